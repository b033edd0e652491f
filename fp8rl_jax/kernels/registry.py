"""Which kernel a GPU program runs, chosen by the platform it is compiled for (issue 28).

The project's own kernels (Pallas quantizers, the Mosaic GPU and Triton W8A8 GEMMs, the grouped expert GEMM, the FP8-KV
decode attention) and
cuDNN's flash attention only exist for CUDA. Whether a computation runs on CUDA is known when it is *lowered*, not
when Python traces it: on a GPU host a computation can still be placed on the CPU (``jax.default_device(cpu)``,
inputs committed to the host), and a program can be compiled for an H100 on a machine without one (the deviceless
compile of ``scripts/compile_h100.py``). So every op that has a kernel stages both paths with
:func:`jax.lax.platform_dependent`: lowered for ``cuda`` the kernel is compiled, lowered for any other platform the
XLA path is, and nothing consults which devices exist. :func:`choose` is that one place.

Modes (:func:`kernel_mode`), set by ``FP8RL_KERNELS=auto|xla|pallas`` in the environment or by
:func:`set_kernel_mode` (``train.kernels`` in gin):

* ``"auto"`` (default): the kernel on CUDA, unless its family failed the one-time self-test;
* ``"xla"``: XLA's path everywhere (the escape hatch: no Pallas or cuDNN kernel is compiled);
* ``"pallas"``: the kernel on CUDA without the self-test.

Self-test. The first time a program containing a kernel family is traced in a process that has a CUDA device, the
family's registered self-test runs once on that device: a small ragged case against a reference computed
independently (float64 numpy, or the XLA path on the CPU, which the test suite proves bit-exact against the numpy
and vLLM references). A compile error or a mismatch warns once, naming the kernel and the error, and that family
takes the XLA path for the rest of the process. Without a CUDA device there is nothing to run the test on (a
deviceless compile for sm_90a, or a CPU host): the kernel is staged for the ``cuda`` platform and only ever runs
if the program is lowered for CUDA.

Families: :data:`FAMILIES`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable

import jax

#: kernel family -> what it is (the names of warnings, self-tests and docs)
FAMILIES = {
    "quant": "Pallas blockwise e4m3 quantization (weights 128x128, activations 1x128)",
    "w8a8_gemm": "Mosaic GPU wgmma W8A8 blockwise FP8 GEMM (dense M > 64, MoE prefill, FP8 training)",
    "decode_gemm": "Mosaic GPU swap-AB split-K W8A8 decode GEMM (M <= 64, fp8rl_jax.kernels.decode_gemm_mgpu)",
    "grouped_experts": "Pallas-Triton grouped W8A8 MoE expert GEMM (explicit expert_impl='pallas'; e5m2 experts)",
    "grouped_decode": "Mosaic GPU swap-AB grouped W8A8 MoE expert GEMM (decode-sized routed rows, "
                      "fp8rl_jax.kernels.decode_grouped_mgpu)",
    "fp8_kv_attention": "Pallas decode attention reading the e4m3 KV cache",
    "cudnn_attention": "cuDNN flash attention (jax.nn.dot_product_attention implementation='cudnn')",
}
#: values of ``FP8RL_KERNELS`` / :func:`set_kernel_mode`
MODES = ("auto", "xla", "pallas")
ENV_VAR = "FP8RL_KERNELS"

# One lock per family, held while that family's self-test runs. A self-test runs in a thread of its own that is
# marked (``_selftest_thread.active``): any kernel choice made inside it (a self-test calling a path that itself
# goes through :func:`choose`) passes without waiting, so no self-test can wait on another.
_family_locks = {family: threading.Lock() for family in FAMILIES}
_selftest_thread = threading.local()
_mode_override: str | None = None
_selftests: dict[str, Callable[[], None]] = {}
_results: dict[str, bool] = {}
_failures: dict[str, str] = {}
_selftest_s: dict[str, float] = {}  # family -> wall seconds its self-test took in this process (passed or not)


def _check_mode(mode: str, source: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{source}={mode!r} is not a kernel mode; expected one of {MODES} "
                         "(auto: our kernels on CUDA after a self-test, xla: XLA everywhere, pallas: kernels untested)")
    return mode


def kernel_mode() -> str:
    """The current mode: :func:`set_kernel_mode`'s, else ``$FP8RL_KERNELS``, else ``"auto"``.

    Raises:
      ValueError: ``FP8RL_KERNELS`` holds something other than ``auto``/``xla``/``pallas`` (named).
    """
    if _mode_override is not None:
        return _mode_override
    return _check_mode(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def set_kernel_mode(mode: str | None) -> None:
    """Set the mode for this process (``None``: back to ``$FP8RL_KERNELS`` / ``"auto"``).

    It applies to programs traced afterwards (a jitted function already compiled keeps its kernels: its cache key
    does not include the mode, so set the mode before the first call, as the trainer does).

    Raises:
      ValueError: an unknown mode.
    """
    global _mode_override
    _mode_override = None if mode is None else _check_mode(str(mode), "kernel mode")


@contextlib.contextmanager
def kernel_mode_scope(mode: str):
    """Context manager: :func:`set_kernel_mode` ``mode`` inside, the previous setting restored after."""
    global _mode_override
    prev = _mode_override
    set_kernel_mode(mode)
    try:
        yield
    finally:
        _mode_override = prev


def register_selftest(family: str, fn: Callable[[], None]) -> None:
    """Register ``fn`` as ``family``'s self-test (called by each kernel's module at import).

    ``fn()`` runs on the default device (a CUDA device, set by the caller), computes a small ragged case with the
    kernel and an independent reference, and raises (any exception; :class:`KernelMismatch` for a numeric mismatch,
    with the size of the error in its message) when they differ.

    Raises:
      ValueError: an unknown family.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(FAMILIES)}")
    _selftests[family] = fn


