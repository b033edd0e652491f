"""Kernel choice by measurement on the device: a small autotuner (issue 37, item 3).

A deviceless compile proves what runs, not how fast: which tile, stage count or split-K factor of a kernel wins, and
whether it beats XLA's own path at all, depends on the GPU, the shape and the JAX/XLA version. :func:`select` answers
that by timing, once per (op, key) and device kind, and remembers the answer:

* ``op`` names the operation (``"decode_gemm"``), ``key`` the shape class it is asked for (e.g.
  ``{"N": 6144, "K": 4096, "M<=": m_bucket(m), "dtype": "bfloat16"}``; :func:`m_bucket` groups token counts);
* the caller lists :class:`Candidate` s: configurations of its kernels and XLA's path, each a function of the same
  arguments. ``candidates[default]`` is the reference and the fallback: it must be valid everywhere (XLA's path, or
  the configuration the kernel picks without measurement).

Modes (:func:`autotune_mode`), set by ``FP8RL_AUTOTUNE=off|cached|on`` in the environment or by
:func:`set_autotune_mode` (gin ``train.autotune``):

* ``"off"``: always ``candidates[default]``;
* ``"cached"``: a stored result when there is one (the user cache, then the tables shipped in the package), else
  the default; nothing is timed;
* ``"on"`` (default): a stored result for this JAX version that covers every current candidate, else every
  candidate is timed on the device now, the fastest kept and written to the user cache.

Without a CUDA device (:func:`fp8rl_jax.kernels.registry.cuda_device`: a CPU host, a deviceless sm_90a compile), inside a
kernel self-test and inside a tuning run itself (a candidate whose code calls :func:`select` again), :func:`select`
returns the default without looking anything up.

Timing ("on"). In a fresh thread (no trace context of the caller, like the kernel self-tests of
:mod:`fp8rl_jax.kernels.registry`: :func:`select` may be called while a program is being traced) with the CUDA device as
the default device: ``make_args()`` builds the arguments; each candidate is jitted, compiled ahead of time (an
exception: excluded, "compile: ..."), run (excluded on an exception, "run: ..."), compared with the reference's
output (relative Frobenius error over all output leaves, float64, at most ``tolerance``; a different structure,
shape or dtype, a non-finite value or a larger error: excluded, "mismatch: ...") and timed by ``timer(fn, args) ->
seconds per call``. A candidate whose kernel family may not be used (:func:`fp8rl_jax.kernels.registry.use_kernel`
false: its self-test failed, or ``FP8RL_KERNELS=xla``) is excluded before anything runs and never chosen, from a
measurement or a stored table. Exclusions and their reasons are in the stored entry, the progress line and
:func:`report`.

Timers (``FP8RL_AUTOTUNE_TIMER``, or ``timer=``):

* ``"auto"`` (default): :func:`cupti_timer`, falling back to :func:`wall_timer` (one warning) where CUPTI does not
  work (no Mosaic GPU runtime, another CUPTI client such as Nsight Systems attached);
* ``"cupti"``: :func:`cupti_timer`: ``jax.experimental.mosaic.gpu.profiler.measure``, the summed device time of
  the kernels one call launches (CUPTI activity records), reusing the candidate's compiled executable. It leaves
  out host dispatch and the gaps between the kernels of one call;
* ``"wall"``: :func:`wall_timer`: host wall clock around ``jax.block_until_ready`` of one jitted ``fori_loop`` of
  N calls (the arguments and outputs pass through ``lax.optimization_barrier`` so no call is hoisted or removed),
  minus a 1-call run, over N - 1. It includes the gaps between kernels and costs one more compile per candidate.

Persistence, per device kind and JAX version (the layout of tokamax's ``data/autotuning/<device_kind>/<op>.json``
and of vLLM's per-device kernel config files, e.g. ``fused_moe/configs/E=..,device_name=NVIDIA_H100...json``;
facts only):

* the user cache: ``$FP8RL_AUTOTUNE_CACHE/<device_kind>/<jax_version>/<op>.json``, where ``FP8RL_AUTOTUNE_CACHE``
  defaults to ``$XDG_CACHE_HOME/fp8rl_jax/autotuning`` (``~/.cache/fp8rl_jax/autotuning``). Written after each
  tuned key: read, merged, written to a temporary file and ``os.replace`` d, under an ``flock`` of a ``.lock`` file
  beside it, so concurrent processes neither read a partial file nor lose each other's keys;
* the shipped tables: ``fp8rl_jax/kernels/data/autotuning/<device_kind>/<op>.json`` (read-only, package data).

``<device_kind>`` is ``jax.Device.device_kind`` with every character outside ``[A-Za-z0-9._-]`` replaced by ``_``
(``"NVIDIA H100 80GB HBM3"`` -> ``NVIDIA_H100_80GB_HBM3``). One file per op (schema 1)::

    {"schema": 1, "op": "decode_gemm", "device_kind": "NVIDIA H100 80GB HBM3",
     "entries": {"<canonical JSON of key>": {"<jax version>": {
         "key": {...}, "choice": "swapab(...)", "config": {...},
         "timings_us": {"swapab(...)": 12.3, "xla": 40.1}, "configs": {"swapab(...)": {...}, "xla": null},
         "excluded": {"name": "compile: ..."}, "jax_version": "0.10.2", "device_kind": "...",
         "timer": "cupti", "date": "2026-11-28T10:00:00+00:00"}}}}

Lookup order: the user cache (this JAX version), the shipped table (this JAX version), and in ``"cached"`` mode only,
the shipped entry of another JAX version (the newest; its source says so: ``"shipped (jax 0.9.1)"``). From an
entry, the fastest timed candidate that is still offered (same name; same config where one is stored) and allowed is
chosen, so a table outlives a candidate that disappears or a family that fails its self-test.

Bounded: tuning time (compiles included) adds up per process against ``FP8RL_AUTOTUNE_BUDGET_S`` (default 30 s).
Once spent, the key being tuned keeps the candidates timed so far (and is not written to the cache: a later process
finishes it) and every later key gets its default, with one warning. One progress line per tuned key goes to stderr
(or to :func:`set_progress`'s callback), e.g. ``autotune decode_gemm N=6144 K=4096 M<=8: 5 candidates, best
swapab(compute_wgs=2,stages=6,splits=4) 12.3 us (default xla 40.1 us)``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import importlib.resources
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8rl_jax.kernels import registry as _kernels

#: values of ``FP8RL_AUTOTUNE`` / :func:`set_autotune_mode` / gin ``train.autotune``
MODES = ("off", "cached", "on")
ENV_VAR = "FP8RL_AUTOTUNE"
#: the mode when neither :func:`set_autotune_mode` nor ``FP8RL_AUTOTUNE`` says
DEFAULT_MODE = "on"
CACHE_ENV_VAR = "FP8RL_AUTOTUNE_CACHE"
BUDGET_ENV_VAR = "FP8RL_AUTOTUNE_BUDGET_S"
DEFAULT_BUDGET_S = 30.0
TIMER_ENV_VAR = "FP8RL_AUTOTUNE_TIMER"
TIMERS = ("auto", "cupti", "wall")
#: the JSON schema version of the table files
SCHEMA = 1

_SHIPPED_ROOT = importlib.resources.files("fp8rl_jax.kernels") / "data" / "autotuning"

_mode_override: str | None = None
_lock = threading.RLock()  # held while a key is resolved (lookups, tuning, cache writes)
_local = threading.local()  # .tuning: this thread is a tuning run (nested select() -> default)
_memo: dict[tuple, dict] = {}  # (op, canonical key, device kind) -> {"entry", "source"} of this process's tuning
_table_memo: dict[str, tuple] = {}  # path -> ((path, mtime_ns, size), entries): each table file parsed once
_report: dict[tuple[str, str], dict] = {}  # (op, canonical key) -> what select() did, for report()
_spent_s = 0.0
_budget_warned = False
_generation = 0
_warned: set[str] = set()
_progress: Callable[[str], None] | None = None


# -- modes -----------------------------------------------------------------------------------------------------------


def _check_mode(mode: str, source: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{source}={mode!r} is not an autotune mode; expected one of {MODES} (set by "
                         f"{ENV_VAR} or gin train.autotune; off: defaults, cached: stored tables, on: time the rest)")
    return mode


def autotune_mode() -> str:
    """The current mode: :func:`set_autotune_mode`'s, else ``$FP8RL_AUTOTUNE``, else :data:`DEFAULT_MODE`.

    Raises:
      ValueError: ``FP8RL_AUTOTUNE`` holds something other than ``off``/``cached``/``on`` (named).
    """
    if _mode_override is not None:
        return _mode_override
    return _check_mode(os.environ.get(ENV_VAR, DEFAULT_MODE).strip().lower() or DEFAULT_MODE, ENV_VAR)


def set_autotune_mode(mode: str | None) -> None:
    """Set the mode for this process (``None``: back to ``$FP8RL_AUTOTUNE`` / :data:`DEFAULT_MODE`); the trainer
    calls it with gin's ``train.autotune`` before anything is traced.

    Choices already made in this process stay (a compiled program keeps its kernels).

    Raises:
      ValueError: an unknown mode (the message names ``train.autotune`` and ``FP8RL_AUTOTUNE``).
    """
    global _mode_override, _generation
    _mode_override = None if mode is None else _check_mode(str(mode).strip().lower(), "train.autotune")
    _generation += 1


@contextlib.contextmanager
def autotune_mode_scope(mode: str):
    """Context manager: :func:`set_autotune_mode` ``mode`` inside, the previous setting restored after."""
    global _mode_override
    prev = _mode_override
    set_autotune_mode(mode)
    try:
        yield
    finally:
        _mode_override = prev


def budget_s() -> float:
    """The tuning budget of this process in seconds (``$FP8RL_AUTOTUNE_BUDGET_S``, default 30).

    Raises:
      ValueError: ``FP8RL_AUTOTUNE_BUDGET_S`` is not a number >= 0 (named).
    """
    raw = os.environ.get(BUDGET_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{BUDGET_ENV_VAR}={raw!r} is not a number of seconds >= 0")
    return value


def spent_s() -> float:
    """Seconds this process has spent tuning on the device (compiling, checking and timing candidates): what the
    budget (:func:`budget_s`) is charged. Tuning runs inside the trace of the first program that uses a key, so a
    first-call time less this (and less :func:`fp8rl_jax.kernels.registry.selftest_seconds`) is the compile
    (``benchmarks/bench_rollout.py``'s ``first_call_compile_s``). 0.0 without a GPU or with ``FP8RL_AUTOTUNE=off``."""
    with _lock:
        return _spent_s


def set_progress(callback: Callable[[str], None] | None) -> None:
    """Send each progress line (one per tuned key) to ``callback`` instead of stderr (None: stderr again)."""
    global _progress
    _progress = callback


def generation() -> int:
    """A counter :func:`reset` and :func:`set_autotune_mode` advance: part of the cache key of a jitted function
    whose trace asks the tuner (:func:`fp8rl_jax.fp8.linear.w8a8_block_matmul`), so a reset retraces it."""
    return _generation


def reset() -> None:
    """Forget this process's choices, report, spent budget and one-time warnings (tests; a new engine config)."""
    global _spent_s, _budget_warned, _generation
    _generation += 1
    with _lock:
        _memo.clear()
        _table_memo.clear()
        _report.clear()
        _warned.clear()
        _spent_s = 0.0
        _budget_warned = False


# -- keys, paths, tables ---------------------------------------------------------------------------------------------


def m_bucket(m: int) -> int:
    """The token-count bucket of ``m``: the smallest power of two >= ``m`` (1, 2, 4, 8, 16, 32, 64, 128, ...), so
    ``M <= m_bucket(m)`` names the tuned shape class.

    Raises:
      ValueError: ``m`` is not an int >= 1.
    """
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"m_bucket takes a token count >= 1, got {m!r}")
    return 1 << (int(m) - 1).bit_length()


