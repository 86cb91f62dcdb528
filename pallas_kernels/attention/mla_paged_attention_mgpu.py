"""Absorbed MLA over a paged latent cache on Mosaic GPU (FlashMLA-style flash-decoding).

Same contract as `reference.mla_paged_attention` (the reference beside it):
  q_latent:     [B, T, nH, Dc]  queries already multiplied by W_UK.
  q_rope:       [B, T, nH, Dr]
  latent_pages: [N, P, Dc + Dr] per token: latent c_kv, then the rope key.
  page_table:   [B, max_pages] int32; q_positions: [B, T] int32; kv_lens: [B] int32.
  returns       [B, T, nH, Dc] in q_latent's dtype.

One kernel covers decode (T = 1), speculative verification (T = k + 1) and chunked prefill (T =
chunk): the T x nH query rows of a sequence share the single latent KV "head", so they are
folded into rows (row = t * nH + h) and tiled into 64-row query blocks (a grid axis); causality
among the new tokens is a per-row key limit min(q_position + 1, kv_len). The KV length is split
across CUDA blocks (flash-decoding) and the splits are merged with their log-sum-exps. Scores use
the full Dc + Dr row (latent . q_latent + rope . q_rope in one WGMMA); values are the first Dc
columns of the same SMEM page, so each page is read from HBM once.

Needs a bf16/f16 cache (float32 raises NotImplementedError: WGMMA would run it in tf32), a page
size that is a multiple of 16 (64 for Kimi) and Dc, Dc + Dr multiples of the swizzle width of
`block_kv` (32 columns for the default 32-token KV blocks; Kimi/DeepSeek 512 + 64 qualify).
Queries are cast to the cache dtype; the output comes back in q_latent's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import paged_flash_mgpu as core
from pallas_kernels.attention.reference import mla_paged_attention as reference  # noqa: F401


def fold_rows(row_limit: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """[G, n] per-row key limits -> ([G, rows] zero-padded, [G, rows // 64] per-block max)."""
  g, n = row_limit.shape
  padded = jnp.pad(row_limit, ((0, 0), (0, rows - n)))
  block_end = padded.reshape(g, rows // core.BLOCK_Q, core.BLOCK_Q).max(axis=-1)
  return padded, block_end


def mla_paged_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                        page_table: jax.Array, q_positions: jax.Array, kv_lens: jax.Array, *,
                        softmax_scale: float, num_splits: int | None = None,
                        block_kv: int = 32, num_stages: int = 3,
                        min_tokens_per_split: int = 512) -> jax.Array:
  """See the module docstring; `num_splits` defaults to filling 132 SMs twice.

  `block_kv` tokens (a divisor of the page size) are loaded per pipeline step; with Dc + Dr = 576
  the SMEM budget (227 KiB: queries 72 KiB + the KV ring) allows 3 stages of 32 tokens.
  """
  b, t, nh, dc = q_latent.shape
  dtype = latent_pages.dtype
  core.check_dtype(dtype)
  rows_used = t * nh
  rows = -(-rows_used // core.BLOCK_Q) * core.BLOCK_Q
  q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(dtype).reshape(b, rows_used, -1)
  q = jnp.pad(q, ((0, 0), (0, rows - rows_used), (0, 0)))
  limit = jnp.minimum(q_positions + 1, kv_lens[:, None]).astype(jnp.int32)  # [B, T]
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
