"""Expert-parallel dispatch of routed MoE rows: all-to-all to the experts' owners and back, dropless and exact.

With a mesh whose ``expert`` axis has size ``e > 1`` and ``E`` experts, device ``r`` of an expert group owns experts
``[r * E/e, (r+1) * E/e)`` (the ``experts -> expert`` sharding rule of :mod:`fp8rl_jax.parallel.rules`). One MoE
layer then runs under :func:`jax.shard_map` (GShard, Lepikhin et al. 2020; the routed-row form of MegaBlocks and
maxtext's ``moe.py`` ``sparse_matmul`` with expert parallelism):

1. each device routes its own tokens (outside this module: the router and R3 replay are unchanged) and sorts its
   ``R = T_local * k`` (token, expert) pairs by expert, hence by owning device;
2. **dispatch**: the rows go to their owners by an all-to-all over ``expert``; the count matrix
   ``[e, E/e]`` goes with them, so each owner knows how many rows of each of its experts came from each source;
3. each owner runs its ``E/e`` local experts on what it received, with the grouped GEMMs the replicated path uses
   (bf16/float32 tiles or ``ragged_dot``, FP8 with the same kernels and self-tests): the caller's ``run_local``;
4. **return**: the outputs go back by the transposed all-to-all, to the sorted positions they came from;
5. **combine**: :func:`fp8rl_jax.models.grouped.combine_top_k` sums each token's ``k`` outputs in slot order (a
   gather and one reduction, no scatter-add), as the replicated path does: the same additions in the same order.

The backward is JAX's transpose of the same program (an all-to-all transposes to the reverse all-to-all).

**Dropless, static buffers.** No capacity factor: an owner can receive every row of every source (all tokens to one
expert), so its receive buffer holds ``e * R`` rows (``e`` source blocks of ``R``). Two lowerings of the same
layout (:func:`dispatch_rows` / :func:`return_rows`), chosen by :func:`fp8rl_jax.kernels.registry.on_cuda`:

* ``"static"`` (the CPU's: XLA:CPU has no ``ragged-all-to-all`` thunk): :func:`jax.lax.all_to_all` of a
  ``[e, R, H]`` send buffer (block ``d`` = the rows for device ``d``, zero-padded). Memory per device and direction:
  ``2 e R H`` elements (send + receive buffers); bytes on the wire: ``(e - 1) R H`` per device, whatever the routing.
* ``"ragged"`` (CUDA): :func:`jax.lax.ragged_all_to_all` sends only the real rows of the sorted ``[R, H]`` buffer
  into the receiver's ``[e R, H]`` buffer at ``source * R``. Memory ``(1 + e) R H``; wire bytes: the rows routed off
  the device, ``~(e - 1)/e * R H`` at balanced routing.

**Compute bounded by what arrived.** The local experts see the received rows sorted by local expert, real
rows first. Static shapes would make every tile of the ``e R`` rows run; instead the rows are cut to the smallest of
a few static capacities ``c_i = ceil(f_i R)`` (``f`` from :data:`DEFAULT_CAPACITY_FACTORS`, then ``e``) that holds all
real rows, one :func:`jax.lax.switch` branch per capacity (a branch is one compiled copy of the local experts). The
cut never drops a row (the last capacity holds ``e R``), so the result does not depend on the factors; they only set
the work: at balanced routing ~``R`` rows arrive, the ``1.25 R`` or ``2 R`` branch runs. Memory is not bounded
that way: XLA allocates a conditional's temporaries for its largest branch, and the dropless one holds ``e R`` rows
(a chunked last branch was tried: without remat its saved residuals are the same and the scan's stacking adds more,
117 against 81 GiB in ``benchmarks/ep_mesh_model.py``'s compile).

**Memory bounded by token rounds.** What bounds the memory is the number of tokens a device dispatches at once:
with ``chunk_tokens = C`` (``moe.chunk_tokens``, :data:`DEFAULT_CHUNK_TOKENS`) a device with ``T > C`` local tokens
runs the layer in ``n = ceil(T / C)`` rounds of ``ceil(T / n) <= C`` tokens (a :func:`jax.lax.scan`; the last
round's tail, under ``n`` tokens, is padding that routes nowhere), each a whole dispatch / local experts / return / combine of ``C`` tokens, so every buffer above holds
``e * C * k`` rows instead of ``e * T * k``. Each round's body is rematerialised (:func:`jax.checkpoint`): the scan
keeps only the rounds' inputs for the backward, and one round's temporaries live at a time (forward and backward).
Still dropless: a round sends every row it has. The forward's wire bytes are the same, plus one all-to-all
latency per round (``~(e-1)`` peer messages, small against a round's ``C k H`` bytes at ``C`` in the thousands). The
cost is in the backward: a rematerialised round runs its dispatch, local experts and return again, so with rounds
the MoE layer's forward runs once more in training (twice with ``remat_policy="full"`` around the layer: three
forwards' all-to-alls and expert GEMMs instead of two), the price of holding one round's buffers instead of ``T``
tokens'. Below ``C`` tokens per device (decode, short sequences) nothing changes. Each token meets the same expert weights and the same combine, so the result is the unchunked one up to
the grouped GEMM's tiling, as above; the expert weights' gradients add the rounds' contributions in round order.

**Exactness.** Each routed row meets the same expert weights in a row-wise product, and the combine is the replicated
path's; only the grouped GEMM's tiling (rows per tile, which rows share a tile) differs. In float32 the results
equal the ``expert = 1`` path to rounding of the products' summation order inside one dot (1e-6 relative); bf16 and
FP8 as their ``expert = 1`` bounds (the FP8 activation quantization is per row, 1x128 groups, so it is unchanged).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from fp8rl_jax.kernels.registry import on_cuda
from fp8rl_jax.models.grouped import combine_top_k

#: ``moe.dispatch`` values: ``"all_to_all"`` (expert parallelism, this module) or ``"replicated"`` (every device
#: runs every expert's tiles on its tokens; the ``expert`` axis then shards storage only)
DISPATCHES = ("auto", "all_to_all", "replicated")
#: ``all_to_all`` lowerings: ``"auto"`` (ragged where lowered for CUDA, static elsewhere), ``"static"``, ``"ragged"``
ALL_TO_ALL_IMPLS = ("auto", "static", "ragged")
#: receive capacities tried before the dropless ``e * R`` (as multiples of the local rows ``R``)
DEFAULT_CAPACITY_FACTORS = (1.25, 2.0)
#: tokens a device dispatches per round (see "Memory bounded by token rounds"; 0: all in one round). At Qwen3-30B-A3B
#: sizes (k = 8, H = 2048, bf16) one round's receive buffer on ``expert = 8`` is 8 * 4096 * 8 * 2048 * 2 B = 1 GiB.
DEFAULT_CHUNK_TOKENS = 4096
#: the mesh axes a token batch is split over (:data:`fp8rl_jax.parallel.rules.LOGICAL_RULES` ``batch``)
TOKEN_AXES = ("data", "fsdp", "expert")


#: the ragged all-to-all the ``"ragged"`` lowering calls (a one-element list so that a test can put an emulation of
#: :func:`jax.lax.ragged_all_to_all`'s documented semantics in its place and run the ragged layout on the CPU, whose
#: XLA has no ragged-all-to-all thunk)
RAGGED_ALL_TO_ALL: list = [jax.lax.ragged_all_to_all]


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where and how one MoE layer dispatches its rows (static: part of the compiled program).

    Attributes:
      mesh: the :class:`jax.sharding.Mesh` (axis ``axis`` of size ``e > 1``).
      num_experts: ``E`` (a multiple of ``e``).
      axis: the expert-parallel mesh axis (``"expert"``).
      token_axes: mesh axes the tokens are split over inside the layer (those of :data:`TOKEN_AXES` with size > 1;
        ``axis`` always among them).
      all_to_all: one of :data:`ALL_TO_ALL_IMPLS`.
      capacity_factors: see the module docstring (increasing, > 0).
      chunk_tokens: tokens a device dispatches per round (0: all at once); see the module docstring.
    """

    mesh: Mesh
    num_experts: int
    axis: str = "expert"
    token_axes: tuple[str, ...] = ("expert",)
    all_to_all: str = "auto"
    capacity_factors: tuple[float, ...] = DEFAULT_CAPACITY_FACTORS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @property
    def size(self) -> int:
        """``e``: devices per expert group."""
        return int(self.mesh.shape[self.axis])

    @property
    def local_experts(self) -> int:
        """``E / e``: experts each device owns."""
        return self.num_experts // self.size

    @property
    def token_shards(self) -> int:
        """Devices the tokens are split over (the product of ``token_axes``)."""
        return math.prod(int(self.mesh.shape[a]) for a in self.token_axes)


