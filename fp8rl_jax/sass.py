"""The machine code (SASS) of a kernel's PTX, read on the CPU: ``ptxas`` to a cubin, ``nvdisasm`` to text, and the
loop that holds the kernel's tensor-core instructions with what one iteration issues.

PTX is not what runs. ``ptxas`` allocates registers, schedules, moves address arithmetic to the uniform datapath and
rewrites idioms: a wgmma whose accumulator input is all zeros (Mosaic GPU's ``wgmma`` always accumulates, so a fresh
accumulator is a register array set to 0.0 in PTX, 64 ``mov`` per thread for a 64 x 128 f32 tile) becomes the Hopper
instruction's zero-accumulate form (``QGMMA... R24, gdesc[UR12], RZ, !UPT``: accumulator input ``RZ``, scale-d
false), so the zeroing costs nothing. Counting instructions per K step therefore reads the SASS:
:func:`gmma_loop` is to the SASS what :func:`fp8rl_jax.gpu_dump.wgmma_loop` is to the PTX, and
:mod:`fp8rl_jax.kernel_roofline` takes its count when an ``nvdisasm`` is installed (``make setup-cuda`` installs
the ``nvidia-cuda-nvdisasm`` wheel of the ``ptxas`` version jax's CUDA plugin brought).

Formats read: ``nvdisasm -c`` output (CUDA 13): one instruction per line as ``/*addr*/  [@P] OPCODE operands ;``
(16-byte instructions on sm_90), labels ``.L_x_N:``, branches ``BRA `(.L_x_N)``, one ``.text.<kernel>`` section
per function. Hopper's warpgroup MMA is ``HGMMA`` (16-bit operands), ``QGMMA`` (FP8), ``IGMMA`` (int8) and
``BGMMA`` (binary) in SASS (NVIDIA CUDA Binary Utilities, "Hopper Instruction Set").
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from collections import Counter

from fp8rl_jax.gpu_dump import find_cuda_tool, find_ptxas

#: SASS opcodes of Hopper's asynchronous warpgroup matrix multiply (``wgmma.mma_async`` in PTX)
GMMA_OPCODES = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")

_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L[\w.$]*):\s*$")
_SECTION = re.compile(r"^\s*\.section\s+\.text\.([\w.$]+)")
# a branch: its guard (``@P1``, ``@!UP0``; ``@PT`` is always true) and/or a predicate operand (``BRA.U !UP0,``)
_BRANCH = re.compile(r"^(?:@(!?U?P\w+)\s+)?BRA(?:\.[\w.]+)?\s+(?:(!?U?P\w+)\s*,\s*)?`\(([^)]+)\)")


def find_nvdisasm() -> str | None:
    """Path of an ``nvdisasm``: ``$NVDISASM``, the ``nvidia-cuda-nvdisasm`` wheel of this Python
    (``site-packages/nvidia/cu13/bin/nvdisasm``), else ``nvdisasm`` on ``PATH``; or None
    (:func:`fp8rl_jax.gpu_dump.find_cuda_tool`)."""
    return find_cuda_tool("nvdisasm", "NVDISASM")


def sass_of_ptx(ptx: str, arch: str = "sm_90a", ptxas: str | None = None, nvdisasm: str | None = None) -> str:
    """The SASS text of a PTX module: ``ptxas --gpu-name {arch}`` (its default ``-O3``, as the CUDA plugin builds
    Mosaic GPU kernels) to a cubin in a temporary directory, then ``nvdisasm -c`` of it.

    Args:
      ptx: the PTX text (one module; e.g. a Mosaic GPU kernel's dump, :func:`fp8rl_jax.kernel_roofline.find_kernel_ptx`).
      arch: the target (``sm_90a``: Hopper with wgmma).
      ptxas, nvdisasm: executables (default :func:`fp8rl_jax.gpu_dump.find_ptxas`, :func:`find_nvdisasm`).

    Raises:
      FileNotFoundError: no ptxas or no nvdisasm (the message says which wheel installs it).
      RuntimeError: ptxas or nvdisasm failed (their first error lines).
    """
    px = ptxas or find_ptxas()
    if px is None:
        raise FileNotFoundError("no ptxas found (set PTXAS, or install jax[cuda13]'s nvidia-cuda-nvcc wheel)")
    nd = nvdisasm or find_nvdisasm()
    if nd is None:
        raise FileNotFoundError("no nvdisasm found (set NVDISASM, or `pip install nvidia-cuda-nvdisasm` of the "
                                "ptxas version: make setup-cuda does)")
    with tempfile.TemporaryDirectory(prefix="fp8rl_sass_") as tmp:
        src, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        for cmd in ([px, "--gpu-name", arch, "-o", cubin, src], [nd, "-c", cubin]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                why = " ".join((r.stderr or r.stdout).strip().splitlines()[:3])
                raise RuntimeError(f"{os.path.basename(cmd[0])} failed: {why}")
        return r.stdout


@dataclasses.dataclass(frozen=True)
class SassLoop:
    """One loop of a SASS function: a label and a predicated branch back to it (:func:`sass_loops`).

    Attributes:
      function: the kernel (the ``.text.<name>`` section).
      label: the loop head (``.L_x_9``).
      start, end: byte addresses of the head's first instruction and of the closing branch.
      instructions: SASS instructions from the head to the closing branch, that branch included: what one
        iteration issues per warp when it takes no out-of-line path (an mbarrier wait that has to retry branches
        to a block after the function's body and back; the retries are latency, not issued work per byte).
      gmma: the warpgroup MMA instructions in the loop, in order, as opcode with modifiers
        (``QGMMA.64x128x32.F32.E4M3.E4M3``).
      zero_accumulate: how many of them start from a zero accumulator (accumulator input ``RZ``; ptxas's form of
        a wgmma on a fresh all-zero accumulator).
      opcodes: ``{opcode without modifiers: count}`` of the loop's instructions (``FFMA``, ``UIADD3``, ...).
    """

    function: str
    label: str
    start: int
    end: int
    instructions: int
    gmma: tuple
    zero_accumulate: int
    opcodes: dict


def _parse(sass: str):
    """``[(function, [(addr, text)], {label: addr})]`` per ``.text`` section of an ``nvdisasm -c`` text."""
    funcs, cur, pending = [], None, []
    for line in sass.splitlines():
        sec = _SECTION.match(line)
        if sec:
            cur = (sec.group(1), [], {})
            funcs.append(cur)
            pending = []
            continue
        if cur is None:
            continue
        lab = _LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        ins = _INSTR.match(line)
        if ins:
            addr = int(ins.group(1), 16)
            for name in pending:
                cur[2][name] = addr
            pending = []
            cur[1].append((addr, ins.group(2)))
    return funcs


def _opcode(text: str) -> str:
    """The opcode with its modifiers of one SASS instruction text (predicate guard dropped)."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def sass_loops(sass: str) -> list[SassLoop]:
    """Every loop of an ``nvdisasm -c`` text: each conditional backward branch to a label at a lower address of the
    same function (guarded, ``@P1 BRA `(.L_x_9)``, or with a predicate operand, ``BRA.U !UP0, `(.L_x_9)``) closes
    the loop from that label to it; in order of their heads.

    Unconditional backward branches (no predicate, or ``PT``) are not loops here: the loops of the kernels read so
    far (the decode and prefill GEMMs' K loops, sm_90a, CUDA 13.5) end with a conditional branch back to their head,
    and their unconditional backward branches are the returns of out-of-line blocks (an mbarrier wait's retry path
    jumping back into the loop body).

    Raises:
      ValueError: a text with no ``.text`` section holding instructions (not ``nvdisasm -c`` output).
    """
    funcs = _parse(sass)
    if not any(instrs for _, instrs, _ in funcs):
        raise ValueError("no SASS instructions found (expected `nvdisasm -c` output with .text sections)")
    loops = []
    for fname, instrs, labels in funcs:
        for addr, text in instrs:
            br = _BRANCH.match(text)
            if not br or br.group(3) not in labels or labels[br.group(3)] > addr:
                continue
            if not any(p and p.lstrip("!") not in ("PT", "UPT") for p in (br.group(1), br.group(2))):
                continue  # unconditional (no predicate, or one that is always true)
            head = labels[br.group(3)]
            body = [t for a, t in instrs if head <= a <= addr]
            ops = [_opcode(t) for t in body]
            gmma = tuple(o for o in ops if o.split(".")[0] in GMMA_OPCODES)
            zero = sum(1 for t in body if _opcode(t).split(".")[0] in GMMA_OPCODES
                       and re.search(r"\]\s*,\s*RZ\s*,\s*!UPT", t))
            loops.append(SassLoop(fname, br.group(3), head, addr, len(body), gmma, zero,
                                  dict(Counter(o.split(".")[0] for o in ops))))
    return sorted(loops, key=lambda lp: (lp.function, lp.start))


def gmma_loop(sass: str) -> SassLoop:
    """The compute loop of a Hopper kernel's SASS: the smallest loop of :func:`sass_loops` (fewest bytes from head to
    closing branch) that holds a warpgroup MMA (``QGMMA``/``HGMMA``/...): the K loop, inside a persistent kernel's
    loop over tiles.

    Raises:
      ValueError: no loop holds a warpgroup MMA (the loops found are named), or the text is not SASS."""
    loops = sass_loops(sass)
    with_gmma = [lp for lp in loops if lp.gmma]
    if not with_gmma:
        found = ", ".join(f"{lp.function}:{lp.label} ({lp.instructions})" for lp in loops) or "none"
        raise ValueError(f"no loop holding a warpgroup MMA in the SASS (loops found: {found})")
    return min(with_gmma, key=lambda lp: (lp.end - lp.start, lp.start))
