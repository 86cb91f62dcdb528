"""The engine core's speculative decoding: `SpecPolicy`, what `Engine` holds when it has
drafters (`engine.spec`; None without): the enabled drafters (`EngineConfig.speculative`, the
requests' default, and `EngineConfig.drafters`), each request's `RequestSpec`, the host copy of
the engine-wide acceptance estimates, the cost table, and the rule for each decode-only call.

A call speculates (`speculates`) when some row has a drafter and the draft length is fixed
(no `adaptive_k`: every call drafts K, whatever the cost table says), or some row drafts with
a drafter whose state must see every verified block (`Drafter.needs_every_block`: MTP,
EAGLE-3; as vLLM and SGLang run those drafters every step), whatever the call's length, batch
and estimates: the loop's plan then chooses, per iteration, the block or width 0 (no drafts,
the drafter still fed the verified token) where drafting does not pay. Otherwise, adaptive, a
call speculates when its batch is below the cost table's break-even, it is long enough to win
back a speculative call's fixed cost, and the rows' estimates say the loop's first iteration
would draft. A batch kept plain by its estimates speculates once every EXPLORE_EVERY calls, so
stale estimates come back. A speculative call is a `SPEC_DECODE` step description (`describe`)
carrying every input the loop decides with: the rows' drafters, estimates and limits, the
engine-wide estimates, the cost table's row and the time budget; the runner executes it and
`apply` books what came back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from engine.model.config import ModelConfig
from engine.runtime.buckets import ShapeBuckets
from engine.runtime.engine_config import EngineConfig
from engine.runtime.page_pool import PagePool
from engine.runtime.speculative import costs as cost_table, goodput
from engine.runtime.speculative.drafters import AUTO, OFF, Drafter, drafter_id, ids
from engine.runtime.speculative.drafters.learned import last_tokens
from engine.runtime.step_description import DRAFTER, SPEC_DECODE, StepDescription

# A batch its estimates keep plain speculates once every this many of its calls: the loop's
# own evidence is what moves the estimates (an n-gram run that starts mid-request; a drafter
# whose last requests accepted little). Costs at most 1/8 of a call's overhead at k = 0 on
# fresh text (BENCHMARKS.md, "Speculative decoding, simplified"); other values not measured.
EXPLORE_EVERY = 8


@dataclasses.dataclass
class RequestSpec:
  """One request's speculative state (`Request.spec`; None for a request that drafts nothing)."""
  drafter: str  # a drafter's name, or "auto"
  accept: np.ndarray  # [D, J, 2] decayed (accepted, ended) counts per drafter and position
  drafts: int = 0  # verify steps with a draft
  drafted: int = 0  # drafted tokens
  accepted: int = 0  # accepted drafted tokens
  accepted_at: np.ndarray | None = None  # [J] verify steps whose draft j (0-based) was accepted
  drafter_steps: dict[str, int] = dataclasses.field(default_factory=dict)  # verify steps per d
  # Drafters' row state at position num_computed - 1 (the MTP hidden state [H]), by name.
  rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # A constrained row's drafts proposed on the device by the last masked step
  # (`speculative/constrained.py`): (num_computed they follow, the tokens after the newest).
  proposed: tuple[int, list[int]] | None = None


