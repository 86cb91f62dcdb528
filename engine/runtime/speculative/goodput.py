"""Adaptive draft length: choose K per loop step from a goodput model (all on the device).

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

The fixed-batch loop (`loop.py`) picks the k that finishes its batch soonest,
argmin_k T(k) max_b remaining_b / E_b[tau](k), over the compiled choices (k = 0 is plain
decoding) (`choose`), with each row's own gains and T(k) an iteration's time at each choice:
measured on the loop itself (`probes.loop_costs`) or T = 1 + k (draft_cost + verify_cost B)
(`step_costs`). The serving loop sizes the
block and every row's drafts together (`plan`), with each row's own gains (`row_gains`).
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


def row_drafters(gain_rows: jnp.ndarray, costs: jnp.ndarray, allowed: jnp.ndarray,
                 row_auto: jnp.ndarray, row_drafter: jnp.ndarray, live: jnp.ndarray, k: int,
                 *, xp=jnp) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """Each row's drafter for an iteration, its gains, and the block's cost per column.

  gain_rows [B, D, J]: every row's gains per drafter (`row_gains`); costs [D + 4]: the
  serving cost model (`plan`'s terms: per-drafter column costs, then overhead, base, per row,
  per token); allowed [B, D] bool: drafters an "auto" row (`row_auto` [B] bool) may take;
  row_drafter [B] int32: the others' own (0: off); live [B] bool. An "auto" row takes the
  allowed drafter with the most expected tokens per unit of step time at the widest block,
  E[tau](k) / (1 + k (base + c_d)) (a model drafter's cost as if the row alone paid for it).
  The block's cost per column is the base, the per-row cost over live rows, and the column
  cost of every drafter a live row uses. Returns (ids [B] int32, gain [B, J], block_cost).
  The serving loop runs this every iteration; the host runs it in numpy (`xp`) to predict a
  call's first iteration (`call_policy`)."""
  n_ids = gain_rows.shape[1]
  score = expected_tokens(gain_rows, k, xp=xp) / (1.0 + k * (costs[-3] + costs[:n_ids]))[None]
  best = xp.argmax(xp.where(allowed, score, -xp.inf), axis=1).astype(xp.int32)
  ids = xp.where(row_auto, best, row_drafter.astype(xp.int32))
  gain = xp.take_along_axis(gain_rows, ids[:, None, None], axis=1)[:, 0]  # [B, J]
  present = xp.any((ids[:, None] == xp.arange(n_ids)[None, :]) & live[:, None], axis=0)
  rows = xp.sum(live).astype(xp.float32)
  block_cost = (costs[-3] + costs[-2] * rows
                + xp.sum(xp.where(present, costs[:n_ids], xp.float32(0.0))))
  return ids, gain, block_cost


def step_costs(choices: tuple[int, ...], batch: int, draft_cost: float = 0.0,
               verify_cost: float = 0.02) -> jnp.ndarray:
  """[C] T(B, k) = 1 + k (draft_cost + verify_cost B) per choice: a step's time relative to a
  plain decode step, from a drafted token's cost and a verified position's per row."""
  ks = jnp.asarray(choices, jnp.float32)
  return 1.0 + ks * (draft_cost + verify_cost * batch)


def choose(gain: jnp.ndarray, costs: jnp.ndarray, choices: tuple[int, ...],
           remaining: jnp.ndarray) -> jnp.ndarray:
  """Index into `choices` of the k that finishes a fixed batch soonest: gain [B, J] each row's
  gains (`gains`), costs [C] each choice's step time (any common unit; the batch's shape is
  fixed, so a step costs the same whichever rows are live), remaining [B] tokens each row
  still has to emit (0: done). The batch takes as many steps as its slowest row needs,
  remaining_b / E_b[tau](k), so k minimises T(k) max_b remaining_b / E_b[tau](k): drafts
  that only speed up rows which finish early anyway do not pay, and a batch whose slowest
  row accepts nothing decodes plainly. (With equal rows this is the most tokens per unit of
  step time.)"""
  return jnp.argmin(finish_times(gain, costs, choices, remaining)).astype(jnp.int32)


def finish_times(gain: jnp.ndarray, costs: jnp.ndarray, choices: tuple[int, ...],
                 remaining: jnp.ndarray) -> jnp.ndarray:
  """[C] T(k) max_b remaining_b / E_b[tau](k): the time the batch needs at each choice (see
  `choose`)."""
  tokens = jnp.stack([expected_tokens(gain, k) for k in choices])  # [C, B]
  steps = jnp.max(remaining.astype(jnp.float32)[None, :] / tokens, axis=1)
  return costs * steps


def plain_wins(gain: jnp.ndarray, costs: jnp.ndarray, choices: tuple[int, ...],
               remaining: jnp.ndarray, plain_cost: jnp.ndarray, margin: float) -> jnp.ndarray:
  """Whether plain decoding (an iteration costing `plain_cost`, without the drafter's upkeep,
  one token per row) would finish the batch at least `margin` (a fraction) sooner than the best
  choice: a bool scalar. Same arguments as `choose`."""
  best = jnp.min(finish_times(gain, costs, choices, remaining))
  plain = plain_cost * jnp.max(remaining).astype(jnp.float32)
  return plain < (1.0 - margin) * best


def plan(gain: jnp.ndarray, drafting: jnp.ndarray, live: jnp.ndarray, room: jnp.ndarray,
         choices: tuple[int, ...], block_cost: jnp.ndarray, token_cost: jnp.ndarray,
         overhead: jnp.ndarray | float = 0.0, refinements: int = 2, *, xp=jnp
         ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
  """The iteration's block width K (index into `choices`), each row's draft count k_b <= K,
  and the rate R at that plan (expected tokens per unit of step time; `rows` at plain decoding).

  gain [B, J >= max(choices)]: each row's gains for its drafter (`gains`); drafting [B] bool:
  live rows with a drafter (the others emit one token whatever K is); live [B] bool; room [B]
  int32: the most drafts a row may verify (its budget, its request's cap). Step time, relative
  to a plain decode step:  T = 1 + [K > 0] overhead + K block_cost + token_cost sum_b k_b.
  `overhead` is what a speculative iteration costs beyond a plain one before it verifies
  anything (its bookkeeping; K = 0 is priced as plain decoding, which the engine falls back to
  after a call that drafted nothing). `block_cost` is paid per column of the [B, K + 1] verify
  block whatever rows put in it (drafter forwards, dense layers over padding); `token_cost`
  per real drafted token (a padded position routes to no expert, so a real one streams more
  expert weights). Row b's j-th draft adds g_bj expected tokens at cost token_cost, so at rate
  R it pays iff g_bj >= token_cost R: rows that rarely accept draft fewer tokens, and with
  token_cost = 0 every drafting row fills the block. R is found by a few fixed-point steps
  (Dinkelbach) per K; K maximises R. (Gains fall with j, so the drafts taken are a prefix.)
  `xp`: the array module (numpy for the engine's host-side per-call decision, `call_policy`).
  """
  ks = xp.asarray(choices, xp.int32)  # [C]
  k_max = max(choices)
  j = xp.arange(1, k_max + 1, dtype=xp.int32)  # [J]
  gain = xp.clip(gain[:, :k_max].astype(xp.float32), 0.0, _MAX_ACCEPT)  # [B, J]
  room = xp.where(drafting, room, 0)
  allowed = (j[None, None, :] <= ks[:, None, None]) & (j[None, None, :] <= room[None, :, None])
  emitted = xp.sum(live).astype(xp.float32)  # one token per live row at least

  def rate(take):  # [C, B, J] -> [C]
    tokens = emitted + xp.sum(xp.where(take, gain[None], 0.0), axis=(1, 2))
    drafted = xp.sum(take, axis=(1, 2)).astype(xp.float32)
    return tokens / (1.0 + xp.where(ks > 0, overhead, 0.0)
                     + ks.astype(xp.float32) * block_cost + token_cost * drafted)

  take = allowed
  for _ in range(refinements):
    take = allowed & (gain[None] >= token_cost * rate(take)[:, None, None])
  rates = rate(take)
  index = xp.argmax(rates).astype(xp.int32)
  return index, xp.sum(take[index], axis=-1).astype(xp.int32), rates[index]
