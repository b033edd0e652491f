"""One Qwen3-MoE block's training step (forward + backward) with tiled vs ``ragged_dot`` experts: memory and time.

For each shape, the block (:class:`fp8rl_jax.models.moe.SparseMoeBlock`, bf16 compute, float32 masters) with
``grouped_impl="tiled"`` (:mod:`fp8rl_jax.models.grouped`) and ``grouped_impl="ragged_dot"`` is compiled for
``jax.grad`` of a sum of squares on the platform present, and reports

* ``temp MiB``: XLA's compiled temporaries (``compiled.memory_analysis().temp_size_in_bytes``): the per-layer
  memory that made the Qwen3-30B-A3B train step not fit (issue 19);
* ``ms``: median wall time of the compiled step over ``--repeats`` runs after a warm-up (``block_until_ready``);
* ``rows``: the routed rows ``T * k``; ``tile``: the tile edge the block chose (:func:`choose_tile_rows`).

Shapes (random weights, router scaled so routing is spread): the 30B-A3B expert sizes (hidden 2048, moe
intermediate 768, 128 experts, top-8) at a few token counts, with hidden/intermediate divided by 4 to keep CPU runs
short (``--full`` keeps them whole), and the tiny CI model's (4 experts top-2, hidden 64).

Usage:
  python benchmarks/bench_moe_grouped.py                # writes benchmarks/results/moe_grouped_<platform>.{json,md}
  python benchmarks/bench_moe_grouped.py --full --tokens 1024   (ragged_dot at 4096 tokens needs ~32 GiB here)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _common import cpu_description, median_seconds  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def measure(num_experts: int, top_k: int, hidden: int, inter: int, tokens: int, impl: str, repeats: int) -> dict:
    """Compile and time one block's forward + backward; returns the row of the table."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fp8rl_jax.models.moe import SparseMoeBlock, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(64, hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                num_experts_per_tok=top_k)
    blk = SparseMoeBlock(cfg, linear_precision="dense", param_dtype=jnp.float32, dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(0))
    blk.gate.weight[...] = blk.gate.weight[...] * 30.0
    blk.grouped_impl = impl
    graph, state = nnx.split(blk)

    def loss(st, x):
        return jnp.sum(nnx.merge(graph, st)(x).astype(jnp.float32) ** 2)

    x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.bfloat16)
    step = jax.jit(jax.grad(loss))
    compiled = step.lower(state, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(state, x))
    ms = 1e3 * median_seconds(lambda: jax.block_until_ready(compiled(state, x)), repeats)
    tile = blk._tile_rows(tokens * top_k) if impl == "tiled" else None
    return {"experts": num_experts, "top_k": top_k, "hidden": hidden, "moe_intermediate": inter, "tokens": tokens,
            "rows": tokens * top_k, "impl": impl, "tile": tile, "temp_MiB": temp / 2**20, "ms": ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="256,1024", help="comma-separated token counts for the 30B-A3B shape")
    ap.add_argument("--full", action="store_true", help="the 30B-A3B hidden/intermediate sizes, not divided by 4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="results path prefix (default benchmarks/results/moe_grouped_<p>)")
    args = ap.parse_args(argv)
    import jax

    div = 1 if args.full else 4
    shapes = [(128, 8, 2048 // div, 768 // div, int(t)) for t in args.tokens.split(",")]
    shapes.append((4, 2, 64, 32, 256))
    rows = []
    for e, k, h, i, t in shapes:
        for impl in ("tiled", "ragged_dot"):
            r = measure(e, k, h, i, t, impl, args.repeats)
            rows.append(r)
            print(json.dumps(r), flush=True)
    platform = jax.devices()[0].platform
    device = cpu_description() if platform == "cpu" else jax.devices()[0].device_kind
    out = args.out or os.path.join(RESULTS, f"moe_grouped_{platform}")
    cmd = "python benchmarks/bench_moe_grouped.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:]))
    lines = [f"# One Qwen3-MoE block, forward + backward, tiled vs ragged_dot experts ({device})", "",
             "bf16 compute, float32 masters; `temp` = XLA's compiled temporaries, `ms` = median of "
             f"{args.repeats} after a warm-up.", "",
             "| experts | top-k | hidden | moe_inter | tokens | rows | tile | tiled temp MiB | ragged_dot temp MiB | "
             "tiled ms | ragged_dot ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a, b in zip(rows[::2], rows[1::2]):
        lines.append(f"| {a['experts']} | {a['top_k']} | {a['hidden']} | {a['moe_intermediate']} | {a['tokens']} | "
                     f"{a['rows']} | {a['tile']} | {a['temp_MiB']:.1f} | {b['temp_MiB']:.1f} | {a['ms']:.1f} | "
                     f"{b['ms']:.1f} |")
    lines += ["", f"`{cmd.strip()}`"]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    json.dump({"command": cmd.strip(), "device": device, "rows": rows}, open(out + ".json", "w"), indent=2)
    open(out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
