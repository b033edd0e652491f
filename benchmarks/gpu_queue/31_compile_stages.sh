#!/usr/bin/env bash
# Issue 37 item 5 (the FP8 engine programs compile in <= 1.5x bf16's time) on the GPU machine: the trace / lower /
# compile split of the bf16 and FP8 engine programs at b=1, 2 layers (benchmarks/compile_stages.py: each in a fresh
# process, the persistent cache off), written to $OUT/compile_stages.json. On the 2-core CPU machine (2026-11-28,
# after the float64 division): 5.95 s bf16, 15.5 s FP8 (2.6x). Under 60 s (the queue's limit per script), so the
# 36-layer split stays a CPU measurement (benchmarks/results/compile_stages_h100_36layers.json). --pass_timers: the 8
# costliest HLO passes per program (on a GPU the autotuner runs inside them; deviceless it cannot). The kernel
# self-tests and the FP8 autotuner that a GPU process runs inside its first trace are recorded apart (selftest_s,
# autotune_s) and left out of trace_s / total_s. bench_rollout.py's first-call table (the quick run's rollout stage)
# gives the same ratio for the real engine on the device.
set -uo pipefail
echo "31_compile_stages: start"
if ! python3 -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')"; then
  echo "31_compile_stages: no GPU in this process: skipped"; exit 0
fi
python3 -u benchmarks/compile_stages.py --programs generate_bf16_b1 generate_fp8_b1 --pass_timers 8 --json "${OUT:-/tmp}/compile_stages.json"
rc=$?
echo "31_compile_stages: end (exit $rc)"
exit "$rc"