class KernelMismatch(AssertionError):
    """A kernel's self-test result differs from its reference (the message says by how much)."""


def check_close(name: str, got, ref, bound, rtol: float) -> None:
    """Raise :class:`KernelMismatch` unless ``|got - ref| <= rtol * bound`` elementwise (float64).

    For self-tests: ``ref`` is a float64 reference, ``bound`` the float64 sum of absolute terms of each output
    (``|x| @ |w|.T`` for a product), so ``rtol`` is a multiple of float32's unit roundoff; a wrong scale or layout
    misses it by orders of magnitude.

    Raises:
      KernelMismatch: an output outside the bound, or not finite (the message gives the worst ratio and the count).
    """
    import numpy as np

    got64 = np.asarray(got, np.float64)
    err = np.abs(got64 - np.asarray(ref, np.float64))
    lim = rtol * np.asarray(bound, np.float64) + 1e-30
    if not (np.all(np.isfinite(got64)) and np.all(err <= lim)):
        worst = float(np.nanmax(err / lim)) if np.all(np.isfinite(got64)) else float("inf")
        raise KernelMismatch(f"{name}: error up to {worst:.3g}x the tolerance ({rtol:g} of the sum of |terms|; "
                             f"{int(np.sum(~(err <= lim)))} of {err.size} outputs outside)")


def cuda_device():
    """The first CUDA device of this process, or None (no GPU backend, or a ROCm one)."""
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    for d in devs:
        if "rocm" not in str(getattr(d.client, "platform_version", "")).lower():
            return d
    return None


def _run_selftest(family: str, dev) -> None:
    fn = _selftests.get(family)
    if fn is None:  # the kernel's module registers it at import: a family used before that is a bug, not a pass
        raise RuntimeError(f"no self-test registered for kernel family {family!r} (its module was not imported)")

    def run():  # a fresh thread: no trace context of the caller (the test runs eagerly even mid-trace)
        _selftest_thread.active = True
        with jax.default_device(dev):
            fn()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()


