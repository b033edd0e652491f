"""Issue 37, item 3: the kernel autotuner (:mod:`fp8rl_jax.kernels.tuner`) on the CPU.

The GPU path runs with a stand-in device (``cuda_device`` patched to an object with a ``device_kind``): candidates
run on the CPU and an injected timer returns each candidate's set time, so the choice logic, the exclusions, the
modes, the cache keys, the persistence and the budget are tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.kernels import registry
from fp8rl_jax.kernels import tuner
from fp8rl_jax.kernels.tuner import Candidate

H100 = "NVIDIA H100 80GB HBM3"
KEY = {"N": 64, "K": 128, "M<=": 8}


class FakeGPU:
    device_kind = H100


@dataclasses.dataclass(frozen=True)
class Cfg:
    stages: int
    splits: int


def _run(t_us: float, fn=lambda x: x * 2.0):
    """A candidate's run function carrying the time the fake timer reports for it."""

    def run(x):
        return fn(x)

    run.t_us = t_us
    return run


class FakeTimer:
    """``timer(fn, args)``: the set time of the candidate behind the jitted ``fn``; counts calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, fn, args):
        self.calls.append(fn.__wrapped__)
        return fn.__wrapped__.t_us * 1e-6


def _args():
    return (jnp.arange(1.0, 9.0, dtype=jnp.float32),)


def _never():
    raise AssertionError("make_args must not be called: nothing is timed here")


def _never_timer(fn, args):
    raise AssertionError("nothing is timed here")


def _three():
    return [Candidate("xla", None, _run(40.0)),
            Candidate("swapab(stages=6,splits=4)", Cfg(6, 4), _run(12.0), family="decode_gemm"),
            Candidate("swapab(stages=4,splits=2)", Cfg(4, 2), _run(20.0), family="decode_gemm")]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A fresh tuner: its own cache and shipped directories, mode from a clean environment, progress captured."""
    monkeypatch.setenv(tuner.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(tuner, "_SHIPPED_ROOT", tmp_path / "shipped")
    for var in (tuner.ENV_VAR, tuner.BUDGET_ENV_VAR, tuner.TIMER_ENV_VAR, registry.ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    tuner.set_autotune_mode(None)
    registry.set_kernel_mode(None)
    tuner.reset()
    lines: list[str] = []
    tuner.set_progress(lines.append)
    yield lines
    tuner.set_progress(None)
    tuner.set_autotune_mode(None)
    tuner.reset()


@pytest.fixture
def gpu(monkeypatch):
    """The stand-in CUDA device; the decode_gemm family's self-test counts as passed."""
    monkeypatch.setattr(registry, "cuda_device", lambda: FakeGPU())
    monkeypatch.setitem(registry._results, "decode_gemm", True)
    return FakeGPU()


def _user_file(op="decode_gemm"):
    return tuner.user_cache_path(op, H100)


def _write_table(path, entries: dict, op="decode_gemm"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": 1, "op": op, "device_kind": H100, "entries": entries}))


def _entry(timings: dict, version: str | None = None, configs: dict | None = None, excluded: dict | None = None):
    best = min(timings, key=timings.get)
    return {"choice": best, "config": None, "timings_us": timings, "configs": configs or {},
            "excluded": excluded or {}, "jax_version": version or jax.__version__, "date": "2026-01-01"}


# -- modes, keys, paths ----------------------------------------------------------------------------------------------


def test_modes_from_env_setter_and_named_errors(monkeypatch):
    assert tuner.autotune_mode() == "on"
    monkeypatch.setenv(tuner.ENV_VAR, " Cached ")
    assert tuner.autotune_mode() == "cached"
    with tuner.autotune_mode_scope("off"):
        assert tuner.autotune_mode() == "off"
    assert tuner.autotune_mode() == "cached"
    monkeypatch.setenv(tuner.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"FP8RL_AUTOTUNE='fast' is not an autotune mode"):
        tuner.autotune_mode()
    with pytest.raises(ValueError, match=r"train.autotune='always' is not an autotune mode.*FP8RL_AUTOTUNE"):
        tuner.set_autotune_mode("always")
    tuner.set_autotune_mode("off")  # the setter wins over the environment
    assert tuner.autotune_mode() == "off"
    monkeypatch.setenv(tuner.BUDGET_ENV_VAR, "soon")
    with pytest.raises(ValueError, match="FP8RL_AUTOTUNE_BUDGET_S='soon'"):
        tuner.budget_s()


def test_train_autotune_knob():
    from fp8rl_jax.trainer.config import TrainConfig

    assert TrainConfig().autotune is None
    assert TrainConfig(autotune="cached").autotune == "cached"
    with pytest.raises(ValueError, match=r"train.autotune='fast' is not one of \[None, 'off', 'cached', 'on'\]"):
        TrainConfig(autotune="fast")


def test_m_bucket_powers_of_two():
    assert [tuner.m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64, 128]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="token count >= 1"):
            tuner.m_bucket(bad)


def test_cache_keys_and_paths(monkeypatch, tmp_path):
    assert tuner.canonical_key({"N": 6144, "K": 4096, "dtype": jnp.bfloat16}) == \
        tuner.canonical_key({"dtype": np.dtype(jnp.bfloat16), "K": np.int64(4096), "N": 6144}) == \
        '{"K":4096,"N":6144,"dtype":"bfloat16"}'
    assert tuner.canonical_key({"shape": (8, 128)}) == '{"shape":[8,128]}'
    with pytest.raises(TypeError, match="autotune key 'f' .* is not JSON data"):
        tuner.canonical_key({"f": object()})
    assert tuner.sanitize_device_kind("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert tuner.sanitize_device_kind("NVIDIA H200 / (SXM)") == "NVIDIA_H200_SXM"
    # the user cache: per device kind and JAX version, under $FP8RL_AUTOTUNE_CACHE ...
    assert tuner.user_cache_path("decode_gemm", H100, "0.10.2") == \
        tmp_path / "cache" / "NVIDIA_H100_80GB_HBM3" / "0.10.2" / "decode_gemm.json"
    assert tuner.user_cache_path("decode_gemm", H100).parent.name == jax.__version__
    # ... else ~/.cache/fp8rl_jax/autotuning (XDG_CACHE_HOME when set)
    monkeypatch.delenv(tuner.CACHE_ENV_VAR)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuner.cache_root() == tmp_path / "home" / ".cache" / "fp8rl_jax" / "autotuning"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuner.cache_root() == tmp_path / "xdg" / "fp8rl_jax" / "autotuning"
    # the shipped tables: per device kind, in the package
    assert tuner.shipped_table_path("decode_gemm", H100) == tmp_path / "shipped" / "NVIDIA_H100_80GB_HBM3" / \
        "decode_gemm.json"


def test_package_ships_tables_folder_without_invented_entries():
    """The shipped folder exists (README) and holds only well-formed tables (none yet: no GPU run has made one)."""
    import importlib.resources

    root = importlib.resources.files("fp8rl_jax.kernels") / "data" / "autotuning"
    assert (root / "README.md").is_file()
    for path in root.rglob("*.json") if hasattr(root, "rglob") else ():
        data = json.loads(path.read_text())
        assert data["schema"] == tuner.SCHEMA and data["op"] == path.stem
        for per_version in data["entries"].values():
            for entry in per_version.values():
                assert entry["choice"] in entry["timings_us"] and entry["date"] and entry["jax_version"]


def test_select_argument_errors(gpu):
    with pytest.raises(ValueError, match="no candidates"):
        tuner.select("decode_gemm", KEY, [], _args)
    with pytest.raises(ValueError, match=r"duplicate candidate names \['a'\]"):
        tuner.select("decode_gemm", KEY, [Candidate("a", None, _run(1)), Candidate("a", None, _run(2))], _args)
    with pytest.raises(ValueError, match="default=3 is not an index"):
        tuner.select("decode_gemm", KEY, _three(), _args, default=3)
    with pytest.raises(ValueError, match="must be a file name"):
        tuner.select("decode/gemm", KEY, _three(), _args)


# -- when nothing is timed -------------------------------------------------------------------------------------------


def test_no_cuda_device_gives_default_without_timing(monkeypatch, isolated):
    monkeypatch.setattr(registry, "cuda_device", lambda: None)
    cands = _three()
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[0]
    assert tuner.select("decode_gemm", KEY, cands, _never, default=2, timer=_never_timer) is cands[2]
    assert isolated == [] and not _user_file().exists()
    assert tuner.report()[0]["source"] == "default: no CUDA device"


def test_off_mode_gives_default(gpu, isolated):
    tuner.set_autotune_mode("off")
    stored = _entry({"xla": 40.0, "swapab(stages=6,splits=4)": 1.0})
    _write_table(_user_file(), {tuner.canonical_key(KEY): {jax.__version__: stored}})
    cands = _three()
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[0]
    assert tuner.report()[0]["source"] == "default: autotune off"


def test_inside_a_kernel_selftest_gives_default(gpu):
    cands = _three()
    result = []

    def in_selftest():
        registry._selftest_thread.active = True
        result.append(tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer))

    t = threading.Thread(target=in_selftest)
    t.start()
    t.join()
    assert result == [cands[0]]


# -- tuning ----------------------------------------------------------------------------------------------------------


def test_fastest_wins_is_persisted_and_reused(gpu, isolated):
    timer = FakeTimer()
    cands = _three()
    chosen = tuner.select("decode_gemm", KEY, cands, _args, timer=timer)
    assert chosen is cands[1]
    assert len(timer.calls) == 3 and timer.calls[0] is cands[0].run  # the reference is run first
    assert isolated == ["autotune decode_gemm N=64 K=128 M<=8: 3 candidates, best swapab(stages=6,splits=4) 12.0 us "
                        "(default xla 40.0 us)"]
    data = json.loads(_user_file().read_text())
    assert (data["schema"], data["op"], data["device_kind"]) == (1, "decode_gemm", H100)
    entry = data["entries"]['{"K":128,"M<=":8,"N":64}'][jax.__version__]
    assert entry["choice"] == "swapab(stages=6,splits=4)" and entry["config"] == {"stages": 6, "splits": 4}
    assert entry["timings_us"] == {"swapab(stages=6,splits=4)": 12.0, "swapab(stages=4,splits=2)": 20.0,
                                   "xla": 40.0}
    assert entry["configs"]["xla"] is None and entry["excluded"] == {}
    assert entry["jax_version"] == jax.__version__ and entry["device_kind"] == H100 and entry["timer"] == "FakeTimer"
    assert entry["key"] == KEY and entry["date"][:2] == "20"
    assert not [p for p in _user_file().parent.iterdir() if p.name.endswith(".tmp")]
    # the same process: no second timing
    assert tuner.select("decode_gemm", KEY, _three(), _never, timer=_never_timer).name == chosen.name
    assert len(timer.calls) == 3
    # a new process (reset): read back from the user cache, nothing timed
    tuner.reset()
    assert tuner.select("decode_gemm", KEY, _three(), _never, timer=_never_timer).name == chosen.name
    assert tuner.report() == [{"op": "decode_gemm", "key": KEY, "choice": chosen.name, "source": "user cache",
                               "timings_us": entry["timings_us"], "excluded": {}}]
    # another key is tuned and merged into the same file
    tuner.select("decode_gemm", dict(KEY, **{"M<=": 16}), _three(), _args, timer=FakeTimer())
    assert len(json.loads(_user_file().read_text())["entries"]) == 2


def _boom(x):
    raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")


def test_failing_mismatching_and_refused_candidates_are_excluded(gpu, isolated, monkeypatch):
    def not_traceable(x):
        raise NotImplementedError("wgmma needs N % 8 == 0")

    def refused_run(x):
        raise AssertionError("a refused family's candidate must not even be compiled")

    refused_run.t_us = 0.5
    monkeypatch.setitem(registry._results, "grouped_experts", False)
    monkeypatch.setitem(registry._failures, "grouped_experts", "KernelMismatch: error up to 1e+03x")
    cands = [Candidate("xla", None, _run(40.0)),
             Candidate("compile-error", None, _run(1.0, not_traceable)),
             Candidate("run-error", None, _run(2.0, lambda x: jax.pure_callback(_boom, x, x))),
             Candidate("wrong", None, _run(3.0, lambda x: x * 3.0)),
             Candidate("wrong-shape", None, _run(4.0, lambda x: x[:4] * 2.0)),
             Candidate("nan", None, _run(4.5, lambda x: x * jnp.nan)),
             Candidate("refused", None, refused_run, family="grouped_experts"),
             Candidate("close", None, _run(30.0, lambda x: x * 2.0 * (1 + 1e-3)))]
    timer = FakeTimer()
    chosen = tuner.select("decode_gemm", KEY, cands, _args, timer=timer)
    assert chosen.name == "close"
    assert [f.t_us for f in timer.calls] == [40.0, 30.0]
    (rep,) = tuner.report()
    assert rep["source"] == "tuned" and set(rep["timings_us"]) == {"xla", "close"}
    ex = rep["excluded"]
    assert ex["compile-error"] == "compile: NotImplementedError: wgmma needs N % 8 == 0"
    assert ex["run-error"].startswith("run: JaxRuntimeError: ") and \
        ex["run-error"].endswith("RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS")
    assert ex["wrong"].startswith("mismatch: relative error 0.5 > 0.01 against xla")
    assert ex["wrong-shape"] == "mismatch: output float32[4] != the reference's float32[8]"
    assert ex["nan"] == "mismatch: non-finite output"
    assert ex["refused"] == "family grouped_experts: self-test failed (KernelMismatch: error up to 1e+03x)"
    assert "; excluded: refused (family grouped_experts" in isolated[0] and "compile-error (compile: " in isolated[0]
    stored = json.loads(_user_file().read_text())["entries"][tuner.canonical_key(KEY)][jax.__version__]
    assert stored["excluded"] == ex
    # a looser tolerance admits the 1e-3 candidate only: 'wrong' (0.5) stays out
    tuner.reset()
    tuner.set_autotune_mode("on")
    assert tuner.select("decode_gemm", {"other": 1}, cands[:1] + cands[3:4] + cands[7:], _args, timer=FakeTimer(),
                        tolerance=0.6).name == "wrong"


def test_fp8rl_kernels_xla_refuses_every_kernel_family(gpu):
    registry.set_kernel_mode("xla")
    try:
        cands = _three()
        assert tuner.select("decode_gemm", KEY, cands, _args, timer=FakeTimer()) is cands[0]
        assert tuner.report()[0]["excluded"]["swapab(stages=6,splits=4)"] == "family decode_gemm: FP8RL_KERNELS=xla"
    finally:
        registry.set_kernel_mode(None)


def test_failed_reference_excludes_everything_and_warns(gpu):
    cands = [Candidate("xla", None, _run(40.0, lambda x: jax.pure_callback(_boom, x, x))),
             Candidate("fast", None, _run(1.0))]
    with pytest.warns(RuntimeWarning, match="every candidate of decode_gemm N=64 K=128 M<=8 was excluded"):
        assert tuner.select("decode_gemm", KEY, cands, _args, timer=FakeTimer()) is cands[0]
    assert tuner.report()[0]["excluded"]["fast"] == "not compared: the reference xla failed"
    assert not _user_file().exists()


def test_select_while_tracing_and_nested_select(gpu):
    """Called mid-trace, tuning runs eagerly in its own thread; a select() made by a candidate being tuned gets its
    default (no tuning inside tuning), the same select() in the caller's trace is tuned."""
    inner = [Candidate("inner-default", None, _run(9.0)), Candidate("inner-fast", None, _run(1.0))]
    seen = []

    def outer_run(x):
        seen.append(tuner.select("inner_op", {"n": 8}, inner, _args, timer=FakeTimer()).name)
        return x * 2.0

    outer_run.t_us = 5.0
    cands = [Candidate("xla", None, _run(40.0)), Candidate("nested", None, outer_run)]

    @jax.jit
    def program(x):
        c = tuner.select("decode_gemm", KEY, cands, _args, timer=FakeTimer())
        return c.run(x)

    np.testing.assert_allclose(program(jnp.ones(8)), 2.0)
    assert seen == ["inner-default", "inner-fast"]  # traced while tuning decode_gemm, then in the program
    assert [(r["op"], r["choice"]) for r in tuner.report()] == [("decode_gemm", "nested"), ("inner_op", "inner-fast")]


# -- stored tables ---------------------------------------------------------------------------------------------------


def test_cached_mode_uses_tables_and_never_times(gpu):
    tuner.set_autotune_mode("cached")
    cands = _three()
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[0]
    assert tuner.report()[0]["source"] == "default: not cached"
    shipped = tuner.shipped_table_path("decode_gemm", H100)
    # a shipped entry measured with another JAX version: used in cached mode, and said so
    _write_table(shipped, {tuner.canonical_key(KEY): {
        "0.4.1": _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0}, "0.4.1"),
        "0.9.0": _entry({"xla": 40.0, "swapab(stages=6,splits=4)": 5.0}, "0.9.0")}})
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[1]  # the newest version
    assert tuner.report()[0]["source"] == "shipped (jax 0.9.0)"
    # this JAX version's entry wins over the others
    _write_table(shipped, {tuner.canonical_key(KEY): {
        "0.9.0": _entry({"xla": 40.0, "swapab(stages=6,splits=4)": 5.0}, "0.9.0"),
        jax.__version__: _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0})}})
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[2]
    assert tuner.report()[0]["source"] == "shipped"


