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
  dump directory, the analysis of :mod:`fp8rl_jax.gpu_dump` (GEMM instruction forms of the PTX, ``ptxas`` per
  Pallas kernel, the kernels launched per iteration of the program's main ``while`` loop and the bytes its
  products move).

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
import time
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

# The CUDA plugin's version probes (cuda/cudnn/cublas... of the driver) fail without a driver unless skipped; the
# variable must be set before jax loads its plugins, so it is set when this module is imported (never overridden).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fp8rl_jax.gpu_dump import (custom_call_targets, find_ptxas, gemm_instruction_counts,  # noqa: E402
                                kernels_built, loop_body_gemm_bytes, loop_body_kernels, mosaic_kernel_hashes,
                                pallas_base_name, pallas_kernel_names, parse_ptxas_info, ptx_entries, ptxas_info,
                                thunk_annotations)

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
      gemm_instructions: sorted distinct GEMM instruction forms in the PTX (:func:`~fp8rl_jax.gpu_dump.gemm_instruction_forms`).
      gemm_instruction_counts: ``{form: occurrences}`` over all PTX.
      pallas_kernels: the program's Pallas kernels: Pallas-Triton ones (the names of its ``__gpu$xla.gpu.triton``
        custom calls) and Mosaic GPU ones (their entry names, from the plugin's ptxas reports).
      spills: ``{pallas kernel: {"registers", "spill_stores", "spill_loads", "stack_frame", "variants"}}`` from
        ``ptxas -v`` (bytes; the worst of the kernel's ``variants`` compiled variants: one ``pallas_call`` name at
        several shapes or settings), or None when Pallas-Triton kernels are present and no ptxas was found.
      custom_calls: ``{custom_call_target: count}`` in the optimized HLO: cuDNN (``__cudnn$fmha...``), cuBLAS
        (``__cublas$...``), Pallas-Triton (``__gpu$xla.gpu.triton``), Mosaic GPU (``mosaic_gpu_v2``), ...
      loop_body_kernels: device kernels launched per iteration of the largest ``while`` body (for a generate
        program: per decode step), from XLA's thunk sequence (:func:`~fp8rl_jax.gpu_dump.loop_body_kernels`), or None (no loop).
      loop_body_breakdown: ``{kind: count}`` of those launches (XLA fusions, Pallas kernels, XLA Triton GEMM
        fusions, cuBLAS, cuDNN, copies, ...).
      loop_body_gemm_bytes: bytes the matrix-product launches of one iteration of that loop move (results and
        distinct operands, from the optimized HLO's shapes: :func:`~fp8rl_jax.gpu_dump.loop_body_gemm_bytes`), or None.
      kernels_built: distinct XLA-fusion and Pallas-Triton kernels the program launches, sorts aside (from the
        thunk sequence: :func:`~fp8rl_jax.gpu_dump.kernels_built`; identical fusions share one build), or None
        without a dump.
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
    kernels_built: int | None = None
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
      ptxas: path of a ``ptxas`` for the spill report (default :func:`~fp8rl_jax.gpu_dump.find_ptxas`).
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
        res.kernels_built = kernels_built(thunks)
        res.loop_body_gemm_bytes = loop_body_gemm_bytes(thunks, hlo, triton, ann, targets)
    else:
        res.notes.append("no *.thunk_sequence.txt in the dump: kernels per loop iteration not counted")
    return res
