"""Qwen3-MoE sparse MLP block (top-k routed SwiGLU experts) for the Flax NNX decoder, with HF/vLLM names.

Semantics follow ``transformers`` ``Qwen3MoeSparseMoeBlock`` / ``Qwen3MoeTopKRouter`` / ``Qwen3MoeExperts``
(transformers 5.x) and vLLM ``Qwen3MoeSparseMoeBlock`` (``FusedMoE(renormalize=norm_topk_prob)``):

1. router logits ``x @ gate.weight.T`` (``mlp.gate``, ``[num_experts, hidden]``, no bias), in the compute dtype;
2. ``softmax`` over experts in float32, then ``top_k`` (``num_experts_per_tok``) of the probabilities;
3. if ``norm_topk_prob`` the k weights are renormalised to sum to 1; they are then cast to the compute dtype;
4. each selected expert ``e`` computes ``down_proj(silu(gate_proj(x)) * up_proj(x))`` and its output is scaled
   by its routing weight; the k outputs are summed. There are no shared experts in Qwen3-MoE.

Parameter layout. The router is ``model.layers.{i}.mlp.gate.weight`` ``[num_experts, hidden]``. The experts are
one :class:`~fp8rl_jax.models.experts.StackedExperts` per layer (issue 19): NNX paths
``mlp.experts.{gate,up,down}_proj.weight``, HF's per-expert ``[N, K]`` layout stacked on a leading expert axis
(``gate_proj`` / ``up_proj`` ``[E, moe_intermediate_size, hidden]``, ``down_proj`` ``[E, hidden,
moe_intermediate_size]``; FP8: e4m3 plus ``weight_scale_inv [E, ceil(N/128), ceil(K/128)]``). Slice ``j`` is
expert ``j``'s checkpoint tensor ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` (HF checkpoints on disk,
vLLM's loader: ``RoutedExperts.build_expert_params_mapping`` maps ``experts.{j}.gate_proj.`` / ``up_proj.`` to the
fused ``experts.w13_*`` shards ``w1`` / ``w3`` and ``experts.{j}.down_proj.`` to ``experts.w2_*``). Every name-based
path (``named_params``, ``load_named_params``, the FP8 export, the rollout engine's in-place update,
``build_sharded_model``) still speaks the per-expert HF names and translates with
:func:`~fp8rl_jax.models.experts.split_expert_stacks` / :func:`~fp8rl_jax.models.experts.stack_expert_tensors`.
A model has O(layers) expert variables, and the stacked dimension is sharded over the ``expert`` mesh axis.

Compute. The experts run as grouped matmuls on the ``T * k`` (token, expert) pairs sorted by expert, reading the
stacks directly (no per-forward stacking): the work is ``T * k`` rows, not ``T * E``, no token is ever dropped (no
capacity factor), and it is differentiable. Two lowerings (``SparseMoeBlock.grouped_impl``):

* ``"tiled"`` (:mod:`fp8rl_jax.models.grouped`): the pairs in fixed-size tiles of one expert each, one batched
  ``dot_general`` over the tiles with each tile's expert weight gathered; memory linear in the routed rows. XLA
  lowers ``ragged_dot`` densely (every row against all E experts: XLA:CPU always, XLA:GPU by default), which made
  the Qwen3-30B-A3B train step's temporaries 322-572 GiB per device; tiled they fit (docs/REPRODUCTION.md).
* ``"ragged_dot"``: :func:`jax.lax.ragged_dot` on ``[E, K, N]`` views of the stacks.

``"auto"`` (default) picks whichever moves fewer elements (:func:`fp8rl_jax.models.grouped.prefer_tiled`):
tiles for training, prefill and large decode batches, ``ragged_dot`` for decode steps of a few rows per expert
(where most tiles would be padding copies of a weight). On a mesh with ``expert = e > 1`` each layer dispatches its
routed rows by all-to-all (:mod:`fp8rl_jax.models.expert_parallel`, :func:`set_expert_parallel`; the trainer and the
engine set it from gin's ``moe.dispatch``): each device routes its tokens, sends every (token, expert) row to the
device owning that expert, runs its ``E / e`` local experts with the kernel choice below on what it received, and
gets the outputs back for the same deterministic combine; dropless, equal to the ``expert = 1`` path (float32 to
1e-6). With ``moe.dispatch = "replicated"`` the ``expert`` axis shards the stacks' storage only: XLA does not split the
tiled product over it (the per-tile weight gather from an ``expert``-sharded stack becomes a masked local gather plus
an all-reduce, so every device holds all tiles on its ``fsdp`` shard of the hidden size).
With FP8 experts the W8A8 blockwise numerics are those of
:func:`fp8rl_jax.fp8.w8a8_block_matmul`'s dequantize path: activations are quantized per token in 1x128 groups
(vLLM ``QuantFP8`` native rounding), weights are the dequantized e4m3 blocks, products accumulate in float32. Where
the program is lowered for CUDA the experts read the e4m3 stacks as they are (gate and up as two products: no
per-call concatenation of the stacks), in the kernel that :func:`grouped_expert_kernel` picks by the routed row
count (the one place; each kernel behind ``choose`` with its own family): prefill-sized counts take the Mosaic GPU FP8
wgmma GEMM on the tile layout (:func:`fp8rl_jax.kernels.mosaic_gemm.mosaic_grouped_w8a8_matmul`, tiles of 64 or 128
rows, activations quantized once per tile row in 1x128 groups; family ``w8a8_gemm``), decode-sized ones the grouped
swap-AB Mosaic GPU decode GEMM (:func:`fp8rl_jax.kernels.decode_grouped_mgpu.grouped_decode_w8a8_matmul`: tiles of 8
to 64 rows of one expert, the expert's weight as wgmma's A operand, split-K, unused tiles skipped, activations
quantized once per layer; family ``grouped_decode``; e4m3 stacks) or, for other FP8 formats, the Triton grouped kernel
(:func:`fp8rl_jax.kernels.pallas_grouped.grouped_w8a8_matmul`, 16-row tiles, empty ones skipped; family
``grouped_experts``). Each token's k expert
outputs are summed by :func:`fp8rl_jax.models.grouped.combine_top_k` (a gather and one reduction), not by a
scatter-add, so the result (and the logprobs) do not change from run to run on a GPU, where a scatter-add is atomic. The router always stays dense in ``param_dtype`` (bf16 in rollout), as
verl's FP8 rollout keeps ``mlp.gate`` in its ignored layers. When a training-precision ``dot_general`` is set on
the expert projections (FP8 training, :mod:`fp8rl_jax.trainer.precision`), the experts always run tiled with that
product on the ``[G, m, K] x [G, N, K]`` tiles (each routed row once; each tile's weight quantized in its own
128x128 blocks, which equal the expert's); lowered for CUDA with the Mosaic kernel allowed, the tile edge ``m`` is
rounded up to a multiple of 64 (Hopper's wgmma M), so that the FP8 training product's GEMMs
(:func:`fp8rl_jax.fp8.dot_general.cuda_gemm_impl`: batched -> the Mosaic kernel, one weight per tile) pad nothing.

Rollout routing replay (R3, arXiv 2510.11370, Sec. 3). :meth:`SparseMoeBlock.forward` returns the router's own
top-k expert ids (what the rollout engine records) and takes optional recorded ids ``replay_ids`` (``-1`` = no
record, route normally). A token with a record runs exactly the recorded experts; its gate weights are recomputed
from *this* forward's router (:func:`replay_gate_weights`: float32 softmax over all experts gathered at the
recorded ids, renormalised iff ``norm_topk_prob``), so the router still gets gradients. With ``norm_topk_prob``
this equals R3's replayed gate ``softmax(router_logits masked to the recorded set)``; without it the gate keeps
the model's own (un-renormalised) top-k semantics, so a replay of the ids the same weights chose reproduces that
forward bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.fp8 import dequantize_weight_blockwise, fake_quantize_activation
from fp8rl_jax.kernels.registry import choose, run_pallas
from fp8rl_jax.kernels.mosaic_gemm import WG_ROWS, mosaic_grouped_w8a8_matmul
from fp8rl_jax.kernels.pallas_grouped import grouped_w8a8_matmul  # registers the grouped_experts family's self-test
from fp8rl_jax.kernels.decode_grouped_mgpu import (decode_tile_rows, decode_tiles,  # and grouped_decode's
                                                   grouped_decode_w8a8_matmul, tile_experts)
from fp8rl_jax.kernels.pallas_quant import quantize_activation_groupwise_dispatch
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.experts import StackedExperts
from fp8rl_jax.models.expert_parallel import ExpertParallel, ep_experts, expert_parallel as make_expert_parallel
from fp8rl_jax.models.grouped import choose_tile_rows, combine_top_k, prefer_tiled, tile_layout, tiled_dot
from fp8rl_jax.models.layers import Linear


def route_top_k(router_logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Qwen3-MoE routing: float32 softmax over experts, top-k, optional renormalisation.

    Args:
      router_logits: ``[T, E]`` (any float dtype).
      top_k: experts per token (``num_experts_per_tok``).
      norm_topk_prob: divide the k probabilities by their sum (HF ``norm_topk_prob``; vLLM ``renormalize``).

    Returns:
      ``(weights [T, k] float32, expert_ids [T, k] int32)``, experts in descending probability order
      (ties broken towards the lower expert id, as ``torch.topk`` / ``jax.lax.top_k``).

    Raises:
      ValueError: ``top_k`` not in ``[1, E]``.

    Source: transformers ``Qwen3MoeTopKRouter.forward``.
    """
    e = router_logits.shape[-1]
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def replay_gate_weights(router_logits: jax.Array, expert_ids: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """Gate weights of given (recorded) experts under the current router: the R3 replayed gate.

    ``probs = softmax(router_logits)`` in float32 over all experts, gathered at ``expert_ids``; divided by their
    sum iff ``norm_topk_prob`` (then equal to R3's ``softmax`` of the router logits masked to the recorded set,
    arXiv 2510.11370 Sec. 3). Differentiable w.r.t. ``router_logits`` (the router keeps learning under replay).
    For ``expert_ids`` equal to :func:`route_top_k`'s ids the result equals its weights bit for bit.

    Args:
      router_logits: ``[T, E]`` (any float dtype).
      expert_ids: int ``[T, k]`` in ``[0, E)`` (negative ids are clipped to 0: mask them out before use).
      norm_topk_prob: renormalise the k weights to sum to 1.

    Returns:
      float32 ``[T, k]``.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    w = jnp.take_along_axis(probs, jnp.maximum(expert_ids, 0).astype(jnp.int32), axis=-1)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w


def route_with_replay(router_logits: jax.Array, top_k: int, norm_topk_prob: bool,
                      replay_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routing of one MoE layer with optional rollout routing replay (R3, arXiv 2510.11370 Sec. 3).

    Args:
      router_logits: ``[T, E]``.
      top_k, norm_topk_prob: as :func:`route_top_k`.
      replay_ids: optional int ``[T, k]`` recorded expert ids; a row with any id ``< 0`` has no record and is
        routed normally. ``None``: no replay (the result is :func:`route_top_k`'s, bit for bit).

    Returns:
      ``(weights [T, k] float32, used_ids [T, k] int32, router_ids [T, k] int32)``: the experts the layer runs
      and their gate weights, and the router's own top-k (equal to ``used_ids`` without replay).

    Raises:
      ValueError: ``replay_ids`` is not ``[T, k]``; ``top_k`` out of range.
    """
    weights, ids = route_top_k(router_logits, top_k, norm_topk_prob)
    if replay_ids is None:
        return weights, ids, ids
    if tuple(replay_ids.shape) != tuple(ids.shape):
        raise ValueError(f"replay_ids must have shape {tuple(ids.shape)} ([tokens, top_k]), got "
                         f"{tuple(replay_ids.shape)}")
    replay_ids = replay_ids.astype(jnp.int32)
    has = jnp.all(replay_ids >= 0, axis=-1, keepdims=True)
    used = jnp.where(has, replay_ids, ids)
    w = jnp.where(has, replay_gate_weights(router_logits, used, norm_topk_prob), weights)
    return w, used, ids


#: tile edges of the Mosaic expert path, largest first (multiples of Hopper's wgmma M = 64; 128 = two warpgroups)
MOSAIC_TILE_ROWS = (128, 64)


def grouped_expert_kernel(num_rows: int, num_experts: int) -> int | None:
    """Which kernel FP8 experts run where the program is lowered for CUDA, by the routed row count: the one place.

    Returns the tile edge ``m`` of the Mosaic GPU path (:func:`fp8rl_jax.kernels.mosaic_gemm.mosaic_grouped_w8a8_matmul`
    on the tile layout), or None for the decode-sized kernels (the grouped swap-AB Mosaic GPU decode GEMM,
    :func:`fp8rl_jax.kernels.decode_grouped_mgpu.grouped_decode_w8a8_matmul`, for e4m3 stacks; else the Triton
    grouped kernel, :func:`fp8rl_jax.kernels.pallas_grouped.grouped_w8a8_matmul`). The Mosaic grid is static:
    ``G = floor((R + E (m - 1)) / m)`` tiles of ``m`` rows, each a CTA row that streams its expert's weight and runs
    its wgmma whether its rows are real or padding (at most ``E (m - 1)`` of them). So ``m`` is the largest of
    :data:`MOSAIC_TILE_ROWS` whose worst-case padding is at most the routed rows themselves (``E (m - 1) <= R``: at most twice the rows' work); when not even ``m = 64`` meets
    that (decode: at Qwen3-30B-A3B, E = 128, fewer than 8064 routed rows, ~1000 tokens at top-8) the decode kernels
    keep the rows in small tiles (8-64 rows; Triton: 16) and skip the unused ones. Element counts, not a timing (no
    GPU here): tune the crossover on the device.

    Args:
      num_rows: ``R = tokens * top_k`` (static). num_experts: ``E``.

    Raises:
      ValueError: non-positive ``num_experts`` or negative ``num_rows``.
    """
    if num_experts <= 0 or num_rows < 0:
        raise ValueError(f"grouped_expert_kernel needs num_rows >= 0 and num_experts > 0, got {num_rows}, "
                         f"{num_experts}")
    for m in MOSAIC_TILE_ROWS:
        if num_experts * (m - 1) <= num_rows:
            return m
    return None


class SparseMoeBlock(nnx.Module):
    """Qwen3-MoE MLP: router ``gate`` + ``experts`` (see the module docstring for semantics and names).

    Args:
      cfg: a ``qwen3_moe`` :class:`ModelConfig` (``num_experts``, ``num_experts_per_tok``,
        ``moe_intermediate_size``, ``norm_topk_prob``).
      linear_precision: ``"dense"`` or ``"fp8"`` for the experts; the router is always dense.
      param_dtype: storage dtype of dense params (router included).
      dtype: activation/compute dtype.
      rngs: ``nnx.Rngs`` for random init.

    Raises:
      ValueError: ``cfg`` has no experts.
    """

    def __init__(self, cfg: ModelConfig, *, linear_precision: str, param_dtype, dtype, rngs: nnx.Rngs):
        if cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ValueError(f"SparseMoeBlock needs num_experts > 0 and num_experts_per_tok > 0, got "
                             f"{cfg.num_experts} and {cfg.num_experts_per_tok} (model_type={cfg.model_type!r})")
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.dtype, self.precision = dtype, linear_precision
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, precision="dense", param_dtype=param_dtype, dtype=dtype,
                           rngs=rngs)
        # The experts' weights stacked on a leading expert axis (:mod:`fp8rl_jax.models.experts`): NNX paths
        # ``mlp.experts.{gate,up,down}_proj.weight`` ``[E, N, K]`` (+ ``weight_scale_inv`` in FP8).
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                      linear_precision=linear_precision, param_dtype=param_dtype, dtype=dtype,
                                      rngs=rngs)

    #: FP8 experts: ``"auto"`` (where the program is lowered for CUDA the kernel of :func:`grouped_expert_kernel`,
    #: the XLA path below elsewhere: :func:`fp8rl_jax.kernels.registry.choose`, family ``w8a8_gemm`` or
    #: ``grouped_decode`` or ``grouped_experts`` as that kernel is), ``"pallas"``
    #: (always the Triton grouped kernel), ``"mosaic"`` (always the Mosaic GPU kernel on 64-row tiles or
    #: :func:`grouped_expert_kernel`'s), ``"swapab"`` (always the grouped swap-AB decode kernel; all three: interpret
    #: mode where not lowered for CUDA) or ``"ragged_dot"`` (never a kernel).
    fp8_expert_impl: str = "auto"

    def _fp8_stacks(self):
        ex = self.experts
        return tuple((p.weight[...], p.weight_scale_inv[...]) for p in (ex.gate_proj, ex.up_proj, ex.down_proj))

    def _mosaic_experts(self, xt, weights, order, group_sizes, *, tile_rows: int, interpret=None) -> jax.Array:
        """FP8 experts with the Mosaic GPU wgmma kernel on the tile layout (:mod:`fp8rl_jax.models.grouped`).

        ``xt [T, hidden]``, ``weights [T, k]``, ``order [T*k]`` (pairs sorted by expert), ``group_sizes [E]`` ->
        ``[T, hidden]`` in ``dtype``. Each tile slot gathers its token's row (padding slots: zero rows), the rows are
        quantized once per tile row in 1x128 e4m3 groups (vLLM ``QuantFP8`` native rounding, the kernel-free path's
        :meth:`_act_in`), then gate and up read those same e4m3 rows and the stacks as they are, the SwiGLU output
        is quantized the same way for down, and each routed row's output is gathered back from its slot.

        Args:
          tile_rows: ``m``, a multiple of 64. interpret: as :func:`~fp8rl_jax.kernels.mosaic_gemm.mosaic_w8a8_matmul`
            (None: compiled where lowered for CUDA, Mosaic GPU's interpreter elsewhere).
        """
        rows = xt.shape[0] * self.top_k
        lay = tile_layout(group_sizes, rows, tile_rows)
        bs = self.experts.gate_proj.block_size

        def gemm(aq, a_s, wq, ws, out_dtype):
            return run_pallas(mosaic_grouped_w8a8_matmul, aq, a_s, wq, ws, lay.tile_group, interpret=interpret,
                              tile_rows=tile_rows, block_size=bs, out_dtype=out_dtype)

        return self._experts_on_tiles(xt, weights, order, lay.slot_row, lay.valid, lay.row_slot, gemm)

    def _experts_on_tiles(self, xt, weights, order, slot_row, valid, row_slot, gemm) -> jax.Array:
        """The FP8 expert SwiGLU on tiled rows, shared by the Mosaic GPU paths: each slot gathers its token's row
        (``slot_row [S]`` into the expert-sorted pairs; ``valid [S]`` False: a zero row), the rows are quantized once
        in 1x128 e4m3 groups (vLLM ``QuantFP8`` native rounding), gate and up read those same e4m3 rows through
        ``gemm(aq, a_scales, wq, ws, out_dtype) -> [S, N]`` (the stacks as they are), the SwiGLU output is quantized
        the same way for down, and each routed row's output is gathered back from its slot (``row_slot [T*k]``),
        gate-weighted and combined per token: ``[T, hidden]`` in ``dtype``."""
        token = order[slot_row] // self.top_k
        x = jnp.where(valid[:, None], xt[token], jnp.zeros((), xt.dtype))  # [S, hidden]
        (qg, sg), (qu, su), (qd, sd) = self._fp8_stacks()
        bs = self.experts.gate_proj.block_size

        def quant(v):
            return quantize_activation_groupwise_dispatch(v, bs, fp8_dtype=jnp.dtype(qg.dtype),
                                                          fp8_max=float(jnp.finfo(qg.dtype).max))

        xq, xs = quant(x)
        g = gemm(xq, xs, qg, sg, jnp.float32)
        u = gemm(xq, xs, qu, su, jnp.float32)
        h = jax.nn.silu(g.astype(self.dtype)) * u.astype(self.dtype)
        hq, hs = quant(h)
        y = gemm(hq, hs, qd, sd, self.dtype)
        y = y[row_slot] * weights.reshape(-1)[order][:, None]  # sorted rows
        return combine_top_k(y, order, self.top_k)

    def _swapab_experts(self, xt, weights, order, group_sizes, *, interpret=None) -> jax.Array:
        """FP8 experts at decode-sized row counts with the grouped swap-AB Mosaic GPU kernel
        (:func:`fp8rl_jax.kernels.decode_grouped_mgpu.grouped_decode_w8a8_matmul`) on the tile layout.

        ``xt [T, hidden]``, ``weights [T, k]``, ``order [T*k]`` (pairs sorted by expert), ``group_sizes [E]`` ->
        ``[T, hidden]`` in ``dtype``. The ``R = T*k`` routed rows go into tiles of ``m`` rows
        (:func:`~fp8rl_jax.kernels.decode_grouped_mgpu.decode_tile_rows`: 8 at decode) of one expert each, at most
        :func:`~fp8rl_jax.kernels.decode_grouped_mgpu.decode_tiles` of them; tiles past the used ones are marked
        ``-1`` and the kernel skips them (no weight of an expert without rows is read). The rows are quantized once
        in 1x128 e4m3 groups (vLLM ``QuantFP8`` native rounding), gate and up read those same e4m3 rows, the SwiGLU
        output is quantized the same way for down, and each routed row's output is gathered back from its slot:
        the numerics of :meth:`_mosaic_experts` per row.

        Args:
          interpret: None (compiled where lowered for CUDA, Mosaic GPU's interpreter elsewhere), True or False.
        """
        rows = xt.shape[0] * self.top_k
        m = decode_tile_rows(rows, self.num_experts)
        g = decode_tiles(rows, self.num_experts, m)
        lay = tile_layout(group_sizes, rows, m)
        tile_expert = tile_experts(group_sizes, lay.tile_group, g, m)

        def gemm(aq, a_s, wq, ws, out_dtype):
            return run_pallas(grouped_decode_w8a8_matmul, aq, a_s, wq, ws, tile_expert, interpret=interpret,
                              tile_rows=m, out_dtype=out_dtype, num_rows=rows)

        return self._experts_on_tiles(xt, weights, order, lay.slot_row[:g * m], lay.valid[:g * m], lay.row_slot,
                                      gemm)

    def _fp8_grouped_experts(self, xs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Expert SwiGLU on rows grouped by expert with the grouped W8A8 kernel (e4m3 weights read as they are).

        ``xs [T*k, hidden]`` sorted by expert, ``group_sizes [E]`` -> ``[T*k, hidden]`` in ``dtype``. gate and up run
        as two grouped products reading the stacks in place: a fused ``[E, 2I, hidden]`` operand (vLLM's ``w13``)
        would have to be concatenated per call (a copy of both stacks, ~0.4 GB per layer at Qwen3-30B-A3B), which
        costs far more than reading the routed rows twice.
        """
        (qg, sg), (qu, su), (qd, sd) = self._fp8_stacks()
        bs = self.experts.gate_proj.block_size
        g = grouped_w8a8_matmul(xs, group_sizes, qg, sg, block_size=bs, out_dtype=jnp.float32)
        u = grouped_w8a8_matmul(xs, group_sizes, qu, su, block_size=bs, out_dtype=jnp.float32)
        h = jax.nn.silu(g.astype(self.dtype)) * u.astype(self.dtype)
        return grouped_w8a8_matmul(h, group_sizes, qd, sd, block_size=bs, out_dtype=self.dtype)

    #: Experts off the FP8 kernel: ``"auto"`` (tiles when :func:`~fp8rl_jax.models.grouped.prefer_tiled` says
    #: they touch fewer elements than ``ragged_dot``'s dense expansion: training and prefill), ``"tiled"`` or
    #: ``"ragged_dot"``. A training-precision ``dot_general`` (FP8 training) always runs tiled.
    grouped_impl: str = "auto"
    #: Tile edge of the tiled path (rows per tile); None: :func:`~fp8rl_jax.models.grouped.choose_tile_rows`.
    tile_rows: int | None = None

    def _tile_rows(self, rows: int) -> int:
        _, inter, hidden = self.experts.gate_proj.weight.shape
        return self.tile_rows or choose_tile_rows(rows, self.num_experts, inter, hidden)

    def _training_tiled(self, xt, weights, order, group_sizes) -> jax.Array:
        """The tiled experts under a training ``dot_general`` (FP8 training): :meth:`_tiled_experts` with the tile
        edge of :meth:`_tile_rows` (``m``); where the program is lowered for CUDA and the Mosaic kernel is allowed
        (family ``w8a8_gemm``), ``m`` rounded up to a multiple of 64, so that the product's batched Mosaic GEMMs
        (one per tile) get whole 64-row warpgroup tiles (an 8-32-row tile would be padded to 64 inside the GEMM).
        Elsewhere exactly :meth:`_tiled_experts` with ``m`` (lowered for the CPU nothing changes)."""
        m = self._tile_rows(order.shape[0])
        mk = -(-m // WG_ROWS) * WG_ROWS
        args = (xt, weights, order, group_sizes)
        if mk == m:
            return self._tiled_experts(*args, tile_rows=m)
        return choose("w8a8_gemm", *args, kernel=functools.partial(self._tiled_experts, tile_rows=mk),
                      xla=functools.partial(self._tiled_experts, tile_rows=m))

    def _grouped_impl(self, rows: int) -> str:
        impl = self.grouped_impl
        if impl not in ("auto", "tiled", "ragged_dot"):
            raise ValueError(f"grouped_impl must be 'auto', 'tiled' or 'ragged_dot', got {impl!r}")
        if impl != "auto":
            return impl
        _, inter, hidden = self.experts.gate_proj.weight.shape
        tiled = prefer_tiled(rows, self.num_experts, self._tile_rows(rows), inter, hidden)
        return "tiled" if tiled else "ragged_dot"

    def _tile_proj(self, lin, x_tiles: jax.Array, tile_group: jax.Array, acc) -> jax.Array:
        """One expert projection on tiles: ``x_tiles [G, m, K]`` -> ``[G, m, N]`` with each tile's expert weight.

        FP8 weights: the tiles' e4m3 blocks and scales gathered, dequantized in float32 (the numerics of the
        ``ragged_dot`` path; a training ``dot_general`` never reaches FP8 weights:
        :func:`fp8rl_jax.trainer.precision.apply_train_precision` refuses pre-quantized linears); a ``dot_general``
        set (FP8 training): it runs on the ``[G, N, K]`` tiles of the
        weight cast to ``dtype`` (gathered from the master stack, so the per-tile weight gradients are summed
        per expert in the master dtype); else ``jax.lax.dot_general`` in ``dtype`` accumulating in ``acc``.
        """
        if lin.precision == "fp8":
            w = dequantize_weight_blockwise(lin.weight[...][tile_group], lin.weight_scale_inv[...][tile_group],
                                            lin.block_size, out_dtype=jnp.float32)
            return tiled_dot(x_tiles, w.astype(x_tiles.dtype), preferred_element_type=acc)
        w = lin.weight[...][tile_group].astype(self.dtype)
        if lin.dot_general is not None:
            return tiled_dot(x_tiles.astype(self.dtype), w, dot_general=lin.dot_general)
        return tiled_dot(x_tiles.astype(self.dtype), w, preferred_element_type=acc)

    def _tiled_experts(self, xt: jax.Array, weights: jax.Array, order: jax.Array,
                       group_sizes: jax.Array, tile_rows: int | None = None) -> jax.Array:
        """The experts on the ``T * k`` expert-sorted pairs in tiles (:mod:`fp8rl_jax.models.grouped`).

        ``xt [T, hidden]``, ``weights [T, k]`` (dtype), ``order [T*k]`` (pair indices sorted by expert),
        ``group_sizes [E]`` -> ``[T, hidden]`` in ``dtype``. Each slot gathers its token's row directly (no sorted
        copy of the rows); padding slots are zero rows whose outputs are discarded. ``tile_rows``: the tile edge
        (None: :meth:`_tile_rows`).
        """
        ex = self.experts
        t, hidden = xt.shape
        rows = t * self.top_k
        m = tile_rows or self._tile_rows(rows)
        lay = tile_layout(group_sizes, rows, m)
        pair = order[lay.slot_row]                              # [G*m] (token, slot) pair of each tile slot
        token = pair // self.top_k
        keep = lay.valid[:, None]
        xs = self._act_in(jnp.where(keep, xt[token], jnp.zeros((), xt.dtype))).reshape(-1, m, hidden)
        acc = jnp.float32 if self.precision == "fp8" else self.dtype
        g = self._tile_proj(ex.gate_proj, xs, lay.tile_group, acc)
        u = self._tile_proj(ex.up_proj, xs, lay.tile_group, acc)
        h = jax.nn.silu(g.astype(self.dtype)) * u.astype(self.dtype)
        hs = self._act_in(h.reshape(-1, h.shape[-1]))
        y = self._tile_proj(ex.down_proj, hs.reshape(h.shape), lay.tile_group, acc).astype(self.dtype)
        y = y.reshape(-1, hidden)[lay.row_slot] * weights.reshape(-1)[order][:, None]  # sorted rows
        return combine_top_k(y, order, self.top_k)

    def router(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [T, hidden]`` -> ``(router_logits [T, E] dtype, weights [T, k] float32, expert_ids [T, k] int32)``.

        The logits are ``gate(x)``, the dense router ``Linear`` in the compute dtype. The router is never run in
        FP8: the FP8 export leaves ``mlp.gate`` unquantized and FP8 training
        (:func:`fp8rl_jax.trainer.precision.apply_train_precision`) skips it for the same reason.
        """
        logits = self.gate(x)
        w, ids = route_top_k(logits, self.top_k, self.norm_topk_prob)
        return logits, w, ids

    def _act_in(self, x: jax.Array) -> jax.Array:
        """Activation entering an expert matmul: fp8 -> 1x128 e4m3 quantize-dequantize in float32."""
        if self.precision == "fp8":
            return fake_quantize_activation(x.astype(jnp.float32), self.experts.gate_proj.block_size)
        return x.astype(self.dtype)

    def __call__(self, x: jax.Array, replay_ids: jax.Array | None = None) -> jax.Array:
        """``x [B, S, hidden]`` (or ``[T, hidden]``) -> same shape and dtype ``dtype`` (see :meth:`forward`)."""
        return self.forward(x, replay_ids)[0]

    def forward(self, x: jax.Array, replay_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The block with optional rollout routing replay (R3, arXiv 2510.11370 Sec. 3).

        Args:
          x: ``[..., hidden]``.
          replay_ids: optional int ``[..., top_k]`` recorded expert ids (``-1`` rows: route normally); the gate
            weights of replayed rows come from this forward's router (:func:`route_with_replay`).

        Returns:
          ``(out [..., hidden] in dtype, router_ids [..., top_k] int32)``: the router's own top-k (descending
          probability), whether or not it was replayed: what a rollout engine records.

        Raises:
          ValueError: ``replay_ids`` of the wrong shape.
        """
        shape = x.shape
        xt = x.reshape(-1, shape[-1]).astype(self.dtype)
        t = xt.shape[0]
        logits = self.gate(xt)
        rep = None
        if replay_ids is not None:
            if tuple(replay_ids.shape) != tuple(shape[:-1]) + (self.top_k,):
                raise ValueError(f"replay_ids must have shape {tuple(shape[:-1]) + (self.top_k,)} (x's leading dims + "
                                 f"top_k), got {tuple(replay_ids.shape)}")
            rep = jnp.reshape(replay_ids, (t, self.top_k))
        weights, ids, router_ids = route_with_replay(logits, self.top_k, self.norm_topk_prob, rep)
        router_ids = router_ids.reshape(shape[:-1] + (self.top_k,))
        weights = weights.astype(self.dtype)  # HF casts the top-k weights back to the logits dtype
        if self.expert_parallel is not None:  # expert-parallel dispatch (all-to-all of the routed rows)
            return self._expert_parallel_experts(xt, weights, ids).reshape(shape), router_ids
        flat = ids.reshape(-1)                                  # [T*k] expert of each (token, slot)
        order = jnp.argsort(flat, stable=True)                  # group pairs by expert
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        return self._run_experts(xt, weights, order, group_sizes).reshape(shape), router_ids

    #: Expert-parallel dispatch (:func:`set_expert_parallel`): an
    #: :class:`~fp8rl_jax.models.expert_parallel.ExpertParallel`, or None (every device runs every expert's tiles)
    expert_parallel: ExpertParallel | None = None

    def _expert_parallel_experts(self, xt: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        """``[T, hidden]`` -> ``[T, hidden]`` through :func:`~fp8rl_jax.models.expert_parallel.ep_experts`: each
        device runs its ``E/e`` experts (the stacks' slices, under ``shard_map``) with :meth:`_run_experts` on the
        rows it received, the same kernel choice as the replicated path."""
        gdef, state = nnx.split(self.experts)
        ep = self.expert_parallel

        def run_local(local_state, rows, group_sizes):
            view = _LocalExperts(self, nnx.merge(gdef, local_state), ep.local_experts)
            n = rows.shape[0]
            return view._run_experts(rows, jnp.ones((n, 1), self.dtype), jnp.arange(n, dtype=jnp.int32),
                                     group_sizes)

        return ep_experts(ep, run_local, state, xt, weights, ids)

    def _run_experts(self, xt: jax.Array, weights: jax.Array, order: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The experts on ``T * k`` expert-sorted pairs, each token's outputs gate-weighted and combined:
        ``xt [T, hidden]``, ``weights [T, k]``, ``order [T*k]``, ``group_sizes [E]`` -> ``[T, hidden]`` in ``dtype``.
        The one place the expert kernel is chosen (:attr:`fp8_expert_impl`, :func:`grouped_expert_kernel`)."""
        args = (xt, weights, order, group_sizes)
        impl = self.fp8_expert_impl
        if impl not in ("auto", "pallas", "mosaic", "swapab", "ragged_dot"):
            raise ValueError(f"fp8_expert_impl must be 'auto', 'pallas', 'mosaic', 'swapab' or 'ragged_dot', got "
                             f"{impl!r}")
        if self.precision != "fp8" or impl == "ragged_dot":
            out = self._xla_experts(*args)
        elif impl == "pallas":
            out = self._triton_experts(*args)
        elif impl == "mosaic":
            m = grouped_expert_kernel(order.shape[0], self.num_experts) or MOSAIC_TILE_ROWS[-1]
            out = self._mosaic_experts(*args, tile_rows=m)
        elif impl == "swapab":
            out = self._swapab_experts(*args)
        elif (m := grouped_expert_kernel(order.shape[0], self.num_experts)) is not None:
            # prefill-sized row counts: the Mosaic GPU kernel on m-row tiles (its family: w8a8_gemm)
            out = choose("w8a8_gemm", *args, kernel=functools.partial(self._mosaic_experts, tile_rows=m,
                                                                         interpret=False), xla=self._xla_experts)
        elif self._swapab_ok():  # decode-sized e4m3 experts: the grouped swap-AB Mosaic GPU kernel (issue 37)
            out = choose("grouped_decode", *args, kernel=functools.partial(self._swapab_experts, interpret=False),
                         xla=self._xla_experts)
        else:  # decode-sized, other FP8 formats: the Triton grouped kernel
            out = choose("grouped_experts", *args, kernel=self._triton_experts, xla=self._xla_experts)
        return out

    def _swapab_ok(self) -> bool:
        """Whether the grouped swap-AB kernel takes these experts: e4m3 stacks in 128x128 blocks (vLLM's W8A8)."""
        p = self.experts.gate_proj
        return p.block_size == 128 and jnp.dtype(p.weight.dtype) == jnp.dtype(jnp.float8_e4m3fn)

    def _triton_experts(self, xt, weights, order, group_sizes) -> jax.Array:
        """FP8 experts with the Triton grouped W8A8 kernel (:meth:`_fp8_grouped_experts`), combined per token."""
        y = self._fp8_grouped_experts(xt[order // self.top_k], group_sizes)
        return combine_top_k(y * weights.reshape(-1)[order][:, None], order, self.top_k)

    def _xla_experts(self, xt, weights, order, group_sizes) -> jax.Array:
        """The experts without our kernels: tiled (:meth:`_tiled_experts`) or ``ragged_dot``, combined per token. A
        training ``dot_general`` runs tiled (:meth:`_training_tiled`)."""
        ex = self.experts
        if ex.gate_proj.dot_general is not None:
            return self._training_tiled(xt, weights, order, group_sizes)
        if self._grouped_impl(order.shape[0]) == "tiled":
            return self._tiled_experts(xt, weights, order, group_sizes)
        acc = jnp.float32 if self.precision == "fp8" else self.dtype
        wg, wu, wd = (p.stacked_kn(self.dtype) for p in (ex.gate_proj, ex.up_proj, ex.down_proj))
        xs = self._act_in(xt[order // self.top_k])
        g = jax.lax.ragged_dot(xs, wg.astype(xs.dtype), group_sizes, preferred_element_type=acc)
        u = jax.lax.ragged_dot(xs, wu.astype(xs.dtype), group_sizes, preferred_element_type=acc)
        h = (jax.nn.silu(g.astype(self.dtype)) * u.astype(self.dtype))
        hs = self._act_in(h)
        y = jax.lax.ragged_dot(hs, wd.astype(hs.dtype), group_sizes, preferred_element_type=acc).astype(self.dtype)
        return combine_top_k(y * weights.reshape(-1)[order][:, None], order, self.top_k)


#: ``expert_impl`` values of :func:`set_expert_impl` (engine and trainer)
EXPERT_IMPLS = ("auto", "pallas", "mosaic", "swapab", "tiled", "ragged_dot")


def set_expert_impl(model: nnx.Module, impl: str) -> str:
    """Set how every :class:`SparseMoeBlock` of ``model`` runs its experts; returns ``impl``.

    ``"auto"``: FP8 experts take a kernel where the program is lowered for CUDA (:func:`fp8rl_jax.kernels.registry.choose`;
    :func:`grouped_expert_kernel`: the Mosaic GPU GEMM for prefill-sized row counts, the grouped swap-AB Mosaic GPU
    decode GEMM for decode-sized ones (e4m3; Triton for other formats)), and otherwise tiles or ``ragged_dot``,
    whichever moves fewer elements; ``"pallas"`` / ``"mosaic"`` / ``"swapab"``: FP8 experts always take the Triton /
    the Mosaic GPU / the grouped swap-AB kernel (interpret mode where not lowered for CUDA); ``"tiled"`` /
    ``"ragged_dot"``: never a kernel, that XLA path.

    Raises:
      ValueError: an unknown ``impl`` (the valid ones named).
    """
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"expert_impl={impl!r} is not one of {EXPERT_IMPLS}")
    for _, mod in nnx.iter_modules(model):
        if isinstance(mod, SparseMoeBlock):
            mod.fp8_expert_impl = impl if impl in ("auto", "pallas", "mosaic", "swapab") else "ragged_dot"
            mod.grouped_impl = impl if impl in ("tiled", "ragged_dot") else "auto"
    return impl


class _LocalExperts:
    """A device's ``E/e`` experts under expert parallelism, seen as a :class:`SparseMoeBlock` whose experts are the
    local stack slices: the block's own expert methods run on it (no second copy of the kernel choice). Rows are
    already routed and sorted, so ``top_k`` is 1 and the gate weights are applied by the caller."""

    def __init__(self, block: "SparseMoeBlock", experts: StackedExperts, num_experts: int):
        self.experts, self.num_experts, self.top_k = experts, num_experts, 1
        for name in ("dtype", "precision", "fp8_expert_impl", "grouped_impl", "tile_rows"):
            setattr(self, name, getattr(block, name))


for _name in ("_run_experts", "_xla_experts", "_training_tiled", "_grouped_impl", "_tiled_experts", "_tile_proj",
              "_tile_rows", "_act_in", "_triton_experts", "_fp8_grouped_experts", "_mosaic_experts", "_fp8_stacks",
              "_swapab_experts", "_swapab_ok", "_experts_on_tiles"):
    setattr(_LocalExperts, _name, getattr(SparseMoeBlock, _name))


def set_expert_parallel(model: nnx.Module, mesh, dispatch: str = "auto", *, all_to_all: str = "auto",
                        capacity_factors=None, chunk_tokens: int | None = None) -> bool:
    """Set how every :class:`SparseMoeBlock` of ``model`` dispatches its routed rows over ``mesh``'s ``expert`` axis.

    Args:
      model: the model (changed in place).
      mesh: the mesh the model runs on, or None (one device).
      dispatch: ``"auto"`` / ``"all_to_all"`` (expert parallelism where ``expert > 1``:
        :mod:`fp8rl_jax.models.expert_parallel`) or ``"replicated"`` (every device runs every expert's tiles on its
        tokens; the ``expert`` axis shards storage only).
      all_to_all: ``"auto"`` (ragged where lowered for CUDA, static buffers elsewhere), ``"static"``, ``"ragged"``.
      capacity_factors: receive capacities tried before the dropless one (None: the module default).
      chunk_tokens: tokens a device dispatches per all-to-all round (None: the module default; 0: one round), which
        bounds the dispatch buffers (:mod:`fp8rl_jax.models.expert_parallel`, "Memory bounded by token rounds").

    Returns:
      whether expert parallelism is on.

    Raises:
      ValueError: as :func:`fp8rl_jax.models.expert_parallel.expert_parallel` (unknown values, ``num_experts`` not
        divisible by the ``expert`` axis).
    """
    kw = {} if capacity_factors is None else {"capacity_factors": tuple(capacity_factors)}
    kw |= {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    on = False
    for _, mod in nnx.iter_modules(model):
        if isinstance(mod, SparseMoeBlock):
            mod.expert_parallel = make_expert_parallel(mesh, mod.num_experts, dispatch, all_to_all=all_to_all, **kw)
            on = on or mod.expert_parallel is not None
    return on


def tiny_qwen3_moe_config(vocab_size: int, *, hidden_size: int = 64, num_hidden_layers: int = 2,
                          num_experts: int = 4, num_experts_per_tok: int = 2, moe_intermediate_size: int = 32,
                          bos_token_id: int | None = None, eos_token_id: int | None = None,
                          pad_token_id: int | None = None) -> ModelConfig:
    """A tiny Qwen3-MoE :class:`ModelConfig` (4 heads, 2 KV heads, head_dim 16, every layer sparse, renormalised).

    For smoke runs and tests only (random weights). Raises ``ValueError`` for non-positive sizes.
    """
    return ModelConfig(model_type="qwen3_moe", vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=2048,
                       bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                       num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                       moe_intermediate_size=moe_intermediate_size, norm_topk_prob=True, qk_norm=True)


def write_tiny_qwen3_moe(path: str, *, tokenizer_source: str = "smollm2-135m-instruct", seed: int = 0,
                         **sizes) -> ModelConfig:
    """Write a random-weight tiny Qwen3-MoE HF directory (``config.json``, ``model.safetensors``, tokenizer).

    The vocabulary and special tokens come from ``tokenizer_source`` (default: the packaged SmolLM2 tokenizer,
    vocab 49152, with its chat template), so the directory works as ``train.model=<path>``. Weights are the
    decoder's random init (normal(0.02), norms 1) from ``seed``, stored float32 under HF/vLLM names.

    Args:
      path: output directory (created).
      tokenizer_source: anything :func:`fp8rl_jax.models.loading.load_tokenizer_for` accepts.
      seed: init seed.
      sizes: overrides for :func:`tiny_qwen3_moe_config` (``hidden_size``, ``num_experts``, ...).

    Returns:
      the written config.

    Raises:
      FileNotFoundError: the tokenizer source is missing (e.g. the SmolLM2 package is not installed).
    """
    from fp8rl_jax.models.decoder import named_params
    from fp8rl_jax.models.hf_io import save_hf_dir
    from fp8rl_jax.models.loading import build_model, load_tokenizer_for

    tok = load_tokenizer_for(tokenizer_source)
    eos = tok.eos_token_ids
    cfg = tiny_qwen3_moe_config(tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=eos[0] if eos else None,
                                pad_token_id=tok.pad_token_id, **sizes)
    model = build_model(cfg, seed=seed)
    save_hf_dir(path, cfg, named_params(model))
    tok.save(path)
    return cfg


if __name__ == "__main__":  # python -m fp8rl_jax.models.moe OUT_DIR
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m fp8rl_jax.models.moe OUT_DIR  (writes a random tiny Qwen3-MoE HF directory)")
    print(write_tiny_qwen3_moe(sys.argv[1]))