def test_user_cache_before_shipped_and_fallback(gpu):
    tuner.set_autotune_mode("cached")
    ckey = tuner.canonical_key(KEY)
    _write_table(tuner.shipped_table_path("decode_gemm", H100),
                 {ckey: {jax.__version__: _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0})}})
    _write_table(_user_file(), {ckey: {jax.__version__: _entry({"xla": 40.0, "gone(stages=9)": 1.0})}})
    cands = _three()
    # the user entry names only a candidate that is no longer offered (and xla): its fastest usable is xla
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[0]
    assert tuner.report()[0]["source"] == "user cache"
    _write_table(_user_file(), {ckey: {jax.__version__: _entry({"gone(stages=9)": 1.0})}})
    tuner.reset()
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[2]
    assert tuner.report()[0]["source"] == "shipped"


def test_stored_choice_of_a_failed_family_is_not_used(gpu, monkeypatch):
    tuner.set_autotune_mode("cached")
    _write_table(tuner.shipped_table_path("decode_gemm", H100), {tuner.canonical_key(KEY): {
        jax.__version__: _entry({"xla": 40.0, "swapab(stages=6,splits=4)": 5.0, "swapab(stages=4,splits=2)": 7.0})}})
    monkeypatch.setitem(registry._results, "decode_gemm", False)
    cands = _three()
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[0]
    assert tuner.report()[0]["excluded"]["swapab(stages=6,splits=4)"].startswith("family decode_gemm: self-test")


