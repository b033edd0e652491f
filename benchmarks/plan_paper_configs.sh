#!/usr/bin/env bash
# Per-device memory of every paper config's train step and rollout program on a fake 8-device mesh (scripts/plan.py:
# ahead-of-time compile on abstract inputs, XLA memory_analysis), as one markdown table.
#   bash benchmarks/plan_paper_configs.sh [MESH] [SEQ_LEN]     # default fsdp=8, the configs' own response length
#   TARGET=h100 bash benchmarks/plan_paper_configs.sh fsdp=8 4096   # XLA:GPU for sm_90a on abstract H100s
#                                                                    # (.venv-cuda: make setup-cuda)
# Writes benchmarks/results/plan_paper_configs_<mesh>_<seq>[_h100][$TAG_SUFFIX].{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-cpu}
if [ "$TARGET" = h100 ]; then PY=${PY:-.venv-cuda/bin/python}; else PY=${PY:-.venv/bin/python}; fi
MESH=${1:-fsdp=8}
SEQ=${2:-}
EXTRA=${PLAN_ARGS:---micro_batch_size=8 --rollout_rows=8 --remat_policy=full --scan_layers}
TAG="${MESH//[=,]/_}_${SEQ:-config}"
if [ "$TARGET" = h100 ]; then TAG="${TAG}_h100"; fi
TAG="${TAG}${TAG_SUFFIX:-}"
OUT=benchmarks/results/plan_paper_configs_$TAG
TMP=$(mktemp -d)
for exp in exp1_dense_w8a8 exp2_moe_w8a8 exp3_fp8_kv exp4_fp16_train_fp8_rollout exp5_fp8_e2e; do
  echo "== $exp" >&2
  "$PY" scripts/plan.py --target="$TARGET" --gin_file=configs/paper/$exp.gin --mesh="$MESH" ${SEQ:+--seq_len=$SEQ} \
    $EXTRA --json="$TMP/$exp.json" >&2 || [ -s "$TMP/$exp.json" ] || echo "{\"failed\": true}" > "$TMP/$exp.json"
done
"$PY" - "$TMP" "$OUT" "$MESH" "${SEQ:-config}" "$EXTRA" "$TARGET" <<'PYEOF'
import json, os, sys
tmp, out, mesh, seq, extra, target = sys.argv[1:]
rows, lines = {}, []
suffix = os.environ.get("TAG_SUFFIX", "")
cmd = (("TARGET=h100 " if target == "h100" else "") + (f"TAG_SUFFIX={suffix} " if suffix else "")
       + f"bash benchmarks/plan_paper_configs.sh {mesh} "
       f"{'' if seq == 'config' else seq}").strip() + f"  (PLAN_ARGS='{extra}')"
compiler = ("XLA:GPU compile for sm_90a on abstract H100s" if target == "h100" else "XLA:CPU compile")
lines += [f"# Paper configs on a {mesh} mesh: per-device GiB ({compiler}, abstract inputs)", "",
          "| config | model | rows x (prompt + response) | micro-batch | train: params+opt | train: temp | train total | "
          "rollout rows | rollout total | fits 80 GiB (-4) |", "|---|---|---|---|---|---|---|---|---|---|"]
for name in sorted(os.listdir(tmp)):
    r = json.load(open(os.path.join(tmp, name)))
    rows[name[:-5]] = r
    if r.get("failed"):
        lines.append(f"| {name[:-5]} | failed | | | | | | | | |")
        continue
    t, ro = r["train_step"], r.get("rollout_step", {})
    def cell(m, key):
        return "does not compile" if m.get("failed") else f"{m[key]:.1f}"
    fits = "NO (does not compile)" if (t.get("failed") or ro.get("failed")) else (
        "yes" if t["fits"] and ro.get("fits", True) else "NO")
    lines.append(f"| {name[:-5]} | {r['model']} | {r['rows']} x ({r['prompt_len']} + {r['response_len']}) | "
                 f"{r['micro_batch_size']} | {cell(t, 'arguments_GiB')} | {cell(t, 'temp_GiB')} | "
                 f"{cell(t, 'total_GiB')} | {r.get('rollout_rows', '-')} | "
                 f"{cell(ro, 'total_GiB') if ro else 'nan'} | {fits} |")
lines += ["", f"Command: `{cmd}`"]
json.dump({"command": cmd, "configs": rows}, open(out + ".json", "w"), indent=2)
open(out + ".md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
