"""Parallelism inside the forward: expert-parallel routed experts, batch rows over `data`.

Under `jax.set_mesh(mesh)` with `expert x tensor > 1` (see `engine.model.sharding`), each device
of the expert-parallel (EP) group of N = expert x tensor devices holds E / N whole experts.
`routed_experts` is the one entry point; `KernelChoice.expert_parallel` picks the formulation
(the model never branches on it):

* "psum" (the default): activations entering the MoE are replicated over the EP group
  (tensor-parallel attention ends in an all-reduce), so every device already has every token of
  its data shard: it runs its local experts on the copies routed to them (`moe_experts` with an
  expert offset; other copies contribute zero) and one float32 `psum` combines the partial
  outputs (all-gather + mask formulation). One collective per layer: best when latency rules
  (decode at small batch).
* "dispatch" (`dispatch_experts`): the token axis is split over `data x expert x tensor` (from
  replicated activations that is a local slice, no traffic). Each device lists, per EP device,
  the tokens that chose at least one expert there (one copy per token and device, however many
  of its k experts live there), exchanges the counts (`all_to_all` of [N] ints), sends the rows
  (token, routing weights and ids bit-cast into one row of unsigned integers) to their owners
  (`exchange`), runs its local experts with the MoE kernel on what it received, sends the
  outputs back by the reverse exchange and sums them per token in float32. The result leaves
  split over the group; XLA all-gathers it where the next layer's tensor-parallel attention
  needs it whole.
* "auto": dispatch when the step has at least DISPATCH_MIN_TOKENS tokens per device (prefill
  sizes), psum below (a guess, not measured on a GPU yet).

`exchange` is the one place the platform matters: on CUDA/ROCm one `ragged_all_to_all` moves
only the real rows (receivers have fixed blocks of C = T/N rows per sender, so no offsets need
exchanging beyond the counts); elsewhere (XLA:CPU has no ragged all-to-all) a padded
`all_to_all` moves whole [N, C] blocks and the padding is masked. Both give identical inputs to
the experts, so results are identical; `lax.platform_dependent` picks the branch at lowering.

Communication per device and MoE layer, per token of the step (T tokens over N devices, hidden H,
c = distinct EP devices a token's k experts live on, N(1 - (1 - 1/N)^k) = 5.25 for uniform
routing with k = N = 8; activations b = 2 bytes):
* psum: ring all-reduce of [T, H] float32: 2 (N-1)/N * H * 4 bytes (Kimi K2.5: 50.2 KB);
* dispatch, ragged: rows out c (N-1)/N^2 * (H + 2k*4/b) * b, results back the same in b bytes,
  plus the all-gather (N-1)/N * H * b for the next layer: Kimi 8.3 + 8.2 + 12.5 = 29 KB (42%
  less than psum; without the all-gather, i.e. with data-parallel attention whose tokens are
  already split, 16.5 KB against 37.6 KB for all-gather + reduce-scatter);
* dispatch, padded all_to_all (the CPU twin): as if c = N: 12.6 + 12.5 + 12.5 = 37.7 KB.
Dispatch costs four dependent collectives per layer (counts, rows, results, all-gather) against
one, which is why decode at small batch stays on psum. The receive buffer holds N * C rows (any
device may receive every token of the group), so the expert kernel runs over a buffer of T rows
padded with rows routed nowhere (id -1).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from engine.model import kernels
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.sharding import EP_AXES, axis_size, ep_size

# "auto" dispatches from this many tokens per device of the mesh (prefill sizes); below it the
# single all-reduce of the psum formulation costs less latency than dispatch's four
# dependent collectives (counts, rows out, results back, all-gather).
DISPATCH_MIN_TOKENS = 16


def _mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def split_batch_over_data(x: jax.Array) -> jax.Array:
  """Constrains activations [B, ...] to be split by row over the mesh's `data` axis (when there
  is one and it divides B); a no-op without a mesh. XLA propagates the split through the
  layers; cache writes from each shard's rows are gathered into the (replicated) page pool."""
  mesh = _mesh()
  data = axis_size(mesh, "data")
  if data == 1 or x.shape[0] % data:
    return x
  return jax.lax.with_sharding_constraint(x, P("data"))


def replicated_features(y: jax.Array) -> jax.Array:
  """Constrains y's last axis to be whole on every device (other axes as XLA propagates them):
  the outputs of `q_a` / `kv_a`, whose columns are split over `tensor`, are gathered here, so
  the norm and the head-split up-projections that follow see them whole. No-op without
  tensor parallelism."""
  if axis_size(_mesh(), "tensor") == 1:
    return y
  return jax.lax.with_sharding_constraint(y, P(*(P.UNCONSTRAINED,) * (y.ndim - 1), None))