def test_on_mode_times_what_the_tables_do_not_cover(gpu):
    ckey = tuner.canonical_key(KEY)
    shipped = tuner.shipped_table_path("decode_gemm", H100)
    cands = _three()
    # a complete shipped entry for this JAX version: used, nothing timed
    _write_table(shipped, {ckey: {jax.__version__: _entry(
        {"xla": 40.0, "swapab(stages=4,splits=2)": 5.0}, excluded={"swapab(stages=6,splits=4)": "compile: X"},
        configs={"swapab(stages=4,splits=2)": {"stages": 4, "splits": 2}})}})
    assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[2]
    # a stored config that differs from the candidate's: stale, timed again
    _write_table(shipped, {ckey: {jax.__version__: _entry(
        {"xla": 40.0, "swapab(stages=4,splits=2)": 5.0}, excluded={"swapab(stages=6,splits=4)": "compile: X"},
        configs={"swapab(stages=4,splits=2)": {"stages": 3, "splits": 2}})}})
    tuner.reset()
    timer = FakeTimer()
    assert tuner.select("decode_gemm", KEY, cands, _args, timer=timer) is cands[1] and len(timer.calls) == 3
    # an entry missing a candidate, or excluded for a reason of one process only (a family refused), or of
    # another JAX version: timed again
    for entry in ({jax.__version__: _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0})},
                  {jax.__version__: _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0},
                                           excluded={"swapab(stages=6,splits=4)": "family decode_gemm: x"})},
                  {"0.1.0": _entry({"xla": 1.0, "swapab(stages=4,splits=2)": 5.0, "swapab(stages=6,splits=4)": 7.0},
                                   "0.1.0")}):
        _write_table(shipped, {ckey: entry})
        _user_file().unlink()
        tuner.reset()
        timer = FakeTimer()
        assert tuner.select("decode_gemm", KEY, cands, _args, timer=timer) is cands[1]
        assert len(timer.calls) == 3 and tuner.report()[0]["source"] == "tuned"