def selftest_passed(family: str) -> bool:
    """Whether ``family``'s kernel passed its self-test in this process (run once, on first use).

    True without a CUDA device (nothing to test on: the kernel is only compiled, e.g. for a deviceless sm_90a
    compile), and inside a self-test (its own calls are the test). On a failure (an exception, a
    :class:`KernelMismatch`, no registered self-test) the warning names the kernel, the device and the error, once per
    process.

    Raises:
      ValueError: an unknown family.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(FAMILIES)}")
    if getattr(_selftest_thread, "active", False):
        return True
    with _family_locks[family]:
        if family in _results:
            return _results[family]
        dev = cuda_device()
        if dev is None:
            return True
        t0 = time.perf_counter()
        try:
            _run_selftest(family, dev)
            ok = True
        except Exception as e:  # noqa: BLE001 - any failure of the kernel means: do not use it
            ok = False
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            _failures[family] = msg
            warnings.warn(f"fp8rl: the {FAMILIES[family]} failed its self-test on {dev.device_kind} ({msg}); this "
                          f"process uses XLA's path for it instead. {ENV_VAR}=pallas forces the kernel, "
                          f"{ENV_VAR}=xla uses XLA for every kernel.", RuntimeWarning, stacklevel=3)
        finally:
            _selftest_s[family] = time.perf_counter() - t0
        _results[family] = ok
        return ok


def selftest_seconds() -> dict[str, float]:
    """``{family: seconds}``: wall-clock seconds each self-test run in this process took (compiling and running it on
    the device, passed or failed); empty where none ran (no GPU, or ``FP8RL_KERNELS=xla|pallas``). A program's first
    call pays these once per process, inside its trace (:func:`choose`), so a first-call time less their sum is
    the compile (``benchmarks/bench_rollout.py``'s ``first_call_compile_s``)."""
    return dict(_selftest_s)


def selftest_failures() -> dict[str, str]:
    """``{family: error}`` of the self-tests that failed in this process (empty when none did)."""
    return dict(_failures)


def use_kernel(family: str) -> bool:
    """Whether programs lowered for CUDA get ``family``'s kernel (mode and self-test; see the module docstring)."""
    mode = kernel_mode()
    if mode == "xla":
        return False
    if mode == "pallas":
        return True
    return selftest_passed(family)


def choose(family: str | None, *args, kernel: Callable, xla: Callable):
    """``kernel(*args)`` where the program is lowered for CUDA (and :func:`use_kernel` allows), ``xla(*args)``
    everywhere else: the one place each op picks its implementation.

    Both callables take the same (pytree) arguments and must return the same shapes and dtypes. With the kernel
    disallowed only ``xla`` is traced.

    Args:
      family: a :data:`FAMILIES` name, or None when the CUDA path is XLA's own (e.g. its FP8 ``dot_general``): then
        no self-test or kernel mode applies and ``kernel`` is simply the CUDA branch.
      args: arrays (pytrees) passed to the chosen callable.
      kernel: the CUDA kernel path (compiled only when lowering for ``cuda``).
      xla: the portable path.

    Returns:
      what the chosen callable returns.

    Source: :func:`jax.lax.platform_dependent` (only the branch of the lowering platform is lowered).
    """
    if family is not None and not use_kernel(family):
        return xla(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=xla)


def on_cuda(*args, cuda: Callable, default: Callable):
    """``cuda(*args)`` when lowered for CUDA, ``default(*args)`` elsewhere (:func:`jax.lax.platform_dependent`),
    for a choice that is not a kernel family (e.g. interpret mode of an explicitly requested Pallas kernel)."""
    return jax.lax.platform_dependent(*args, cuda=cuda, default=default)


def run_pallas(fn: Callable, *args, interpret: bool | None = None, **kwargs):
    """Call a Pallas kernel wrapper ``fn(*args, interpret=..., **kwargs)``: with ``interpret=None`` compiled where
    the program is lowered for CUDA and in interpret mode elsewhere (:func:`on_cuda`); otherwise as forced.

    For a kernel the caller asked for explicitly (no self-test, no XLA fallback): what ``"auto"`` dispatch does is
    :func:`choose`'s job.
    """
    if interpret is not None:
        return fn(*args, interpret=bool(interpret), **kwargs)
    return on_cuda(*args, cuda=lambda *a: fn(*a, interpret=False, **kwargs),
                   default=lambda *a: fn(*a, interpret=True, **kwargs))


__all__ = ["FAMILIES", "MODES", "ENV_VAR", "kernel_mode", "set_kernel_mode", "kernel_mode_scope", "register_selftest",
           "KernelMismatch", "check_close", "cuda_device", "selftest_passed", "selftest_seconds", "selftest_failures",
           "use_kernel", "choose", "on_cuda", "run_pallas"]