def routed_experts(impl: KernelChoice, x: jax.Array, weights: jax.Array, ids: jax.Array,
                   experts: Params, layer: Any = None) -> jax.Array:
  """x [T, H], weights/ids [T, k], experts {gate, up: [E, H, I], down: [E, I, H]} -> [T, H];
  with `layer` (an int32 scalar) the experts are a stack [L, E, ...] of which layer `layer`
  runs, read in place by the kernels.

  One entry point for every layout: one device, the psum formulation, token dispatch
  (`impl.expert_parallel`, see the module docstring)."""
  fn = kernels.moe_experts(impl)
  mesh = _mesh()
  n = ep_size(mesh)
  stacked = layer is not None
  if n == 1:
    extra = {"layer": layer} if stacked else {}
    return fn(x, weights, ids, experts["gate"], experts["up"], experts["down"], **extra)
  if _dispatch_pays(impl.expert_parallel, x.shape[0], mesh):
    return dispatch_experts(fn, x, weights, ids, experts, layer)
  e_local = _num_experts(experts, stacked) // n

  def local(x, weights, ids, layer, gate, up, down):
    offset = jax.lax.axis_index(EP_AXES) * e_local
    y = fn(x, weights, ids, gate, up, down, expert_offset=offset,
           **({"layer": layer} if stacked else {}))
    # Partial sums are combined in float32: one rounding at the end, as on one device (and
    # XLA:CPU cannot all-reduce bf16). Costs twice the bytes of a bf16 all-reduce.
    return jax.lax.psum(y.astype(jnp.float32), EP_AXES).astype(x.dtype)

  shard = _expert_spec(stacked)
  return jax.shard_map(local, in_specs=(P(), P(), P(), P(), shard, shard, shard), out_specs=P(),
                       axis_names=set(EP_AXES))(
                           x, weights, ids, _layer_arg(layer),
                           experts["gate"], experts["up"], experts["down"])


def _num_experts(experts: Params, stacked: bool) -> int:
  return experts["gate"].shape[1 if stacked else 0]


def _layer_arg(layer: Any) -> jax.Array:
  return jnp.asarray(0 if layer is None else layer, jnp.int32)


def _expert_spec(stacked: bool) -> P:
  """Experts split whole over the EP group (after the layer axis of a stack)."""
  return P(None, EP_AXES) if stacked else P(EP_AXES)


def _dispatch_pays(mode: str, tokens: int, mesh) -> bool:
  if mode not in ("psum", "dispatch", "auto"):
    raise ValueError(f"expert_parallel: {mode!r} is not psum, dispatch or auto")
  if mode == "auto":
    return tokens >= DISPATCH_MIN_TOKENS * axis_size(mesh, "data") * ep_size(mesh)
  return mode == "dispatch"


