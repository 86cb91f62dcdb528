"""The routed-expert computation, on one device or expert-parallel over the ambient mesh.

Under `jax.set_mesh(mesh)` with `expert x tensor > 1` (see `engine.model.sharding`), each device
of the expert-parallel group holds E / (expert * tensor) whole experts. Activations entering the
MoE are replicated over that group (tensor-parallel attention ends in an all-reduce), so every
device already has every token of its data shard: it runs its local experts on the copies routed
to them (`moe_experts` with an expert offset; other copies contribute zero) and one `psum` over
the group combines the partial outputs. This is the all-gather + mask formulation of expert
parallelism; it is exact (up to the order of a float sum) and runs on every backend. Its
communication is one all-reduce of [T, H] per MoE layer, the same as a tensor-parallel MLP.

Not done yet: the token-dispatch formulation (`ragged_all_to_all` of only the routed copies to
the devices owning their experts, GPU only: XLA:CPU lacks it), which moves T * k * H / N
instead of T * H per device and wins at prefill sizes.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from engine.model import kernels
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.sharding import EP_AXES, ep_size


def routed_experts(impl: KernelChoice, x: jax.Array, weights: jax.Array, ids: jax.Array,
                   experts: Params) -> jax.Array:
  """x [T, H], weights/ids [T, k], experts {gate, up: [E, H, I], down: [E, I, H]} -> [T, H]."""
  fn = kernels.moe_experts(impl)
  mesh = jax.sharding.get_abstract_mesh()
  n = ep_size(mesh) if mesh is not None and not mesh.empty else 1
  if n == 1:
    return fn(x, weights, ids, experts["gate"], experts["up"], experts["down"])
  e_local = experts["gate"].shape[0] // n

  def local(x, weights, ids, gate, up, down):
    offset = jax.lax.axis_index(EP_AXES) * e_local
    y = fn(x, weights, ids, gate, up, down, expert_offset=offset)
    return jax.lax.psum(y, EP_AXES)

  shard = P(EP_AXES)
  return jax.shard_map(local, in_specs=(P(), P(), P(), shard, shard, shard), out_specs=P(),
                       axis_names=set(EP_AXES))(
                           x, weights, ids, experts["gate"], experts["up"], experts["down"])