def _json_value(name: str, v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(name, x) for x in v]
    try:
        return np.dtype(v).name  # numpy / jnp / ml_dtypes dtypes and scalar types
    except TypeError:
        raise TypeError(f"autotune key {name!r} = {v!r} is not JSON data (use ints, floats, str, bools, dtypes, "
                        "or lists of them)") from None


def canonical_key(key: Mapping[str, Any]) -> str:
    """The canonical JSON of ``key`` (sorted names, no spaces; dtypes as their names): its name in the tables.

    Raises:
      TypeError: ``key`` is not a mapping with str names and JSON-like values (named).
    """
    if not isinstance(key, Mapping):
        raise TypeError(f"autotune key must be a mapping of str to JSON values, got {type(key).__name__}")
    out = {}
    for k, v in key.items():
        if not isinstance(k, str):
            raise TypeError(f"autotune key names must be str, got {k!r}")
        out[k] = _json_value(k, v)
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def sanitize_device_kind(kind: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3"``: a directory name (``[A-Za-z0-9._-]`` only)."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", str(kind)).strip("_")
    return s or "unknown"


def cache_root() -> Path:
    """The user cache's root: ``$FP8RL_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME/fp8rl_jax/autotuning``, else
    ``~/.cache/fp8rl_jax/autotuning``."""
    env = os.environ.get(CACHE_ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fp8rl_jax" / "autotuning"


def user_cache_path(op: str, device_kind: str, jax_version: str | None = None) -> Path:
    """``<cache_root()>/<device_kind>/<jax_version>/<op>.json`` (``jax_version`` default: this process's)."""
    return cache_root() / sanitize_device_kind(device_kind) / (jax_version or jax.__version__) / f"{op}.json"


def shipped_table_path(op: str, device_kind: str):
    """``fp8rl_jax/kernels/data/autotuning/<device_kind>/<op>.json`` in the installed package (may not exist)."""
    return _SHIPPED_ROOT / sanitize_device_kind(device_kind) / f"{op}.json"


def _warn_once(tag: str, msg: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _read_table(path, op: str) -> dict:
    """The ``entries`` of a table file ({} when missing; a corrupt file warns once and reads as empty). Parsed
    once per (path, mtime, size) in this process."""
    try:
        st = os.stat(path) if isinstance(path, (str, os.PathLike)) else None
    except OSError:
        return {}
    sig = (str(path), st.st_mtime_ns, st.st_size) if st is not None else None
    if sig is not None and _table_memo.get(str(path), (None,))[0] == sig:
        return _table_memo[str(path)][1]
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        _warn_once(f"read:{path}", f"fp8rl autotune: cannot read {path} ({e}); ignoring it")
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
            raise ValueError(f"not an autotune table of schema {SCHEMA}")
        if data.get("op", op) != op:
            raise ValueError(f"it holds op {data.get('op')!r}, not {op!r}")
    except ValueError as e:
        _warn_once(f"read:{path}", f"fp8rl autotune: ignoring {path}: {e}")
        return {}
    if sig is not None:
        _table_memo[str(path)] = (sig, data["entries"])
    return data["entries"]


def _write_entry(path: Path, op: str, device_kind: str, ckey: str, entry: dict) -> None:
    """Merge ``entry`` into the table at ``path`` atomically (flock + tmp file + os.replace).

    Raises:
      OSError: the directory or file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+") as lock:
        try:
            import fcntl

            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock (Windows, some network file systems): replace is still atomic
            pass
        entries = json.loads(json.dumps(_read_table(path, op)))  # a copy: the parsed tables are shared
        entries.setdefault(ckey, {})[entry["jax_version"]] = entry
        data = {"schema": SCHEMA, "op": op, "device_kind": device_kind, "entries": entries}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def export_table(op: str, device_kind: str, out_root) -> Path | None:
    """Write the table to ship for ``op`` on ``device_kind``: ``<out_root>/<device_kind>/<op>.json``, the shipped
    table's entries (:func:`shipped_table_path`) with this process's user-cache entries (:func:`user_cache_path`,
    this JAX version) merged over them, in the shipped tables' schema. What a GPU run's autotune stage
    (``benchmarks/autotune_sweep.py``) leaves to be copied into ``fp8rl_jax/kernels/data/autotuning/``.

    Returns:
      the path written, or None when the user cache holds no entry for ``op`` (nothing was tuned).

    Raises:
      OSError: ``out_root`` cannot be written.
    """
    user = _read_table(user_cache_path(op, device_kind), op)
    if not user:
        return None
    out = Path(out_root) / sanitize_device_kind(device_kind) / f"{op}.json"
    with _lock:
        for table in (_read_table(shipped_table_path(op, device_kind), op), user):
            for ckey, versions in sorted(table.items()):
                for ver, entry in sorted(versions.items()):
                    if isinstance(entry, dict):  # filed under its version's key, as select() reads it
                        _write_entry(out, op, device_kind, ckey, dict(entry, jax_version=ver))
    return out


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", v))


# -- candidates ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to compute an op.

    Attributes:
      name: unique among the candidates of a call, stable across versions (the tables' name for it), e.g.
        ``"swapab(compute_wgs=2,stages=6,splits=4)"`` or ``"xla"``.
      config: the tuning configuration (a dataclass instance, stored as ``dataclasses.asdict``; or JSON data; or
        None). A stored entry whose config for this name differs is stale for it.
      run: ``run(*args) -> array`` (or a pytree of arrays), traceable; the tuner jits it.
      family: the :data:`fp8rl_jax.kernels.registry.FAMILIES` kernel family it runs, or None (XLA's path): a candidate
        of a family :func:`fp8rl_jax.kernels.registry.use_kernel` refuses (failed self-test, ``FP8RL_KERNELS=xla``) is
        never chosen.
    """

    name: str
    config: Any
    run: Callable
    family: str | None = None


def _config_json(config):
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    try:
        return json.loads(json.dumps(config, sort_keys=True, default=str))
    except (TypeError, ValueError):
        return repr(config)


def _family_refusal(c: Candidate) -> str | None:
    """Why ``c``'s kernel family may not be used in this process (None: it may)."""
    if c.family is None or _kernels.use_kernel(c.family):
        return None
    if _kernels.kernel_mode() == "xla":
        return f"family {c.family}: {_kernels.ENV_VAR}=xla"
    err = _kernels.selftest_failures().get(c.family)
    return f"family {c.family}: self-test failed" + (f" ({err})" if err else "")


#: exclusion reasons that hold for the device kind and JAX version (a stored one counts as measured); the others
#: (a refused family, a timing failure, the budget) belong to one process and are measured again in "on" mode
_LASTING_EXCLUSIONS = ("compile:", "run:", "mismatch:")


def _pick_from_entry(entry: dict, candidates: Sequence[Candidate], refused: Mapping[str, str]):
    """(index of the fastest usable candidate the entry timed, or None; whether the entry covers every candidate:
    each is timed or excluded for a lasting reason, with the same config)."""
    timings = entry.get("timings_us") or {}
    configs = entry.get("configs") or {}
    excluded = entry.get("excluded") or {}
    best, best_t, covered = None, math.inf, True
    for i, c in enumerate(candidates):
        if c.name in configs and configs[c.name] is not None and configs[c.name] != _config_json(c.config):
            covered = False  # the name now means another configuration: its measurement is stale
            continue
        t = timings.get(c.name)
        if t is None:
            covered = covered and str(excluded.get(c.name, "")).startswith(_LASTING_EXCLUSIONS)
            continue
        if c.name in refused or not isinstance(t, (int, float)) or not math.isfinite(t):
            continue
        if t < best_t:
            best, best_t = i, float(t)
    return best, covered


# -- timers ----------------------------------------------------------------------------------------------------------


def timing_loop(fn: Callable, args: tuple) -> Callable:
    """The jitted ``loop(n, args)`` that :func:`wall_timer` times: ``n`` dependent calls of ``fn(*args)`` in one
    ``fori_loop`` (``n`` a traced int32), returning one element of each output leaf."""
    out_shape = jax.eval_shape(fn, *args)

    def loop(n, args):
        def body(i, prev):
            a, _ = lax.optimization_barrier((args, prev))
            return fn(*a)

        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
        out = lax.fori_loop(0, n, body, init)
        return jax.tree.map(lambda x: x.ravel()[:1], out)  # keeps every call live, returns a few bytes

    return jax.jit(loop)


def wall_timer(fn: Callable, args: tuple, *, target_s: float = 0.02, max_iters: int = 10_000,
               repeats: int = 3) -> float:
    """Seconds per call of ``fn(*args)``: host wall clock around ``jax.block_until_ready`` of one jitted
    ``fori_loop`` of ``n`` calls, ``(t(n) - t(1)) / (n - 1)`` (the fixed dispatch and sync cost cancels), best of
    ``repeats``, ``n`` chosen so ``t(n)`` is about ``target_s``.

    The loop carries the output; each call's arguments pass through ``lax.optimization_barrier`` together with the
    previous output, so the calls depend on each other and XLA can neither hoist one out of the loop nor remove it
    (checked on XLA:GPU with the deviceless sm_90a compile: the GEMM stays in the loop body, no argument is
    copied). XLA:CPU drops optimization barriers before its loop optimizations, so on a CPU this measures only the
    loop: it is a GPU timer.

    Raises:
      whatever compiling or running ``fn`` raises.
    """
    looped = timing_loop(fn, args)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(looped(np.int32(n), args))
        return time.perf_counter() - t0

    run(1)  # compile and warm up
    t1 = min(run(1) for _ in range(2))
    n = int(min(max_iters, max(10, round(target_s / max(t1, 1e-7)))))
    tn = min(run(n) for _ in range(repeats))
    t1 = min(t1, run(1))
    per_call = (tn - t1) / (n - 1)
    return per_call if per_call > 0 else tn / n


def cupti_timer(fn: Callable, args: tuple, *, iterations: int = 20) -> float:
    """Seconds per call of ``fn(*args)``: the median over ``iterations`` calls of the summed device time of the
    kernels one call launches, by ``jax.experimental.mosaic.gpu.profiler.measure`` (CUPTI). ``fn`` is a jitted
    function (its compiled executable is reused).

    Raises:
      RuntimeError: CUPTI does not work here (no Mosaic GPU runtime, a CPU device, another CUPTI client) or ``fn``
        launched no kernel.
    """
    from jax.experimental.mosaic.gpu import profiler

    _, times_ms = profiler.measure(fn, iterations=iterations)(*args)
    if times_ms is None:
        raise RuntimeError("CUPTI recorded no kernel launch")
    times_ms = times_ms if isinstance(times_ms, list) else [times_ms]
    return float(np.median(times_ms)) * 1e-3


def _auto_timer(fn: Callable, args: tuple) -> float:
    """:func:`cupti_timer`, or :func:`wall_timer` (warned once) where CUPTI does not work."""
    if "cupti-broken" not in _warned:
        try:
            return cupti_timer(fn, args)
        except Exception as e:  # noqa: BLE001 - any CUPTI failure: time by the wall clock instead
            _warned.add("cupti-broken")
            warnings.warn(f"fp8rl autotune: CUPTI timing does not work here ({type(e).__name__}: "
                          f"{str(e).strip()[:200]}); timing by the wall clock of a jitted loop instead",
                          RuntimeWarning, stacklevel=2)
    return wall_timer(fn, args)


def _default_timer() -> tuple[Callable, str]:
    name = os.environ.get(TIMER_ENV_VAR, "auto").strip().lower() or "auto"
    if name not in TIMERS:
        raise ValueError(f"{TIMER_ENV_VAR}={name!r} is not an autotune timer; expected one of {TIMERS}")
    return {"auto": _auto_timer, "cupti": cupti_timer, "wall": wall_timer}[name], name


# -- tuning ----------------------------------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    """``Type: first line`` of an exception (`` ... last line`` added when there are more: a wrapped traceback)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0][:300] if lines else ""
    if len(lines) > 1:
        text += f" ... {lines[-1][:200]}"
    return f"{type(e).__name__}: {text}".rstrip(": ")


def _relative_error(out, ref) -> tuple[float | None, str | None]:
    """(relative Frobenius error of ``out`` against ``ref`` over all leaves, or None; why not comparable)."""
    out_leaves, out_tree = jax.tree.flatten(out)
    ref_leaves, ref_tree = jax.tree.flatten(ref)
    if out_tree != ref_tree:
        return None, f"output structure {out_tree} != the reference's {ref_tree}"
    num = den = 0.0
    for o, r in zip(out_leaves, ref_leaves):
        if o.shape != r.shape or o.dtype != r.dtype:
            return None, f"output {o.dtype}{list(o.shape)} != the reference's {r.dtype}{list(r.shape)}"
        o64, r64 = np.asarray(o).astype(np.float64), np.asarray(r).astype(np.float64)
        if not np.all(np.isfinite(o64)):
            return None, "non-finite output"
        num += float(np.sum((o64 - r64) ** 2))
        den += float(np.sum(r64 ** 2))
    return (math.sqrt(num / den) if den > 0 else math.sqrt(num)), None


def _describe(op: str, key: Mapping[str, Any]) -> str:
    parts = []
    for k, v in key.items():
        parts.append(f"{k}{v}" if k.endswith(("=", "<", ">")) else f"{k}={v}")
    return " ".join([op] + parts)


def _emit(line: str) -> None:
    if _progress is not None:
        _progress(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _tune(op: str, key: Mapping[str, Any], candidates: Sequence[Candidate], make_args: Callable[[], tuple],
          default: int, refused: Mapping[str, str], dev, timer: Callable, timer_name: str, tolerance: float,
          deadline: float) -> dict:
    """Time the candidates on ``dev`` (in this thread); returns the entry (``"complete"``: False when the budget
    ran out before every candidate was timed)."""
    timings: dict[str, float] = {}
    excluded: dict[str, str] = dict(refused)
    complete = True
    args = tuple(make_args())
    # the reference: the default, else the first usable candidate of XLA's path, else the first usable one
    order = [default] + [i for i in range(len(candidates)) if i != default]
    usable = [i for i in order if candidates[i].name not in refused]
    ref_idx = next((i for i in usable if i == default or candidates[i].family is None), usable[0] if usable else None)
    ref = None
    for i in ([ref_idx] if ref_idx is not None else []) + [i for i in usable if i != ref_idx]:
        c = candidates[i]
        if time.monotonic() > deadline and timings:
            excluded[c.name] = "not timed: autotune budget spent"
            complete = False
            continue
        if i != ref_idx and ref is None:
            excluded[c.name] = f"not compared: the reference {candidates[ref_idx].name} failed"
            complete = False
            continue
        jitted = jax.jit(c.run)
        try:
            compiled = jitted.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is excluded, not fatal
            excluded[c.name] = f"compile: {_first_line(e)}"
            continue
        try:
            out = jax.block_until_ready(compiled(*args))
        except Exception as e:  # noqa: BLE001
            excluded[c.name] = f"run: {_first_line(e)}"
            continue
        if i == ref_idx:
            ref = out
        else:
            err, why = _relative_error(out, ref)
            if why is not None:
                excluded[c.name] = f"mismatch: {why}"
                continue
            if not err <= tolerance:
                excluded[c.name] = (f"mismatch: relative error {err:.3g} > {tolerance:g} against "
                                    f"{candidates[ref_idx].name}")
                continue
        try:
            t = float(timer(jitted, args))
        except Exception as e:  # noqa: BLE001
            excluded[c.name] = f"timing: {_first_line(e)}"
            continue
        if not (math.isfinite(t) and t > 0):
            excluded[c.name] = f"timing: the timer returned {t!r}"
            continue
        timings[c.name] = t * 1e6
    best = min(timings, key=timings.get) if timings else None
    cand = {c.name: c for c in candidates}
    return {
        "key": json.loads(canonical_key(key)),
        "choice": best,
        "config": _config_json(cand[best].config) if best is not None else None,
        "timings_us": {k: round(v, 3) for k, v in sorted(timings.items(), key=lambda kv: kv[1])},
        "configs": {n: _config_json(cand[n].config) for n in timings},
        "excluded": excluded,
        "jax_version": jax.__version__,
        "device_kind": str(dev.device_kind),
        "timer": timer_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "complete": complete,
    }


def _in_thread(fn: Callable, dev):
    """``fn()`` in a fresh thread marked as a tuning run, with ``dev`` as the default device where it is a real
    ``jax.Device`` (a stand-in object only supplies its ``device_kind``: tests)."""

    def run():
        _local.tuning = True
        ctx = jax.default_device(dev) if isinstance(dev, jax.Device) else contextlib.nullcontext()
        with ctx:
            return fn()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _lookup(op: str, ckey: str, device_kind: str, any_version: bool) -> list[tuple[dict, str]]:
    """The stored entries for (op, key) with their sources, in the lookup order of the module docstring: the user
    cache and the shipped table for this JAX version, then (``any_version``) the shipped ones of other versions,
    newest first."""
    ver = jax.__version__
    found = []
    user = _read_table(user_cache_path(op, device_kind), op).get(ckey)
    user = user if isinstance(user, dict) else {}
    if isinstance(user.get(ver), dict):
        found.append((user[ver], "user cache"))
    shipped = _read_table(shipped_table_path(op, device_kind), op).get(ckey)
    shipped = shipped if isinstance(shipped, dict) else {}
    if isinstance(shipped.get(ver), dict):
        found.append((shipped[ver], "shipped"))
    if any_version:
        others = sorted((v for v in shipped if v != ver and isinstance(shipped[v], dict)), key=_version_tuple)
        found += [(shipped[v], f"shipped (jax {v})") for v in reversed(others)]
    return found


def select(op: str, key: Mapping[str, Any], candidates: Sequence[Candidate], make_args: Callable[[], tuple], *,
           default: int = 0, timer: Callable | None = None, device=None, tolerance: float = 1e-2) -> Candidate:
    """The candidate to use for ``op`` at ``key`` on this process's CUDA device (see the module docstring).

    Args:
      op: the operation's name (a file name: ``[A-Za-z0-9._-]``), e.g. ``"decode_gemm"``.
      key: the shape class, JSON-like values (e.g. ``{"N": 6144, "K": 4096, "M<=": m_bucket(m)}``); a name ending
        in ``=``, ``<`` or ``>`` is printed without another ``=``.
      candidates: the ways to compute it, unique names.
      make_args: builds the arguments of every candidate's ``run`` (called once per tuning, in the tuning thread,
        on the device: concrete arrays, never the caller's tracers).
      default: index of the reference and fallback candidate.
      timer: ``timer(jitted_fn, args) -> seconds per call``; None = ``$FP8RL_AUTOTUNE_TIMER`` (module docstring).
      device: the device to tune on; None = :func:`fp8rl_jax.kernels.registry.cuda_device`.
      tolerance: the largest relative Frobenius error against the reference's output that a candidate may have.

    Returns:
      one of ``candidates``.

    Raises:
      ValueError: no candidates, a duplicate name, ``default`` out of range, a bad ``op`` name, a bad
        ``FP8RL_AUTOTUNE`` / ``FP8RL_AUTOTUNE_BUDGET_S`` / ``FP8RL_AUTOTUNE_TIMER``.
      TypeError: ``key`` is not JSON-like data.
    A failure while tuning (``make_args`` raising, every candidate excluded, a cache that cannot be written) is a
    warning and the default, not an exception.
    """
    global _spent_s, _budget_warned
    candidates = list(candidates)
    if not candidates:
        raise ValueError(f"autotune {op}: no candidates")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"autotune {op}: duplicate candidate names {sorted({n for n in names if names.count(n) > 1})}")
    if not 0 <= default < len(candidates):
        raise ValueError(f"autotune {op}: default={default} is not an index of the {len(candidates)} candidates")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", op):
        raise ValueError(f"autotune op name {op!r} must be a file name ([A-Za-z0-9._-])")
    ckey = canonical_key(key)
    mode = autotune_mode()
    fallback = candidates[default]

    def note(source: str, chosen: Candidate, entry: dict | None = None) -> Candidate:
        _report[(op, ckey)] = {"op": op, "key": json.loads(ckey), "choice": chosen.name, "source": source,
                               "timings_us": dict((entry or {}).get("timings_us") or {}),
                               "excluded": dict((entry or {}).get("excluded") or {})}
        return chosen

    if mode == "off":
        return note("default: autotune off", fallback)
    if getattr(_local, "tuning", False) or getattr(_kernels._selftest_thread, "active", False):
        return fallback  # a call made by a candidate being tuned, or by a kernel self-test: no report either
    dev = device if device is not None else _kernels.cuda_device()
    if dev is None:
        return note("default: no CUDA device", fallback)
    device_kind = str(dev.device_kind)

    with _lock:
        refused = {c.name: why for c in candidates if (why := _family_refusal(c)) is not None}

        def stored(any_version: bool, need_cover: bool, suffix: str = "") -> Candidate | None:
            """The fastest usable candidate of the first stored entry that has one (memo first), noted."""
            memo = _memo.get((op, ckey, device_kind))
            entries = ([(memo["entry"], memo["source"])] if memo else []) + _lookup(op, ckey, device_kind,
                                                                                  any_version)
            for entry, source in entries:
                idx, covered = _pick_from_entry(entry, candidates, refused)
                if idx is None or (need_cover and not covered):
                    continue
                if not any_version and source.startswith("shipped (jax"):
                    continue
                merged = dict(entry, excluded={**(entry.get("excluded") or {}), **refused})
                return note(source + suffix, candidates[idx], merged)
            return None

        if mode == "cached":
            return stored(any_version=True, need_cover=False) or note("default: not cached", fallback)
        hit = stored(any_version=False, need_cover=True)
        if hit is not None:
            return hit
        if len(refused) == len(candidates):
            return note("default: every candidate refused", fallback, {"excluded": refused})

        limit = budget_s()
        if _spent_s >= limit:
            if not _budget_warned:
                _budget_warned = True
                warnings.warn(f"fp8rl autotune: the tuning budget of {limit:g} s ({BUDGET_ENV_VAR}) is spent; "
                              f"{_describe(op, key)} and every later untuned key use a stored result for another JAX "
                              "version or candidate set where there is one, else their default candidate",
                              RuntimeWarning, stacklevel=2)
            return (stored(any_version=True, need_cover=False, suffix=" (budget spent)")
                    or note("default: autotune budget spent", fallback))
        if timer is None:
            timer, timer_name = _default_timer()
        else:
            timer_name = getattr(timer, "__name__", type(timer).__name__)
        desc = _describe(op, key)
        t0 = time.monotonic()
        try:
            entry = _in_thread(lambda: _tune(op, key, candidates, make_args, default, refused, dev, timer,
                                             timer_name, tolerance, t0 + (limit - _spent_s)), dev)
        except Exception as e:  # noqa: BLE001 - a broken tuning run must not stop the program: default, warned
            warnings.warn(f"fp8rl autotune: tuning {desc} failed ({_first_line(e)}); using {fallback.name}",
                          RuntimeWarning, stacklevel=2)
            return note("default: tuning failed", fallback)
        finally:
            _spent_s += time.monotonic() - t0
        if timer_name == "auto":
            entry["timer"] = "wall" if "cupti-broken" in _warned else "cupti"
        complete = entry.pop("complete")
        timings, excluded = entry["timings_us"], entry["excluded"]
        if entry["choice"] is None:
            warnings.warn(f"fp8rl autotune: every candidate of {desc} was excluded ({excluded}); using "
                          f"{fallback.name}", RuntimeWarning, stacklevel=2)
            return note("default: every candidate excluded", fallback, entry)
        best = entry["choice"]
        line = f"autotune {desc}: {len(candidates)} candidates, best {best} {timings[best]:.1f} us"
        if best != fallback.name:
            line += (f" (default {fallback.name} {timings[fallback.name]:.1f} us)" if fallback.name in timings
                     else f" (default {fallback.name} excluded)")
        if excluded:
            line += f"; excluded: {', '.join(f'{n} ({why})' for n, why in excluded.items())}"
        if not complete:
            line += "; not every candidate was timed (not cached)"
        _emit(line)
        if complete:
            path = user_cache_path(op, device_kind)
            try:
                _write_entry(path, op, device_kind, ckey, entry)
            except OSError as e:
                _warn_once(f"write:{path}", f"fp8rl autotune: cannot write the cache {path} ({e}); the choices of "
                           f"this process are not kept ({CACHE_ENV_VAR} sets another directory)")
        _memo[(op, ckey, device_kind)] = {"entry": entry, "source": "tuned" if complete else "tuned (partial)"}
        return note("tuned" if complete else "tuned (partial)", candidates[names.index(best)], entry)


def report() -> list[dict]:
    """What :func:`select` chose in this process, one dict per (op, key): ``op``, ``key``, ``choice``, ``source``
    (``"tuned"``, ``"user cache"``, ``"shipped"``, ``"shipped (jax X)"`` or ``"default: <why>"``), ``timings_us``
    and ``excluded`` (name -> reason), for a run's summary and notes."""
    with _lock:
        return [json.loads(json.dumps(r)) for r in _report.values()]


def format_report() -> str:
    """:func:`report` as text, one line per (op, key) ("" when nothing was selected)."""
    lines = []
    for r in report():
        line = f"{_describe(r['op'], r['key'])}: {r['choice']} [{r['source']}]"
        if r["choice"] in r["timings_us"]:
            line += f" {r['timings_us'][r['choice']]:.1f} us"
        if r["excluded"]:
            line += f"; excluded: {', '.join(f'{n} ({why})' for n, why in r['excluded'].items())}"
        lines.append(line)
    return "\n".join(lines)


__all__ = ["MODES", "ENV_VAR", "DEFAULT_MODE", "CACHE_ENV_VAR", "BUDGET_ENV_VAR", "TIMER_ENV_VAR", "TIMERS",
           "Candidate", "autotune_mode", "set_autotune_mode", "autotune_mode_scope", "budget_s", "spent_s",
           "set_progress", "generation", "reset", "m_bucket", "canonical_key", "sanitize_device_kind", "cache_root",
           "user_cache_path", "shipped_table_path", "export_table", "timing_loop", "wall_timer", "cupti_timer",
           "select", "report", "format_report"]
