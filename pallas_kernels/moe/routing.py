"""MoE routing from elementwise ops and reductions only (no sort, no top-k primitive).

Same contract and results as `reference.route` (noaux_tc sigmoid + e_score_correction_bias +
group-limited top-k, softmax greedy and group_limited_greedy, normalisation,
routed_scaling_factor), including order: experts come out best first, ties broken by the lower
expert id, as `lax.top_k` does.

Formulation: top-k by rank. Each expert's rank in its row is a reduction of elementwise
compares, rank_i = #{j: s_j > s_i} + #{j < i: s_j == s_i}; the k picks (ids and weights) are a
second reduction, `rank == r`. Group selection is the same over n_group values. Nothing depends
on k sequentially, so the chain of dependent reductions is fixed: Kimi-K2.5 (n_group 1) is
score -> rank -> pick -> normalise, DeepSeek-V3 adds top-2 per group and the group rank. Each
reduction's elementwise producers (sigmoid, bias, group mask) are recomputed inside it, which
is what XLA's GPU input fusion does; the [T, E, E] compares are never stored.

Evidence and its limits: the CUDA export of this function has 8 `stablehlo.reduce` and no
`sort`/`chlo.top_k` (the reference has 3 sorts and 9 top_k for DeepSeek-V3 shapes). This machine
has no CUDA backend, so the *optimized* GPU HLO (the fusion decisions) cannot be produced here:
"a handful of reduction fusions, independent of k" is an argument, not a measurement. The cost
is T * E^2 compares (E = 384: 150 K per token), trivial for decode where kernel launches
dominate, but ~1.2 G compares at T = 8192; so above RANK_MAX_TOKENS tokens this delegates to
the reference (`lax.top_k`, XLA's sort-based/TopK kernels), which returns identical results.
A Mosaic GPU routing kernel was not written: routing reads T * E * 4 bytes, negligible beside
the experts, and Mosaic GPU offers no top-k or index-tracking row reductions.

Shapes: router_logits [T, E] float32; correction_bias [E] float32 or None.
Returns (weights [T, k] float32, expert_ids [T, k] int32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe import reference

RANK_MAX_TOKENS = 64


def _rank_desc(values: jax.Array) -> jax.Array:
  """Position of each entry in a descending sort along the last axis, ties to the lower index.

  rank_i = #{j: v_j > v_i} + #{j < i: v_j == v_i}: a reduction over j of elementwise compares,
  so the [..., n, n] comparison is never stored, and ranks are distinct for non-NaN inputs.
  """
  n = values.shape[-1]
  vi, vj = values[..., :, None], values[..., None, :]
  i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
  beats = (vj > vi) | ((vj == vi) & (j < i))
  return jnp.sum(beats.astype(jnp.int32), axis=-1)


def _top_k_by_rank(values: jax.Array, k: int, *also: jax.Array):
  """(values, indices, *also's values at those indices) of the k largest along the last axis,
  best first, ties to the lower index: exactly `lax.top_k`'s choice for non-NaN inputs."""
  n = values.shape[-1]
  rank = _rank_desc(values)
  pick = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, n]
  iota = jax.lax.broadcasted_iota(jnp.int32, pick.shape, pick.ndim - 1)
  ids = jnp.min(jnp.where(pick, iota, n), axis=-1)
  # Selects, not products: -inf entries must not turn into NaN.
  picked = [jnp.max(jnp.where(pick, a[..., None, :], -jnp.inf), axis=-1)
            for a in (values, *also)]
  return picked[0], ids, *picked[1:]


def _keep_top_groups(grouped: jax.Array, group_scores: jax.Array, topk_group: int,
                     fill: float) -> jax.Array:
  """grouped [T, G, E/G]: experts outside the best topk_group groups replaced by fill."""
  keep = _rank_desc(group_scores) < topk_group  # [T, G]
  return jnp.where(keep[:, :, None], grouped, fill)


def route(router_logits: jax.Array, correction_bias: jax.Array | None, *, scoring_func: str,
          topk_method: str, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
          routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
  """Chooses experts per token; see `reference.route` for the rules."""
  logits = router_logits.astype(jnp.float32)
  t, e = logits.shape
  if t > RANK_MAX_TOKENS:
    return reference.route(logits, correction_bias, scoring_func=scoring_func,
                           topk_method=topk_method, top_k=top_k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor)
  scores = jax.nn.sigmoid(logits) if scoring_func == "sigmoid" else jax.nn.softmax(logits, -1)

  if topk_method == "noaux_tc":
    choice = scores if correction_bias is None else scores + correction_bias[None, :]
    if n_group > 1:
      grouped = choice.reshape(t, n_group, e // n_group)
      top2, _ = _top_k_by_rank(grouped, 2)
      choice = _keep_top_groups(grouped, jnp.sum(top2, -1), topk_group, -jnp.inf).reshape(t, e)
    # The weights are the uncorrected scores of the chosen experts, picked in the same pass.
    _, ids, weights = _top_k_by_rank(choice, top_k, scores)
  else:
    choice = scores
    if topk_method == "group_limited_greedy" and n_group > 1:
      grouped = scores.reshape(t, n_group, e // n_group)
      choice = _keep_top_groups(grouped, jnp.max(grouped, -1), topk_group, 0.0).reshape(t, e)
    weights, ids = _top_k_by_rank(choice, top_k)
  weights = reference.finish_weights(weights, topk_method, norm_topk_prob,
                                     routed_scaling_factor)
  return weights, ids.astype(jnp.int32)


route_reference = reference.route
