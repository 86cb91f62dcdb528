"""`Engine.warmup`'s work: compile every bucket before traffic arrives, then (with drafters)
time the speculative cost table.

Warm-up is a sequence of step descriptions the engine core makes and its model runner executes,
like any step (so a follower host of a multi-host replica runs it in lockstep): each program on
the null page (writes at positions past the page table are dropped), so no real cache entry
changes: mixed prefill/decode shapes (and a drafter's own program at each, the draft model's
catch-up), the plain decode loop per decode batch size (with learners: the learned table's
update from its tokens), the speculative loop per decode batch size when the engine has
drafters, then the cost table's timing calls (`SpecPolicy.measure_costs`); the masked step of
constrained rows per decode batch size (`EngineConfig.constrained_warmup`). The decode loops run
every branch once (block widths, logprobs, model drafters): a branch's first run is slow
(`_spec_steps`). A model with a vision tower also compiles each mixed shape's image-prefill
program.

Compiling is most of a cold warm-up (~4-7 s a program on 2 CPU cores, the demo model). So the
programs whose arguments are known before anything runs (the mixed steps, the plain decode
loops, the masked steps) are first lowered one by one on this thread and compiled ahead on
`compile_workers()` threads (XLA releases the GIL); the run that follows finds each compiled in
memory (also with the persistent cache off). The speculative loops and the cost table's timing
compile at their runs.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from engine.runtime import batching
from engine.runtime.grammar import bitmask_words
from engine.runtime.request import MAX_STOP_IDS
from engine.runtime.step_description import (CLEAR_NULL_PAGE, DRAFTER, MASKED,
                                             StepDescription)

Step = tuple[StepDescription, bool]  # (a warm-up step, whether it is compiled ahead)


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
  if eng.spec is not None:
    shapes += [("spec", b, 1) for b in eng.buckets.decode]
  if eng.config.constrained_warmup:  # structured outputs' masked step (with drafts: k + 1)
    widths = (1, eng.k + 1) if eng.spec is not None else (1,)
    shapes += [("masked", b, t) for b in eng.buckets.decode for t in widths]
  return shapes


def shape_steps(eng: Any, kind: str, b: int, w: int) -> list[Step]:
  """The warm-up steps of one shape, in order."""
  max_pages, page_size = eng.max_pages_per_seq, eng.config.page_size
  if kind == "step":
    return list(_mixed_steps(eng, b, w))
  if kind == "decode":  # (once with logprobs: `steps.decode_loop`'s conditional)
    return [(_null_decode(eng, b, logprobs=lp), not lp) for lp in (False, True)]
  if kind == "spec":
    return [(d, False) for d in _spec_steps(eng, b)]
  if kind == "masked":  # (its logprobs are a conditional)
    table, past = batching.null_rows(b, max_pages, page_size)
    bits = np.full((b, w, bitmask_words(eng.cfg.vocab_size)), -1, np.int32)
    return [(StepDescription(MASKED, dict(
        tokens=np.zeros((b, w), np.int32), start=past, n_draft=np.full((b,), w - 1, np.int32),
        page_table=table, bitmask=bits, **batching.sampling([None] * b)),
        dict(want_logprobs=lp)), not lp) for lp in (False, True)]
  raise ValueError(f"unknown warm-up shape kind {kind!r}")


def run_shapes(eng: Any, shapes: list[tuple[str, int, int]]) -> None:
  """Runs these shapes' warm-up steps (`shape_steps`) on `eng` (its step lock held)."""
  for kind, b, w in shapes:
    for desc, _ in shape_steps(eng, kind, b, w):
      eng.runner.execute(desc)


def compile_buckets(eng: Any, progress: Callable[[int, int, str], None] | None, *,
                    workers: int | None = None) -> int:
  """Runs every bucket's programs once on `eng` (an `Engine`; its step lock held). Returns the
  number of shapes; `progress(done, total, what)` (on this thread) as each is compiled ahead
  (`workers` threads, default `compile_workers()`), else after its run."""
  if eng.runner.on_warmup is not None:  # a multi-host leader: the followers compile ahead too
    eng.runner.on_warmup()
  shapes = warmup_shapes(eng)
  names = [f"{kind} [{b}x{w}]" for kind, b, w in shapes]
  ahead = compile_ahead(eng, shapes, workers or compile_workers(), progress, names)
  done = len(ahead)
  for i, (kind, b, w) in enumerate(shapes):
    for desc, _ in shape_steps(eng, kind, b, w):
      eng.runner.execute(desc)
    if progress is not None and i not in ahead:
      done += 1
      progress(done, len(shapes), names[i])
  if eng.spec is not None and eng.config.measure_spec_costs:
    measure_costs(eng)
  jax.block_until_ready(eng.runner.cache)
  return len(shapes)


