"""Dropless grouped matmul of expert-sorted rows in fixed-size tiles: a memory-light ``ragged_dot`` for MoE.

Why (issue 19): :func:`jax.lax.ragged_dot` is lowered densely by XLA:CPU and, by default, by XLA:GPU (XLA's
``RaggedDotRewriter`` expands the ragged operand to a zero-padded ``[E, R, K]`` and runs a batched dot; cuDNN's
ragged-dot fusion is behind the experimental ``xla_gpu_experimental_use_ragged_dot_fusion`` flag and rewrites the
weight gradient densely even then). For a Qwen3-30B-A3B train step (E = 128 experts) that expansion made the
planner's per-device temporaries 322-572 GiB. This module computes the same product with memory and FLOPs
proportional to the ``R`` routed rows, as a plain batched ``dot_general`` that every backend, sharding propagation
and any custom ``dot_general`` (FP8 training's included) accept.

Layout (the padded block layout of MegaBlocks' block-sparse MoE, Gale et al. 2022, and of megablox ``gmm``): the
``R = T * k`` (token, expert) rows sorted by expert, group ``e`` of ``g_e`` rows, are placed in tiles of ``m``
rows that each hold rows of one expert only. Expert ``e`` gets ``ceil(g_e / m)`` consecutive tiles, its last one
zero-padded. The static tile count ``G = floor((R + E * (m - 1)) / m)`` bounds ``sum_e ceil(g_e / m)`` for any
routing; the tiles past the last used one are all padding (they compute zeros). Tile ``t`` multiplies its ``m``
rows with its expert's ``[N, K]`` weight, gathered per tile: one ``[G, m, K] x [G, N, K] -> [G, m, N]``
``dot_general`` with the tile as batch dimension. Its gradient is a batched dot plus a segment sum of the ``G``
per-tile weight gradients into ``[E, N, K]`` (the gather's transpose).

Cost: ``G * m <= R + E * (m - 1)`` rows (FLOPs ``G * m * N * K``) and ``G * N * K`` gathered weight elements,
against ``E * R * (K + N)`` elements for the dense expansion. :func:`choose_tile_rows` balances the two terms;
:func:`prefer_tiled` compares the tiled and expanded footprints. No row is ever dropped (no capacity factor).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

#: smallest / largest tile edge :func:`choose_tile_rows` returns
MIN_TILE_ROWS, MAX_TILE_ROWS = 8, 1024


class TileLayout(NamedTuple):
    """Where each slot of the ``[G * m]`` tiled rows comes from (see the module docstring).

    Attributes:
      slot_row: int32 ``[G * m]``: the sorted-row index (in ``[0, R)``) a slot holds; padding slots hold 0.
      valid: bool ``[G * m]``: the slot holds a row (False: padding; callers feed it a zero row and drop its output,
        as :func:`grouped_matmul` does with ``mode="drop"``).
      tile_group: int32 ``[G]``: the expert (group) of each tile; padding tiles get the last group.
      row_slot: int32 ``[R]``: the slot of each sorted row (the inverse of ``slot_row`` on the valid slots), so a
        row's output is a gather ``y[row_slot]``, not a scatter.
    """

    slot_row: jax.Array
    valid: jax.Array
    tile_group: jax.Array
    row_slot: jax.Array


def num_tiles(num_rows: int, num_groups: int, tile_rows: int) -> int:
    """The static tile count ``G = floor((R + E * (m - 1)) / m)`` that fits any split of ``R`` rows into ``E``
    groups (at least 1).

    Raises:
      ValueError: non-positive ``num_groups`` or ``tile_rows``, or negative ``num_rows``.
    """
    if num_groups <= 0 or tile_rows <= 0 or num_rows < 0:
        raise ValueError(f"num_tiles needs num_rows >= 0, num_groups > 0 and tile_rows > 0, got {num_rows}, "
                         f"{num_groups}, {tile_rows}")
    return max(1, (num_rows + num_groups * (tile_rows - 1)) // tile_rows)


def choose_tile_rows(num_rows: int, num_groups: int, n: int, k: int) -> int:
    """A tile edge ``m`` (a power of two in ``[8, 1024]``) that balances padding against gathered weights.

    The padding rows cost about ``E * m / 2 * (K + N)`` elements, the gathered weights ``(R / m + E) * N * K``;
    their sum is smallest near ``m = sqrt(2 * R * N * K / (E * (K + N)))``, rounded down to a power of two.

    Args:
      num_rows: ``R`` (static). num_groups: ``E``. n, k: the weight's ``N`` (output) and ``K`` (contracting).

    Raises:
      ValueError: non-positive ``num_groups``, ``n`` or ``k``.
    """
    if min(num_groups, n, k) <= 0:
        raise ValueError(f"choose_tile_rows needs positive num_groups, n, k, got {num_groups}, {n}, {k}")
    best = math.sqrt(2.0 * max(num_rows, 1) * n * k / (num_groups * (k + n)))
    m = 1 << max(0, int(math.floor(math.log2(max(best, 1.0)))))
    return int(min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, m)))


def prefer_tiled(num_rows: int, num_groups: int, tile_rows: int, n: int, k: int) -> bool:
    """Whether the tiled product moves fewer elements than ``ragged_dot``'s dense expansion.

    Tiled: ``G * m * (K + N)`` for the tiled rows plus ``3 * G * N * K`` for the gathered weights (read from the
    stack, written as tiles, read by the product); expanded: ``2 * E * R * (K + N) + E * N * K`` (XLA's rewrite of
    a ragged dot into a batched dot over the zero-padded ``[E, R, K]`` operand: the expanded rows and outputs
    written and read, each weight read once). Decode steps of a few rows per expert (at 30B-A3B sizes up to about
    64 sequences: most tiles would be padding copies of a weight) favour the expansion; larger decode batches,
    prefill and training favour the tiles. Element counts, not a timing model.

    Args:
      num_rows: ``R``. num_groups: ``E``. tile_rows: ``m``. n, k: the weight's ``N`` and ``K``.

    Raises:
      ValueError: as :func:`num_tiles`.
    """
    g = num_tiles(num_rows, num_groups, tile_rows)
    tiled = g * tile_rows * (k + n) + 3 * g * n * k
    expanded = 2 * num_groups * num_rows * (k + n) + num_groups * n * k
    return tiled < expanded


#: the most comparisons :func:`searchsorted_right` does as one broadcast compare (``method="compare_all"``)
COMPARE_ALL_LIMIT = 1 << 24


def searchsorted_right(sorted_seq: jax.Array, queries: jax.Array) -> jax.Array:
    """``jnp.searchsorted(sorted_seq, queries, side="right")`` (int32, same result) with the method chosen by size:
    ``"compare_all"`` (one fused compare-and-count over ``len(seq) x len(queries)``) up to
    :data:`COMPARE_ALL_LIMIT` comparisons, else the default ``"scan"``. The default is a ``while`` loop of
    ``log2(len(seq))`` steps, each several kernel launches on a GPU (a decode step's MoE tile layout held two such
    loops per layer); the sizes here (experts x tiles or rows) make the comparison one small kernel."""
    method = "compare_all" if sorted_seq.shape[0] * queries.size <= COMPARE_ALL_LIMIT else "scan"
    return jnp.searchsorted(sorted_seq, queries, side="right", method=method).astype(jnp.int32)


def tile_layout(group_sizes: jax.Array, num_rows: int, tile_rows: int) -> TileLayout:
    """The tile layout of ``R`` rows sorted by group (``group_sizes[e]`` rows of group ``e``, in order).

    Args:
      group_sizes: int ``[E]``, non-negative, summing to ``num_rows`` (traced; not checked).
      num_rows: ``R`` (static).
      tile_rows: ``m`` (static, positive).

    Returns:
      a :class:`TileLayout` with ``G = num_tiles(R, E, m)`` tiles.

    Raises:
      ValueError: ``group_sizes`` is not 1-D; bad sizes (:func:`num_tiles`).
    """
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D [num_groups], got shape {tuple(group_sizes.shape)}")
    e = int(group_sizes.shape[0])
    m = int(tile_rows)
    g = num_tiles(num_rows, e, m)
    sizes = group_sizes.astype(jnp.int32)
    tiles = (sizes + m - 1) // m                       # [E] tiles per group
    tile_end = jnp.cumsum(tiles)                       # [E] exclusive end tile of each group
    tile_start = tile_end - tiles
    row_start = jnp.cumsum(sizes) - sizes              # [E] first sorted row of each group
    tile_group = jnp.minimum(searchsorted_right(tile_end, jnp.arange(g, dtype=jnp.int32)), e - 1).astype(jnp.int32)
    slot = jnp.arange(g * m, dtype=jnp.int32)
    t = slot // m
    grp = tile_group[t]
    rank = (t - tile_start[grp]) * m + slot % m        # row rank within its group
    valid = (t < tile_end[-1]) & (rank < sizes[grp])
    slot_row = jnp.where(valid, row_start[grp] + rank, 0).astype(jnp.int32)
    r = jnp.arange(num_rows, dtype=jnp.int32)
    row_grp = jnp.minimum(searchsorted_right(jnp.cumsum(sizes), r), e - 1)
    row_slot = (tile_start[row_grp] * m + r - row_start[row_grp]).astype(jnp.int32)
    return TileLayout(slot_row, valid, tile_group, row_slot)


def combine_top_k(y_sorted: jax.Array, order: jax.Array, top_k: int) -> jax.Array:
    """Sum each token's ``top_k`` expert outputs, deterministically: ``[T * k, H]`` expert-sorted rows -> ``[T, H]``.

    Row ``r`` of ``y_sorted`` is pair ``order[r]`` (pair ``p`` = token ``p // k``, slot ``p % k``). The rows are
    gathered back into pair order (``order``'s inverse permutation, a scatter of unique indices) and summed over the
    ``k`` slots by one reduction: the same additions in the same order on every run. ``zeros.at[token].add(y)``
    computes the same sum but becomes an atomic scatter-add on a GPU, whose order (and so the rounded result, hence
    the logprobs) changes from run to run.

    Args:
      y_sorted: ``[T * k, H]``. order: int ``[T * k]``, a permutation (the expert sort of the pairs).
      top_k: ``k``.

    Returns:
      ``[T, H]`` in ``y_sorted.dtype``.

    Raises:
      ValueError: ``order`` does not match ``y_sorted``'s rows or they are not a multiple of ``k``.
    """
    rows = y_sorted.shape[0]
    if order.shape != (rows,) or rows % top_k:
        raise ValueError(f"combine_top_k: order {tuple(order.shape)} must be [{rows}] and {rows} rows a multiple of "
                         f"top_k={top_k}")
    inv = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32), unique_indices=True)
    return jnp.sum(y_sorted[inv].reshape(rows // top_k, top_k, -1), axis=1, dtype=y_sorted.dtype)


def tiled_dot(x_tiles: jax.Array, w_tiles: jax.Array, *, dot_general: Callable | None = None,
              preferred_element_type=None) -> jax.Array:
    """``out[t] = x_tiles[t] @ w_tiles[t].T``: ``[G, m, K] x [G, N, K] -> [G, m, N]`` (tile = batch dimension).

    Args:
      x_tiles: ``[G, m, K]`` rows of each tile.
      w_tiles: ``[G, N, K]`` each tile's expert weight (HF ``[out, in]`` layout), e.g. ``stack[tile_group]``.
      dot_general: a ``jax.lax.dot_general``-compatible product (e.g. FP8 training's); None: ``jax.lax``'s.
      preferred_element_type: accumulation / output dtype for ``jax.lax.dot_general`` (ignored with a custom
        ``dot_general``, whose output dtype is its own).

    Returns:
      ``[G, m, N]`` in ``preferred_element_type`` (else the operands' promoted dtype), or a custom
      ``dot_general``'s output dtype.

    Raises:
      ValueError: mismatched tile counts or contracting sizes.
    """
    if x_tiles.ndim != 3 or w_tiles.ndim != 3 or x_tiles.shape[0] != w_tiles.shape[0] \
            or x_tiles.shape[2] != w_tiles.shape[2]:
        raise ValueError(f"tiled_dot needs x [G, m, K] and w [G, N, K], got {tuple(x_tiles.shape)} and "
                         f"{tuple(w_tiles.shape)}")
    dims = (((2,), (2,)), ((0,), (0,)))
    if dot_general is not None:
        return dot_general(x_tiles, w_tiles, dims)
    return jax.lax.dot_general(x_tiles, w_tiles, dims, preferred_element_type=preferred_element_type)


def grouped_matmul(xs: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int | None = None,
                   dot_general: Callable | None = None, preferred_element_type=None) -> jax.Array:
    """``out[r] = xs[r] @ w[g(r)].T`` for rows sorted by group: :func:`jax.lax.ragged_dot` semantics, tiled.

    Equals ``jax.lax.ragged_dot(xs, swapaxes(w, 1, 2), group_sizes)`` (up to float summation order) with
    memory linear in the rows (module docstring).

    Args:
      xs: ``[R, K]`` rows, grouped by group id in ascending order.
      w: ``[E, N, K]`` per-group weights (HF ``[out, in]`` per expert, stacked).
      group_sizes: int ``[E]`` summing to ``R``.
      tile_rows: tile edge ``m``; None: :func:`choose_tile_rows`.
      dot_general, preferred_element_type: as :func:`tiled_dot`.

    Returns:
      ``[R, N]`` in :func:`tiled_dot`'s output dtype.

    Raises:
      ValueError: ``xs`` / ``w`` / ``group_sizes`` shapes disagree.
    """
    if xs.ndim != 2 or w.ndim != 3 or xs.shape[1] != w.shape[2] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul needs xs [R, K], w [E, N, K], group_sizes [E]; got {tuple(xs.shape)}, "
                         f"{tuple(w.shape)}, {tuple(group_sizes.shape)}")
    r, k = xs.shape
    e, n, _ = w.shape
    if r == 0:
        return jnp.zeros((0, n), preferred_element_type or jnp.result_type(xs.dtype, w.dtype))
    m = tile_rows or choose_tile_rows(r, e, n, k)
    lay = tile_layout(group_sizes, r, m)
    x = jnp.where(lay.valid[:, None], xs[lay.slot_row], jnp.zeros((), xs.dtype))
    y = tiled_dot(x.reshape(-1, m, k), w[lay.tile_group], dot_general=dot_general,
                  preferred_element_type=preferred_element_type).reshape(-1, n)
    return y[lay.row_slot]  # each row's slot (padding slots are never read)