def dispatch_experts(fn, x: jax.Array, weights: jax.Array, ids: jax.Array,
                     experts: Params, layer: Any = None) -> jax.Array:
  """Token-dispatch expert parallelism under the current mesh (see the module docstring).

  The token axis is split over `data x expert x tensor` (padded to a multiple of it); each
  device sends each of its tokens once to every EP device owning one of its chosen experts,
  runs `fn` (the MoE kernel, with the expert offset of its shard) on what it received and sends
  the partial outputs back, where they are summed in float32. Returns [T, H] split the same way
  (XLA gathers it where the next layer needs it replicated).
  """
  mesh = _mesh()
  n = ep_size(mesh)
  stacked = layer is not None
  e_local = _num_experts(experts, stacked) // n
  token_axes = tuple(a for a in ("data",) + EP_AXES if a in mesh.axis_names)
  split = axis_size(mesh, "data") * n
  t = x.shape[0]
  pad = -t % split
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))
    ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)

  def local(x, weights, ids, layer, gate, up, down):
    c = x.shape[0]  # this device's tokens
    me = jax.lax.axis_index(EP_AXES)
    dest = jnp.where(ids >= 0, ids // e_local, -1)  # [C, k] EP device owning each choice
    needs = jnp.any(dest[:, :, None] == jnp.arange(n)[None, None, :], axis=1).T  # [n, C]
    # Block d lists the tokens device d must see, in token order, then the others (unsent).
    order = jnp.argsort(~needs, axis=1, stable=True)  # [n, C]
    sizes = jnp.sum(needs, axis=1).astype(jnp.int32)  # [n]
    sent = jnp.arange(c)[None, :] < sizes[:, None]  # [n, C]
    recv_sizes = jax.lax.all_to_all(sizes, EP_AXES, 0, 0, tiled=True)  # [n] from each device
    packed = exchange(_pack(x, weights, ids)[order], sizes, recv_sizes)
    rx, rw, rids = _unpack(packed, x.shape[1], ids.shape[1], x.dtype)
    received = jnp.arange(c)[None, :] < recv_sizes[:, None]  # [n, C] real rows
    rids = jnp.where(received[..., None], rids, -1)  # padding rows go to no expert
    y = fn(rx.reshape(n * c, -1), rw.reshape(n * c, -1), rids.reshape(n * c, -1), gate, up,
           down, expert_offset=me * e_local, **({"layer": layer} if stacked else {}))
    # The reverse exchange: block s of y goes back to device s, into block `me`. y is already
    # rounded to x's dtype by the kernel, so it travels in that dtype; the sum is float32.
    back = exchange(y.reshape(n, c, -1), recv_sizes, sizes).astype(jnp.float32)
    back = jnp.where(sent[..., None], back, 0.0)
    out = jnp.zeros((c, x.shape[1]), jnp.float32).at[order.reshape(-1)].add(
        back.reshape(n * c, -1))
    return out.astype(x.dtype)

  tokens, shard = P(token_axes), _expert_spec(stacked)
  y = jax.shard_map(local, in_specs=(tokens, tokens, tokens, P(), shard, shard, shard),
                    out_specs=tokens, axis_names=set(token_axes))(
                        x, weights, ids, _layer_arg(layer),
                        experts["gate"], experts["up"], experts["down"])
  return y[:t] if pad else y


def _pack(x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
  """[T, H + m] unsigned integers of x's width: each token's row, then its routing weights and
  expert ids, all bit-cast, so one exchange carries all three. Integers, not x's dtype: a
  float select or copy may canonicalise what it moves (XLA:CPU at -O0 zeroed the bf16
  subnormals that small ids are as bf16 bits), an integer one moves bits."""
  bits = _uint(x.dtype)
  meta = jnp.concatenate([jax.lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.uint32),
                          jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.uint32)], -1)
  meta = jax.lax.bitcast_convert_type(meta, bits).reshape(x.shape[0], -1)
  return jnp.concatenate([jax.lax.bitcast_convert_type(x, bits), meta], axis=-1)


def _unpack(packed: jax.Array, h: int, k: int, dtype: Any) -> tuple[jax.Array, ...]:
  """Inverse of `_pack` on [..., H + m] -> (x [..., H] in `dtype`, weights [..., k], ids
  [..., k])."""
  x, meta = packed[..., :h], packed[..., h:]
  per = 4 // packed.dtype.itemsize  # packed values per 32-bit word
  if per > 1:
    meta = meta.reshape(*meta.shape[:-1], 2 * k, per)
  meta = jax.lax.bitcast_convert_type(meta, jnp.uint32)
  return (jax.lax.bitcast_convert_type(x, dtype),
          jax.lax.bitcast_convert_type(meta[..., :k], jnp.float32),
          jax.lax.bitcast_convert_type(meta[..., k:], jnp.int32))


def _uint(dtype: Any) -> Any:
  """The unsigned integer type as wide as `dtype`."""
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def exchange(blocks: jax.Array, sizes: jax.Array, recv_sizes: jax.Array) -> jax.Array:
  """Inside shard_map over the EP group: the first sizes[d] rows of blocks[d] go to EP device d.

  blocks [n, C, ...], sizes / recv_sizes [n] (recv_sizes[s] = what device s sends here, from
  an all_to_all of sizes). Returns [n, C, ...] whose block s holds device s's rows, then zeros.
  On CUDA/ROCm one `ragged_all_to_all` moves only the real rows; elsewhere (XLA:CPU has no
  ragged all-to-all) a padded `all_to_all` moves whole blocks and the padding is masked: the
  results are identical. The platform is picked when the program is lowered.
  """
  n, c = blocks.shape[:2]
  tail = (1,) * (blocks.ndim - 2)

  def ragged(blocks, sizes, recv_sizes):
    flat = blocks.reshape(n * c, *blocks.shape[2:])
    me = jax.lax.axis_index(EP_AXES)
    starts = jnp.arange(n, dtype=jnp.int32) * c
    out = jax.lax.ragged_all_to_all(flat, jnp.zeros_like(flat), starts, sizes,
                                    jnp.full((n,), me * c, jnp.int32), recv_sizes,
                                    axis_name=EP_AXES)
    return out.reshape(blocks.shape)

  def padded(blocks, sizes, recv_sizes):
    recv = jax.lax.all_to_all(blocks, EP_AXES, 0, 0, tiled=True)
    valid = jnp.arange(c)[None, :] < recv_sizes[:, None]
    return jnp.where(valid.reshape(n, c, *tail), recv, jnp.zeros((), blocks.dtype))

  return jax.lax.platform_dependent(blocks, sizes, recv_sizes, cuda=ragged, rocm=ragged,
                                    default=padded)
