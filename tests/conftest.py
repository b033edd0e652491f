"""Shared fixtures: tiny random HF checkpoints built offline with ``transformers`` (the reference)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent XLA compilation cache for the whole test session: this process and every subprocess it starts
# (trainer scripts, multi-device workers, the two jax.distributed processes) inherit the variables, so a program
# that several tests compile (the same tiny trainer, the same reference forward) is compiled once. The cache key
# is the program itself (HLO, devices, compile options, jax/XLA versions): a hit returns the executable that
# compiling again would give, so results are unchanged. The directory is new for each session (nothing stale) and
# removed at exit; set JAX_COMPILATION_CACHE_DIR yourself to use another one, or to "" to compile everything.
# Set here, before anything imports jax (jax reads these variables when it is imported).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _xla_cache = tempfile.mkdtemp(prefix="fp8rl-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # small programs too (trainer runs)
    atexit.register(shutil.rmtree, _xla_cache, True)
# XLA:CPU compiles the tests' programs with LLVM's cheap pipeline (TEST_XLA_FLAGS: backend optimization level 0,
# no expensive LLVM passes). Most of the suite's time is XLA:CPU compiling small programs (tiny models, 8-device SPMD
# workers), not running them, and that cuts the compile CPU time by a quarter to a third (2-core AMD EPYC,
# 2026-11-28: tests/test_mesh.py's llama equivalence worker 116 -> 78 s of CPU, tests/test_remat_scan.py 266 -> 198 s).
# Nothing a test asserts depends on it: every comparison is against an independent reference within a tolerance, or
# between programs compiled the same way; the bit-exact suites (vLLM's quantizers, sync, export, KV cache, FP8 dot,
# engine) pass at both levels. Every subprocess a test starts inherits it (the multi-device workers append their
# device count; the notebooks' kernels drop it, tests/test_notebooks.py). Not on a machine with an NVIDIA device
# (the GPU tests compile for the GPU at XLA's defaults), nor with FP8RL_TEST_XLA_OPT=default (the suite at XLA's
# default optimization, what users run).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ.get("FP8RL_TEST_XLA_OPT", "fast") != "default" and not os.path.exists("/dev/nvidiactl") \
        and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # nor over the user's own
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TEST_XLA_FLAGS).strip()
# This (the pytest) process uses the cache too: many tests build several trainers whose programs are the same HLO
# under new Python closures, a miss of JAX's in-memory cache that the persistent one catches (tests/test_sync_verify.py:
# 90.7 s without it, 70.6 s with it, 2026-11-27: one of the reasons the suite took 89 min in a clean clone while it
# was off). It was off for one stop because of a hang seen here twice under heavy parallel load: a C++ exception (an
# executable XLA:CPU cannot serialize for the cache, once an XLA:CPU compile error) unwound into a segfault inside
# libgcc's unwinder, and the SIGSEGV handler of apache-tvm-ffi (loaded with vLLM's xgrammar) deadlocked on the
# unwinder's lock, so the suite sat at 0% CPU. Now a segfault cannot hang the run: every test module starts and ends
# with Python's faulthandler re-installed over whatever handler a library put there (_fatal_signals_to_faulthandler
# below), which prints every thread's Python stack and lets the process die. FP8RL_TEST_CACHE=0 turns it off here.
import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", os.environ.get("FP8RL_TEST_CACHE", "1") != "0")
# No JAX platform is forced here: on a GPU machine the `gpu`-marked tests must run on the GPU. Every other test
# runs with the CPU as JAX's default device (the autouse fixture below), so CPU-only tests compute on the CPU
# whatever the machine, and their bit-exact references keep their meaning.

import numpy as np
import pytest

# Intel AMX CPUs where torch's oneDNN AMX GEMM dies with SIGILL (rollout_bridge/cpu_gemm.py): oneDNN fixes its ISA at
# its first JIT compilation in a process, and several tests use torch in this one before the vLLM tests start
# their engine, so the check runs here, first.
from rollout_bridge.cpu_gemm import ensure_cpu_bf16_gemm  # noqa: E402

ensure_cpu_bf16_gemm()


@pytest.fixture(autouse=True)
def _default_device(request):
    """CPU as the default JAX device for tests not marked ``gpu`` (explicit placement, not a platform switch)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield


_FAULT_FD: list[int] = []  # a copy of the terminal's stderr, made at configure time as pytest's faulthandler does


def pytest_configure(config):
    """Keep a duplicate of stderr's descriptor for :func:`_fatal_signals_to_faulthandler` (made here, as pytest's own
    faulthandler plugin makes its copy, so output capture during a test does not swallow a crash's stacks)."""
    import sys

    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError):
        fd = sys.__stderr__.fileno()
    _FAULT_FD.append(os.dup(fd))


def _fatal_signals_to_faulthandler():
    """Re-install Python's faulthandler for SIGSEGV/SIGFPE/SIGABRT/SIGBUS/SIGILL (all threads, to the stderr copy of
    :func:`pytest_configure`): a library loaded since (apache-tvm-ffi, with vLLM's xgrammar) may have put its own
    handler there, one that deadlocked in a segfault inside the C++ unwinder (see the cache note above; tvm-ffi's
    handler replaces faulthandler's when it is imported, checked 2026-11-27). faulthandler prints the stacks and then
    re-raises the signal with the default action: the process dies with a traceback instead of hanging."""
    import faulthandler

    faulthandler.disable()  # enable() alone keeps an earlier enable and would not replace the library's handler
    faulthandler.enable(file=_FAULT_FD[0], all_threads=True)


# The slowest test files, slowest first (the 2-core CI machine, 2026-11-27/28 runs: `--durations` and a per-test
# log), collected first. Under `make test` (two pytest-xdist workers, `--dist loadfile --no-loadscope-reorder`) the
# workers take the files in this order, so the longest start first and the short ones fill in at the end (longest
# processing time first); without `--no-loadscope-reorder` xdist would hand out the files with the most tests first,
# which ran the two-test Ray and colocated files last, side by side (the 2026-11-28 timing). A stale list costs
# balance, never correctness.
SLOW_FILES_FIRST = (
    "test_mesh.py", "test_expert_parallel.py", "test_ray_launch.py", "test_vllm_bridge.py", "test_engine.py",
    "test_engine_mesh.py", "test_fused_projections.py", "test_colocated.py", "test_train_and_errors.py",
    "test_async_rl.py", "test_wgmma_paths.py", "test_fp8_attention_kernel.py", "test_routing_replay.py",
    "test_kl_entropy.py", "test_fp8_training.py", "test_sync_verify.py", "test_multihost.py", "test_vllm_tp_sync.py",
    "test_stacked_experts.py", "test_fp8_vllm_exact.py", "test_attention.py", "test_run_gpu.py",
    "test_kernel_choice.py", "test_precision.py", "test_model_parity.py", "test_mosaic_gemm.py",
    "test_objectives_properties.py", "test_quant_gpu_compile.py", "test_offload.py", "test_checkpoint.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Run the files of :data:`SLOW_FILES_FIRST` first, in that order (a stable sort: the tests inside a file, and
    the other files, keep their order)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _faulthandler_on_fatal_signals():
    """Before and after each test module: :func:`_fatal_signals_to_faulthandler` (a module may import the library
    that replaces the handler)."""
    _fatal_signals_to_faulthandler()
    yield
    _fatal_signals_to_faulthandler()


@pytest.fixture(autouse=True, scope="module")
def _fresh_gin_config():
    """Each test module starts and ends with an empty gin config (``gin.clear_config``): a module that parses a
    config in this process (configs/quickstart.gin's ``train.max_tokens = 16``, say) must not leak its bindings into
    the next module, whichever runs next (pytest-xdist hands out files in another order than a plain run)."""
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module: drop JAX's in-memory caches of traced and compiled programs (``jax.clear_caches``)
    and collect garbage. The suite compiles thousands of programs in this one process; keeping them all grew it to
    ~8 GB here, beside the compile lane and the notebooks on a 24 GiB machine. Programs are rarely shared across
    modules, so this costs little recompilation (the persistent cache above has them)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
