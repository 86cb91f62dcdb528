"""`speculative_decode_loop`: the serving engine's decode-only device loop with n-gram drafting.

Same contract as `steps.decode_loop` (B rows that only decode; a token budget `num_steps` per
call, for which the scheduler took pages up front; EOS/stop ids and per-row limits on the
device), but every iteration drafts up to K tokens per row, by prompt lookup in the row's recent
tokens ("ngram") or from the engine's learned n-gram table ("learned", updated from every
emitted token and handed back), and verifies them with ONE target forward over K + 1 positions. A row never writes past
`n_cached + limit - 1`, so the pages taken for `num_steps` plain decode steps suffice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative import drafters, learned
from engine.runtime.speculative.loop import SpecStats, _place, verify_block


@functools.partial(jax.jit,
                   static_argnames=("max_steps", "num_draft", "drafter", "cfg", "impl"),
                   donate_argnames=("cache", "ngram_table"))
def speculative_decode_loop(params: Params, cache: Cache, tokens: jax.Array,
                            n_cached: jax.Array, page_table: jax.Array,
                            sampling: SamplingArrays, stop_ids: jax.Array, remaining: jax.Array,
                            min_before_stop: jax.Array, num_steps: jax.Array,
                            history: jax.Array, history_len: jax.Array,
                            ngram_table: learned.NgramTable | None = None, *, max_steps: int,
                            num_draft: int, drafter: str = "ngram", cfg: ModelConfig,
                            impl: KernelChoice = REFERENCE
                            ) -> tuple[jax.Array, jax.Array, jax.Array, SpecStats,
                                       learned.NgramTable | None, Cache]:
  """Up to `num_steps` (<= max_steps) new tokens per row, K = num_draft drafted per iteration.

  Args:
    tokens, n_cached, page_table, sampling, stop_ids, remaining, min_before_stop, num_steps:
      as in `steps.decode_loop` (num_steps counts tokens, not iterations).
    history: [B, W] int32 the row's most recent tokens, oldest first, ending with `tokens`;
      W >= history_len + max_steps (the loop appends what it emits).
    history_len: [B] int32 tokens in `history` (>= 1 for real rows).
    ngram_table: drafter "learned" only (donated).
  Returns:
    (out [B, max_steps] (-1 past each row's count), counts [B], stopped [B] bool, SpecStats,
     the updated table (or None), cache).
  """
  if drafter not in ("ngram", "learned"):
    raise ValueError(f"the serving loop drafts with 'ngram' or 'learned', got {drafter!r}")
  b, k = tokens.shape[0], num_draft
  limit = jnp.minimum(remaining, jnp.minimum(num_steps, max_steps))

  def step(state):
    cache, tok, n_cached, done, count, out, stopped, history, history_len, stats, table = state
    live = ~done
    if drafter == "ngram":
      draft, n_draft = drafters.ngram_propose(history, history_len - 1, k)
    else:
      draft, n_draft = learned.propose(table, history, history_len - 1, k)
    n_draft = jnp.where(live, jnp.minimum(n_draft, limit - count - 1), 0)
    v = verify_block(params, cache, tok, draft, None, n_draft, n_cached, live, count, stop_ids,
                     min_before_stop, sampling, page_table, cfg=cfg, impl=impl)
    out = _place(out, count, v.emitted, v.n_emit)
    history = _place(history, history_len, v.emitted, v.n_emit)
    count = count + v.n_emit
    stopped = stopped | v.stopped
    done = done | v.stopped | (count >= limit)
    stats = stats.add(live, n_draft, v.n_accepted)
    if drafter == "learned":
      slots = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
      table = learned.update(table, history, history_len[:, None] + slots,
                             slots < v.n_emit[:, None])
    return (v.cache, jnp.where(live, v.extra, tok), n_cached + v.n_emit, done, count, out,
            stopped, history, history_len + v.n_emit, stats, table)

  zeros = jnp.zeros((b,), jnp.int32)
  state = (cache, tokens, n_cached, limit <= 0, zeros, jnp.full((b, max_steps), -1, jnp.int32),
           jnp.zeros((b,), bool), history, history_len.astype(jnp.int32),
           SpecStats.zeros(b, k), ngram_table if drafter == "learned" else None)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s[3]), step, state)
  cache, _, _, _, count, out, stopped, _, _, stats, table = state
  return out, count, stopped, stats, table, cache
