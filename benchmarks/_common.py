"""Pieces the benchmark scripts share: the CPU's name, Qwen3 model shapes, their random bf16 weights, and the one-time
seconds (kernel self-tests, autotuning) inside a first call."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Iterator

from fp8rl_jax.models.presets import QWEN3, qwen3_config  # noqa: F401 (re-exported for the benchmarks)


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls (no warm-up: the caller warms up; ``fn`` waits for
    its own device work)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_time_seconds() -> dict:
    """``{"selftest_s", "autotune_s"}``: seconds this process has spent so far on the kernel families' one-time
    self-tests (:func:`fp8rl_jax.kernels.registry.selftest_seconds`) and on the on-device autotuner
    (:func:`fp8rl_jax.kernels.tuner.spent_s`). Both run inside the trace of the first program that needs them (on a
    GPU; 0 elsewhere), so a first call less their growth over it is that program's compile (issue 37 item 5)."""
    from fp8rl_jax.kernels import registry, tuner

    return {"selftest_s": float(sum(registry.selftest_seconds().values())), "autotune_s": float(tuner.spent_s())}


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (``platform.processor()`` or ``"cpu"`` where unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cpu_description() -> str:
    """``"<cpu model>, <n> cores"`` for result files."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def random_param_groups(cfg, seed: int = 0) -> Iterator[dict]:
    """Random bf16 weights ``0.02 * N(0, 1)`` of ``cfg``'s HF parameters, one dict per decoder layer (plus one for
    the tensors outside the layers), so a large model can be processed without all its weights existing at once.
    Tensor ``i`` of the sorted names is drawn from ``fold_in(key(seed), i)``: the same values however grouped."""
    import jax
    import jax.numpy as jnp

    from fp8rl_jax.models.config import hf_param_shapes

    def layer_of(name: str) -> str:
        parts = name.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "layers" else "-"

    key = jax.random.key(seed)
    groups: dict[str, list] = {}
    for i, (name, shape) in enumerate(sorted(hf_param_shapes(cfg).items())):
        groups.setdefault(layer_of(name), []).append((i, name, shape))
    for members in groups.values():
        yield {name: (0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(jnp.bfloat16)
               for i, name, shape in members}
