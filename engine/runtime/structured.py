"""The serving engine's constrained rows (structured outputs): masks on the host, one masked
program on the device, matchers advanced with every emitted token.

A constrained request (`Request.grammar`, a `grammar.GrammarMatcher`) never samples in
`model_step` or the decode loops: the scheduler stops its segments one token short and lists
it in `SchedulerOutput.constrained` once only its newest token is uncomputed. Each engine step
then, for those rows:

1. `prepare` (on a worker thread, started before the step's main program is dispatched, so the
   llguidance mask computation overlaps the unconstrained rows' device loop; llguidance drops
   the GIL while it computes): per row, drafts cut at the first one the grammar forbids, and
   the allowed-token bitmask at every position of [newest, d_1 .. d_k] (the matcher advanced
   along the drafts, then rolled back). A row's drafts (`row_drafter`, when the engine
   speculates): a model drafter's that drafts on the device (`Drafter.drafts_constrained`:
   MTP or EAGLE-3, for rows drafting with it; "auto" rows the first of them the engine has),
   proposed by the previous masked step (`speculative/constrained.py`); else its drafter's
   host form (`host_drafter`: n-gram prompt lookup, for rows drafting with "ngram" or "auto").
2. `steps.masked_step` after the main program: one forward over `[B, 1]` (no drafts) or
   `[B, k + 1]`, masked logits, the speculative rule (greedy: argmax over allowed tokens;
   sampled: the (seed, position) sample of the masked distribution), so drafting changes
   nothing in the output. Device drafters observe the verified block and propose the next
   step's drafts in the same program.
3. `finish`: the emitted tokens go to the matcher; a matcher that admits nothing but EOS ends
   the request (finish reason "stop"); EOS itself is allowed only where the grammar accepts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from engine.runtime.grammar import bitmask_words
from engine.runtime.page_pool import NULL_PAGE
from engine.runtime.speculative.drafters import AUTO, drafter_id, registry


def _host_form(name: str) -> Any:
  """The registered drafter a row drafting with `name` ("auto", a name) drafts with on the
  host: its own when it has a host form (`Drafter.drafts_on_host`), for "auto" the first
  registered one that has, else None."""
  return next((d for d in registry() if d.drafts_on_host and name in (d.name, AUTO)), None)


def host_drafter(name: str | None) -> Callable[[Sequence[int], int, int], list[int]] | None:
  """How a constrained row drafting with `name` drafts on the host: its drafter's host form
  (`Drafter.host_propose`; see `_host_form`)."""
  d = _host_form(name) if name is not None else None
  return d.host_propose if d is not None else None


def row_drafter(drafter: str | None, device: Sequence[str] = ()) -> str | None:
  """The drafter a constrained row drafting with `drafter` ("auto", a name, None) takes: the
  first of the engine's `device` drafters (`Drafter.drafts_constrained`) it names, else the
  one with a host form (`_host_form`), else None."""
  if drafter is None:
    return None
  d = next((name for name in device if drafter in (name, AUTO)), None)
  if d is not None:
    return d
  d = _host_form(drafter)
  return d.name if d is not None else None


def proposed_drafts(req: Any) -> list[int]:
  """The drafts the last masked step proposed for `req`, if they follow its newest token."""
  got = req.spec.proposed if req.spec is not None else None
  return list(got[1]) if got is not None and got[0] == req.num_computed else []


def draft_limits(reqs: Sequence[Any], scheduler: Any, k: int,
                 device: Sequence[str] = ()) -> list[int]:
  """Drafts each constrained row may take this step: rows with a drafter (`row_drafter`; a
  device drafter's only when it proposed some), within max_draft_tokens, the tokens the row
  may still emit and the pages free for them (taken here, `Scheduler.grow`; nothing is
  preempted for drafts)."""
  out = []
  for req in reqs:
    n = 0
    name = row_drafter(req.spec.drafter, device) if req.spec is not None else None
    if name is not None and (name not in device or proposed_drafts(req)):
      n = min(k, req.sampling.max_draft_tokens or k, scheduler.remaining_tokens(req) - 1)
      while n > 0 and not scheduler.grow(req, req.num_computed + 1 + n):
        n //= 2
    out.append(max(n, 0))
  return out


@dataclasses.dataclass
class Prepared:
  """Host inputs of one masked step."""
  reqs: list[Any]
  drafts: list[list[int]]
  bitmask: np.ndarray  # [len(reqs), T, W] int32
  seconds: float  # host time spent computing them
  cut: int = 0  # drafts dropped at (or after) a token the grammar forbids
  drafters: list[str | None] = dataclasses.field(default_factory=list)  # each row's `row_drafter`


def prepare(reqs: Sequence[Any], draft_k: Sequence[int], window: int, vocab_size: int,
            max_drafts: int, device: Sequence[str] = ()) -> Prepared:
  """Drafts and masks for constrained rows (see the module docstring); draft_k[i]: the most
  drafts row i may take (0: none, at most max_drafts); `device`: the engine's device drafters.
  The block is [1] without drafts, else [max_drafts + 1] (the compiled widths); always the
  latter with a row drafting on the device (one masked program for those rows to compile)."""
  t0 = time.perf_counter()
  drafts, names = [], []
  on_device = False
  for req, k in zip(reqs, draft_k):
    spec = getattr(req, "spec", None)  # (rows asked to draft without one: "auto"'s form)
    name = row_drafter(spec.drafter if spec is not None else AUTO, device)
    names.append(name if spec is not None else None)
    on_device |= spec is not None and name in device
    if k <= 0 or name is None:
      drafts.append([])
    elif name in device:
      drafts.append(proposed_drafts(req)[:k])
    else:
      drafts.append(host_drafter(name)(req.all_ids, k, window))
  t = 1 + max_drafts if any(drafts) or on_device else 1
  # Slots past a row's drafts are never read; all-allowed keeps their logits finite.
  bits = np.full((len(reqs), t, bitmask_words(vocab_size)), -1, np.int32)
  cut = 0
  for i, (req, d) in enumerate(zip(reqs, drafts)):
    m = req.grammar
    m.fill_bitmask(bits[i, 0])
    # A draft the grammar forbids ends the row's drafts (verification would reject it); checked
    # before consuming, since a refused token leaves the matcher in its error state for good.
    allowed = m.allowed_prefix(d)
    cut += len(d) - allowed
    del d[allowed:]
    for j, tok in enumerate(d):
      if not m.accept(tok):
        raise RuntimeError(f"grammar matcher refused a token it allowed: {m.error()}")
      m.fill_bitmask(bits[i, j + 1])
    if d:
      m.rollback(len(d))
  return Prepared(list(reqs), drafts, bits, time.perf_counter() - t0, cut, names)


class ConstrainedRows:
  """The engine's worker thread for masks and the masked step's host arrays."""

  def __init__(self, vocab_size: int, ngram_window: int, max_drafts: int,
               device: Sequence[str] = ()):
    self.vocab_size, self.window, self.max_drafts = vocab_size, ngram_window, max_drafts
    self.device = tuple(device)  # the engine's device drafters of constrained rows
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moejax-masks")
    self.counters = dict(structured_steps=0, structured_tokens=0, structured_drafted=0,
                         structured_accepted=0, structured_drafts_cut=0,
                         structured_mask_seconds=0.0,
                         structured_mask_wait_seconds=0.0)

  def start(self, reqs: Sequence[Any], draft_k: Sequence[int]) -> concurrent.futures.Future:
    return self._pool.submit(prepare, list(reqs), list(draft_k), self.window, self.vocab_size,
                             self.max_drafts, self.device)

  def now(self, reqs: Sequence[Any], draft_k: Sequence[int]) -> concurrent.futures.Future:
    """`start`'s work on the calling thread (nothing to overlap: no other rows' program)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(prepare(list(reqs), list(draft_k), self.window, self.vocab_size,
                            self.max_drafts, self.device))
    return done

  def wait(self, future: concurrent.futures.Future) -> Prepared:
    t0 = time.perf_counter()
    prep = future.result()
    self.counters["structured_mask_wait_seconds"] += time.perf_counter() - t0
    self.counters["structured_mask_seconds"] += prep.seconds
    self.counters["structured_drafts_cut"] += prep.cut
    return prep

  def arrays(self, prep: Prepared, b: int, max_pages: int, page_size: int,
             page_row) -> tuple[np.ndarray, ...]:
    """(tokens [b, T], start [b], n_draft [b], page table [b, P], bitmask [b, T, W]) with rows
    past the requests as padding (positions past the page table: nothing written)."""
    n, t = len(prep.reqs), prep.bitmask.shape[1]
    tokens = np.zeros((b, t), np.int32)
    start = np.full((b,), max_pages * page_size, np.int32)
    n_draft = np.zeros((b,), np.int32)
    table = np.full((b, max_pages), NULL_PAGE, np.int32)
    bits = np.full((b, t, prep.bitmask.shape[2]), -1, np.int32)
    bits[:n] = prep.bitmask
    for i, (req, d) in enumerate(zip(prep.reqs, prep.drafts)):
      tokens[i, 0] = req.all_ids[-1]
      tokens[i, 1:1 + len(d)] = d
      start[i], n_draft[i], table[i] = req.num_computed, len(d), page_row(req)
    return tokens, start, n_draft, table, bits

  def device_arrays(self, prep: Prepared, b: int, widths: dict[str, int]
                    ) -> dict[str, np.ndarray]:
    """The masked step's inputs for the device drafters (`widths`: each one's row width):
    live [b], drafting [b] (each row's device drafter's id, 0: none) and each drafter's rows'
    state `rows.<name>` [b, width]."""
    n = len(prep.reqs)
    live = np.zeros((b,), bool)
    live[:n] = True
    drafting = np.zeros((b,), np.int32)
    rows = {name: np.zeros((b, w), np.float32) for name, w in widths.items()}
    for i, (req, name) in enumerate(zip(prep.reqs, prep.drafters)):
      spec = req.spec
      if name in self.device:
        drafting[i] = drafter_id(name)
      for d, x in rows.items():
        if spec is not None and d in spec.rows:
          x[i] = spec.rows[d]
    return dict(live=live, drafting=drafting, **{f"rows.{d}": x for d, x in rows.items()})

  def count_drafts(self, req: Any, name: str | None, drafted: int, accepted: int,
                   engine_counters: dict | None, per_drafter: dict | None = None) -> None:
    """A verified draft of `req`, drafted by `name` (`Prepared.drafters`): its own counters,
    ours, the engine's `spec_*` ones and, in `per_drafter` (the policy's), the drafter's."""
    self.counters["structured_drafted"] += drafted
    self.counters["structured_accepted"] += accepted
    s = req.spec
    s.drafts, s.drafted, s.accepted = s.drafts + 1, s.drafted + drafted, s.accepted + accepted
    if engine_counters is not None:
      engine_counters["spec_steps"] += 1
      engine_counters["spec_drafted"] += drafted
      engine_counters["spec_accepted"] += accepted
    if per_drafter is not None and f"spec_steps_{name}" in per_drafter:
      s.drafter_steps[name] = s.drafter_steps.get(name, 0) + 1
      for key, n in (("steps", 1), ("drafted", drafted), ("accepted", accepted)):
        per_drafter[f"spec_{key}_{name}"] += n

  def close(self) -> None:
    self._pool.shutdown(wait=False)
