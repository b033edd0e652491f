"""Counting the kernel launches of a lowered StableHLO module (for the CUDA-lowering tests on CPU)."""

from __future__ import annotations

import collections
import re


def is_triton(line: str) -> bool:
    """A Pallas-Triton kernel's custom call."""
    return "__gpu$xla.gpu.triton" in line


def is_kernel(line: str) -> bool:
    """A Pallas kernel's custom call: Triton or Mosaic GPU."""
    return is_triton(line) or "stablehlo.custom_call @mosaic_gpu" in line


def triton_launches(hlo: str, kind=lambda line: "all", match=is_triton) -> collections.Counter:
    """Kernel custom calls (``match``: Triton's ``__gpu$xla.gpu.triton`` by default, :func:`is_kernel` for Mosaic GPU
    too) that ``@main`` executes, counted through the call graph.

    A jitted kernel wrapper is lowered once into a private function that every use calls, so a plain text count
    would see one launch per distinct kernel; this walks ``call @f(...)`` edges from ``@main`` instead.

    Args:
      hlo: the module's text (``jax.jit(...).trace(...).lower(...).as_text()``).
      kind: maps a launch's line to the key it is counted under (default: everything under ``"all"``).
      match: which lines are launches.

    Returns:
      ``Counter`` of launches per ``kind``.
    """
    funcs, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"\s*func\.func (?:public|private) @(\w+)\(", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
        elif cur is not None:
            cur.append(line)
    memo: dict = {}

    def count(name):
        if name not in memo:
            c = collections.Counter()
            for line in funcs[name]:
                if match(line):
                    c[kind(line)] += 1
                for callee in re.findall(r"(?<!custom_)call @(\w+)\(", line):
                    c.update(count(callee))
            memo[name] = c
        return memo[name]

    return count("main")
