"""Grouped-query attention over paged K/V on Mosaic GPU (flash-decoding, one kernel for all T).

Same contract as `reference.gqa_paged_attention` (the reference beside it):
  q:               [B, T, nH, D]; query head h reads KV head h // (nH / nKV).
  k_pages/v_pages: [N, P, nKV, D].
  page_table:      [B, max_pages] int32; q_positions: [B, T] int32; kv_lens: [B] int32.
  returns          [B, T, nH, D] in q's dtype.

The query heads that share a KV head are folded with the T new tokens into rows (per (sequence,
KV head) group: row = t * (nH / nKV) + g), tiled into 64-row query blocks; one CUDA block loads
each K/V page of its KV head once for all of its rows. Decode, speculative verification and
chunked prefill are the same kernel (a longer T only adds query blocks); causality among the new
tokens is the per-row key limit min(q_position + 1, kv_len). KV length is split across CUDA
blocks and merged by log-sum-exp.

Needs a bf16/f16 cache (float32 raises NotImplementedError), a page size that is a multiple of
16 and D a multiple of the swizzle width of the KV block (min(page, 64) tokens: D % 64 for pages
of 64 or more, % 32 for 32, % 16 for 16). Queries are cast to the cache dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import paged_flash_mgpu as core
from pallas_kernels.attention.mla_paged_attention_mgpu import fold_rows
from pallas_kernels.attention.reference import gqa_paged_attention as reference  # noqa: F401


def gqa_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, q_positions: jax.Array, kv_lens: jax.Array, *,
                        softmax_scale: float, num_splits: int | None = None,
                        num_stages: int = 3,
                        min_tokens_per_split: int = 512) -> jax.Array:
  """See the module docstring; `num_splits` defaults to filling 132 SMs twice."""
  b, t, nh, d = q.shape
  nkv = k_pages.shape[2]
  heads_per_kv = nh // nkv
  dtype = k_pages.dtype
  core.check_dtype(dtype)
  rows_used = t * heads_per_kv
  rows = -(-rows_used // core.BLOCK_Q) * core.BLOCK_Q
  # [B, T, nKV, G, D] -> [B * nKV, T * G, D]
  qg = q.astype(dtype).reshape(b, t, nkv, heads_per_kv, d).transpose(0, 2, 1, 3, 4)
  qg = jnp.pad(qg.reshape(b * nkv, rows_used, d), ((0, 0), (0, rows - rows_used), (0, 0)))
  limit = jnp.minimum(q_positions + 1, kv_lens[:, None]).astype(jnp.int32)  # [B, T]
  limit = jnp.repeat(jnp.repeat(limit, heads_per_kv, axis=1), nkv, axis=0)  # [B * nKV, T * G]
  row_limit, block_end = fold_rows(limit, rows)
  if num_splits is None:
    num_splits = core.default_num_splits(
        b * nkv * rows // core.BLOCK_Q, page_table.shape[1] * k_pages.shape[1],
        min_tokens_per_split=min_tokens_per_split)
  out, lse = core.paged_flash_attention(
      qg, k_pages, v_pages, page_table.astype(jnp.int32), row_limit, block_end,
      softmax_scale=softmax_scale, num_splits=num_splits, num_kv_heads=nkv,
      num_stages=num_stages,
      min_tokens_per_split=min_tokens_per_split)
  ctx = core.combine_splits(out, lse)[:, :rows_used]  # [B * nKV, T * G, D]
  ctx = ctx.reshape(b, nkv, t, heads_per_kv, d).transpose(0, 2, 1, 3, 4)
  return ctx.reshape(b, t, nh, d).astype(q.dtype)
