"""Lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

* Greedy rows (temperature 0) accept while d_i is the target's argmax and emit the argmax after
  them: exactly non-speculative greedy.
* Sampled rows with the drafter's distributions q use speculative sampling: accept d_i with
  probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample normalize(max(0,
  p_i - q_i)), after a full run p_{n_draft} (p, q after the row's sampling transforms).
* Deterministic drafters (one-hot q) accept while d_i equals the target's own sample under the
  same (seed, position) key (`sampling.sample`): the output is plain sampling's, token for token.

Randomness for the token at position P comes from fold_in(key(seed), P) only, one stream per
use, so results depend neither on batch company nor on how many tokens were drafted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def prefix_length(ok: jax.Array, n: jax.Array) -> jax.Array:
  """[B] leading Trues of ok [B, K] within each row's first n [B]."""
  ok = ok & (jnp.arange(ok.shape[1])[None, :] < n[:, None])
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _match(x, draft, n_draft):
  """Accepts while the draft equals x [B, K+1] (the target's choice per slot); the extra token
  is x at the first mismatch."""
  n_acc = prefix_length(draft == x[:, :draft.shape[1]], n_draft)
  return n_acc, jnp.take_along_axis(x, n_acc[:, None], axis=1)[:, 0]


def _categorical(keys, probs):
  logs = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return jax.vmap(jax.random.categorical)(keys, logs).astype(jnp.int32)


def _stochastic(target_logits, draft, draft_probs, n_draft, s, first_position):
  b, k = draft.shape
  positions = first_position[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  if draft_probs is None:  # one-hot q: the target's own samples
    x = sample(target_logits.reshape(b * (k + 1), -1), repeat_rows(s, k + 1),
               positions.reshape(-1)).reshape(b, k + 1)
    return _match(x, draft, n_draft)
  p = block_probs(target_logits, s)  # [B, K+1, V]
  p_draft = jnp.take_along_axis(p[:, :k], draft[:, :, None], axis=-1)[..., 0]  # [B, K]
  q_all = draft_probs.astype(p.dtype)
  q_draft = jnp.take_along_axis(q_all, draft[:, :, None], axis=-1)[..., 0]
  u = jax.vmap(jax.vmap(jax.random.uniform))(position_keys(s.seed, positions[:, :k],
                                                           STREAM_ACCEPT))
  # u < p/q written without division (q_draft > 0 for any token the drafter could propose).
  n_acc = prefix_length(u * q_draft < p_draft, n_draft)
  # The extra token at slot n_acc: residual after a rejection, plain p_{n_acc} after a full run.
  p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q_all, jnp.zeros_like(q_all[:, :1])], axis=1)
  q_at = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
  residual = jnp.where((n_acc < n_draft)[:, None], jnp.maximum(p_at - q_at, 0.0), p_at)
  # p == q up to rounding can leave no residual mass; then p itself is the right fallback.
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_at)
  pos_at = jnp.take_along_axis(positions, n_acc[:, None], axis=1)[:, 0]
  return n_acc, _categorical(position_keys(s.seed, pos_at, STREAM_RESAMPLE), residual)


def verify(target_logits: jax.Array, draft: jax.Array, draft_probs: jax.Array | None,
           n_draft: jax.Array, s: SamplingArrays, first_position: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
  """Accepts a prefix of each row's drafts [B, K] (the first n_draft [B]) and chooses the
  token after it (see the module docstring). target_logits [B, K+1, V]: slot i for the token at
  first_position [B] + i; draft_probs [B, K, V] the drafter's q, or None (one-hot). Returns
  (n_accepted [B] int32, extra token [B] int32): the row emits draft[:n_accepted], extra."""
  n_draft = n_draft.astype(jnp.int32)
  g_acc, g_tok = _match(argmax(target_logits), draft, n_draft)

  def mixed(_):
    s_acc, s_tok = _stochastic(target_logits, draft, draft_probs, n_draft, s, first_position)
    hot = s.temperature > 0
    return jnp.where(hot, s_acc, g_acc), jnp.where(hot, s_tok, g_tok)

  return jax.lax.cond(jnp.any(s.temperature > 0), mixed, lambda _: (g_acc, g_tok), None)


def draft_sample(logits: jax.Array, s: SamplingArrays, positions: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """A drafter's choice of the token at `positions` [B]: logits [B, V] -> (token [B], q [B, V]):
  the argmax in greedy rows (whose q verification ignores), else a sample of the transformed q
  from the drafting stream of (seed, position). With temperatures known to be 0 while tracing
  (host arrays: top-1 drafts, `speculative/constrained.py`) only the argmax is traced."""
  greedy = argmax(logits)
  if isinstance(s.temperature, np.ndarray) and not np.any(s.temperature > 0):
    return greedy, jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)

  def stochastic(_):
    q = sampling_probs(logits, s)
    tok = _categorical(position_keys(s.seed, positions, STREAM_DRAFT), q)
    return jnp.where(s.temperature > 0, tok, greedy), q

  def plain(_):
    return greedy, jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)

  return jax.lax.cond(jnp.any(s.temperature > 0), stochastic, plain, None)
