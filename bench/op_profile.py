"""Where a compiled program's time goes, by source line: an XLA:CPU (or GPU) trace attributed
through the compiled HLO's stack frames.

    python -m bench.op_profile                          # serving loop, every drafter, k = 0
    python -m bench.op_profile --force_width=1 --rows=learned --out=prof.json
    python -m bench.op_profile --program=decode_loop    # the plain decode loop, same batch

Serves a batch of the demo prompts on an `Engine` (demo model, every drafter the model
supports), captures the step description of one full decode call of `--program`
("speculative_decode_loop" or "decode_loop"), then re-runs that call under `jax.profiler`: every
executed op is charged to the outermost frame in `engine/` or `pallas_kernels/` (`--depth=outer`,
e.g. `moe_experts_all`, `compute_logits`) or its innermost (`--depth=inner`). Ops without a
frame (copies, tuple plumbing) are "?". With the speculative loop, `--rows` sets every row's
drafter and `--force_width` the block width (an index into the compiled widths (0, K): 1 is the
block; -1: the loop's plan).

Prints a table (op time, share, executions) and the call's wall time (best of 5, untraced);
tracing adds per-op cost, so read the shares, not the absolute figures. The method behind the
2026-12-01 entries of BENCHMARKS.md ("speculative loop overhead").
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import tempfile
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import app, flags

import engine as moejax
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import drafters as registry
from engine.runtime.step_description import DECODE, SPEC_DECODE

from bench.spec_workloads import FRESH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_enum("program", "speculative_decode_loop", ["speculative_decode_loop",
                                                         "decode_loop"], "Which call.")
flags.DEFINE_integer("force_width", 0, "Speculative loop: index into the compiled widths (0: "
                     "plain, 1: the K + 1 block; -1: the loop's plan chooses).")
flags.DEFINE_enum("rows", "off", list(registry.ids()), "Speculative loop: every row's drafter.")
flags.DEFINE_integer("batch", 4, "Requests.")
flags.DEFINE_list("drafters", ["ngram", "learned", "mtp", "draft"], "The engine's drafters "
                  "(its speculative loop carries every one, used or not).")
flags.DEFINE_integer("num_draft_tokens", 4, "K.")
flags.DEFINE_enum("depth", "outer", ["outer", "inner"], "Frame an op is charged to.")
flags.DEFINE_integer("top", 30, "Rows printed.")
flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"], "Parameter dtype.")
flags.DEFINE_string("out", "", "Write the table as JSON here.")

_OURS = ("/engine/", "/pallas_kernels/")


def frames_by_op(hlo: str) -> dict[str, list[tuple[str, str, int]]]:
  """op name -> its stack, innermost first: (file, function, line), from the HLO text's
  FileNames / FunctionNames / FileLocations / StackFrames tables."""
  tables: dict[str, dict[int, Any]] = collections.defaultdict(dict)
  section = None
  for line in hlo.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    if section and not line.strip():
      section = None
      continue
    if section in ("FileNames", "FunctionNames"):
      i, name = line.split(" ", 1)
      tables[section][int(i)] = name.strip('"')
    elif section == "FileLocations":
      m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", line)
      tables[section][int(m[1])] = (int(m[2]), int(m[3]), int(m[4]))
    elif section == "StackFrames":
      m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
      tables[section][int(m[1])] = (int(m[2]), int(m[3]))
  files, funcs = tables["FileNames"], tables["FunctionNames"]
  locs, frames = tables["FileLocations"], tables["StackFrames"]

  def stack(fid: int) -> list[tuple[str, str, int]]:
    out = []
    while fid in frames:
      loc, parent = frames[fid]
      f, fn, ln = locs[loc]
      out.append((files[f], funcs[fn], ln))
      if parent == fid:
        break
      fid = parent
    return out

  return {m[1]: stack(int(m[2])) for m in re.finditer(
      r"^\s*(?:ROOT )?%([\w.\-]+) = .*stack_frame_id=(\d+)", hlo, re.MULTILINE)}


def op_times(call: Callable[[], Any]) -> tuple[collections.Counter, collections.Counter]:
  """(total ns, executions) per op name over one traced run of `call`."""
  from jax._src.profiler import ProfileData  # the trace reader jax ships
  total, count = collections.Counter(), collections.Counter()
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      jax.block_until_ready(call())
    data = ProfileData.from_file(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
    for plane in data.planes:
      for line in plane.lines:
        if not line.name.startswith("tf_XLA"):
          continue
        for ev in line.events:
          if not ev.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "Threadpool")):
            total[ev.name] += ev.duration_ns
            count[ev.name] += 1
  return total, count


def attribute(hlo: str, total, count, depth: str) -> list[dict]:
  stacks = frames_by_op(hlo)
  by, n = collections.Counter(), collections.Counter()
  for op, ns in total.items():
    ours = [f for f in stacks.get(op, []) if any(p in f[0] for p in _OURS)]
    frame = (ours[-1] if depth == "outer" else ours[0]) if ours else None
    key = f"{frame[1]}:{frame[2]}" if frame else "?"
    by[key] += ns
    n[key] += count[op]
  whole = sum(by.values()) or 1
  return [dict(where=k, us=v / 1e3, share=v / whole, executions=n[k])
          for k, v in by.most_common()]


def main(argv):
  del argv
  model = moejax.load(os.path.join(ROOT, "checkpoints", "demo", "target"), progress=False,
                      dtype=FLAGS.dtype)
  drafters = [d for d in FLAGS.drafters
              if d != "mtp" or model.config.num_nextn_predict_layers]
  draft = (moejax.load(os.path.join(ROOT, "checkpoints", "demo", "draft"), progress=False,
                       dtype=FLAGS.dtype) if "draft" in drafters else None)
  eng = Engine.from_model(model, EngineConfig(
      max_num_seqs=FLAGS.batch, max_num_batched_tokens=512, max_model_len=512,
      max_decode_steps=16, drafters=tuple(drafters),
      num_draft_tokens=FLAGS.num_draft_tokens, adaptive_k=True), draft_model=draft)
  kind = SPEC_DECODE if FLAGS.program == "speculative_decode_loop" else DECODE
  real = eng.runner.execute
  captured = []

  def capture(desc):  # a full call (num_steps >= 16)
    if desc.kind == kind and desc.scalars["num_steps"] >= 16 and not captured:
      captured.append(desc)
    return real(desc)

  eng.runner.execute = capture
  drafter = "off" if FLAGS.program == "decode_loop" else (FLAGS.rows if FLAGS.rows != "off"
                                                          else "ngram")
  ids = [model.encode(p) for p in (FRESH * 4)[:FLAGS.batch]]
  eng.generate(ids, SamplingParams(drafter=drafter), StopParams(max_tokens=64, ignore_eos=True))
  eng.runner.execute = real
  if not captured:
    raise SystemExit(f"no full call of {FLAGS.program}")
  desc = captured[0]
  a = desc.arrays
  b = a["tokens"].shape[0]
  a["remaining"] = np.full((b,), 16, np.int32)  # every row runs 16 tokens
  if kind == SPEC_DECODE:
    desc.scalars["time_budget"] = float("inf")  # (the tokens alone bound the call)
    row = registry.drafter_id(FLAGS.rows)
    a["row_drafter"] = np.full((b,), row, np.int32)
    a["row_auto"] = np.zeros((b,), bool)
    a["fed"] = np.zeros_like(a["fed"])
    a["fed"][:, row] = row > 0  # (its model drafter fed for every row)
    desc.scalars["force_width"] = int(FLAGS.force_width)
  run = lambda: eng.runner.execute(desc)  # noqa: E731 (the cache comes back to the runner)
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - t0)
  prog = eng.runner.program(desc)
  with eng.runner.on_mesh():
    hlo = prog.fn.lower(*prog.args, **prog.kwargs).compile().as_text()
  rows = attribute(hlo, *op_times(run), FLAGS.depth)
  print(f"{FLAGS.program} (rows {FLAGS.rows}, force_width {FLAGS.force_width}): "
        f"{best * 1e3:.2f} ms per 16-step call untraced")
  print(f"{'op time us':>11} {'share':>6} {'execs':>6}  where")
  for r in rows[:FLAGS.top]:
    print(f"{r['us']:11.0f} {r['share']:6.1%} {r['executions']:6d}  {r['where']}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(dict(program=FLAGS.program, rows_drafter=FLAGS.rows, force_width=FLAGS.force_width,
                     call_ms=best * 1e3, table=rows), fh, indent=1)
  return 0


if __name__ == "__main__":
  app.run(main)