def test_corrupt_cache_file_is_ignored_and_replaced(gpu):
    _user_file().parent.mkdir(parents=True)
    _user_file().write_text("{not json")
    cands = _three()
    with pytest.warns(RuntimeWarning, match="ignoring .*decode_gemm.json"):
        assert tuner.select("decode_gemm", KEY, cands, _args, timer=FakeTimer()) is cands[1]
    assert json.loads(_user_file().read_text())["entries"]


def test_concurrent_writers_keep_every_key(tmp_path):
    path = tmp_path / "cache" / "x" / "op.json"

    def writer(w):
        for i in range(8):
            entry = _entry({"xla": float(i)})
            tuner._write_entry(path, "op", H100, tuner.canonical_key({"w": w, "i": i}), entry)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(json.loads(path.read_text())["entries"]) == 32
    assert sorted(p.name for p in path.parent.iterdir()) == ["op.json", "op.json.lock"]


# -- budget ----------------------------------------------------------------------------------------------------------


def test_budget_spent_gives_defaults_with_one_warning(gpu, monkeypatch, isolated):
    monkeypatch.setenv(tuner.BUDGET_ENV_VAR, "0.05")

    class SlowTimer(FakeTimer):
        def __call__(self, fn, args):
            time.sleep(0.06)
            return super().__call__(fn, args)

    cands = _three()
    # the first key: the reference is timed, then the budget is spent: the rest are skipped, nothing is cached
    assert tuner.select("decode_gemm", KEY, cands, _args, timer=SlowTimer()) is cands[0]
    rep = tuner.report()[0]
    assert rep["source"] == "tuned (partial)" and set(rep["timings_us"]) == {"xla"}
    assert rep["excluded"]["swapab(stages=6,splits=4)"] == "not timed: autotune budget spent"
    assert "not every candidate was timed (not cached)" in isolated[0]
    assert not _user_file().exists()
    # later keys: the default, one warning for all of them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (16, 32):
            assert tuner.select("decode_gemm", dict(KEY, **{"M<=": m}), cands, _never, timer=_never_timer) is cands[0]
    spent = "tuning budget of 0.05 s (FP8RL_AUTOTUNE_BUDGET_S) is spent"
    assert len([w for w in caught if spent in str(w.message)]) == 1
    assert [r["source"] for r in tuner.report()[1:]] == ["default: autotune budget spent"] * 2
    # with the budget spent, a stored entry of another JAX version is better than the default
    _write_table(tuner.shipped_table_path("decode_gemm", H100), {tuner.canonical_key(dict(KEY, **{"M<=": 64})): {
        "0.1.0": _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0}, "0.1.0")}})
    assert tuner.select("decode_gemm", dict(KEY, **{"M<=": 64}), cands, _never, timer=_never_timer) is cands[2]
    assert tuner.report()[-1]["source"] == "shipped (jax 0.1.0) (budget spent)"


