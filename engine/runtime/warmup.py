"""`Engine.warmup`'s work: compile every bucket before traffic arrives, then (with drafters)
time the speculative cost table.

Each program runs on the null page (writes at positions past the page table are dropped), so
no real cache entry changes: mixed prefill/decode shapes (and the draft model's catch-up
forward at each), the plain decode loop per decode batch size (and the learned table's update
from its tokens), the speculative loop per decode batch size when the engine has drafters, then
`SpecRuntime.measure_costs`; the masked step of constrained rows per decode batch size
(`EngineConfig.constrained_warmup`). The decode loops run every branch once (block widths,
logprobs, model drafters): a branch's first run is slow (`_spec_branches`). A model with a vision
tower also compiles each mixed shape's image-prefill program (`steps.model_step_embeds`).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from engine.runtime import steps
from engine.runtime.grammar import bitmask_words
from engine.runtime.page_pool import NULL_PAGE
from engine.runtime.speculative import catch_up
from engine.runtime.speculative.loop import DETERMINISTIC


def printer(out: Any = None) -> Callable[[int, int, str], None]:
  """A warm-up `progress` that prints "warm-up n/N programs, seconds: what" lines."""
  start = time.perf_counter()

  def progress(done: int, total: int, what: str) -> None:
    print(f"[moejax] warm-up {done}/{total} programs, {time.perf_counter() - start:.1f}s: "
          f"{what}", file=out or sys.stderr, flush=True)
  return progress


def compile_buckets(eng: Any, progress: Callable[[int, int, str], None] | None, *,
                    stop_width: int) -> int:
  """Runs every bucket's programs once on `eng` (an `Engine`; its step lock held, on its
  mesh). Returns the number of programs; `progress(done, total, what)` after each."""
  shapes = [("step", b, w) for b, w in eng.buckets.mixed_shapes()]
  shapes += [("decode", b, 1) for b in eng.buckets.decode]
  if eng.spec.enabled:
    shapes += [("spec", b, 1) for b in eng.buckets.decode]
  if eng.config.constrained_warmup:  # structured outputs' masked step (with drafts: k + 1)
    widths = (1, eng.spec.k + 1) if eng.spec.enabled else (1,)
    shapes += [("masked", b, t) for b in eng.buckets.decode for t in widths]
  for i, (kind, b, w) in enumerate(shapes):
    table = np.full((b, eng.max_pages_per_seq), NULL_PAGE, np.int32)
    zeros = np.zeros((b,), np.int32)
    # Work at positions past the page table (writes dropped): every loop body runs once.
    past = np.full((b,), eng.max_pages_per_seq * eng.config.page_size, np.int32)
    full, ones = np.full((b,), w, np.int32), np.ones((b,), np.int32)
    samp = eng._sampling_arrays([None] * b)
    stop_ids = np.full((b, stop_width), -1, np.int32)
    if kind == "step" and "draft" in eng.spec.enabled:  # the draft model's catch-up
      eng.spec.draft_cache = catch_up.draft_forward(
          eng.spec.draft_params, eng.spec.draft_cache, np.zeros((b, w), np.int32), past, full,
          table, cfg=eng.spec.draft_cfg, impl=eng.config.kernels)
    if kind == "step" and eng.spec.observes:
      *_, eng.cache = eng.spec.model_step(
          eng.params, eng.cache, np.zeros((b, w), np.int32), zeros, zeros, table, samp,
          np.zeros((b, w), np.int32), impl=eng.config.kernels)
    elif kind == "step":
      _plain_step(eng, b, w)
    elif kind == "masked":
      _masked_step(eng, b, w)
    elif kind == "spec":
      _spec_branches(eng, zeros, past, table, samp, stop_ids)
    else:  # (once with logprobs: `steps.decode_loop`'s conditional)
      for logprobs in (False, True):
        *_, eng.cache = eng.spec.decode(
            eng.params, eng.cache, [], zeros, past, table, samp, stop_ids, ones, zeros, 1, {},
            speculate=False, impl=eng.config.kernels, logprobs=logprobs)
    if kind == "step" and eng.images.pad_id is not None:  # image prefill (`steps.
      _image_step(eng, b, w)                             # model_step_embeds`)
    if progress is not None:
      progress(i + 1, len(shapes), f"{kind} [{b}x{w}]")
  if eng.spec.enabled and eng.config.measure_spec_costs:
    eng.cache = eng.spec.measure_costs(eng.params, eng.cache, eng.max_pages_per_seq,
                                       stop_width=stop_width, impl=eng.config.kernels)
  jax.block_until_ready(eng.cache)
  return len(shapes)


def _spec_branches(eng: Any, tokens: np.ndarray, past: np.ndarray, table: np.ndarray,
                   samp: Any, stop_ids: np.ndarray) -> None:
  """The speculative loop for len(tokens) rows, one iteration at each compiled block width
  (plain and K + 1; writes past the page table, dropped): with logprobs and rows drafting with
  each model drafter in turn, and with neither. The first run of a branch (`lax.cond`) costs
  ~30-50 ms more than later runs on the CPU demo (XLA:CPU). Rows of junk teach the table and
  counters nothing (`SpecRuntime.decode` with no requests)."""
  passes = [((d,), True) for d in eng.spec.enabled if d not in DETERMINISTIC] or [((), True)]
  passes.append(((), False))  # (rows, logprobs)
  for i in range(len(eng.spec.widths)):
    for rows, logprobs in passes:
      *_, eng.cache = eng.spec.decode(
          eng.params, eng.cache, [], tokens, past, table, samp, stop_ids, np.ones_like(tokens),
          np.zeros_like(tokens), 1, {}, speculate=True, impl=eng.config.kernels, force_k=i,
          logprobs=logprobs, warm_rows=rows)


def _plain_step(eng: Any, b: int, w: int) -> None:
  """The mixed prefill/decode step without the MTP layer, b rows of w tokens, once."""
  table = np.full((b, eng.max_pages_per_seq), NULL_PAGE, np.int32)
  past = np.full((b,), eng.max_pages_per_seq * eng.config.page_size, np.int32)
  _, _, eng.cache = steps.model_step(
      eng.params, eng.cache, np.zeros((b, w), np.int32), past, np.full((b,), w, np.int32),
      table, eng._sampling_arrays([None] * b), cfg=eng.cfg, impl=eng.config.kernels)


def _image_step(eng: Any, b: int, w: int) -> None:
  """The mixed step whose rows take image features, once (the tower itself compiles per image
  grid when first met)."""
  table = np.full((b, eng.max_pages_per_seq), NULL_PAGE, np.int32)
  past = np.full((b,), eng.max_pages_per_seq * eng.config.page_size, np.int32)
  _, _, eng.cache = steps.model_step_embeds(
      eng.params, eng.cache, np.zeros((b, w), np.int32), past, np.full((b,), w, np.int32),
      table, eng._sampling_arrays([None] * b), np.zeros((b, w, eng.cfg.hidden_size),
                                                        eng.images.dtype),
      np.ones((b, w), bool), cfg=eng.cfg, impl=eng.config.kernels)


def _masked_step(eng: Any, b: int, t: int) -> None:
  """The constrained rows' masked step, b rows of t tokens (positions past the page table)."""
  table = np.full((b, eng.max_pages_per_seq), NULL_PAGE, np.int32)
  past = np.full((b,), eng.max_pages_per_seq * eng.config.page_size, np.int32)
  bits = np.full((b, t, bitmask_words(eng.cfg.vocab_size)), -1, np.int32)
  for logprobs in (False, True):  # (its logprobs are a conditional)
    *_, eng.cache = steps.masked_step(
        eng.params, eng.cache, np.zeros((b, t), np.int32), past,
        np.full((b,), t - 1, np.int32), table, eng._sampling_arrays([None] * b), bits,
        np.bool_(logprobs), cfg=eng.cfg, impl=eng.config.kernels)
