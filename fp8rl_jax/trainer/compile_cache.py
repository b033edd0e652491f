"""JAX's persistent compilation cache for the main job: a program compiled once is loaded, not compiled, by the
next process (issue 37 item 5: the engine's FP8 programs took 65 s to compile on an H200 at b=32, bf16's 19 s).

``scripts/train.py --compilation_cache_dir=DIR`` chooses it; by default (:func:`resolve_cache_dir`):

* ``JAX_COMPILATION_CACHE_DIR`` set in the environment: JAX already uses it; nothing is changed;
* else, on a machine with an NVIDIA device (``/dev/nvidiactl``): ``$XDG_CACHE_HOME/fp8rl_jax/xla`` (``~/.cache``
  when unset); MaxText likewise turns a cache on by default (``jax_cache_dir: ~/jax_cache``);
* else (CPU): off. XLA:CPU programs of the default configs compile in seconds, and a failed serialization of an
  XLA:CPU executable in a process that also loaded vLLM's xgrammar once hung a test run (tests/conftest.py), so the
  cache is opt-in there.

``--compilation_cache_dir=""`` turns it off everywhere. The cache key is the program (HLO, devices, compile options,
JAX/XLA versions), so a hit returns what compiling again would give; JAX's own thresholds decide which programs are
written (``jax_persistent_cache_min_compile_time_secs``, 1 s by default). Source: JAX "Persistent compilation cache"
(``jax_compilation_cache_dir``). JAX keeps every entry unless ``JAX_COMPILATION_CACHE_MAX_SIZE`` (bytes) caps the
directory (least recently used entries go first).
"""

from __future__ import annotations

import os
from typing import Mapping

ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
ENABLE_VAR = "JAX_ENABLE_COMPILATION_CACHE"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_CACHE_HOME/fp8rl_jax/xla``, with ``XDG_CACHE_HOME`` defaulting to ``~/.cache`` (an absolute path)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "fp8rl_jax", "xla"))


def has_nvidia_device() -> bool:
    """Whether this machine has an NVIDIA device node, checked without initializing JAX's backends (which must wait
    for ``jax.distributed.initialize`` on multi-host runs)."""
    return os.path.exists("/dev/nvidiactl")


def resolve_cache_dir(flag: str | None, environ: Mapping[str, str] | None = None,
                      nvidia: bool | None = None) -> str | None:
    """The cache directory this process should set, ``""`` to turn the cache off, or None to leave JAX as it is.

    Args:
      flag: ``--compilation_cache_dir`` as given (None when not given; ``""`` turns the cache off).
      environ: the environment (default ``os.environ``); ``JAX_COMPILATION_CACHE_DIR`` there is JAX's own setting.
      nvidia: whether an NVIDIA device is present (default :func:`has_nvidia_device`).

    Returns:
      an absolute directory (user ``~`` expanded), ``""``, or None (see the module docstring for the order).
    """
    env = os.environ if environ is None else environ
    if flag is not None:
        return os.path.abspath(os.path.expanduser(flag)) if flag else ""
    if env.get(ENV_VAR) is not None:
        return None
    if has_nvidia_device() if nvidia is None else nvidia:
        return default_cache_dir(env)
    return None


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Apply :func:`resolve_cache_dir`'s answer to JAX in this process and to the processes it starts.

    Args:
      cache_dir: a directory (created if missing; JAX then reads and writes compiled programs there), ``""`` (cache
        off), or None (nothing changes).

    Raises:
      OSError: the directory cannot be created (e.g. not writable), with its path in the message.
    """
    if cache_dir is None:
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if cache_dir:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise OSError(f"--compilation_cache_dir {cache_dir}: cannot create it ({e.strerror or e})") from e
        os.environ[ENV_VAR] = cache_dir  # subprocesses and Ray workers started from here inherit both variables
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    else:  # off: JAX treats a set-but-empty directory variable as a cache still on, so drop it
        os.environ.pop(ENV_VAR, None)
    os.environ[ENABLE_VAR] = "true" if cache_dir else "false"
    jax.config.update("jax_enable_compilation_cache", bool(cache_dir))
    compilation_cache.reset_cache()  # a cache JAX already set up (or found off) in this process is set up again


__all__ = ["ENV_VAR", "ENABLE_VAR", "default_cache_dir", "has_nvidia_device", "resolve_cache_dir",
           "enable_compilation_cache"]
