"""Where each INT4 weight goes in the W4A16 kernel (`w4a16_mgpu`): from a thread's SMEM load to
WGMMA's register operand, and the K order of the activations that follows.

The packed weights stay in compressed-tensors' byte order (`quant.Int4Weight`: rows of K/2
bytes, element 2j in the low nibble of byte j). A consumer warpgroup loads its 64 weight rows of
one K step ([64, bk/2] bytes of the swizzled SMEM tile) in `BYTE_LAYOUT`: thread (warp, lane)
holds rows 16 warp + 8 rh + lane // 4 (rh = 0, 1) and, per 64-input chunk c, the 8 bytes
32 c + 8 (lane % 4) .. + 7 of each: one 64-bit shared load, two 32-bit words of 8 nibbles.

WGMMA's register A operand (`WGMMA_LAYOUT`, 16-bit) wants from the same thread, per 8-column
block cb of the [64, 64] chunk, the pair of columns 8 cb + 2 (lane % 4) + {0, 1} of those two
rows: one bf16x2 register. The rows already match. Instead of moving nibbles between threads
(Mosaic's UPCAST_4X -> WGMMA relayout: two shuffles and two byte permutes per 8 weights), each
word is converted where it lies and its pairs are *declared* to be the columns WGMMA reads:

  word w of the load, nibble i' (bits 4 i' .. 4 i' + 3) = stored input p = 16 j + 8 w + i'
                                                          (j = lane % 4, chunk-relative)
  pair i = 0..3 of word w = nibbles (i, i + 4) -> register column block cb = 4 w + i, so
  stored input p = 16 j + 8 w + 4 e + i      is multiplied at K column  32 w + 8 i + 2 j + e

(the pair (i, i + 4) is what `(word >> 4 i) & 0x000F000F` leaves in the two bf16 halves). The
sum over K is the same if the activations are put in that order too: `permute_k`, an XLA
transpose of the [rows, K] activations (cheap: activations, not weights), applied to the
kernel's inputs. So the weights need no repack beyond the loader's byte view.

Per word (8 weights): 3 shifts, 4 `lop3` ((x & 0x000F000F) | 0x4300_4300: the bf16 pair
128 + n), 4 `sub.bf16x2` (- 136: q = n - 8, exact), 4 `mul.bf16x2` by the group's scale
(bitwise compressed-tensors' bf16 product q * s): 15 instructions, plus per thread, chunk and
row one 64-bit load of the bytes and one 16-bit load of the scale: 2.0 per weight (SASS of the
same sequence compiled by nvcc 13.0 for sm_90a, `_CONVERT_PAIR`).

`thread_coords` evaluates a Mosaic `TiledLayout` for one thread in plain Python (as
`TiledLayout.thread_idxs` does in IR), so the tests check this plan against Mosaic's own layout
definitions; `dequantize_step` is the same math on whole arrays, in the kernel's K order (the
interpret-mode path).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quant import INT4_OFFSET

CHUNK = 64  # K inputs per WGMMA call (4 x k16) and per block of the K permutation
ROWS = 64  # weight rows per consumer warpgroup (WGMMA's M)

# uint8 [64, 32 c] in 8-byte vectors: warp -> 16-row block, lane -> (row, 8-byte group).
BYTE_MGPU_LAYOUT = fa.TiledLayout(fa.Tiling(((64, 32), (16, 32), (8, 32), (8,))),
                                  warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1)
BYTE_LAYOUT = plgpu.Layout.TILED(BYTE_MGPU_LAYOUT.tiling, warp_dims=(-7,), lane_dims=(-3, -2),
                                 vector_dim=-1)


def k_column(p: int) -> int:
  """The WGMMA K column (within a 64-input chunk) that stored input p is multiplied at."""
  j, rest = divmod(p, 16)
  w, rest = divmod(rest, 8)
  e, i = divmod(rest, 4)
  return 32 * w + 8 * i + 2 * j + e


# K_ORDER[col] = the stored input at WGMMA K column col (chunk-relative).
K_ORDER = np.argsort([k_column(p) for p in range(CHUNK)])


def permute_k(x: jax.Array) -> jax.Array:
  """[..., K] -> the kernel's K order: out[..., 64 c + col] = x[..., 64 c + K_ORDER[col]]
  (stored p = 16 j + 8 w + 4 e + i goes to col = 32 w + 8 i + 2 j + e: a transpose)."""
  *lead, k = x.shape
  y = x.reshape(*lead, k // CHUNK, 4, 2, 2, 4)  # (j, w, e, i)
  n = y.ndim
  y = jnp.transpose(y, (*range(n - 4), n - 3, n - 1, n - 4, n - 2))  # (w, i, j, e)
  return y.reshape(*lead, k)


def unpermute_k(x: jax.Array) -> jax.Array:
  """The inverse of `permute_k`."""
  *lead, k = x.shape
  y = x.reshape(*lead, k // CHUNK, 2, 4, 4, 2)  # (w, i, j, e)
  n = y.ndim
  y = jnp.transpose(y, (*range(n - 4), n - 2, n - 4, n - 1, n - 3))  # (j, w, e, i)
  return y.reshape(*lead, k)


def dequantize_step(packed: jax.Array, scale: jax.Array, group: int) -> jax.Array:
  """bf16 [R, bk] weight rows in the kernel's K order from one K step's packed bytes
  [R, bk/2] (compressed-tensors order) and scales [bk/group, R]: what the register path puts
  in WGMMA's A operand, on whole arrays (`dequantize`'s bf16 product)."""
  r, half = packed.shape
  p = packed.astype(jnp.int32)
  nib = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(r, 2 * half)  # stored order
  q = (nib - INT4_OFFSET).astype(scale.dtype)
  s = jnp.repeat(scale.T, group, axis=1)  # [R, bk]
  return permute_k((q * s).astype(jnp.bfloat16))


# ---- the per-thread plan ----------------------------------------------------------------------

def thread_coords(layout: fa.TiledLayout, shape: tuple[int, ...], thread: int,
                  reg_idx: tuple[int, ...], elem: int) -> tuple[int, ...]:
  """Logical index of element `elem` of register `reg_idx` of thread `thread` (0..127) for an
  array of `shape` in `layout` (pure Python; `TiledLayout.thread_idxs` in IR)."""
  contig = [math.prod(shape[i + 1:]) for i in range(len(shape))]
  tile_strides = layout.tiling.tile_strides(tuple(contig))
  rank = layout.tiled_tiling_rank
  tiled = layout.tiled_tiling_shape
  tail = tile_strides[-rank:]

  def offset(index: int, dims) -> int:
    sizes = [d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims]
    out = 0
    for d, size, stride in zip(dims, sizes, [math.prod(sizes[k + 1:]) for k in range(len(sizes))]):
      i = (index // stride) % size
      if not isinstance(d, fa.Replicated):
        out += i * tail[d]
    return out

  lin = offset((thread // 32) % 4, layout.warp_dims) + offset(thread % 32, layout.lane_dims)
  lin += sum(i * s for i, s in zip(reg_idx, tile_strides))
  lin += elem * tile_strides[layout.vector_dim]
  return tuple(int(v) for v in np.unravel_index(lin, shape))


def byte_register(chunk: int, rh: int) -> tuple[int, ...]:
  """`BYTE_LAYOUT` register (vector<8 x u8>) of a thread's row half rh, 64-input chunk."""
  return (0, chunk, 0, 0, rh, 0, 0, 0, 0)


