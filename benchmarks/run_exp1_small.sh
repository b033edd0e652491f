#!/bin/bash
# Experiment 1, small (CPU): FP8 rollout with token TIS vs FP8 without TIS vs bf16 rollout, 3 seeds each,
# configs/paper/exp1_dense_w8a8_small.gin (12 steps; ~4 min and ~9 GB RAM per run on 2 cores, one at a time).
#   PYTHON=.venv/bin/python bash benchmarks/run_exp1_small.sh [OUT=runs/exp1_small] [RUN ...]
# RUN is cond:seed with cond in fp8_tis, fp8_notis, bf16 (default: all nine). Then:
#   python benchmarks/summarize_exp1_small.py OUT benchmarks/results/exp1_small_cpu
set -e
OUT=${1:-runs/exp1_small}
shift || true
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  RUNS=(fp8_tis:0 fp8_notis:0 bf16:0 fp8_tis:1 fp8_notis:1 bf16:1 fp8_tis:2 fp8_notis:2 bf16:2)
fi
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
for run in "${RUNS[@]}"; do
  cond=${run%%:*}; seed=${run##*:}
  case $cond in
    fp8_tis) G=();;
    fp8_notis) G=(--gin_param=RolloutCorrectionConfig.rollout_is=None);;
    bf16) G=("--gin_param=train.rollout_precision='bf16'" --gin_param=RolloutCorrectionConfig.rollout_is=None);;
    *) echo "unknown condition $cond (fp8_tis, fp8_notis, bf16)"; exit 2;;
  esac
  echo "=== $cond seed $seed"
  "${PYTHON:-python}" scripts/train.py --gin_file=configs/paper/exp1_dense_w8a8_small.gin "${G[@]}" \
    --gin_param=train.seed=$seed --gin_param=train.plots=False --output_dir="$OUT/${cond}_seed$seed"
done
