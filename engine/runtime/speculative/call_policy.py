"""Whether a serving decode call runs the speculative loop at all (host side, once per call).

The loop picks its block width every iteration (`goodput.plan`), but the call as a whole has
a cost its iterations do not: the speculative loop's fixed cost F beyond a plain call's (a
larger program to dispatch, more outputs to fetch, its set-up), measured at warm-up
(`serving_costs`, `SpecRuntime.call_cost`) in plain-loop iterations and corrected, with the
rest of the cost model, by what live calls take (`SpecRuntime.live_costs`). The plan the
call's first iteration would run gives each row b a rate r_b: tokens per unit of step time
(plain decoding's is 1). The call runs until every row has its tokens or its time is spent,
and rows ride every iteration whether they draft or not: a row that drafts nothing goes at
1 / T, slower than plain decoding. So the call is priced row by row (`call_saving`): a batch
whose average rate beats 1 loses where its slowest row has to finish within the call (the
last call of a request) at 1 / T.

On the 2-core CPU F is several plain iterations, so short calls (the engine's first calls
after a request joins, a probe's K + 1 tokens) lose there even at high acceptance, which the
per-iteration model alone could not see; on a GPU, where an iteration is the weights' read
time, F is a fraction of one.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.runtime.speculative import goodput
from engine.runtime.speculative.serving import AUTO, DETERMINISTIC, DRAFTER_IDS, drafter_id


def first_iteration_speedup(spec: Any, reqs: Sequence[Any], n: int) -> float:
  """The mean of `first_iteration`'s rates at n tokens per row."""
  return float(np.mean(first_iteration(spec, reqs, np.full((len(reqs),), n))[0]))


def first_iteration(spec: Any, reqs: Sequence[Any], limits: np.ndarray
                    ) -> tuple[np.ndarray, bool]:
  """[len(reqs)] each row's tokens per unit of step time (plain decoding's: 1) in the plan
  the loop would start `reqs` with: 1 for all when nothing would draft; a row that drafts
  nothing, 1 / T. The loop's own choices (`goodput.row_drafters`, `goodput.plan`) on the rows'
  current estimates (`goodput.row_gains`); "auto" rows may take the deterministic drafters
  and the model drafters the loop call would be offered (`SpecRuntime.
  model_drafters_for_auto`, uncommitted). `spec`: the `SpecRuntime`; limits [len(reqs)]:
  the tokens each row may emit in the call. Also whether the call would keep a model drafter
  current (its costs carry that kind of call's correction, `SpecRuntime.live_costs`)."""
  b, k = len(reqs), spec.k
  if not any(r.drafter for r in reqs):
    return np.ones((b,), np.float32), False
  row_accept = np.stack([r.spec_accept if r.spec_accept is not None
                         else np.zeros(spec.accept_seen.shape, np.float32) for r in reqs])
  gains = goodput.row_gains(row_accept, spec.accept_seen, xp=np)  # [B, D, J]
  row_auto = np.asarray([r.drafter == AUTO for r in reqs])
  models = set()
  if row_auto.any():  # (a row without evidence has the engine-wide gains: `row_gains`)
    engine_wide = goodput.drafter_gains(spec.accept_seen, xp=np)[None]
    models = spec.model_drafters_for_auto(
        reqs, commit=False, gains=np.concatenate([engine_wide, gains[row_auto]]))
  fed = bool(models) or any(r.drafter not in (None, AUTO) and r.drafter not in DETERMINISTIC
                            for r in reqs)
  costs = spec.live_costs(fed)
  allowed = np.asarray([d in spec.enabled and (d in DETERMINISTIC or d in models)
                        for d in DRAFTER_IDS])
  row_drafter = np.asarray([0 if r.drafter in (None, AUTO) else drafter_id(r.drafter)
                            for r in reqs], np.int32)
  live = np.ones((b,), bool)
  ids, gain, block_cost = goodput.row_drafters(
      gains, costs, np.broadcast_to(allowed, (b, len(DRAFTER_IDS))), row_auto, row_drafter,
      live, k, xp=np)
  room = np.asarray([min(n - 1, r.sampling.max_draft_tokens or k)
                     for r, n in zip(reqs, limits)], np.int32)
  _, drafts, rate = goodput.plan(gain, ids > 0, live, np.maximum(room, 0), spec.choices,
                                 np.float32(block_cost), np.float32(costs[-1]),
                                 np.float32(costs[-4]), xp=np)
  taken = np.arange(1, k + 1)[None, :] <= drafts[:, None]
  tokens = 1.0 + np.sum(np.where(taken, gain[:, :k], 0.0), axis=1)  # per row and iteration
  return tokens * (float(rate) / float(np.sum(tokens))), fed  # (rate: their sum over T)


def call_saving(rates: Sequence[float], limits: Sequence[int], fixed_cost: float,
                time: float | None = None) -> float:
  """Plain-loop iterations a speculative call saves (negative: it loses) after its fixed cost.

  rates [B]: each row's tokens per unit of step time (`first_iteration`); limits [B]: the
  tokens each row may emit; time: the call's budget in plain-loop iterations (None: none).
  The call runs t = min(time, max_b limit_b / r_b), and row b emits min(limit_b, r_b t); a
  plain call runs t_p = min(time, max_b limit_b) iterations for min(limit_b, t_p) each. The
  saving is the time the plain loop would take for the speculative call's tokens at its own
  rate, less the call's t + F. (Equal rows at rate s, n tokens, no time limit:
  n (1 - 1 / s) - F.)"""
  r = np.asarray(rates, np.float64)
  n = np.asarray(limits, np.float64)
  inf = float("inf") if time is None else float(time)
  t = min(inf, float(np.max(n / r)))
  t_plain = min(inf, float(np.max(n)))
  plain_tokens = float(np.sum(np.minimum(n, t_plain)))
  if plain_tokens <= 0:
    return -fixed_cost
  tokens = float(np.sum(np.minimum(n, r * t)))
  return tokens * t_plain / plain_tokens - t - fixed_cost
