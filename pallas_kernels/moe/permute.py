"""Token permutation for grouped expert kernels: sort token copies by expert, and combine back.

Each token t picks k experts; its k *copies* (copy c = t * k + j) are sorted by local expert so
every expert's copies form one contiguous group of rows. For the Mosaic GPU kernels each group
starts at a multiple of `block_rows` (the kernel's row tile), so a row tile never mixes experts
and a kernel can write whole tiles; the padding rows are zero and are never read back.

`block_rows=1` is the plain permutation (no padding): `xs[row_of_copy[c]] == x[c // k]`.

Expert parallelism: ids are global; a shard owns experts [expert_offset, expert_offset +
num_local_experts). Copies routed elsewhere get no row (`row_of_copy == num_rows`, one past the
end) and contribute zero in `combine`, so shards' outputs sum to the full result.

Shapes: T tokens, H hidden, k experts per token, n = T * k copies, E local experts, R rows of the
permuted layout (static bound, see `padded_rows`), R / block_rows row tiles.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import swiglu_mlp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Permutation:
  """Where every token copy went.

  row_of_copy: [n] int32, row of copy c in the permuted layout; R (out of range) for copies of
    experts outside the shard.
  group_sizes: [E] int32 copies per local expert.
  group_starts: [E] int32 first row of each expert's group (multiples of block_rows).
  tile_expert: [R / block_rows] int32 local expert of each row tile (last used expert after the
    used tiles, so unused tiles never index out of bounds).
  num_tiles: [1] int32 row tiles in use (the kernels skip the rest).
  """
  row_of_copy: jax.Array
  group_sizes: jax.Array
  group_starts: jax.Array
  tile_expert: jax.Array
  num_tiles: jax.Array


def expert_pool(weights: tuple, layer) -> tuple[tuple, int, jax.Array | int]:
  """The kernels' view of expert weights: (weights as one pool of experts, E_local, the pool
  index of the layer's first expert). One layer's [E, ...] weights are their own pool; with
  `layer`, a stack [L, E, ...] is viewed as [L * E, ...] (a free reshape, so the kernels read
  the layer's experts in place through `tile_expert + base`, and no layer is sliced out)."""
  if layer is None:
    return weights, weights[0].shape[0], 0
  e_local = weights[0].shape[1]
  pool = tuple(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), w) for w in weights)
  base = layer * e_local if isinstance(layer, int) else jnp.asarray(layer, jnp.int32) * e_local
  return pool, e_local, base


