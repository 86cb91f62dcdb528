"""The serving engine's speculative decoding: `SpecRuntime`, what `Engine` owns for it
(`engine.spec`), with or without drafters: the enabled drafters (`EngineConfig.speculative`,
the requests' default, and `EngineConfig.drafters`), each request's `RequestSpec`, the device
state carried across steps (learned table, engine-wide acceptance counts, the draft model's
paged cache), the cost table, and `decode`, every decode-only engine step.

A call speculates (`speculates`) when some row has a drafter, its batch is below the cost
table's break-even, it is long enough to win back a speculative call's fixed cost, and the
rows' estimates say the loop's first iteration would draft (or a row drafts with MTP, whose
cache must see every verified block). A batch kept plain by its estimates speculates once
every EXPLORE_EVERY calls, so stale estimates come back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import init_cache
from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache, forward
from engine.runtime import steps
from engine.runtime.buckets import ShapeBuckets
from engine.runtime.engine_config import EngineConfig
from engine.runtime.page_pool import PagePool
from engine.runtime.request import wants_logprobs
from engine.runtime.sampling import SamplingArrays, SamplingParams
from engine.runtime.speculative import catch_up, costs as cost_table, drafters as dr, goodput
from engine.runtime.speculative import learned
from engine.runtime.speculative.learned import NgramTable
from engine.runtime.speculative.loop import (AUTO, DETERMINISTIC, DRAFTER_IDS, drafter_id,
                                             speculative_decode_loop)

# A batch its estimates keep plain speculates once every this many of its calls: the loop's
# own evidence is what moves the estimates (an n-gram run that starts mid-request; a drafter
# whose last requests accepted little). Costs at most 1/8 of a call's overhead at k = 0 on
# fresh text (BENCHMARKS.md, "Speculative decoding, simplified"); other values not measured.
EXPLORE_EVERY = 8


@dataclasses.dataclass
class RequestSpec:
  """One request's speculative state (`Request.spec`; None for a request that drafts nothing)."""
  drafter: str  # ngram, learned, mtp, draft or auto
  accept: np.ndarray  # [D, J, 2] decayed (accepted, ended) counts per drafter and position
  drafts: int = 0  # verify steps with a draft
  drafted: int = 0  # drafted tokens
  accepted: int = 0  # accepted drafted tokens
  accepted_at: np.ndarray | None = None  # [J] verify steps whose draft j (0-based) was accepted
  drafter_steps: dict[str, int] = dataclasses.field(default_factory=dict)  # verify steps per d
  mtp_hidden: np.ndarray | None = None  # [H] MTP output at position num_computed - 1


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


@functools.partial(jax.jit, static_argnames=("max_steps", "cfg", "impl"),
                   donate_argnames=("cache", "table"))
def decode_loop_learning(params: Params, cache: Cache, tokens, n_cached, page_table, sampling,
                         stop_ids, remaining, min_before_stop, num_steps, want_logprobs,
                         table: NgramTable, context: jax.Array, learn_rows: jax.Array, *,
                         max_steps: int, cfg: ModelConfig, impl: KernelChoice = REFERENCE):
  """`steps.decode_loop`, then the table taught every new token of the rows `learn_rows` [B]
  after their `context` [B, C] (each row's last tokens before the call), in one program (as a
  program of its own the update costs a dispatch per call)."""
  out, count, stopped, lps, cache = steps.decode_loop(
      params, cache, tokens, n_cached, page_table, sampling, stop_ids, remaining,
      min_before_stop, num_steps, want_logprobs, max_steps=max_steps, cfg=cfg, impl=impl)
  cols = jnp.arange(max_steps, dtype=jnp.int32)
  positions = jnp.broadcast_to(context.shape[1] + cols, out.shape)
  valid = (cols[None, :] < count[:, None]) & learn_rows[:, None]
  table = learned.update(table, jnp.concatenate([context, out], axis=1), positions, valid)
  return out, count, stopped, lps, cache, table


