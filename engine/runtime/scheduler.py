"""Continuous batching with a token budget per step, chunked prefill and preemption.

Each step the scheduler hands out at most `max_num_batched_tokens` tokens (vLLM V1's rule):
running requests first, oldest first, each getting `num_tokens - num_computed` tokens (1 for a
decode, a chunk of the prompt otherwise) within the budget; then waiting requests in arrival
order, up to `max_num_seqs` running, each first matched against the prefix cache. A long prompt
is prefilled in chunks that share steps with other requests' decodes.

When a running request needs a page and none is free, the newest running request is preempted:
its pages are released (full pages stay in the prefix cache, so the recompute is often cheap),
`num_computed` returns to 0 and it goes back to the front of the queue. Its output so far is
kept; recomputing prompt + outputs and sampling with the (seed, position) keys gives the same
continuation, so preemption never changes a request's output.

When nothing waits and every running request is decoding, the step may run several decode
iterations on the device (`num_steps`); pages for all of them are taken up front.

Constrained requests (structured outputs, `Request.constrained`) never sample in a segment:
their segments stop one token short of the known tokens, and once only that token is left they
are listed in `SchedulerOutput.constrained` (a page for it taken), for the engine's masked
step after the step's program. They do not join the decode loop, and do not keep it from
running for the other rows.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import AbstractSet, Sequence

from engine.runtime.page_pool import OutOfPages, PagePool, page_keys
from engine.runtime.request import Request, Status
from engine.runtime.speculative.drafters.base import AUTO


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  max_num_seqs: int = 16  # running requests at once
  max_num_batched_tokens: int = 256  # tokens per step (all requests together)
  max_model_len: int = 2048  # prompt + output tokens per request


@dataclasses.dataclass
class Segment:
  """`num_tokens` consecutive tokens of `request`, from position `start`, computed this step."""
  request: Request
  start: int
  num_tokens: int

  @property
  def samples(self) -> bool:
    """The segment reaches the end of the known tokens, so its last logits give a new token."""
    return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
  segments: list[Segment]
  num_steps: int = 1  # > 1 only for decode-only steps run as a device loop
  preempted: list[Request] = dataclasses.field(default_factory=list)
  # Constrained requests whose newest token is the only one not in the cache: the masked step
  # feeds it and samples under the grammar's mask (a page for it is taken).
  constrained: list[Request] = dataclasses.field(default_factory=list)

  @property
  def decode_only(self) -> bool:
    return bool(self.segments) and all(
        s.num_tokens == 1 and s.request.is_decoding for s in self.segments)

  @property
  def num_tokens(self) -> int:
    return sum(s.num_tokens for s in self.segments)


def _masked_ready(req: Request) -> bool:
  """A constrained request whose one uncomputed token is the masked step's input."""
  return req.constrained and req.num_uncomputed == 1


