"""Flash-decoding over a paged KV cache: the Mosaic GPU kernel behind the MLA and GQA wrappers.

Both attention forms reduce to one problem once query heads are folded into rows: a block of
`R` query rows (query tokens x the query heads that share one KV head) attends to the KV tokens of
one sequence, stored in pages. Row `r` sees the keys at positions `< row_limit[r]` (the caller
folds causality among the new tokens and the sequence length into that one number).

Shapes (G = B * nKV "groups": a sequence and one of its KV heads; R rows per group, a multiple
of 64; S splits; N pages of P tokens):
  q:          [G, R, Dk]        queries, folded rows (MLA: Dk = Dc + Dr, latent then rope).
  k_pages:    [N, P, Dk]        (MLA latent pool) or [N, P, nKV, Dk] (GQA keys).
  v_pages:    None (MLA: the values are the first Dv columns of each key) or [N, P, nKV, Dv].
  page_table: [B, max_pages] int32.
  row_limit:  [G, R] int32      row r sees key positions s < row_limit[r] (0: sees nothing).
  block_end:  [G, R // 64] int32  max of row_limit over each 64-row query block.
Returns:
  out: [G, S, R, Dv]  per split, softmax-normalised partial context (q's dtype).
  lse: [G, S, R] float32  per split log-sum-exp of the scaled scores (-inf: split saw nothing).
`combine_splits` merges the splits (flash-decoding).

Grid: (S, R // 64, G). Each CUDA block owns one 64-row query block of one group and a
contiguous run of KV blocks (`block_kv` tokens, a divisor of the page size): the KV blocks the
query block needs are divided evenly among the splits at run time, so ragged batches and short
sequences waste no loads, and batch 1 with a long context still launches S CUDA blocks.

Inside a CUDA block: `num_compute_wgs` compute warpgroups plus one memory warpgroup. The memory
warpgroup streams KV blocks (TMA, through the page table) into a ring of `num_stages` SMEM slots.
Compute warpgroup 0 waits for a slot, computes the 64 x block_kv scores with WGMMA, masks them
(per-row key limit), runs the online softmax in registers, stages P (bf16/f16) in SMEM and
accumulates P @ V for its share of the value columns with WGMMA, then releases the slot. The value
width is split across the compute warpgroups (MLA: 512 = 2 x 256) because a 64 x 512 float32
accumulator does not fit in one warpgroup's registers; the other compute warpgroups take P and the
rescale factor alpha from warpgroup 0 through double-buffered SMEM (barriers p_ready / p_free,
as FlashMLA does), so QK^T is computed once. At the end every compute warpgroup writes its
normalised tile through SMEM (aliasing the query buffer) and warpgroup 0 the log-sum-exp.

Constraints (WGMMA / TMA): q and pages bf16 or f16 (float32 would run WGMMA in tf32: rejected);
block_kv a multiple of 16 dividing the page size; Dk and each compute warpgroup's share of Dv
multiples of the swizzle width (64 columns for block_kv >= 64, 32 for 32, 16 for 16).

Interpret mode (`pallas_kernels.interpret`) implements neither `pl.run_state` nor stores to
WGMMA accumulators, so under it (only) P @ V goes to a fresh accumulator and is added in
registers (`wgmma_accumulate`); on the GPU it accumulates in place. Everything else is the same
code.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.interpret import wgmma_accumulate

BLOCK_Q = 64  # WGMMA's M tile: one warpgroup's rows.
_MAX_WGMMA_N = 256  # widest accumulator one compute warpgroup holds (64 x 256 float32).
_MEMORY_WG_REGISTERS = 40  # per thread; the memory warpgroup only issues TMA copies.
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_dtype(dtype) -> None:
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"the Mosaic GPU attention kernels take bf16/f16 caches, got {jnp.dtype(dtype)} "
        "(WGMMA would compute float32 in tf32); use the reference for float32")


def _smem_transforms(dtype, block_kv: int) -> tuple:
  """Tiling + swizzle for every WGMMA operand in SMEM.

  WGMMA wants A and B with the same swizzle; P (A of P @ V) is only block_kv wide, so its row
  width in bytes bounds the swizzle of every operand (128 B for 64 bf16 tokens, 64 B for 32).
  """
  swizzle = plgpu.find_swizzle(block_kv * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def paged_flash_attention(q, k_pages, v_pages, page_table, row_limit, block_end, *,
                          softmax_scale: float, num_splits: int, num_kv_heads: int = 1,
                          value_dim: int | None = None, block_kv: int | None = None,
                          num_stages: int = 2, min_tokens_per_split: int = 512):
  """Partial (per split) attention over paged KV; see the module docstring for shapes."""
  groups, rows, dk = q.shape
  dtype = q.dtype
  check_dtype(dtype)
  if k_pages.dtype != dtype or (v_pages is not None and v_pages.dtype != dtype):
    raise ValueError(f"q and pages must share a dtype, got {q.dtype}, {k_pages.dtype}")
  shared_kv = v_pages is None
  page_size = k_pages.shape[1]
  if shared_kv:
    if k_pages.ndim != 3 or value_dim is None:
      raise ValueError(f"MLA pages must be [N, P, Dk] with a value_dim, got {k_pages.shape}")
    dv = value_dim
  else:
    dv = v_pages.shape[-1]
  block_kv = block_kv or min(page_size, 64)
  if rows % BLOCK_Q:
    raise ValueError(f"rows={rows} must be a multiple of {BLOCK_Q}")
  if block_kv % 16 or page_size % block_kv:
    raise ValueError(f"block_kv={block_kv} must be a multiple of 16 (WGMMA K tile) dividing "
                     f"page_size={page_size}")
  # Every SMEM operand is tiled in columns of the swizzle width (see _smem_transforms).
  tile_cols = _smem_transforms(dtype, block_kv)[0].tiling[1]
  num_compute_wgs = pl.cdiv(dv, _MAX_WGMMA_N)
  if dk % tile_cols or dv % (num_compute_wgs * tile_cols):
    raise ValueError(f"with block_kv={block_kv} the head dims must be multiples of {tile_cols} "
                     f"(Dv of {num_compute_wgs} x {tile_cols}), got Dk={dk} Dv={dv}")
  dv_wg = dv // num_compute_wgs
  num_q_blocks = rows // BLOCK_Q
  blocks_per_page = page_size // block_kv
  # A split writes a 64 x Dv partial; fewer KV tokens than this per split and the partials
  # cost more HBM traffic than they save.
  min_blocks_per_split = max(1, min_tokens_per_split // block_kv)
  # Pages viewed as [N, P // block_kv, block_kv, ...] (a free reshape), so that a KV block is
  # addressed by static-size indices: TMA wants slice starts it can prove tile-aligned.
  def by_blocks(pages):
    return pages.reshape(pages.shape[0], blocks_per_page, block_kv, *pages.shape[2:])
  # setmaxnreg wants multiples of 8; 65536 registers per SM, 128 threads per warpgroup.
  compute_registers = min(
      240, (65536 - 128 * _MEMORY_WG_REGISTERS) // (128 * num_compute_wgs) // 8 * 8)

  def kernel(q_ref, k_ref, v_ref, pt_ref, row_limit_ref, block_end_ref, out_ref, lse_ref,
             q_or_out_smem, k_smem, v_smem, p_smem, alpha_smem, inv_l_smem, limit_smem, lse_smem,
             q_bars, k_bars, v_bars, k_free, v_free, p_ready, p_free, l_ready):
    q_smem, out_smem = q_or_out_smem
    split = lax.axis_index("split")
    q_block = lax.axis_index("q_block")
    group = lax.axis_index("group")
    wg = lax.axis_index("wg")
    seq = lax.div(group, jnp.int32(num_kv_heads))
    kv_head = lax.rem(group, jnp.int32(num_kv_heads))
    q_rows = pl.ds(q_block * BLOCK_Q, BLOCK_Q)

    # This split's KV blocks: those the query block needs, divided evenly among the splits (but
    # at least min_blocks_per_split each, so a short sequence leaves the later splits idle).
    end = block_end_ref[group, q_block]
    num_blocks = lax.div(end + (block_kv - 1), jnp.int32(block_kv))
    per_split = jnp.maximum(lax.div(num_blocks + (num_splits - 1), jnp.int32(num_splits)),
                            jnp.int32(min_blocks_per_split))
    first = split * per_split
    steps = jnp.maximum(jnp.minimum(per_split, num_blocks - first), 0)

    # With 3+ warpgroups the even register split (65536 / 384 = 168 per thread) is too small for
    # a 64 x 256 float32 accumulator plus scores: move registers to the compute warpgroups.
    rebalance_registers = num_compute_wgs > 1

    @pl.when(wg == num_compute_wgs)
    def _memory_wg():
      if rebalance_registers:
        plgpu.set_max_registers(_MEMORY_WG_REGISTERS, action="decrease")

      def issue(step, slot):
        kv_block = first + step
        page = pt_ref[seq, lax.div(kv_block, jnp.int32(blocks_per_page))]
        in_page = lax.rem(kv_block, jnp.int32(blocks_per_page))
        k_src = k_ref.at[page, in_page] if shared_kv else k_ref.at[page, in_page, :, kv_head]
        plgpu.copy_gmem_to_smem(k_src, k_smem.at[slot], k_bars.at[slot])
        if not shared_kv:
          plgpu.copy_gmem_to_smem(v_ref.at[page, in_page, :, kv_head], v_smem.at[slot],
                                  v_bars.at[slot])

      @pl.loop(0, jnp.minimum(steps, num_stages))
      def _prologue(step):
        issue(step, step)

      def wait_free(step):
        slot = lax.rem(step, jnp.int32(num_stages))
        plgpu.barrier_wait(k_free.at[slot])
        if not shared_kv:
          plgpu.barrier_wait(v_free.at[slot])
        return slot

      @pl.loop(num_stages, jnp.maximum(steps, num_stages))
      def _steady(step):
        issue(step, wait_free(step - num_stages))

      # Observe the release of the last blocks too, so every barrier phase is waited for once
      # (cheap: the memory warpgroup has nothing else to do, and interpret mode insists).
      @pl.loop(jnp.maximum(steps - num_stages, 0), steps)
      def _drain(step):
        wait_free(step)

    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def add_context(acc, slot, cols, p_tile):
      """acc += P @ V[:, cols] for the KV block in `slot`, then releases the slot."""
      if not shared_kv:
        plgpu.barrier_wait(v_bars.at[slot])
        v_tile = v_smem.at[slot, :, cols]
      else:
        v_tile = k_smem.at[slot, :, cols]
      acc = wgmma_accumulate(acc, p_tile, v_tile)
      plgpu.barrier_arrive(k_free.at[slot])
      if not shared_kv:
        plgpu.barrier_arrive(v_free.at[slot])
      return acc

    def write_context(acc, inv_l, cols, tile):
      # The staging tile aliases q_smem, which only warpgroup 0 reads: its last score WGMMA
      # completed before it published the last P, which every warpgroup has consumed by now.
      # An idle split writes only its lse (-inf): combine_splits never reads its partial.
      @pl.when(steps > 0)
      def _():
        out_smem.at[tile][...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[tile], out_ref.at[group, split, q_rows, cols])

    def zeros_acc():
      return plgpu.layout_cast(jnp.zeros((BLOCK_Q, dv_wg), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _softmax_wg():
      """Scores, masking and the online softmax for every column; P @ V for columns [0, dv_wg)."""
      if rebalance_registers:
        plgpu.set_max_registers(compute_registers, action="increase")
      plgpu.copy_gmem_to_smem(q_ref.at[group, q_rows], q_smem, q_bars.at[0])
      plgpu.copy_gmem_to_smem(row_limit_ref.at[group, q_rows], limit_smem, q_bars.at[1])
      plgpu.barrier_wait(q_bars.at[0])
      plgpu.barrier_wait(q_bars.at[1])
      limit = lax.broadcast_in_dim(plgpu.load(limit_smem, layout=row_layout),
                                   (BLOCK_Q, block_kv), [0])
      cols = pl.ds(0, dv_wg)
      m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout)
      l_i = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout)

      def step_body(step, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(step, jnp.int32(num_stages))
        p_slot = lax.rem(step, jnp.int32(2))
        plgpu.barrier_wait(k_bars.at[slot])

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]
        s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
        s = s * softmax_scale
        kv_pos = (first + step) * block_kv + plgpu.broadcasted_iota(
            jnp.int32, (BLOCK_Q, block_kv), 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where(kv_pos < limit, s, -jnp.inf)

        # Online softmax. m stays -inf while a row has seen no visible key; m_safe keeps
        # exp(-inf - -inf) from turning into NaN.
        m_new = jnp.maximum(m_i, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_i - m_safe)
        p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        # P (WGMMA's A operand) and alpha go through SMEM, double-buffered: the other
        # warpgroups may still be using step - 1's. Step - 2's are free once they said so
        # (this warpgroup's own P @ V of that step completed when its accumulator was read).
        if num_compute_wgs > 1:
          @pl.when(step >= 2)
          def _():
            plgpu.barrier_wait(p_free.at[p_slot])
          alpha_smem.at[p_slot][...] = alpha
        p_smem.at[p_slot][...] = p.astype(dtype)
        plgpu.commit_smem()
        if num_compute_wgs > 1:
          plgpu.barrier_arrive(p_ready.at[p_slot])
        acc = add_context(acc, slot, cols, p_smem.at[p_slot])
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(0, steps, step_body, (zeros_acc(), m_i, l_i))
      seen = l_i > 0
      inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
      if num_compute_wgs > 1:
        # Observe the last releases of P too (every barrier phase is waited for once).
        @pl.loop(jnp.maximum(steps - 2, 0), steps)
        def _drain(step):
          plgpu.barrier_wait(p_free.at[lax.rem(step, jnp.int32(2))])
        inv_l_smem[...] = inv_l
        plgpu.commit_smem()
        plgpu.barrier_arrive(l_ready)
      write_context(acc, inv_l, cols, 0)
      lse_smem[...] = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[group, split, q_rows])
      plgpu.wait_smem_to_gmem(0)

    if num_compute_wgs > 1:
      @pl.when((wg > 0) & (wg < num_compute_wgs))
      def _value_wg():
        """P @ V for columns [wg * dv_wg, (wg + 1) * dv_wg), with warpgroup 0's P and alpha."""
        plgpu.set_max_registers(compute_registers, action="increase")
        cols = pl.ds(wg * dv_wg, dv_wg)

        def step_body(step, acc):
          slot = lax.rem(step, jnp.int32(num_stages))
          p_slot = lax.rem(step, jnp.int32(2))
          plgpu.barrier_wait(k_bars.at[slot])  # the TMA's writes, seen by this warpgroup too
          plgpu.barrier_wait(p_ready.at[p_slot])
          alpha = plgpu.load(alpha_smem.at[p_slot], layout=row_layout)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          acc = add_context(acc, slot, cols, p_smem.at[p_slot])
          plgpu.barrier_arrive(p_free.at[p_slot])
          return acc

        acc = lax.fori_loop(0, steps, step_body, zeros_acc())
        plgpu.barrier_wait(l_ready)
        write_context(acc, plgpu.load(inv_l_smem, layout=row_layout), cols, wg)
        plgpu.wait_smem_to_gmem(0)

  def entry(*refs):
    transforms = _smem_transforms(dtype, block_kv)
    scratch = dict(
        # Queries while the loop runs, then each compute warpgroup's output tile.
        q_or_out_smem=plgpu.RefUnion(
            plgpu.SMEM((BLOCK_Q, dk), dtype, transforms=transforms),
            plgpu.SMEM((num_compute_wgs, BLOCK_Q, dv_wg), dtype,
                       transforms=transforms)),
        k_smem=plgpu.SMEM((num_stages, block_kv, dk), dtype, transforms=transforms),
        v_smem=None if shared_kv else plgpu.SMEM(
            (num_stages, block_kv, dv), dtype, transforms=transforms),
        p_smem=plgpu.SMEM((2, BLOCK_Q, block_kv), dtype, transforms=transforms),
        limit_smem=plgpu.SMEM((BLOCK_Q,), jnp.int32),
        lse_smem=plgpu.SMEM((BLOCK_Q,), jnp.float32),
        q_bars=plgpu.Barrier(num_barriers=2),
        k_bars=plgpu.Barrier(num_barriers=num_stages),
        v_bars=None if shared_kv else plgpu.Barrier(num_barriers=num_stages),
        k_free=plgpu.Barrier(num_arrivals=num_compute_wgs, num_barriers=num_stages),
        v_free=None if shared_kv else plgpu.Barrier(
            num_arrivals=num_compute_wgs, num_barriers=num_stages),
        # Warpgroup 0 hands P, alpha and finally 1 / l to the other compute warpgroups.
        alpha_smem=None, inv_l_smem=None, p_ready=None, p_free=None, l_ready=None,
    )
    if num_compute_wgs > 1:
      scratch.update(
          alpha_smem=plgpu.SMEM((2, BLOCK_Q), jnp.float32),
          inv_l_smem=plgpu.SMEM((BLOCK_Q,), jnp.float32),
          p_ready=plgpu.Barrier(num_barriers=2),
          p_free=plgpu.Barrier(num_arrivals=num_compute_wgs - 1, num_barriers=2),
          l_ready=plgpu.Barrier())
    pl.run_scoped(lambda **s: kernel(*refs, **s), **scratch, collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((groups, num_splits, rows, dv), dtype),
              jax.ShapeDtypeStruct((groups, num_splits, rows), jnp.float32))
  call = plgpu.kernel(
      entry, out_type=out_type,
      grid=(num_splits, num_q_blocks, groups), grid_names=("split", "q_block", "group"),
      num_threads=num_compute_wgs + 1, thread_name="wg")
  k_blocks = by_blocks(k_pages)
  return call(q, k_blocks, k_blocks if shared_kv else by_blocks(v_pages), page_table, row_limit,
              block_end)