def measure_costs(eng: Any, **kwargs) -> None:
  """Times the speculative cost table (`SpecPolicy.measure_costs`) with junk rows at a
  quarter of the page table's length (writes on the null page, cleared after)."""
  rng = np.random.default_rng(0)
  max_pages, page_size = eng.max_pages_per_seq, eng.config.page_size
  n = min(kwargs.get("iterations", eng.config.max_decode_steps), eng.config.max_decode_steps)
  context = max(max_pages * page_size // 4 - n * (eng.k + 1), 0)

  def junk_call(b: int, n_steps: int) -> StepDescription:
    desc = batching.null_decode(
        b, max_pages, page_size, MAX_STOP_IDS, num_steps=n_steps, logprobs=False,
        tokens=rng.integers(0, eng.cfg.vocab_size, (b,), dtype=np.int32),
        n_cached=np.full((b,), context, np.int32), table=np.zeros((b, max_pages), np.int32))
    return batching.with_learner_inputs(desc, eng.runner.learners, [])

  eng.spec.measure_costs(eng.runner.execute, junk_call, **kwargs)
  eng.runner.execute(StepDescription(CLEAR_NULL_PAGE))


def compile_ahead(eng: Any, shapes: list[tuple[str, int, int]], workers: int,
                  progress: Callable[[int, int, str], None] | None,
                  names: list[str]) -> set[int]:
  """Lowers each shape's programs compiled ahead (`shape_steps`) here, in order, and compiles
  them on `workers` threads meanwhile. A later call with the same arguments finds the
  executable in JAX's in-memory caches (its lowering is cached, and holds what it compiled).
  Returns the indices of the shapes compiled ahead (none with workers <= 1)."""
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
  with concurrent.futures.ThreadPoolExecutor(workers, "moejax-warmup") as pool, \
      eng.runner.on_mesh():
    for i, (kind, b, w) in enumerate(shapes):
      steps = [d for d, ahead in shape_steps(eng, kind, b, w) if ahead]
      programs = [eng.runner.program(d) for d in steps]
      if not programs or not all(hasattr(p.fn, "lower") for p in programs):
        continue
      lowered = [p.fn.lower(*p.args, **p.kwargs) for p in programs]
      pending[pool.submit(lambda ls: [lo.compile() for lo in ls], lowered)] = i
      report([f for f in pending if f.done()])
    report(concurrent.futures.as_completed(list(pending)))
  return done


def _null_decode(eng: Any, b: int, *, logprobs: bool, num_steps: int = 1) -> StepDescription:
  desc = batching.null_decode(b, eng.max_pages_per_seq, eng.config.page_size, MAX_STOP_IDS,
                              num_steps=num_steps, logprobs=logprobs)
  return batching.with_learner_inputs(desc, eng.runner.learners, [])


def _spec_steps(eng: Any, b: int) -> list[StepDescription]:
  """The speculative loop for b rows, one iteration at each compiled block width (plain and
  K + 1; writes past the page table, dropped): with logprobs and rows drafting with each model
  drafter in turn, and with neither: a branch's (`lax.cond`) first run costs more than later
  ones, and warm-up pays it instead of a request. Junk rows teach the table and counters
  nothing (`SpecPolicy.describe` with no requests)."""
  model = [d.name for d in eng.spec.drafters if not d.deterministic]
  passes = [((d,), True) for d in model] or [((), True)]
  passes.append(((), False))  # (rows, logprobs)
  out = []
  for i in range(len(eng.spec.widths)):
    for rows, logprobs in passes:
      _, desc, _ = eng.spec.describe([], _null_decode(eng, b, logprobs=logprobs), None,
                                     force_width=i, warm_rows=rows)
      out.append(desc)
  return out


def _mixed_steps(eng: Any, b: int, w: int):
  """A mixed shape's programs, b rows of w tokens: each drafter's own program at that shape
  (the draft model's catch-up forward), the step (with the drafters that observe prefill)
  and, for a model with a vision tower, the step whose rows take image features (the tower
  itself compiles per image grid when first met)."""
  max_pages, page_size = eng.max_pages_per_seq, eng.config.page_size
  table, past = batching.null_rows(b, max_pages, page_size)
  for d in (eng.spec.drafters if eng.spec is not None else ()):
    arrays = d.warm_arrays(b, w, past, table)
    if arrays is not None:
      yield StepDescription(DRAFTER, arrays, {"drafter": d.name}), True
  observe = bool(eng.spec is not None and eng.spec.observers)
  yield batching.null_mixed(b, w, max_pages, page_size, observe=observe), True
  if eng.images.pad_id is not None:
    feats = (np.zeros((b, w, eng.cfg.hidden_size), eng.images.dtype), np.ones((b, w), bool))
    # (an engine whose observers serve images, EAGLE-3's, runs image steps with them)
    observe_images = observe and not eng.spec.refuses_images()
    yield batching.null_mixed(b, w, max_pages, page_size, observe=observe_images,
                              features=feats), True
