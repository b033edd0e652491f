"""Compile for an H100 (sm_90a) on a machine without one: the target, abstract meshes, and what the PTX shows.

XLA:GPU compiles whole programs for a GPU it is only told about: ``jax.experimental.topologies.get_topology_desc``
with a ``GpuTargetConfig`` text (:data:`H100_SXM_TARGET_CONFIG`) gives abstract H100 devices; arguments placed on
a mesh of them (``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec))``) make
``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",)).compile()`` build an sm_90a executable, Pallas-Triton
kernels included, with no GPU and no driver. This needs the CUDA plugin (``jax[cuda13]``, the ``.venv-cuda`` that
``make setup-cuda`` builds) and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (set here, before the plugin loads, when
unset: its version probes need a driver otherwise). Method: jax-ml/jax PR 33542 (its deviceless-compile test);
the measurements: docs/GPU_VERIFICATION.md.

Pieces:

* :func:`abstract_h100_mesh` / :func:`lowering_for_h100`: an ``AbstractMesh`` whose abstract device is an H100,
  entered with ``jax.sharding.use_abstract_mesh``. Lowering only (StableHLO with Triton custom calls) then works
  without the CUDA plugin: jax 0.11's Pallas-Triton lowering reads the GPU from that abstract device
  (``jax/_src/pallas/triton/gpu_info.py``) and fails with "No supported GPU devices found" when the default device
  is a CPU and no abstract GPU is set; jax 0.10.2 falls back to compute capability 9.0 by itself.
* :func:`h100_mesh`: a concrete-looking ``Mesh`` of 1, 8, 16 ... abstract H100s (CUDA plugin needed).
* :func:`compile_for_h100`: lower + compile one program for sm_90a, timed, with XLA's memory analysis and, given a
  dump directory, the PTX analysis (:func:`gemm_instruction_forms`, :func:`ptxas_info` per Pallas kernel) and
  the kernels launched per iteration of the program's main ``while`` loop (:func:`loop_body_kernels`).

What a compile cannot show (speed, autotuned GEMM choices, cuDNN run-time plans, numerics as executed): see
docs/GPU_VERIFICATION.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import math
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

# The CUDA plugin's version probes (cuda/cudnn/cublas... of the driver) fail without a driver unless skipped; the
# variable must be set before jax loads its plugins, so it is set when this module is imported (never overridden).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

#: ``stream_executor::GpuTargetConfigProto`` text of one NVIDIA H100 80GB HBM3 (SXM): 132 SMs, 1.98 GHz boost,
#: 3.35 TB/s, 50 MiB L2, 227 KiB opt-in shared memory per block, compute capability 9.0 (XLA compiles sm_90a),
#: cuDNN 9.7, CUDA runtime 13.0. The values of ``cudaGetDeviceProperties`` on that card (shared/GPU.md).
H100_SXM_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
#: ``device_kind`` of the card (as ``jax.devices()[0].device_kind`` reads on it) and its SM count.
H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
H100_NUM_CORES = 132
#: What :func:`compile_for_h100` targets, in words (written into result files).
TARGET_DESCRIPTION = "sm_90a H100 SXM (deviceless)"

#: where :func:`compile_for_h100` has the CUDA plugin write Mosaic GPU kernels' PTX and ptxas reports (in the dump)
MOSAIC_DUMP_SUBDIR = "mosaic_gpu"

SETUP_HINT = "run `make setup-cuda` (builds .venv-cuda with jax[cuda13]) and use .venv-cuda/bin/python"


class CudaPluginMissing(RuntimeError):
    """The running Python has no usable JAX CUDA plugin, so nothing can be compiled for the H100 here."""


def abstract_h100_mesh(axis_sizes: Sequence[int] = (1,), axis_names: Sequence[str] = ("x",),
                       axis_types: Sequence[Any] | None = None) -> jax.sharding.AbstractMesh:
    """An ``AbstractMesh`` of ``prod(axis_sizes)`` H100s (no devices, no plugin needed).

    Args:
      axis_sizes: mesh shape, e.g. ``(1,)`` or ``(1, 8, 1, 1)``.
      axis_names: one name per axis.
      axis_types: ``jax.sharding.AxisType`` per axis; default all ``Auto`` (the project's meshes are Auto, and
        jax 0.11 would otherwise default an ``AbstractMesh`` to ``Explicit``).

    Returns:
      ``AbstractMesh`` whose ``abstract_device`` is
      ``AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")``.

    Raises:
      ValueError: names and sizes of different lengths.
    """
    sizes, names = tuple(int(s) for s in axis_sizes), tuple(axis_names)
    if len(sizes) != len(names):
        raise ValueError(f"axis_sizes {sizes} and axis_names {names} differ in length")
    types = tuple(axis_types) if axis_types is not None else (jax.sharding.AxisType.Auto,) * len(sizes)
    device = jax.sharding.AbstractDevice(device_kind=H100_DEVICE_KIND, num_cores=H100_NUM_CORES, platform="gpu")
    return jax.sharding.AbstractMesh(sizes, names, types, abstract_device=device)


@contextlib.contextmanager
def lowering_for_h100(mesh=None) -> Iterator[jax.sharding.AbstractMesh]:
    """Context in which ``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` lowers Pallas for an H100.

    Enters ``jax.sharding.use_abstract_mesh`` with :func:`abstract_h100_mesh` (shape of ``mesh`` when given: a
    ``Mesh`` or ``AbstractMesh``, whose axis names, sizes and types are kept; else one device). Public JAX API
    only, with or without the CUDA plugin and a GPU: tested with jax 0.10.2; jax 0.11's ``AbstractDevice``,
    ``AbstractMesh`` and ``use_abstract_mesh`` take the same arguments (its source). Yields the abstract mesh.
    """
    if mesh is None:
        am = abstract_h100_mesh()
    else:
        src = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
        am = abstract_h100_mesh(src.axis_sizes, src.axis_names, src.axis_types)
    with jax.sharding.use_abstract_mesh(am):
        yield am


def cuda_plugin_available() -> bool:
    """True when this Python can build H100 topologies (the ``jax[cuda13]`` plugin is installed and loads)."""
    try:
        h100_topology(1)
    except CudaPluginMissing:
        return False
    return True


@functools.lru_cache(maxsize=8)
def h100_topology(num_devices: int = 1):
    """``jax.experimental.topologies.TopologyDescription`` of ``num_devices`` H100s on one host.

    The topology string is ``"1x1x{n}"`` (the CUDA plugin's ``<partitions>x<hosts per partition>x<devices per
    host>``: one host with ``n`` devices; it also accepts e.g. ``"1x2x8"``, 16 devices on two hosts).

    Raises:
      CudaPluginMissing: no CUDA plugin in this Python (the message names ``make setup-cuda``).
      ValueError: ``num_devices < 1``.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(platform="cuda", target_config=H100_SXM_TARGET_CONFIG,
                                            topology=f"1x1x{num_devices}")
    except Exception as e:  # jaxlib raises RuntimeError/ValueError/XlaRuntimeError, by version
        raise CudaPluginMissing(f"cannot describe an H100 topology in this Python ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}): {SETUP_HINT}") from None


def h100_mesh(shape: Sequence[int] = (1,), names: Sequence[str] = ("x",), axis_types: Sequence[Any] | None = None):
    """A ``jax.sharding.Mesh`` over ``prod(shape)`` abstract H100s (CUDA plugin needed, no GPU).

    Programs whose arguments are placed on it (``NamedSharding(mesh, spec)``) compile for sm_90a. For the project's
    four-axis meshes pass ``devices=h100_topology(n).devices`` to :func:`fp8rl_jax.parallel.mesh.make_mesh` instead.

    Args:
      shape: mesh shape, e.g. ``(1,)``, ``(8,)``, ``(2, 4)``.
      names: one axis name per dimension.
      axis_types: per axis; default all ``AxisType.Auto``.

    Raises:
      CudaPluginMissing: see :func:`h100_topology`.
      ValueError: names and shape of different lengths.
    """
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and names {names} differ in length")
    devs = h100_topology(math.prod(shape)).devices
    types = tuple(axis_types) if axis_types is not None else (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.sharding.Mesh(np.array(devs).reshape(shape), names, axis_types=types)


def on_mesh(tree, mesh):
    """Abstract arguments for a deviceless compile: every array-like leaf of ``tree`` as a ``ShapeDtypeStruct``.

    A leaf that already has a ``NamedSharding`` on H100 devices keeps it; one with a ``NamedSharding`` on another
    mesh of the same axis names and sizes (the CPU mesh of a test) gets the same ``PartitionSpec`` on ``mesh``; every
    other leaf is replicated on ``mesh`` (``PartitionSpec()``). Python scalars, None and other non-array leaves are
    left as they are (static or weakly typed arguments)."""
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(mesh, PartitionSpec())

    def conv(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and isinstance(sh.mesh, jax.sharding.Mesh):
            if _is_h100_mesh(sh.mesh):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            if dict(sh.mesh.shape) == dict(mesh.shape):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, sh.spec))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

    return jax.tree.map(conv, tree)


def _is_h100_mesh(mesh) -> bool:
    return all(getattr(d, "device_kind", "") == H100_DEVICE_KIND for d in mesh.devices.flat)


@dataclasses.dataclass
class H100Compile:
    """One program compiled for sm_90a (:func:`compile_for_h100`).

    Attributes:
      compiled: the ``jax.stages.Compiled`` executable (not runnable here: it only describes the H100 program).
      compile_s: seconds of trace + lower + XLA:GPU compile (wall clock, this process).
      temp_bytes: XLA:GPU's temporary buffer bytes per device (``memory_analysis().temp_size_in_bytes``).
      memory: bytes per device: ``arguments``, ``outputs``, ``aliased``, ``temp``, ``generated_code``.
      dump_dir: where XLA dumped the program (None without one); the fields below need it.
      gemm_instructions: sorted distinct GEMM instruction forms in the PTX (:func:`gemm_instruction_forms`).
      gemm_instruction_counts: ``{form: occurrences}`` over all PTX.
      pallas_kernels: the program's Pallas kernels: Pallas-Triton ones (the names of its ``__gpu$xla.gpu.triton``
        custom calls) and Mosaic GPU ones (their entry names, from the plugin's ptxas reports).
      spills: ``{pallas kernel: {"registers", "spill_stores", "spill_loads", "stack_frame", "variants"}}`` from
        ``ptxas -v`` (bytes; the worst of the kernel's ``variants`` compiled variants: one ``pallas_call`` name at
        several shapes or settings), or None when Pallas-Triton kernels are present and no ptxas was found.
      custom_calls: ``{custom_call_target: count}`` in the optimized HLO: cuDNN (``__cudnn$fmha...``), cuBLAS
        (``__cublas$...``), Pallas-Triton (``__gpu$xla.gpu.triton``), Mosaic GPU (``mosaic_gpu_v2``), ...
      loop_body_kernels: device kernels launched per iteration of the largest ``while`` body (for a generate
        program: per decode step), from XLA's thunk sequence (:func:`loop_body_kernels`), or None (no loop).
      loop_body_breakdown: ``{kind: count}`` of those launches (XLA fusions, Pallas kernels, XLA Triton GEMM
        fusions, cuBLAS, cuDNN, copies, ...).
      loop_body_gemm_bytes: bytes the matrix-product launches of one iteration of that loop move (results and
        distinct operands, from the optimized HLO's shapes: :func:`loop_body_gemm_bytes`), or None.
      notes: anything the analysis could not do, in words.

    Registers and spills are read from ptxas's report; kernel kinds and counts from XLA's thunk sequence, which
    lists the compiled program's launches in order, memcpys included (counting the fusions and custom calls of the
    loop body in the optimized HLO, ``*gpu_after_optimizations.txt``, gives the same number: 57 and 57 for the bf16
    engine at Qwen3-8B widths, 2 layers).
    """

    compiled: Any
    compile_s: float
    temp_bytes: int
    memory: dict
    dump_dir: str | None = None
    gemm_instructions: list = dataclasses.field(default_factory=list)
    gemm_instruction_counts: dict = dataclasses.field(default_factory=dict)
    pallas_kernels: list = dataclasses.field(default_factory=list)
    spills: dict | None = None
    custom_calls: dict = dataclasses.field(default_factory=dict)
    loop_body_kernels: int | None = None
    loop_body_breakdown: dict = dataclasses.field(default_factory=dict)
    loop_body_gemm_bytes: int | None = None
    notes: list = dataclasses.field(default_factory=list)


def compile_for_h100(fn: Callable, *args, mesh=None, dump_dir: str | None = None, ptxas: str | None = None,
                     **static_kwargs) -> H100Compile:
    """Lower and compile ``fn(*args, **static_kwargs)`` for one or more H100s (sm_90a) on this machine.

    Args:
      fn: a function, or a ``jax.jit``-wrapped one (its own ``static_argnames`` then apply to ``static_kwargs``).
        A plain function is wrapped as ``jax.jit(functools.partial(fn, **static_kwargs))``.
      *args: arrays, ``jax.ShapeDtypeStruct`` s or pytrees of them (only shapes, dtypes and shardings are used):
        leaves without a ``NamedSharding`` on H100 devices are placed replicated on ``mesh`` (:func:`on_mesh`).
      mesh: the H100 mesh the arguments live on (default :func:`h100_mesh` of one device).
      dump_dir: XLA dump directory for this program (``xla_dump_to``; LLVM IR not dumped). Given, the result
        carries the PTX and thunk analyses. Reuse across programs mixes their files: use one directory each.
      ptxas: path of a ``ptxas`` for the spill report (default :func:`find_ptxas`).
      **static_kwargs: keyword arguments of ``fn`` (static ones for a jitted ``fn``).

    Returns:
      :class:`H100Compile`.

    Raises:
      CudaPluginMissing: no CUDA plugin in this Python (one line naming ``make setup-cuda``).
      Any tracing, lowering or XLA compile error of the program, unchanged.
    """
    if mesh is None:
        mesh = h100_mesh()
    args = on_mesh(args, mesh)
    jitted = fn if hasattr(fn, "trace") else jax.jit(functools.partial(fn, **static_kwargs))
    kwargs = static_kwargs if hasattr(fn, "trace") else {}
    options = {}
    env = {}
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options = {"xla_dump_to": os.path.abspath(dump_dir), "xla_gpu_dump_llvmir": False}
        # Mosaic GPU kernels are compiled by the CUDA plugin itself (not in XLA's dump); it writes their PTX and
        # ptxas report where these variables say, read at each Mosaic GPU compile
        env = {"MOSAIC_GPU_DUMP_TO": os.path.abspath(os.path.join(dump_dir, MOSAIC_DUMP_SUBDIR)),
               "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}
        os.makedirs(env["MOSAIC_GPU_DUMP_TO"], exist_ok=True)
    t0 = time.perf_counter()
    with _environ(env), lowering_for_h100(mesh):
        lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
        compiled = lowered.compile(options)
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    memory = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
              "aliased": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
              "generated_code": int(m.generated_code_size_in_bytes)}
    res = H100Compile(compiled=compiled, compile_s=compile_s, temp_bytes=memory["temp"], memory=memory,
                      dump_dir=dump_dir)
    if dump_dir is not None:
        analyze_dump(res, ptxas=ptxas)
    return res


@contextlib.contextmanager
def _environ(values: dict):
    """Set environment variables inside the block (restored after)."""
    prev = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compile_error_summary(e: BaseException, max_lines: int = 10) -> str:
    """The lines of a trace/lower/compile exception that say what went wrong, as text: the whole message when it is
    short; else its first line, the final exception line(s) of a Python traceback XLA embeds in its message (a
    custom partitioner's, a callback's) and the first frames of JAX's "Suspected Python Code Location" (where in the
    project's code the failing op was staged)."""
    lines = [x.rstrip() for x in f"{type(e).__name__}: {e}".strip().splitlines() if x.strip()]
    if len(lines) <= max_lines:
        return "\n".join(lines)
    keep = [lines[0]]
    keep += [x.strip() for x in lines[1:] if re.match(r"^\s*[A-Za-z_][\w.]*(Error|Exception)\b.*", x)][-2:]
    if "Suspected Python Code Location:" in lines:
        i = lines.index("Suspected Python Code Location:")
        keep += ["Suspected Python Code Location:"] + [x.strip() for x in lines[i + 1:i + 6]]
    return "\n".join(keep[:max_lines + 6])


# --------------------------------------------------------------------------------------------------------------------
# Reading XLA's dump: PTX GEMM instructions, ptxas register/spill report, kernels per loop iteration.

# A GEMM instruction of PTX: Hopper's warpgroup MMA (``wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3``) or
# the warp-level MMA (``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``), sparse forms included. The
# wgmma fence/commit/wait instructions are not GEMMs and do not match.
_GEMM_RE = re.compile(r"(?<![\w.])(wgmma\.mma_async(?:\.sp)?(?:\.[\w:]+)+|mma(?:\.sp(?:::ordered_metadata)?)?"
                      r"\.sync(?:\.[\w:]+)+)")
_ENTRY_RE = re.compile(r"^\s*\.(?:visible\s+)?\.entry\s+([\w$.]+)\s*\(", re.M)


def _strip_ptx_comments(ptx: str) -> str:
    ptx = re.sub(r"/\*.*?\*/", "", ptx, flags=re.S)
    return re.sub(r"//[^\n]*", "", ptx)


def gemm_instruction_counts(ptx_texts: str | Sequence[str]) -> dict[str, int]:
    """``{instruction form: occurrences}`` of the GEMM instructions in PTX text(s) (comments ignored).

    A form is the full opcode with its modifiers and operand types, e.g.
    ``wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3`` (FP8 tensor cores, Hopper) or
    ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` (warp MMA, f16 operands).
    """
    texts = [ptx_texts] if isinstance(ptx_texts, str) else list(ptx_texts)
    c: Counter = Counter()
    for t in texts:
        c.update(_GEMM_RE.findall(_strip_ptx_comments(t)))
    return dict(sorted(c.items()))


def gemm_instruction_forms(ptx_texts: str | Sequence[str]) -> list[str]:
    """Sorted distinct GEMM instruction forms in PTX text(s) (see :func:`gemm_instruction_counts`)."""
    return sorted(gemm_instruction_counts(ptx_texts))


def ptx_entries(ptx: str) -> list[str]:
    """Names of the kernels (``.entry`` functions) defined in a PTX text."""
    return _ENTRY_RE.findall(ptx)


def parse_ptxas_info(text: str) -> dict[str, dict[str, int]]:
    """``{function: {"registers", "spill_stores", "spill_loads", "stack_frame"}}`` from ``ptxas -v`` output.

    Reads the lines ``Function properties for NAME`` / ``N bytes stack frame, S bytes spill stores, L bytes spill
    loads`` / ``Used R registers`` (the register line follows its entry's ``Compiling entry function 'NAME'``).
    Spills and the stack frame are bytes; device functions without a register line get ``registers`` -1.
    """
    out: dict[str, dict[str, int]] = {}
    props_for = entry = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = m.group(1)
            out.setdefault(entry, {"registers": -1, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props_for = m.group(1)
            out.setdefault(props_for, {"registers": -1, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props_for is not None:
            out[props_for].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
            props_for = None
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
            entry = None
    return out


def find_ptxas() -> str | None:
    """Path of a ``ptxas`` that knows sm_90a: ``$PTXAS``, the ``nvidia-cuda-nvcc`` wheel of this Python
    (``site-packages/nvidia/cu13/bin/ptxas``, installed by ``jax[cuda13]``), else ``ptxas`` on ``PATH``; or None."""
    env = os.environ.get("PTXAS")
    if env and os.path.isfile(env):
        return env
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for base in list(getattr(nvidia, "__path__", [])):
            for cand in sorted(glob.glob(os.path.join(base, "*", "bin", "ptxas"))):
                if os.access(cand, os.X_OK):
                    return cand
    except ImportError:
        pass
    return shutil.which("ptxas")


def ptxas_info(ptx_path: str, ptxas: str | None = None, arch: str = "sm_90a") -> dict[str, dict[str, int]]:
    """Run ``ptxas -v --gpu-name {arch}`` on one PTX file; :func:`parse_ptxas_info` of its report.

    Raises:
      FileNotFoundError: no ptxas (:func:`find_ptxas`).
      RuntimeError: ptxas failed (its first error lines).
    """
    exe = ptxas or find_ptxas()
    if exe is None:
        raise FileNotFoundError("no ptxas found (set PTXAS, or install jax[cuda13]'s nvidia-cuda-nvcc wheel)")
    r = subprocess.run([exe, "-v", "--gpu-name", arch, "-o", os.devnull, ptx_path], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}: {' '.join((r.stderr or r.stdout).strip().splitlines()[:3])}")
    return parse_ptxas_info(r.stdout + "\n" + r.stderr)


def pallas_base_name(kernel: str, pallas: Sequence[str]) -> str | None:
    """The Pallas kernel name (of ``pallas``) that a PTX entry or thunk name stands for, or None: XLA names a
    kernel's further variants (other shapes or settings of one ``pallas_call`` name) ``NAME__1``, ``NAME__2``, ..."""
    if kernel in pallas:
        return kernel
    base, sep, num = kernel.rpartition("__")
    if sep and num.isdigit() and base in pallas:
        return base
    return None


def pallas_kernel_names(hlo_text: str) -> list[str]:
    """Names of the Pallas-Triton kernels in an HLO text: the ``name`` of each ``__gpu$xla.gpu.triton``
    custom call's backend config (sorted, distinct)."""
    names = set()
    for line in hlo_text.splitlines():
        if "__gpu$xla.gpu.triton" in line:
            m = re.search(r'\bname = "([^"]+)"', line)
            if m:
                names.add(m.group(1))
    return sorted(names)


# Thunk kinds (XLA:GPU ``Thunk::Kind`` names as the thunk-sequence dump prints them) that do not launch device work.
_CONTROL_THUNKS = {"kWhile", "kConditional", "kSequential", "kCommandBuffer", "kWaitForStreams", "kPartitionId",
                   "kReplicaId", "kInfeed", "kOutfeed", "kHostSend", "kHostRecv", "kHostSendDone", "kHostRecvDone",
                   "kDynamicSlice"}


def _parse_thunk_sequence(text: str) -> list[tuple[int, str, str, int]]:
    """``[(indent, kind, name, thunk id)]`` of the ``NNN: kKind [...] name ...`` lines, and the section markers as
    ``(indent, "condition:" / "body:" ..., "", -1)``."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        m = re.match(r"\s*(\d+):\s+(k\w+)\s+\[[^\]]*\]\s*(\S*)", line)
        if m:
            rows.append((indent, m.group(2), m.group(3), int(m.group(1))))
        elif line.strip().endswith(":"):
            rows.append((indent, line.strip(), "", -1))
    return rows


def loop_bodies(thunk_text: str) -> list[list[tuple[int, str, str, int]]]:
    """The thunks of every ``while`` body in a thunk-sequence dump (``*.thunk_sequence.txt``), in dump order
    (outer loops before the loops they contain): each a list of ``(indent, kind, name, thunk id)``, nested loops'
    condition and body thunks included (they run in every iteration of the outer body).

    The dump lists a loop's condition and body thunks below the ``kWhile`` line, indented one level deeper
    (``condition:`` / ``body:`` markers between them; a marker's own indentation is not reliable). A loop's body
    starts at the first ``body:`` marker whose next thunk sits at the loop's own level."""
    rows = _parse_thunk_sequence(thunk_text)
    out = []
    for i, (ind, kind, _, _) in enumerate(rows):
        if kind != "kWhile":
            continue
        region = []
        for r in rows[i + 1:]:
            if r[1].startswith("k") and r[0] <= ind:
                break  # the next thunk at the loop's own level or above
            region.append(r)
        thunks = [r for r in region if r[1].startswith("k")]
        if not thunks:
            out.append([])
            continue
        level = min(r[0] for r in thunks)
        body, in_body = [], False
        for j, r in enumerate(region):
            if not r[1].startswith("k"):
                if r[1] == "body:" and not in_body:
                    nxt = next((x for x in region[j + 1:] if x[1].startswith("k")), None)
                    in_body = nxt is not None and nxt[0] == level
                continue
            if in_body:
                body.append(r)
        out.append(body)
    return out


def thunk_annotations(metadata_text: str) -> dict[int, str]:
    """``{thunk id: HLO instruction name}`` from a ``*.thunk_metadata.txt`` dump (``profile_annotation``)."""
    out = {}
    for block in re.findall(r"thunk_info\s*\{(.*?)\}", metadata_text, flags=re.S):
        name = re.search(r'profile_annotation:\s*"([^"]*)"', block)
        tid = re.search(r"thunk_id:\s*(\d+)", block)
        if name and tid:
            out[int(tid.group(1))] = name.group(1)
    return out


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """``{instruction name: custom_call_target}`` of every custom call in an HLO text."""
    out = {}
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?custom-call\([^\n]*?custom_call_target=\"([^\"]+)\"", hlo_text):
        out[m.group(1)] = m.group(2)
    return out


def classify_thunk(kind: str, name: str, pallas: Sequence[str] = (), target: str | None = None) -> str | None:
    """What one thunk launches: ``"pallas"`` (a named Pallas-Triton kernel), ``"mosaic_gpu"`` (a Pallas Mosaic GPU
    kernel), ``"triton_gemm"`` (XLA's own Triton GEMM fusion), ``"fusion"`` (other XLA kernel), ``"cublas"``,
    ``"cudnn"``, ``"custom_call"`` (another custom call), ``"copy"`` (device-to-device memcpy), ``"collective"``,
    ``"other"``; None for control-flow thunks. ``target``: the custom-call target of a ``kCustomCall`` thunk
    (:func:`custom_call_targets`), when known."""
    if kind in _CONTROL_THUNKS:
        return None
    if kind in ("kCustomKernel", "kKernel", "kTriton"):
        if pallas_base_name(name, pallas) is not None:
            return "pallas"
        return "triton_gemm" if name.startswith(("gemm_fusion", "triton_gemm", "dot_fusion")) else "fusion"
    if kind in ("kGemm", "kCublasLtMatmul"):
        return "cublas"
    if kind.startswith("kCuDnn") or kind == "kConvolution":
        return "cudnn"
    if kind in ("kCustomCall", "kFfi"):
        t = (target or "").lower()
        if "mosaic_gpu" in t:
            return "mosaic_gpu"
        if "cudnn" in t:
            return "cudnn"
        if "cublas" in t:
            return "cublas"
        return "custom_call"
    if kind in ("kCopy", "kMemcpy", "kMemset32BitValue", "kMemzero", "kDeviceToDevice"):
        return "copy"
    if kind.startswith(("kAll", "kReduceScatter", "kCollective", "kNccl", "kRagged", "kSend", "kRecv")):
        return "collective"
    return "other"


def loop_body_kernels(thunk_text: str, pallas: Sequence[str] = (), annotations: dict[int, str] | None = None,
                      targets: dict[str, str] | None = None) -> tuple[int | None, dict[str, int]]:
    """Device launches per iteration of the largest ``while`` body in a thunk-sequence dump.

    For an engine's generate program that loop is the decode loop, so the count is the kernels per decode step
    (each layer's fusions, GEMMs and Pallas kernels plus sampling and bookkeeping). Every launching thunk counts
    once (:func:`classify_thunk`), memcpys included; a nested loop's thunks count once per listing (its trip
    count is not multiplied in).

    Args:
      thunk_text: a ``*.thunk_sequence.txt`` dump.
      pallas: Pallas-Triton kernel names (:func:`pallas_kernel_names`).
      annotations, targets: :func:`thunk_annotations` and :func:`custom_call_targets` of the same program, to tell
        a custom call's kind (Mosaic GPU, cuDNN, cuBLAS).

    Returns:
      ``(count, {kind: count})``, or ``(None, {})`` when the program has no loop.
    """
    annotations, targets = annotations or {}, targets or {}
    best = None
    for body in loop_bodies(thunk_text):
        kinds = Counter()
        for _, kind, name, tid in body:
            k = classify_thunk(kind, name, pallas, targets.get(annotations.get(tid, ""), None))
            if k is not None:
                kinds[k] += 1
        n = sum(kinds.values())
        if best is None or n > best[0]:
            best = (n, dict(sorted(kinds.items())))
    return best if best is not None else (None, {})


# Bytes per element of the HLO element types that appear in these programs' kernels.
_HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2,
                    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
# Launch kinds (:func:`classify_thunk`) that are matrix products: what :func:`loop_body_gemm_bytes` sums.
GEMM_KINDS = ("pallas", "mosaic_gpu", "triton_gemm", "cublas")


def hlo_shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape text (``f32[8,1,6144]{2,1,0}``, a tuple ``(bf16[2,3], s32[])``: the sum of its arrays).

    Raises:
      ValueError: an element type not in the table (named)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
        if dtype not in _HLO_DTYPE_BYTES:
            raise ValueError(f"hlo_shape_bytes: unknown HLO element type {dtype!r} in {shape[:80]!r}")
        total += _HLO_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def hlo_instructions(hlo_text: str) -> dict[str, tuple[int, list[str]]]:
    """``{instruction name: (result bytes, [operand names])}`` of every instruction in an HLO text (names are
    unique within a module). Operands are the ``%names`` between the opcode's parentheses."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", hlo_text, flags=re.M):
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):  # tuple shape: up to its matching parenthesis
            depth = 0
            for i, ch in enumerate(rest):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
            shape, rest = rest[:i + 1], rest[i + 1:]
        else:
            shape, _, rest = rest.partition(" ")
        args = re.match(r"\s*[\w\-]+\(([^)]*)\)", rest)
        out[name] = (hlo_shape_bytes(shape), re.findall(r"%([\w.\-]+)", args.group(1)) if args else [])
    return out


def _largest_loop_body(thunk_text, pallas, annotations, targets):
    """``(body thunks with their kind, {kind: count})`` of the ``while`` body with the most launches, or None."""
    best = None
    for body in loop_bodies(thunk_text):
        rows = [(tid, classify_thunk(kind, name, pallas, targets.get(annotations.get(tid, ""), None)))
                for _, kind, name, tid in body]
        rows = [(tid, k) for tid, k in rows if k is not None]
        if best is None or len(rows) > len(best):
            best = rows
    return best


def loop_body_gemm_bytes(thunk_text: str, hlo_text: str, pallas: Sequence[str] = (),
                         annotations: dict[int, str] | None = None,
                         targets: dict[str, str] | None = None) -> int | None:
    """Bytes the matrix-product launches (:data:`GEMM_KINDS`) of one iteration of the largest ``while`` body move:
    for each launch, its result plus each distinct operand buffer once, from the shapes in the optimized HLO.

    For a generate program's decode loop this is what its linears (and XLA's attention dots over the KV cache)
    read and write per token: the weights, their scales, the activations and any split-K partials. A kernel
    that reads an operand once (the project's decode and Mosaic GEMMs read each weight tile in exactly one
    program) moves exactly this; an operand passed twice (the fused gate|up stack read as two halves) counts
    once. Per layer: the difference between two layer counts, as for :func:`loop_body_kernels`.

    Returns None when the program has no loop or a launch has no HLO instruction (no thunk metadata)."""
    annotations, targets = annotations or {}, targets or {}
    body = _largest_loop_body(thunk_text, pallas, annotations, targets)
    if body is None:
        return None
    instr = hlo_instructions(hlo_text)
    total = 0
    for tid, kind in body:
        if kind not in GEMM_KINDS:
            continue
        name = annotations.get(tid)
        if name not in instr:
            return None
        out_bytes, operands = instr[name]
        total += out_bytes + sum(instr[o][0] for o in dict.fromkeys(operands) if o in instr)
    return total


def _worst(cur: dict | None, new: dict) -> dict:
    """Keep the variant with the most spilled bytes (then registers); count the variants."""
    new = dict(new, variants=1 + (cur["variants"] if cur else 0))
    if cur is None or (new["spill_stores"], new["registers"]) > (cur["spill_stores"], cur["registers"]):
        return new
    return dict(cur, variants=new["variants"])


_INFO_KEYS = ("registers", "spill_stores", "spill_loads", "stack_frame")


# Mosaic GPU kernels compiled in this process, by the ``kernel_hash`` of their ``mosaic_gpu_v2`` custom call: the
# plugin compiles a kernel once per process ("Found Mosaic GPU kernel in cache") and dumps it only then, so a later
# program with the same kernel finds its PTX and ptxas report here. Values: [(file stem, PTX, ptxas report)].
_MOSAIC_SEEN: dict[str, list[tuple[str, str, str]]] = {}


def mosaic_kernel_hashes(hlo_text: str) -> list[str]:
    """The ``kernel_hash`` of every Mosaic GPU custom call in an HLO text, distinct, in order of appearance."""
    out = []
    for line in hlo_text.splitlines():
        if "mosaic_gpu" not in line:
            continue
        for h in re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', line):
            if h not in out:
                out.append(h)
    return out


def _mosaic_kernels(res: H100Compile, hlo: str, mosaic_dir: str) -> list[tuple[str, str, str]]:
    """This program's Mosaic GPU kernels as ``(stem, PTX, ptxas report)``: the ones compiled (and dumped) by this
    compile, and, for kernels the plugin took from its in-process cache, the dump of the compile that built them
    (:data:`_MOSAIC_SEEN`). When one compile builds several new kernels, each is recorded with all of them (the dump
    does not say which file belongs to which hash), so a later program that reuses only some may list a few more."""
    new = []
    for ptx_path in sorted(glob.glob(os.path.join(mosaic_dir, "*.ptx"))):
        if os.path.getsize(ptx_path) == 0:
            continue
        rep_path = ptx_path[:-4] + ".ptxas"
        report = open(rep_path, errors="replace").read() if os.path.exists(rep_path) else ""
        new.append((os.path.basename(ptx_path)[:-4], open(ptx_path, errors="replace").read(), report))
    hashes = mosaic_kernel_hashes(hlo)
    unseen = [h for h in hashes if h not in _MOSAIC_SEEN]
    if unseen and new:
        for h in unseen:
            _MOSAIC_SEEN[h] = list(new)
    elif unseen:
        res.notes.append(f"{len(unseen)} Mosaic GPU kernel(s) compiled earlier in this process without a dump: "
                         "not analyzed")
    out, keys = list(new), {(k[0], hash(k[1])) for k in new}
    for h in hashes:
        for k in _MOSAIC_SEEN.get(h, []):
            if (k[0], hash(k[1])) not in keys:
                keys.add((k[0], hash(k[1])))
                out.append(k)
    return out


def analyze_dump(res: H100Compile, ptxas: str | None = None) -> H100Compile:
    """Fill ``res``'s PTX/thunk fields from its ``dump_dir`` (the dump of one program).

    GEMM instruction forms over every PTX (XLA's ``*.ptx`` and the Mosaic GPU kernels' under
    :data:`MOSAIC_DUMP_SUBDIR`); Pallas-Triton kernel names from the optimized HLO and their ``ptxas -v`` report
    (ptxas run on the PTX files holding them); Mosaic GPU kernels' reports from the ``*.ptxas`` files the plugin
    wrote; kernels per iteration of the largest loop from the thunk sequence. When the directory holds several
    compiled modules, the one with the largest optimized HLO is analyzed (a note says so). Returns ``res``.
    """
    d = res.dump_dir
    hlo_files = sorted(glob.glob(os.path.join(d, "*gpu_after_optimizations.txt")),
                       key=lambda p: -os.path.getsize(p))
    if not hlo_files:
        res.notes.append("no *gpu_after_optimizations.txt in the dump")
        prefix = ""
    else:
        prefix = os.path.basename(hlo_files[0]).split(".")[0]  # module_NNNN
        if len(hlo_files) > 1:
            res.notes.append(f"{len(hlo_files)} modules in the dump; analyzed {prefix}")
    hlo = open(hlo_files[0], errors="replace").read() if hlo_files else ""
    ptx_files = [p for p in sorted(glob.glob(os.path.join(d, f"{prefix}*.ptx"))) if os.path.getsize(p) > 0]
    texts = {p: open(p, errors="replace").read() for p in ptx_files}
    mosaic_kernels = _mosaic_kernels(res, hlo, os.path.join(d, MOSAIC_DUMP_SUBDIR))
    res.gemm_instruction_counts = gemm_instruction_counts(list(texts.values()) + [k[1] for k in mosaic_kernels])
    res.gemm_instructions = sorted(res.gemm_instruction_counts)
    triton = pallas_kernel_names(hlo)
    res.custom_calls = dict(sorted(Counter(custom_call_targets(hlo).values()).items()))
    spills: dict[str, dict[str, int]] = {}
    # Mosaic GPU kernels: the plugin ran ptxas itself and wrote its report beside each kernel's PTX
    mosaic = set()
    for _, _, report in mosaic_kernels:
        for entry, info in parse_ptxas_info(report).items():
            if info["registers"] < 0:
                continue
            mosaic.add(entry)
            spills[entry] = _worst(spills.get(entry), {k: info[k] for k in _INFO_KEYS})
    res.pallas_kernels = sorted(set(triton) | mosaic)
    exe = ptxas or find_ptxas()
    if exe is None and triton:
        res.notes.append("no ptxas found: Pallas-Triton kernels' spills not measured")
    elif triton:
        for p in ptx_files:  # Pallas-Triton kernels: entries NAME, NAME__1, ... in XLA's dump
            entries = [(e, pallas_base_name(e, triton)) for e in ptx_entries(texts[p])]
            entries = [(e, b) for e, b in entries if b is not None]
            if not entries:
                continue
            info = ptxas_info(p, exe)
            for e, base in entries:
                if e in info:
                    spills[base] = _worst(spills.get(base), {k: info[e][k] for k in _INFO_KEYS})
        missing = set(triton) - set(spills)
        if missing:
            res.notes.append(f"no PTX found for Pallas kernels {sorted(missing)}")
    res.spills = dict(sorted(spills.items())) if (exe is not None or not triton) else None
    thunk_files = sorted(glob.glob(os.path.join(d, f"{prefix}*.thunk_sequence.txt")))
    if thunk_files:
        meta = sorted(glob.glob(os.path.join(d, f"{prefix}*.thunk_metadata.txt")))
        ann = thunk_annotations(open(meta[0]).read()) if meta else {}
        thunks, targets = open(thunk_files[0]).read(), custom_call_targets(hlo)
        res.loop_body_kernels, res.loop_body_breakdown = loop_body_kernels(thunks, triton, ann, targets)
        res.loop_body_gemm_bytes = loop_body_gemm_bytes(thunks, hlo, triton, ann, targets)
    else:
        res.notes.append("no *.thunk_sequence.txt in the dump: kernels per loop iteration not counted")
    return res
