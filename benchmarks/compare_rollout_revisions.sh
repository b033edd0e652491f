#!/usr/bin/env bash
# CPU rollout throughput of an earlier revision against the working tree, interleaved per precision so both see the
# same machine load: bench_rollout.py (embedded engine, SmolLM2-135M, batches 1 and 8, 32 new tokens) run from a git
# worktree of REV and from here.
#   bash benchmarks/compare_rollout_revisions.sh REV      # writes benchmarks/results/rollout_cpu_vs_<REV>.md
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: compare_rollout_revisions.sh REV}
PY=${PY:-$PWD/.venv/bin/python}
TMP=$(mktemp -d)
git worktree add -q "$TMP/rev" "$REV"
trap 'git worktree remove --force "$TMP/rev"' EXIT
OUT=benchmarks/results/rollout_cpu_vs_$REV.md
{
  echo "# CPU rollout: $REV against $(git rev-parse --short HEAD) (+ working tree)"; echo
  echo "Embedded engine, SmolLM2-135M-Instruct, 32 new tokens, median of 3 after a warm-up, interleaved runs."; echo
  echo "| precision | batch | $REV tok/s | now tok/s |"; echo "|---|---|---|---|"
} > "$OUT"
for p in bf16 fp8; do
  for side in rev now; do
    root=$PWD; [[ $side == rev ]] && root=$TMP/rev
    PYTHONPATH=$root "$PY" "$root/benchmarks/bench_rollout.py" --models 135m --engines embedded --precisions $p \
      --batches 1,8 --max_tokens 32 --repeats 3 --out "$TMP/$side.$p" > "$TMP/$side.$p.log" 2>&1
  done
  "$PY" - "$TMP/rev.$p.json" "$TMP/now.$p.json" "$p" >> "$OUT" <<'PYEOF'
import json, sys
a, b = (json.load(open(f))["cells"][0]["rows"] for f in sys.argv[1:3])
for ra, rb in zip(a, b):
    print(f"| {sys.argv[3]} | {ra['batch']} | {ra['tokens_per_s']:.1f} | {rb['tokens_per_s']:.1f} |")
PYEOF
done
echo; echo "Command: \`bash benchmarks/compare_rollout_revisions.sh $REV\` ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores)" >> "$OUT"
cat "$OUT"
