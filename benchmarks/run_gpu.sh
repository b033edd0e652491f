#!/usr/bin/env bash
# The FP8 GPU checks and benchmarks (issue "FP8 numerics") in one call on a CUDA machine.
#
# Run from the repository root, with a python3 that has jax[cuda], flax, optax, ml_dtypes and pytest:
#   bash benchmarks/run_gpu.sh                    # all stages
#   bash benchmarks/run_gpu.sh tests quant        # some of: tests quant matmul (e.g. to fit a time limit)
# Steps: record the device; the GPU tests (Pallas kernels compiled by Triton == the CPU jnp reference bit for
# bit, the FP8 GEMM vs float64) plus the FP8 unit tests; bench_quant.py (quantization vs device copy, 1 MB-1 GB,
# all Qwen3-8B linear weights) and bench_fp8_matmul.py (FP8 vs bf16 at M = 1, 64, 4096, and a GEMM tile sweep).
# Results: benchmarks/results/{quant,fp8_matmul}_gpu_<device>.{json,md}; logs and copies of the results in
# $OUT (the device tool's output folder) or runs/gpu. Exit status: that of the tests (0 when not run).
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
LOG=${OUT:-runs/gpu}
mkdir -p "$LOG"
{ nvidia-smi -L; "$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$LOG/env.txt" || exit 1
stages=" ${*:-tests quant matmul} "
status=0
if [[ $stages == *" tests "* ]]; then
  "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_fp8_gpu.py tests/test_fp8_pallas.py tests/test_fp8_quant.py \
    tests/test_fp8_dot.py tests/test_fp8_training.py 2>&1 | tee "$LOG/tests.log"
  status=$?
fi
[[ $stages == *" quant "* ]] && "$PY" benchmarks/bench_quant.py 2>&1 | tee "$LOG/bench_quant.log"
[[ $stages == *" matmul "* ]] && "$PY" benchmarks/bench_fp8_matmul.py 2>&1 | tee "$LOG/bench_fp8_matmul.log"
cp benchmarks/results/quant_gpu_* benchmarks/results/fp8_matmul_gpu_* "$LOG"/ 2>/dev/null
exit $status
