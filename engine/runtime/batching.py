"""The engine core's half of a step's inputs: scheduled requests -> step descriptions.

Rows are laid out here, at the compiled shapes (`buckets.py`), from the requests' host state:
a mixed step's segments packed as `[B, W]` rows, a decode call's rows padded to its bucket,
with their page-table rows, sampling parameters and stop rules. Padding and warm-up rows sit
past the page table on the null page, so nothing they write lands anywhere.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.runtime.page_pool import NULL_PAGE
from engine.runtime.request import Request, wants_logprobs
from engine.runtime.sampling import SamplingArrays, SamplingParams
from engine.runtime.step_description import (DECODE, MIXED, StepDescription,
                                             sampling_arrays)


def page_table_row(req: Request, max_pages: int) -> np.ndarray:
  row = np.full((max_pages,), NULL_PAGE, np.int32)
  row[:len(req.pages)] = req.pages
  return row


def sampling(reqs: Sequence[Request | None]) -> dict[str, np.ndarray]:
  """Per-row sampling parameters as description arrays; padding rows (None) sample greedily."""
  default = SamplingParams()
  return sampling_arrays(SamplingArrays.from_params(
      [r.sampling if r is not None else default for r in reqs],
      [r.thought if r is not None else None for r in reqs]))


def null_rows(b: int, max_pages: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
  """b rows' page table (the null page) and positions past it: writes there are dropped."""
  return (np.full((b, max_pages), NULL_PAGE, np.int32),
          np.full((b,), max_pages * page_size, np.int32))


def mixed(segments: Sequence[Any], b: int, w: int, max_pages: int, *, observe: bool,
          features: tuple[np.ndarray, np.ndarray] | None = None
          ) -> tuple[StepDescription, list[int]]:
  """A mixed step: each segment of n tokens as ceil(n / w) rows of w, b rows in all.
  `observe`: with the token after each position (drafters that observe prefill); `features`:
  image rows (`multimodal_step`). Returns (description, each segment's last row: where it
  samples, if it does)."""
  tokens = np.zeros((b, w), np.int32)
  start = np.zeros((b,), np.int32)
  n_new = np.zeros((b,), np.int32)
  table = np.full((b, max_pages), NULL_PAGE, np.int32)
  row_req: list[Request | None] = [None] * b
  next_tokens = np.zeros((b, w), np.int32)  # token after each position (-1: sampled here)
  last_rows: list[int] = []
  r = 0
  for seg in segments:
    ids = seg.request.all_ids[seg.start:seg.start + seg.num_tokens + 1]
    table_row = page_table_row(seg.request, max_pages)
    for off in range(0, seg.num_tokens, w):
      chunk = ids[off:min(off + w, seg.num_tokens)]
      tokens[r, :len(chunk)] = chunk
      nxt = ids[off + 1:off + 1 + len(chunk)]
      next_tokens[r, :len(chunk)] = nxt + [-1] * (len(chunk) - len(nxt))
      start[r], n_new[r], table[r] = seg.start + off, len(chunk), table_row
      row_req[r] = seg.request
      r += 1
    last_rows.append(r - 1)
  arrays = dict(tokens=tokens, start=start, n_new=n_new, page_table=table, **sampling(row_req))
  if observe:
    arrays["next_tokens"] = next_tokens
  if features is not None:
    arrays["features"], arrays["feature_mask"] = features
  return StepDescription(MIXED, arrays), last_rows


def null_mixed(b: int, w: int, max_pages: int, page_size: int, *, observe: bool,
               features: tuple[np.ndarray, np.ndarray] | None = None) -> StepDescription:
  """A mixed step of b junk rows of w tokens written nowhere (warm-up)."""
  table, past = null_rows(b, max_pages, page_size)
  arrays = dict(tokens=np.zeros((b, w), np.int32), start=past,
                n_new=np.full((b,), w, np.int32), page_table=table, **sampling([None] * b))
  if observe:
    arrays.update(start=np.zeros((b,), np.int32), n_new=np.zeros((b,), np.int32),
                  next_tokens=np.zeros((b, w), np.int32))
  if features is not None:
    arrays["features"], arrays["feature_mask"] = features
  return StepDescription(MIXED, arrays)


def decode(reqs: Sequence[Request], b: int, max_pages: int, stop_width: int, *,
           remaining: Sequence[int], num_steps: int,
           logprobs: bool | None = None) -> StepDescription:
  """A decode-only call of `reqs` padded to b rows (`steps.DecodeBatch`'s fields): each row's
  newest token, cached length, pages, stop ids, tokens it may still emit (`remaining`, capped
  by num_steps) and tokens before its stop ids count."""
  tokens = np.zeros((b,), np.int32)
  n_cached = np.zeros((b,), np.int32)
  table = np.full((b, max_pages), NULL_PAGE, np.int32)
  stop_ids = np.full((b, stop_width), -1, np.int32)
  left = np.zeros((b,), np.int32)
  left[:len(reqs)] = remaining
  min_before = np.zeros((b,), np.int32)
  for i, req in enumerate(reqs):
    tokens[i], n_cached[i], table[i] = req.output_ids[-1], req.num_computed, page_table_row(
        req, max_pages)
    stop_ids[i, :len(req.stop_ids)] = req.stop_ids
    min_before[i] = max(0, req.stop.min_tokens - len(req.output_ids))
  return StepDescription(
      DECODE, dict(tokens=tokens, n_cached=n_cached, page_table=table, stop_ids=stop_ids,
                   remaining=np.minimum(left, num_steps), min_before_stop=min_before,
                   **sampling(list(reqs) + [None] * (b - len(reqs)))),
      dict(num_steps=int(num_steps), want_logprobs=bool(wants_logprobs(reqs, logprobs))))


def null_decode(b: int, max_pages: int, page_size: int, stop_width: int, *, num_steps: int,
                logprobs: bool, n_cached: np.ndarray | None = None,
                tokens: np.ndarray | None = None, table: np.ndarray | None = None
                ) -> StepDescription:
  """A decode call of b junk rows (warm-up, the cost table's timing), each allowed num_steps
  tokens; on the null page past the page table unless given positions and a table."""
  null_table, past = null_rows(b, max_pages, page_size)
  return StepDescription(
      DECODE, dict(tokens=np.zeros((b,), np.int32) if tokens is None else tokens,
                   n_cached=past if n_cached is None else n_cached,
                   page_table=null_table if table is None else table,
                   stop_ids=np.full((b, stop_width), -1, np.int32),
                   remaining=np.full((b,), num_steps, np.int32),
                   min_before_stop=np.zeros((b,), np.int32), **sampling([None] * b)),
      dict(num_steps=int(num_steps), want_logprobs=bool(logprobs)))


def with_learner_inputs(desc: StepDescription, learners: Sequence[Any],
                        reqs: Sequence[Request]) -> StepDescription:
  """A plain decode call's description with what its learners (`Drafter.learns_from_plain`)
  read, `<drafter>.<name>` (junk rows: none of them teach)."""
  b = desc.arrays["tokens"].shape[0]
  for d in learners:
    desc.arrays.update({f"{d.name}.{k}": v for k, v in d.plain_inputs(reqs, b).items()})
  return desc
