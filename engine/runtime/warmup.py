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

Compiling is most of a cold warm-up (~4-7 s a program on 2 CPU cores, the demo model). So the
programs whose arguments are known before anything runs (the mixed steps, the plain decode
loops, the masked steps: `_programs`) are first lowered one by one on this thread and compiled
ahead on `compile_workers()` threads (XLA releases the GIL); the run that follows finds each
compiled in memory (also with the persistent cache off). The speculative loops and the cost
table's timing compile at their runs, as before.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

from engine.runtime import steps
from engine.runtime.grammar import bitmask_words
from engine.runtime.page_pool import NULL_PAGE
from engine.runtime.speculative import catch_up
from engine.runtime.speculative.loop import DETERMINISTIC
from engine.runtime.speculative.runtime import spec_model_step


def printer(out: Any = None) -> Callable[[int, int, str], None]:
  """A warm-up `progress` that prints "warm-up n/N programs, seconds: what" lines."""
  start = time.perf_counter()

  def progress(done: int, total: int, what: str) -> None:
    print(f"[moejax] warm-up {done}/{total} programs, {time.perf_counter() - start:.1f}s: "
          f"{what}", file=out or sys.stderr, flush=True)
  return progress


def compile_workers() -> int:
  """Threads that compile warm-up programs ahead: $MOEJAX_COMPILE_WORKERS, else the CPUs this
  process may use, at most 4 (1 or less: none; each program compiles at its run)."""
  if os.environ.get("MOEJAX_COMPILE_WORKERS"):
    return int(os.environ["MOEJAX_COMPILE_WORKERS"])
  return min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)


def warmup_shapes(eng: Any) -> list[tuple[str, int, int]]:
  """What warm-up compiles, in order: (kind, rows, width) for each mixed shape ("step"), decode
  batch size ("decode"; "spec" with drafters) and constrained rows' masked step ("masked")."""
  shapes = [("step", b, w) for b, w in eng.buckets.mixed_shapes()]
  shapes += [("decode", b, 1) for b in eng.buckets.decode]
  if eng.spec.enabled:
    shapes += [("spec", b, 1) for b in eng.buckets.decode]
  if eng.config.constrained_warmup:  # structured outputs' masked step (with drafts: k + 1)
    widths = (1, eng.spec.k + 1) if eng.spec.enabled else (1,)
    shapes += [("masked", b, t) for b in eng.buckets.decode for t in widths]
  return shapes


def compile_buckets(eng: Any, progress: Callable[[int, int, str], None] | None, *,
                    stop_width: int, workers: int | None = None) -> int:
  """Runs every bucket's programs once on `eng` (an `Engine`; its step lock held, on its
  mesh). Returns the number of programs; `progress(done, total, what)` (on this thread) as
  each is compiled ahead (`workers` threads, default `compile_workers()`), else after its run."""
  shapes = warmup_shapes(eng)
  names = [f"{kind} [{b}x{w}]" for kind, b, w in shapes]
  ahead = _compile_ahead(eng, shapes, stop_width, workers or compile_workers(), progress,
                         names)
  done = len(ahead)
  for i, (kind, b, w) in enumerate(shapes):
    table, past = _null_rows(eng, b)
    zeros, ones = np.zeros((b,), np.int32), np.ones((b,), np.int32)
    samp = eng._sampling_arrays([None] * b)
    stop_ids = np.full((b, stop_width), -1, np.int32)
    if kind == "step":
      for fn, args, kwargs, keep in _step_programs(eng, b, w):
        keep(eng, fn(*args, **kwargs))
    elif kind == "masked":
      for logprobs in (False, True):  # (its logprobs are a conditional)
        fn, args, kwargs, _ = _masked_program(eng, b, w, logprobs)
        *_, eng.cache = fn(*args, **kwargs)
    elif kind == "spec":
      _spec_branches(eng, zeros, past, table, samp, stop_ids)
    else:  # (once with logprobs: `steps.decode_loop`'s conditional)
      for logprobs in (False, True):
        *_, eng.cache = eng.spec.decode(
            eng.params, eng.cache, [], zeros, past, table, samp, stop_ids, ones, zeros, 1, {},
            speculate=False, impl=eng.config.kernels, logprobs=logprobs)
    if progress is not None and i not in ahead:
      done += 1
      progress(done, len(shapes), names[i])
  if eng.spec.enabled and eng.config.measure_spec_costs:
    eng.cache = eng.spec.measure_costs(eng.params, eng.cache, eng.max_pages_per_seq,
                                       stop_width=stop_width, impl=eng.config.kernels)
  jax.block_until_ready(eng.cache)
  return len(shapes)


def _compile_ahead(eng: Any, shapes: list[tuple[str, int, int]], stop_width: int, workers: int,
                   progress: Callable[[int, int, str], None] | None,
                   names: list[str]) -> set[int]:
  """Lowers each shape's programs (`_programs`) here, in order, and compiles them on `workers`
  threads meanwhile. A later call with the same arguments finds the executable in JAX's
  in-memory caches (its lowering is cached, and holds what it compiled). Returns the indices
  of the shapes compiled ahead (none with workers <= 1)."""
  if workers <= 1:
    return set()
  done: set[int] = set()

  def report(finished):
    for f in finished:
      i = pending.pop(f)
      f.result()  # (a compile error raises here, as it would have at the program's run)
      done.add(i)
      if progress is not None:
        progress(len(done), len(shapes), names[i])

  pending: dict[Any, int] = {}
  with concurrent.futures.ThreadPoolExecutor(workers, "moejax-warmup") as pool:
    for i, (kind, b, w) in enumerate(shapes):
      programs = _programs(eng, kind, b, w, stop_width)
      if not programs or not all(hasattr(p[0], "lower") for p in programs):
        continue
      lowered = [fn.lower(*args, **kwargs) for fn, args, kwargs, _ in programs]
      pending[pool.submit(lambda ls: [lo.compile() for lo in ls], lowered)] = i
      report([f for f in pending if f.done()])
    report(concurrent.futures.as_completed(list(pending)))
  return done


