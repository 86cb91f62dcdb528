"""The serving engine: a stream of requests in, incremental outputs out.

    eng = Engine.from_model(engine.load("checkpoints/demo/target"), EngineConfig())
    eng.warmup()                                   # compiles every shape bucket, once
    rid = eng.add_request("def f(x):", SamplingParams(), StopParams(max_tokens=32))
    while eng.has_unfinished():
      for out in eng.step():                       # RequestOutput: new ids, text delta, reason
        ...
    eng.abort(rid)                                 # any time; its pages return at once

The engine is the core: requests, the scheduler, the page pool, the speculative policy and the
outputs. Each `step` asks the scheduler for work, lays it out as step descriptions
(`batching.py`: host arrays only) and hands them to its model runner (`runner.py`: compiled
programs and the device cache), which runs one program (`model_step` for prefill chunks mixed
with decodes, or a decode loop for several decode iterations when the batch is stable); then
the host-side part: append tokens, check stops (token ids on the device, stop strings here
after detokenisation), publish full pages to the prefix cache, and emit deltas. `add_request`,
`abort`, `release`, `stats` and `queue_load` may be called from other threads and never wait
for a device step (adds and aborts go through an inbox).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax

from engine.model.cache import cache_bytes_per_token
from engine.model.config import ModelConfig
from engine.model.kernels import AUTO
from engine.model.params import Params
from engine.model.sharding import shard_head
from engine.runtime import batching, compile_cache, kv_sizing, structured, warmup
from engine.runtime.buckets import TrafficStats, default_row_widths, derive_buckets
from engine.runtime.engine_config import EngineConfig, with_kernels_resolved
from engine.runtime.multimodal import ImageInput, check_spans
from engine.runtime.multimodal_step import ImageEncoder
from engine.runtime.grammar import compile_grammar
from engine.runtime.outputs import append_tokens, logprob_entry, request_output
from engine.runtime.page_pool import PagePool
from engine.runtime.request import (FINISH_ABORT, FINISH_STOP, Request, RequestOutput,
                                    MAX_STOP_IDS, StopParams, TokenLogprob,
                                    check_stop_and_room, wants_logprobs)
from engine.runtime.runner import ModelRunner
from engine.runtime.sampling import SamplingParams
from engine.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.runtime.speculative import drafters as drafter_registry
from engine.runtime.speculative.policy import SpecPolicy
from engine.runtime.step_description import MASKED, StepDescription


@dataclasses.dataclass(frozen=True)
class QueueLoad:
  requests: int  # waiting (not running) requests
  tokens: int  # their tokens not yet in the cache


class Engine:
  """Continuous-batching engine over one model replica."""

  def __init__(self, cfg: ModelConfig, params: Params, config: EngineConfig = EngineConfig(),
               tokenizer: Any = None, eos_token_ids: Sequence[int] = (), mesh: Any = None,
               draft: tuple[ModelConfig, Params] | None = None,
               head: tuple[Any, Params] | None = None):
    """`mesh`: the `jax.sharding.Mesh` the parameters are placed on (`engine.model.sharding`);
    the cache is placed by the same module's rules and every program runs under it.
    `draft`: (config, params) of a draft model with the target's vocabulary (drafter "draft").
    `head`: (Eagle3Config, params) of an EAGLE-3 head (`eagle3_loader.load_eagle3`; drafter
    "eagle3")."""
    config = with_kernels_resolved(config, cfg, params, mesh)  # "auto" -> this device's
    self.cfg, self.params, self.config, self.mesh = cfg, params, config, mesh
    self.tokenizer = tokenizer
    self.chat_template: Any = None  # the model's (`engine.load`), for the servers' chat APIs
    # With a vision tower: `image_processing.ImageProcessorConfig` (the edge preprocesses).
    self.image_processor: Any = None
    self.eos_token_ids = tuple(eos_token_ids)
    compile_cache.enable(config.compilation_cache_dir)
    max_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_len > cfg.max_position_embeddings:
      raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                       f"({cfg.max_position_embeddings})")
    self.sched_config = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=config.max_num_batched_tokens,
                                        max_model_len=max_len)
    self.max_pages_per_seq = -(-max_len // config.page_size)
    draft_cfg = draft[0] if draft is not None else None
    wanted = ({config.speculative} if config.speculative not in (None, drafter_registry.AUTO)
              else set()) | set(config.drafters)
    if config.speculative == drafter_registry.AUTO and not wanted:
      raise ValueError("EngineConfig.speculative='auto' chooses among EngineConfig.drafters, "
                       "which is empty")
    drafters = drafter_registry.build(wanted, cfg, config, draft_cfg,
                                      head_cfg=head[0] if head is not None else None)
    own = {d.name: draft[1] for d in drafters if d.uses_draft_model}
    # (on a mesh, the head's weights split as a target layer of its kind: `shard_head`)
    own.update({d.name: head[1] if mesh is None else shard_head(head[0].layer, head[1], mesh)
                for d in drafters if d.uses_head})
    # (drafters' own cache entries, an EAGLE-3 head's KV, take pages' room too)
    self._extra_entries = tuple(e for d in drafters for e in d.cache_entries())
    dtype = config.cache_dtype or params["embed"].dtype
    devices = jax.tree.leaves(params)[0].sharding.device_set
    num_pages = kv_sizing.agree_num_pages(
        config.num_pages or self._default_num_pages(dtype, devices), bool(config.num_pages))
    self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_cache)
    # (drafters' entries only some forwards write: pages record which they hold)
    self.scheduler = Scheduler(self.sched_config, self.pool,
                               observers=[d.name for d in drafters if d.observes_prefill])
    self.runner = ModelRunner(cfg, params, config, num_pages=num_pages, cache_dtype=dtype,
                              mesh=mesh, drafters=drafters, own_params=own)
    self.traffic = TrafficStats()
    platform = next(iter(self.runner.devices)).platform
    self.buckets = derive_buckets(
        self.sched_config, config.row_widths or default_row_widths(platform),
        TrafficStats.load(config.traffic_stats_path), config.decode_batch_sizes)
    # The speculative policy (None: no drafters; decode calls run the plain loop).
    self.spec = SpecPolicy(cfg, config, drafters, self.pool, self.buckets) if drafters else None
    # Threads: one thread steps; any thread may add, abort, release and read stats. `_lock`
    # (held for a whole step) guards the scheduler, pool and cache; `_inbox_lock` (held for
    # microseconds) guards what other threads touch: the request table, the inbox of adds and
    # aborts, pending outputs and the last stats snapshot. Adds and aborts land in the inbox
    # and are applied at the start of the next step, or at once when no step is running.
    self.requests: dict[str, Request] = {}
    self._inbox: list[Request] = []
    self._aborts: list[str] = []
    self._pending: list[RequestOutput] = []  # outputs produced outside a step (aborts)
    self._lock = threading.RLock()
    self._inbox_lock = threading.Lock()
    self._snapshot: dict[str, Any] = {}
    self._order = itertools.count()
    self._decode_steps = 1
    self._speculates = False  # whether the next decode-only call speculates
    self._last_batch: tuple[str, ...] = ()
    self._closed_batch = False  # `generate` runs a batch no request joins: no ramp
    self.counters = dict(prompt_tokens=0, generation_tokens=0, steps=0, decode_loops=0,
                         finished_stop=0, finished_length=0, finished_abort=0)
    self.images = ImageEncoder(cfg, params, config.encoder_cache_bytes, self.counters,
                               self.runner.execute)
    if self.spec is not None:
      self.counters.update(spec_steps=0, spec_drafted=0, spec_accepted=0)
    self.constrained = structured.ConstrainedRows(
        cfg.vocab_size, config.ngram_window, config.num_draft_tokens,
        device=tuple(d.name for d in self.runner.constrained_drafters))
    self._take_snapshot()

  @staticmethod
  def from_model(model: Any, config: EngineConfig = EngineConfig(),
                 draft_model: Any = None, head: tuple[Any, Params] | None = None) -> "Engine":
    """From an `engine.load` result (and a loaded draft model for drafter "draft", a loaded
    EAGLE-3 head (config, params) for drafter "eagle3")."""
    eng = Engine(model.config, model.params, dataclasses.replace(config, kernels=model.kernels)
                 if config.kernels == AUTO else config, model.tokenizer,
                 model.eos_token_ids, mesh=getattr(model, "mesh", None),
                 draft=None if draft_model is None else (draft_model.config,
                                                         draft_model.params), head=head)
    eng.chat_template = getattr(model, "chat_template", None)
    if eng.images.pad_id is not None:
      eng.image_processor = getattr(model, "image_processor", None)
      if eng.image_processor is None and getattr(model, "path", ""):
        from engine.model.image_processing import ImageProcessorConfig
        eng.image_processor = ImageProcessorConfig.from_dir(model.path)
    return eng

  @property
  def cache(self) -> Any:
    """The device KV cache (the runner's)."""
    return self.runner.cache

  @cache.setter
  def cache(self, value: Any) -> None:
    self.runner.cache = value

  @property
  def drafters(self) -> tuple[str, ...]:
    """The drafters this engine enables (their names)."""
    return self.spec.enabled if self.spec is not None else ()

  @property
  def k(self) -> int:
    """Drafts per speculative iteration (0: no drafters)."""
    return self.spec.k if self.spec is not None else 0

  def _default_num_pages(self, dtype: Any, devices: Any) -> int:
    """From the free memory of this process's devices (`kv_sizing`); without memory
    statistics (CPU), room for every sequence at full length, plus the null page."""
    return kv_sizing.pages_for(
        kv_sizing.free_device_bytes(devices),
        cache_bytes_per_token(self.cfg, dtype, self._extra_entries) * self.config.page_size,
        self.config.kv_cache_memory_fraction,
        self.sched_config.max_num_seqs * self.max_pages_per_seq + 1)

  # ---- requests ------------------------------------------------------------------------------

  def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams = SamplingParams(),
                  stop: StopParams = StopParams(), request_id: str | None = None,
                  images: Sequence[ImageInput] = ()) -> str:
    """Queues a request; raises ValueError naming the offending field on bad input.
    `images`: its images, each on its own run of media_pad ids in the prompt
    (`engine.service.images.to_inputs` makes the runs and the inputs)."""
    ids = self._encode(prompt)
    images = tuple(images)
    check_spans(ids, images, self.images.pad_id)
    refusal = self.spec.refuses_images() if self.spec is not None else None
    if images and refusal:
      raise ValueError(refusal)
    sampling.validate()
    spec = self._request_spec(sampling.drafter)
    matcher = None
    if sampling.structured_outputs is not None:  # GrammarError (a ValueError) with the reason
      matcher = self.compile_grammar(sampling.structured_outputs).matcher()
    stop_ids = check_stop_and_room(
        ids, stop, self.eos_token_ids, vocab_size=self.cfg.vocab_size,
        max_model_len=self.sched_config.max_model_len, page_size=self.config.page_size,
        usable_pages=self.pool.num_pages - 1)
    with self._inbox_lock:
      rid = request_id if request_id is not None else f"req-{next(self._order)}"
      if rid in self.requests:
        raise ValueError(f"request_id: {rid!r} is already in use")
      req = Request(request_id=rid, prompt_ids=ids, sampling=sampling, stop=stop,
                    stop_ids=stop_ids, arrival_order=next(self._order), spec=spec,
                    images=images, grammar=matcher, thought=sampling.thought())
      self.requests[rid] = req
      self._inbox.append(req)
    self._apply_inbox_if_idle()
    return rid

  def _request_spec(self, drafter: str | None) -> Any:
    """The request's speculative state (None: it drafts nothing); ValueError naming `drafter`
    for one this engine lacks."""
    if self.spec is not None:
      return self.spec.request_state(self.spec.resolve(drafter))
    if drafter not in (None, drafter_registry.OFF):
      raise ValueError(f"drafter: {drafter!r} is not enabled on this engine (enabled: none)")
    return None

  def compile_grammar(self, spec: Any) -> Any:
    """`grammar.compile_grammar` for this engine's tokenizer, vocabulary and EOS ids (cached;
    the edges may call it to validate a request: GrammarError with the reason)."""
    return compile_grammar(spec, self.tokenizer, vocab_size=self.cfg.vocab_size,
                           eos_token_ids=self.eos_token_ids)

  def _encode(self, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("prompt: this model has no tokenizer; pass token ids")
      ids = list(self.tokenizer.encode(prompt).ids)
    else:
      ids = [int(t) for t in prompt]
      bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
      if bad:
        raise ValueError(f"prompt: token id {bad[0]} outside the vocabulary [0, "
                         f"{self.cfg.vocab_size})")
    if not ids:
      raise ValueError("prompt: must contain at least one token")
    return ids

  def abort(self, request_id: str) -> bool:
    """Ends a request: at once when no step is running, else when the current step ends (its
    pages return to the pool then). False if unknown, already finished or already aborted.
    A request that finishes within the current step keeps its own finish reason."""
    with self._inbox_lock:
      req = self.requests.get(request_id)
      if req is None or req.finished or request_id in self._aborts:
        return False
      self._aborts.append(request_id)
    self._apply_inbox_if_idle()
    return True

  def settle(self) -> list[RequestOutput]:
    """Carries out queued adds and aborts and returns the pending updates without running the
    model: what a stopping loop calls so an abort queued during its last step is not lost."""
    with self._lock:
      self._apply_inbox()
      with self._inbox_lock:
        outputs, self._pending = self._pending, []
      return outputs

  def has_unfinished(self) -> bool:
    with self._inbox_lock:
      if self._inbox or self._aborts or self._pending:
        return True
    return self.scheduler.has_work()

  def release(self, request_id: str) -> None:
    """Forgets a finished request (the engine keeps them until told, for late lookups)."""
    with self._inbox_lock:
      req = self.requests.get(request_id)
      if req is not None and req.finished:
        del self.requests[request_id]

  def _apply_inbox_if_idle(self) -> None:
    if self._lock.acquire(blocking=False):
      try:
        self._apply_inbox()
      finally:
        self._lock.release()

  def _apply_inbox(self) -> None:
    """Moves queued adds into the scheduler and carries out queued aborts (step lock held)."""
    with self._inbox_lock:
      adds, self._inbox = self._inbox, []
      aborts, self._aborts = self._aborts, []
    for req in adds:
      self.scheduler.add(req)
      self.counters["prompt_tokens"] += len(req.prompt_ids)
    for rid in aborts:
      req = self.requests.get(rid)
      if req is not None and not req.finished:
        self._finish(req, FINISH_ABORT)
        out = request_output(req, [])
        with self._inbox_lock:
          self._pending.append(out)
    if aborts:
      self._take_snapshot()
    elif adds:  # only the waiting queue changed: a full snapshot per add is O(n^2) in a burst
      with self._inbox_lock:
        snap = self._snapshot
        snap["num_requests_waiting"] += len(adds)
        snap["waiting_tokens"] += sum(r.num_uncomputed for r in adds)
        snap["prompt_tokens"] = self.counters["prompt_tokens"]

  # ---- the step ------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Runs one scheduled step; returns an update for every request that changed."""
    with self._lock:
      self._apply_inbox()
      with self._inbox_lock:
        outputs, self._pending = self._pending, []
      plan = self.scheduler.schedule(self._next_decode_steps())
      if not plan.segments and not plan.constrained:
        return outputs
      now = time.monotonic()
      reqs = [seg.request for seg in plan.segments] + plan.constrained
      for req in reqs:
        if req.timings.first_scheduled is None:
          req.timings.first_scheduled = now
      sent = {req.request_id: len(req.output_ids) for req in reqs}
      # Constrained rows' masks are computed on the worker thread while the main program runs
      # (`structured.py`), here when there is none (a thread hand-off costs ~3 ms on the CPU);
      # their masked step follows it.
      masks = None
      if plan.constrained:
        limits = structured.draft_limits(plan.constrained, self.scheduler, self.k,
                                         self.constrained.device)
        masks = (self.constrained.start(plan.constrained, limits) if plan.segments
                 else self.constrained.now(plan.constrained, limits))
      if plan.decode_only:
        self._run_decode_loop(plan)
      elif plan.segments:
        self._run_model_step(plan)
      if masks is not None:
        self._run_masked_step(self.constrained.wait(masks))
      self.counters["steps"] += 1
      for req in reqs:
        new = req.output_ids[sent[req.request_id]:]
        if new or req.finished:
          outputs.append(request_output(req, new))
      self._take_snapshot()
      return outputs

  def _next_decode_steps(self) -> int:
    """Adaptive loop length: 1 while requests wait or after one joined the batch, doubling
    while none does. Requests that leave do not restart it: nothing waits to be let in, and the
    rows left (often speculative ones, whose lengths drift apart) would finish in a ramp of
    short calls, each paying a call's fixed cost (the CPU demo: 1- and 2-token calls for the
    last row). Returns the call's token budget: a speculative call gets the plain call's time
    and up to num_draft_tokens + 1 tokens per iteration of it."""
    batch = tuple(r.request_id for r in self.scheduler.running)
    loop_rows = [r for r in self.scheduler.running if not r.constrained]
    if self._closed_batch and not self.scheduler.waiting:
      self._decode_steps = self.config.max_decode_steps  # nothing else can join (`generate`)
    elif self.scheduler.waiting or not set(batch) <= set(self._last_batch):
      self._decode_steps = 1
    else:
      self._decode_steps = min(self._decode_steps * 2, self.config.max_decode_steps)
    if len(loop_rows) < len(self.scheduler.running):  # constrained rows: 1 token per call
      self._decode_steps = min(self._decode_steps, self.config.constrained_decode_steps)
    self._last_batch = batch
    self._speculates = (self.spec is not None
                        and self.spec.speculates(loop_rows, self._decode_steps))
    return self._decode_steps * ((self.k + 1) if self._speculates else 1)

  def _run_model_step(self, plan: SchedulerOutput) -> None:
    b, w = self.buckets.pack([s.num_tokens for s in plan.segments])
    self.traffic.record_mixed([s.num_tokens for s in plan.segments])
    features = self.images.block_features(plan.segments, w, b)  # encodes what is missing
    observers = self.spec.observers if self.spec is not None else ()
    desc, last_rows = batching.mixed(plan.segments, b, w, self.max_pages_per_seq,
                                     observe=bool(observers), features=features)
    out = self.runner.execute(desc)
    sampled, lps = out["sampled"], out["lps"]
    for seg, row in zip(plan.segments, last_rows):
      req = seg.request
      # Drafters' row state after the segment's last position: where it samples, or where a
      # constrained row's prefill ends (its newest token waits for the masked step).
      if req.spec is not None and (seg.samples or (
          req.constrained and seg.start + seg.num_tokens == req.num_tokens - 1)):
        for d in observers:
          req.spec.rows[d.name] = out[f"rows.{d.name}"][row]
      if not seg.samples:
        self._advance(req, seg.start + seg.num_tokens, [])
        continue
      self._advance(req, seg.start + seg.num_tokens, [int(sampled[row])],
                    [logprob_entry(req, lps, (row,))])

  def _run_decode_loop(self, plan: SchedulerOutput) -> None:
    reqs = [s.request for s in plan.segments]
    b = self.buckets.decode_rows(len(reqs))
    self.traffic.record_decode(len(reqs))
    self.counters["decode_loops"] += 1
    plain = batching.decode(reqs, b, self.max_pages_per_seq, MAX_STOP_IDS,
                            remaining=[self.scheduler.remaining_tokens(r) for r in reqs],
                            num_steps=plan.num_steps)
    if self._speculates:  # (logprobs come from the verify logits)
      pre, desc, fed = self.spec.describe(reqs, plain, self._decode_steps,
                                          shape=self.buckets.pack)
      for p in pre:
        self.runner.execute(p)
      out = self.runner.execute(desc)
      self.spec.apply(reqs, out, fed, self.counters)
      observed = [self.spec.fed_names(fed[i]) for i in range(len(reqs))]
    else:
      out = self.runner.execute(batching.with_learner_inputs(plain, self.runner.learners, reqs))
      if self.spec is not None:
        self.spec.count_plain(reqs)
      observed = [frozenset()] * len(reqs)  # (the plain loop writes no drafter's entries)
    tokens, counts, lps = out["out"], out["count"], out["lps"]
    for i, req in enumerate(reqs):
      n = int(counts[i])
      self._advance(req, req.num_computed + n, [int(t) for t in tokens[i, :n]],
                    None if req.sampling.logprobs is None
                    else [logprob_entry(req, lps, (i, j)) for j in range(n)], observed[i])

  def _run_masked_step(self, prep: structured.Prepared) -> None:
    """The masked step of constrained rows (`steps.masked_step`), then their matchers and
    stop rules."""
    reqs = prep.reqs
    b = self.buckets.decode_rows(len(reqs))
    tokens, start, n_draft, table, bits = self.constrained.arrays(
        prep, b, self.max_pages_per_seq, self.config.page_size,
        lambda r: batching.page_table_row(r, self.max_pages_per_seq))
    device = self.runner.constrained_drafters
    observed = frozenset(d.name for d in device)  # (the masked step writes their entries)
    out = self.runner.execute(StepDescription(
        MASKED, dict(tokens=tokens, start=start, n_draft=n_draft, page_table=table,
                     bitmask=bits, **batching.sampling(reqs + [None] * (b - len(reqs))),
                     **(self.constrained.device_arrays(
                         prep, b, {d.name: d.row_width() for d in device}) if device else {})),
        dict(want_logprobs=bool(wants_logprobs(reqs)))))
    emitted_all, counts, lps = out["out"], out["count"], out["lps"]
    c = self.constrained.counters
    c["structured_steps"] += 1
    for i, req in enumerate(reqs):
      n, drafted = int(counts[i]), int(n_draft[i])
      emitted = [int(t) for t in emitted_all[i, :n]]
      c["structured_tokens"] += n
      if drafted:
        self.constrained.count_drafts(req, prep.drafters[i], drafted, n - 1,
                                      self.counters if self.spec is not None else None,
                                      self.spec.per_drafter if self.spec is not None else None)
      if device and req.spec is not None:  # (the next step's drafts follow the new newest)
        for d in device:
          req.spec.rows[d.name] = out[f"rows.{d.name}"][i]
        req.spec.proposed = (req.num_computed + n, [int(t) for t in out["drafts"][i]])
      for tok in emitted:
        if not req.grammar.accept(tok):  # cannot happen: every emitted token was allowed
          raise RuntimeError(f"{req.request_id}: token {tok} outside the grammar's mask "
                             f"({req.grammar.error()})")
      self._advance(req, req.num_computed + n, emitted,
                    None if req.sampling.logprobs is None
                    else [logprob_entry(req, lps, (i, j)) for j in range(n)], observed)
      if not req.finished and req.grammar.is_terminated():
        req.stop_reason = None
        self._finish(req, FINISH_STOP)

  # ---- host-side token handling (the rules: `outputs.py`) ------------------------------------

  def _advance(self, req: Request, num_computed: int, new_ids: list[int],
               logprobs: list[TokenLogprob | None] | None = None,
               observed: frozenset[str] | None = None) -> None:
    """Records a step's result: new tokens, cache progress (full pages join the prefix cache,
    also when the request ends here; `observed`: the drafters whose entries the step wrote,
    None: all), then the finish if a stop rule fired."""
    before = len(req.output_ids)
    reason = append_tokens(req, new_ids, logprobs, self.tokenizer,
                           self.sched_config.max_model_len)
    self.counters["generation_tokens"] += len(req.output_ids) - before
    self.scheduler.record_computed(req, num_computed, observed)
    if req.image_features:  # prefilled past an image: its features are not needed again
      for i in [i for i in req.image_features if req.images[i].end <= req.num_computed]:
        del req.image_features[i]
    if reason is not None:
      self._finish(req, reason)

  def _finish(self, req: Request, reason: str) -> None:
    self.scheduler.finish(req, reason)
    req.image_features.clear()
    req.timings.finished = time.monotonic()
    self.counters[f"finished_{reason}"] += 1

  # ---- conveniences --------------------------------------------------------------------------

  def run(self) -> Iterator[RequestOutput]:
    """Steps until no work is left, yielding every update."""
    while self.has_unfinished():
      yield from self.step()

  def generate(self, prompts: Sequence[str | Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               stop: StopParams | Sequence[StopParams] = StopParams(), *,
               closed: bool = False) -> list[Request]:
    """Runs a batch of prompts to completion through the scheduler; returns the finished
    requests (and forgets them: `Engine.requests` keeps only what streaming callers release).
    `closed`: no other request joins while these run (`llm.py`), so decode calls take
    `max_decode_steps` from the first (the ramp exists to let arrivals in)."""
    n = len(prompts)
    samp = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
    stops = [stop] * n if isinstance(stop, StopParams) else list(stop)
    ids = [self.add_request(p, s, t) for p, s, t in zip(prompts, samp, stops)]
    self._closed_batch = closed
    try:
      for _ in self.run():
        pass
    finally:
      self._closed_batch = False
    done = [self.requests[i] for i in ids]
    for i in ids:
      self.release(i)  # the caller holds the results; the engine need not
    return done

  def warmup(self, progress: Callable[[int, int, str], None] | bool = True) -> int:
    """Compiles every bucket (mixed shapes, then decode-loop batch sizes, plain and, with
    drafters, speculative); with drafters, measures the cost table (`measure_spec_costs`).
    Returns the number of programs. `progress(done, total, what)` is called after each
    (True: a line per program on stderr; False: quiet)."""
    if progress is True:
      progress = warmup.printer()
    with self._lock:
      n = warmup.compile_buckets(self, progress or None)
    self._take_snapshot()
    return n

  def save_traffic_stats(self) -> None:
    if self.config.traffic_stats_path:
      self.traffic.save(self.config.traffic_stats_path)

  def _take_snapshot(self) -> None:
    """Stats as of now (step lock held), for readers on other threads."""
    pool = self.pool.stats()
    waiting = list(self.scheduler.waiting)
    snap = dict(self.counters, **self.constrained.counters,
                num_requests_running=len(self.scheduler.running),
                num_requests_waiting=len(waiting), kv_cache_usage_perc=pool.usage,
                prefix_cache_queries=pool.prefix_queries, prefix_cache_hits=pool.prefix_hits,
                prefix_cache_hits_lacking_drafter_entries=pool.prefix_hits_lacking,
                num_preemptions=self.scheduler.num_preemptions,
                waiting_tokens=sum(r.num_uncomputed for r in waiting),
                **self.images.stats())
    if self.spec is not None:
      snap.update(self.spec.stats())
    with self._inbox_lock:
      self._snapshot = snap

  def queue_load(self) -> QueueLoad:
    """The waiting queue's size (as of the last step, plus requests added since), for
    admission control; never waits for a step."""
    with self._inbox_lock:
      snap = self._snapshot
      return QueueLoad(requests=snap.get("num_requests_waiting", 0) + len(self._inbox),
                       tokens=snap.get("waiting_tokens", 0)
                       + sum(len(r.prompt_ids) for r in self._inbox))

  def stats(self) -> dict[str, Any]:
    """Gauges and counters for metrics endpoints (as of the last step; never waits)."""
    with self._inbox_lock:
      snap, inbox = dict(self._snapshot), len(self._inbox)
    snap.pop("waiting_tokens")
    snap["num_requests_waiting"] += inbox
    return snap
