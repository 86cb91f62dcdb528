"""W4A16 expert SwiGLU MLP on INT4 experts: Pallas Mosaic GPU (Hopper WGMMA), from packed weights.

The kernels read `Int4Weight` experts as stored (`pallas_kernels/quant.py`): packed uint8
[E, K/2, N] (byte j of column n = elements 2j (low nibble) and 2j + 1 (high), each q + 8) and
bf16 scales [E, K/group, N]. Each K step dequantizes its weight tile in registers and writes it
to SMEM as bf16 for the tensor cores; nothing else ever holds a float copy of a weight.

Layout (the matmul skeleton in `dequant_mlp_mgpu`; tokens on WGMMA's N axis, weights on M, as
`decode_mlp_mgpu`): every active local expert owns slots of `block_tokens` rows in the permuted
layout of `permute.py`; a work item is (slot, 64 output columns), unused slots are skipped
without reading their weights.

  gate_up:  hT[s, I, Nt] = silu(Wg[e]^T @ xs[s]^T) * (Wu[e]^T @ xs[s]^T)
  down:     yT[s, H, Nt] = Wd[e]^T @ h[s]^T

One K step of `block_k` (bk, a multiple of 128) inputs and 64 output columns:
  TMA     packed [bk/2, 64] uint8, scale [bk/group, 64] bf16, activations [Nt, bk] bf16 -> SMEM
  dequant for each 64-row chunk of packed bytes (4 scale groups of 16 byte rows at group 32),
          in the WGMMA register layout, all in 16-bit pairs: bytes widened to uint16, each
          nibble n OR 0x4300 is the bf16 128 + n (no int -> float conversion), minus 136 is
          q = n - 8 (exact), times the chunk's bf16 scales in bf16 (each group's 64-column
          scale row broadcast over its rows, selected by row // (group / 2)): bitwise the
          bf16 product compressed-tensors defines; stored to a bf16 SMEM tile [bk, 64] with
          all low nibbles first (rows 0..bk/2) and all high nibbles after
  WGMMA   acc[64, Nt] += tile^T @ act^T   (f32 accumulator; the tile is double-buffered so the
          next step's dequant overlaps this step's MMA)
The tile's rows are a fixed permutation of the step's K: row r < bk/2 is input 2r, row bk/2 + r
is input 2r + 1. The activations are permuted the same way outside the kernel (`permute_k`, an
XLA transpose of the [rows, K] activations), so the sum over K is unchanged. Every K step
starts on a group boundary (bk is a multiple of the group), so a step's scales are its own
bk/group scale rows and no scale straddles two steps.

Shapes: xs [S * Nt, K] (K-permuted), packed [E, K/2, N] uint8, scale [E, K/group, N],
slot_expert [S] int32, num_slots [1] int32 -> [S, N, Nt] (unused slots unwritten).

Limits: bf16 activations; group 32 (K2.5's, tested) or 64, 128 (same code, untested); K a
multiple of block_k; N a multiple of 64; block_tokens a multiple of 8, at most 128 (SMEM: the fused gate/up
pipeline at block_tokens 64, block_k 128, 4 stages takes 164 KiB of the 227; Mosaic refuses
at lowering a configuration that does not fit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.moe import dequant_mlp_mgpu as dequant_lib
from pallas_kernels.moe import permute as permute_lib
from pallas_kernels.quant import INT4_OFFSET, Int4Weight, dequantize, is_int4

_WEIGHT_TILE = dequant_lib.WEIGHT_TILE
_CHUNK = 64  # packed byte rows dequantized at once (one WGMMA-layout register tile)


# block_k: inputs per K step (a multiple of 128, hence of the group); max_concurrent_steps,
# num_sms as in `dequant_mlp_mgpu`.
Int4Config = dequant_lib.DequantConfig


def permute_k(x: jax.Array, block_k: int) -> jax.Array:
  """Columns of x [R, K] in the kernel's K order: within each block_k block, the even inputs
  first, then the odd ones (the dequantized tile's rows: low nibbles, then high)."""
  r, k = x.shape
  return x.reshape(r, k // block_k, block_k // 2, 2).swapaxes(-1, -2).reshape(r, k)


def _check(dtype, w: Int4Weight, nt: int, cfg: Int4Config) -> None:
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    raise NotImplementedError(f"Mosaic GPU W4A16 MLP takes bf16 activations, got {dtype}")
  _, k, n = w.shape
  bk, g = cfg.block_k, w.group
  if 128 % g or g % 2:
    raise NotImplementedError(f"INT4 group {g}: the kernel takes groups dividing 128")
  if bk % 128 or k % bk:
    raise ValueError(f"K={k} must be a multiple of block_k={bk}, itself a multiple of 128")
  if n % _WEIGHT_TILE:
    raise ValueError(f"N={n} must be a multiple of {_WEIGHT_TILE}")
  if nt % 8 or nt > 128:
    raise ValueError(f"block_tokens={nt} must be a multiple of 8, at most 128")


# bf16 with exponent field 2^7: bits 0x4300 | n (n < 128) are the value 128 + n exactly.
_BF16_128 = 0x4300


def _dequantize_tile(p_smem, s_smem, dst, group: int, bk: int) -> None:
  """bf16 tile [bk, 64] in `dst` (rows: low nibbles, then high) of the packed [bk/2, 64] bytes
  and [bk/group, 64] scales in SMEM."""
  rows_per_group = group // 2  # packed byte rows per scale row
  groups_per_chunk = _CHUNK // rows_per_group
  row_group = jax.lax.broadcasted_iota(jnp.int32, (_CHUNK, _WEIGHT_TILE), 0) // rows_per_group
  for c in range(bk // 2 // _CHUNK):
    # Mosaic GPU does only bitwise ops on 8-bit values: widen to 16 bits, then each nibble n
    # becomes the bf16 128 + n by its bit pattern (no int -> float conversion), minus 136
    # (exact) is q = n - 8; q times the bf16 scale in bf16 is compressed-tensors' product.
    b = p_smem[pl.ds(c * _CHUNK, _CHUNK), :].astype(jnp.uint16)  # [64, 64]
    lo = jax.lax.bitcast_convert_type((b & 0xF) | _BF16_128, jnp.bfloat16)
    hi = jax.lax.bitcast_convert_type((b >> 4) | _BF16_128, jnp.bfloat16)
    offset = jnp.asarray(128 + INT4_OFFSET, jnp.bfloat16)
    scale = None
    for g in range(groups_per_chunk):
      row = s_smem[c * groups_per_chunk + g, :]
      s_g = jax.lax.broadcast_in_dim(row, (_CHUNK, _WEIGHT_TILE), (1,))
      scale = s_g if scale is None else jnp.where(row_group == g, s_g, scale)
    dst[pl.ds(c * _CHUNK, _CHUNK), :] = ((lo - offset) * scale).astype(dst.dtype)
    dst[pl.ds(bk // 2 + c * _CHUNK, _CHUNK), :] = ((hi - offset) * scale).astype(dst.dtype)


def _int4_tiles(w: Int4Weight, bk: int) -> dequant_lib.WeightTiles:
  group = w.group

  def deq(kk, ni, expert, tiles, side, dst, fetched):
    del kk, ni, expert, side, fetched
    _dequantize_tile(tiles[0], tiles[1], dst, group, bk)

  return dequant_lib.WeightTiles(tiled=(w.packed, w.scale), block_rows=(bk // 2, bk // group),
                                 side=(), dequantize=deq)


def _int4_swapped_matmul(act: jax.Array, weights: tuple[Int4Weight, ...], slot_expert: jax.Array,
                         num_slots: jax.Array, nt: int, cfg: Int4Config) -> jax.Array:
  """outT[s, N, nt] = W[e]^T @ act[s]^T (one weight) or the SwiGLU of two, per active slot;
  act [S * nt, K] already in `permute_k` order."""
  for w in weights:
    _check(act.dtype, w, nt, cfg)
  return dequant_lib.swapped_matmul(act, [_int4_tiles(w, cfg.block_k) for w in weights],
                                    weights[0].shape[2], slot_expert, num_slots, nt, cfg)


def int4_swiglu(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
                w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, block_tokens: int,
                cfg: Int4Config = Int4Config()) -> jax.Array:
  """ys [S * Nt, H] = down(silu(xs @ gate) * (xs @ up)) per slot's expert, the weights INT4;
  xs [S * Nt, H] in natural K order; rows of unused slots are zero."""
  nt, bk = block_tokens, cfg.block_k
  for w in (w_gate, w_up, w_down):  # before the K permutation, which needs whole K steps
    _check(xs.dtype, w, nt, cfg)
  mm = functools.partial(_int4_swapped_matmul, slot_expert=slot_expert, num_slots=num_slots,
                         nt=nt, cfg=cfg)
  return dequant_lib.swiglu_two_kernels(
      xs, num_slots, nt,
      gate_up=lambda a: mm(permute_k(a, bk), (w_gate, w_up)),  # [S, I, nt]
      down=lambda h: mm(permute_k(h, bk), (w_down,)))  # [S, H, nt]


def int4_swiglu_reference(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
                          w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight,
                          block_tokens: int, cfg: Int4Config = Int4Config()) -> jax.Array:
  """Plain JAX of `int4_swiglu`: the weights dequantized (bf16 product, as compressed-tensors),
  then the tiled SwiGLU reference of the bf16 kernels."""
  del cfg
  w = [dequantize(v, xs.dtype) for v in (w_gate, w_up, w_down)]
  return permute_lib.tiled_swiglu_reference(xs, slot_expert, num_slots, *w, block_tokens)


def moe_experts_int4(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                     w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, *,
                     expert_offset: int = 0,
                     layer: jax.Array | int | None = None,
                     cfg: Int4Config = Int4Config()) -> jax.Array:
  """`reference.moe_experts` contract through the W4A16 kernels, any token count (slots:
  `dequant_mlp_mgpu.block_tokens`); with `layer`, the weights are stacks and the kernels read
  layer `layer`'s experts in place."""
  if not all(is_int4(w) for w in (w_gate, w_up, w_down)):
    raise TypeError("moe_experts_int4 takes Int4Weight experts")
  (w_gate, w_up, w_down), e_local, base = permute_lib.expert_pool((w_gate, w_up, w_down), layer)
  return dequant_lib.moe_experts_slots(
      x, weights, expert_ids, e_local, expert_offset,
      lambda xs, se, ns, nt: int4_swiglu(xs, se, ns, w_gate, w_up, w_down, nt, cfg), base)
