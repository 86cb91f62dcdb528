"""Adaptive draft length: choose K per loop step from a goodput model (all on the device).

With per-position acceptance probability a (i.i.d.), a step drafting k tokens emits
E[tau](k) = (1 - a^(k+1)) / (1 - a) tokens per row. Its cost relative to a plain decode step is
modelled as T(B, k) = 1 + k * (draft_cost + verify_cost * B) for B live rows: `draft_cost` is
one drafted token's cost (MTP layer, draft model forward; ~0 for n-gram lookups) and
`verify_cost` one extra verified position per row (small while decoding is memory-bound, ~1/B
once the forward is compute-bound). The loop picks k* = argmax_k B E[tau](k) / T(B, k) over the
compiled choices (k = 0 is plain decoding) and estimates a from its own recent steps:
accepted / (accepted + rejections) with exponentially decayed counts and a weak prior, so a
drafter that stopped paying is retried once the evidence has decayed.
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



def choose_rows(a: jnp.ndarray, drafting: jnp.ndarray, live: jnp.ndarray,
                choices: tuple[int, ...], draft_cost: jnp.ndarray, verify_cost: jnp.ndarray
                ) -> jnp.ndarray:
  """Index into `choices` maximising sum_b E[tau_b](k) / T(B, k) over the live rows.

  a [B] each row's acceptance estimate; drafting [B] bool live rows with a drafter (the others
  emit one token whatever k is); live [B] bool. T(B, k) = 1 + k (draft_cost + verify_cost B).
  """
  ks = jnp.asarray(choices, jnp.float32)
  per_row = jnp.where(drafting[:, None], expected_tokens(a[:, None], ks[None, :]), 1.0)
  tokens = jnp.sum(jnp.where(live[:, None], per_row, 0.0), axis=0)
  rows = jnp.sum(live).astype(jnp.float32)
  cost = 1.0 + ks * (draft_cost + verify_cost * rows)
  return jnp.argmax(tokens / cost).astype(jnp.int32)
