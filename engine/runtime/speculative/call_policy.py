"""Whether a serving decode call runs the speculative loop, for how many tokens, and which model
drafters "auto" rows are offered (host side, once per call; `CallPolicy`, a part of
`SpecRuntime`).

The loop picks its block width every iteration (`goodput.plan`), but the call as a whole has a
cost its iterations do not: the speculative loop's fixed cost F beyond a plain call's (on
XLA:CPU mostly setting up a buffer per allocation of the larger program, run or not; more
outputs to fetch), measured at warm-up (`serving_costs`, `SpecRuntime.call_cost`) in plain-loop
iterations and corrected, with the rest of the cost model, by what live calls take
(`SpecRuntime.live_costs`). The plan the call's first iteration would run gives each row b a
rate r_b: tokens per unit of step time (plain decoding's is 1). The call runs until every row
has its tokens or its time is spent, and rows ride every iteration whether they draft or not: a
row that drafts nothing goes at 1 / T, slower than plain decoding. So the call is priced row by
row (`call_saving`): a batch whose average rate beats 1 loses where its slowest row has to
finish within the call (the last call of a request) at 1 / T.

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

# "auto" rows get a model drafter that does not look worth its upkeep once per this many calls.
EXPLORE_EVERY = 32


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
  models = spec.model_drafters_for_auto(reqs, commit=False) if row_auto.any() else set()
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


class CallPolicy:
  """`SpecRuntime`'s decisions per decode call (a mixin: the state is `SpecRuntime`'s; see its
  `__init__`): `speculates` (the speculative loop or the plain one), `budget` (tokens per
  row), `model_drafters_for_auto` (what "auto" rows may take), `hopeless` (model drafters
  that cannot pay), `gated`/`pays` (replayed batches decided by the call's price) and the rest
  schedule (`rest.py`)."""

  def model_drafters_for_auto(self, reqs: Sequence[Any], *, commit: bool = True) -> set[str]:
    """The model drafters (mtp, draft) "auto" rows may take in the next loop call.

    Keeping one usable costs every iteration a forward (the MTP layer observes the verified
    block, the draft model is fed), so it is offered only while an estimate says it can beat
    the best free choice: E[tau](K; g_d) / (1 + K (base + c_d) + c_d) > the best deterministic
    drafter's E[tau](K; g) / (1 + K base), or plain decoding's 1 (adaptive k), with the gains g
    from the engine-wide counts or from any auto row's own (`goodput.row_gains`). Every
    EXPLORE_EVERY calls with auto rows, a drafter not offered meanwhile is offered once (and at
    the first such call), so fresh evidence can bring it back. A `hopeless` one never is.
    `commit`: the loop call is made (counts it and the offers); False: what the next call
    would be offered, changing nothing (`first_iteration` predicts that call).
    """
    calls = self._auto_calls + 1
    counts = self.accept_seen
    gains = goodput.drafter_gains(counts, xp=np)[None]  # [1 + auto rows with evidence, D, K]
    rows = [r.spec_accept for r in reqs if r.drafter == AUTO and r.spec_accept is not None]
    if rows:  # (numpy, all rows at once: this runs on the host before every loop call)
      gains = np.concatenate([gains, goodput.row_gains(np.stack(rows), counts, xp=np)])
    costs = self.live_costs(models=True)
    k, base = self.k, float(costs[-3])
    hopeless = self.hopeless()
    out = set()
    for tokens in goodput.expected_tokens(gains, k, xp=np):
      free = max([1.0 if self.config.adaptive_k else 1.0 / (1.0 + k * base)]
                 + [tokens[drafter_id(d)] / (1.0 + k * base) for d in self.enabled
                    if d in DETERMINISTIC])
      for d in self.enabled:
        c = float(costs[drafter_id(d)])
        if d not in DETERMINISTIC and tokens[drafter_id(d)] / (1 + k * (base + c) + c) > free:
          out.add(d)
    for d in self.enabled:
      if d in hopeless:
        out.discard(d)
      elif d not in DETERMINISTIC and (d in out or self.exploration_due(d, calls)):
        out.add(d)
        if commit:
          self._offered[d] = calls
    if commit:
      self._auto_calls = calls
    return out

  def exploration_due(self, drafter: str, calls: int | None = None) -> bool:
    """Whether the loop call numbered `calls` (default: the next) with "auto" rows offers
    `drafter` to explore it (EXPLORE_EVERY, `model_drafters_for_auto`)."""
    calls = self._auto_calls + 1 if calls is None else calls
    return calls - self._offered.get(drafter, -10**9) >= EXPLORE_EVERY

  def hopeless(self) -> set[str]:
    """Model drafters that could not pay for themselves even if every draft were accepted:
    (1 + j) / (1 + overhead + j (base + c_d) + c_d) <= 1 (plain decoding) at every compiled
    j > 0, by the measured costs (adaptive k; e.g. the MTP layer of the CPU demo model)."""
    if not self.config.adaptive_k:
      return set()
    costs = self.live_costs(models=True)
    overhead, base = float(costs[-4]), float(costs[-3])
    out = set()
    for d in self.enabled:
      c = float(costs[drafter_id(d)])
      if d not in DETERMINISTIC and all((1 + j) / (1 + overhead + j * (base + c) + c) <= 1.0
                                        for j in self.choices if j):
        out.add(d)
    return out

  def speculates(self, reqs: Sequence[Any], num_steps: int, time: float | None = None,
                 left: Sequence[int] | None = None) -> bool:
    """Whether a decode-only step of `reqs` (`num_steps` tokens per row at most, in `time`
    plain-loop iterations: `budget`; `left` as `pays`') runs the speculative loop.

    Where the replay keeps every estimate the batch drafts from current (`gated`): when its
    predicted saving covers the call's fixed cost (`pays`). Otherwise, with `adaptive_k`,
    after a call that chose k = 0 throughout, the next REST_CALLS calls of batches without an
    MTP row decode plainly (their tokens still teach the table and are replayed, `plain_decode`),
    then the loop probes again (ending a rest as soon as the evidence said drafting paid lost
    on the CPU demo: 0.70-0.80x against 0.93-0.99x). Draft-model rows rest too and are caught
    up when they return (`catch_up_draft`); MTP rows always take the speculative loop (the
    MTP layer must observe every verified block) unless MTP is `hopeless`: then they give it
    up for good and decode plainly (`spec_mtp_given_up`)."""
    if any(r.drafter == "mtp" for r in reqs) and "mtp" in self.hopeless():
      for r in reqs:
        if r.drafter == "mtp":
          r.drafter = None
          self.per_drafter["spec_mtp_given_up"] = (
              self.per_drafter.get("spec_mtp_given_up", 0) + 1)
    if not any(r.drafter for r in reqs):
      return False
    if self.gated(reqs):
      if self.pays(reqs, num_steps, time, left):
        return True
      self.per_drafter["spec_gated_calls"] = self.per_drafter.get("spec_gated_calls", 0) + 1
      return False
    if self._may_rest(reqs) and self.rest.take():
      self._probe = True
      self.per_drafter["spec_rest_calls"] = self.per_drafter.get("spec_rest_calls", 0) + 1
      return False
    return True

  def gated(self, reqs: Sequence[Any]) -> bool:
    """Whether `pays` decides `reqs`' calls (instead of the rest schedule): adaptive k with
    the replay on (`replay_budget`), and every row's drafter one the replay evaluates on plain
    calls (ngram, learned; "auto" rows too, whose model drafters are explored in the calls
    that speculate), so estimates move while the batch decodes plainly and no probe is
    needed to find out that drafting pays again."""
    return (self.force_k < 0 and self.replay_budget > 0
            and all(r.drafter in (None, AUTO) or r.drafter in DETERMINISTIC for r in reqs))

  def pays(self, reqs: Sequence[Any], n: int, time: float | None = None,
           left: Sequence[int] | None = None) -> bool:
    """Whether a speculative call of n tokens per row at most (each row's `left`: tokens its
    request may still emit) in `time` plain-loop iterations (None: no limit) beats plain
    decoding, fixed cost included (`call_policy`). The prediction is kept with what it came
    from (drafters, estimates, room, costs): a plainly decoding batch asks every step, and its
    estimates move only when the replay runs (~0.5 ms on the host, 2-3% of a CPU call)."""
    limits = np.minimum(n, np.asarray(left if left is not None else [n] * len(reqs)))
    if limits.max(initial=0) <= 1:
      return False
    key = (tuple(np.minimum(limits, self.k + 1).tolist()), self.correction.scale.tobytes(),
           self.costs.tobytes(), self.accept_seen.tobytes(),
           tuple((r.drafter, r.sampling.max_draft_tokens, None if r.spec_accept is None
                  else r.spec_accept.tobytes()) for r in reqs),
           tuple(self.exploration_due(d) for d in self.enabled if d not in DETERMINISTIC))
    if key not in self._speedups:  # (the plan depends on limits only through the room)
      if len(self._speedups) >= 16:
        self._speedups.clear()
      self._speedups[key] = first_iteration(self, reqs, limits)
    rates, models = self._speedups[key]
    return call_saving(rates, limits, self.call_cost * self.correction.of(models), time) > 0

  @staticmethod
  def _may_rest(reqs: Sequence[Any]) -> bool:
    """MTP rows never rest: the MTP layer must observe every verified block."""
    return all(r.drafter != "mtp" for r in reqs)

  def budget(self, steps_: int, running: Sequence[Any], left: Sequence[int] | None = None
             ) -> int:
    """The tokens per row a decode call of `running` may emit (the scheduler's pages).
    `steps_`: the engine's budget in plain-loop iterations, which a plain call spends on as
    many tokens. A speculative call gets the same time (`decode`'s `time_budget`) and up to
    k + 1 tokens per iteration: it lasts as long as a plain call, its fixed cost spread over
    as much time (16 tokens ran ~6 iterations on the CPU demo). A probe after a rest gets
    k + 1 tokens; a resting call, one without drafters and a `gated` one that would not pay
    keep the plain budget. `left`: as `pays`'."""
    if not any(r.drafter for r in running):
      return steps_
    n = steps_ * (self.k + 1)
    if self.gated(running):  # (the plain budget where a speculative call would not pay)
      return n if self.pays(running, n, steps_, left) else steps_
    if self.rest.left > 0 and self._may_rest(running):
      return steps_
    return self.k + 1 if self._probe and self.rest.left == 0 else n
