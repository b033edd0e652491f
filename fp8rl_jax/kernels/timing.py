"""Timing for the kernels' ``main`` functions (issue 37's layout: each kernel module has a ``main`` that times it,
in the manner of jax's ``jax/experimental/pallas/ops/gpu/*_mgpu.py``).

Each ``main`` times its kernel against XLA's own path at the Qwen3 shapes on the device the process has (a Hopper
GPU for real numbers); ``--smoke`` runs tiny shapes in the kernels' interpreters on a CPU, so the CPU tests keep
the ``main`` functions working (tests/test_kernel_mains.py). The numbers that choose kernels come from the on-device
tuner (:mod:`fp8rl_jax.kernels.tuner`) and the benchmarks (``benchmarks/bench_fp8_matmul.py``); these are the quick
look at one kernel.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def per_call_us(fn: Callable, args: Sequence, iters: int = 20) -> float:
    """Microseconds per call of ``fn(*args)``: ``iters`` calls inside one jitted ``lax.fori_loop``, timed on the
    host around ``block_until_ready`` after a first call of the loop (compile and warm-up).

    Each iteration passes the arguments through ``lax.optimization_barrier`` together with the loop carry, so XLA
    cannot hoist the loop-invariant call out of the loop; the first element of the call's first output is added to
    the carry, so the call is never dead code. The time includes the loop's one launch and its ``iters`` kernel
    launches (the same a jitted program pays).

    Args:
      fn: a function of jax arrays returning an array or a pytree of arrays.
      args: its arguments (jax arrays).
      iters: calls per timed loop (>= 1).

    Returns:
      float: microseconds per call (wall clock of this host).

    Raises:
      ValueError: ``iters < 1``.
    """
    if iters < 1:
        raise ValueError(f"per_call_us: iters must be >= 1, got {iters}")

    @jax.jit
    def loop(*a):
        def body(_, carry):
            acc, xs = lax.optimization_barrier(carry)
            out = jax.tree.leaves(fn(*xs))[0]
            return acc + out.reshape(-1)[0].astype(jnp.float32), xs
        return lax.fori_loop(0, iters, body, (jnp.float32(0), tuple(a)))[0]

    loop(*args).block_until_ready()
    t0 = time.perf_counter()
    loop(*args).block_until_ready()
    return (time.perf_counter() - t0) / iters * 1e6


def main_parser(module: str, doc: str, iters: int) -> argparse.ArgumentParser:
    """The argument parser every kernel ``main`` starts from: ``--iters`` (calls per timed loop, default ``iters``)
    and ``--smoke`` (tiny shapes in the kernel's interpreter on a CPU); the ``main`` adds its own shape flags.

    Args:
      module: the kernel module's name (``python -m fp8rl_jax.kernels.<module>``). doc: the ``main``'s docstring.
      iters: the default of ``--iters``.
    """
    p = argparse.ArgumentParser(prog=f"python -m fp8rl_jax.kernels.{module}", description=doc)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in the kernel's interpreter (CPU; numbers "
                   "meaningless)")
    return p


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence]) -> None:
    """Print ``title`` with the device kind and jax version, then ``rows`` under ``header`` as aligned columns (floats
    with 2 decimals)."""
    print(f"{title} on {jax.devices()[0].device_kind}; jax {jax.__version__}")
    cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