def wgmma_register(cb: int, rh: int) -> tuple[int, ...]:
  """`WGMMA_LAYOUT` register (bf16 pair) of a [64, 64] chunk: 8-column block cb, row half rh."""
  return (0, cb, 0, 0, rh, 0, 0, 0, 0)


def scale_group(chunk: int, lane_col: int, group: int) -> int:
  """Index (within a K step) of the scale group of the 16 inputs a thread converts per row of
  `chunk`: stored inputs 64 chunk + 16 lane_col .. + 15 (a group is at least 16 inputs)."""
  return (CHUNK * chunk + 16 * lane_col) // group


# ---- the plan in Mosaic GPU (register path; GPU only: interpret mode cannot run inline code) ---

# bf16 with exponent field 2^7: bits 0x4300 | n (n < 128) are exactly the value 128 + n.
_BF16_128_PAIR = 0x43004300
_BF16_136_PAIR = 0x43084308  # 128 + 8: (128 + n) - 136 = n - 8 = q, exact
# $1: a word shifted so the pair's nibbles are bits 0-3 and 16-19; $2: the scale in both halves.
# One LOP3 ((x & 0x000F000F) | 0x43004300: the magic in a register, as LOP3 takes one
# immediate; written in LLVM, and + or became two), HADD2.BF16 -136 (the constant folded),
# HMUL2.BF16 by the scale: bitwise compressed-tensors' bf16 product q * s. (nvcc + ptxas 13.0,
# sm_90a: 3 SHF + 4 LOP3 + 4 HADD2 + 4 HMUL2 per word; the scale's broadcast is an .H0_H0
# operand.)
_CONVERT_PAIR = (
    "{ .reg .b32 q, k; "
    f"mov.b32 k, {_BF16_128_PAIR:#x}; lop3.b32 q, $1, 0x000F000F, k, 0xEA; "
    f"mov.b32 k, {_BF16_136_PAIR:#x}; sub.bf16x2 q, q, k; mul.rn.bf16x2 $0, q, $2; }}")