def pages_for(num_tokens: int, page_size: int) -> int:
  return -(-num_tokens // page_size)


class Scheduler:
  """Owns the waiting queue, the running list and the page pool's assignment to requests."""

  def __init__(self, config: SchedulerConfig, pool: PagePool, prefix_salt: object = None,
               observers: Sequence[str] = ()):
    """`observers`: the drafters with entries of their own in the paged cache (an MTP layer's,
    an EAGLE-3 head's KV) that only some forwards write: prefill chunks and masked steps
    always, the speculative loop for the rows it feeds them, the plain loop never. Published
    pages record which observers' entries they hold (`record_computed`). A row that may draft
    with one of them (`needs`) recomputes a prefix hit's last page: the entry at a position
    depends on the token after it (a cached page's entry at its last position saw the next
    token of the request that computed it), and prefill builds the row state (vLLM's rule with
    EAGLE). It takes hit pages lacking its drafter's entries as they are (counted: the pool's
    `prefix_hits_lacking`): recomputing them would cost the hit, and on the demo model the
    head's acceptance barely moved (docs/design/speculative.md)."""
    self.config = config
    self.pool = pool
    self.prefix_salt = prefix_salt
    self.observers = frozenset(observers)
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.num_preemptions = 0

  # ---- queue changes -------------------------------------------------------------------------

  def add(self, request: Request) -> None:
    self.waiting.append(request)

  def finish(self, request: Request, reason: str) -> None:
    """Ends a request (done or aborted) and returns its pages to the pool at once."""
    if request.status is Status.RUNNING:
      self.running.remove(request)
    elif request.status is Status.WAITING:
      self.waiting.remove(request)
    self._release(request)
    request.status = Status.FINISHED
    request.finish_reason = reason

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  # ---- the step ------------------------------------------------------------------------------

  def schedule(self, max_decode_steps: int = 1) -> SchedulerOutput:
    """Chooses this step's work. `max_decode_steps` caps a decode-only device loop's tokens
    per row; where the free pages cannot hold them, the loop gets half as many, and so on."""
    steps = max_decode_steps
    while (steps > 1 and not self.waiting and any(not r.constrained for r in self.running)
           and all(r.is_decoding or _masked_ready(r) for r in self.running)):
      out = self._schedule_decode_loop(steps)
      if out is not None:
        return out
      steps //= 2

    budget = self.config.max_num_batched_tokens
    segments: list[Segment] = []
    preempted: list[Request] = []
    constrained: list[Request] = []
    scheduled: set[str] = set()
    i = 0
    while i < len(self.running) and budget > 0:
      req = self.running[i]
      masked = _masked_ready(req)
      n = 1 if masked else min(req.num_uncomputed - req.constrained, budget)
      if n <= 0:
        i += 1
        continue
      while not self._grow(req, req.num_computed + n):
        victim = self.running[-1]
        assert victim.request_id not in scheduled, "preemption must not undo scheduled work"
        self._preempt(victim)
        preempted.append(victim)
        if victim is req:
          break
      if req.status is not Status.RUNNING:
        break  # it preempted itself: everything after it is gone too
      (constrained.append(req) if masked else segments.append(Segment(req, req.num_computed, n)))
      scheduled.add(req.request_id)
      budget -= n
      i += 1

    while (self.waiting and budget > 0 and not preempted
           and len(self.running) < self.config.max_num_seqs):
      req = self.waiting[0]
      self._match_prefix(req)
      masked = _masked_ready(req)
      n = 1 if masked else min(req.num_uncomputed - req.constrained, budget)
      if not self._grow(req, req.num_computed + n):
        self._release(req)  # keep nothing while it waits (the prefix cache keeps the pages)
        break
      self.waiting.popleft()
      if req.cached_tokens is None:  # report the first admission's prefix hit
        req.cached_tokens = req.num_computed
      req.status = Status.RUNNING
      self.running.append(req)
      (constrained.append(req) if masked else segments.append(Segment(req, req.num_computed, n)))
      budget -= n
    return SchedulerOutput(segments=segments, preempted=preempted, constrained=constrained)

  def _schedule_decode_loop(self, max_steps: int) -> SchedulerOutput | None:
    """All running requests decode for up to `max_steps` iterations, if the pages suffice
    (constrained ones: one token, in the masked step)."""
    limits = [1 if r.constrained else min(max_steps, self.remaining_tokens(r))
              for r in self.running]
    need = [pages_for(r.num_computed + n, self.pool.page_size) - len(r.pages)
            for r, n in zip(self.running, limits)]
    if sum(max(0, x) for x in need) > self.pool.num_free:
      return None
    for r, n in zip(self.running, limits):
      assert self._grow(r, r.num_computed + n)
    loop = [r for r in self.running if not r.constrained]
    return SchedulerOutput(segments=[Segment(r, r.num_computed, 1) for r in loop],
                           num_steps=max(n for r, n in zip(self.running, limits)
                                         if not r.constrained),
                           constrained=[r for r in self.running if r.constrained])

  def grow(self, req: Request, num_tokens: int) -> bool:
    """Pages for `num_tokens` of a running request if free ones suffice (nothing preempted):
    the masked step's drafted tokens."""
    return self._grow(req, num_tokens)

  def remaining_tokens(self, req: Request) -> int:
    """How many more tokens `req` may generate (its max_tokens and the model length)."""
    return max(0, min(req.stop.max_tokens - len(req.output_ids),
                      self.config.max_model_len - req.num_tokens))

  # ---- after the step ------------------------------------------------------------------------

  def record_computed(self, req: Request, num_computed: int,
                      observed: AbstractSet[str] | None = None) -> None:
    """Advances `req` to `num_computed` cached tokens and publishes its new full pages.
    `observed`: the observers whose entries the step wrote at the new positions (None: all)."""
    page = self.pool.page_size
    missing = self.observers - observed if observed is not None else ()
    if missing and num_computed > req.num_computed:
      for j in range(req.num_computed // page, (num_computed - 1) // page + 1):
        req.pages_lacking.setdefault(j, set()).update(missing)
    req.num_computed = num_computed
    full = min(num_computed, req.num_tokens) // page
    if full > len(req.page_keys):  # hash only the newly full pages, chained on the last key
      req.page_keys = page_keys(req.all_ids[:full * page], page, self.prefix_salt,
                                known=req.page_keys, images=req.images)
    for j in range(req.num_cached_pages, full):
      self.pool.cache_page(req.pages[j], req.page_keys[j],
                           self.observers - req.pages_lacking.get(j, set()))
    req.num_cached_pages = max(req.num_cached_pages, full)

  def needs(self, req: Request) -> frozenset[str]:
    """The observers whose entries `req` may draft from: its drafter's, or all for "auto"."""
    drafter = req.spec.drafter if req.spec is not None else None
    if drafter == AUTO:
      return self.observers
    return self.observers & {drafter}

  # ---- helpers -------------------------------------------------------------------------------

  def _match_prefix(self, req: Request) -> None:
    """On admission, takes the longest cached prefix of the known tokens (leaving at least one
    token to compute, whose logits give the next token; and the hit's last page, for a row
    that `needs` observers' entries: see `__init__`)."""
    if req.pages:
      return
    usable = (req.num_tokens - 1) // self.pool.page_size
    keys = page_keys(req.all_ids[:usable * self.pool.page_size], self.pool.page_size,
                     self.prefix_salt, images=req.images)
    needs = self.needs(req)
    hits = self.pool.match_prefix(keys, drop_last=bool(needs), needs=needs)
    req.pages = list(hits)
    req.page_keys = keys[:len(hits)]
    req.num_cached_pages = len(hits)
    req.num_computed = len(hits) * self.pool.page_size
    for j, page in enumerate(hits):
      if lacks := self.observers - self.pool.observed(page):
        req.pages_lacking[j] = set(lacks)

  def _grow(self, req: Request, num_tokens: int) -> bool:
    """Gives `req` pages for `num_tokens` tokens; False (and nothing taken) if the pool is dry."""
    need = pages_for(num_tokens, self.pool.page_size) - len(req.pages)
    if need <= 0:
      return True
    try:
      req.pages += self.pool.allocate(need)
    except OutOfPages:
      return False
    return True

  def _release(self, req: Request) -> None:
    self.pool.release(req.pages)
    req.pages = []
    req.page_keys = []
    req.num_cached_pages = 0
    req.num_computed = 0
    req.pages_lacking = {}

  def _preempt(self, req: Request) -> None:
    self.running.remove(req)
    self._release(req)
    req.status = Status.WAITING
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(req)
