"""Lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

Shapes: B rows, K draft slots per row, V vocabulary. Row b drafted `n_draft[b] <= K` tokens
`draft[b, :n_draft[b]]`; the target forward over `[newest, d_1 .. d_K]` gave logits
`target_logits[b, i]` for the token after position `first_position[b] - 1 + i`, i.e. the
distribution of the token at position `first_position[b] + i`.

* Greedy rows (temperature 0): accept while d_i equals the target argmax; the emitted extra token
  is the target argmax at the first mismatch (or after the last accepted draft), so the output is
  exactly non-speculative greedy.
* Sampled rows: p_i and q_i are the target's and drafter's distributions after the row's
  temperature/top-k/top-p/min-p transforms. d_i is accepted with probability
  min(1, p_i(d_i) / q_i(d_i)); at the first rejection the extra token comes from
  normalize(max(0, p_i - q_i)); if every drafted token is accepted it comes from p_{n_draft}.
  Deterministic drafters pass `draft_probs=None`: q is one-hot at d_i, so d_i must be accepted
  with probability p_i(d_i) and a rejection must sample p_i without d_i. Sampling x_i ~ p_i and
  accepting while x_i == d_i does exactly that; with x_i drawn by `sampling.sample` under the
  same (seed, position) key, the output is token for token the non-speculative sample (so it
  also does not depend on how many tokens were drafted).

Randomness of the token at position P comes from fold_in(key(seed), P) only (as in
`sampling.sample`), split into one stream per use, so results do not depend on batch company.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.runtime.sampling import SamplingArrays, argmax, over_kept_tokens, sample

# fold_in tags under the (seed, position) key: one independent stream per use.
STREAM_ACCEPT, STREAM_RESAMPLE, STREAM_DRAFT = 1, 2, 3


def position_keys(seed: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
  """Keys for tokens at `positions` [B, ...] of rows with `seed` [B]; same shape as positions."""
  def one(s, p):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), stream)
  flat = positions.reshape(positions.shape[0], -1).astype(jnp.uint32)
  keys = jax.vmap(lambda s, ps: jax.vmap(lambda p: one(s, p))(ps))(seed, flat)
  return keys.reshape(positions.shape)


def repeat_rows(s: SamplingArrays, n: int) -> SamplingArrays:
  """Each row's sampling parameters repeated n times: [B] -> [B * n] (row-major)."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), s)


def sampling_probs(logits: jax.Array, s: SamplingArrays) -> jax.Array:
  """Probabilities after the row's transforms, in vocabulary order. logits [N, V] -> [N, V]."""
  rows = jnp.arange(logits.shape[0])[:, None]

  def scatter(masked, ids):
    return jnp.zeros(logits.shape, jnp.float32).at[rows, ids].set(jax.nn.softmax(masked, -1))

  return over_kept_tokens(logits, s, scatter)


def block_probs(logits: jax.Array, s: SamplingArrays) -> jax.Array:
  """`sampling_probs` for a block of positions per row: [B, T, V] -> [B, T, V]."""
  b, t, v = logits.shape
  return sampling_probs(logits.reshape(b * t, v), repeat_rows(s, t)).reshape(b, t, v)


def _greedy(target_logits, draft, n_draft):
  k = draft.shape[1]
  best = argmax(target_logits)  # [B, K+1]
  ok = (draft == best[:, :k]) & (jnp.arange(k)[None, :] < n_draft[:, None])
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  return n_acc, jnp.take_along_axis(best, n_acc[:, None], axis=1)[:, 0]


