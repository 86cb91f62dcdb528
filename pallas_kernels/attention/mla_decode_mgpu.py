"""MLA decode on Mosaic GPU: a persistent split-KV kernel over a balanced schedule (FlashMLA's
design), writing per-segment partials that `mla_combine_mgpu` merges.

Shapes (B sequences, R = `partial_rows(T x nH)` query rows per sequence, row = t * nH + h;
N pages of P tokens; S = `num_slots(B, parts)`):
  q_latent:   [B, R, Dc]   queries already multiplied by W_UK (rows past T x nH are padding)
  q_rope:     [B, R, Dr]
  pages:      [N, P, Dc + Dr]  latent then rope key per token; the values are its first Dc
  page_table: [B, max_pages] int32
  row_limit:  [B, R] int32  row r sees key positions < row_limit[r] (< 2^24)
  schedule:   `mla_decode_schedule.decode_schedule(kv_lens, num_parts=...)`
Returns:
  partial: [S, R, Dc] (f32 or bf16) per slot the softmax-normalised context of one segment
  lse:     [S, R] float32  its log-sum-exp (-inf: the row saw nothing there)
Only the slots of non-empty segments are written; the rest is unwritten memory.

Grid (query block, part): the query block is the fastest axis, so a verify's query blocks
(64 heads x T = 4: four of them) run side by side over the same KV and share it in L2. Each CUDA
block runs its part's segments in order: for each, one query tile in SMEM, then the segment's
64-token KV blocks through a 2-stage TMA ring (one 64 x 576 tile = 72 KiB per stage: 64-token
blocks make QK^T an m64n64 WGMMA, which streams Q from SMEM once per 64 keys instead of twice),
the online softmax, and the partial written for the segment's real rows only.

Warpgroups: 0 computes the scores, the mask and the online softmax, hands P (bf16) and the
rescale factor to warpgroup 1 through SMEM (one buffer: its next QK^T hides 1's P @ V), and
accumulates P @ V for the first half of the value columns; 1 accumulates the second half (a
64 x 512 float32 accumulator does not fit one warpgroup); 2 only issues TMA copies and runs
ahead across segments (the next sequence's first blocks load during this one's epilogue).
The epilogue stages 128-column chunks through the query tile's SMEM (the next segment's query
load waits for both warpgroups' chunks to leave), so SMEM holds Q 72 + KV 144 + P 8 KiB.

Constraints: bf16/f16 pages and queries; Dc a multiple of 128 (two warpgroups of 64-column
tiles) and Dr a multiple of 64 (128-byte swizzle); page size a multiple of 64, or 8, 16 or 32
(a 64-token block is then gathered from 64 / P pages, one TMA copy each).

Interpret mode (`pallas_kernels.interpret`) implements neither `pl.run_state` nor stores to
WGMMA accumulators, so under it (only) P @ V goes to a fresh accumulator and is added in
registers (`wgmma_accumulate`); on the GPU it accumulates in place. Everything else is the same
code.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.mla_decode_schedule import (BLOCK_KV, BLOCK_Q, DecodeSchedule,
                                                          num_q_blocks, num_slots)
from pallas_kernels.interpret import wgmma_accumulate

NUM_STAGES = 2  # 2 x 72 KiB of KV next to the 72 KiB query tile: the SMEM (227 KiB) is full
_MEMORY_WG_REGISTERS = 40  # per thread; the memory warpgroup only issues TMA copies
_COMPUTE_WG_REGISTERS = 232  # (65536 - 128 * 40) / 256, rounded down to a multiple of 8
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_PARTIAL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_LN2 = math.log(2.0)


def check_shapes(dc: int, dr: int, page_size: int, dtype, partial_dtype=jnp.float32) -> None:
  """Raises ValueError / NotImplementedError for what this kernel cannot take."""
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the Mosaic GPU MLA decode kernel takes bf16/f16 caches, got {jnp.dtype(dtype)} "
        "(WGMMA would compute float32 in tf32); use the reference for float32")
  if jnp.dtype(partial_dtype) not in _PARTIAL_DTYPES:
    raise ValueError(f"partials are float32 or bfloat16, got {jnp.dtype(partial_dtype)}")
  if dc % 128 or dr % 64 or dr <= 0:
    raise ValueError(f"the MLA decode kernel needs Dc a multiple of 128 and Dr of 64 "
                     f"(64-column swizzle tiles, two value warpgroups), got Dc={dc} Dr={dr}")
  if not (page_size % BLOCK_KV == 0 or page_size in (8, 16, 32)):
    raise ValueError(f"the MLA decode kernel needs pages of 8, 16, 32 or a multiple of "
                     f"{BLOCK_KV} tokens, got {page_size}")


def _transforms(dtype, cols: int) -> tuple:
  """Tiling + swizzle for an SMEM operand whose rows are `cols` elements of `dtype`."""
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def decode_partials(q_latent: jax.Array, q_rope: jax.Array, pages: jax.Array,
                    page_table: jax.Array, row_limit: jax.Array, schedule: DecodeSchedule, *,
                    softmax_scale: float, partial_dtype=jnp.float32
                    ) -> tuple[jax.Array, jax.Array]:
  """Partial contexts and log-sum-exps per slot; see the module docstring."""
  batch, rows, dc = q_latent.shape
  dr = q_rope.shape[-1]
  dk = dc + dr
  dtype = pages.dtype
  page_size = pages.shape[1]
  check_shapes(dc, dr, page_size, dtype, partial_dtype)
  if q_latent.dtype != dtype or q_rope.dtype != dtype:
    raise ValueError(f"queries and pages must share a dtype, got {q_latent.dtype}, "
                     f"{q_rope.dtype}, {dtype}")
  if pages.shape[2] != dk or q_rope.shape[:2] != (batch, rows) or row_limit.shape != (batch, rows):
    raise ValueError(f"inconsistent shapes: q_latent {q_latent.shape}, q_rope {q_rope.shape}, "
                     f"pages {pages.shape}, row_limit {row_limit.shape}")
  partial_dtype = jnp.dtype(partial_dtype)
  q_blocks = num_q_blocks(rows)
  rows_q = min(rows, BLOCK_Q)  # real rows a CUDA block owns (R < 64: all of them)
  if rows % rows_q or rows_q % 8:
    raise ValueError(f"rows={rows} must be 8, 16, 32 or a multiple of 64 (`partial_rows`)")
  parts = schedule.part_meta.shape[0]
  slots = num_slots(batch, parts)
  dv_wg = dc // 2  # value columns per compute warpgroup
  chunk = 128 if dv_wg % 128 == 0 else 64  # epilogue columns staged at a time
  max_pages = page_table.shape[1]
  if page_size >= BLOCK_KV:
    copies, blocks_per_page = 1, page_size // BLOCK_KV
    kv_src = pages.reshape(pages.shape[0], blocks_per_page, BLOCK_KV, dk)
  else:
    copies, blocks_per_page = BLOCK_KV // page_size, 0
    kv_src = pages
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  # Scores in log2 units: exp2 is one ex2.approx (approx_math), and the scale folds log2(e).
  scale_log2 = softmax_scale * math.log2(math.e)

  def kernel(ql_ref, qr_ref, kv_ref, pt_ref, limit_ref, part_ref, seq_ref, out_ref, lse_ref,
             q_or_stage, k_smem, p_smem, vec_smem, q_bars, k_bars, k_free, p_ready, p_free, l_ready, stage_free):
    (ql_smem, qr_smem), stage = q_or_stage
    # Per-row vectors (SMEM is allocated in 1 KiB units: one buffer, not four).
    alpha_smem, inv_l_smem, lse_smem, limit_smem = (vec_smem.at[i] for i in range(4))
    q_block = lax.axis_index("q_block")
    part = lax.axis_index("part")
    wg = lax.axis_index("wg")
    b_first, b_last = part_ref[part, 0], part_ref[part, 1]
    line_lo, line_hi = part_ref[part, 2], part_ref[part, 3]
    q_rows = pl.ds(q_block * BLOCK_Q, rows_q)

    def segment(b):
      """(first KV block, number of blocks) of sequence b in this part."""
      start, n = seq_ref[b, 0], seq_ref[b, 1]
      first = jnp.maximum(start, line_lo) - start
      return first, jnp.maximum(jnp.minimum(start + n, line_hi) - start - first, 0)

    def over_segments(body):
      """Runs body(b, first, steps, g, k) for each non-empty segment, g the part's KV blocks
      before it and k the non-empty segments before it; returns the totals (g, k)."""
      def seg(b, carry):
        g, k = carry
        first, steps = segment(b)
        pl.when(steps > 0)(lambda: body(b, first, steps, g, k))
        return g + steps, k + (steps > 0).astype(jnp.int32)
      return lax.fori_loop(b_first, b_last + 1, seg, (jnp.int32(0), jnp.int32(0)))

    def wait_kv(slot):
      for j in range(copies):
        plgpu.barrier_wait(k_bars.at[slot * copies + j])

    @pl.when(wg == 2)
    def _memory_wg():
      plgpu.set_max_registers(_MEMORY_WG_REGISTERS, action="decrease")

      def body(b, first, steps, g0, _):
        @pl.loop(0, steps)
        def _(i):
          g = g0 + i
          slot = lax.rem(g, jnp.int32(NUM_STAGES))
          block = first + i
          # Page ids before the wait: their loads overlap it. Entries past the table (the
          # tail of a last block) read its last page: those positions are masked.
          if copies == 1:
            ids = [pt_ref[b, jnp.minimum(lax.div(block, jnp.int32(blocks_per_page)),
                                         max_pages - 1)]]
          else:
            ids = [pt_ref[b, jnp.minimum(block * copies + j, max_pages - 1)]
                   for j in range(copies)]

          @pl.when(g >= NUM_STAGES)
          def _():
            plgpu.barrier_wait(k_free.at[slot])
          for j, page in enumerate(ids):
            if copies == 1:
              src = kv_ref.at[page, lax.rem(block, jnp.int32(blocks_per_page))]
              dst = k_smem.at[slot]
            else:
              src, dst = kv_ref.at[page], k_smem.at[slot, pl.ds(j * page_size, page_size)]
            plgpu.copy_gmem_to_smem(src, dst, k_bars.at[slot * copies + j])

      total, _ = over_segments(body)

      # Observe the release of the last blocks (every barrier phase is waited for once).
      @pl.loop(jnp.maximum(total - NUM_STAGES, 0), total)
      def _(g):
        plgpu.barrier_wait(k_free.at[lax.rem(g, jnp.int32(NUM_STAGES))])

    def add_context(acc, slot, cols):
      """acc += P @ V[:, cols] for the KV block in `slot`, then releases the slot."""
      acc = wgmma_accumulate(acc, p_smem, k_smem.at[slot, :, cols])
      plgpu.barrier_arrive(k_free.at[slot])
      return acc

    def write_partial(acc, inv_l, slot):
      """The normalised context of warpgroup `wg`'s columns, real rows only, chunk by chunk
      through its half of the staging buffer (the query tile's SMEM)."""
      out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
      for c in range(dv_wg // chunk):
        if c:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        stage.at[wg][...] = out[:, c * chunk:(c + 1) * chunk].astype(partial_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            stage.at[wg, pl.ds(0, rows_q)],
            out_ref.at[slot, q_rows, pl.ds(wg * dv_wg + c * chunk, chunk)])

    def zeros_acc():
      return plgpu.layout_cast(jnp.zeros((BLOCK_Q, dv_wg), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _softmax_wg():
      """Scores, mask and online softmax for every column; P @ V for the first dv_wg."""
      plgpu.set_max_registers(_COMPUTE_WG_REGISTERS, action="increase")
      cols = pl.ds(0, dv_wg)

      def body(b, first, steps, g0, k):
        # The previous segment's staged chunks (in the query tile) have left SMEM.
        @pl.when(k > 0)
        def _():
          plgpu.barrier_wait(stage_free)
        plgpu.copy_gmem_to_smem(ql_ref.at[b, q_rows], ql_smem.at[pl.ds(0, rows_q)],
                                q_bars.at[0])
        plgpu.copy_gmem_to_smem(qr_ref.at[b, q_rows], qr_smem.at[pl.ds(0, rows_q)],
                                q_bars.at[1])
        plgpu.copy_gmem_to_smem(limit_ref.at[b, q_rows], limit_smem.at[pl.ds(0, rows_q)],
                                q_bars.at[2])
        for j in range(3):
          plgpu.barrier_wait(q_bars.at[j])
        limit = plgpu.load(limit_smem, layout=row_layout).astype(jnp.int32)
        col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_KV), 1,
                                     layout=plgpu.Layout.WGMMA)

        def step(i, carry):
          acc, m_i, l_i = carry
          g = g0 + i
          slot = lax.rem(g, jnp.int32(NUM_STAGES))
          wait_kv(slot)

          def scores(acc_ref):  # latent . q_latent + rope . q_rope
            kv = k_smem.at[slot]
            plgpu.wgmma(acc_ref, ql_smem, kv.at[:, pl.ds(0, dc)].transpose((1, 0)))
            plgpu.wgmma(acc_ref, qr_smem, kv.at[:, pl.ds(dc, dr)].transpose((1, 0)))
            return acc_ref[...]
          s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
          # Key positions (first + i) * 64 + col are visible below each row's limit.
          keys_left = limit - (first + i) * BLOCK_KV
          s = jnp.where(col < lax.broadcast_in_dim(keys_left, s.shape, [0]), s * scale_log2,
                        -jnp.inf)
          # m stays -inf while a row has seen no visible key; m_safe keeps exp(-inf - -inf)
          # from turning into NaN.
          m_new = jnp.maximum(m_i, s.max(axis=1))
          m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m_i - m_safe)
          p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
          l_i = l_i * alpha + p.sum(axis=1)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          # One P buffer: warpgroup 1 has finished the previous block's P @ V (it ran while
          # this block's QK^T did).
          @pl.when(g > 0)
          def _():
            plgpu.barrier_wait(p_free)
          alpha_smem[...] = alpha
          p_smem[...] = p.astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_arrive(p_ready)
          return add_context(acc, slot, cols), m_new, l_i

        init = (zeros_acc(), plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                                               row_layout),
                plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout))
        acc, m_i, l_i = lax.fori_loop(0, steps, step, init)
        seen = l_i > 0
        inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
        inv_l_smem[...] = inv_l
        plgpu.commit_smem()
        plgpu.barrier_arrive(l_ready)
        slot = b + part
        write_partial(acc, inv_l, slot)
        # (natural log-sum-exp of the unscaled scores: m is in log2 units)
        lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(jnp.where(seen, l_i, 1.0))) * _LN2,
                                  -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows_q)], lse_ref.at[slot, q_rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      total, segs = over_segments(body)

      # Observe the last releases (every barrier phase is waited for once).
      @pl.when(total > 0)
      def _():
        plgpu.barrier_wait(p_free)

      @pl.when(segs > 0)
      def _():
        plgpu.barrier_wait(stage_free)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _value_wg():
      """P @ V for the second dv_wg columns, with warpgroup 0's P and rescale factors."""
      plgpu.set_max_registers(_COMPUTE_WG_REGISTERS, action="increase")
      cols = pl.ds(dv_wg, dv_wg)

      def body(b, first, steps, g0, _):
        del first

        def step(i, acc):
          slot = lax.rem(g0 + i, jnp.int32(NUM_STAGES))
          wait_kv(slot)  # the TMA's writes, seen by this warpgroup too
          plgpu.barrier_wait(p_ready)
          alpha = plgpu.load(alpha_smem, layout=row_layout)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          acc = add_context(acc, slot, cols)
          plgpu.barrier_arrive(p_free)
          return acc

        acc = lax.fori_loop(0, steps, step, zeros_acc())
        plgpu.barrier_wait(l_ready)
        write_partial(acc, plgpu.load(inv_l_smem, layout=row_layout), b + part)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(stage_free)

      over_segments(body)
      plgpu.wait_smem_to_gmem(0)

  def entry(*refs):
    kv_t = _transforms(dtype, BLOCK_KV)  # 128 B rows of P bound every operand's swizzle
    # Positional, the 1 KiB-aligned swizzled tiles first: a dict's sorted keys interleaved
    # them with the small buffers, and the alignment padding overflowed the 227 KiB.
    scratch = (
        # The query tile while a segment runs, then both warpgroups' staged output chunks.
        plgpu.RefUnion(
            (plgpu.SMEM((BLOCK_Q, dc), dtype, transforms=kv_t),
             plgpu.SMEM((BLOCK_Q, dr), dtype, transforms=kv_t)),
            plgpu.SMEM((2, BLOCK_Q, chunk), partial_dtype,
                       transforms=_transforms(partial_dtype, chunk))),
        plgpu.SMEM((NUM_STAGES, BLOCK_KV, dk), dtype, transforms=kv_t),  # KV ring
        plgpu.SMEM((BLOCK_Q, BLOCK_KV), dtype, transforms=kv_t),  # P
        plgpu.SMEM((4, BLOCK_Q), jnp.float32),  # alpha, 1 / l, lse, row limits
        plgpu.Barrier(num_barriers=3),  # query latent, rope, limits
        plgpu.Barrier(num_barriers=NUM_STAGES * copies),  # KV block landed (per page copy)
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),  # KV slot free
        plgpu.Barrier(),  # P ready
        plgpu.Barrier(),  # P free
        plgpu.Barrier(),  # 1 / l ready
        plgpu.Barrier(),  # staged chunks gone
    )
    pl.run_scoped(lambda *s: kernel(*refs, *s), *scratch, collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((slots, rows, dc), partial_dtype),
              jax.ShapeDtypeStruct((slots, rows), jnp.float32))
  call = plgpu.kernel(
      entry, out_type=out_type, grid=(q_blocks, parts), grid_names=("q_block", "part"),
      num_threads=3, thread_name="wg",
      # (every reduction here is along a row, inside a warp: no cross-warp scratch needed,
      # and the SMEM is full; ex2.approx / rcp.approx / lg2.approx, as FlashAttention-3)
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0, approx_math=True))
  # (row limits as float32, exact below 2^24 positions, to share the row-vector buffer)
  return call(q_latent, q_rope, kv_src, page_table.astype(jnp.int32),
              row_limit.astype(jnp.float32), schedule.part_meta, schedule.seq_meta)