def expert_parallel(mesh: Mesh | None, num_experts: int, dispatch: str = "auto", *, all_to_all: str = "auto",
                    capacity_factors: Sequence[float] = DEFAULT_CAPACITY_FACTORS,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, axis: str = "expert") -> ExpertParallel | None:
    """The :class:`ExpertParallel` of a mesh, or None where the layer runs replicated.

    Args:
      mesh: the mesh, or None (one device).
      num_experts: ``E``.
      dispatch: ``"auto"`` (all-to-all when ``mesh.shape[axis] > 1``), ``"all_to_all"`` (the same; named for
        configs), or ``"replicated"`` (never: the ``expert`` axis shards the stacks' storage only).
      all_to_all: one of :data:`ALL_TO_ALL_IMPLS`.
      capacity_factors: receive capacities (multiples of the local rows) tried before the dropless one.
      chunk_tokens: tokens a device dispatches per round, ``>= 0`` (0: all at once; see the module docstring).
      axis: the expert mesh axis.

    Returns:
      the plan, or None (no mesh, ``replicated``, or an ``expert`` axis of size 1).

    Raises:
      ValueError: an unknown ``dispatch`` / ``all_to_all``; ``E`` not divisible by the axis size (names both);
        capacity factors that are not positive and increasing; a ``chunk_tokens`` that is not an integer >= 0.
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"moe dispatch={dispatch!r} is not one of {DISPATCHES}")
    if all_to_all not in ALL_TO_ALL_IMPLS:
        raise ValueError(f"all_to_all={all_to_all!r} is not one of {ALL_TO_ALL_IMPLS}")
    f = tuple(float(x) for x in capacity_factors)
    if any(x <= 0 for x in f) or list(f) != sorted(set(f)):
        raise ValueError(f"capacity_factors must be positive and increasing, got {capacity_factors}")
    check_chunk_tokens(chunk_tokens)
    if mesh is None or dispatch == "replicated" or int(mesh.shape.get(axis, 1)) == 1:
        return None
    e = int(mesh.shape[axis])
    if num_experts % e:
        raise ValueError(f"expert parallelism needs num_experts divisible by the '{axis}' mesh axis: {num_experts} "
                         f"experts over {axis}={e} (choose {axis} among the divisors of {num_experts}, or "
                         f"moe dispatch='replicated')")
    token_axes = tuple(a for a in TOKEN_AXES if int(mesh.shape.get(a, 1)) > 1 or a == axis)
    return ExpertParallel(mesh, int(num_experts), axis, token_axes, all_to_all, f, int(chunk_tokens))


def check_chunk_tokens(chunk_tokens, name: str = "chunk_tokens") -> None:
    """Raise ``ValueError`` (naming ``name``) unless ``chunk_tokens`` is an integer >= 0 (``bool`` is refused)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, numbers.Integral) or chunk_tokens < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: one all-to-all round), got {chunk_tokens!r}")


