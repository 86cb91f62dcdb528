"""Host-side bookkeeping for the paged KV cache: free list, reference counts, prefix cache.

The device holds one page pool per layer (`engine.model.cache`); this class decides which page
ids each sequence owns. Page 0 is reserved as the null page: unused page-table entries point at
it, nothing is ever written there (padding writes are dropped) and reads of it are masked.

Prefix cache (vLLM's hash-chain design): a *full* page of tokens gets a key
`hash((parent_key, tokens of the page))`, so a key names the whole prefix up to the end of that
page. `cache_page` records key -> page once the page's tokens are computed; `match_prefix` walks
a new sequence's full pages and takes a reference on every page whose key is known, so a
follow-up turn computes only its new tokens. A page whose reference count drops to zero goes to
the free queue but keeps its key (and contents) until the allocator reuses it: pages without a
key are reused first, then keyed pages in least-recently-freed order (LRU eviction).

A cached page also records which drafters' cache entries it holds in full (`observed`: an MTP
layer's or EAGLE-3 head's KV, which only some forwards write; `Scheduler.record_computed`). A
page that holds more of them takes over the key of one that holds fewer, and a lookup counts
the pages it hits that lack the entries its row drafts from (`match_prefix(needs=)`): it still
takes them (the drafter drafts over what they hold, lossless; recomputing them would cost the
hit).

Every allocation of a page bumps its `epoch`: whoever keeps side entries on the same page ids
(the draft model's cache) can tell a page handed out again from one still holding its tokens.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import AbstractSet, Hashable, Sequence

from engine.runtime.multimodal import ImageInput, page_extras

NULL_PAGE = 0


class OutOfPages(Exception):
  """Raised by `allocate` when the pool cannot supply the pages asked for."""


def page_keys(tokens: Sequence[int], page_size: int, salt: Hashable = None,
              known: Sequence[int] = (), images: Sequence[ImageInput] = ()) -> list[int]:
  """Prefix keys of every full page of `tokens` (a key covers all tokens up to its page end).

  `salt` separates key spaces (e.g. different models or LoRA adapters sharing a pool).
  `known`: keys already computed for the leading pages of the same tokens; only the pages
  after them are hashed. `images`: the request's images; a page overlapping an image's
  placeholder span also hashes that image's content hash (`multimodal.page_extras`), so the
  same placeholder ids with other pixels name another prefix.
  """
  keys = list(known)
  parent: Hashable = keys[-1] if keys else ("moejax-prefix", salt)
  for i in range(len(keys), len(tokens) // page_size):
    block = tuple(tokens[i * page_size:(i + 1) * page_size])
    extras = page_extras(images, i, page_size) if images else ()
    parent = hash((parent, block, extras) if extras else (parent, block))
    keys.append(parent)
  return keys


@dataclasses.dataclass
class PoolStats:
  num_pages: int  # usable pages (the null page excluded)
  free: int  # allocatable now (unreferenced, with or without a prefix key)
  cached: int  # pages holding a prefix key (referenced or not)
  prefix_queries: int  # full pages looked up
  prefix_hits: int  # of which served from the cache
  prefix_hits_lacking: int  # of which lacking entries of the drafter their row drafts with

  @property
  def usage(self) -> float:
    return 1.0 - self.free / max(self.num_pages, 1)


class PagePool:
  """Reference-counted page allocator with an LRU prefix cache over full pages."""

  def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True):
    if num_pages < 2:
      raise ValueError(f"need at least 2 pages (one is the reserved null page), got {num_pages}")
    self.num_pages = num_pages
    self.page_size = page_size
    self.enable_prefix_cache = enable_prefix_cache
    self._refs = [0] * num_pages
    self._key_of: dict[int, int] = {}  # page -> prefix key
    self._page_of: dict[int, int] = {}  # prefix key -> page
    self._observed: dict[int, frozenset[str]] = {}  # cached page -> drafters' entries held
    # Unreferenced pages in reuse order: front is reused next.
    self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
        (p, None) for p in range(1, num_pages))
    self.prefix_queries = 0
    self.prefix_hits = 0
    self.prefix_hits_lacking = 0  # of which lacking the drafters' entries the lookup needed
    self.epoch = [0] * num_pages  # allocations of each page so far

  # ---- allocation ----------------------------------------------------------------------------

  @property
  def num_free(self) -> int:
    return len(self._free)

  def allocate(self, n: int) -> list[int]:
    """Takes `n` pages (reference count 1 each), evicting unreferenced cached pages LRU-first.

    All or nothing: raises `OutOfPages` and changes nothing when fewer than `n` are free.
    """
    if n > len(self._free):
      raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
    pages = []
    for _ in range(n):
      page, _ = self._free.popitem(last=False)
      self._forget(page)
      self._refs[page] = 1
      self.epoch[page] += 1
      pages.append(page)
    return pages

  def release(self, pages: Sequence[int]) -> None:
    """Drops one reference from each page; pages reaching zero become reusable.

    Pages are released last-first, so that a sequence's tail (the least shareable part of its
    prefix) is evicted before its head.
    """
    for page in reversed(pages):
      if page == NULL_PAGE:
        continue
      if self._refs[page] <= 0:
        raise RuntimeError(f"page {page} released more often than taken")
      self._refs[page] -= 1
      if self._refs[page] == 0:
        self._free[page] = None
        if page not in self._key_of:  # nothing worth keeping: reuse it first
          self._free.move_to_end(page, last=False)

  def ref_count(self, page: int) -> int:
    return self._refs[page]

  # ---- prefix cache --------------------------------------------------------------------------

  def match_prefix(self, keys: Sequence[int], drop_last: bool = False,
                   needs: AbstractSet[str] = frozenset()) -> list[int]:
    """Pages holding the longest cached run of `keys` from the start; takes a reference on each.
    `drop_last`: all but the run's last page (which the caller computes again). `needs`: the
    drafters whose entries the caller drafts from (pages lacking them are counted)."""
    if not self.enable_prefix_cache:
      return []
    pages = []
    for key in keys:
      page = self._page_of.get(key)
      if page is None:
        break
      pages.append(page)
    if drop_last:
      pages = pages[:-1]
    self.prefix_queries += len(keys)
    self.prefix_hits += len(pages)
    self.prefix_hits_lacking += sum(not needs <= self._observed[p] for p in pages)
    for page in pages:
      if self._refs[page] == 0:
        del self._free[page]
      self._refs[page] += 1
    return pages

  def cache_page(self, page: int, key: int, observed: AbstractSet[str] = frozenset()) -> None:
    """Records that `page` (referenced, fully computed) holds the prefix named by `key` and the
    entries of the drafters in `observed`. Another page serving the same prefix keeps the key
    unless this one holds a strict superset of its drafters' entries."""
    if not self.enable_prefix_cache or page in self._key_of:
      return
    if self._refs[page] <= 0:
      raise RuntimeError(f"page {page} is not referenced; cannot cache it")
    observed = frozenset(observed)
    other = self._page_of.get(key)
    if other is not None:
      if not observed > self._observed[other]:
        return
      self._forget(other)
      if self._refs[other] == 0:  # nothing worth keeping: reuse it first
        self._free.move_to_end(other, last=False)
    self._key_of[page] = key
    self._page_of[key] = page
    self._observed[page] = observed

  def _forget(self, page: int) -> None:
    key = self._key_of.pop(page, None)
    if key is not None:
      del self._page_of[key]
      del self._observed[page]

  def observed(self, page: int) -> frozenset[str]:
    """The drafters whose entries cached `page` holds in full."""
    return self._observed.get(page, frozenset())

  def reset_prefix_cache(self) -> None:
    """Forgets every prefix key (e.g. after the weights change)."""
    self._key_of.clear()
    self._page_of.clear()
    self._observed.clear()

  def stats(self) -> PoolStats:
    return PoolStats(num_pages=self.num_pages - 1, free=len(self._free),
                     cached=len(self._key_of), prefix_queries=self.prefix_queries,
                     prefix_hits=self.prefix_hits,
                     prefix_hits_lacking=self.prefix_hits_lacking)

  def check_invariants(self) -> None:
    """Asserts the bookkeeping is consistent (used by tests and debug builds)."""
    assert self._refs[NULL_PAGE] == 0 and NULL_PAGE not in self._free
    for page in range(1, self.num_pages):
      assert self._refs[page] >= 0
      assert (self._refs[page] == 0) == (page in self._free), page
    for page, key in self._key_of.items():
      assert self._page_of[key] == page
    assert len(self._page_of) == len(self._key_of) == len(self._observed)
    assert self._observed.keys() == self._key_of.keys()