def test_budget_zero_times_nothing(gpu, monkeypatch):
    monkeypatch.setenv(tuner.BUDGET_ENV_VAR, "0")
    cands = _three()
    with pytest.warns(RuntimeWarning, match="budget of 0 s"):
        assert tuner.select("decode_gemm", KEY, cands, _never, timer=_never_timer) is cands[0]


# -- report, timers --------------------------------------------------------------------------------------------------


def test_report_and_format_report(gpu, monkeypatch):
    tuner.select("decode_gemm", KEY, _three(), _args, timer=FakeTimer())
    monkeypatch.setattr(registry, "cuda_device", lambda: None)
    tuner.select("prefill_gemm", {"N": 64}, _three(), _never)
    text = tuner.format_report().splitlines()
    assert text == ["decode_gemm K=128 M<=8 N=64: swapab(stages=6,splits=4) [tuned] 12.0 us",
                    "prefill_gemm N=64: xla [default: no CUDA device]"]
    assert [r["op"] for r in tuner.report()] == ["decode_gemm", "prefill_gemm"]


def test_default_timers_run_on_cpu(gpu, monkeypatch):
    """The wall-clock loop runs (on a CPU its number means little: XLA:CPU drops the barriers); CUPTI is absent
    on a CPU, so the default timer warns once and falls back to the wall clock."""
    fn = jax.jit(lambda x: (x * 2.0, x.sum()))
    args = _args()
    out = tuner.timing_loop(fn, args)(np.int32(3), args)
    assert [o.shape for o in out] == [(1,), (1,)]
    assert tuner.wall_timer(fn, args, target_s=1e-3, repeats=1) > 0
    with pytest.raises(RuntimeError):
        tuner.cupti_timer(fn, args)
    monkeypatch.setenv(tuner.TIMER_ENV_VAR, "sundial")
    with pytest.raises(ValueError, match="FP8RL_AUTOTUNE_TIMER='sundial'"):
        tuner.select("decode_gemm", KEY, _three(), _args)
    monkeypatch.setenv(tuner.TIMER_ENV_VAR, "auto")
    with pytest.warns(RuntimeWarning, match="CUPTI timing does not work here"):
        chosen = tuner.select("decode_gemm", KEY, _three(), _args)
    assert chosen.name in {c.name for c in _three()}
    entry = json.loads(_user_file().read_text())["entries"][tuner.canonical_key(KEY)][jax.__version__]
    assert entry["timer"] == "wall" and len(entry["timings_us"]) == 3