def _spec_branches(eng: Any, tokens: np.ndarray, past: np.ndarray, table: np.ndarray,
                   samp: Any, stop_ids: np.ndarray) -> None:
  """The speculative loop for len(tokens) rows, one iteration at each compiled block width
  (plain and K + 1; writes past the page table, dropped): with logprobs and rows drafting with
  each model drafter in turn, and with neither: a branch's (`lax.cond`) first run costs more
  than later ones, and warm-up pays it instead of a request. Rows of junk teach the table and
  counters nothing (`SpecRuntime.decode` with no requests)."""
  passes = [((d,), True) for d in eng.spec.enabled if d not in DETERMINISTIC] or [((), True)]
  passes.append(((), False))  # (rows, logprobs)
  for i in range(len(eng.spec.widths)):
    for rows, logprobs in passes:
      *_, eng.cache = eng.spec.decode(
          eng.params, eng.cache, [], tokens, past, table, samp, stop_ids, np.ones_like(tokens),
          np.zeros_like(tokens), 1, {}, speculate=True, impl=eng.config.kernels, force_width=i,
          logprobs=logprobs, warm_rows=rows)


def _null_rows(eng: Any, b: int) -> tuple[np.ndarray, np.ndarray]:
  """b rows' page table (the null page) and positions past it: writes there are dropped."""
  return (np.full((b, eng.max_pages_per_seq), NULL_PAGE, np.int32),
          np.full((b,), eng.max_pages_per_seq * eng.config.page_size, np.int32))


def _programs(eng: Any, kind: str, b: int, w: int, stop_width: int) -> list[tuple]:
  """The jitted programs a shape's run compiles, each (fn, args, kwargs, keep) with the
  arguments it is called with; [] for the speculative loop's (compiled at their runs)."""
  if kind == "step":
    return list(_step_programs(eng, b, w))
  if kind == "masked":
    return [_masked_program(eng, b, w, False)]
  if kind == "decode":
    table, past = _null_rows(eng, b)
    zeros = np.zeros((b,), np.int32)
    fn, args, kwargs = eng.spec.plain_program(
        eng.params, eng.cache, [], zeros, past, table, eng._sampling_arrays([None] * b),
        np.full((b, stop_width), -1, np.int32), np.ones((b,), np.int32), zeros, 1,
        impl=eng.config.kernels, logprobs=False)
    return [(fn, args, kwargs, None)]
  return []


def _keep_cache(eng: Any, out: Any) -> None:
  eng.cache = out[-1]


def _step_programs(eng: Any, b: int, w: int) -> Iterator[tuple]:
  """A mixed shape's programs, b rows of w tokens: the draft model's catch-up forward (drafter
  "draft"), the step (with the MTP layer when a drafter observes it) and, for a model with a
  vision tower, the step whose rows take image features (`steps.model_step_embeds`; the tower
  itself compiles per image grid when first met). Yielded one by one, so a run that consumes
  them makes each one's arguments after the previous one donated the cache."""
  table, past = _null_rows(eng, b)
  zeros, full = np.zeros((b,), np.int32), np.full((b,), w, np.int32)
  samp, kernels = eng._sampling_arrays([None] * b), dict(impl=eng.config.kernels)
  if "draft" in eng.spec.enabled:
    yield (catch_up.draft_forward, (eng.spec.draft_params, eng.spec.draft_cache,
                                    np.zeros((b, w), np.int32), past, full, table),
           dict(cfg=eng.spec.draft_cfg, **kernels),
           lambda e, cache: setattr(e.spec, "draft_cache", cache))
  if eng.spec.observes:
    yield (spec_model_step, (eng.params, eng.cache, np.zeros((b, w), np.int32), zeros,
                             zeros, table, samp, np.zeros((b, w), np.int32)),
           dict(cfg=eng.cfg, **kernels), _keep_cache)
  else:
    yield (steps.model_step, (eng.params, eng.cache, np.zeros((b, w), np.int32), past,
                              full, table, samp), dict(cfg=eng.cfg, **kernels), _keep_cache)
  if eng.images.pad_id is not None:
    yield (steps.model_step_embeds, (
        eng.params, eng.cache, np.zeros((b, w), np.int32), past, full, table, samp,
        np.zeros((b, w, eng.cfg.hidden_size), eng.images.dtype), np.ones((b, w), bool)),
        dict(cfg=eng.cfg, **kernels), _keep_cache)


def _masked_program(eng: Any, b: int, t: int, logprobs: bool) -> tuple:
  """The constrained rows' masked step, b rows of t tokens (positions past the page table)."""
  table, past = _null_rows(eng, b)
  bits = np.full((b, t, bitmask_words(eng.cfg.vocab_size)), -1, np.int32)
  return (steps.masked_step, (eng.params, eng.cache, np.zeros((b, t), np.int32), past,
                              np.full((b,), t - 1, np.int32), table,
                              eng._sampling_arrays([None] * b), bits, np.bool_(logprobs)),
          dict(cfg=eng.cfg, impl=eng.config.kernels), _keep_cache)
