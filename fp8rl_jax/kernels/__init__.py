"""GPU kernels as one family (issue 37): the registry that chooses them, their self-tests, the on-device tuner, and
one module per kernel. Importing this package imports none of them (kernels build their Pallas calls lazily), and
:mod:`fp8rl_jax.fp8` keeps the numerics contract they implement (formats, the reference quantizers,
``dot_general``, FP8 training).

* :mod:`~fp8rl_jax.kernels.registry`: which kernel a GPU program runs (``FP8RL_KERNELS=auto|xla|pallas``,
  ``jax.lax.platform_dependent`` per op) and each family's one-time self-test on the device;
* :mod:`~fp8rl_jax.kernels.tuner`: the on-device autotuner (``FP8RL_AUTOTUNE=off|cached|on``, ``train.autotune``):
  times a kernel's candidate configurations on first use of a shape on a GPU and keeps the fastest, persisted per
  device kind and JAX version; shipped tables in ``fp8rl_jax/kernels/data/autotuning/<device_kind>/<op>.json``;
* :mod:`~fp8rl_jax.kernels.decode_gemm_mgpu`: the swap-AB split-K / stream-K W8A8 decode GEMM (M <= 64; Mosaic GPU,
  FP8 wgmma), with its tuning config and a ``main`` that times it;
* :mod:`~fp8rl_jax.kernels.mosaic_gemm`: the W8A8 blockwise GEMM for M > 64 (prefill, FP8 training, MoE prefill;
  Mosaic GPU, FP8 wgmma, TMA pipeline), with a ``main`` that times it against bf16 at the Qwen3-8B prefill shapes;
* :mod:`~fp8rl_jax.kernels.pallas_quant`: blockwise e4m3 quantization (weights 128x128, activations 1x128: the
  FP8 GEMMs' input quantizer on CUDA, ``quantize_activation_groupwise_dispatch``) and the batched export quantizer,
  with a ``main`` that times it against XLA's jnp quantizers;
* :mod:`~fp8rl_jax.kernels.timing`: the ``main`` functions' jitted timing loop and table;
* :mod:`~fp8rl_jax.kernels.decode_grouped_mgpu`: the grouped swap-AB W8A8 decode GEMM for MoE experts
  (decode-sized routed rows in tiles of one expert, unused tiles skipped; Mosaic GPU, FP8 wgmma);
* :mod:`~fp8rl_jax.kernels.pallas_grouped`: the Pallas-Triton grouped W8A8 MoE expert GEMM (``expert_impl="pallas"``,
  and decode-sized e5m2 experts), with a timing ``main``;
* :mod:`~fp8rl_jax.kernels.pallas_attention`: decode and prefill attention reading the e4m3 KV cache, with a timing
  ``main`` (decode);
* :mod:`~fp8rl_jax.kernels.pallas_decode`, :mod:`~fp8rl_jax.kernels.pallas_gemm`: see below.

Kernels no "auto" path chooses, and why they stay: the Pallas-Triton tiled W8A8 GEMM (``pallas_gemm``,
``impl="pallas"``: f16 ``mma.sync``) is the independent second implementation the Mosaic GEMM's tests and the
GPU A/B runs compare against (and holds the self-tests' shared operands and float32 reference); the Triton split-K
decode kernel (``pallas_decode``, ``impl="fused"``) still serves e5m2 weights at M <= 64 (the swap-AB kernel is
e4m3 only) and is the baseline of ``benchmarks/gpu_queue/10_decode_gemm_ab.py``. Both go once a GPU run has
measured their replacements. The older modules keep their ``pallas_*`` / ``mosaic_*`` names (moved from
``fp8rl_jax/fp8/`` unchanged). Timing ``main`` functions (``python -m fp8rl_jax.kernels.<module>``, ``--smoke`` for
a CPU run in interpret mode): ``decode_gemm_mgpu``, ``mosaic_gemm``, ``pallas_quant``, ``pallas_attention`` and
``pallas_grouped``, each against XLA's path; the two kept baselines (``pallas_gemm``, ``pallas_decode``) are timed by
``benchmarks/bench_fp8_matmul.py`` and ``benchmarks/gpu_queue/10_decode_gemm_ab.py``, and the grouped decode GEMM
(``decode_grouped_mgpu``, no ``main`` of its own: its timing needs the MoE block's tile layout and routed rows
around it) by ``benchmarks/gpu_queue/12_grouped_decode_ab.py``.
"""
