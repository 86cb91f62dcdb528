"""Lazy feeding of the draft model: a row's draft cache is caught up when it starts drafting.

Feeding it every token of every request costs a draft forward per token whether or not the
request drafts with it ("auto" on fresh prompts fell from 0.92x to 0.67x of plain decoding on
the CPU demo). So the loop feeds only its `draft_rows`, and before a call each one whose draft
entries stop short (`DraftEntries`) runs a draft-only forward over the missing positions, cut
like prefill (`plan`) into the compiled mixed-step shapes (`pack`).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache, forward
from engine.runtime.page_pool import NULL_PAGE

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
