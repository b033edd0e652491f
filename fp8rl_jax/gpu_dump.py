"""Readers of XLA:GPU's dump and of compile errors, as text (no JAX needed): the GEMM instruction forms of PTX,
ptxas's register/spill report, Pallas kernel names and custom-call targets of an optimized HLO, the kernels launched
per iteration of a ``while`` loop (XLA's thunk sequence) and the bytes its matrix products move (the HLO's shapes),
and the loops of a kernel's PTX with the instructions one iteration issues (:func:`ptx_loops`, :func:`wgmma_loop`:
what :mod:`fp8rl_jax.kernel_roofline` reads per weight byte).

:mod:`fp8rl_jax.gpu_target` compiles for an H100 and applies these to its dump (``analyze_dump``); the fields they
fill are described in docs/GPU_VERIFICATION.md. Formats read: PTX ISA (``wgmma`` / ``mma`` instruction names),
``ptxas -v`` output, and XLA's ``--xla_dump_to`` files (``*.thunk_sequence.txt``, ``*.thunk_metadata.txt``,
``*gpu_after_optimizations.txt``) as XLA 0.10 writes them.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import shutil
import subprocess
from collections import Counter
from typing import Sequence


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


def find_cuda_tool(name: str, env_var: str) -> str | None:
    """Path of the CUDA command-line tool ``name``: ``$<env_var>`` when it names a file, else the NVIDIA wheels of
    this Python (``site-packages/nvidia/<cuXX>/bin/<name>``), else ``name`` on ``PATH``; or None."""
    env = os.environ.get(env_var)
    if env and os.path.isfile(env):
        return env
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for base in list(getattr(nvidia, "__path__", [])):
            for cand in sorted(glob.glob(os.path.join(base, "*", "bin", name))):
                if os.access(cand, os.X_OK):
                    return cand
    except ImportError:
        pass
    return shutil.which(name)


def find_ptxas() -> str | None:
    """Path of a ``ptxas`` that knows sm_90a: ``$PTXAS``, the ``nvidia-cuda-nvcc`` wheel of this Python
    (``site-packages/nvidia/cu13/bin/ptxas``, installed by ``jax[cuda13]``), else ``ptxas`` on ``PATH``; or None
    (:func:`find_cuda_tool`)."""
    return find_cuda_tool("ptxas", "PTXAS")


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


def kernels_built(thunk_text: str) -> int:
    """Distinct device kernels a program's thunk sequence (``*.thunk_sequence.txt``) launches, sorts aside: the names
    of its ``kKernel`` / ``kCustomKernel`` thunks (XLA fusions and Pallas-Triton kernels; Mosaic GPU kernels are custom
    calls, counted by :func:`mosaic_kernel_hashes`).

    XLA:GPU builds a fusion once and launches it wherever an identical one recurs (its kernel reuse by fingerprint): the
    thunks of a reused kernel carry the first one's name. So the count is the number of kernels XLA generated LLVM IR
    and PTX for, and it stays flat as decoder layers are added unless some fusion differs from layer to layer (e.g. a
    per-layer constant fused in: issue 37 item 5). Sort kernels (``sort_<n>``, ``sort_<n>_1__<m>``: XLA's sort emitter
    builds every sort's own kernels, never reusing them; MoE routing's top-k and expert grouping are two sorts per layer
    and step) are left out: they recur per layer whatever the model code does, and each builds quickly (Qwen3-30B-A3B, 2
    to 6 layers deviceless: about 0.5 s per added layer with its 4 sorts, no less without them)."""
    return len({name for _, kind, name, _ in _parse_thunk_sequence(thunk_text)
                if kind in ("kKernel", "kCustomKernel") and name
                and not re.fullmatch(r"sort[_\d]*", name)})


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


def _largest_loop_body(thunk_text, pallas, annotations, targets) -> list[tuple[int, str]] | None:
    """``[(thunk id, launch kind)]`` of the launching thunks (:func:`classify_thunk`) of the ``while`` body with the
    most launches, or None when the program has no loop."""
    best = None
    for body in loop_bodies(thunk_text):
        rows = [(tid, classify_thunk(kind, name, pallas, targets.get(annotations.get(tid, ""), None)))
                for _, kind, name, tid in body]
        rows = [(tid, k) for tid, k in rows if k is not None]
        if best is None or len(rows) > len(best):
            best = rows
    return best


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
    body = _largest_loop_body(thunk_text, pallas, annotations or {}, targets or {})
    if body is None:
        return None, {}
    return len(body), dict(sorted(Counter(k for _, k in body).items()))


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


# --------------------------------------------------------------------------------------------------------------------
# Reading a kernel's PTX loops: the instructions one iteration of a (wgmma) loop issues per thread.

# PTX line directives that carry no ``;`` (debug line info, source files): dropped whole before tokenizing.
_LINE_DIRECTIVE_RE = re.compile(r"^\s*\.(?:loc|file)\b[^\n]*$", re.M)
# One token at a statement start inside a function body: a scope brace, a label (``$L__BB0_3:``, ``LAB_WAIT:``; not
# a ``::`` state-space qualifier), or a statement up to its ``;`` whose vector operands (``{%r1, %r2}``) may hold
# braces but no ``;``.
_PTX_TOKEN_RE = re.compile(r"\s*(?:(?P<open>\{)|(?P<close>\})|(?P<label>[A-Za-z_$%][\w$]*)\s*:(?!:)"
                           r"|(?P<stmt>[^;{}]*(?:\{[^{};]*\}[^;{}]*)*;))", re.S)
_PTX_GUARD_RE = re.compile(r"^@!?%?[\w$]+\s+")
_PTX_BRANCH_RE = re.compile(r"^bra(?:\.uni)?\s+([\w$]+)\s*;$")


@dataclasses.dataclass(frozen=True)
class PtxLoop:
    """One loop of a PTX function: a label and the last branch back to it in the same scope
    (:func:`ptx_loops`).

    Attributes:
      entry: the ``.entry`` function holding it.
      label: the loop head's label (``$L__BB0_3``).
      instructions: PTX instructions one iteration issues per thread, by static count from the label to the
        backward branch (that branch included): every instruction once (both arms of a conditional, an inner
        loop's body once); an inline ``{ ... }`` asm block counts the instructions in it; an mbarrier
        ``try_wait``/``test_wait`` spin loop (a scope with the wait and a branch back inside it) counts as one
        instruction (it is one wait when the data has arrived; its retries are latency, not issued work per
        byte). Directives (``.reg``, ``.loc``, ``.pragma``), labels and comments do not count.
      gemm_instructions: ``{GEMM form: occurrences}`` in the loop (:func:`gemm_instruction_counts` forms).
      spin_waits: mbarrier spin loops in it (each counted as one instruction).
      opcodes: ``{opcode: count}`` of the counted instructions (predicate guards dropped; a spin wait is its
        ``mbarrier.try_wait...`` opcode), for reading what the loop spends its instructions on.
      inner_loops: labels of the loops that lie inside this one (same entry).
    """

    entry: str
    label: str
    instructions: int
    gemm_instructions: dict
    spin_waits: int
    opcodes: dict
    inner_loops: tuple = ()


def _ptx_functions(ptx: str) -> list[tuple[str, str]]:
    """``[(entry name, body text)]`` of every ``.entry`` function: the text between its body's outer braces,
    comments and ``.loc`` / ``.file`` lines removed.

    Raises:
      ValueError: an entry whose parameter list or body braces do not close."""
    text = _strip_ptx_comments(_LINE_DIRECTIVE_RE.sub("", ptx))
    out = []
    for m in _ENTRY_RE.finditer(text):
        close = text.find(")", m.end())
        start = text.find("{", close) if close >= 0 else -1
        if start < 0:
            raise ValueError(f"PTX entry {m.group(1)}: no parameter list end or body after it")
        depth = 0
        for i in range(start, len(text)):
            depth += text[i] == "{"
            depth -= text[i] == "}"
            if depth == 0:
                break
        else:
            raise ValueError(f"PTX entry {m.group(1)}: body braces do not close")
        out.append((m.group(1), text[start + 1:i]))
    return out


def _ptx_items(entry: str, body: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Tokens of a function body as ``(kind, text, scopes)``: kind ``"label"`` (text: its name),
    ``"directive"`` or ``"instruction"`` (text: the statement without its ``;``'s trailing blanks); ``scopes``:
    the ids of the ``{ ... }`` scopes around it, outermost first (the body itself is id 0)."""
    items, stack, next_id, pos = [], [0], 1, 0
    while pos < len(body):
        if not body[pos:].strip():
            break
        m = _PTX_TOKEN_RE.match(body, pos)
        if m is None:
            near = body[pos:pos + 80].strip().splitlines()[0] if body[pos:].strip() else ""
            raise ValueError(f"PTX entry {entry}: cannot read the statement at {near!r}")
        pos = m.end()
        if m.group("open"):
            stack.append(next_id)
            next_id += 1
        elif m.group("close"):
            if len(stack) == 1:
                raise ValueError(f"PTX entry {entry}: unbalanced '}}'")
            stack.pop()
        elif m.group("label"):
            items.append(("label", m.group("label"), tuple(stack)))
        else:
            stmt = " ".join(m.group("stmt").split())
            items.append(("directive" if stmt.startswith(".") else "instruction", stmt, tuple(stack)))
    return items


def _opcode(stmt: str) -> str:
    """An instruction's opcode, predicate guard (``@%p1``, ``@!P1``) dropped."""
    s = _PTX_GUARD_RE.sub("", stmt)
    return s.split(None, 1)[0].rstrip(";")


def _branch_target(stmt: str) -> str | None:
    m = _PTX_BRANCH_RE.match(_PTX_GUARD_RE.sub("", stmt))
    return m.group(1) if m else None


def _spin_scopes(items) -> set[int]:
    """Scopes (ids) that are mbarrier spin loops: an ``mbarrier.try_wait`` / ``test_wait`` and a branch to a label
    of the same scope (Mosaic GPU's inline ``{ LAB_WAIT: mbarrier.try_wait... @P1 bra DONE; bra LAB_WAIT; DONE: }``)."""
    labels: dict[int, set[str]] = {}
    waits, branches = set(), {}
    for kind, text, scopes in items:
        s = scopes[-1]
        if kind == "label":
            labels.setdefault(s, set()).add(text)
        elif kind == "instruction":
            if _opcode(text).startswith(("mbarrier.try_wait", "mbarrier.test_wait")):
                waits.update(scopes[1:])
            t = _branch_target(text)
            if t is not None:
                branches.setdefault(s, set()).add(t)
    return {s for s in waits if s != 0 and branches.get(s, set()) & labels.get(s, set())}


def ptx_loops(ptx: str) -> list[PtxLoop]:
    """Every loop of every ``.entry`` function in a PTX text, in order of their heads.

    A loop is a label and the last branch to it after it in the same scope (a backward ``bra``), outside mbarrier
    spin loops (those count as one instruction, see :class:`PtxLoop`); the loop body is every statement from the
    label to that branch. Instructions are counted per thread (PTX is per-thread code): multiply by the warps that
    run the loop for warp-instructions. Source: PTX ISA (statements end with ``;``, ``{ }`` open a scope whose
    labels are local, ``bra`` branches), as LLVM's NVPTX back end writes it for Mosaic GPU and Triton.

    Raises:
      ValueError: text that does not read as PTX statements (the entry and the text near the place named)."""
    out = []
    for entry, body in _ptx_functions(ptx):
        items = _ptx_items(entry, body)
        spin = _spin_scopes(items)
        in_spin = [next((s for s in scopes if s in spin), None) for _, _, scopes in items]
        last_branch: dict[tuple[int, str], int] = {}  # (scope, target label) -> index of the last branch to it
        for j, (kind, text, scopes) in enumerate(items):
            t = _branch_target(text) if kind == "instruction" else None
            if t is not None:
                last_branch[(scopes[-1], t)] = j
        heads = []
        for i, (kind, text, scopes) in enumerate(items):
            if kind == "label" and in_spin[i] is None and last_branch.get((scopes[-1], text), -1) > i:
                heads.append((i, last_branch[(scopes[-1], text)], text))
        for i, j, label in heads:
            opcodes: Counter = Counter()
            seen_spin: set[int] = set()
            gemm: Counter = Counter()
            for idx in range(i, j + 1):
                kind, text, _ = items[idx]
                if kind != "instruction":
                    continue
                gemm.update(_GEMM_RE.findall(text))
                s = in_spin[idx]
                if s is not None:
                    if s in seen_spin or not _opcode(text).startswith("mbarrier."):
                        continue
                    seen_spin.add(s)
                opcodes[_opcode(text)] += 1
            inner = tuple(lab for i2, j2, lab in heads if i < i2 and j2 <= j)
            out.append(PtxLoop(entry=entry, label=label, instructions=sum(opcodes.values()),
                               gemm_instructions=dict(sorted(gemm.items())), spin_waits=len(seen_spin),
                               opcodes=dict(sorted(opcodes.items())), inner_loops=inner))
    return out


def wgmma_loop(ptx: str) -> PtxLoop:
    """The compute loop of a Hopper kernel: the innermost loop of :func:`ptx_loops` that holds
    ``wgmma.mma_async`` instructions (when several do, e.g. peeled copies, the one with the most instructions: the
    upper estimate).

    Raises:
      ValueError: no loop in the PTX holds a ``wgmma.mma_async`` (the loops found are named), or the PTX does not
        read (:func:`ptx_loops`)."""
    loops = ptx_loops(ptx)
    with_wgmma = [lp for lp in loops if any(f.startswith("wgmma.") for f in lp.gemm_instructions)]
    inner = [lp for lp in with_wgmma
             if not any(o.entry == lp.entry and o.label in lp.inner_loops for o in with_wgmma)]
    if not inner:
        found = ", ".join(f"{lp.entry}:{lp.label} ({lp.instructions} instructions)" for lp in loops) or "none"
        raise ValueError(f"no loop holding wgmma.mma_async in the PTX (loops found: {found})")
    return max(inner, key=lambda lp: lp.instructions)


#: collective opcodes of an optimized HLO module (the ``-done`` half of an async pair carries the result shape)
COLLECTIVES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def _loop_multiplicity(hlo_text: str) -> dict[str, int]:
    """``{computation: times it runs per program execution}`` through ``while`` bodies with a known trip count
    (``backend_config={"known_trip_count":{"n":"L"}}``, e.g. a scan over layers), nested loops multiplied; other
    computations 1."""
    parent, trips, current = {}, {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head:
            current = head.group(1)
            continue
        m = re.search(r"\bwhile\(.*\bbody=%([\w.\-]+)", line)
        if m and current is not None:
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            parent[m.group(1)], trips[m.group(1)] = current, int(n.group(1)) if n else 1

    def mult(c, depth=0):
        return trips[c] * mult(parent[c], depth + 1) if c in trips and depth < 64 else 1

    return {c: mult(c) for c in trips}


def collective_bytes(hlo_text: str) -> dict[str, dict]:
    """Collectives of an optimized (SPMD-partitioned) HLO module, per device and per execution.

    For each kind of :data:`COLLECTIVES`: ``count`` (instructions, times their loop trip counts), ``bytes`` (their
    result bytes per device, summed likewise), ``group_sizes`` (distinct replica-group sizes), ``by_group`` (the
    same three sums per replica-group size, as ``{"g": {...}}``) and ``wire_bytes``, the
    bytes each device sends under the usual ring/pairwise algorithms: all-gather and all-to-all ``(g - 1) / g`` of
    the result, reduce-scatter ``(g - 1)`` times its (scattered) result, all-reduce ``2 (g - 1) / g``,
    collective-permute the result. A ragged all-to-all's result is its receive buffer (an upper bound: what moves
    depends on the routing). Collectives inside both branches of a conditional are all counted (an upper bound).

    Raises:
      ValueError: an unknown HLO element type in a collective's shape (:func:`hlo_shape_bytes`).
    """
    mult = _loop_multiplicity(hlo_text)
    out = {k: {"count": 0, "bytes": 0, "wire_bytes": 0.0, "group_sizes": [], "by_group": {}} for k in COLLECTIVES}
    ops = "|".join(sorted(COLLECTIVES, key=len, reverse=True))
    pat = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s(" + ops + r")(-start|-done)?\(%?([\w.\-]*)")

    def group_size(line):
        groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
        iota = re.search(r"replica_groups=\[\d+,(\d+)\]", line)
        return len(groups.group(1).split(",")) if groups else (int(iota.group(1)) if iota else None)

    parts = re.search(r"num_partitions=(\d+)", hlo_text)
    everyone = int(parts.group(1)) if parts else 1  # replica_groups={}: every partition
    start_groups = {m.group(1): group_size(line) for line in hlo_text.splitlines()
                    if (m := pat.match(line)) and m.group(4) == "-start"}
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head:
            current = head.group(1)
            continue
        m = pat.match(line)
        if not m or m.group(4) == "-start":
            continue
        kind, shape = m.group(3), m.group(2)
        g = start_groups.get(m.group(5)) if m.group(4) == "-done" else group_size(line)
        k = mult.get(current, 1)
        nbytes = hlo_shape_bytes(shape) * k
        rec = out[kind]
        rec["count"] += k
        rec["bytes"] += nbytes
        g = g or everyone
        if g not in rec["group_sizes"]:
            rec["group_sizes"].append(g)
        gg = g or everyone
        factor = {"all-gather": (gg - 1) / gg, "all-to-all": (gg - 1) / gg, "ragged-all-to-all": (gg - 1) / gg,
                  "reduce-scatter": gg - 1, "all-reduce": 2 * (gg - 1) / gg, "collective-permute": 1.0}[kind]
        rec["wire_bytes"] += nbytes * factor
        grp = rec["by_group"].setdefault(str(g), {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        grp["count"] += k
        grp["bytes"] += nbytes
        grp["wire_bytes"] += nbytes * factor
    return out
