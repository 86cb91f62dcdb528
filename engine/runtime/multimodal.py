"""Images inside a request: where their placeholder tokens sit, their encoder outputs, and
what the prefix cache must know about them.

A request with images carries one `ImageInput` per image: the preprocessed pixels the vision
tower reads (`pixel_values`, `grid_thw`), a `content_hash` (sha256 of the decoded pixels and
the preprocessing parameters, computed at the edge), and the span of prompt positions its
features fill (`offset`, `num_tokens`: a run of `media_pad` ids). The engine encodes an image
when a prefill step first reaches its span (`Engine._image_features`), through an
`EncoderCache` keyed by the content hash, so an image sent again is not encoded again, and
writes feature row `p - offset` into position p's input embedding. A chunk may end inside a
span: each chunk takes the rows of the positions it computes.

The prefix cache's page keys (`page_pool.page_keys`) include, for every page, the content
hashes of the images whose spans overlap it (`page_extras`): identical placeholder ids with
different images never share KV pages, the same image at the same place does.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
  """One image of a request (see the module docstring)."""
  pixel_values: np.ndarray  # float32 patches, as `image_processing.preprocess` makes them
  grid_thw: tuple[int, int, int]  # (t, h, w) patches
  content_hash: str  # hex sha256: decoded pixels + preprocessing parameters
  offset: int  # first prompt position of its placeholder span
  num_tokens: int  # placeholder tokens (= encoder output rows)

  @property
  def end(self) -> int:
    return self.offset + self.num_tokens


def check_spans(ids: Sequence[int], images: Sequence[ImageInput], pad_id: int | None) -> None:
  """The request's images sit on runs of `pad_id` in its prompt, in order, one run each, and
  every pad id of the prompt belongs to one (ValueError naming `images` otherwise)."""
  if not images:
    return
  if pad_id is None:
    raise ValueError("images: this model has no vision tower")
  covered = np.zeros(len(ids), bool)
  prev_end = 0
  for i, im in enumerate(images):
    if im.offset < prev_end or im.end > len(ids) or im.num_tokens < 1:
      raise ValueError(f"images[{i}]: span [{im.offset}, {im.end}) is outside the prompt or "
                       f"overlaps the previous image")
    if any(ids[p] != pad_id for p in range(im.offset, im.end)):
      raise ValueError(f"images[{i}]: its span [{im.offset}, {im.end}) must hold media_pad "
                       f"ids ({pad_id})")
    covered[im.offset:im.end] = True
    prev_end = im.end
  stray = [p for p, t in enumerate(ids) if t == pad_id and not covered[p]]
  if stray:
    raise ValueError(f"prompt: media_pad id {pad_id} at position {stray[0]} belongs to no "
                     "image")


def page_extras(images: Sequence[ImageInput], page: int, page_size: int) -> tuple:
  """What page `page`'s prefix key must add to its token ids: (content hash, offset relative
  to the page) of each image overlapping it; () when none does."""
  lo, hi = page * page_size, (page + 1) * page_size
  return tuple((im.content_hash, im.offset - lo) for im in images
               if im.offset < hi and im.end > lo)


def overlapping(images: Sequence[ImageInput], start: int, end: int) -> list[ImageInput]:
  """The images whose spans overlap positions [start, end)."""
  return [im for im in images if im.offset < end and im.end > start]


class EncoderCache:
  """Encoder outputs by content hash, least recently used evicted first, bounded in bytes.
  Thread-safe (the engine thread fills it; stats readers may be elsewhere)."""

  def __init__(self, max_bytes: int):
    self.max_bytes = max_bytes
    self._entries: collections.OrderedDict[str, Any] = collections.OrderedDict()
    self._bytes = 0
    self._lock = threading.Lock()
    self.hits = 0
    self.misses = 0
    self.evictions = 0

  def get(self, key: str) -> Any:
    with self._lock:
      value = self._entries.get(key)
      if value is None:
        self.misses += 1
        return None
      self._entries.move_to_end(key)
      self.hits += 1
      return value

  def put(self, key: str, value: Any) -> None:
    size = int(value.nbytes)
    with self._lock:
      if key in self._entries or size > self.max_bytes:
        return  # too large to keep: its request holds it while it prefills
      self._entries[key] = value
      self._bytes += size
      while self._bytes > self.max_bytes:
        _, old = self._entries.popitem(last=False)
        self._bytes -= int(old.nbytes)
        self.evictions += 1

  @property
  def num_bytes(self) -> int:
    return self._bytes

  def __len__(self) -> int:
    return len(self._entries)
