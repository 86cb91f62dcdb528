"""Parallelism inside the forward: expert-parallel routed experts, batch rows over `data`.

Under `jax.set_mesh(mesh)` with `expert x tensor > 1` (see `engine.model.sharding`), each device
of the expert-parallel group holds E / (expert * tensor) whole experts. Activations entering the
MoE are replicated over that group (tensor-parallel attention ends in an all-reduce), so every
device already has every token of its data shard: it runs its local experts on the copies routed
to them (`moe_experts` with an expert offset; other copies contribute zero) and one `psum` over
the group combines the partial outputs. This is the all-gather + mask formulation of expert
parallelism; it is exact (up to the order of a float sum) and runs on every backend. Its
communication is one all-reduce of [T, H] per MoE layer (float32), like a tensor-parallel MLP.

Why no token dispatch (`ragged_all_to_all`): with tensor-parallel attention every device of the
group already holds every token, so there is nothing to send before the experts; the only
traffic is combining the results, which the all-reduce does. Dispatch pays off when the
activations entering the MoE are *different* per device (data-parallel attention, as in
SGLang's DP-attention + DeepEP): then each device sends only its tokens' routed copies (T*k*H/N
per device instead of an all-reduce of T*H). That layout is the next step for large batches;
`ragged_all_to_all` exists on GPU only (XLA:CPU lacks it), so its CPU twin would be this
all-gather + mask formulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from engine.model import kernels
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.sharding import EP_AXES, axis_size, ep_size


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


def routed_experts(impl: KernelChoice, x: jax.Array, weights: jax.Array, ids: jax.Array,
                   experts: Params) -> jax.Array:
  """x [T, H], weights/ids [T, k], experts {gate, up: [E, H, I], down: [E, I, H]} -> [T, H]."""
  fn = kernels.moe_experts(impl)
  n = ep_size(_mesh())
  if n == 1:
    return fn(x, weights, ids, experts["gate"], experts["up"], experts["down"])
  e_local = experts["gate"].shape[0] // n

  def local(x, weights, ids, gate, up, down):
    offset = jax.lax.axis_index(EP_AXES) * e_local
    y = fn(x, weights, ids, gate, up, down, expert_offset=offset)
    # Partial sums are combined in float32: one rounding at the end, as on one device (and
    # XLA:CPU cannot all-reduce bf16). Costs twice the bytes of a bf16 all-reduce.
    return jax.lax.psum(y.astype(jnp.float32), EP_AXES).astype(x.dtype)

  shard = P(EP_AXES)
  return jax.shard_map(local, in_specs=(P(), P(), P(), shard, shard, shard), out_specs=P(),
                       axis_names=set(EP_AXES))(
                           x, weights, ids, experts["gate"], experts["up"], experts["down"])
