"""Drafters' proposals of the next K tokens of every row, on the device: prompt lookup
(`ngram_propose`, deterministic) and DeepSeek's multi-token-prediction layer (`mtp_observe` over
every verified block, its cache entries after the decoder layers' in the target cache;
`mtp_propose`, chained on its own output hidden state). (The draft model: `loop._draft_feed`,
`loop._draft_chain`.) Draft j (1-based) is the token at position n_cached + j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.transformer import Cache, compute_logits, forward_mtp
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative.acceptance import draft_sample

# The longest suffix prompt lookup matches (the longest recurring one wins, down to one token).
# On `bench.spec_constants`' workloads a minimum of 1 drafted the most accepted tokens per
# forward (against 2 and 3: +10-15%), and 8 the most of 3 / 5 / 8 / 12 on agent repetition
# (3.15 vs 3.04 at 5; fresh text within 1%) (BENCHMARKS.md, "the speculative constants").
NGRAM_MAX = 8


def ngram_propose(history: jax.Array, newest: jax.Array, k: int
                  ) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup in each row's history [B, L] (its newest token at index newest [B]): the
  tokens after the most recent occurrence of its longest recurring suffix (NGRAM_MAX tokens
  down to one). Returns (draft [B, K] int32, n_draft [B] int32, 0 if none recurs)."""
  b, length = history.shape
  ends = jnp.arange(length, dtype=jnp.int32)[None, :]
  run = jnp.zeros((b, length), jnp.int32)  # matched suffix length ending at each index
  alive = jnp.ones((b, length), bool)
  for m in range(NGRAM_MAX):
    suffix_tok = jnp.take_along_axis(history, jnp.maximum(newest - m, 0)[:, None], axis=1)
    shifted = jnp.concatenate([jnp.full((b, m), -1, history.dtype), history[:, :length - m]],
                              axis=1)  # shifted[e] = history[e - m]
    alive = alive & (shifted == suffix_tok) & (m <= newest)[:, None]
    run = run + alive.astype(jnp.int32)
  # A candidate must end before the newest token so that a continuation exists; prefer the
  # longest match, then the most recent one.
  valid = (ends < newest[:, None]) & (run > 0)
  score = jnp.where(valid, run * length + ends, -1)
  best = jnp.argmax(score, axis=1).astype(jnp.int32)
  found = jnp.max(score, axis=1) >= 0
  cols = best[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
  draft = jnp.take_along_axis(history, jnp.minimum(cols, length - 1), axis=1)
  n_draft = jnp.where(found, jnp.minimum(k, newest - best), 0).astype(jnp.int32)
  return draft, n_draft


def mtp_observe(params: Params, cache: Cache, hidden: jax.Array, next_tokens: jax.Array,
                start: jax.Array, n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
                impl: KernelChoice) -> tuple[jax.Array, Cache]:
  """Runs the MTP layer over a verified block and keeps its output at the block's last real
  position. hidden [B, T, H] (target, after the final norm); next_tokens [B, T] (token i+1 for
  every position i); start, n_new [B]. Returns (MTP hidden [B, H], cache)."""
  out, cache = forward_mtp(params, cache, hidden, next_tokens, start, n_new, page_table,
                           cfg=cfg, impl=impl)
  last = jnp.maximum(n_new - 1, 0)[:, None, None]
  return jnp.take_along_axis(out, last, axis=1)[:, 0], cache


def mtp_propose(params: Params, cache: Cache, mtp_hidden: jax.Array, n_cached: jax.Array,
                live: jax.Array, page_table: jax.Array, sampling: SamplingArrays, *, k: int,
                cfg: ModelConfig, impl: KernelChoice
                ) -> tuple[jax.Array, jax.Array, Cache]:
  """K drafts from the MTP layer, mtp_hidden [B, H] its output at position n_cached - 1.
  Returns (draft [B, K], q [B, K, V], cache); the chained steps' cache entries (positions
  n_cached .. n_cached + K - 2) are overwritten by the next `mtp_observe`."""
  h = mtp_hidden
  drafts, qs = [], []
  for j in range(1, k + 1):
    if j > 1:
      out, cache = forward_mtp(params, cache, h[:, None], drafts[-1][:, None],
                               n_cached + j - 2, live.astype(jnp.int32), page_table, cfg=cfg,
                               impl=impl)
      h = out[:, 0]
    tok, q = draft_sample(compute_logits(params, h, cfg), sampling, n_cached + j)
    drafts.append(tok)
    qs.append(q)
  return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), cache