def test_spent_s_charges_the_tuning_wall_time_and_nothing_else(gpu, monkeypatch):
    """``spent_s`` (what a first call less its compile is, in bench_rollout) grows by at least the time the timer
    slept for each timed candidate, not for stored or off-mode choices, and ``reset`` zeroes it."""
    assert tuner.spent_s() == 0.0
    slept = []

    class SleepyTimer(FakeTimer):
        def __call__(self, fn, args):
            t0 = time.perf_counter()
            time.sleep(0.02)
            slept.append(time.perf_counter() - t0)
            return super().__call__(fn, args)

    t0 = time.monotonic()
    tuner.select("decode_gemm", KEY, _three(), _args, timer=SleepyTimer())
    wall = time.monotonic() - t0
    assert len(slept) == 3 and sum(slept) <= tuner.spent_s() <= wall
    before = tuner.spent_s()
    tuner.select("decode_gemm", KEY, _three(), _never, timer=_never_timer)  # this process's memo: nothing timed
    with tuner.autotune_mode_scope("off"):
        tuner.select("decode_gemm", dict(KEY, **{"M<=": 16}), _three(), _never, timer=_never_timer)
    assert tuner.spent_s() == before
    tuner.reset()
    assert tuner.spent_s() == 0.0


def test_export_table_merges_this_runs_entries_over_the_shipped_table(gpu, tmp_path, monkeypatch):
    """The table to ship: the shipped entries kept (other keys, other JAX versions), this JAX version's user-cache
    entries merged in, in the schema select() reads back as "shipped"."""
    assert tuner.export_table("decode_gemm", H100, tmp_path / "ship") is None  # nothing tuned: nothing written
    old_key, new_key = (tuner.canonical_key(dict(KEY, **{"M<=": m})) for m in (64, 16))
    _write_table(tuner.shipped_table_path("decode_gemm", H100), {
        old_key: {"0.1.0": _entry({"xla": 40.0, "swapab(stages=4,splits=2)": 5.0}, "0.1.0")}})
    tuner.select("decode_gemm", dict(KEY, **{"M<=": 16}), _three(), _args, timer=FakeTimer())  # tuned: user cache
    out = tuner.export_table("decode_gemm", H100, tmp_path / "ship")
    assert out == tmp_path / "ship" / tuner.sanitize_device_kind(H100) / "decode_gemm.json"
    data = json.loads(out.read_text())
    assert (data["schema"], data["op"], data["device_kind"]) == (1, "decode_gemm", H100)
    assert set(data["entries"]) == {old_key, new_key}
    assert set(data["entries"][old_key]) == {"0.1.0"}
    assert data["entries"][old_key]["0.1.0"]["choice"] == "swapab(stages=4,splits=2)"
    assert data["entries"][new_key][jax.__version__]["choice"] == "swapab(stages=6,splits=4)"
    # shipped from there (and the user cache gone), it is read back as a shipped table: nothing timed
    tuner.reset()
    _user_file().unlink()
    monkeypatch.setattr(tuner, "_SHIPPED_ROOT", tmp_path / "ship")
    assert tuner.select("decode_gemm", dict(KEY, **{"M<=": 16}), _three(), _never,
                        timer=_never_timer).name == "swapab(stages=6,splits=4)"
    assert tuner.report()[-1]["source"] == "shipped"
