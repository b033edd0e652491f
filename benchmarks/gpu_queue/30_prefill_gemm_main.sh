#!/usr/bin/env bash
# Issue 37 item 2 (prefill GEMM >= 1.3x bf16 at M = 4096, activation quantization included): the Mosaic GPU W8A8
# GEMM's own timing main at the four Qwen3-8B prefill shapes against bf16 dot_general
# (`python -m fp8rl_jax.kernels.mosaic_gemm`: microseconds, TFLOP/s, fp8/bf16 and fp8+quant/bf16). Its table goes to
# $OUT/mosaic_gemm.txt as it is printed; under 60 s with 10 iterations per timing (4 shapes x 3 timed programs).
set -uo pipefail
echo "30_prefill_gemm_main: start"
if ! python3 -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')"; then
  echo "30_prefill_gemm_main: no GPU in this process: skipped"; exit 0
fi
# the kernel's configuration per shape: what the quick run's autotune stage measured (run_gpu.sh exports its cache
# with FP8RL_AUTOTUNE=cached), else the shipped tables or the default; never tuning inside this script's 60 s
[[ ${FP8RL_AUTOTUNE:-} == cached || ${FP8RL_AUTOTUNE:-} == off ]] || export FP8RL_AUTOTUNE=cached
echo "30_prefill_gemm_main: FP8RL_AUTOTUNE=$FP8RL_AUTOTUNE"
python3 -u -m fp8rl_jax.kernels.mosaic_gemm --m 4096 --iters 10 2>&1 | tee "${OUT:-/tmp}/mosaic_gemm.txt"
rc=${PIPESTATUS[0]}
echo "30_prefill_gemm_main: end (exit $rc)"
exit "$rc"
