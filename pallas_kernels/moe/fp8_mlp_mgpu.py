"""W8A16 expert SwiGLU MLP on FP8 experts: Pallas Mosaic GPU (Hopper WGMMA), from e4m3 weights.

The kernels read `Fp8Weight` experts as stored (`pallas_kernels/quant.py`, DeepSeek-V3 /
Kimi-K2-Instruct): float8_e4m3fn [E, K, N] and a float32 scale_inv per 128 x 128 block
[E, K/128, ceil(N/128)]. Matmul skeleton, slots and work items: `dequant_mlp_mgpu` (tokens on
WGMMA's N axis, 64 weight columns per work item, unused slots skipped unread).

  gate_up:  hT[s, I, Nt] = silu(Wg[e]^T @ xs[s]^T) * (Wu[e]^T @ xs[s]^T)
  down:     yT[s, H, Nt] = Wd[e]^T @ h[s]^T

One K step of block_k (bk, a multiple of 128) inputs and 64 output columns:
  TMA     w [bk, 64] e4m3 (64-byte rows), activations [Nt, bk] bf16 -> SMEM
  dequant each 64-row chunk to f32 times its block's scale (one scalar per 128 x 128 block,
          read from GMEM one K step ahead and carried through the pipeline: block row
          kk * bk / 128 + chunk // 2, block column = tile // 2),
          rounded to bf16 (= `dequantize`'s float32 product, then bf16), into the bf16 SMEM tile
  WGMMA   acc[64, Nt] += tile^T @ act^T   (f32)
K order is natural (no packing), so the activations go in as they are. A 64-column tile lies
inside one 128-column scale block and a 64-row chunk inside one 128-row block, so each chunk
has one scale.

Shapes: xs [S * Nt, K], w [E, K, N] float8_e4m3fn, scale_inv [E, K/128, ceil(N/128)] f32,
slot_expert [S] int32, num_slots [1] int32.

Limits: bf16 activations; 128 x 128 blocks (the expert axis leading, one input and one output
axis); K a multiple of block_k, N of 64; block_tokens a multiple of 8, at most 128 (SMEM: the
fused gate/up pipeline at block_tokens 64, block_k 128, 4 stages takes 164 KiB of the 227).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.moe import dequant_mlp_mgpu as dequant_lib
from pallas_kernels.moe import permute as permute_lib
from pallas_kernels.quant import Fp8Weight, dequantize, is_fp8

_WEIGHT_TILE = dequant_lib.WEIGHT_TILE
_BLOCK = 128  # the FP8 scale block, both axes
_CHUNK = 64  # weight rows dequantized at once

Fp8Config = dequant_lib.DequantConfig


def _check(dtype, w: Fp8Weight, nt: int, cfg: Fp8Config) -> None:
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    raise NotImplementedError(f"Mosaic GPU W8A16 MLP takes bf16 activations, got {dtype}")
  if tuple(w.block) != (_BLOCK, _BLOCK) or w.lead != 1 or w.n_in != 1 or w.ndim != 3:
    raise NotImplementedError(f"Mosaic GPU W8A16 MLP takes [E, K, N] experts in 128 x 128 "
                              f"blocks, got shape {w.shape}, block {w.block}")
  _, k, n = w.shape
  bk = cfg.block_k
  if bk % _BLOCK or k % bk:
    raise ValueError(f"K={k} must be a multiple of block_k={bk}, itself a multiple of 128")
  if n % _WEIGHT_TILE:
    raise ValueError(f"N={n} must be a multiple of {_WEIGHT_TILE}")
  if nt % 8 or nt > 128:
    raise ValueError(f"block_tokens={nt} must be a multiple of 8, at most 128")


def _fp8_tiles(w: Fp8Weight, bk: int) -> dequant_lib.WeightTiles:
  rows = bk // _BLOCK  # scale block rows per K step

  def prefetch(kk, ni, expert, side):
    (scale_gmem,) = side
    block_col = ni * _WEIGHT_TILE // _BLOCK
    return tuple(scale_gmem[expert, kk * rows + r, block_col] for r in range(rows))

  def deq(kk, ni, expert, tiles, side, dst, scales):
    del kk, ni, expert, side
    for c in range(bk // _CHUNK):
      v = tiles[0][pl.ds(c * _CHUNK, _CHUNK), :].astype(jnp.float32) * scales[
          c * _CHUNK // _BLOCK]
      dst[pl.ds(c * _CHUNK, _CHUNK), :] = v.astype(dst.dtype)

  return dequant_lib.WeightTiles(tiled=(w.w,), block_rows=(bk,), side=(w.scale_inv,),
                                 dequantize=deq, prefetch=prefetch)


def _fp8_swapped_matmul(act: jax.Array, weights: tuple[Fp8Weight, ...], slot_expert: jax.Array,
                        num_slots: jax.Array, nt: int, cfg: Fp8Config) -> jax.Array:
  """outT[s, N, nt] = W[e]^T @ act[s]^T (one weight) or the SwiGLU of two, per active slot."""
  for w in weights:
    _check(act.dtype, w, nt, cfg)
  return dequant_lib.swapped_matmul(act, [_fp8_tiles(w, cfg.block_k) for w in weights],
                                    weights[0].shape[2], slot_expert, num_slots, nt, cfg)


def fp8_swiglu(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
               w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight, block_tokens: int,
               cfg: Fp8Config = Fp8Config()) -> jax.Array:
  """ys [S * Nt, H] = down(silu(xs @ gate) * (xs @ up)) per slot's expert, the weights FP8;
  rows of unused slots are zero."""
  mm = functools.partial(_fp8_swapped_matmul, slot_expert=slot_expert, num_slots=num_slots,
                         nt=block_tokens, cfg=cfg)
  return dequant_lib.swiglu_two_kernels(xs, num_slots, block_tokens,
                                        gate_up=lambda a: mm(a, (w_gate, w_up)),
                                        down=lambda h: mm(h, (w_down,)))


def fp8_swiglu_reference(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
                         w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight,
                         block_tokens: int, cfg: Fp8Config = Fp8Config()) -> jax.Array:
  """Plain JAX of `fp8_swiglu`: the weights dequantized (float32 product, then bf16), then the
  tiled SwiGLU reference of the bf16 kernels."""
  del cfg
  w = [dequantize(v, xs.dtype) for v in (w_gate, w_up, w_down)]
  return permute_lib.tiled_swiglu_reference(xs, slot_expert, num_slots, *w, block_tokens)


def moe_experts_fp8(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                    w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight, *,
                    expert_offset: int = 0,
                    layer: jax.Array | int | None = None,
                    cfg: Fp8Config = Fp8Config()) -> jax.Array:
  """`reference.moe_experts` contract through the W8A16 kernels, any token count (slots:
  `dequant_mlp_mgpu.block_tokens`); with `layer`, the weights are stacks and the kernels read
  layer `layer`'s experts in place."""
  if not all(is_fp8(w) for w in (w_gate, w_up, w_down)):
    raise TypeError("moe_experts_fp8 takes Fp8Weight experts")
  (w_gate, w_up, w_down), e_local, base = permute_lib.expert_pool((w_gate, w_up, w_down), layer)
  return permute_lib.moe_experts_slots(
      x, weights, expert_ids,
      lambda xs, se, ns, nt: fp8_swiglu(xs, se, ns, w_gate, w_up, w_down, nt, cfg),
      num_local_experts=e_local, expert_offset=expert_offset,
      block_rows=dequant_lib.block_tokens(expert_ids.shape[0]), base=base)
