"""The sync content check (train.verify_sync) on the quickstart model: probe difference and cost per precision.

For each rollout precision the quickstart trainer (SmolLM2-135M-Instruct, configs/quickstart.gin) is built with
its embedded engine; the engine's probe logprobs are compared with the trainer's (``RLTrainer.verify_sync``, mean
|difference| in nats per probe token, beside the tolerance of ``fp8rl_jax.rollout.verify``), and the median time
of a verification is set beside the median time of a sync (``export`` + ``engine.update_weights``).

    python benchmarks/bench_sync_probe.py            # prints a table, writes results/sync_probe_cpu.{json,md}
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_description, median_seconds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
VARIANTS = {"float32": ("float32", "auto"), "bf16": ("bf16", "auto"), "fp8": ("fp8", "auto"),
            "fp8_kv": ("fp8", "fp8_e4m3")}


def main(repeats: int = 3) -> list[dict]:
    import gin

    from fp8rl_jax.rollout import verify
    from fp8rl_jax.trainer import RLTrainer, TrainConfig

    gin.parse_config_file(os.path.join(ROOT, "configs", "quickstart.gin"))
    rows = []
    for name, (prec, kv) in VARIANTS.items():
        tr = RLTrainer(TrainConfig(output_dir="/tmp/bench_sync_probe", rollout_precision=prec, kv_cache_dtype=kv,
                                   checkpoint_every=0, plots=False, progress_bar=False, verify_sync="off"))
        diff = tr.verify_sync()  # compiles both sides
        verify_s = median_seconds(tr.verify_sync, repeats)
        sync_s = median_seconds(lambda: tr.engine.update_weights(tr.export()), repeats)
        rows.append({"variant": name, "probe_abs_diff": diff, "tolerance": verify.probe_tolerance(prec, kv),
                     "probe_tokens": tr.sync_probe.num_tokens, "verify_s": verify_s, "sync_s": sync_s,
                     "verify_over_sync": verify_s / sync_s})
        tr.engine.close()
    lines = [f"# Sync content check on the quickstart model ({cpu_description()})", "",
             "| variant | probe mean abs diff (nats/token) | tolerance | verify s | sync s | verify / sync |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['probe_abs_diff']:.4g} | {r['tolerance']:.3g} | {r['verify_s']:.3f} | "
              f"{r['sync_s']:.3f} | {r['verify_over_sync']:.2f} |" for r in rows]
    lines += ["", f"Probe: {rows[0]['probe_tokens']} tokens; medians of {repeats}. "
              "Command: `python benchmarks/bench_sync_probe.py`"]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "sync_probe_cpu.json"), "w") as f:
        json.dump({"device": cpu_description(), "rows": rows}, f, indent=2)
    with open(os.path.join(RESULTS, "sync_probe_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
