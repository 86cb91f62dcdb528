"""The serving engine's speculative decoding: drafters per request, device state, cost model.

`SpecRuntime` is what `Engine` owns for speculation:
* the enabled drafters (`EngineConfig.speculative`, the default for requests that do not choose,
  plus `EngineConfig.drafters`, which requests may pick with `SamplingParams.drafter`);
* device state carried across engine steps: the learned n-gram table, the per-drafter decayed
  acceptance counts of the adaptive draft length, the draft model's paged cache (same page
  table and page ids as the target cache, so page accounting is unchanged);
* `model_step`: the mixed prefill/decode program plus what the MTP layer must see of every
  prefill chunk (it observes the chunk, filling its cache entries and giving each sampling row
  its MTP hidden state);
* `decode`: a decode-only engine step through `serving.speculative_decode_loop`. The draft
  model is fed lazily (`catch_up.py`): only rows that may draft with it, each first caught up
  over the positions its draft entries lack;
* per call, whether it speculates and for how many tokens, and what "auto" rows are offered:
  `call_policy.CallPolicy`, which `SpecRuntime` extends;
* the cost model: measured at `Engine.warmup` (`measure_costs`, `serving_costs.py`: the
  goodput model's step time T(B, k) in plain-loop iterations), then corrected by what live
  speculative calls take (`live_costs`); `adaptive_state` carries it, with the acceptance
  counts, rest and exploration schedule, to a later engine of the same configuration.

Each request keeps its own acceptance counts per drafter and draft position
(`Request.spec_accept`), so the loop sizes every row's drafts, and picks an "auto" row's
drafter, from what that request accepts at each depth.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import init_cache
from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache, forward
from engine.runtime import steps
from engine.runtime.buckets import CompileCounter, ShapeBuckets
from engine.runtime.page_pool import PagePool
from engine.runtime.request import wants_logprobs
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative import (call_policy, catch_up, drafters as dr, goodput,
                                        plain_calls, serving_costs, serving_stats)
from engine.runtime.speculative.learned import NgramTable
from engine.runtime.speculative.live_correction import LiveCorrection
from engine.runtime.speculative.rest import Rest
from engine.runtime.speculative.serving import (AUTO, DETERMINISTIC, DRAFTER_IDS, drafter_id,
                                                speculative_decode_loop)

# Cost per drafted token relative to a plain decode step until measured (adaptive mode).
DEFAULT_COSTS = {"ngram": 0.0, "learned": 0.0, "mtp": 0.1, "draft": 0.2}
DEFAULT_BASE, DEFAULT_PAD_ROW, DEFAULT_PER_TOKEN = 0.03, 0.02, 0.0
# Rests (`SpecRuntime.rest`, the schedule of `generate_tokens`' rests too: `rest.py`): after a
# loop call in which the adaptive policy chose k = 0 throughout, REST_CALLS calls run the plain
# loop (cheaper per token than the speculative loop at k = 0) before a short call (`budget`:
# num_draft_tokens + 1 tokens) probes again; each probe that drafts nothing doubles the rest,
# up to MAX_REST_CALLS, and a call that drafts resets it.
# The replay's share of plain calls' time (`SpecRuntime.replay_budget`): a plain call is
# replayed through the deterministic drafters when the time it and the earlier calls earned
# covers the replay's measured cost (every few calls on the CPU demo, ~1.4 ms against ~20 ms;
# every call on a GPU). With it, batches of replayable drafters are decided per call by
# `SpecRuntime.pays` instead of resting and probing. (Off, 0: the rest schedule alone; before
# `pays` priced a speculative call's fixed cost, replayed estimates made the engine's short
# calls draft where they lose: CPU demo 0.69-0.85x.)
REPLAY_BUDGET = 0.02


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
def spec_model_step(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
                    n_new: jax.Array, page_table: jax.Array, sampling: SamplingArrays,
                    next_tokens: jax.Array, *, cfg: ModelConfig, impl: KernelChoice = REFERENCE):
  """`steps.model_step` that also runs the MTP layer over the chunk. next_tokens [B, W]: the
  token after each position (-1 where it is the one sampled here). Returns (sampled, logprobs,
  MTP hidden at each row's last position [B, H], cache)."""
  hidden, cache = forward(params, cache, tokens, start, n_new, page_table, cfg=cfg, impl=impl)
  sampled, lps = steps.sample_rows(params, hidden, start, n_new, sampling, cfg)
  nxt = jnp.where(next_tokens < 0, sampled[:, None], next_tokens)
  mtp_hidden, cache = dr.mtp_observe(params, cache, hidden, nxt, start, n_new, page_table,
                                     cfg=cfg, impl=impl)
  return sampled, lps, mtp_hidden.astype(jnp.float32), cache


class SpecRuntime(call_policy.CallPolicy):
  """Speculative decoding state and programs of one `Engine` (see the module docstring)."""

  def __init__(self, cfg: ModelConfig, config: Any, num_pages: int, dtype: Any,
               draft: tuple[ModelConfig, Params] | None = None, place=lambda c: c,
               place_state=lambda x: x, pool: PagePool | None = None,
               buckets: ShapeBuckets | None = None):
    """`pool`, `buckets`: the engine's page pool (which pages hold draft-model entries) and
    compiled shapes (the draft model's catch-up forwards); needed with drafter "draft"."""
    self.cfg, self.config = cfg, config
    self.pool, self.buckets, self._place_state = pool, buckets, place_state
    self.default = config.speculative
    wanted = ({config.speculative} if config.speculative not in (None, AUTO) else set()
              ) | set(config.drafters)
    if config.speculative == AUTO and not wanted:
      raise ValueError("EngineConfig.speculative='auto' chooses among EngineConfig.drafters, "
                       "which is empty")
    bad = wanted - set(DRAFTER_IDS[1:])
    if bad:
      raise ValueError(f"EngineConfig.speculative/drafters: unknown drafter {sorted(bad)[0]!r};"
                       f" one of {DRAFTER_IDS[1:]}")
    self.enabled = tuple(d for d in DRAFTER_IDS[1:] if d in wanted)
    if "mtp" in wanted and cfg.num_nextn_predict_layers < 1:
      raise ValueError(f"EngineConfig: drafter 'mtp' needs an MTP layer: {cfg.no_mtp_reason}")
    self.draft_cfg, self.draft_params = draft if draft is not None else (None, None)
    if "draft" in wanted:
      if draft is None:
        raise ValueError("EngineConfig: drafter 'draft' needs a draft model (Engine(draft=))")
      if self.draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"draft model: vocabulary {self.draft_cfg.vocab_size} differs from "
                         f"the target's {cfg.vocab_size}")
    k = config.num_draft_tokens
    if self.enabled and (k < 1 or config.max_decode_steps < k + 1):
      raise ValueError("EngineConfig: num_draft_tokens must be >= 1 and max_decode_steps >= "
                       "num_draft_tokens + 1 with speculative decoding")
    self.k = k
    # A speculative call's tokens per row at most: its budget is time (`budget`), in which
    # max_decode_steps iterations could each emit k + 1 tokens.
    self.max_call_tokens = config.max_decode_steps * (k + 1)
    self.choices = goodput.k_choices(k) if config.adaptive_k else (k,)
    self.force_k = -1 if config.adaptive_k else 0
    # Device state is committed where the weights are from the start (like the cache): a
    # commitment that changed after the first call would compile the loop twice.
    self.table = (place_state(NgramTable.empty(config.learned_table_slots))
                  if "learned" in self.enabled else None)
    # Engine-wide decayed (accepted, ended) counts per drafter and draft position.
    self.accept = place_state(jnp.zeros((len(DRAFTER_IDS), k, 2), jnp.float32))
    self.accept_seen = np.zeros((len(DRAFTER_IDS), k, 2), np.float32)  # host copy (stats)
    self.costs = np.asarray([0.0] + [DEFAULT_COSTS[d] for d in DRAFTER_IDS[1:]]
                            + [0.0, DEFAULT_BASE, DEFAULT_PAD_ROW, DEFAULT_PER_TOKEN],
                            np.float32)
    self.cost_fit: dict[str, Any] = {}
    self.draft_cache = (place(init_cache(self.draft_cfg, num_pages, config.page_size, dtype))
                        if "draft" in self.enabled else None)
    self.k_steps = np.zeros((len(self.choices),), np.int64)
    # A speculative call's fixed cost beyond a plain call's, in plain-loop iterations (measured
    # at warm-up; 0 until then, as on a GPU where it is a fraction of one): `call_policy`.
    self.call_cost = 0.0
    self._speedups: dict[tuple, tuple] = {}  # `pays`' predictions, by what they came from
    self.rest = Rest()  # plain-loop calls left before the speculative loop probes again
    self._probe = False  # the next speculative call follows a rest: a short one
    self._auto_calls = 0  # loop calls with "auto" rows, and when each model drafter was
    self._offered: dict[str, int] = {}  # last offered to them (`model_drafters_for_auto`)
    self.per_drafter = {f"spec_{n}_{d}": 0 for d in self.enabled
                        for n in ("steps", "drafted", "accepted")}
    if "draft" in self.enabled:
      if pool is None or buckets is None:
        raise ValueError("SpecRuntime: drafter 'draft' needs the engine's pool and buckets")
      self.per_drafter.update(spec_draft_catch_up_steps=0, spec_draft_catch_up_tokens=0)
    self.per_position = np.zeros((2, k), np.int64)  # drafted, accepted tokens at each slot
    self.calibration = np.zeros((2,), np.float64)  # tokens expected / emitted when drafting
    # The cost model's calibration on live traffic: speculative calls' time as it predicts it
    # and as measured (wall time over a plain-loop iteration's, `record_plain`), in plain-loop
    # iterations; and that iteration's time per decode batch size (s).
    self.cost_seen = np.zeros((2,), np.float64)
    self.plain_iter_s: dict[int, float] = {}
    self._last_plain_s = 0.0  # the last plain call's time (`record_plain`)
    self._replay_s, self._replay_credit = 0.0, 0.0  # a replay's cost (moving average), budget
    self.replay_budget = REPLAY_BUDGET
    self.correction = LiveCorrection()  # measured / predicted, per kind of call (`live_costs`)

  @property
  def observes(self) -> bool:
    """Prefill chunks must feed the MTP layer: unless it is `hopeless`, when no row drafts
    with it (auto does not offer it, MTP rows give it up) and its upkeep would be wasted. (Were
    the live correction to bring it back, rows prefilled meanwhile would draft from stale MTP
    entries: rejected drafts, the output unchanged.)"""
    return "mtp" in self.enabled and "mtp" not in self.hopeless()

  def resolve(self, drafter: str | None) -> str | None:
    """A request's drafter (None: plain decoding); ValueError if the engine lacks it."""
    if drafter is None:
      return self.default
    if drafter == "off":
      return None
    if drafter == AUTO and self.enabled:
      return AUTO
    if drafter not in self.enabled:
      raise ValueError(f"drafter: {drafter!r} is not enabled on this engine (enabled: "
                       f"{', '.join(self.enabled) or 'none'})")
    return drafter

  def live_costs(self, models: bool = False) -> np.ndarray:
    """`costs` corrected by what speculative calls measured on live traffic
    (`live_correction.py`), for a call that keeps a model drafter current (`models`) or not.
    So drafting must beat plain decoding by what the warm-up's probes leave out."""
    return self.correction.costs(self.costs, models)

  @property
  def cost_scale(self) -> float:
    """The live correction of calls that keep no model drafter current (stats, tests)."""
    return self.correction.of(False)

  @property
  def model_cost_scale(self) -> float:
    """The live correction of calls that keep a model drafter current."""
    return self.correction.of(True)

  def adaptive_state(self) -> dict[str, Any]:
    """What the adaptive policy has learned, for a later engine of the same configuration
    (`set_adaptive_state`), so that an engine `generate_on_engine` builds again for a
    configuration whose kept engine was dropped goes on from where it was: the fitted costs, the
    plain-iteration unit and the live correction; the engine-wide acceptance counts; the rest
    and the exploration schedule of model drafters."""
    return dict(costs=self.costs.copy(), cost_fit=dict(self.cost_fit),
                call_cost=self.call_cost,
                plain_iter_s=dict(self.plain_iter_s), correction=self.correction.copy(),
                accept=np.array(self.accept_seen),
                rest=self.rest.left, rest_len=self.rest.length, probe=self._probe,
                auto_calls=self._auto_calls, offered=dict(self._offered))

  def set_adaptive_state(self, state: dict[str, Any]) -> None:
    self.costs, self.cost_fit = state["costs"].copy(), dict(state["cost_fit"])
    self.call_cost = state["call_cost"]
    self.plain_iter_s = dict(state["plain_iter_s"])
    self.correction = state["correction"].copy()
    self.accept_seen = np.array(state["accept"])
    self.accept = self._place_state(jnp.asarray(self.accept_seen))
    self.rest, self._probe = Rest(state["rest"], state["rest_len"]), state["probe"]
    self._auto_calls, self._offered = state["auto_calls"], dict(state["offered"])

  def plain_decode(self, params, cache, reqs, tokens, n_cached, table, sampling, stop_ids,
                   remaining, min_before, num_steps, *, impl: KernelChoice = REFERENCE,
                   logprobs: bool | None = None):
    """A decode-only step of `reqs` on the plain loop (`speculates` said no). Its tokens teach
    the learned table, in the loop's own program unless the call is replayed (`plain_calls`);
    with `adaptive_k`, rows with a drafter get what the deterministic drafters would have
    achieved on them when the replay's budget allows (`_replay_due`); its time is the cost
    model's unit (`record_plain`). Returns (out, counts, logprobs, cache) as `decode`.
    `reqs` empty: runs every program a plain call may run (warm-up); `logprobs` as `decode`'s."""
    b, warm_up = tokens.shape[0], not reqs
    replaying = warm_up or self._replay_due(reqs)
    args = (tokens, n_cached, table, sampling, stop_ids, remaining, min_before,
            np.int32(num_steps), wants_logprobs(reqs, logprobs))
    kw = dict(max_steps=self.config.max_decode_steps, cfg=self.cfg, impl=impl)
    started = time.perf_counter()
    with CompileCounter() as compiles:
      if self.table is not None and (warm_up or not replaying):
        context, rows = plain_calls.contexts(reqs, b)
        out, counts, _, lps, cache, self.table = plain_calls.decode_loop_learning(
            params, cache, *args, self.table, context, rows, **kw)
      if warm_up or self.table is None or replaying:
        out, counts, _, lps, cache = steps.decode_loop(params, cache, *args, **kw)
      out, counts, lps = jax.device_get((out, counts, lps))
    if not warm_up and not compiles.count:  # (a call that compiled is not timed)
      self.record_plain(b, int(counts.max()), time.perf_counter() - started)
    if replaying and self.config.adaptive_k and self.replay_budget > 0:
      self._replay(reqs, out, counts)
    if replaying and self.table is not None:
      self.table = plain_calls.learn_tokens(self.table, reqs, out, counts)
    return out, counts, lps, cache

  def _replay_due(self, reqs: Sequence[Any]) -> bool:
    """Whether this plain call is replayed: the time it and the earlier calls earned at
    `replay_budget` of their own covers the replay's measured cost (adaptive k, rows with a
    drafter)."""
    if not self.config.adaptive_k or self.replay_budget <= 0 or not any(
        r.drafter for r in reqs):
      return False
    self._replay_credit += self.replay_budget * self._last_plain_s
    return self._replay_credit >= self._replay_s

  def _replay(self, reqs: Sequence[Any], out: np.ndarray, counts: np.ndarray) -> None:
    """`plain_calls.replay`, timed for the replay's budget (`reqs` empty: compiles)."""
    started = time.perf_counter()
    with CompileCounter() as compiles:
      plain_calls.replay(self, reqs, out, counts)
    if not reqs:
      return
    spent = time.perf_counter() - started
    self.per_drafter["spec_replayed_calls"] = self.per_drafter.get("spec_replayed_calls", 0) + 1
    if not compiles.count:  # (one that compiled neither sets the cost nor spends)
      self._replay_s = spent if not self._replay_s else 0.8 * self._replay_s + 0.2 * spent
      self._replay_credit = max(self._replay_credit - spent, 0.0)

  def record_plain(self, b: int, iterations: int, seconds: float) -> None:
    """A plain decode-loop call of b rows: its time per iteration, the unit of the cost model
    (a moving average over full calls, `max_decode_steps` iterations, as at warm-up)."""
    self._last_plain_s = seconds
    if iterations == self.config.max_decode_steps:
      old = self.plain_iter_s.get(b)
      t = seconds / iterations
      self.plain_iter_s[b] = t if old is None else 0.8 * old + 0.2 * t

  # ---- programs ------------------------------------------------------------------------------

  def model_step(self, params, cache, tokens, start, n_new, table, sampling, next_tokens, *,
                 impl: KernelChoice = REFERENCE):
    """Returns (sampled, logprobs, MTP hidden [B, H] numpy or None, cache)."""
    return spec_model_step(params, cache, tokens, start, n_new, table, sampling, next_tokens,
                           cfg=self.cfg, impl=impl)

  def catch_up_draft(self, reqs: Sequence[Any], rows: np.ndarray, table: np.ndarray, *,
                     impl: KernelChoice = REFERENCE) -> None:
    """Fills the draft model's cache of `reqs[i]` where rows[i], from `draft_computed` to
    `num_computed` (`catch_up.py`); table [>= len(reqs), P] their page-table rows."""
    spans = [(i, r.draft_computed, r.num_computed - r.draft_computed)
             for i, r in enumerate(reqs) if rows[i] and r.draft_computed < r.num_computed]
    groups = catch_up.plan(spans, self.config.max_num_batched_tokens, self.config.max_num_seqs)
    ids = [r.all_ids for r in reqs]
    for group in groups:
      self.draft_cache = catch_up.draft_forward(
          self.draft_params, self.draft_cache, *catch_up.pack(group, ids, table,
                                                              self.buckets.pack),
          cfg=self.draft_cfg, impl=impl)
    self.per_drafter["spec_draft_catch_up_steps"] += len(groups)
    self.per_drafter["spec_draft_catch_up_tokens"] += sum(n for _, _, n in spans)

  def draft_fed(self, req: Any, upto: int) -> None:
    """`req`'s draft-model entries are valid below position `upto`: its full pages there are
    marked for prefix sharing."""
    req.draft_computed = upto
    self.pool.mark_draft_valid(req.pages[:upto // self.pool.page_size])

  def histories(self, reqs: Sequence[Any], b: int) -> tuple[np.ndarray, np.ndarray]:
    """[b, window + max_call_tokens] each request's last `ngram_window` tokens, and counts."""
    window = self.config.ngram_window
    return plain_calls.last_tokens(reqs, b, window, window + self.max_call_tokens)

  def decode(self, params, cache, reqs, tokens, n_cached, table, sampling, stop_ids, remaining,
             min_before, num_steps, counters: dict, *, impl: KernelChoice = REFERENCE,
             force_k: int | None = None, time_budget: float | None = None,
             logprobs: bool | None = None, warm_rows: Sequence[str] = ()):
    """A decode-only step of `reqs` (rows past them are padding): up to num_steps tokens per
    row in about `time_budget` plain-loop iterations (None: the tokens alone bound it;
    `budget`). `logprobs`: compute them (None: if a request wants them). `warm_rows` (reqs
    empty, warm-up): the drafters the rows take in turn. Returns (out, counts, logprobs as
    `steps.decode_loop`'s, cache)."""
    started, compiles = time.perf_counter(), CompileCounter()  # (a call that compiled: untimed)
    b, n_ids = tokens.shape[0], len(DRAFTER_IDS)
    history, history_len = self.histories(reqs, b)
    pad = [None] * (b - len(reqs))
    row_auto = np.asarray([r.drafter == AUTO for r in reqs] + [False] * len(pad))
    drafters = ([None if r.drafter == AUTO else r.drafter for r in reqs] + pad if reqs
                else [warm_rows[i % len(warm_rows)] if warm_rows else None for i in range(b)])
    row_drafter = np.asarray([drafter_id(d) for d in drafters], np.int32)
    row_max_draft = np.zeros((b,), np.int32)
    row_accept = np.zeros((b, n_ids, self.k, 2), np.float32)
    mtp_hidden = None
    if "mtp" in self.enabled:
      mtp_hidden = np.zeros((b, self.cfg.hidden_size), np.float32)
    models = (self.model_drafters_for_auto(reqs) if any(r.drafter == AUTO for r in reqs)
              else set())
    auto_allowed = np.asarray([d in DETERMINISTIC or d in models for d in DRAFTER_IDS])
    # Model drafters kept current in this call: those a row uses or "auto" may take; the
    # draft model only for those rows (`draft_rows`), each first caught up.
    feed = np.asarray([i > 0 and (d in models or bool((row_drafter == i).any()))
                       for i, d in enumerate(DRAFTER_IDS)])
    draft_rows = (row_drafter == drafter_id("draft")) | (row_auto & ("draft" in models))
    fed = any(feed[drafter_id(d)] for d in self.enabled if d not in DETERMINISTIC)
    live, scale = self.live_costs(fed), self.correction.of(fed)
    if draft_rows.any():
      with compiles:
        self.catch_up_draft(reqs, draft_rows, table, impl=impl)
    for d in self.enabled:  # loop calls that kept a model drafter current (its upkeep)
      if feed[drafter_id(d)]:
        self.per_drafter[f"spec_fed_calls_{d}"] = self.per_drafter.get(
            f"spec_fed_calls_{d}", 0) + 1
    for i, req in enumerate(reqs):
      row_max_draft[i] = req.sampling.max_draft_tokens or self.k
      if req.spec_accept is not None:
        row_accept[i] = req.spec_accept
      if mtp_hidden is not None and req.mtp_hidden is not None:
        mtp_hidden[i] = req.mtp_hidden
    with compiles:
      res, cache = speculative_decode_loop(
          params, cache, tokens, n_cached, table, sampling, stop_ids, remaining, min_before,
          np.int32(num_steps), np.float32(np.inf if time_budget is None else time_budget),
          history, history_len, row_drafter, row_auto, row_max_draft,
          row_accept, auto_allowed, feed, draft_rows, self.accept, live,
          np.int32(self.force_k if force_k is None else force_k),
          wants_logprobs(reqs, logprobs), self.table, mtp_hidden,
          self.draft_params, self.draft_cache, max_steps=self.max_call_tokens,
          choices=self.choices, drafters=self.enabled, cfg=self.cfg, draft_cfg=self.draft_cfg,
          impl=impl)
    self.accept, self.table, self.draft_cache = res.accept, res.table, res.draft_cache
    out, counts, spec, k_steps, mtp_h, lps, row_accept, by_drafter, self.accept_seen, calib = (
        jax.device_get((res.out, res.counts, res.stats, res.k_steps, res.mtp_hidden,
                        res.logprobs, res.row_accept, res.by_drafter, res.accept,
                        res.calibration)))
    self.calibration += calib[:2]
    # (catch-up and host work included: real costs; not a call that compiled, whose seconds
    # would count as hundreds of iterations in the calibration and the live correction)
    if reqs and b in self.plain_iter_s and not compiles.count:
      # (the loop priced its iterations with live_costs: T times scale; plus the call's own)
      predicted = float(calib[2]) / scale + self.call_cost
      measured = (time.perf_counter() - started) / self.plain_iter_s[b]
      self.cost_seen += predicted, measured
      if self.force_k < 0:
        self.correction.learn(predicted, measured, fed)
    self.k_steps += k_steps
    if not self.gated(reqs):  # (gated calls are decided by `pays`: the rests are not theirs)
      if self.force_k < 0 and k_steps[0] > 0 and not k_steps[1:].any():
        self.rest.after_speculating(gave_up=True)  # k = 0 throughout: rest
      elif k_steps[1:].any():
        self.rest.after_speculating(gave_up=False)
    self._probe = False
    counters["spec_steps"] += int(spec.steps.sum())
    counters["spec_drafted"] += int(spec.draft_tokens.sum())
    counters["spec_accepted"] += int(spec.accepted_tokens.sum())
    self.per_position += np.stack([spec.drafted_at.sum(0), spec.accepted_at.sum(0)])
    for i, req in enumerate(reqs):
      for j, x in enumerate((spec.drafted_steps, spec.draft_tokens, spec.accepted_tokens)):
        req.spec[j] += int(x[i])
      req.spec_accept = row_accept[i]
      for d in self.enabled:  # per drafter: verify steps, drafted and accepted tokens
        steps_, drafted, accepted = (int(x) for x in by_drafter[i, drafter_id(d)])
        if not steps_:
          continue
        req.drafter_steps[d] = req.drafter_steps.get(d, 0) + steps_
        self.per_drafter[f"spec_steps_{d}"] += steps_
        self.per_drafter[f"spec_drafted_{d}"] += drafted
        self.per_drafter[f"spec_accepted_{d}"] += accepted
        if row_auto[i]:  # row iterations in which "auto" chose d
          key = f"spec_auto_choice_{d}"
          self.per_drafter[key] = self.per_drafter.get(key, 0) + steps_
      if mtp_h is not None:
        req.mtp_hidden = mtp_h[i]
      if draft_rows[i]:  # the loop fed it every token and flushed
        self.draft_fed(req, req.num_computed + int(counts[i]))
    return out, counts, lps, cache

  def snapshot(self) -> serving_stats.SpecSnapshot:
    """What `stats` reports, copied as of now (the engine's per-step snapshot)."""
    return serving_stats.SpecSnapshot.of(self)

  def stats(self) -> dict[str, Any]:
    return serving_stats.spec_stats(self.snapshot())

  # ---- the cost model ------------------------------------------------------------------------

  def measure_costs(self, params, cache, batch_sizes: Sequence[int], max_pages: int, *,
                    stop_width: int, impl: KernelChoice = REFERENCE, rounds: int = 7):
    """Times the loops and forwards and fits the cost model (`serving_costs.
    measure_serving_costs`). Returns the cache (donated through)."""
    return serving_costs.measure_serving_costs(self, params, cache, batch_sizes, max_pages,
                                               stop_width=stop_width, impl=impl, rounds=rounds)
