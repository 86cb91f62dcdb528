"""Acceptance estimates per draft position, and whether an iteration drafts.

c_j = P(draft j accepted | drafts 1 .. j-1 were), g_j = c_1 ... c_j (`gains`): drafting k
tokens emits E[tau](k) = 1 + g_1 + ... + g_k (one rate for all positions would overrate deep
ones where acceptance falls with depth). The c_j come from decayed (accepted, ended) counts per
position (`position_evidence`, `decay_add`: a chain that matched m drafts, then ended, counts
accepted at 1 .. m and ended at m + 1); counts decay only where evidence arrives, and each
position's prior is the estimate one shallower (`conditional_acceptance`). `row_drafters`
picks "auto" rows' drafters; `plan` picks plain or the block of K + 1 by expected tokens per
unit of time (cost table). `xp`: numpy for the host's decisions.
"""

from __future__ import annotations

import jax.numpy as jnp

# The estimates' prior (acceptance 0.5, worth one observation) and forgetting (counts decay by
# 0.8 per update: ~5 observations of memory). Chosen, not tuned: with them the expected tokens
# are within 1-15% of those emitted, and a prior worth 4 at depth changed nothing (BENCHMARKS.md,
# "per-position acceptance, the model's calibration").
PRIOR_ACCEPT, PRIOR_WEIGHT, DECAY = 0.5, 1.0, 0.8
# Weight of a drafter's engine-wide estimate in a row's own estimate (in decayed observations):
# a new request starts from it and is its own after a few iterations. 0.5 to 4 moved "auto"'s
# tokens per forward by at most 1% on fresh, agent and mixed batches (`bench.spec_constants`).
ROW_PRIOR_WEIGHT = 2.0
_MAX_ACCEPT = 1.0 - 1e-6


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
  given: how acceptance changes with depth elsewhere, e.g. for the drafter engine-wide)."""
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


def row_gains(row_counts: jnp.ndarray, counts: jnp.ndarray, *, xp=jnp) -> jnp.ndarray:
  """[B, D, J] each row's gains per drafter from its own counts `row_counts` [B, D, J, 2],
  with the drafter's engine-wide estimate (`counts` [D, J, 2]) as a prior worth
  ROW_PRIOR_WEIGHT observations. Without evidence at a depth, a row's estimate follows its own
  shallower one scaled by the drafter's engine-wide change with depth."""
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
  """Each row's drafter for an iteration: an "auto" row (`row_auto` [B]) the one `allowed`
  [B, D] with the most E[tau](k) / (T + k c_d) (gain_rows [B, D, J], step_cost T(B, k),
  drafter_cost [D] c_d per drafted column), the others their own `row_drafter` [B] (0: off).
  Returns (ids [B] int32, gain [B, J], the sum of c_d over the drafters live rows use)."""
  n_ids = gain_rows.shape[1]
  score = expected_tokens(gain_rows, k, xp=xp) / (step_cost + k * drafter_cost)[None]
  best = xp.argmax(xp.where(allowed, score, -xp.inf), axis=1).astype(xp.int32)
  ids = xp.where(row_auto, best, row_drafter.astype(xp.int32))
  gain = xp.take_along_axis(gain_rows, ids[:, None, None], axis=1)[:, 0]  # [B, J]
  present = xp.any((ids[:, None] == xp.arange(n_ids)[None, :]) & live[:, None], axis=0)
  return ids, gain, xp.sum(xp.where(present, drafter_cost, xp.float32(0.0)))


def plan(gain: jnp.ndarray, drafting: jnp.ndarray, live: jnp.ndarray, room: jnp.ndarray,
         k: int, step_cost: jnp.ndarray, column_cost: jnp.ndarray, *, xp=jnp
         ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Whether an iteration verifies a block of k drafts: it emits sum over live rows of
  1 + g_1 + ... + g_min(k, room) (gain [B, J >= k]; rows `drafting` only) in T(B, k) + k
  column_cost, plain decoding one token per live row in T(B, 0) (step_cost [2]). Returns
  (block: bool, draft counts [B] int32)."""
  rows = xp.where(drafting, xp.minimum(room, k), 0).astype(xp.int32)
  taken = xp.arange(1, k + 1, dtype=xp.int32)[None, :] <= rows[:, None]
  gain = xp.clip(gain[:, :k].astype(xp.float32), 0.0, _MAX_ACCEPT)
  n_live = xp.sum(live).astype(xp.float32)
  tokens = n_live + xp.sum(xp.where(taken, gain, 0.0))
  block = tokens / (step_cost[1] + k * column_cost) > n_live / step_cost[0]
  return block, xp.where(block, rows, 0)
