#!/usr/bin/env bash
# Peak memory and disk of a quickstart run (the README's "Resources" figures): a 4-step run of the main job with a
# checkpoint after each step (per-step RSS from metrics.jsonl shows whether memory grows step to step), under /usr/bin/time -v, then du of the run directory and of each checkpoint.
#   bash benchmarks/bench_run_resources.sh      # writes benchmarks/results/run_resources_cpu.{json,md}
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=$(mktemp -d)/run
/usr/bin/time -v "$PY" scripts/train.py --gin_file=configs/quickstart.gin --gin_param=train.num_steps=${STEPS:-4} \
  --gin_param=train.checkpoint_every=1 --gin_param=train.progress_bar=False --output_dir="$RUN" \
  > "$RUN.log" 2> "$RUN.time"
"$PY" - "$RUN" <<'PYEOF'
import json, os, re, subprocess, sys
sys.path.insert(0, "benchmarks")
from _common import cpu_description
run = sys.argv[1]
text = open(run + ".time").read()
rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
du = lambda p: int(subprocess.check_output(["du", "-sb", p]).split()[0])
ckpts = {n: du(os.path.join(run, "checkpoints", n)) for n in sorted(os.listdir(os.path.join(run, "checkpoints")))
         if n.isdigit()}
steps = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
res = {"device": cpu_description(), "peak_rss_GB": rss_kb / 1e6, "run_dir_GB": du(run) / 1e9,
       "checkpoint_GB": {k: v / 1e9 for k, v in ckpts.items()},
       "rss_after_step_GB": [round(m["memory/host_rss_gb"], 3) for m in steps],
       "command": f"bash benchmarks/bench_run_resources.sh ({len(steps)}-step quickstart, checkpoint_every=1)"}
lines = [f"# Quickstart run resources ({res['device']})", "", "| peak RSS | run directory | per checkpoint |",
         "|---|---|---|", f"| {res['peak_rss_GB']:.2f} GB | {res['run_dir_GB']:.2f} GB | "
         + ", ".join(f"{v:.2f} GB" for v in res["checkpoint_GB"].values()) + " |", "",
         "RSS after each step (GB, after the between-step heap trim): "
         + ", ".join(f"{v:.2f}" for v in res["rss_after_step_GB"]), "", f"Command: `{res['command']}`"]
os.makedirs("benchmarks/results", exist_ok=True)
json.dump(res, open("benchmarks/results/run_resources_cpu.json", "w"), indent=2)
open("benchmarks/results/run_resources_cpu.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
