"""A small model with the target's vocabulary as a drafter (`draft`): its own paged cache on
the target's page ids, fed lazily.

In the loop its fed rows (`fed`: the rows using it, or "auto" rows that may) get every token:
each iteration feeds the tokens they emitted since (`pending`) with the newest one, then chains
K drafts; the loop flushes what is pending at its end.

Feeding it every token of every request costs a draft forward per token whether or not the
request drafts with it ("auto" on fresh prompts fell from 0.92x to 0.67x of plain decoding on
the CPU demo). So the loop feeds only its `draft_rows`, and before a call each one whose draft
entries stop short (`DraftEntries`) runs a draft-only forward over the missing positions, cut
like prefill (`plan`) into the compiled mixed-step shapes (`pack`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import clear_page, init_cache
from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache, compute_logits, forward
from engine.runtime.page_pool import NULL_PAGE
from engine.runtime.speculative.acceptance import draft_sample
from engine.runtime.speculative.drafters.base import (Drafter, LoopContext, Proposal,
                                                      zeros_like_shape)
from engine.runtime.speculative.inplace import place, run_if

Span = tuple[int, int, int]  # (row, first position, number of positions)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
def draft_forward(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
                  n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
                  impl: KernelChoice = REFERENCE) -> Cache:
  """Writes the draft model's cache entries of tokens [B, W] at positions start[b] + t for the
  first n_new[b] of each row (rows of one request may continue each other: every row's entries
  are written before any row attends). Returns the cache (donated)."""
  return forward(params, cache, tokens, start, n_new, page_table, cfg=cfg, impl=impl)[1]


def plan(spans: Sequence[Span], budget: int, max_spans: int) -> list[list[Span]]:
  """Groups (row, start, n) spans into steps of at most `budget` positions and `max_spans`
  spans, cutting a span across steps where the budget runs out (its earlier positions first).
  A row appears at most once per step."""
  groups: list[list[Span]] = [[]]
  used = 0
  for row, start, n in spans:
    while n > 0:
      if used == budget or len(groups[-1]) == max_spans:
        groups.append([])
        used = 0
      take = min(n, budget - used)
      groups[-1].append((row, start, take))
      used, start, n = used + take, start + take, n - take
  return [g for g in groups if g]


def pack(group: Sequence[Span], ids: Sequence[Sequence[int]], page_table: np.ndarray,
         shape: Callable[[Sequence[int]], tuple[int, int]]) -> tuple[np.ndarray, ...]:
  """A step's spans as `draft_forward` inputs: each span of n positions becomes ceil(n / W) rows
  of width W, (B, W) = shape(span lengths). ids[row]: that row's tokens from position 0;
  page_table [rows, P]. Returns (tokens [B, W], start [B], n_new [B], page table [B, P])."""
  b, w = shape([n for _, _, n in group])
  tokens = np.zeros((b, w), np.int32)
  start = np.zeros((b,), np.int32)
  n_new = np.zeros((b,), np.int32)
  table = np.full((b, page_table.shape[1]), NULL_PAGE, np.int32)
  r = 0
  for row, first, n in group:
    for off in range(0, n, w):
      chunk = ids[row][first + off:first + min(off + w, n)]
      tokens[r, :len(chunk)] = chunk
      start[r], n_new[r], table[r] = first + off, len(chunk), page_table[row]
      r += 1
  return tokens, start, n_new, table


class DraftEntries:
  """Which cache pages hold draft-model entries for their tokens: page -> (the page's epoch
  when they were written, positions filled). A page handed out again has a new epoch
  (`PagePool.epoch`), so its entries lapse; a shared prefix page keeps them for every request
  that matches it."""

  def __init__(self, epoch: Sequence[int], page_size: int):
    self._epoch, self.page_size = epoch, page_size
    self._marks: dict[int, tuple[int, int]] = {}

  def computed(self, pages: Sequence[int]) -> int:
    """Leading positions of a sequence on `pages` whose draft entries are valid."""
    n = 0
    for page in pages:
      mark = self._marks.get(page)
      if mark is None or mark[0] != self._epoch[page]:
        break
      n += mark[1]
      if mark[1] < self.page_size:
        break
    return n

  def written(self, pages: Sequence[int], upto: int) -> None:
    """The sequence on `pages` has valid draft entries at every position below `upto`."""
    for j, page in enumerate(pages[:-(-upto // self.page_size)]):
      if page != NULL_PAGE:
        self._marks[page] = (self._epoch[page], min(self.page_size, upto - j * self.page_size))




def draft_feed(draft_params, dcache, pending, n_pending, tok, n_cached, live, page_table, *,
               draft_cfg, impl):
  """Feeds the draft model each row's pending tokens [B, P] (positions n_cached - n_pending ..
  n_cached - 1) and its newest token. Returns (its hidden state at the newest token [B, H],
  the draft cache holding positions <= n_cached)."""
  live_i = live.astype(jnp.int32)
  block = jnp.concatenate([pending, jnp.zeros_like(pending[:, :1])], axis=1)
  block = place(block, n_pending, tok[:, None], jnp.ones_like(n_pending))
  hidden, dcache = forward(draft_params, dcache, block, n_cached - n_pending,
                           (n_pending + 1) * live_i, page_table, cfg=draft_cfg, impl=impl)
  return jnp.take_along_axis(hidden, n_pending[:, None, None], axis=1)[:, 0], dcache


def draft_chain(draft_params, dcache, h, n_cached, live, page_table, sampling, *, k, draft_cfg,
                impl):
  """k >= 1 drafts from the draft model's state h [B, H] at the newest token. Returns (draft
  [B, k], q [B, k, V], draft cache holding positions < n_cached + k)."""
  drafts, qs = [], []
  for j in range(1, k + 1):
    if j > 1:
      hidden, dcache = forward(draft_params, dcache, drafts[-1][:, None], n_cached + j - 1,
                               live.astype(jnp.int32), page_table, cfg=draft_cfg, impl=impl)
      h = hidden[:, 0]
    t, q = draft_sample(compute_logits(draft_params, h, draft_cfg), sampling, n_cached + j)
    drafts.append(t)
    qs.append(q)
  return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), dcache


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(Drafter):
  name = "draft"
  aliases = ("draft_model",)
  fed_per_row = True
  uses_draft_model = True
  cfg: ModelConfig
  draft_cfg: ModelConfig | None = None

  @classmethod
  def create(cls, cfg, config, draft_cfg, head_cfg=None) -> "DraftModelDrafter":
    return cls(cfg=cfg, draft_cfg=draft_cfg)

  @classmethod
  def unsupported(cls, cfg: ModelConfig, draft_cfg: ModelConfig | None,
                  head_cfg=None) -> str | None:
    if draft_cfg is None:
      return "drafter 'draft' needs a draft model (Engine(draft=))"
    if draft_cfg.vocab_size != cfg.vocab_size:
      return (f"draft model: vocabulary {draft_cfg.vocab_size} differs from the target's "
              f"{cfg.vocab_size}")
    return None

  def roofline_cost(self) -> float:
    """A draft step reads its layers (by hidden size and depth) against the target's."""
    d, t = self.draft_cfg, self.cfg
    return d.num_layers * d.hidden_size / (t.num_layers * t.hidden_size)

  def init_state(self, num_pages, page_size, dtype, place_cache, place_state) -> Cache:
    return place_cache(init_cache(self.draft_cfg, num_pages, page_size, dtype), self.draft_cfg)

  def clear_null_page(self, state: Cache) -> Cache:
    return clear_page(state, NULL_PAGE, self.draft_cfg)

  def start(self, state: Cache, rows: Any, b: int, k_max: int) -> dict:
    return {"cache": state, "pending": jnp.zeros((b, k_max), jnp.int32),
            "n_pending": jnp.zeros((b,), jnp.int32)}

  def propose(self, ctx: LoopContext, st: dict, cache: Any, k: int
              ) -> tuple[Proposal, dict, Any]:
    b = ctx.tok.shape[0]
    fed_rows = ctx.live & ctx.fed  # fed every iteration (plain ones too)

    def fed(s):
      return draft_feed(ctx.own_params, s[1], st["pending"], st["n_pending"], ctx.tok,
                        ctx.n_cached, fed_rows, ctx.page_table, draft_cfg=self.draft_cfg,
                        impl=ctx.impl)

    wanted = jnp.any(ctx.uses & ctx.live)
    h0 = jax.eval_shape(fed, (None, st["cache"]))[0]
    h, dcache = run_if(jnp.any(fed_rows), fed, (zeros_like_shape(h0), st["cache"]))
    nothing = (jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k, self.cfg.vocab_size), jnp.float32))
    draft, q, dcache = run_if(
        wanted, lambda s: draft_chain(ctx.own_params, s[2], h, ctx.n_cached, fed_rows,
                                      ctx.page_table, ctx.sampling, k=k,
                                      draft_cfg=self.draft_cfg, impl=ctx.impl),
        (*nothing, dcache))
    # (other rows' drafts come from a stale context: not evidence)
    return (Proposal(draft, jnp.full((b,), k, jnp.int32), q, wanted & ctx.fed),
            dict(st, cache=dcache), cache)

  def observe(self, ctx: LoopContext, st: dict, cache: Any, v: Any, k: int
              ) -> tuple[dict, Any]:
    # It was fed tok and, in rows drafting with it, its drafts d_1 .. d_{k-1}: so those rows
    # lack the emitted tokens past their accepted drafts, the others every emitted token.
    seen = jnp.where(ctx.uses, jnp.minimum(v.n_accepted, max(k, 1) - 1), 0)
    n_pend = jnp.maximum(v.n_emit - 1 - seen, 0)
    pend = jnp.take_along_axis(
        v.emitted, jnp.minimum(seen[:, None] + jnp.arange(ctx.k_max)[None, :], k), axis=1)
    return dict(st, pending=jnp.where(ctx.live[:, None], pend, st["pending"]),
                n_pending=jnp.where(ctx.live, n_pend, st["n_pending"])), cache

  def finish(self, ctx: LoopContext, st: dict) -> tuple[Cache, None]:
    """Flush: the fed rows' draft cache holds every position < n_cached."""
    def flush(c):
      return forward(ctx.own_params, c, st["pending"], ctx.n_cached - st["n_pending"],
                     st["n_pending"] * ctx.fed.astype(jnp.int32), ctx.page_table,
                     cfg=self.draft_cfg, impl=ctx.impl)[1]
    return run_if(jnp.any(ctx.fed), flush, st["cache"]), None

  # ---- the lazy catch-up, on the engine core's side -------------------------------------------

  def host_state(self, pool: Any) -> DraftEntries:
    return DraftEntries(pool.epoch, pool.page_size)

  def counters(self) -> dict[str, int]:
    return dict(spec_draft_catch_up_steps=0, spec_draft_catch_up_tokens=0)

  def before_call(self, host: DraftEntries, reqs, fed, table, shape, budget, max_spans,
                  counters) -> list[dict[str, np.ndarray]]:
    """Draft-only forwards filling each fed row's draft cache from the positions whose
    entries are valid (`DraftEntries`) to `num_computed`."""
    spans = []
    for i, r in enumerate(reqs):
      done = min(host.computed(r.pages), r.num_computed)
      if fed[i] and done < r.num_computed:
        spans.append((i, done, r.num_computed - done))
    groups = plan(spans, budget, max_spans)
    ids = [r.all_ids for r in reqs]
    counters["spec_draft_catch_up_steps"] += len(groups)
    counters["spec_draft_catch_up_tokens"] += sum(n for _, _, n in spans)
    return [dict(zip(("tokens", "start", "n_new", "page_table"), pack(g, ids, table, shape)))
            for g in groups]

  def after_call(self, host: DraftEntries, reqs, fed, counts) -> None:
    for i, req in enumerate(reqs):
      if fed[i]:  # the loop fed it every token and flushed
        host.written(req.pages, req.num_computed + int(counts[i]))

  def program(self, state: Cache, own_params: Params, arrays, *, impl):
    return draft_forward, (own_params, state, arrays["tokens"], arrays["start"],
                           arrays["n_new"], arrays["page_table"]), dict(cfg=self.draft_cfg,
                                                                         impl=impl)

  def warm_arrays(self, b: int, w: int, past: np.ndarray, table: np.ndarray):
    return dict(tokens=np.zeros((b, w), np.int32), start=past,
                n_new=np.full((b,), w, np.int32), page_table=table)
