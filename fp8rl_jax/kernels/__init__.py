"""GPU kernels as one family (issue 37): one module per kernel, each with its tuning configuration and a ``main``
that times it on a GPU, in the manner of jax's ``pallas/ops/gpu/*_mgpu.py``.

* :mod:`fp8rl_jax.kernels.decode_gemm_mgpu`: the swap-AB split-K W8A8 decode GEMM (Mosaic GPU, FP8 wgmma);
* :mod:`fp8rl_jax.kernels.tuner`: the on-device autotuner (``FP8RL_AUTOTUNE=off|cached|on``, ``train.autotune``):
  times a kernel's candidate configurations on first use of a shape on a GPU and keeps the fastest, persisted per
  device kind and JAX version; shipped tables in ``fp8rl_jax/kernels/data/autotuning/<device_kind>/<op>.json``.

The registry (self-tests, ``FP8RL_KERNELS``) is :mod:`fp8rl_jax.fp8.kernels`; the older kernels still live beside
the numerics contract in :mod:`fp8rl_jax.fp8` (``mosaic_gemm``, ``pallas_quant``, ``pallas_attention``,
``pallas_grouped``, ``pallas_decode``) and move here as they are reworked. Importing this package imports no
Mosaic GPU module (kernels build their Pallas calls lazily).

Kernels no "auto" path chooses, and why they stay: the Pallas-Triton tiled W8A8 GEMM (``fp8/pallas_gemm.py``,
``impl="pallas"``: f16 ``mma.sync``) is the independent second implementation the Mosaic GEMM's tests and the
GPU A/B runs compare against; the Triton split-K decode kernel (``fp8/pallas_decode.py``, ``impl="fused"``) still
serves e5m2 weights at M <= 64 (the swap-AB kernel is e4m3 only) and is the baseline of
``benchmarks/gpu_queue/10_decode_gemm_ab.py``. Both go once a GPU run has measured their replacements.
"""