def combine_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
  """[G, S, R, Dv] partial contexts + [G, S, R] log-sum-exps -> [G, R, Dv] float32.

  Splits that saw no key carry lse = -inf and weigh nothing (their partial may be unwritten
  memory, so it is selected away, not multiplied by 0); rows no split saw come out 0 (as the
  reference's fully-masked rows).
  """
  lse_max = jnp.max(lse, axis=1, keepdims=True)
  lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  w = jnp.exp(lse - lse_max)  # [G, S, R]
  denom = jnp.sum(w, axis=1)
  out = jnp.where((w > 0)[..., None], out.astype(jnp.float32), 0.0)
  num = jnp.einsum("gsr,gsrd->grd", w, out)
  return num / jnp.where(denom > 0, denom, 1.0)[..., None]


def default_num_splits(work_blocks: int, max_tokens: int, num_sms: int = 132,
                       min_tokens_per_split: int = 512) -> int:
  """Enough splits for about two CUDA blocks per SM (H200: 132 SMs), but no split shorter than
  `min_tokens_per_split` tokens of the longest possible sequence (`max_tokens`)."""
  wanted = pl.cdiv(2 * num_sms, max(work_blocks, 1))
  return max(1, min(wanted, pl.cdiv(max_tokens, min_tokens_per_split)))
