#!/usr/bin/env bash
# Per-device memory of every paper config's train step and rollout program on a fake 8-device mesh (scripts/plan.py:
# ahead-of-time compile on abstract inputs, XLA memory_analysis), as one markdown table.
#   bash benchmarks/plan_paper_configs.sh [MESH] [SEQ_LEN]     # default fsdp=8, the configs' own response length
# Writes benchmarks/results/plan_paper_configs_<mesh>_<seq>.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MESH=${1:-fsdp=8}
SEQ=${2:-}
EXTRA=${PLAN_ARGS:---micro_batch_size=8 --rollout_rows=8 --remat_policy=full --scan_layers}
TAG="${MESH//[=,]/_}_${SEQ:-config}"
OUT=benchmarks/results/plan_paper_configs_$TAG
TMP=$(mktemp -d)
for exp in exp1_dense_w8a8 exp2_moe_w8a8 exp3_fp8_kv exp4_fp16_train_fp8_rollout exp5_fp8_e2e; do
  echo "== $exp" >&2
  "$PY" scripts/plan.py --gin_file=configs/paper/$exp.gin --mesh="$MESH" ${SEQ:+--seq_len=$SEQ} $EXTRA \
    --json="$TMP/$exp.json" >&2 || echo "{\"failed\": true}" > "$TMP/$exp.json"
done
"$PY" - "$TMP" "$OUT" "$MESH" "${SEQ:-config}" "$EXTRA" <<'PYEOF'
import json, os, sys
tmp, out, mesh, seq, extra = sys.argv[1:]
rows, lines = {}, []
cmd = f"bash benchmarks/plan_paper_configs.sh {mesh} {'' if seq == 'config' else seq}".strip() + f"  (PLAN_ARGS='{extra}')"
lines += [f"# Paper configs on a {mesh} mesh: per-device GiB (XLA:CPU compile, abstract inputs)", "",
          "| config | model | rows x (prompt + response) | micro-batch | train: params+opt | train: temp | train total | "
          "rollout rows | rollout total | fits 80 GiB (-4) |", "|---|---|---|---|---|---|---|---|---|---|"]
for name in sorted(os.listdir(tmp)):
    r = json.load(open(os.path.join(tmp, name)))
    rows[name[:-5]] = r
    if r.get("failed"):
        lines.append(f"| {name[:-5]} | failed | | | | | | | | |")
        continue
    t, ro = r["train_step"], r.get("rollout_step", {})
    fits = t["fits"] and ro.get("fits", True)
    lines.append(f"| {name[:-5]} | {r['model']} | {r['rows']} x ({r['prompt_len']} + {r['response_len']}) | "
                 f"{r['micro_batch_size']} | {t['arguments_GiB']:.1f} | {t['temp_GiB']:.1f} | {t['total_GiB']:.1f} | "
                 f"{r.get('rollout_rows', '-')} | {ro.get('total_GiB', float('nan')):.1f} | {'yes' if fits else 'NO'} |")
lines += ["", f"Command: `{cmd}`"]
json.dump({"command": cmd, "configs": rows}, open(out + ".json", "w"), indent=2)
open(out + ".md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
