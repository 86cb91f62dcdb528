"""Adaptive draft length: acceptance estimates per draft position, and the block width they buy.

Acceptance is measured per draft position: c_j = P(draft j accepted | drafts 1 .. j-1 were),
so a step drafting k tokens emits E[tau](k) = 1 + sum_{j <= k} g_j tokens per row, with
g_j = c_1 ... c_j the chance that the first j drafts are all accepted (`gains`). (A single
acceptance rate a for every position, g_j = a^j, overrates deep positions when acceptance falls
with depth, e.g. a prompt-lookup match that runs out, and underrates them in a long copy.)

The estimates come from the loop's own recent steps as decayed (accepted, ended) counts per
position (`position_evidence`, `decay_add`): a chain that matched m drafts and then ended
(a rejection, or no proposal) counts as accepted at positions 1 .. m and ended at m + 1;
positions past a chain's horizon learn nothing (censored). Counts decay only where new
evidence arrives, so what was learned about deep positions survives iterations that draft
nothing. Each position's estimate has a weak prior: the estimate one position shallower
(`conditional_acceptance`), so where deep evidence is missing the model is the geometric
one, and a drafter that stopped paying is retried once its evidence has decayed.

Each loop iteration (`plan`) takes the block width k among the compiled choices with the most
expected tokens per unit of time, (sum_b E_b[tau](min(k, room_b))) / T(B, k), T from the cost
table (`costs.py`); an "auto" row first takes its drafter (`row_drafters`).
"""

from __future__ import annotations

import jax.numpy as jnp

PRIOR_ACCEPT, PRIOR_WEIGHT, DECAY = 0.5, 1.0, 0.8
# Weight of a drafter's engine-wide estimate in a row's own estimate (in decayed observations).
ROW_PRIOR_WEIGHT = 2.0
_MAX_ACCEPT = 1.0 - 1e-6


def k_choices(k_max: int, allow_zero: bool = True) -> tuple[int, ...]:
  """Compiled draft lengths: 0 (when allowed), powers of two below k_max, and k_max."""
  ks = {k_max} | {1 << i for i in range(k_max.bit_length()) if 1 << i < k_max}
  return tuple(sorted(ks | ({0} if allow_zero else set())))


def position_evidence(matched: jnp.ndarray, ended: jnp.ndarray, depth: int,
                      weight: jnp.ndarray | None = None) -> jnp.ndarray:
  """[..., depth, 2] float32 (accepted, ended) at draft positions 1 .. depth of chains whose
  first `matched` [...] drafts were accepted and which `ended` [...] bool at matched + 1 (else
  censored there); scaled by `weight` [...] (e.g. 0 for rows that did not take part)."""
  j = jnp.arange(1, depth + 1, dtype=jnp.int32)
  m = matched.astype(jnp.int32)[..., None]
  acc = j <= m
  end = (j == m + 1) & ended[..., None]
  ev = jnp.stack([acc, end], axis=-1).astype(jnp.float32)
  return ev if weight is None else ev * weight[..., None, None].astype(jnp.float32)


def decay_add(counts: jnp.ndarray, evidence: jnp.ndarray) -> jnp.ndarray:
  """Decayed counts [..., J, 2] plus new evidence of the same shape: a position's counts decay
  by DECAY when it gets evidence (one observation's worth of forgetting per update)."""
  seen = jnp.sum(evidence, axis=-1, keepdims=True) > 0
  return jnp.where(seen, DECAY * counts, counts) + evidence


def conditional_acceptance(counts: jnp.ndarray, first_prior: jnp.ndarray | float,
                           weight: float, depth_ratio: jnp.ndarray | None = None, *,
                           xp=jnp) -> jnp.ndarray:
  """[..., J] c_j from decayed (accepted, ended) counts [..., J, 2], each with a prior worth
  `weight` observations: `first_prior` at j = 1, then c_{j-1} (times depth_ratio[..., j] when
  given: how acceptance changes with depth elsewhere, e.g. for the drafter engine-wide).

  `xp`: the array module; the engine's host-side decisions and statistics pass numpy (these
  few small ops, dispatched eagerly one by one, cost ~1 ms per call through jax)."""
  acc, end = counts[..., 0], counts[..., 1]
  prior = xp.broadcast_to(xp.asarray(first_prior, xp.float32), acc.shape[:-1])
  out = []
  for j in range(acc.shape[-1]):
    if j:
      prior = out[-1] if depth_ratio is None else xp.clip(out[-1] * depth_ratio[..., j], 0.0,
                                                          _MAX_ACCEPT)
    out.append((acc[..., j] + weight * prior) / (acc[..., j] + end[..., j] + weight))
  return xp.stack(out, axis=-1)


def gains(c: jnp.ndarray, *, xp=jnp) -> jnp.ndarray:
  """[..., J] g_j = c_1 ... c_j: the chance that drafts 1 .. j are all accepted."""
  return xp.cumprod(xp.clip(c, 0.0, _MAX_ACCEPT), axis=-1)


