#!/usr/bin/env python
"""Where an engine program's compile time goes: trace, lower and XLA:GPU compile, bf16 against FP8 (issue 37 item 5).

    .venv-cuda/bin/python benchmarks/compile_stages.py                       # generate_bf16_b1 and generate_fp8_b1
    .venv-cuda/bin/python benchmarks/compile_stages.py --programs generate_bf16_b128 generate_fp8_b128
    .venv-cuda/bin/python benchmarks/compile_stages.py --layers 12 --pass_timers 8 --json /tmp/passes.json

Each program is one of ``scripts/compile_h100.py``'s (same builders: Qwen3 widths, 2 decoder layers unless
``--layers``), or the bf16 MoE engine this script adds as the MoE programs' baseline (``generate_moe_bf16_b1`` /
``_b128``, Qwen3-30B-A3B widths: not in the compile lane, which has no bf16 MoE program), compiled deviceless for an
H100 (sm_90a) in its own fresh process, so no program finds another's kernels or executables in a cache (the persistent
compilation cache is off). Per program: seconds of ``jit(...).trace``, ``.lower(lowering_platforms=("cuda",))`` and
``.compile()`` (wall clock, this process), and the lowered module's Mosaic GPU kernels: ``mosaic_gpu_v2`` custom calls
and their distinct ``kernel_hash`` values (each distinct kernel is lowered in Python once and built by the CUDA plugin's
LLVM + ptxas once), and XLA's own timers of the compile's two halves: its HLO passes and its backend (thunk emission,
where the Mosaic GPU kernels are built, LLVM and ptxas on the fusions). Issue 37's goal: the FP8 programs compile in at
most 1.5x the bf16 ones' time.
Per-layer and fixed costs come from two runs at different ``--layers`` (the slope is the per-layer cost).

Prints a table; writes ``benchmarks/results/compile_stages_h100.json`` (``--json`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TAG = "COMPILE_STAGES "


def programs() -> dict:
    """``{name: compile_h100.Program}``: the compile lane's programs and the bf16 MoE engine (b=1, b=128), the
    baseline of ``generate_moe_fp8_b*``."""
    if os.path.join(ROOT, "scripts") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import compile_h100

    extra = {f"generate_moe_bf16_b{b}": compile_h100.Program(
        f"generate_moe_bf16_b{b}", "generate", "30b-a3b", "bf16", batch=b,
        describe=f"engine generate, bf16 MoE, Qwen3-30B-A3B widths, b={b}") for b in (1, 128)}
    return {**compile_h100.PROGRAMS, **extra}


def measure(name: str, layers: int) -> dict:
    """Trace, lower and compile ``scripts/compile_h100.py``'s program ``name`` at ``layers`` layers for an H100
    (this process; call it in a fresh one). Returns ``{"program", "layers", "trace_s", "lower_s", "compile_s",
    "total_s", "mosaic_calls", "mosaic_kernels", "selftest_s", "autotune_s"}``: on a GPU machine the kernel families'
    self-tests and the autotuner run once per process inside the first trace (``selftest_s``, ``autotune_s``, 0
    without a GPU); ``trace_s`` and ``total_s`` leave them out."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import functools

    import jax

    import compile_h100
    from _common import one_time_seconds
    from fp8rl_jax.gpu_target import lowering_for_h100

    jax.config.update("jax_enable_compilation_cache", False)
    fn, args, kw, mesh = compile_h100.build(programs()[name], layers)
    jitted = fn if hasattr(fn, "trace") else jax.jit(functools.partial(fn, **kw))
    kwargs = kw if hasattr(fn, "trace") else {}
    with lowering_for_h100(mesh):
        once0 = one_time_seconds()
        t0 = time.perf_counter()
        traced = jitted.trace(*args, **kwargs)
        t1 = time.perf_counter()
        once = {k: round(v - once0[k], 2) for k, v in one_time_seconds().items()}
        t0 += once["selftest_s"] + once["autotune_s"]  # paid once per process inside the first trace: not compile
        lowered = traced.lower(lowering_platforms=("cuda",))
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
    text = lowered.as_text()
    calls = [ln for ln in text.splitlines() if "mosaic_gpu" in ln and "custom_call" in ln]
    hashes = {m.group(1) for ln in calls for m in [re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', ln)] if m}
    return {"program": name, "layers": layers, "trace_s": round(t1 - t0, 2), "lower_s": round(t2 - t1, 2),
            "compile_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2), "mosaic_calls": len(calls),
            "mosaic_kernels": len(hashes), **once}


def xla_timers(log: str) -> dict:
    """``{"hlo_passes_s", "backend_s"}`` from XLA:GPU's timer lines (``GpuCompiler::RunHloPasses`` /
    ``RunBackend for jit_f time: 1.52 s (1522342 us) (cumulative: ...)``, logged with
    ``TF_CPP_VMODULE=gpu_compiler=1``; the exact microseconds in parentheses, whatever unit the readable figure uses),
    summed over modules; None where the log holds no such line (another XLA version may word them differently)."""
    out = {}
    for key, name in (("hlo_passes_s", "RunHloPasses"), ("backend_s", "RunBackend")):
        hits = re.findall(rf"GpuCompiler::{name} for \S+ time: [^(\n]*\((\d+) us\)", log)
        out[key] = round(sum(int(v) for v in hits) * 1e-6, 2) if hits else None
    return out


def pass_timers(log: str, top: int) -> dict:
    """The ``top`` costliest HLO passes, ``{pass name: seconds}`` summed over every run of each pass, from XLA's
    per-pass timer lines (``HLO pass: priority-fusion time: 2.1 s (2135923 us) ...``, logged with
    ``TF_CPP_VMODULE=hlo_pass_pipeline=1``); empty where the log holds none."""
    total: dict[str, int] = {}
    for name, us in re.findall(r"HLO pass: (\S+) time: [^(\n]*\((\d+) us\)", log):
        total[name] = total.get(name, 0) + int(us)
    return {k: round(v * 1e-6, 3) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:top]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", nargs="+", default=["generate_bf16_b1", "generate_fp8_b1"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "compile_stages_h100.json"))
    p.add_argument("--pass_timers", type=int, default=0, metavar="N",
                   help="also time every HLO pass and report each program's N costliest (JSON: hlo_pass_s)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = programs()
    unknown = [n for n in args.programs if n not in known]
    if unknown:
        p.error(f"unknown program(s) {', '.join(unknown)}; generate programs: "
                + ", ".join(n for n in known if n.startswith("generate_")))
    if args.worker:
        print(RESULT_TAG + json.dumps(measure(args.worker, args.layers)), flush=True)
        return 0
    # XLA's own timers of its two compile halves (gpu_compiler.cc logs them at VLOG 1): the HLO passes and the
    # backend (thunk emission with the Mosaic GPU kernels' builds, LLVM, ptxas)
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "TF_CPP_MIN_LOG_LEVEL": "0",
           "TF_CPP_VMODULE": "gpu_compiler=1" + (",hlo_pass_pipeline=1" if args.pass_timers else ""),
           "TF_CPP_MAX_VLOG_LEVEL": "0"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    rows = []
    for name in args.programs:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, f"--layers={args.layers}"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if r.returncode != 0 or not lines:
            print(f"{name}: failed\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        row = json.loads(lines[-1][len(RESULT_TAG):])
        row.update(xla_timers(r.stderr))
        if args.pass_timers:
            row["hlo_pass_s"] = pass_timers(r.stderr, args.pass_timers)
        rows.append(row)
    import jax

    print(f"Compile stages for sm_90a (deviceless), {args.layers} layers; jax {jax.__version__}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'program':<24} {'trace s':>8} {'lower s':>8} {'compile s':>10} {'(HLO passes':>12} {'backend)':>9} "
          f"{'total s':>8} {'Mosaic calls':>13} {'kernels':>8}")

    def sec(v):
        return "?" if v is None else f"{v:.2f}"

    for r in rows:
        print(f"{r['program']:<24} {r['trace_s']:>8.2f} {r['lower_s']:>8.2f} {r['compile_s']:>10.2f} "
              f"{sec(r['hlo_passes_s']):>12} {sec(r['backend_s']):>9} {r['total_s']:>8.2f} {r['mosaic_calls']:>13} "
              f"{str(r['mosaic_kernels']):>8}")
    if args.pass_timers:  # one row per pass, one column per program
        names = list(dict.fromkeys(k for r in rows for k in r["hlo_pass_s"]))
        print(f"\n{'HLO pass (s)':<32}" + "".join(f"{r['program']:>24}" for r in rows))
        for k in names:
            print(f"{k:<32}" + "".join(f"{sec(r['hlo_pass_s'].get(k)):>24}" for r in rows))
    by_name = {r["program"]: r for r in rows}
    for r in rows:  # each FP8 program against the bf16 one of the same batch (generate_fp8[_kv]_bN -> generate_bf16_bN)
        base = by_name.get(re.sub(r"fp8(_kv)?", "bf16", r["program"]))
        if "fp8" in r["program"] and base:
            r["ratio_to_bf16"] = round(r["total_s"] / base["total_s"], 2)
            print(f"{r['program']}: {r['ratio_to_bf16']:.2f}x {base['program']}'s total (issue 37's goal: <= 1.5x)")
    cmd = "python benchmarks/compile_stages.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = {"command": cmd.strip(), "jax": jax.__version__, "target": "sm_90a H100 SXM (deviceless)",
           "host_cpus": os.cpu_count(), "layers": args.layers, "programs": rows}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {os.path.relpath(args.json, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
