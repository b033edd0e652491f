"""Fused qkv_proj / gate_up_proj in the embedded FP8 engine (issue 21): rollout and sync time, unfused vs fused.

Both engines serve the same FP8 weights in one process: ``fuse_projections=False`` (q/k/v and gate/up as separate
W8A8 linears, the engine before issue 21's fusion) and the default fused engine, and the calls alternate
(unfused, fused, unfused, ...) so both see the same machine load. Each cell checks that the two produce the same
greedy tokens and logprobs. Also timed: the sync (``export_weights`` of the float32/bf16 params, unfused or
``fuse=True``, + ``update_weights``), median of the same alternation.

(A lone jitted decode step is no stand-in on CPU: inside ``generate``'s ``while_loop`` XLA hoists the
loop-invariant weight dequantization of the CPU W8A8 path out of the loop, a lone step repeats it every call.)

Models: ``135m`` = the packaged SmolLM2-135M-Instruct (q/k/v stay separate, 576/192 rows; the 30 gate|up pairs
fuse), ``0.6b`` = Qwen3-0.6B shapes with random bf16 weights (every q/k/v and gate|up group fuses).

  python benchmarks/bench_fused_projections.py --models 135m,0.6b --batches 1,8 --max_tokens 64 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _common import cpu_description, qwen3_config, random_param_groups  # noqa: E402
from fp8rl_jax.export import export_weights  # noqa: E402
from fp8rl_jax.rollout.engine import JaxRolloutEngine  # noqa: E402
from fp8rl_jax.rollout.types import SamplingParams  # noqa: E402


def _model(name: str):
    """``(config, HF-named params)``: the real SmolLM2-135M or random Qwen3-0.6B-shaped bf16 weights."""
    if name == "135m":
        from fp8rl_jax.models.loading import load_checkpoint

        return load_checkpoint("smollm2-135m-instruct")
    cfg = qwen3_config(name)
    params = {}
    for group in random_param_groups(cfg):
        params.update(group)
    return cfg, params


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args) -> dict:
    """Alternating timings of the unfused and fused engines per model and batch (see the module docstring)."""
    out = {"device": cpu_description(), "jax": jax.__version__, "max_tokens": args.max_tokens,
           "prompt_len": args.prompt_len, "rounds": args.rounds, "cells": []}
    for name in args.models.split(","):
        cfg, params = _model(name)
        engines = {
            "unfused": JaxRolloutEngine(cfg, export_weights(params, "fp8_blockwise"), fuse_projections=False,
                                        log_kv_cache=False),
            "fused": JaxRolloutEngine(cfg, export_weights(params, "fp8_blockwise", fuse=True), log_kv_cache=False),
        }
        groups = [g.name.rsplit(".", 1)[1] for g in engines["fused"].fused_projections]
        rng = np.random.default_rng(0)
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = [list(rng.integers(3, cfg.vocab_size, args.prompt_len)) for _ in range(b)]
            sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            first = {k: e.generate(prompts, sp) for k, e in engines.items()}  # compile + warm up
            same = (np.array_equal(first["unfused"].response_token_ids, first["fused"].response_token_ids)
                    and np.array_equal(first["unfused"].rollout_logprobs, first["fused"].rollout_logprobs))
            times = {k: [] for k in engines}
            for _ in range(args.rounds):
                for k, e in engines.items():
                    times[k].append(_timed(lambda e=e: e.generate(prompts, sp)))
            tok = b * args.max_tokens
            cell = {"model": name, "batch": b, "identical_tokens_and_logprobs": bool(same),
                    "fused_groups": {g: groups.count(g) for g in sorted(set(groups))}}
            for k in engines:
                cell[f"{k}_tok_s"] = tok / statistics.median(times[k])
                cell[f"{k}_tok_s_best"] = tok / min(times[k])
                cell[f"{k}_s_all"] = times[k]
            cell["fused_over_unfused"] = cell["fused_tok_s"] / cell["unfused_tok_s"]
            out["cells"].append(cell)
            print(json.dumps({k: v for k, v in cell.items() if not k.endswith("_all")}), flush=True)
        # the sync: export (unfused / fused) + install, alternated
        sync = {"unfused": [], "fused": []}
        for v in range(args.rounds):
            for k, e in engines.items():
                def step(k=k, e=e, v=v):
                    e.update_weights(export_weights(params, "fp8_blockwise", version=v + 1, fuse=k == "fused"))
                    jax.block_until_ready(e.state)
                sync[k].append(_timed(step))
        cell = {"model": name, "sync": True, **{f"{k}_sync_s": statistics.median(t) for k, t in sync.items()}}
        out["cells"].append(cell)
        print(json.dumps(cell), flush=True)
        for e in engines.values():
            e.close()
    return out


def to_markdown(res: dict, command: str) -> str:
    """The result file's table."""
    lines = ["# Fused qkv_proj / gate_up_proj, embedded FP8 engine on CPU (issue 21)", "",
             f"{res['device']}, jax {res['jax']}; greedy, {res['prompt_len']}-token prompts, {res['max_tokens']} new "
             f"tokens; median (best) of {res['rounds']} alternating calls per engine after a warm-up (same process, "
             "same weights). Tokens and logprobs of the two engines compared bit for bit.", "",
             "| model | batch | fused groups | unfused tok/s | fused tok/s | fused / unfused (medians) | identical |",
             "|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        if c.get("sync"):
            continue
        groups = ", ".join(f"{n} {g}" for g, n in c["fused_groups"].items())
        lines.append(f"| {c['model']} | {c['batch']} | {groups} | {c['unfused_tok_s']:.1f} ({c['unfused_tok_s_best']:.1f}) "
                     f"| {c['fused_tok_s']:.1f} ({c['fused_tok_s_best']:.1f}) | {c['fused_over_unfused']:.2f} | "
                     f"{c['identical_tokens_and_logprobs']} |")
    lines += ["", "Sync (export of the trainer-side params + `update_weights`), median seconds:", "",
              "| model | unfused export + install | fused export + install |", "|---|---|---|"]
    for c in res["cells"]:
        if c.get("sync"):
            lines.append(f"| {c['model']} | {c['unfused_sync_s']:.3f} | {c['fused_sync_s']:.3f} |")
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="135m,0.6b")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/fused_projections_cpu")
    args = p.parse_args()
    res = run(args)
    command = "python benchmarks/bench_fused_projections.py " + " ".join(sys.argv[1:])
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(res, command))
    print(to_markdown(res, command))


if __name__ == "__main__":
    main()