def drafter_gains(counts: jnp.ndarray, *, xp=jnp) -> jnp.ndarray:
  """[..., J] gains from engine-wide counts [..., J, 2] (prior PRIOR_ACCEPT)."""
  return gains(conditional_acceptance(counts, PRIOR_ACCEPT, PRIOR_WEIGHT, xp=xp), xp=xp)


def row_gains(row_counts: jnp.ndarray, counts: jnp.ndarray, *, xp=jnp) -> jnp.ndarray:
  """[B, D, J] each row's gains per drafter from its own decayed counts `row_counts`
  [B, D, J, 2], with the drafter's engine-wide estimate (`counts` [D, J, 2]) as a prior worth
  ROW_PRIOR_WEIGHT observations: a new request starts from what the drafter does for
  everyone and moves to what it does for this request. Where the row has no evidence at a
  depth, its estimate follows the row's own shallower one scaled by the drafter's engine-wide
  change with depth (a request that accepts more than most at position 1 is expected to keep
  doing so)."""
  g = conditional_acceptance(counts, PRIOR_ACCEPT, PRIOR_WEIGHT, xp=xp)  # [D, J]
  ratio = g / xp.concatenate([g[:, :1], g[:, :-1]], axis=1)  # c_j / c_{j-1} (1 at j = 1)
  c = conditional_acceptance(row_counts, g[None, :, 0], ROW_PRIOR_WEIGHT, ratio[None], xp=xp)
  return gains(c, xp=xp)


def expected_tokens(gain: jnp.ndarray, k: int, *, xp=jnp) -> jnp.ndarray:
  """E[tau](k) = 1 + g_1 + ... + g_k (tokens per row per step) from gains [..., J]."""
  return 1.0 + xp.sum(gain[..., :k], axis=-1)


def row_drafters(gain_rows: jnp.ndarray, step_cost: jnp.ndarray, drafter_cost: jnp.ndarray,
                 allowed: jnp.ndarray, row_auto: jnp.ndarray, row_drafter: jnp.ndarray,
                 live: jnp.ndarray, k: int, *, xp=jnp
                 ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Each row's drafter for an iteration, its gains, and the model drafters' cost per column.

  gain_rows [B, D, J]: every row's gains per drafter (`row_gains`); step_cost: T(B, k) at the
  widest block k; drafter_cost [D]: each drafter's cost per drafted column; allowed [B, D]
  bool: what an "auto" row (`row_auto` [B]) may take; row_drafter [B] int32: the others' own
  (0: off). An "auto" row takes the allowed drafter with the most expected tokens per unit of
  time at the widest block, E[tau](k) / (T + k c_d). Returns (ids [B] int32, gain [B, J],
  column cost: the sum of c_d over the drafters live rows use). `xp`: numpy on the host."""
  n_ids = gain_rows.shape[1]
  score = expected_tokens(gain_rows, k, xp=xp) / (step_cost + k * drafter_cost)[None]
  best = xp.argmax(xp.where(allowed, score, -xp.inf), axis=1).astype(xp.int32)
  ids = xp.where(row_auto, best, row_drafter.astype(xp.int32))
  gain = xp.take_along_axis(gain_rows, ids[:, None, None], axis=1)[:, 0]  # [B, J]
  present = xp.any((ids[:, None] == xp.arange(n_ids)[None, :]) & live[:, None], axis=0)
  return ids, gain, xp.sum(xp.where(present, drafter_cost, xp.float32(0.0)))


def plan(gain: jnp.ndarray, drafting: jnp.ndarray, live: jnp.ndarray, room: jnp.ndarray,
         choices: tuple[int, ...], step_cost: jnp.ndarray, column_cost: jnp.ndarray, *,
         xp=jnp) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """The iteration's block width (index into `choices`), each row's draft count, its time.

  gain [B, J >= max(choices)]: each row's gains for its drafter; drafting [B] bool: live rows
  with a drafter (the others emit one token whatever the width); live [B] bool; room [B]: the
  most drafts a row may verify; step_cost [C]: T(B, k) per choice; column_cost: the model
  drafters' cost per column. Width k emits sum_b (1 + g_b1 + ... + g_b,min(k, room_b)) in
  T(B, k) + k column_cost; the width with the most tokens per unit of time wins, and every
  drafting row drafts min(k, room_b) (the block's cost does not depend on what fills it).
  Returns (index, draft counts [B] int32, the iteration's time)."""
  ks = xp.asarray(choices, xp.int32)
  k_max = max(choices)
  j = xp.arange(1, k_max + 1, dtype=xp.int32)
  gain = xp.clip(gain[:, :k_max].astype(xp.float32), 0.0, _MAX_ACCEPT)
  room = xp.where(drafting, room, 0)
  rows = xp.minimum(ks[:, None], room[None, :])  # [C, B]
  taken = j[None, None, :] <= rows[:, :, None]
  tokens = xp.sum(live).astype(xp.float32) + xp.sum(xp.where(taken, gain[None], 0.0),
                                                     axis=(1, 2))
  cost = step_cost + ks.astype(xp.float32) * column_cost
  index = xp.argmax(tokens / cost).astype(xp.int32)
  return index, rows[index].astype(xp.int32), cost[index]