def padded_rows(num_copies: int, num_local_experts: int, block_rows: int,
                max_group_size: int | None = None) -> int:
  """Static number of rows R that holds every group padded to block_rows.

  Each non-empty group wastes at most block_rows - 1 rows, and at most min(E, n) groups are
  non-empty. When no group can exceed one tile (`max_group_size <= block_rows`, the decode case:
  a group has at most T copies), every non-empty group is exactly one tile.
  """
  nonempty = min(num_local_experts, num_copies)
  if max_group_size is not None and max_group_size <= block_rows:
    return max(nonempty, 1) * block_rows
  rows = num_copies + nonempty * (block_rows - 1)
  return max(-(-rows // block_rows), 1) * block_rows


def route_copies(expert_ids: jax.Array, *, num_local_experts: int, expert_offset: int,
                 block_rows: int, num_rows: int) -> Permutation:
  """Computes the permutation for expert_ids [T, k] (global ids) into num_rows padded rows."""
  n = expert_ids.size
  e_local = num_local_experts
  local = expert_ids.reshape(-1).astype(jnp.int32) - expert_offset
  in_shard = (local >= 0) & (local < e_local)
  # Out-of-shard copies sort last, into a group (index e_local) that gets no rows.
  key = jnp.where(in_shard, local, e_local)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=e_local + 1).astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes  # unpadded group starts, [E + 1]
  padded_sizes = (sizes[:e_local] + block_rows - 1) // block_rows * block_rows
  padded_starts = jnp.cumsum(padded_sizes) - padded_sizes  # [E]
  sorted_key = key[order]
  rank = jnp.arange(n, dtype=jnp.int32) - starts[sorted_key]
  row_sorted = jnp.where(sorted_key < e_local,
                         padded_starts[jnp.minimum(sorted_key, e_local - 1)] + rank, num_rows)
  row_of_copy = jnp.zeros((n,), jnp.int32).at[order].set(row_sorted.astype(jnp.int32))

  num_tiles_total = num_rows // block_rows
  used_tiles = jnp.sum(padded_sizes) // block_rows
  tile_start = jnp.arange(num_tiles_total, dtype=jnp.int32) * block_rows
  padded_ends = padded_starts + padded_sizes
  # Tile i belongs to the first expert whose padded group ends after the tile's first row: the
  # count of ends at or before it (searchsorted side="right", which jax 0.11.2 cannot trace
  # inside shard_map when only one operand varies over the mesh: the psum expert-parallel
  # path, whose expert offset is per device).
  tile_expert = jnp.sum(padded_ends[None, :] <= tile_start[:, None], axis=1, dtype=jnp.int32)
  return Permutation(row_of_copy=row_of_copy, group_sizes=sizes[:e_local],
                     group_starts=padded_starts.astype(jnp.int32),
                     tile_expert=jnp.minimum(tile_expert, e_local - 1),
                     num_tiles=used_tiles.astype(jnp.int32).reshape(1))


def permute(x: jax.Array, perm: Permutation, *, top_k: int, num_rows: int) -> jax.Array:
  """Gathers token rows into the permuted layout: x [T, H] -> xs [R, H] (padding rows zero)."""
  n = perm.row_of_copy.shape[0]
  # One scatter of int32 indices, then one gather of rows: every row of x moves exactly once.
  token_of_row = jnp.full((num_rows,), x.shape[0], jnp.int32).at[perm.row_of_copy].set(
      jnp.arange(n, dtype=jnp.int32) // top_k, mode="drop")
  return jnp.take(x, token_of_row, axis=0, mode="fill", fill_value=0)


def combine(ys: jax.Array, perm: Permutation, weights: jax.Array, out_dtype) -> jax.Array:
  """Weighted sum back in token order: ys [R, H], weights [T, k] -> [T, H] in out_dtype.

  Accumulates in float32; copies without a row (other shards) gather zeros.
  """
  t, k = weights.shape
  y = jnp.take(ys, perm.row_of_copy, axis=0, mode="fill", fill_value=0)  # [n, H]
  y = y.astype(jnp.float32).reshape(t, k, -1) * weights.astype(jnp.float32)[:, :, None]
  return jnp.sum(y, axis=1).astype(out_dtype)


unpermute = combine


def moe_experts_slots(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                      swiglu: Callable[[jax.Array, jax.Array, jax.Array, int], jax.Array], *,
                      num_local_experts: int, expert_offset: int, block_rows: int,
                      base: jax.Array | int = 0) -> jax.Array:
  """`reference.moe_experts` contract around a slot kernel pair: the copies permuted into
  groups of `block_rows`-row slots, swiglu(xs, slot_expert, num_slots, block_rows) -> ys, the
  weighted combine. `base`: the pool index of the layer's first expert (weights viewed as a
  pool of stacked layers' experts: `expert_pool`)."""
  t, k = expert_ids.shape
  rows = padded_rows(t * k, num_local_experts, block_rows, max_group_size=t)
  perm = route_copies(expert_ids, num_local_experts=num_local_experts,
                      expert_offset=expert_offset, block_rows=block_rows, num_rows=rows)
  xs = permute(x, perm, top_k=k, num_rows=rows)
  ys = swiglu(xs, perm.tile_expert + base, perm.num_tiles, block_rows)
  return combine(ys, perm, weights, x.dtype)


def moe_experts_permuted(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                         expert_offset: int = 0) -> jax.Array:
  """Reference of permute -> grouped SwiGLU (`lax.ragged_dot`) -> combine, with block_rows=1.

  Same contract as `reference.moe_experts`; exists to test `route_copies`/`permute`/`combine`
  on their own (the kernels use the same functions with block_rows = their row tile).
  """
  t, k = expert_ids.shape
  e_local = w_gate.shape[0]
  n = t * k
  perm = route_copies(expert_ids, num_local_experts=e_local, expert_offset=expert_offset,
                      block_rows=1, num_rows=n)
  xs = permute(x, perm, top_k=k, num_rows=n)
  # Out-of-shard copies sit in no group; their rows (zeros, at the end) are left out by
  # ragged_dot (group_sizes sum to the in-shard count) and are never gathered back.
  gate = jax.lax.ragged_dot(xs, w_gate, perm.group_sizes)
  up = jax.lax.ragged_dot(xs, w_up, perm.group_sizes)
  ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, perm.group_sizes)
  return combine(ys, perm, weights, x.dtype)


def tiled_swiglu_reference(xs: jax.Array, tile_expert: jax.Array, num_tiles: jax.Array,
                           w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                           block_rows: int) -> jax.Array:
  """Plain JAX of the tiled expert kernels (grouped and decode): each used tile of
  `block_rows` permuted rows through its expert's SwiGLU MLP; rows of unused tiles are 0."""
  tiles = xs.reshape(-1, block_rows, xs.shape[1])
  ys = jax.vmap(lambda x, e: swiglu_mlp(x, w_gate[e], w_up[e], w_down[e]))(tiles, tile_expert)
  used = jnp.arange(tiles.shape[0]) < num_tiles[0]
  return jnp.where(used[:, None, None], ys, 0).reshape(xs.shape).astype(xs.dtype)
