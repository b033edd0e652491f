#!/usr/bin/env bash
# Issue 37 item 5 (2026-11-29): the FP8 GEMMs' activations are quantized by the `quant` family's Pallas kernel on
# CUDA (`pallas_quant.quantize_activation_groupwise_dispatch`), one launch per site, instead of XLA's fusions of the
# jnp quantizer: the deviceless compile of the 36-layer Qwen3-8B b=1 engine program went from 2.04x to 1.42x bf16. Same
# bits (the quant self-test). What only the GPU can say: the kernel's time against XLA's at decode rows (8) and at a
# prefill (4096), with the weights' quantization alongside (`python -m fp8rl_jax.kernels.pallas_quant`: microseconds,
# GB/s and the kernel's speedup over XLA). Tables to $OUT/pallas_quant_m{8,4096}.txt as printed; well under 60 s.
set -uo pipefail
echo "13_activation_quant_ab: start"
if ! python3 -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')"; then
  echo "13_activation_quant_ab: no GPU in this process: skipped"; exit 0
fi
rc=0
for m in 8 4096; do
  python3 -u -m fp8rl_jax.kernels.pallas_quant --m "$m" --iters 20 2>&1 | tee "${OUT:-/tmp}/pallas_quant_m$m.txt"
  r=${PIPESTATUS[0]}; [[ $r -ne 0 ]] && rc=$r
done
echo "13_activation_quant_ab: end (exit $rc)"
exit "$rc"
