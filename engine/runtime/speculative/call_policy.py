"""Whether a serving decode call runs the speculative loop at all (host side, once per call).

The loop picks its block width every iteration (`goodput.plan`), but the call as a whole has
a cost its iterations do not: the speculative loop's fixed cost F beyond a plain call's (a
larger program to dispatch, more outputs to fetch, its set-up), measured at warm-up
(`serving_costs`, `SpecRuntime.call_cost`) in plain-loop iterations and corrected, with the
rest of the cost model, by what live calls take (`SpecRuntime.live_costs`). A call of n tokens
per row whose first iteration's plan emits R tokens per unit of step time against `rows` for
plain decoding saves about n (1 - rows / R) plain iterations; it pays when that exceeds F.

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
  """`first_iteration`'s speedup."""
  return first_iteration(spec, reqs, n)[0]


def first_iteration(spec: Any, reqs: Sequence[Any], n: int) -> tuple[float, bool]:
  """Tokens per unit of step time of the plan the loop would start `reqs` with, over plain
  decoding's (one token per row per iteration): 1 when nothing would draft, <= 1 never pays.
  The loop's own choices (`goodput.row_drafters`, `goodput.plan`) on the rows' current
  estimates (`goodput.row_gains`); "auto" rows may take the deterministic drafters and the
  model drafters the loop call would be offered (`SpecRuntime.model_drafters_for_auto`,
  uncommitted). `spec`: the `SpecRuntime`; n: the call's budget per row. Also whether the
  call would keep a model drafter current (its costs carry that kind of call's correction,
  `SpecRuntime.live_costs`)."""
  if not any(r.drafter for r in reqs):
    return 1.0, False
  b, k = len(reqs), spec.k
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
  room = np.asarray([min(n - 1, r.sampling.max_draft_tokens or k) for r in reqs], np.int32)
  _, _, rate = goodput.plan(gain, ids > 0, live, np.maximum(room, 0), spec.choices,
                            np.float32(block_cost), np.float32(costs[-1]),
                            np.float32(costs[-4]), xp=np)
  return float(rate) / b, fed


def call_saving(speedup: float, n: int, fixed_cost: float, time: float | None = None) -> float:
  """Plain-loop iterations a speculative call of n tokens per row at most, in `time` plain-loop
  iterations (None: no limit), saves at `speedup` (tokens per unit of time over plain
  decoding's) after its fixed cost (negative: it loses). Its tokens would take plain decoding
  as many iterations, and take it 1 / speedup of them."""
  if speedup <= 1.0:
    return -fixed_cost
  tokens = n if time is None else min(n, time * speedup)
  return tokens * (1.0 - 1.0 / speedup) - fixed_cost