# Qwen3-MoE extras: 4 experts, top-2, renormalised; every layer sparse unless overridden.
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])


def make_hf_model(arch: str, tie: bool = False, seed: int = 0, **overrides):
    """A random-weight ``transformers`` model (float32, eval mode) of the given family.

    ``arch`` is ``llama`` | ``qwen2`` | ``qwen3`` | ``qwen3_moe`` (``TINY`` + ``TINY_MOE`` sizes).
    """
    torch = pytest.importorskip("torch", reason="needs the [test] extra (torch)")
    transformers = pytest.importorskip("transformers", reason="needs the [test] extra (transformers)")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig}[arch]
    kw = dict(TINY, tie_word_embeddings=tie, eos_token_id=3, bos_token_id=1, pad_token_id=0)
    if arch == "qwen3_moe":
        kw.update(TINY_MOE)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the packaged SmolLM2-135M-Instruct GGUF (installed by ``make setup``; a missing asset fails)."""
    from fp8rl_jax.assets import smollm2_gguf_path

    return smollm2_gguf_path()


def make_byte_tokenizer(directory):
    """A tiny byte-level tokenizer (259 ids: ``<pad>``=0, ``<|im_start|>``=1, ``<|im_end|>``=2 (eos), then the
    256 GPT-2 byte symbols, no merges) with a ChatML template, saved as ``tokenizer.json`` +
    ``tokenizer_config.json`` in ``directory``; for trainer tests on tiny models (small vocab = fast): the package's
    :func:`fp8rl_jax.models.synthetic.byte_tokenizer`, saved."""
    from fp8rl_jax.models.synthetic import byte_tokenizer

    tok = byte_tokenizer()
    tok.save(str(directory))
    return tok


def make_tiny_run_dir(directory, arch: str = "llama", **overrides) -> str:
    """An HF directory with a tiny random model (``TINY`` sizes, vocab 320) and :func:`make_byte_tokenizer`:
    a ``train.model`` for fast end-to-end trainer tests. Returns ``str(directory)``."""
    make_hf_model(arch, **dict(dict(vocab_size=320, eos_token_id=2, bos_token_id=1, pad_token_id=0), **overrides)
                  ).save_pretrained(directory)
    make_byte_tokenizer(directory)
    return str(directory)


def make_tiny_smollm2_vocab_dir(directory, **overrides) -> str:
    """An HF directory with a tiny random tied Llama (hidden 64, intermediate 128) and SmolLM2's real tokenizer
    (vocab 49152, from the packaged GGUF): the quickstart's shapes at test speed. Returns ``str(directory)``."""
    from fp8rl_jax.assets import smollm2_gguf_path
    from fp8rl_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    kw = dict(tie=True, vocab_size=tok.vocab_size, eos_token_id=2, pad_token_id=2, hidden_size=64, intermediate_size=128)
    make_hf_model("llama", **dict(kw, **overrides)).save_pretrained(directory)
    tok.save(str(directory))
    return str(directory)


def fake_cuda_tuner(monkeypatch, timer, core_count: int = 132) -> None:
    """Let :func:`fp8rl_jax.kernels.tuner.select` tune on this CPU as if on an H100: a fake CUDA device (``core_count``
    SMs) for :func:`fp8rl_jax.kernels.registry.cuda_device`, every kernel family allowed (their self-tests are their
    own tests), and each ``select`` call timed by ``timer(fn, args) -> seconds`` on the CPU device (the candidates'
    kernels must run in interpret mode: the caller patches that)."""
    from fp8rl_jax.kernels import registry, tuner

    class FakeGPU:
        device_kind = "NVIDIA H100 80GB HBM3"
        platform = "gpu"

    FakeGPU.core_count = core_count
    select, cpu = tuner.select, jax.devices("cpu")[0]
    monkeypatch.setattr(registry, "cuda_device", lambda: FakeGPU())
    monkeypatch.setattr(registry, "use_kernel", lambda family: True)
    monkeypatch.setattr(tuner, "select", lambda *a, **kw: select(*a, **dict(kw, timer=timer, device=cpu)))