def convert_chunk(chunk: int, group: int):
  """An `inline_mgpu` function (bytes, scale_ref) -> bf16 [64, 64] in `WGMMA_LAYOUT`: chunk
  `chunk` of a consumer warpgroup's K step. bytes: its [64, bk/2] uint8 rows in `BYTE_LAYOUT`;
  scale_ref: the step's scales [bk/group, 64] (SMEM). Register (cb = 4 w + i, rh) of the result
  is pair i of word w of the thread's row-half rh bytes, times its scale (see module doc)."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.extend.mlir import ir
  from jax.extend.mlir.dialects import arith, memref, vector
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu(
      arg_types=(BYTE_LAYOUT, plgpu.RefType()),
      return_type=plgpu.ShapeDtypeStruct((ROWS, CHUNK), jnp.bfloat16, plgpu.Layout.WGMMA))
  def convert(ctx, packed, scale_ref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    c = lambda v: mgpu_utils.c(v, i32)
    tid = mgpu_utils.thread_idx()  # within the warpgroup's 128 threads (lane semantics)
    lane = arith.remui(tid, c(32))
    lane_col = arith.remui(lane, c(4))
    row0 = arith.addi(arith.muli(arith.remui(arith.divui(tid, c(32)), c(4)), c(16)),
                      arith.divui(lane, c(4)))
    # The thread's 16 stored inputs per row share one scale group (16 | group).
    grp = arith.divui(arith.addi(arith.muli(lane_col, c(16)), c(CHUNK * chunk)), c(group))
    grp = arith.index_cast(index, grp)
    out = np.empty(fa.WGMMA_LAYOUT.registers_shape((ROWS, CHUNK)), dtype=object)
    for rh in range(2):
      row = arith.index_cast(index, arith.addi(row0, c(8 * rh)))
      scale = mgpu_utils.bitcast(vector.broadcast(pair, memref.load(scale_ref, [grp, row])), i32)
      words = mgpu_utils.bitcast(packed.registers[byte_register(chunk, rh)],
                                 ir.VectorType.get((2,), i32))
      for w in range(2):
        word = vector.extract(words, dynamic_position=[],
                              static_position=ir.DenseI64ArrayAttr.get([w]))
        for i in range(4):
          nibbles = word if i == 0 else arith.shrui(word, c(4 * i))
          w_pair = mgpu_utils.inline_ptx(_CONVERT_PAIR, nibbles, scale, result_types=i32)
          out[wgmma_register(4 * w + i, rh)] = mgpu_utils.bitcast(w_pair, pair)
    return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return convert
