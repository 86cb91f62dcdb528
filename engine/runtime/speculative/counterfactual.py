"""What a drafter would have achieved on tokens it did not draft: acceptance evidence for free.

* `matched`: a proposal against the tokens a row emitted (the speculative loop checks every
  drafter that proposed, not only the one it used, so "auto" rows compare drafters at no cost).
* `plain_call_evidence`: the same for a plain decode-loop call (the serving engine resting,
  `SpecRuntime.speculates`): each deterministic drafter (ngram, learned) is replayed over the
  call's tokens as if it had drafted K per step: from the token the call started after, it
  proposes K, the tokens that followed confirm a prefix of m, the next step starts m + 1
  further on (as a speculative loop at k = K would have advanced). Deterministic drafters are
  verified against the target's own samples (the same (seed, position) keys), so the tokens a
  plain call emitted are exactly what a speculative one would have, sampled rows too.
  One program: every position's chain at once (the proposals, vectorized over positions),
  then a loop of cheap steps that walks each row's chains and folds their evidence into the
  counts in order, as the loop folds its own (`goodput.decay_add`). (Proposing inside that
  loop cost ~1.2 ms per call on the CPU demo, 10% of the plain call it followed.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.runtime.speculative import drafters as dr, goodput, learned


def matched(proposal: jax.Array, n_proposed: jax.Array, emitted: jax.Array, n_emit: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """What a drafter's proposal [B, P] (first n_proposed real) would have achieved against the
  tokens the row emitted [B, >= P] (first n_emit real): (leading matches [B], ended [B] bool:
  a mismatch or no proposal before the horizon min(P, n_emit); else censored)."""
  p = proposal.shape[1]
  slots = jnp.arange(p, dtype=jnp.int32)[None, :]
  same = (proposal == emitted[:, :p]) & (slots < jnp.minimum(n_proposed, n_emit)[:, None])
  m = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1)
  return m, m < jnp.minimum(p, n_emit)


def _chains(history: jax.Array, newest: jax.Array, end: jax.Array,
            table: learned.NgramTable | None, k: int, replayed: tuple[str, ...], steps: int
            ) -> tuple[jax.Array, jax.Array]:
  """(matched [R, B, steps], ended [R, B, steps]): each replayed drafter's K-token chain drafted
  at position newest + s, against the tokens after it (`matched`)."""
  b, length = history.shape
  at = (newest[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]).reshape(-1)  # [B*S]
  rows = jnp.repeat(history, steps, axis=0)  # [B*S, L]
  left = jnp.repeat(end, steps) - at
  actual = jnp.take_along_axis(
      rows, jnp.minimum(at[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :], length - 1),
      axis=1)
  out_m, out_end = [], []
  for name in replayed:
    draft, n = (dr.ngram_propose(rows, at, k) if name == "ngram"
                else learned.propose(table, rows, at, k))
    m, ended = matched(draft, n, actual, left)
    out_m.append(m.reshape(b, steps))
    out_end.append(ended.reshape(b, steps))
  return jnp.stack(out_m), jnp.stack(out_end)


@functools.partial(jax.jit, static_argnames=("k", "replayed", "steps"))
def plain_call_evidence(history: jax.Array, newest: jax.Array, end: jax.Array,
                        rows: jax.Array, table: learned.NgramTable | None,
                        row_accept: jax.Array, accept: jax.Array, *, k: int,
                        replayed: tuple[tuple[str, int], ...], steps: int
                        ) -> tuple[jax.Array, jax.Array]:
  """Folds a plain call's counterfactual evidence into the acceptance counts.

  Args:
    history: [B, L] each row's recent tokens, then the call's new ones; newest: [B] index of
      the token the call started after (fed at its first step); end: [B] index of its last
      new token (= newest where it emitted nothing).
    rows: [B] bool rows whose drafter uses the estimates (the others learn nothing).
    table: the learned drafter's table as it was before the call learned its tokens.
    row_accept: [B, D, K, 2] per-row counts; accept: [D, K, 2] engine-wide (`serving`).
    replayed: (drafter name, index into D) of the deterministic drafters to replay.
    steps: the call's most new tokens (a bound on the replayed steps).
  Returns:
    (row_accept, accept), updated.
  """
  m_all, ended_all = _chains(history, newest, end, table, k, tuple(n for n, _ in replayed),
                             steps)

  def step(_, carry):  # one replayed step of every row: cheap, the chains are known
    pos, row_accept, accept = carry  # pos [R, B]: each drafter's offset into the call
    new_pos = []
    for r, (_, d) in enumerate(replayed):
      at = jnp.minimum(pos[r], steps - 1)[:, None]
      m = jnp.take_along_axis(m_all[r], at, axis=1)[:, 0]
      ended = jnp.take_along_axis(ended_all[r], at, axis=1)[:, 0]
      ev = goodput.position_evidence(m, ended, k, rows & (newest + pos[r] < end))
      row_accept = row_accept.at[:, d].set(goodput.decay_add(row_accept[:, d], ev))
      accept = accept.at[d].set(goodput.decay_add(accept[d], jnp.sum(ev, axis=0)))
      new_pos.append(pos[r] + m + 1)
    return jnp.stack(new_pos), row_accept, accept

  pos = jnp.zeros((len(replayed),) + newest.shape, jnp.int32)
  _, row_accept, accept = jax.lax.fori_loop(0, steps, step, (pos, row_accept, accept))
  return row_accept, accept