def capacities(rows: int, e: int, factors: Sequence[float]) -> tuple[int, ...]:
    """The static receive capacities: ``ceil(f * rows)`` for each factor below ``e``, then ``e * rows`` (dropless).

    Raises:
      ValueError: ``rows < 0`` or ``e < 1``.
    """
    if rows < 0 or e < 1:
        raise ValueError(f"capacities needs rows >= 0 and e >= 1, got {rows}, {e}")
    caps = sorted({min(e * rows, max(1, math.ceil(f * rows))) for f in factors if f < e} | {e * rows})
    return tuple(c for c in caps if c > 0) or (0,)


class SendLayout:
    """One device's sorted pairs and where they go (all traced ``int32``; ``R`` pairs, ``e`` devices).

    Attributes:
      order: ``[R]`` pair indices sorted by expert (invalid pairs last).
      sorted_ids: ``[R]`` their expert ids (``E`` for an invalid pair).
      send_counts: ``[e]`` rows for each device. send_start: ``[e]`` first sorted position of each device's rows.
      expert_counts: ``[e, E/e]`` rows for each (device, local expert).
    """

    def __init__(self, ids: jax.Array, valid: jax.Array, num_experts: int, e: int):
        flat = jnp.where(valid[:, None], ids.astype(jnp.int32), num_experts).reshape(-1)
        self.order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        self.sorted_ids = flat[self.order]
        counts = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
        self.expert_counts = counts.reshape(e, num_experts // e)
        self.send_counts = jnp.sum(self.expert_counts, axis=1)
        self.send_start = jnp.cumsum(self.send_counts) - self.send_counts


def dispatch_rows(sorted_rows: jax.Array, lay: SendLayout, recv_sizes: jax.Array, axis: str, e: int,
                  impl: str) -> jax.Array:
    """Send each device its rows: ``sorted_rows [R, H]`` (sorted by expert) -> ``[e, R, H]`` received, block ``s``
    holding source ``s``'s rows for this device first, zeros after.

    ``recv_sizes [e]``: the rows each source sends here (the ragged lowering's receive sizes). ``impl``: ``"static"``
    (:func:`jax.lax.all_to_all` of a zero-padded ``[e, R, H]`` buffer) or ``"ragged"``
    (:func:`jax.lax.ragged_all_to_all`, real rows only; CUDA). Same result.
    """
    r, h = sorted_rows.shape
    if impl == "static":
        j = jnp.arange(r, dtype=jnp.int32)
        src = lay.send_start[:, None] + j[None, :]                               # [e, R]
        ok = j[None, :] < lay.send_counts[:, None]
        buf = jnp.where(ok[..., None], sorted_rows[jnp.minimum(src, r - 1)], jnp.zeros((), sorted_rows.dtype))
        return jax.lax.all_to_all(buf, axis, 0, 0, tiled=False)
    me = jax.lax.axis_index(axis).astype(jnp.int32)
    out = jnp.zeros((e * r, h), sorted_rows.dtype)
    got = RAGGED_ALL_TO_ALL[0](sorted_rows, out, lay.send_start, lay.send_counts,
                                    jnp.full((e,), me * r, jnp.int32), recv_sizes, axis_name=axis)
    return got.reshape(e, r, h)


def return_rows(y: jax.Array, lay: SendLayout, recv_sizes: jax.Array, axis: str, e: int, impl: str) -> jax.Array:
    """The transpose of :func:`dispatch_rows`: ``y [e, R, H]`` (block ``s`` = outputs for source ``s``'s rows,
    ``recv_sizes[s]`` of them) -> ``[R, H]`` this device's outputs at its sorted positions (rows of invalid pairs:
    zeros)."""
    _, r, h = y.shape
    if impl == "static":
        back = jax.lax.all_to_all(y, axis, 0, 0, tiled=False)                     # [e, R, H]: block d from device d
        p = jnp.arange(r, dtype=jnp.int32)
        d = jnp.minimum(jnp.searchsorted(jnp.cumsum(lay.send_counts), p, side="right"), e - 1).astype(jnp.int32)
        j = p - lay.send_start[d]
        ok = j < lay.send_counts[d]
        return jnp.where(ok[:, None], back[d, jnp.clip(j, 0, r - 1)], jnp.zeros((), y.dtype))
    their_start = jax.lax.all_to_all(lay.send_start, axis, 0, 0, tiled=True)   # where s keeps its rows for me
    out = jnp.zeros((r, h), y.dtype)
    return RAGGED_ALL_TO_ALL[0](y.reshape(e * r, h), out, jnp.arange(e, dtype=jnp.int32) * r, recv_sizes,
                                     their_start, lay.send_counts, axis_name=axis)


def _local_plan(recv_counts: jax.Array, r: int):
    """Received rows ``[e * R]`` -> (local expert id of each, ``E/e`` meaning padding; stable sort by it)."""
    e, el = recv_counts.shape
    cum = jnp.cumsum(recv_counts, axis=1)                                         # [e, E/e]
    j = jnp.arange(r, dtype=jnp.int32)
    lid = jax.vmap(lambda c: jnp.searchsorted(c, j, side="right"))(cum).astype(jnp.int32).reshape(e * r)
    return lid, jnp.argsort(lid, stable=True).astype(jnp.int32)


def run_local_bounded(run_local: Callable, local_state, rows_sorted: jax.Array, lid_sorted: jax.Array,
                      num_local: int, total: jax.Array, caps: Sequence[int]) -> jax.Array:
    """The local experts on what arrived, with work bounded by static capacities.

    ``run_local(local_state, rows[:c], gs) -> [c, H]`` on the smallest capacity ``c`` of ``caps`` that holds the
    ``total`` real rows (real rows first in ``rows_sorted [N, H]``; ``lid_sorted [N]`` their local expert ids,
    ``num_local`` for padding; ``gs`` the counts of each local expert among the first ``c``). The result is padded
    back to ``[N, H]`` (rows past ``total``: whatever ``run_local`` gave; callers mask them).
    """
    n, h = rows_sorted.shape

    def branch(c):
        def f(operands):
            st, x, ids = operands
            gs = jnp.bincount(ids[:c], length=num_local + 1)[:num_local].astype(jnp.int32)
            y = run_local(st, x[:c], gs)
            return jnp.concatenate([y, jnp.zeros((n - c, y.shape[-1]), y.dtype)], axis=0) if c < n else y
        return f

    operands = (local_state, rows_sorted, lid_sorted)
    if len(caps) == 1:
        return branch(caps[0])(operands)
    idx = jnp.sum(total > jnp.asarray(caps[:-1], jnp.int32)).astype(jnp.int32)
    return jax.lax.switch(idx, [branch(c) for c in caps], operands)


def ep_experts(ep: ExpertParallel, run_local: Callable, expert_state, xt: jax.Array, weights: jax.Array,
               ids: jax.Array) -> jax.Array:
    """The routed experts of one MoE layer under expert parallelism: ``[T, H]`` -> ``[T, H]``.

    Args:
      ep: the plan (:func:`expert_parallel`).
      run_local: ``(local_state, rows [N, H], group_sizes [E/e]) -> [N, H]``: the SwiGLU experts on rows sorted by
        local expert (real rows first, ``sum(group_sizes)`` of them; outputs of the rows past them are ignored), no
        gate weight applied. ``local_state`` is ``expert_state`` with each array's leading ``E`` cut to ``E/e``.
      expert_state: a pytree of arrays with leading dimension ``E`` (the experts' stacks and scales), sharded or
        not: ``shard_map`` hands each device its ``E/e`` slice (a gather over other axes is the fsdp gather).
      xt: ``[T, H]`` tokens. weights: ``[T, k]`` gate weights (compute dtype). ids: int ``[T, k]`` expert ids.

    Returns:
      ``[T, H]`` in the dtype ``run_local`` returns, each token's ``sum_j weights[t, j] * expert_{ids[t, j]}(x_t)``
      summed in slot order (:func:`~fp8rl_jax.models.grouped.combine_top_k`).

    Raises:
      ValueError: mismatched shapes.
    """
    t, h = xt.shape
    k = ids.shape[-1]
    if weights.shape != (t, k) or ids.shape != (t, k):
        raise ValueError(f"ep_experts: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must be [{t}, k]")
    n = ep.token_shards
    tp = -(-max(t, 1) // n) * n
    valid = jnp.arange(tp) < t
    if tp != t:  # pad the tokens to a multiple of the shards; padded tokens route nowhere and output zeros
        xt = jnp.concatenate([xt, jnp.zeros((tp - t, h), xt.dtype)])
        weights = jnp.concatenate([weights, jnp.zeros((tp - t, k), weights.dtype)])
        ids = jnp.concatenate([ids, jnp.zeros((tp - t, k), ids.dtype)])
    e, el = ep.size, ep.local_experts
    tok = PartitionSpec(ep.token_axes)
    state_spec = jax.tree.map(lambda _: PartitionSpec(ep.axis), expert_state)

    def body(impl, st, x, w, i, v):
        """One device's ``T_local`` tokens, in rounds of ``chunk_tokens`` when there are more."""
        tl, c = x.shape[0], ep.chunk_tokens
        if not c or tl <= c:
            return round_(impl, st, x, w, i, v)
        nc = -(-tl // c)
        c = -(-tl // nc)  # equal rounds of at most chunk_tokens: the padding is under one token per round
        pad = nc * c - tl
        if pad:  # the last round's tail: padding that routes nowhere (valid False)
            x, w, i = (jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)]) for a in (x, w, i))
            v = jnp.concatenate([v, jnp.zeros((pad,), v.dtype)])
        one = jax.checkpoint(lambda s_, xs: round_(impl, s_, *xs), prevent_cse=False)
        _, ys = jax.lax.scan(lambda carry, xs: (carry, one(st, xs)), None,
                             tuple(a.reshape((nc, c) + a.shape[1:]) for a in (x, w, i, v)))
        return ys.reshape((nc * c,) + ys.shape[2:])[:tl]

    def round_(impl, st, x, w, i, v):
        r = x.shape[0] * k
        lay = SendLayout(i, v, ep.num_experts, e)
        rows = x[lay.order // k]                                                   # [R, H] sorted by expert
        recv_counts = jax.lax.all_to_all(lay.expert_counts, ep.axis, 0, 0, tiled=False)  # [e, E/e] from source s
        recv_sizes = jnp.sum(recv_counts, axis=1).astype(jnp.int32)               # [e] rows from source s
        recv = dispatch_rows(rows, lay, recv_sizes, ep.axis, e, impl)              # [e, R, H]
        lid, lorder = _local_plan(recv_counts, r)
        total = jnp.sum(recv_sizes)
        flat = recv.reshape(e * r, h)
        y_sorted = run_local_bounded(run_local, st, flat[lorder], lid[lorder], el, total,
                                     capacities(r, e, ep.capacity_factors))
        inv = jnp.zeros((e * r,), jnp.int32).at[lorder].set(jnp.arange(e * r, dtype=jnp.int32), unique_indices=True)
        y = jnp.where((lid < el)[:, None], y_sorted[inv], jnp.zeros((), y_sorted.dtype))
        back = return_rows(y.reshape(e, r, -1), lay, recv_sizes, ep.axis, e, impl)           # [R, H] at sorted positions
        ok = lay.sorted_ids < ep.num_experts
        gate = jnp.where(ok, w.reshape(-1)[lay.order], jnp.zeros((), w.dtype))
        return combine_top_k(back * gate[:, None].astype(back.dtype), lay.order, k)

    def run(impl):
        def f(st, x, w, i, v):
            # check_vma=False: the Pallas kernels the local experts may trace (the FP8 branch of ``choose``) carry
            # no varying-axes annotations; the specs here are exact (state over ``axis``, tokens over token_axes)
            return jax.shard_map(lambda *a: body(impl, *a), mesh=ep.mesh, in_specs=(state_spec, tok, tok, tok, tok),
                                 out_specs=tok, check_vma=False)(st, x, w, i, v)
        return f

    args = (expert_state, xt, weights, ids, valid)
    if ep.all_to_all == "auto":
        out = on_cuda(*args, cuda=run("ragged"), default=run("static"))
    else:
        out = run(ep.all_to_all)(*args)
    return out[:t]


def collective_sizes_per_layer(tokens: int, top_k: int, hidden: int, e: int, itemsize: int) -> dict[str, float]:
    """Bytes one device sends per MoE layer forward (dispatch + return), both lowerings, at balanced routing.

    Static: the whole ``[e, R, H]`` buffer minus the block kept locally, twice. Ragged: the rows routed off the
    device, ``(e - 1)/e`` of ``R``, twice. ``R = tokens * top_k`` (tokens on this device).
    """
    r = tokens * top_k
    return {"static": 2.0 * (e - 1) * r * hidden * itemsize, "ragged": 2.0 * (e - 1) / e * r * hidden * itemsize}


__all__ = ["DISPATCHES", "ALL_TO_ALL_IMPLS", "DEFAULT_CAPACITY_FACTORS", "DEFAULT_CHUNK_TOKENS", "ExpertParallel",
           "expert_parallel", "check_chunk_tokens", "capacities", "SendLayout", "dispatch_rows", "return_rows",
           "run_local_bounded", "ep_experts", "collective_sizes_per_layer"]
