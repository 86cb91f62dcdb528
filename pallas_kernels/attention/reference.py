"""Plain-JAX paged attention: the reference for the Pallas kernels and the CPU implementation.

The KV cache is a pool of pages shared by all sequences. A sequence's tokens live in the pages its
row of `page_table` names, in order: token position `p` is at page `page_table[b, p // P]`,
slot `p % P`. Queries are a block of `T >= 1` new tokens per sequence at absolute positions
`q_positions[b, t]`, already written into the cache; query `t` sees the keys at positions
`<= q_positions[b, t]` and `< kv_lens[b]`. One function therefore covers prefill (T = prompt
chunk), decode (T = 1) and speculative verification (T = k + 1).

Shapes: B sequences, T query tokens, nH query heads, N pages, P tokens per page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
  """[N, P, ...] pages, [B, max_pages] table -> [B, max_pages * P, ...] per-sequence view."""
  g = pages[page_table]  # [B, max_pages, P, ...]
  return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def _causal_mask(q_positions: jax.Array, kv_lens: jax.Array, kv_len_max: int) -> jax.Array:
  """[B, T, S] boolean: key position s is visible to query t."""
  s = jnp.arange(kv_len_max, dtype=jnp.int32)
  return (s[None, None, :] <= q_positions[:, :, None]) & (s[None, None, :] < kv_lens[:, None, None])


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis of float32 `scores`; rows with no visible key give zeros."""
  scores = jnp.where(mask, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(scores - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


# `_blocked_attention` runs for query blocks at least this long (prefill chunks) and for page
# tables of at least BLOCKED_MIN_KEYS positions (decode over a serving engine's page table sized
# for max_model_len: only the pages the longest row uses are gathered); else the one-pass form.
BLOCKED_MIN_QUERIES = 32
BLOCKED_MIN_KEYS = 512


def _block_sizes(t: int) -> tuple[int, int]:
  """(query rows, key rows) per block; measured on 2 CPU cores at the demo model's shapes."""
  return 64, (64 if BLOCKED_MIN_QUERIES <= t < 256 else 128)


def _uses_blocks(t: int, max_keys: int) -> bool:
  return t >= BLOCKED_MIN_QUERIES or max_keys >= BLOCKED_MIN_KEYS


def _blocked_attention(q: jax.Array, pages: jax.Array, page_table: jax.Array, dv: int,
                       q_positions: jax.Array, kv_lens: jax.Array) -> jax.Array:
  """Causal attention by blocks with an online softmax (flash-attention order). Each block of
  queries visits only the key blocks it can see (up to its last query's position and the longest
  kv_len, a dynamic bound: later blocks are skipped by `lax.cond`, so the loop stays
  reverse-differentiable) and gathers only those blocks' pages; no [T, S] score matrix is
  materialised. A prompt of T tokens costs ~T^2/2 instead of T * S; a decode step costs the
  longest row's length, not the page table's width.

  Args:
    q: [B, T, nH, D] float32 queries, already scaled.
    pages: [N, P, D] cache pages (keys; values are the first dv channels); page_table [B, M].
    q_positions, kv_lens: as in `mla_paged_attention`.
  Returns:
    [B, T, nH, dv] float32; queries with no visible key give zeros.
  """
  b, t, nh, _ = q.shape
  page = pages.shape[1]
  bq, bk = _block_sizes(t)
  bq = min(bq, t)
  pages_per_block = max(1, -(-bk // page))
  bk = pages_per_block * page
  n_qb, n_kb = -(-t // bq), -(-page_table.shape[1] // pages_per_block)
  # Padding entries name the null page 0; their positions lie past every kv_len.
  table = jnp.pad(page_table, ((0, 0), (0, n_kb * pages_per_block - page_table.shape[1])))
  q = jnp.pad(q, ((0, 0), (0, n_qb * bq - t), (0, 0), (0, 0)))
  pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, n_qb * bq - t)), constant_values=-1)
  q = jnp.moveaxis(q.reshape(b, n_qb, bq, nh, -1), 1, 0)  # [n_qb, B, bq, nH, D]
  pos = jnp.moveaxis(pos.reshape(b, n_qb, bq), 1, 0)
  table_blocks = jnp.moveaxis(table.reshape(b, n_kb, pages_per_block), 1, 0)  # [n_kb, B, ppb]
  kv_max = jnp.max(kv_lens)

  def query_block(_, xs):
    qb, pb = xs
    visible = jnp.minimum(jnp.max(pb) + 1, kv_max)  # keys [0, visible) may be seen

    def key_block(carry, kx):
      j, tb = kx

      def update(carry):
        m, l, acc = carry
        kb = gather_pages(pages, tb).astype(jnp.float32)  # [B, bk, D]
        kpos = j * bk + jnp.arange(bk, dtype=jnp.int32)
        mask = ((kpos[None, None, :] <= pb[:, :, None])
                & (kpos[None, None, :] < kv_lens[:, None, None]))[:, :, None, :]
        sc = jnp.where(mask, jnp.einsum("bqhd,bkd->bqhk", qb, kb), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(sc - m_safe[..., None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("bqhk,bkc->bqhc", p, kb[..., :dv])
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc

      return jax.lax.cond(j * bk < visible, update, lambda c: c, carry), None

    init = (jnp.full((b, bq, nh), -jnp.inf, jnp.float32), jnp.zeros((b, bq, nh), jnp.float32),
            jnp.zeros((b, bq, nh, dv), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(key_block, init,
                                  (jnp.arange(n_kb, dtype=jnp.int32), table_blocks))
    return None, acc / jnp.where(l > 0, l, 1.0)[..., None]

  _, out = jax.lax.scan(query_block, None, (q, pos))  # [n_qb, B, bq, nH, dv]
  return jnp.moveaxis(out, 0, 1).reshape(b, n_qb * bq, nh, dv)[:, :t]


def mla_paged_attention(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                        page_table: jax.Array, q_positions: jax.Array, kv_lens: jax.Array, *,
                        softmax_scale: float) -> jax.Array:
  """Absorbed Multi-head Latent Attention over a paged latent cache.

  Args:
    q_latent: [B, T, nH, Dc] queries already multiplied by W_UK (Dc = kv_lora_rank).
    q_rope: [B, T, nH, Dr] rotary part of the queries (Dr = qk_rope_head_dim).
    latent_pages: [N, P, Dc + Dr] per token: normalised latent c_kv, then the rotated rope key.
    page_table: [B, max_pages] int32.
    q_positions: [B, T] int32 absolute positions of the queries.
    kv_lens: [B] int32 valid cache length per sequence (including the new tokens).
    softmax_scale: multiplier on the scores.
  Returns:
    [B, T, nH, Dc] latent context in q_latent's dtype (the caller applies W_UV).
  """
  dc = q_latent.shape[-1]
  # One contraction over latent and rope parts together (the cache row is [c_kv, k_rope]).
  q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32) * softmax_scale
  if _uses_blocks(q_latent.shape[1], page_table.shape[1] * latent_pages.shape[1]):
    return _blocked_attention(q, latent_pages, page_table, dc, q_positions,
                              kv_lens).astype(q_latent.dtype)
  kv = gather_pages(latent_pages, page_table).astype(jnp.float32)  # [B, S, Dc+Dr]
  c = kv[..., :dc]
  scores = jnp.einsum("bthd,bsd->bths", q, kv)
  mask = _causal_mask(q_positions, kv_lens, kv.shape[1])[:, :, None, :]
  probs = _masked_softmax(scores, mask)
  return jnp.einsum("bths,bsc->bthc", probs, c).astype(q_latent.dtype)


def gqa_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, q_positions: jax.Array, kv_lens: jax.Array, *,
                        softmax_scale: float) -> jax.Array:
  """Grouped-query attention over paged K/V.

  Args:
    q: [B, T, nH, D]; nH is a multiple of nKV and query head h reads KV head h // (nH / nKV).
    k_pages, v_pages: [N, P, nKV, D].
    page_table, q_positions, kv_lens, softmax_scale: as in `mla_paged_attention`.
  Returns:
    [B, T, nH, D] in q's dtype.
  """
  b, t, nh, d = q.shape
  nkv = k_pages.shape[2]
  k = gather_pages(k_pages, page_table).astype(jnp.float32)  # [B, S, nKV, D]
  v = gather_pages(v_pages, page_table).astype(jnp.float32)
  qg = q.astype(jnp.float32).reshape(b, t, nkv, nh // nkv, d)
  scores = jnp.einsum("btkgd,bskd->btkgs", qg, k) * softmax_scale
  mask = _causal_mask(q_positions, kv_lens, k.shape[1])[:, :, None, None, :]
  probs = _masked_softmax(scores, mask)
  out = jnp.einsum("btkgs,bskd->btkgd", probs, v)
  return out.reshape(b, t, nh, d).astype(q.dtype)


def write_pages(pages: jax.Array, page_table: jax.Array, positions: jax.Array,
                valid: jax.Array, new: jax.Array) -> jax.Array:
  """Scatters new tokens into their pages; invalid tokens are dropped.

  Args:
    pages: [N, P, ...] (donate it: the update is in place).
    page_table: [B, max_pages] int32.
    positions: [B, T] int32 absolute positions of the new tokens.
    valid: [B, T] bool; False entries (padding, finished rows) write nothing.
    new: [B, T, ...] values, cast to the pages' dtype.
  Returns:
    The updated pages.
  """
  num_pages, page_size = pages.shape[:2]
  max_pages = page_table.shape[1]
  logical = positions // page_size
  in_table = (logical >= 0) & (logical < max_pages)
  page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, max_pages - 1), axis=1)
  # An out-of-range page index makes mode="drop" skip the write.
  page = jnp.where(valid & in_table, page, num_pages)
  slot = positions % page_size
  return pages.at[page, slot].set(new.astype(pages.dtype), mode="drop")
