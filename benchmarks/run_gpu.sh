#!/usr/bin/env bash
# Every GPU check and GPU benchmark in one call on a CUDA machine (issue "GPU path: correct on an H100").
#
# Run from the repository root of a clean copy of the tracked files, with a python3 that has jax[cuda], flax,
# optax, ml_dtypes, pytest (and torch for the weight-sync benchmark); no package registry, no model asset needed:
#   bash benchmarks/run_gpu.sh                          # all stages
#   bash benchmarks/run_gpu.sh tests quant              # some of: tests quant matmul rollout rollout_moe
#                                                       #   kv_attention profile sync moe
# Stages:
#   tests   the GPU tests (pytest -m gpu: Pallas kernels vs the float64-numpy/ml_dtypes reference bit for bit, the
#           FP8 GEMM vs float64 at M = 1, 3, 64, 300, 4096) run ON THE GPU, then the FP8 unit and CUDA-lowering
#           tests. Fails when any GPU test is skipped, fails, or none ran.
#   quant   bench_quant.py (quantization vs device copy, all Qwen3-8B linear weights)
#   matmul  bench_fp8_matmul.py (FP8 vs bf16 GEMMs)
#   rollout bench_rollout.py at Qwen3-0.6B and 8B shapes (random weights), bf16 / fp8 / fp8 + e4m3 KV cache, prompts
#           of 32 and 512 tokens, 256 new tokens, FP8/bf16 speedups and b=1 decode against the HBM floor
#           (override the arguments with ROLLOUT_ARGS="...")
#   rollout_moe  the same at Qwen3-30B-A3B shapes (bf16 and fp8; ~57 GiB of bf16 weights, small KV budget)
#   kv_attention  bench_rollout.py at Qwen3-8B shapes, fp8 + e4m3 KV cache, 4096-token prompts, 256 new tokens, b=1
#           and 32, twice: decode attention in the Pallas kernel that reads the e4m3 cache and dequantizes inside
#           (kv_attention=auto) and over the whole dequantized cache (materialize); issue 21's ">= 1.3x at 4k contexts"
#   profile jax.profiler traces of 8B decode (bf16, fp8, fp8 + e4m3 KV): kernels per token, top kernels
#   sync    bench_weight_sync.py (export + DLPack + copy into preallocated torch tensors)
#   moe     bench_moe_grouped.py --full: one 30B-A3B MoE block's forward + backward, tiled vs ragged_dot experts
#           (XLA:GPU's ragged_dot rewrite: compiled temporaries and time)
# Results: benchmarks/results/*_gpu_<device>.{json,md}; logs and copies in $OUT (the device tool's folder) or
# runs/gpu. Exit status: non-zero if a test stage failed or a GPU test was skipped, or a benchmark failed.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
LOG=${OUT:-runs/gpu}
mkdir -p "$LOG"
{ nvidia-smi -L; "$PY" -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$LOG/env.txt" || exit 1
"$PY" -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)" \
  || { echo "run_gpu.sh: JAX sees no GPU (check JAX_PLATFORMS and the CUDA plugin)" | tee -a "$LOG/env.txt"; exit 1; }
stages=" ${*:-tests quant matmul rollout rollout_moe kv_attention profile sync moe} "
status=0
run() {  # run NAME CMD...: log to $LOG/NAME.log, remember a failure
  local name=$1; shift
  "$@" 2>&1 | tee "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  [[ $rc -ne 0 ]] && { echo "run_gpu.sh: $name failed (exit $rc)"; status=1; }
  return 0
}
if [[ $stages == *" tests "* ]]; then
  run gpu_tests "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_fp8_gpu.py tests/test_fused_projections.py \
    tests/test_attention.py tests/test_wgmma_paths.py
  # a GPU test may skip only where no CUDA device exists, and this machine has one: any skip is a failure
  if grep -qE "[0-9]+ skipped|SKIPPED" "$LOG/gpu_tests.log"; then echo "run_gpu.sh: GPU tests were skipped"; status=1; fi
  grep -qE "[0-9]+ passed" "$LOG/gpu_tests.log" || { echo "run_gpu.sh: no GPU test ran"; status=1; }
  # the FP8 KV decode-attention kernel: its GPU tests (none may skip here), then its interpret-mode and lowering tests
  run gpu_tests_attention "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_fp8_attention_kernel.py
  if grep -qE "[0-9]+ skipped|SKIPPED" "$LOG/gpu_tests_attention.log"; then echo "run_gpu.sh: GPU tests were skipped"; status=1; fi
  grep -qE "[0-9]+ passed" "$LOG/gpu_tests_attention.log" || { echo "run_gpu.sh: no attention GPU test ran"; status=1; }
  run unit_tests_attention "$PY" -m pytest -q -ra -p no:cacheprovider -m "not gpu" tests/test_fp8_attention_kernel.py
  # the Mosaic GPU GEMM's own tests run their interpret-mode cases and, here, the kernel itself
  run mosaic_tests "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_mosaic_gemm.py tests/test_decode_fusion.py \
    tests/test_fp8_prefill_attention.py tests/test_kernel_choice.py
  run unit_tests "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_fp8_pallas.py tests/test_fp8_quant.py \
    tests/test_fp8_reference.py tests/test_fp8_dot.py tests/test_fp8_training.py tests/test_imports.py
fi
[[ $stages == *" quant "* ]] && run bench_quant "$PY" benchmarks/bench_quant.py
[[ $stages == *" matmul "* ]] && run bench_fp8_matmul "$PY" benchmarks/bench_fp8_matmul.py
[[ $stages == *" rollout "* ]] && run bench_rollout "$PY" benchmarks/bench_rollout.py --models 0.6b,8b \
  --engines embedded --precisions bf16,fp8,fp8_kv ${ROLLOUT_ARGS:---batches 1,32,128 --prompt_len 32,512 --max_tokens 256 --repeats 1 --floor}
[[ $stages == *" rollout_moe "* ]] && run bench_rollout_moe "$PY" benchmarks/bench_rollout.py --models 30b-a3b \
  --engines embedded --precisions bf16,fp8 --batches 1,32 --prompt_len 32 --max_tokens 128 --repeats 1 --floor \
  --kv_cache_memory_bytes 4294967296 --update
if [[ $stages == *" kv_attention "* ]]; then
  for impl in auto materialize; do
    run "bench_kv_attention_$impl" "$PY" benchmarks/bench_rollout.py --models 8b --engines embedded --precisions fp8_kv \
      --batches 1,32 --prompt_len 4096 --max_tokens 256 --repeats 1 --kv_cache_memory_bytes 17179869184 \
      --kv_attention "$impl" --out "benchmarks/results/rollout_kv_attention_${impl}_gpu"
  done
fi
[[ $stages == *" profile "* ]] && run bench_rollout_profile "$PY" benchmarks/bench_rollout.py --models 8b \
  --engines embedded --precisions bf16,fp8,fp8_kv --batches 1 --prompt_len 32 --max_tokens 32 --repeats 1 \
  --profile "$LOG/profile" --out benchmarks/results/rollout_profile_gpu
[[ $stages == *" sync "* ]] && run bench_weight_sync "$PY" benchmarks/bench_weight_sync.py --sizes 0.6b,8b
[[ $stages == *" moe "* ]] && run bench_moe_grouped "$PY" benchmarks/bench_moe_grouped.py --full --tokens 256,1024
cp benchmarks/results/*_gpu* "$LOG"/ 2>/dev/null
exit $status
