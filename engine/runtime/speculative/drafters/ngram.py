"""Prompt lookup (`ngram`): the tokens that followed the most recent occurrence of the row's
longest recurring suffix, in its last `ngram_window` tokens. Deterministic (verified against
the target's own samples), no state; constrained rows draft with its host form
(`host_propose`, the same rule in Python)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.runtime.speculative.drafters.base import Drafter, LoopContext, Proposal

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


def ngram_draft(ids: Sequence[int], k: int, window: int, max_n: int = NGRAM_MAX) -> list[int]:
  """`ngram_propose` on the host: the longest suffix (max_n tokens down to one) of the last
  `window` tokens that occurred before; up to k tokens that followed its most recent
  occurrence."""
  hist = list(ids[-window:])
  n = len(hist)
  if k <= 0 or n < 2:
    return []
  best_end, best_run = -1, 0
  for end in range(n - 2, -1, -1):  # most recent first; a continuation must exist
    run = 0
    while run < max_n and end - run >= 0 and hist[end - run] == hist[n - 1 - run]:
      run += 1
    if run > best_run:
      best_end, best_run = end, run
      if run == max_n:
        break
  if best_end < 0:
    return []
  return hist[best_end + 1:best_end + 1 + min(k, n - 1 - best_end)]


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  name = "ngram"
  deterministic = True
  drafts_on_host = True
  cfg: ModelConfig

  @staticmethod
  def host_propose(ids: Sequence[int], k: int, window: int) -> list[int]:
    return ngram_draft(ids, k, window)

  def propose(self, ctx: LoopContext, st: Any, cache: Any, k: int
              ) -> tuple[Proposal, Any, Any]:
    draft, n = ngram_propose(ctx.history, ctx.history_len - 1, k)
    return Proposal(draft, n, None, jnp.bool_(True)), st, cache