def last_tokens(reqs: Sequence[Any], b: int, width: int, columns: int | None = None, *,
                right_align: bool = False) -> np.ndarray:
  """[b, columns or width] each request's last `width` tokens, oldest first (from column 0,
  or ending at column width - 1 with `right_align`), zeros elsewhere."""
  out = np.zeros((b, columns or width), np.int32)
  for i, req in enumerate(reqs):
    last = req.all_ids[-width:]
    start = width - len(last) if right_align else 0
    out[i, start:start + len(last)] = last
  return out


class SpecRuntime:
  """Speculative decoding state and programs of one `Engine` (see the module docstring)."""

  def __init__(self, cfg: ModelConfig, config: EngineConfig, num_pages: int, dtype: Any,
               draft: tuple[ModelConfig, Params] | None, place: Callable, place_state: Callable,
               pool: PagePool, buckets: ShapeBuckets):
    """`place`, `place_state`: commit the draft cache and device state like the engine's;
    `pool`, `buckets`: the engine's page pool and compiled shapes (decode batch sizes: the
    cost table's rows; mixed shapes: the draft model's catch-up)."""
    self.cfg, self.config, self.buckets = cfg, config, buckets
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
    # A speculative call's budget is time (`decode`): max_decode_steps iterations of k + 1.
    self.max_call_tokens = config.max_decode_steps * (k + 1)
    self.widths = (0, k) if config.adaptive_k else (k,)  # the loop's compiled block widths
    # Device state is committed where the weights are from the start (like the cache): a
    # commitment that changed after the first call would compile the loop twice.
    self.table = (place_state(NgramTable.empty(config.learned_table_slots))
                  if "learned" in self.enabled else None)
    self.accept = place_state(jnp.zeros((len(DRAFTER_IDS), k, 2), jnp.float32))
    self.accept_seen = np.zeros((len(DRAFTER_IDS), k, 2), np.float32)  # host copy
    self.draft_cache = (place(init_cache(self.draft_cfg, num_pages, config.page_size, dtype))
                        if "draft" in self.enabled else None)
    self.draft_entries = (catch_up.DraftEntries(pool.epoch, pool.page_size)
                          if "draft" in self.enabled else None)
    self.costs = cost_table.roofline(tuple(buckets.decode), self.widths,
                                     self._roofline_drafter_costs())
    self._plain_calls = 0  # plain calls in a row of batches with drafters (`speculates`)
    self._exploring = False  # the last `speculates` said yes to explore
    self.k_steps = np.zeros((len(self.widths),), np.int64)
    self.per_drafter = {f"spec_{n}_{d}": 0 for d in self.enabled
                        for n in ("steps", "drafted", "accepted", "auto_choice")}
    self.per_drafter.update(spec_plain_calls=0, spec_loop_calls=0, spec_explore_calls=0)
    if "draft" in self.enabled:
      self.per_drafter.update(spec_draft_catch_up_steps=0, spec_draft_catch_up_tokens=0)
    self.per_position = np.zeros((2, k), np.int64)  # drafted, accepted tokens at each slot
    self.calibration = np.zeros((2,), np.float64)  # tokens expected / emitted when drafting

  def _roofline_drafter_costs(self) -> list[float]:
    """Per drafted column, in plain iterations of the target: the MTP layer is one decoder
    layer of the target's; a draft model step reads its layers (by hidden size and depth)."""
    out = [0.0] * len(DRAFTER_IDS)
    out[drafter_id("mtp")] = 1.0 / max(self.cfg.num_layers, 1)
    if self.draft_cfg is not None:
      out[drafter_id("draft")] = (self.draft_cfg.num_layers * self.draft_cfg.hidden_size
                                  ) / (self.cfg.num_layers * self.cfg.hidden_size)
    return out

  @property
  def observes(self) -> bool:
    """Prefill chunks feed the MTP layer (its cache entries, each request's MTP hidden)."""
    return "mtp" in self.enabled

  def resolve(self, drafter: str | None) -> str | None:
    """A request's drafter (None: plain decoding); ValueError if the engine lacks it."""
    if drafter is None:
      return self.config.speculative
    if drafter == "off":
      return None
    if drafter == AUTO and self.enabled:
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

  def speculates(self, reqs: Sequence[Any], num_steps: int) -> bool:
    """Whether a decode-only call of `reqs` with a plain budget of `num_steps` iterations runs
    the speculative loop (see the module docstring)."""
    specs = [r.spec for r in reqs if r.spec is not None]
    if not specs or num_steps < self.costs.min_call_tokens:
      return False
    b = self.buckets.decode_rows(len(reqs))
    if not self.costs.pays_at_full_acceptance(b):
      return False
    self._exploring = False
    if (any(s.drafter == "mtp" for s in specs) or len(self.widths) == 1
        or self.first_iteration_drafts(reqs, b)):
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
                              (len(reqs), len(DRAFTER_IDS)))
    live = np.ones((len(reqs),), bool)
    ids, gain, column_cost = goodput.row_drafters(gains, step_cost[-1], drafter_cost, allowed,
                                                  row_auto, row_drafter, live, self.k, xp=np)
    room = np.asarray([min(self.k, r.sampling.max_draft_tokens or self.k) for r in reqs])
    block, _ = goodput.plan(gain, ids > 0, live, room, self.k, step_cost, column_cost,
                               xp=np)
    return bool(block)

  def _rows(self, specs: Sequence[RequestSpec | None]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row_auto [B] bool, row_drafter [B] int32, row_accept [B, D, K, 2]) of rows with these
    specs (None: no drafter)."""
    row_auto = np.asarray([s is not None and s.drafter == AUTO for s in specs])
    row_drafter = np.asarray([drafter_id(None if s is None or auto else s.drafter)
                              for s, auto in zip(specs, row_auto)], np.int32)
    zeros = np.zeros(self.accept_seen.shape, np.float32)
    return row_auto, row_drafter, np.stack([zeros if s is None else s.accept for s in specs])

  def _auto_allowed(self, any_auto: bool, b: int) -> np.ndarray:
    """[D] what "auto" rows of a b-row call may take: the deterministic drafters, and a model
    drafter that can beat plain decoding at full acceptance (every iteration it is fed pays
    its upkeep)."""
    out = np.zeros((len(DRAFTER_IDS),), bool)
    if any_auto:
      row = self.costs.index(b)
      for d in self.enabled:
        i = drafter_id(d)
        out[i] = d in DETERMINISTIC or self.costs.pays_at_full_acceptance(
            b, float(self.costs.drafter[row, i]))
    return out

  def decode(self, params, cache, reqs, tokens, n_cached, table, sampling, stop_ids, remaining,
             min_before, num_steps, counters: dict, *, speculate: bool,
             time_budget: float | None = None, impl: KernelChoice = REFERENCE,
             force_width: int = -1, logprobs: bool | None = None, warm_rows: Sequence[str] = ()):
    """A decode-only step of `reqs` (rows past them are padding): the speculative loop when
    `speculate` (up to num_steps tokens per row in about `time_budget` plain iterations), else
    the plain loop (num_steps tokens). `force_width`, `warm_rows` (reqs empty: warm-up and the
    cost table's timing): a forced block width index, the drafters rows take in turn.
    Returns (out, counts, logprobs as `steps.decode_loop`'s, cache)."""
    if not speculate:  # (a learned table still learns the call's tokens)
      fn, args, kw = self.plain_program(params, cache, reqs, tokens, n_cached, table, sampling,
                                        stop_ids, remaining, min_before, num_steps, impl=impl,
                                        logprobs=logprobs)
      if any(r.spec is not None for r in reqs):
        self._plain_calls += 1
        self.per_drafter["spec_plain_calls"] += 1
      out, counts, _, lps, cache, *table_out = fn(*args, **kw)
      self.table = table_out[0] if table_out else self.table
      return (*jax.device_get((out, counts, lps)), cache)
    b = tokens.shape[0]
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
    mtp_hidden = None
    if "mtp" in self.enabled:
      mtp_hidden = np.zeros((b, self.cfg.hidden_size), np.float32)
      for i, s in enumerate(specs):
        if s is not None and s.mtp_hidden is not None:
          mtp_hidden[i] = s.mtp_hidden
    auto_allowed = self._auto_allowed(bool(row_auto.any()), b)
    # Model drafters kept current in this call: those a row uses or "auto" may take; the
    # draft model only for those rows, each first caught up.
    feed = np.asarray([i > 0 and d not in DETERMINISTIC for i, d in enumerate(DRAFTER_IDS)]) & (
        auto_allowed | np.isin(np.arange(len(DRAFTER_IDS)), row_drafter))
    draft_rows = (row_drafter == drafter_id("draft")) | (row_auto & bool(
        auto_allowed[drafter_id("draft")]))
    if draft_rows.any() and reqs:
      self.catch_up_draft(reqs, draft_rows, table, impl=impl)
    junk = not reqs  # (warm-up, timing: rows of junk must teach nothing)
    table_in = (jax.tree.map(jnp.copy, self.table) if junk and self.table is not None
                else self.table)
    res, cache = speculative_decode_loop(
        params, cache, tokens, n_cached, table, sampling, stop_ids, remaining, min_before,
        np.int32(num_steps), np.float32(np.inf if time_budget is None else time_budget),
        history, history_len, row_drafter, row_auto, row_max_draft, row_accept, auto_allowed,
        feed, draft_rows, self.accept, self.costs.costs(b), np.int32(force_width),
        wants_logprobs(reqs, logprobs), table_in, mtp_hidden, self.draft_params,
        self.draft_cache, max_steps=self.max_call_tokens, widths=self.widths,
        drafters=self.enabled, cfg=self.cfg, draft_cfg=self.draft_cfg, impl=impl)
    self.draft_cache = res.draft_cache
    if junk:
      return (*jax.device_get((res.out, res.count, res.lps)), cache)
    self.accept, self.table = res.accept, res.table
    out, counts, slots, k_steps, mtp_h, lps, row_accept, by_drafter, accept_seen, calib = (
        jax.device_get((res.out, res.count, res.slots, res.k_steps, res.mtp_hidden, res.lps,
                        res.row_accept, res.by_drafter, res.accept, res.calibration)))
    self.accept_seen = accept_seen
    self.calibration += calib[:2]
    self.k_steps += k_steps
    totals = by_drafter.sum(1)  # [B, 3] verify steps, drafted and accepted tokens
    for name, n in zip(("spec_steps", "spec_drafted", "spec_accepted"), totals.sum(0)):
      counters[name] += int(n)
    self.per_position += slots.sum(0)
    for i, (req, s) in enumerate(zip(reqs, specs)):
      if draft_rows[i]:  # the loop fed it every token and flushed
        self.draft_entries.written(req.pages, req.num_computed + int(counts[i]))
      if s is None:
        continue
      s.drafts += int(slots[i, 0, 0])  # (a step that drafted at all drafted slot 0)
      s.drafted += int(totals[i, 1])
      s.accepted += int(totals[i, 2])
      s.accepted_at += slots[i, 1]
      s.accept = row_accept[i]
      if mtp_h is not None:
        s.mtp_hidden = mtp_h[i]
      for d in self.enabled:
        if by_drafter[i, drafter_id(d), 0]:
          s.drafter_steps[d] = s.drafter_steps.get(d, 0) + int(by_drafter[i, drafter_id(d), 0])
    for d in self.enabled:  # per drafter: verify steps, drafted and accepted tokens
      per_row = by_drafter[:, drafter_id(d)]  # [B, 3]
      for name, n in zip(("steps", "drafted", "accepted"), per_row.sum(0)):
        self.per_drafter[f"spec_{name}_{d}"] += int(n)
      self.per_drafter[f"spec_auto_choice_{d}"] += int(per_row[row_auto, 0].sum())
    return out, counts, lps, cache

  def plain_program(self, params, cache, reqs, tokens, n_cached, table, sampling, stop_ids,
                    remaining, min_before, num_steps, *, impl, logprobs):
    """The plain decode loop's jitted program and its arguments, (fn, args, kwargs): the one
    `decode` runs (with a learned table, the loop that also learns the call's tokens), and
    what warm-up compiles ahead (`warmup.py`)."""
    args = (params, cache, tokens, n_cached, table, sampling, stop_ids, remaining, min_before,
            np.int32(num_steps), wants_logprobs(reqs, logprobs))
    kw = dict(max_steps=self.config.max_decode_steps, cfg=self.cfg, impl=impl)
    if self.table is None:
      return steps.decode_loop, args, kw
    context = last_tokens(reqs, tokens.shape[0], max(learned.ORDERS), right_align=True)
    rows = np.arange(tokens.shape[0]) < len(reqs)
    return decode_loop_learning, (*args, self.table, context, rows), kw

  def catch_up_draft(self, reqs: Sequence[Any], rows: np.ndarray, table: np.ndarray, *,
                     impl: KernelChoice = REFERENCE) -> None:
    """Fills the draft model's cache of `reqs[i]` where rows[i], from the positions whose
    entries are valid (`DraftEntries`) to `num_computed` (`catch_up.py`); table
    [>= len(reqs), P] their page-table rows."""
    spans = []
    for i, r in enumerate(reqs):
      done = min(self.draft_entries.computed(r.pages), r.num_computed)
      if rows[i] and done < r.num_computed:
        spans.append((i, done, r.num_computed - done))
    groups = catch_up.plan(spans, self.config.max_num_batched_tokens, self.config.max_num_seqs)
    ids = [r.all_ids for r in reqs]
    for group in groups:
      self.draft_cache = catch_up.draft_forward(
          self.draft_params, self.draft_cache, *catch_up.pack(group, ids, table,
                                                              self.buckets.pack),
          cfg=self.draft_cfg, impl=impl)
    self.per_drafter["spec_draft_catch_up_steps"] += len(groups)
    self.per_drafter["spec_draft_catch_up_tokens"] += sum(n for _, _, n in spans)

  def measure_costs(self, params, cache, max_pages: int, *, stop_width: int,
                    impl: KernelChoice = REFERENCE, rounds: int = 5,
                    iterations: int = EngineConfig.max_decode_steps) -> Cache:
    """Times the plain and speculative loops at every decode bucket and block width (rows
    on the null page: nothing real is read or written), calls of `iterations` (at most
    max_decode_steps; default a serving engine's) and of 1, and installs the table. Returns
    the cache (donated through)."""
    n = min(iterations, self.config.max_decode_steps)
    state = {"cache": cache}
    rng = np.random.default_rng(0)
    context = max(max_pages * self.config.page_size // 4 - n * (self.k + 1), 0)

    def rows(b, n_steps):
      return (rng.integers(0, self.cfg.vocab_size, (b,), dtype=np.int32),
              np.full((b,), context, np.int32), np.zeros((b, max_pages), np.int32),
              SamplingArrays.from_params([SamplingParams()] * b),
              np.full((b, stop_width), -1, np.int32), np.full((b,), n_steps, np.int32),
              np.zeros((b,), np.int32))

    def run(b, n_steps, speculate, force_width=-1, drafter=None):
      out, _, _, state["cache"] = self.decode(
          params, state["cache"], [], *rows(b, n_steps), n_steps, {}, speculate=speculate,
          impl=impl, force_width=force_width, warm_rows=(drafter,) if drafter else ())
      return out

    model = [d for d in self.enabled if d not in DETERMINISTIC]
    self.costs = cost_table.measure(
        self.costs.batch_sizes, self.widths, model, [drafter_id(d) for d in model],
        len(DRAFTER_IDS), n, lambda b, m: run(b, m, False),
        lambda b, m, c, d: run(b, m, True, c, d), rounds=rounds)
    if self.draft_cache is not None:
      self.draft_cache = _cleared_null_page(self.draft_cache)
    return _cleared_null_page(state["cache"])

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


def _cleared_null_page(cache: Cache) -> Cache:
  """The cache with page 0 zeroed again (the timing calls wrote junk there)."""
  return [{k: v.at[0].set(0) for k, v in layer.items()} for layer in cache]
