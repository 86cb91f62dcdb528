"""Absorbed MLA over a paged latent cache on Mosaic GPU.

Same contract as `reference.mla_paged_attention` (the reference beside it):
  q_latent:     [B, T, nH, Dc]  queries already multiplied by W_UK.
  q_rope:       [B, T, nH, Dr]
  latent_pages: [N, P, Dc + Dr] per token: latent c_kv, then the rope key.
  page_table:   [B, max_pages] int32; q_positions: [B, T] int32; kv_lens: [B] int32.
  returns       [B, T, nH, Dc] in q_latent's dtype.

The T x nH query rows of a sequence share the single latent KV "head", so they are folded into
rows (row = t * nH + h); causality among the new tokens is a per-row key limit
min(q_position + 1, kv_len). Scores use the full Dc + Dr row; values are the first Dc columns of
the same SMEM tile, so each page is read from HBM once. Two kernels behind one contract:

* `kernel="decode"` (decode and speculative verify: T x nH <= 512 rows):
  `mla_decode_mgpu` + `mla_combine_mgpu`. The KV of the whole batch is split over all SMs by
  the actual lengths (`mla_decode_schedule`: FlashMLA's balanced persistent schedule, computed
  in XLA from kv_lens, shared by every layer of a step), 64-token blocks, float32 (or bf16)
  partials for real rows only, merged by a small combine kernel.
* `kernel="flash"` (prefill chunks, and head dims the decode kernel does not take):
  `paged_flash_mgpu`, a grid over (splits, query blocks, sequences) with a uniform split count.

`kernel="auto"` picks "decode" where it applies (`decode_problem` is None), else "flash".
Needs a bf16/f16 cache (float32 raises NotImplementedError: WGMMA would run it in tf32); decode:
Dc a multiple of 128, Dr of 64, pages of 8, 16, 32 or a multiple of 64 tokens (Kimi K2.5's
512 + 64 at pages of 16 or 64 qualify); flash: a page size that is a multiple of 16 and Dc,
Dc + Dr multiples of the swizzle width of `block_kv`. Queries are cast to the cache dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import mla_combine_mgpu, mla_decode_mgpu
from pallas_kernels.attention import mla_decode_schedule as schedule_lib
from pallas_kernels.attention import paged_flash_mgpu as core
from pallas_kernels.attention.reference import mla_paged_attention as reference  # noqa: F401


def fold_rows(row_limit: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """[G, n] per-row key limits -> ([G, rows] zero-padded, [G, rows // 64] per-block max)."""
  g, n = row_limit.shape
  padded = jnp.pad(row_limit, ((0, 0), (0, rows - n)))
  block_end = padded.reshape(g, rows // core.BLOCK_Q, core.BLOCK_Q).max(axis=-1)
  return padded, block_end


# Query rows per sequence up to which the decode kernel runs (8 query blocks: 64 heads x T = 8,
# or 8 heads x T = 64); longer blocks (prefill chunks) take the flash kernel, which skips the
# KV a causal query block cannot see.
MAX_DECODE_ROWS = 512
KERNELS = ("auto", "decode", "flash")


def decode_problem(rows: int, dc: int, dr: int, page_size: int, dtype) -> str | None:
  """Why the decode kernel does not apply to T x nH = `rows` query rows, or None."""
  if rows > MAX_DECODE_ROWS:
    return f"{rows} query rows per sequence (a prefill chunk) exceed {MAX_DECODE_ROWS}"
  try:
    mla_decode_mgpu.check_shapes(dc, dr, page_size, dtype)
  except (ValueError, NotImplementedError) as e:
    return str(e)
  return None


def num_sms() -> int:
  """SMs of the default GPU (its parts per query block), 132 (H100/H200 SXM) elsewhere."""
  try:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0)) or schedule_lib.DEFAULT_SMS
  except RuntimeError:
    return schedule_lib.DEFAULT_SMS


def mla_paged_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                        page_table: jax.Array, q_positions: jax.Array, kv_lens: jax.Array, *,
                        softmax_scale: float, kernel: str = "auto", num_parts: int | None = None,
                        overhead_blocks: int = schedule_lib.DEFAULT_OVERHEAD_BLOCKS,
                        min_blocks_per_part: int = 1, partial_dtype=jnp.float32,
                        combine_chunk: int | None = None,
                        combine_rows: int | None = None,
                        num_splits: int | None = None, block_kv: int = 32, num_stages: int = 3,
                        min_tokens_per_split: int = 512) -> jax.Array:
  """See the module docstring. Decode kernel: `num_parts` CUDA blocks per query block (default:
  the GPU's SMs / query blocks), `overhead_blocks` and `min_blocks_per_part` shape the split
  (`mla_decode_schedule`), `partial_dtype` float32 or bf16, `combine_chunk` value columns and
  `combine_rows` rows per CUDA block of the combine (32 / 64 / 128 and 8 / 16 / 32 / 64;
  defaults: `mla_combine_mgpu.auto_config`).
  Flash kernel: `num_splits` defaults
  to filling 132 SMs twice; `block_kv` tokens (a divisor of the page size) per pipeline step;
  with Dc + Dr = 576 the SMEM (227 KiB: queries 72 KiB + the KV ring) allows 3 stages of 32."""
  if kernel not in KERNELS:
    raise ValueError(f"kernel={kernel!r}: one of {KERNELS}")
  b, t, nh, dc = q_latent.shape
  dtype = latent_pages.dtype
  core.check_dtype(dtype)
  limit = jnp.minimum(q_positions + 1, kv_lens[:, None]).astype(jnp.int32)  # [B, T]
  problem = decode_problem(t * nh, dc, q_rope.shape[-1], latent_pages.shape[1], dtype)
  if kernel == "decode" and problem:
    raise ValueError(f"the MLA decode kernel does not apply: {problem}")
  if kernel == "decode" or (kernel == "auto" and problem is None):
    return _decode(q_latent, q_rope, latent_pages, page_table, limit, softmax_scale=softmax_scale,
                   num_parts=num_parts, overhead_blocks=overhead_blocks,
                   min_blocks_per_part=min_blocks_per_part, partial_dtype=partial_dtype,
                   combine_chunk=combine_chunk, combine_rows=combine_rows)
  rows_used = t * nh
  rows = -(-rows_used // core.BLOCK_Q) * core.BLOCK_Q
  q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(dtype).reshape(b, rows_used, -1)
  q = jnp.pad(q, ((0, 0), (0, rows - rows_used), (0, 0)))
  row_limit, block_end = fold_rows(jnp.repeat(limit, nh, axis=1), rows)
  if num_splits is None:
    num_splits = core.default_num_splits(
        b * rows // core.BLOCK_Q, page_table.shape[1] * latent_pages.shape[1],
        min_tokens_per_split=min_tokens_per_split)
  out, lse = core.paged_flash_attention(
      q, latent_pages, None, page_table.astype(jnp.int32), row_limit, block_end,
      softmax_scale=softmax_scale, num_splits=num_splits, value_dim=dc,
      block_kv=min(block_kv, latent_pages.shape[1]), num_stages=num_stages,
      min_tokens_per_split=min_tokens_per_split)
  ctx = core.combine_splits(out, lse)[:, :rows_used]  # [B, T * nH, Dc]
  return ctx.reshape(b, t, nh, dc).astype(q_latent.dtype)


def _decode(q_latent, q_rope, latent_pages, page_table, limit, *, softmax_scale, num_parts,
            overhead_blocks, min_blocks_per_part, partial_dtype, combine_chunk,
            combine_rows):
  """The decode kernel and its combine; limit [B, T] per query token."""
  b, t, nh, dc = q_latent.shape
  dtype = latent_pages.dtype
  rows_used = t * nh
  rows = schedule_lib.partial_rows(rows_used)
  pad = ((0, 0), (0, rows - rows_used), (0, 0))
  ql = q_latent.astype(dtype).reshape(b, rows_used, dc)
  qr = q_rope.astype(dtype).reshape(b, rows_used, -1)
  row_limit = jnp.repeat(limit, nh, axis=1)
  if rows != rows_used:  # (Kimi's 8 or 64 heads never pad)
    ql, qr = jnp.pad(ql, pad), jnp.pad(qr, pad)
    row_limit = jnp.pad(row_limit, pad[:2])
  if num_parts is None:
    num_parts = schedule_lib.num_parts_for(schedule_lib.num_q_blocks(rows), num_sms())
  # The KV each sequence needs: up to its last query's limit (a function of the step's
  # positions and lengths only: every layer's call computes the same schedule, and XLA keeps
  # one).
  schedule = schedule_lib.decode_schedule(
      jnp.max(limit, axis=1), num_parts=num_parts, overhead_blocks=overhead_blocks,
      min_blocks_per_part=min_blocks_per_part)
  partial, lse = mla_decode_mgpu.decode_partials(
      ql, qr, latent_pages, page_table, row_limit, schedule, softmax_scale=softmax_scale,
      partial_dtype=partial_dtype)
  out = mla_combine_mgpu.combine_partials(partial, lse, schedule.first_slot, schedule.count,
                                          out_dtype=q_latent.dtype, chunk=combine_chunk,
                                          group_rows=combine_rows)
  return out[:, :rows_used].reshape(b, t, nh, dc)


def mla_paged_attention_flash(q_latent, q_rope, latent_pages, page_table, q_positions, kv_lens,
                              **kwargs) -> jax.Array:
  """`mla_paged_attention` with the flash kernel for every block (the kernel before the
  split-KV decode kernel): `attention="mosaic_gpu_flash"`, for A/B runs and as a fallback."""
  return mla_paged_attention(q_latent, q_rope, latent_pages, page_table, q_positions, kv_lens,
                             kernel="flash", **kwargs)
