"""Adaptive draft length: choose K per loop step from a goodput model (all on the device).

With per-position acceptance probability a (i.i.d.), a step drafting k tokens emits
E[tau](k) = (1 - a^(k+1)) / (1 - a) tokens per row. The fixed-batch loop (`loop.py`) models a
step's cost relative to a plain decode step as T(B, k) = 1 + k (draft_cost + verify_cost B) and
picks k* = argmax_k B E[tau](k) / T(B, k) over the compiled choices (k = 0 is plain decoding)
(`choose`). The serving loop sizes the block and every row's drafts together (`plan`), with
each row's own estimate (`row_estimates`). Estimates come from the loop's own recent steps:
accepted / (accepted + ended) with exponentially decayed counts and a weak prior, so a drafter
that stopped paying is retried once the evidence has decayed.
"""

from __future__ import annotations

import jax.numpy as jnp

PRIOR_ACCEPT, PRIOR_WEIGHT, DECAY = 0.5, 1.0, 0.8


def k_choices(k_max: int, allow_zero: bool = True) -> tuple[int, ...]:
  """Compiled draft lengths: 0 (when allowed), powers of two below k_max, and k_max."""
  ks = {k_max} | {1 << i for i in range(k_max.bit_length()) if 1 << i < k_max}
  return tuple(sorted(ks | ({0} if allow_zero else set())))


def expected_tokens(a: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
  """E[tau](k) = 1 + a + ... + a^k (tokens per row per step)."""
  a = jnp.clip(a, 0.0, 1.0 - 1e-6)
  return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_estimate(accepted: jnp.ndarray, rejected: jnp.ndarray) -> jnp.ndarray:
  return (accepted + PRIOR_ACCEPT * PRIOR_WEIGHT) / (accepted + rejected + PRIOR_WEIGHT)


def choose(a: jnp.ndarray, live_rows: jnp.ndarray, choices: tuple[int, ...], draft_cost: float,
           verify_cost: float) -> jnp.ndarray:
  """Index into `choices` of the k maximising tokens per unit of step time."""
  ks = jnp.asarray(choices, jnp.float32)
  cost = 1.0 + ks * (draft_cost + verify_cost * live_rows.astype(jnp.float32))
  return jnp.argmax(expected_tokens(a, ks) / cost).astype(jnp.int32)


# Weight of a drafter's engine-wide estimate in a row's own estimate (in decayed observations).
ROW_PRIOR_WEIGHT = 2.0


def row_estimates(row_counts: jnp.ndarray, counts: jnp.ndarray) -> jnp.ndarray:
  """[B, D] each row's acceptance estimate per drafter: its own decayed (accepted, ended)
  counts `row_counts` [B, D, 2], with the drafter's engine-wide estimate (`counts` [D, 2]) as a
  prior worth ROW_PRIOR_WEIGHT observations: a new request starts from what the drafter does
  for everyone and moves to what it does for this request."""
  g = acceptance_estimate(counts[:, 0], counts[:, 1])[None, :]
  acc, ended = row_counts[..., 0], row_counts[..., 1]
  return (acc + ROW_PRIOR_WEIGHT * g) / (acc + ended + ROW_PRIOR_WEIGHT)


def plan(a: jnp.ndarray, drafting: jnp.ndarray, live: jnp.ndarray, room: jnp.ndarray,
         choices: tuple[int, ...], block_cost: jnp.ndarray, token_cost: jnp.ndarray,
         overhead: jnp.ndarray | float = 0.0, refinements: int = 2
         ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The iteration's block width K (index into `choices`) and each row's draft count k_b <= K.

  a [B]: each row's acceptance estimate for its drafter; drafting [B] bool: live rows with a
  drafter (the others emit one token whatever K is); live [B] bool; room [B] int32: the most
  drafts a row may verify (its budget, its request's cap). Step time, relative to a plain
  decode step:  T = 1 + [K > 0] overhead + K block_cost + token_cost sum_b k_b.  `overhead`
  is what a speculative iteration costs beyond a plain one before it verifies anything (its
  bookkeeping; K = 0 is priced as plain decoding, which the engine falls back to after a call
  that drafted nothing). `block_cost` is paid per column
  of the [B, K + 1] verify block whatever rows put in it (drafter forwards, dense layers over
  padding); `token_cost` per real drafted token (a padded position routes to no expert, so a
  real one streams more expert weights). Row b's j-th draft adds a_b^j expected tokens at
  cost token_cost, so at rate R it pays iff a_b^j >= token_cost R: rows that rarely accept
  draft fewer tokens, and with token_cost = 0 every drafting row fills the block. R is found
  by a few fixed-point steps (Dinkelbach) per K; K maximises R.
  """
  ks = jnp.asarray(choices, jnp.int32)  # [C]
  j = jnp.arange(1, max(choices) + 1, dtype=jnp.int32)  # [J]
  a = jnp.clip(a, 0.0, 1.0 - 1e-6)
  gain = a[:, None] ** j[None, :].astype(jnp.float32)  # [B, J] P(first j drafts accepted)
  room = jnp.where(drafting, room, 0)
  allowed = (j[None, None, :] <= ks[:, None, None]) & (j[None, None, :] <= room[None, :, None])
  emitted = jnp.sum(live).astype(jnp.float32)  # one token per live row at least

  def rate(take):  # [C, B, J] -> [C]
    tokens = emitted + jnp.sum(jnp.where(take, gain[None], 0.0), axis=(1, 2))
    drafted = jnp.sum(take, axis=(1, 2)).astype(jnp.float32)
    return tokens / (1.0 + jnp.where(ks > 0, overhead, 0.0)
                     + ks.astype(jnp.float32) * block_cost + token_cost * drafted)

  take = allowed
  for _ in range(refinements):
    take = allowed & (gain[None] >= token_cost * rate(take)[:, None, None])
  index = jnp.argmax(rate(take)).astype(jnp.int32)
  return index, jnp.sum(take[index], axis=-1).astype(jnp.int32)