def _match_samples(target_logits, draft, n_draft, s, first_position):
  """One-hot q: the target's own sample at every slot, accepted while it equals the draft."""
  b, k = draft.shape
  positions = first_position[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  x = sample(target_logits.reshape(b * (k + 1), -1), repeat_rows(s, k + 1),
             positions.reshape(-1)).reshape(b, k + 1)
  ok = (draft == x[:, :k]) & (jnp.arange(k)[None, :] < n_draft[:, None])
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  return n_acc, jnp.take_along_axis(x, n_acc[:, None], axis=1)[:, 0]


def _stochastic(target_logits, draft, draft_probs, n_draft, s, first_position):
  if draft_probs is None:
    return _match_samples(target_logits, draft, n_draft, s, first_position)
  b, k = draft.shape
  p = block_probs(target_logits, s)  # [B, K+1, V]
  positions = first_position[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  p_draft = jnp.take_along_axis(p[:, :k], draft[:, :, None], axis=-1)[..., 0]  # [B, K]
  q_all = draft_probs.astype(p.dtype)
  q_draft = jnp.take_along_axis(q_all, draft[:, :, None], axis=-1)[..., 0]
  u = jax.vmap(jax.vmap(jax.random.uniform))(position_keys(s.seed, positions[:, :k],
                                                           STREAM_ACCEPT))
  # u < p/q written without division (q_draft > 0 for any token the drafter could propose).
  ok = (u * q_draft < p_draft) & (jnp.arange(k)[None, :] < n_draft[:, None])
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

  # The extra token at slot n_acc: residual after a rejection, plain p_{n_acc} after a full run.
  p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q_all, jnp.zeros_like(q_all[:, :1])], axis=1)
  q_at = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
  rejected = n_acc < n_draft
  residual = jnp.where(rejected[:, None], jnp.maximum(p_at - q_at, 0.0), p_at)
  # p == q up to rounding can leave no residual mass; then p itself is the right fallback.
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_at)
  pos_at = jnp.take_along_axis(positions, n_acc[:, None], axis=1)[:, 0]
  keys = position_keys(s.seed, pos_at, STREAM_RESAMPLE)
  logs = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf)
  extra = jax.vmap(jax.random.categorical)(keys, logs).astype(jnp.int32)
  return n_acc, extra


def verify(target_logits: jax.Array, draft: jax.Array, draft_probs: jax.Array | None,
           n_draft: jax.Array, s: SamplingArrays, first_position: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
  """Accepts a prefix of each row's drafts and chooses the token that follows it.

  Args:
    target_logits: [B, K+1, V] float32; slot i is the distribution of the token at
      `first_position + i` (verifying d_{i+1}, or the bonus token at i = n_draft).
    draft: [B, K] int32 drafted tokens (entries at or past n_draft are ignored).
    draft_probs: [B, K, V] the drafter's (transformed) distributions the drafts were sampled
      from, or None for deterministic drafters (one-hot q).
    n_draft: [B] int32 in [0, K].
    s: [B] sampling parameters; temperature 0 rows use the greedy rule.
    first_position: [B] int32 position of d_1.
  Returns:
    (n_accepted [B] int32 in [0, n_draft], extra token [B] int32). The row emits
    draft[:n_accepted] followed by the extra token.
  """
  n_draft = n_draft.astype(jnp.int32)
  g_acc, g_tok = _greedy(target_logits, draft, n_draft)

  def mixed(_):
    s_acc, s_tok = _stochastic(target_logits, draft, draft_probs, n_draft, s, first_position)
    hot = s.temperature > 0
    return jnp.where(hot, s_acc, g_acc), jnp.where(hot, s_tok, g_tok)

  return jax.lax.cond(jnp.any(s.temperature > 0), mixed, lambda _: (g_acc, g_tok), None)


def draft_sample(logits: jax.Array, s: SamplingArrays, positions: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """A drafter's choice of the token at `positions` [B]: logits [B, V] -> (token [B], q [B, V]).

  Greedy rows take the argmax (their q is irrelevant: greedy verification ignores it); sampled
  rows sample their transformed distribution q from the drafting stream of (seed, position).
  """
  greedy = argmax(logits)

  def stochastic(_):
    q = sampling_probs(logits, s)
    keys = position_keys(s.seed, positions, STREAM_DRAFT)
    logs = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)), -jnp.inf)
    tok = jax.vmap(jax.random.categorical)(keys, logs).astype(jnp.int32)
    return jnp.where(s.temperature > 0, tok, greedy), q

  def plain(_):
    return greedy, jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)

  return jax.lax.cond(jnp.any(s.temperature > 0), stochastic, plain, None)
