"""Counting the Triton kernel launches of a lowered StableHLO module (for the CUDA-lowering tests on CPU)."""

from __future__ import annotations

import collections
import re


def triton_launches(hlo: str, kind=lambda line: "all") -> collections.Counter:
    """Triton custom calls (``__gpu$xla.gpu.triton``) that ``@main`` executes, counted through the call graph.

    A jitted kernel wrapper is lowered once into a private function that every use calls, so a plain text count
    would see one launch per distinct kernel; this walks ``call @f(...)`` edges from ``@main`` instead.

    Args:
      hlo: the module's text (``jax.jit(...).trace(...).lower(...).as_text()``).
      kind: maps a launch's line to the key it is counted under (default: everything under ``"all"``).

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
                if "__gpu$xla.gpu.triton" in line:
                    c[kind(line)] += 1
                for callee in re.findall(r"call @(\w+)\(", line):
                    c.update(count(callee))
            memo[name] = c
        return memo[name]

    return count("main")
