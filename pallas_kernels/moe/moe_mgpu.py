"""The MoE layer's expert computation on Mosaic GPU kernels: the engine's "mosaic_gpu" choice.

`moe_experts` has `reference.moe_experts`'s signature and contract (local shard of experts at
`expert_offset`, out-of-shard copies contribute zero) and picks the kernel by token count:

* T <= DECODE_MAX_TOKENS: `decode_mlp_mgpu` (tokens on WGMMA's N axis, one slot per active
  expert, reads only active experts' weights);
* otherwise `grouped_mlp_mgpu` (64-row tiles of sorted token copies, fused gate/up + SiLU);
* INT4 experts (`Int4Weight`), any T: `int4_mlp_mgpu` (W4A16, `w4a16_mgpu`: the packed bytes
  dequantized in registers straight into WGMMA's A operand, a producer warpgroup and two
  consumers, K split over the SMs when few experts are hit; 8-row slots up to 64 tokens, 64-row
  slots above);
* FP8 experts (`Fp8Weight`, 128 x 128 blocks), any T: `fp8_mlp_mgpu` (W8A16, the same
  skeleton: e4m3 tiles times their block's scale into bf16 SMEM tiles).

Both run `permute.route_copies` / `permute` before and `permute.combine` after (plain JAX).
`route` is `routing.route` (plain JAX, no sort/top-k primitive).

Requirements (raise otherwise, no silent fallback): bf16/f16 activations and weights (Hopper
WGMMA takes transposed 16-bit operands only), or INT4 / FP8 experts with bf16 activations; hidden
and expert width multiples of 64 (of 128 for INT4 / FP8: their K step). Tile
choices assume an H100/H200 (132 SMs, 227 KiB SMEM).

Shapes: x [T, H], weights [T, k] float32, expert_ids [T, k] int32 (global ids, distinct per
token), w_gate/w_up [E_local, H, I], w_down [E_local, I, H] -> [T, H] in x's dtype. With
`layer` (a scanned stack's position, int32), w_* are the stack's [L, E_local, ...]: the kernels
see them as one pool of L * E_local experts and address layer `layer`'s through their tile /
slot expert indices, so the stack is read in place.
"""

from __future__ import annotations

import jax

from pallas_kernels.moe import (decode_mlp_mgpu, dequant_mlp_mgpu, fp8_mlp_mgpu, grouped_mlp_mgpu,
                                int4_mlp_mgpu, routing)
from pallas_kernels.quant import is_fp8, is_int4

DECODE_MAX_TOKENS = 64

route = routing.route


def _block_k(k: int) -> int:
  return 128 if k % 128 == 0 else 64


def moe_experts(x: jax.Array, weights: jax.Array, expert_ids: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, *, expert_offset: int = 0,
                layer: jax.Array | int | None = None, num_sms: int = 132) -> jax.Array:
  """Weighted sum of the chosen experts' SwiGLU MLPs over a local shard (see module doc); with
  `layer`, w_* are stacks [L, E_local, ...] and the kernels read layer `layer`'s experts where
  they lie (`permute.expert_pool`: no layer's experts are sliced out and copied)."""
  t, h = x.shape
  inter = w_gate.shape[-1]
  if is_int4(w_gate):
    return int4_mlp_mgpu.moe_experts_int4(x, weights, expert_ids, w_gate, w_up, w_down,
                                          expert_offset=expert_offset, layer=layer,
                                          cfg=int4_mlp_mgpu.Int4Config(num_sms=num_sms))
  if is_fp8(w_gate):
    if h % 128 or inter % 128:
      raise NotImplementedError(f"mosaic_gpu FP8 MoE needs hidden ({h}) and expert width "
                                f"({inter}) to be multiples of 128 (its K step)")
    return fp8_mlp_mgpu.moe_experts_fp8(x, weights, expert_ids, w_gate, w_up, w_down,
                                        expert_offset=expert_offset, layer=layer,
                                        cfg=dequant_mlp_mgpu.DequantConfig(num_sms=num_sms))
  if h % 64 or inter % 64:
    raise NotImplementedError(f"mosaic_gpu MoE needs hidden ({h}) and expert width ({inter}) "
                              "to be multiples of 64")
  if t <= DECODE_MAX_TOKENS:
    cfg = decode_mlp_mgpu.DecodeConfig(block_k=min(_block_k(h), _block_k(inter)),
                                       num_sms=num_sms)
    return decode_mlp_mgpu.moe_experts_decode(x, weights, expert_ids, w_gate, w_up, w_down,
                                              expert_offset=expert_offset, layer=layer, cfg=cfg)
  cfg = grouped_mlp_mgpu.GroupedConfig(
      block_n=128 if min(h, inter) % 128 == 0 else 64, num_sms=num_sms)
  return grouped_mlp_mgpu.moe_experts_grouped(x, weights, expert_ids, w_gate, w_up, w_down,
                                              expert_offset=expert_offset, layer=layer, cfg=cfg)