def xla_flags_without(*flags: str) -> str:
    """``$XLA_FLAGS`` without the flags named (``--name`` or ``--name=value``: any value of that name goes), the
    rest kept in order."""
    names = {f.split("=", 1)[0] for f in flags}
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] not in names)


def xla_flags_for_one_device() -> str:
    """``$XLA_FLAGS`` without ``--xla_force_host_platform_device_count`` (for a process that must have one CPU
    device: the multi-process tests), keeping the rest (TEST_XLA_FLAGS)."""
    return xla_flags_without("--xla_force_host_platform_device_count")


def run_worker_script(script: str, mode: str, *args: str, devices: int = 8, timeout: int = 900) -> dict:
    """Run ``python script mode args...`` with ``devices`` host CPU devices (``XLA_FLAGS`` for that process only)
    and return the JSON object on its last stdout line (the multi-device tests' workers)."""
    import json
    import subprocess
    import sys

    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, script, mode, *args], env=env, cwd=root, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"worker {mode} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


_CUDA_VENV_WAIT = {"deadline": None, "error": None}


def _wait_for_the_lanes_cuda_venv(limit_s: float = 1800.0) -> None:
    """Under ``make test`` (FP8RL_CUDA_VENV_SETUP_RC set), the lane beside the tests runs ``make setup-cuda`` and then
    writes its exit status to that file: wait for it; fail (never skip) when it is not 0, or when it has not appeared
    ``limit_s`` after the first test that waited (one deadline for the session, and a failure is remembered).
    Elsewhere: return at once."""
    import time

    rc_file = os.environ.get("FP8RL_CUDA_VENV_SETUP_RC")
    if not rc_file:
        return
    if _CUDA_VENV_WAIT["error"]:
        pytest.fail(_CUDA_VENV_WAIT["error"])
    if _CUDA_VENV_WAIT["deadline"] is None:
        _CUDA_VENV_WAIT["deadline"] = time.monotonic() + limit_s
    while not os.path.exists(rc_file):
        if time.monotonic() > _CUDA_VENV_WAIT["deadline"]:
            _CUDA_VENV_WAIT["error"] = f"{rc_file} did not appear within {limit_s:.0f} s: make test's `make setup-cuda`"
            pytest.fail(_CUDA_VENV_WAIT["error"])
        time.sleep(5)
    with open(rc_file) as f:
        rc = f.read().strip()
    if rc != "0":
        _CUDA_VENV_WAIT["error"] = (f"make setup-cuda failed in make test's lane (exit {rc}): see "
                                    f"{os.path.join(os.path.dirname(rc_file), 'compile.log')}")
        pytest.fail(_CUDA_VENV_WAIT["error"])


def require_cuda_venv() -> str:
    """The path of the CUDA environment's Python (``.venv-cuda``, or make test's ``FP8RL_CUDA_VENV_PYTHON``: JAX's
    CUDA plugin, for deviceless sm_90a compiles): under ``make test`` once the lane has built it
    (:func:`_wait_for_the_lanes_cuda_venv`); skips the test when there is none (run ``make setup-cuda``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _wait_for_the_lanes_cuda_venv()
    cuda_py = os.environ.get("FP8RL_CUDA_VENV_PYTHON") or os.path.join(root, ".venv-cuda", "bin", "python")
    if not os.path.exists(cuda_py):
        pytest.skip("needs .venv-cuda with jax[cuda13] for the deviceless sm_90a compile: run `make setup-cuda`")
    return cuda_py


def run_in_cuda_venv(code: str, timeout: int = 600) -> dict:
    """Run ``code`` with ``.venv-cuda``'s Python (JAX's CUDA plugin, deviceless sm_90a compiles; no GPU needed) and
    return the JSON object on its last stdout line; skipped when ``.venv-cuda`` is missing (``make setup-cuda``)."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cuda_py = require_cuda_venv()
    env = {**os.environ, "PYTHONPATH": root, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    for var in ("JAX_PLATFORMS", "XLA_FLAGS"):
        env.pop(var, None)
    proc = subprocess.run([cuda_py, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
