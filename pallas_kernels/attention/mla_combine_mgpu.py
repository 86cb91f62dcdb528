"""Merges the MLA decode kernel's per-segment partials into each sequence's output (Mosaic GPU).

Shapes (S slots, R = `partial_rows(T x nH)` rows per slot, B sequences):
  partial:    [S, R, Dv] float32 or bf16  per slot a softmax-normalised partial context
  lse:        [S, R] float32              its log-sum-exp (-inf: the row saw nothing)
  first_slot: [B] int32, count: [B] int32  sequence b owns slots first .. first + count - 1
Returns:
  [B, R, Dv] in `out_dtype`: sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M) per row (M the
  row's largest lse); rows no slot saw, and sequences with no slot, are 0.

One CUDA block per (column chunk, group of rho rows, sequence) merges rows [r0, r0 + rho) of
its sequence's slots, reading 64-row tiles that hold G = 64 / rho consecutive slots' rows (one
TMA copy when those rows are contiguous in memory, rho = R or 64, else one per slot); rho comes
from the shape (`lane_rows`): 8 rows when few sequences are split many ways (batch 1 over 132
parts: 8 slots per tile and 64 blocks at 64 heads instead of 8 blocks of 132 tiles each), whole
64-row tiles for large batches. The tiles stream through a TMA ring (4 or 8 tiles in flight,
`auto_config`); an online softmax runs per tile row ("lane"), every update elementwise in the
WGMMA layout; at the end the G lanes of each output row are folded together through SMEM (row
windows shifted by multiples of rho, whose row r < rho gathers the lanes r, r + rho, ...).

Constraints: R in {8, 16, 32} or a multiple of 64; Dv a multiple of `chunk` (32, 64 or 128).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.mla_decode_schedule import BLOCK_Q

CHUNK = 64  # output columns per CUDA block
TARGET_BLOCKS = 132  # one per SM


def _transforms(dtype, cols: int) -> tuple:
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def lane_rows(batch: int, rows: int, col_blocks: int, target: int = TARGET_BLOCKS) -> int:
  """Rows of each slot a CUDA block merges (rho): the largest of 64, 32, 16, 8 (at most R)
  that still gives `target` CUDA blocks, else 8. Few sequences split many ways (batch 1 over
  132 parts) then get 8-row groups, 8 slots per tile and 8-64x more blocks; a large batch
  keeps whole 64-row tiles per slot."""
  for rho in (64, 32, 16, 8):
    if rho <= rows and batch * (rows // rho) * col_blocks >= target:
      return rho
  return min(rows, 8)


def auto_config(batch: int, rows: int, dv: int) -> tuple[int, int, int]:
  """(chunk, rho, stages). Batch 1 split over 64-132 parts gives a block 8-17 tiles in a row,
  each an L2 round trip (~0.7 us) against ~0.1 us of arithmetic: with fewer blocks than SMs,
  32-column chunks (twice the blocks, half the arithmetic per tile) and 8 tiles in flight;
  else 64 columns and 4 in flight (3 blocks per SM)."""
  rho = lane_rows(batch, rows, dv // CHUNK)
  if batch * (rows // rho) * (dv // CHUNK) < TARGET_BLOCKS and dv % 32 == 0:
    return 32, lane_rows(batch, rows, dv // 32), 8
  return CHUNK, rho, 4


def combine_partials(partial: jax.Array, lse: jax.Array, first_slot: jax.Array,
                     count: jax.Array, *, out_dtype, chunk: int | None = None,
                     group_rows: int | None = None) -> jax.Array:
  """See the module docstring; `chunk` (value columns per CUDA block) and `group_rows` (rho)
  default to `auto_config`'s."""
  slots, rows, dv = partial.shape
  batch = first_slot.shape[0]
  auto_chunk, auto_rho, num_stages = auto_config(batch, rows, dv)
  if chunk is None:
    chunk = auto_chunk
  else:
    num_stages = 8 if chunk <= 32 else 4
  if group_rows is None and chunk == auto_chunk:
    group_rows = auto_rho
  if rows not in (8, 16, 32) and rows % BLOCK_Q:
    raise ValueError(f"rows={rows} must be 8, 16, 32 or a multiple of {BLOCK_Q}")
  if dv % chunk or chunk % 32:
    raise ValueError(f"Dv={dv} must be a multiple of chunk={chunk} (a multiple of 32)")
  rho = group_rows or lane_rows(batch, rows, dv // chunk)
  if rho not in (8, 16, 32, 64) or rows % rho:
    raise ValueError(f"group_rows={rho} must be 8, 16, 32 or 64 and divide rows={rows}")
  lanes_per_row = BLOCK_Q // rho  # G: slots per 64-row tile
  # One TMA copy per tile when a tile's 64 rows are contiguous in the flattened partials
  # (whole slots, or 64 rows of one), else one per slot.
  copies = 1 if rho in (rows, BLOCK_Q) else lanes_per_row
  num_stages = min(num_stages, 32 // copies)  # (Mosaic: at most 32 barriers per group)
  pdtype = partial.dtype
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  tile = (BLOCK_Q, chunk)

  def kernel(x_ref, l_ref, first_ref, count_ref, out_ref,
             x_smem, fold_smem, out_smem, vec_smem, x_bars, l_bars):
    col = lax.axis_index("chunk")
    group = lax.axis_index("rows")
    b = lax.axis_index("seq")
    n = count_ref[b]
    s0 = first_ref[b]
    r0 = group * rho
    tiles = lax.div(n + (lanes_per_row - 1), jnp.int32(lanes_per_row))
    cols = pl.ds(col * chunk, chunk)
    # Rows 0..num_stages-1: lse windows in flight; then the fold's shifted windows over
    # (m, M, z), each stored in the first half of a 128-entry row.
    l_smem = vec_smem.at[pl.ds(0, num_stages)]
    fold_vecs = vec_smem.at[pl.ds(num_stages, 3)]

    def issue(t, slot):
      first = s0 + t * lanes_per_row
      if copies == 1:
        row0 = first * rows + r0
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row0, BLOCK_Q), cols], x_smem.at[slot],
                                x_bars.at[slot])
        plgpu.copy_gmem_to_smem(l_ref.at[pl.ds(row0, BLOCK_Q)],
                                l_smem.at[slot, pl.ds(0, BLOCK_Q)], l_bars.at[slot])
        return
      for j in range(copies):  # (slots past the sequence's: read, then selected away)
        plgpu.copy_gmem_to_smem(x_ref.at[first + j, pl.ds(r0, rho), cols],
                                x_smem.at[slot, pl.ds(j * rho, rho)],
                                x_bars.at[slot * copies + j])
        plgpu.copy_gmem_to_smem(l_ref.at[first + j, pl.ds(r0, rho)],
                                l_smem.at[slot, pl.ds(j * rho, rho)],
                                l_bars.at[slot * copies + j])

    @pl.loop(0, jnp.minimum(tiles, num_stages))
    def _(t):
      issue(t, t)

    lane = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0, layout=row_layout)
    bcast = lambda v: lax.broadcast_in_dim(v, tile, [0])

    def step(t, carry):
      m, l, acc = carry
      slot = lax.rem(t, jnp.int32(num_stages))
      for j in range(copies):
        plgpu.barrier_wait(x_bars.at[slot * copies + j])
        plgpu.barrier_wait(l_bars.at[slot * copies + j])
      valid = t * lanes_per_row + lane // rho < n
      lse_t = jnp.where(valid, plgpu.load(l_smem.at[slot, pl.ds(0, BLOCK_Q)], layout=row_layout),
                        -jnp.inf)
      # (lanes past the sequence's slots hold other sequences' or unwritten memory: selected
      # away, never multiplied by 0)
      x = jnp.where(bcast(valid),
                    plgpu.load(x_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32),
                    0.0)

      @pl.when(t + num_stages < tiles)
      def _():
        issue(t + num_stages, slot)
      m_new = jnp.maximum(m, lse_t)
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      a = jnp.exp(m - m_safe)
      e = jnp.exp(lse_t - m_safe)
      return m_new, l * a + e, acc * bcast(a) + x * bcast(e)

    init = (plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros(tile, jnp.float32), plgpu.Layout.WGMMA))
    m, l, acc = lax.fori_loop(0, tiles, step, init)

    if lanes_per_row == 1:
      out = acc * bcast(jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0))
    else:
      out = _fold(m, l, acc, lane, fold_vecs, fold_smem, rho, lanes_per_row, bcast)
    out_smem[...] = out.astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rho)], out_ref.at[b, pl.ds(r0, rho), cols])
    plgpu.wait_smem_to_gmem(0)

  def entry(*refs):
    scratch = (
        plgpu.SMEM((num_stages,) + tile, pdtype, transforms=_transforms(pdtype, chunk)),
        # The fold's row windows: the scaled lanes, then 64 rows of zeros.
        plgpu.SMEM((2 * BLOCK_Q, chunk), jnp.float32, transforms=_transforms(jnp.float32, chunk))
        if lanes_per_row > 1 else None,
        plgpu.SMEM(tile, out_dtype, transforms=_transforms(out_dtype, chunk)),
        plgpu.SMEM((num_stages + 3, 2 * BLOCK_Q), jnp.float32),
        plgpu.Barrier(num_barriers=num_stages * copies),
        plgpu.Barrier(num_barriers=num_stages * copies),
    )
    pl.run_scoped(lambda *s: kernel(*refs, *s), *scratch)

  call = plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((batch, rows, dv), out_dtype),
      grid=(dv // chunk, rows // rho, batch), grid_names=("chunk", "rows", "seq"),
      compiler_params=plgpu.CompilerParams(approx_math=True))
  if copies == 1:
    x, l = partial.reshape(slots * rows, dv), lse.reshape(slots * rows)
  else:
    x, l = partial, lse
  return call(x, l, first_slot.astype(jnp.int32), count.astype(jnp.int32))