class SpecPolicy:
  """The engine core's speculative state and rule (see the module docstring)."""

  def __init__(self, cfg: ModelConfig, config: EngineConfig, drafters: tuple[Drafter, ...],
               pool: PagePool, buckets: ShapeBuckets):
    self.cfg, self.config, self.buckets = cfg, config, buckets
    self.drafters = drafters
    self.enabled = tuple(d.name for d in drafters)
    k = config.num_draft_tokens
    if k < 1 or config.max_decode_steps < k + 1:
      raise ValueError("EngineConfig: num_draft_tokens must be >= 1 and max_decode_steps >= "
                       "num_draft_tokens + 1 with speculative decoding")
    self.k = k
    # A speculative call's budget is time (`describe`): max_decode_steps iterations of k + 1.
    self.max_call_tokens = config.max_decode_steps * (k + 1)
    self.widths = (0, k) if config.adaptive_k else (k,)  # the loop's compiled block widths
    self.num_ids = len(ids())  # drafter ids (0: none)
    self.accept_seen = np.zeros((self.num_ids, k, 2), np.float32)  # engine-wide estimates
    self.host = {d.name: h for d in drafters if (h := d.host_state(pool)) is not None}
    prices = np.zeros((self.num_ids,), np.float32)
    for d in drafters:
      prices[drafter_id(d.name)] = d.roofline_cost()
    self.costs = cost_table.roofline(tuple(buckets.decode), self.widths, prices)
    self._plain_calls = 0  # plain calls in a row of batches with drafters (`speculates`)
    self._exploring = False  # the last `speculates` said yes to explore
    self.k_steps = np.zeros((len(self.widths),), np.int64)
    self.per_drafter = {f"spec_{n}_{d}": 0 for d in self.enabled
                        for n in ("steps", "drafted", "accepted", "auto_choice")}
    self.per_drafter.update(spec_plain_calls=0, spec_loop_calls=0, spec_explore_calls=0)
    for d in drafters:
      self.per_drafter.update(d.counters())
    self.per_position = np.zeros((2, k), np.int64)  # drafted, accepted tokens at each slot
    self.calibration = np.zeros((2,), np.float64)  # tokens expected / emitted when drafting

  @property
  def observers(self) -> tuple[Drafter, ...]:
    """Drafters whose row state prefill chunks build (the mixed step feeds them)."""
    return tuple(d for d in self.drafters if d.observes_prefill)

  def refuses_images(self) -> str | None:
    return next((d.refuses_images for d in self.drafters if d.refuses_images), None)

  def resolve(self, drafter: str | None) -> str | None:
    """A request's drafter (None: plain decoding); ValueError if the engine lacks it."""
    if drafter is None:
      return self.config.speculative
    if drafter == OFF:
      return None
    if drafter == AUTO:
      return AUTO
    if drafter not in self.enabled:
      raise ValueError(f"drafter: {drafter!r} is not enabled on this engine (enabled: "
                       f"{', '.join(self.enabled) or 'none'})")
    return drafter

  def request_state(self, drafter: str | None) -> RequestSpec | None:
    """A new request's `Request.spec` for its resolved drafter."""
    if drafter is None:
      return None
    return RequestSpec(drafter, np.zeros(self.accept_seen.shape, np.float32),
                       accepted_at=np.zeros((self.k,), np.int64))

  # ---- the rule ---------------------------------------------------------------------------------

  def speculates(self, reqs: Sequence[Any], num_steps: int) -> bool:
    """Whether a decode-only call of `reqs` with a plain budget of `num_steps` iterations runs
    the speculative loop (see the module docstring)."""
    specs = [r.spec for r in reqs if r.spec is not None]
    self._exploring = False
    if not specs:
      return False
    if len(self.widths) == 1:  # fixed K: drafting is the request's choice, not the table's
      return True
    # (a plain call would leave those drafters' cache entries and row state behind)
    every_block = {d.name for d in self.drafters if d.needs_every_block}
    if any(s.drafter in every_block for s in specs):
      return True
    b = self.buckets.decode_rows(len(reqs))
    if num_steps < self.costs.min_call_tokens or not self.costs.pays_at_full_acceptance(b):
      return False
    if self.first_iteration_drafts(reqs, b):
      return True
    self._exploring = self._plain_calls + 1 >= EXPLORE_EVERY
    return self._exploring

  def first_iteration_drafts(self, reqs: Sequence[Any], b: int) -> bool:
    """Whether the loop's plan (`goodput.plan`, here in numpy) would draft in its first
    iteration over `reqs`, from their current estimates."""
    row_auto, row_drafter, accept = self._rows([r.spec for r in reqs])
    gains = goodput.row_gains(accept, self.accept_seen, xp=np)
    row = self.costs.index(b)
    step_cost, drafter_cost = self.costs.step[row], self.costs.drafter[row]
    allowed = np.broadcast_to(self._auto_allowed(bool(row_auto.any()), b),
                              (len(reqs), self.num_ids))
    live = np.ones((len(reqs),), bool)
    ids, gain, column_cost = goodput.row_drafters(gains, step_cost[-1], drafter_cost, allowed,
                                                  row_auto, row_drafter, live, self.k, xp=np)
    room = np.asarray([min(self.k, r.sampling.max_draft_tokens or self.k) for r in reqs])
    block, _ = goodput.plan(gain, ids > 0, live, room, self.k, step_cost, column_cost, xp=np)
    return bool(block)

  def _rows(self, specs: Sequence[RequestSpec | None]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row_auto [B] bool, row_drafter [B] int32, row_accept [B, D, K, 2]) of rows with these
    specs (None: no drafter)."""
    row_auto = np.asarray([s is not None and s.drafter == AUTO for s in specs], bool)
    row_drafter = np.asarray([drafter_id(None if s is None or auto else s.drafter)
                              for s, auto in zip(specs, row_auto)], np.int32)
    zeros = np.zeros(self.accept_seen.shape, np.float32)
    return row_auto, row_drafter, np.stack([zeros if s is None else s.accept for s in specs])

  def _auto_allowed(self, any_auto: bool, b: int) -> np.ndarray:
    """[D] what "auto" rows of a b-row call may take: the deterministic drafters, and a model
    drafter that can beat plain decoding at full acceptance (every iteration it is fed pays
    its upkeep)."""
    out = np.zeros((self.num_ids,), bool)
    if any_auto:
      row = self.costs.index(b)
      for d in self.drafters:
        i = drafter_id(d.name)
        out[i] = d.deterministic or self.costs.pays_at_full_acceptance(
            b, float(self.costs.drafter[row, i]))
    return out

  def count_plain(self, reqs: Sequence[Any]) -> None:
    """A decode-only call of `reqs` ran the plain loop."""
    if any(r.spec is not None for r in reqs):
      self._plain_calls += 1
      self.per_drafter["spec_plain_calls"] += 1

  # ---- a speculative call -------------------------------------------------------------------

  def describe(self, reqs: Sequence[Any], plain: StepDescription, time_budget: float | None,
               *, force_width: int = -1, warm_rows: Sequence[str] = (), shape: Any = None
               ) -> tuple[list[StepDescription], StepDescription, np.ndarray]:
    """A speculative call of `reqs` (rows past them: padding) from the plain call's
    description `plain` (`batching.decode`): (the drafters' programs to run first, the
    call, the rows each drafter is fed [B, D]). `force_width`, `warm_rows` (reqs empty:
    warm-up and the cost table's timing, junk rows that keep nothing): a forced block width
    index, the drafters rows take in turn. `shape`: the mixed shapes' packing (catch-up)."""
    b = plain.arrays["tokens"].shape[0]
    if reqs:
      self.per_drafter["spec_loop_calls"] += 1
      self.per_drafter["spec_explore_calls"] += self._exploring
      self._plain_calls = 0
    window = self.config.ngram_window
    history = last_tokens(reqs, b, window, window + self.max_call_tokens)
    history_len = np.asarray([min(len(r.all_ids), window) for r in reqs]
                             + [0] * (b - len(reqs)), np.int32)
    specs = [r.spec for r in reqs] + [None] * (b - len(reqs))
    row_auto, row_drafter, row_accept = self._rows(specs)
    if warm_rows:  # (reqs empty) the rows take the drafters in turn
      row_drafter = np.asarray([drafter_id(warm_rows[i % len(warm_rows)]) for i in range(b)],
                               np.int32)
    row_max_draft = np.asarray([(r.sampling.max_draft_tokens or self.k) for r in reqs]
                               + [self.k] * (b - len(reqs)), np.int32)
    auto_allowed = self._auto_allowed(bool(row_auto.any()), b)
    # Model drafters kept current in this call: for the rows that use them or, "auto", may;
    # one fed per row (the draft model) only for those rows, the others for the whole batch.
    fed = np.zeros((b, self.num_ids), bool)
    for d in self.drafters:
      if d.deterministic:
        continue
      i = drafter_id(d.name)
      rows = (row_drafter == i) | (row_auto & bool(auto_allowed[i]))
      fed[:, i] = rows if d.fed_per_row else rows.any()
    own = tuple(f"{d.name}." for d in self.drafters)  # (a plain call's learner inputs)
    arrays = {k: v for k, v in plain.arrays.items() if not k.startswith(own)}
    arrays.update(history=history, history_len=history_len,
                  row_drafter=row_drafter, row_auto=row_auto, row_max_draft=row_max_draft,
                  row_accept=row_accept.astype(np.float32), accept=self.accept_seen.copy(),
                  auto_allowed=auto_allowed, fed=fed, costs=self.costs.costs(b))
    for d in self.drafters:
      if d.row_width():
        x = np.zeros((b, d.row_width()), np.float32)
        for i, s in enumerate(specs):
          if s is not None and d.name in s.rows:
            x[i] = s.rows[d.name]
        arrays[f"rows.{d.name}"] = x
    pre = []
    if reqs:
      for d in self.drafters:
        if d.name in self.host:
          pre += [StepDescription(DRAFTER, a, {"drafter": d.name}) for a in d.before_call(
              self.host[d.name], reqs, fed[:, drafter_id(d.name)], plain.arrays["page_table"],
              shape, self.config.max_num_batched_tokens, self.config.max_num_seqs,
              self.per_drafter)]
    scalars = dict(plain.scalars, time_budget=float(np.inf if time_budget is None
                                                    else time_budget),
                   force_width=int(force_width), junk=not reqs)
    return pre, StepDescription(SPEC_DECODE, arrays, scalars), fed

  def fed_names(self, fed_row: np.ndarray) -> frozenset[str]:
    """The model drafters a row of a speculative call was fed (`describe`'s fed [D])."""
    return frozenset(d.name for d in self.drafters
                     if not d.deterministic and fed_row[drafter_id(d.name)])

  def apply(self, reqs: Sequence[Any], out: dict[str, Any], fed: np.ndarray,
            counters: dict) -> None:
    """Books a speculative call's outputs: estimates, counters, each request's state."""
    self.accept_seen = np.asarray(out["accept"], np.float32)
    self.calibration += out["calibration"][:2]
    self.k_steps += out["k_steps"]
    by_drafter, slots, row_accept = out["by_drafter"], out["slots"], out["row_accept"]
    totals = by_drafter.sum(1)  # [B, 3] verify steps, drafted and accepted tokens
    for name, n in zip(("spec_steps", "spec_drafted", "spec_accepted"), totals.sum(0)):
      counters[name] += int(n)
    self.per_position += slots.sum(0)
    for d in self.drafters:
      if d.name in self.host:
        d.after_call(self.host[d.name], reqs, fed[:, drafter_id(d.name)], out["count"])
    row_auto = np.asarray([r.spec is not None and r.spec.drafter == AUTO for r in reqs], bool)
    for i, req in enumerate(reqs):
      s = req.spec
      if s is None:
        continue
      s.drafts += int(slots[i, 0, 0])  # (a step that drafted at all drafted slot 0)
      s.drafted += int(totals[i, 1])
      s.accepted += int(totals[i, 2])
      s.accepted_at += slots[i, 1]
      s.accept = row_accept[i]
      for name, rows in out["rows"].items():
        s.rows[name] = rows[i]
      for d in self.enabled:
        n = int(by_drafter[i, drafter_id(d), 0])
        if n:
          s.drafter_steps[d] = s.drafter_steps.get(d, 0) + n
    for d in self.enabled:  # per drafter: verify steps, drafted and accepted tokens
      per_row = by_drafter[:len(reqs), drafter_id(d)]  # [B, 3]
      for name, n in zip(("steps", "drafted", "accepted"), per_row.sum(0)):
        self.per_drafter[f"spec_{name}_{d}"] += int(n)
      self.per_drafter[f"spec_auto_choice_{d}"] += int(per_row[row_auto, 0].sum())

  # ---- the cost table ---------------------------------------------------------------------------

  def measure_costs(self, run: Callable[[StepDescription], Any],
                    junk_call: Callable[..., StepDescription], *, rounds: int = 5,
                    iterations: int = EngineConfig.max_decode_steps) -> None:
    """Times the plain and speculative loops at every decode bucket and block width (rows
    on the null page: nothing real is read or written), calls of `iterations` (at most
    max_decode_steps; default a serving engine's) and of 1, and installs the table.
    `run(desc)` executes a description; `junk_call(b, n_steps)` is a plain call's
    description of b junk rows allowed n_steps tokens each."""
    n = min(iterations, self.config.max_decode_steps)

    def plain(b, n_steps):
      return run(junk_call(b, n_steps))

    def speculative(b, n_steps, force_width=-1, drafter=None):
      pre, desc, _ = self.describe([], junk_call(b, n_steps), None, force_width=force_width,
                                   warm_rows=(drafter,) if drafter else ())
      return run(desc)

    model = [d.name for d in self.drafters if not d.deterministic]
    self.costs = cost_table.measure(
        self.costs.batch_sizes, self.widths, model, [drafter_id(d) for d in model],
        self.num_ids,
        n, plain, speculative, rounds=rounds)

  # ---- statistics ----------------------------------------------------------------------------

  def stats(self) -> dict[str, Any]:
    """Counters per block width, drafter and draft position, the estimates, the cost table."""
    s = {f"spec_k{k}_loops": int(n) for k, n in zip(self.widths, self.k_steps)}
    s.update(self.per_drafter)
    for j, (drafted, accepted) in enumerate(self.per_position.T):  # slot j (0-based)
      s[f"spec_pos{j}_drafted"], s[f"spec_pos{j}_accepted"] = int(drafted), int(accepted)
    c = goodput.conditional_acceptance(self.accept_seen, goodput.PRIOR_ACCEPT,
                                       goodput.PRIOR_WEIGHT, xp=np)
    for d in self.enabled:
      for j, x in enumerate(c[drafter_id(d)]):
        s[f"spec_pos{j}_estimate_{d}"] = round(float(x), 4)
      steps_ = self.per_drafter[f"spec_steps_{d}"]
      if steps_:  # tokens per target forward of rows drafting with d
        s[f"spec_mean_accepted_length_{d}"] = 1 + self.per_drafter[f"spec_accepted_{d}"] / steps_
    # Over iterations that drafted: tokens the estimates expected, and tokens emitted.
    s["spec_model_expected_tokens"], s["spec_model_emitted_tokens"] = map(float,
                                                                          self.calibration)
    s["spec_cost_table"] = self.costs.summary()
    s["spec_cost_break_even"] = self.costs.break_even or 0
    return s
