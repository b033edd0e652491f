#!/bin/bash
# Rollout/trainer mismatch for bf16, FP8 linear, FP8 linear + FP8 KV cache, with token TIS on and off
# (the paper's Experiment 3 ordering on the quickstart config). Runs one after another (each ~9 GB RAM),
# then tabulates steps 1..STEPS of every run:
#   PYTHON=.venv/bin/python bash benchmarks/run_kv_mismatch.sh [STEPS=3] [OUT=runs/kv_mismatch]
#   python benchmarks/summarize_kv_mismatch.py runs/kv_mismatch benchmarks/results/kv_mismatch_cpu
set -e
STEPS=${1:-3}
OUT=${2:-runs/kv_mismatch}
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
COMMON=(--gin_param=train.num_steps=$STEPS --gin_param=train.progress_bar=False --gin_param=train.checkpoint_every=0
        --gin_param=train.plots=False)
for run in bf16:on fp8:on fp8_kv:on bf16:off fp8:off fp8_kv:off; do
  cfg=${run%%:*}; tis=${run##*:}
  case $cfg in
    bf16) G=(--gin_file=configs/quickstart.gin "--gin_param=train.rollout_precision='bf16'");;
    fp8) G=(--gin_file=configs/quickstart.gin);;
    fp8_kv) G=(--gin_file=configs/quickstart_kv.gin);;
  esac
  T=(); if [ "$tis" = off ]; then T=(--gin_param=RolloutCorrectionConfig.rollout_is=None); fi
  echo "=== $cfg TIS $tis"
  "${PYTHON:-python}" scripts/train.py "${G[@]}" "${COMMON[@]}" "${T[@]}" --output_dir="$OUT/${cfg}_tis_${tis}"
done