def _fold(m, l, acc, lane, fold_vecs, fold_smem, rows_t, lanes_per_row, bcast):
  """Merges the G = lanes_per_row lanes of each output row r (tile rows r, r + R, ...): returns
  [64, chunk] whose rows r < R are the normalised outputs (later rows are scratch)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  m_buf, max_buf, z_buf = (fold_vecs.at[i] for i in range(3))
  window = lambda buf, start: plgpu.load(buf.at[pl.ds(start, BLOCK_Q)], layout=row_layout)
  neg_inf = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
  zeros = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout)
  # M[r] = max over the lanes of row r (valid in rows r < R of the max over shifted windows).
  m_buf.at[pl.ds(0, BLOCK_Q)][...] = m
  m_buf.at[pl.ds(BLOCK_Q, BLOCK_Q)][...] = neg_inf
  plgpu.commit_smem()
  big = window(m_buf, 0)
  for k in range(1, lanes_per_row):
    big = jnp.maximum(big, window(m_buf, k * rows_t))
  # ... and spread back to every lane: lane i = k R + r reads M[r] at offset 64 - k R.
  max_buf.at[pl.ds(BLOCK_Q, BLOCK_Q)][...] = big
  plgpu.commit_smem()
  group = lane // rows_t
  big_rep = neg_inf
  for k in range(lanes_per_row):
    big_rep = jnp.where(group == k, window(max_buf, BLOCK_Q - k * rows_t), big_rep)
  seen = m != -jnp.inf
  c = jnp.where(seen, jnp.exp(m - jnp.where(seen, big_rep, 0.0)), 0.0)
  # L[r] = sum over row r's lanes of c l.
  z_buf.at[pl.ds(0, BLOCK_Q)][...] = c * l
  z_buf.at[pl.ds(BLOCK_Q, BLOCK_Q)][...] = zeros
  fold_smem.at[pl.ds(0, BLOCK_Q)][...] = acc * bcast(c)
  fold_smem.at[pl.ds(BLOCK_Q, BLOCK_Q)][...] = plgpu.layout_cast(jnp.zeros_like(acc),
                                                                   plgpu.Layout.WGMMA)
  plgpu.commit_smem()
  total = window(z_buf, 0)
  out = plgpu.load(fold_smem.at[pl.ds(0, BLOCK_Q)], layout=plgpu.Layout.WGMMA)
  for k in range(1, lanes_per_row):
    total = total + window(z_buf, k * rows_t)
    out = out + plgpu.load(fold_smem.at[pl.ds(k * rows_t, BLOCK_Q)], layout=plgpu.Layout.WGMMA)
  return out * bcast(jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0))
