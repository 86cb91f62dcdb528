"""Speculative decoding benchmark on the demo model: accepted length, tok/s, speedup, identity.

    python -m bench.speculative                                   # demo target + demo draft
    python -m bench.speculative --methods=ngram,mtp --num_draft=2,4,8 --out=spec.json
    python -m bench.speculative --dtype=float32 --num_draft=4,8 --learning_curve=5

Two workloads of `--batch` prompts (a list: each batch size in turn), greedy,
`--max_new_tokens` each (EOS ignored):
* fresh: short code openings the model continues freely (little to copy);
* agent: agent-style repetition: a later turn that resends the conversation: the fresh prompt,
  the model's own greedy continuation of it, a blank line, and the same prompt again, so the
  answer repeats earlier context (as re-sent tool calls and code edits do).

Rows, for each K of `--num_draft` (every call is `engine.generate`: the batch as requests of
an engine the model keeps; since issue 47 there is no other generate path, and the two "paths"
name two groups of rows measured the same way):
* path "loop": every method with a fixed draft length and, with `--adaptive`, with adaptive
  draft length; their speedup is over plain `engine.generate` (`off`);
* path "engine" (`--auto`): method "auto" (every drafter the model supports, chosen per decode
  loop, adaptive k); its speedup is over the same plain calls. Every call first empties the
  kept engines' prefix caches (it computes its prompts anew) and gets an empty learned table
  of its own.
Each row: one warm-up call of it and of its path's `off` (compiles), then `--rounds` rounds
that time a call of each in turn; speedup = the mean times' ratio, so load from elsewhere on the
machine (which moved separately timed rows by up to 0.3x on CPU) slows both alike. Counters are
summed over the timed calls: mean accepted length = tokens per target forward; identical =
every call's tokens equal plain greedy on the loop path; accepted at 1/2/..: the share of
verify steps with drafts that accepted draft j (per-position acceptance). The learned table
starts empty in every call (no credit for the warm-up having seen the prompts).

`--learning_curve=N`: N repetitions of the agent workload with one learned table kept across
them (drafter "learned" at the largest K, and "auto" with `--auto`): accepted length and speedup
per repetition, each one timed call (its table is what the earlier repetitions left) right
after one of its path's `off`.

Prints a table (and the issue's targets: agent accepted length >= 3 and speedup >= 2.5x, fresh
adaptive/auto never below 0.95x) and writes JSON (`--out`). On CPU the times describe the
reference path and depend on the machine's load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import jax
from absl import app, flags

import engine as moejax
from engine import NgramMemory, SpeculativeConfig

from bench.spec_workloads import agent_turns, fresh_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", os.path.join(ROOT, "checkpoints", "demo", "target"),
                    "Target checkpoint (default: the demo model).")
flags.DEFINE_string("draft_checkpoint", os.path.join(ROOT, "checkpoints", "demo", "draft"),
                    "Draft model for method 'draft' (and one of auto's drafters).")
flags.DEFINE_string("eagle3_checkpoint", os.path.join(ROOT, "checkpoints", "demo", "eagle3"),
                    "EAGLE-3 head for method eagle3 (and auto, when the directory exists).")
flags.DEFINE_list("methods", ["ngram", "mtp", "draft", "learned"], "Drafters to compare "
                  "(also eagle3).")
flags.DEFINE_list("num_draft", ["2", "4"], "K values (draft tokens per step), e.g. 2,4,8.")
flags.DEFINE_bool("adaptive", True, "Also run each method with adaptive draft length.")
flags.DEFINE_bool("auto", True, "Also run method 'auto' on the serving engine path.")
flags.DEFINE_integer("learning_curve", 0, "Repetitions of the agent workload with one learned "
                     "table kept across them (0: skip).", lower_bound=0)
flags.DEFINE_list("batch", ["4"], "Prompts per workload; a list (e.g. 1,16) runs each.")
flags.DEFINE_integer("agent_context", 0, "Tokens of a held-out document in front of each agent "
                     "turn (a long conversation: attention reads more cache per step, so "
                     "verifying drafts costs relatively less).")
flags.DEFINE_integer("max_new_tokens", 64, "Generated tokens per prompt.")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Parameter dtype (default: the "
                  "checkpoint's). In bfloat16 on CPU, a (k+1)-token verify forward can round "
                  "differently from 1-token decoding, so greedy outputs may differ slightly.")
flags.DEFINE_integer("rounds", 4, "Timed rounds per row, each a call of the row's path's "
                     "plain decoding and one of the row's, in turn (after a warm-up call of "
                     "each); speedup = mean time of the one over the other.", lower_bound=1)
flags.DEFINE_string("out", "", "Write the results as JSON here.")


# ---- one call, timed -------------------------------------------------------------------------

def engine_call(model, ids, max_new, spec: SpeculativeConfig | None) -> list[tuple[list, dict]]:
  """`engine.generate`: [(token ids, spec counters or None)] per prompt, the model's kept
  engines' prefix caches emptied first."""
  model.llm.reset_prefix_caches()
  out = moejax.generate(model, ids, max_new_tokens=max_new, ignore_eos=True, speculative=spec)
  if spec is not None:  # the engine's cost table, to say why a row drafted nothing
    table = model.llm.engines[-1].stats().get("spec_cost_table")
    for r in out:
      r.spec["cost_table"] = table
  return [(r.token_ids, r.spec) for r in out]


loop_call = engine_call  # (one generate path: the rows' two groups run the same call)


def timed(call: Callable[[], Any], repeats: int) -> tuple[Any, float]:
  """(result of the last call, best wall time of `repeats` calls)."""
  best, out = float("inf"), None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = call()
    best = min(best, time.perf_counter() - t0)
  return out, best


def side_by_side(base: Callable[[], Any], call: Callable[[Any], Any], rounds: int,
                 prepare: Callable[[], Any] = lambda: None) -> tuple[list, float, float]:
  """One warm-up call of each (compiles), then `rounds` rounds that time `base()` and
  `call(prepare())` in turn (`prepare` untimed: a fresh learned table is the benchmark's
  choice, not the call's work): (the results of `call`'s timed calls, mean seconds per call of
  base, of call). Load from elsewhere on the machine then slows both alike, and the mean counts
  every call a workload makes (a rest's probes as well as its plain calls)."""
  base()
  call(prepare())
  t_base = t_call = 0.0
  results = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    base()
    t_base += time.perf_counter() - t0
    args = prepare()
    t0 = time.perf_counter()
    results.append(call(args))
    t_call += time.perf_counter() - t0
  # Every (method, K, path) compiles its own programs; one process holding all of them ran a
  # shared 23 GB machine out of memory (LLVM "Cannot allocate memory", then a segfault).
  jax.clear_caches()
  return results, t_base / rounds, t_call / rounds


def row(workload: str, path: str, method: str, k: int, adaptive: bool, calls: list,
        seconds: float, plain_ids: list[list[int]], base_seconds: float, prompt_tokens: int
        ) -> dict:
  """A table row from the timed calls of one configuration (`seconds`: mean per call);
  counters summed over the calls; speedup is over `base_seconds` (the path's `off`, timed side
  by side); `accepted_at_rate[j]`: the share of verify steps with drafts whose draft j + 1 was
  accepted (drafts past the first rejection count as rejected)."""
  got = [r for call in calls for r in call]
  n_tokens = sum(len(t) for t, _ in got) / len(calls)
  specs = [s for _, s in got if s is not None]
  steps = sum(s["steps"] for s in specs)
  drafted = sum(s["drafted"] for s in specs)
  r = dict(workload=workload, path=path, method=method, k=k, adaptive=adaptive,
           mean_accepted_length=(sum(len(t) - 1 for t, _ in got) / steps if steps else 1.0),
           acceptance_rate=sum(s["accepted"] for s in specs) / drafted if drafted else 0.0,
           tok_s=n_tokens / seconds, seconds=seconds, speedup=base_seconds / seconds,
           identical=all([t for t, _ in call] == plain_ids for call in calls),
           prompt_tokens=prompt_tokens, calls=len(calls), batch=len(plain_ids),
           steps=steps, drafted=drafted, accepted=sum(s["accepted"] for s in specs))
  if specs and not drafted:
    r["cost_table"] = specs[0].get("cost_table")
  with_drafts = sum(s["drafts"] for s in specs)
  if specs and with_drafts:
    at = [sum(s["accepted_at"][j] for s in specs) for j in range(len(specs[0]["accepted_at"]))]
    r["accepted_at_rate"] = [a / with_drafts for a in at]
  if specs and "auto_choices" in specs[0]:  # row iterations per drafter, all requests
    r["auto_choices"] = {}
    for s in specs:
      for d, n in s["auto_choices"].items():
        r["auto_choices"][d] = r["auto_choices"].get(d, 0) + n
    r["drafters"] = specs[0]["drafters"]
  return r


# ---- the workloads ---------------------------------------------------------------------------

def head_dir(method: str) -> str | None:
  """The EAGLE-3 head a method runs with: --eagle3_checkpoint for eagle3 (which needs it) and
  for auto when the directory exists."""
  path = FLAGS.eagle3_checkpoint
  if method == "eagle3":
    if not path or not os.path.isdir(path):
      raise SystemExit(f"--methods=eagle3 needs --eagle3_checkpoint (not found: {path})")
    return path
  return path if method == "auto" and path and os.path.isdir(path) else None


def spec_factory(method: str, k: int, adaptive: bool, draft) -> Callable[[], SpeculativeConfig]:
  """A fresh config per call: the learned table (and auto's) starts empty every time."""
  head = head_dir(method)

  def make():
    with_draft = draft is not None and method in ("draft", "auto")
    return SpeculativeConfig(method, k, draft.config if with_draft else None,
                             draft.params if with_draft else None,
                             memory=NgramMemory() if method in ("learned", "auto") else None,
                             adaptive=adaptive or method == "auto", checkpoint=head)
  return make


def _progress(label: str, r: dict) -> None:
  print(f"  {label}: accepted length {r['mean_accepted_length']:.2f}, speedup "
        f"{r['speedup']:.2f}", file=sys.stderr)


def workload_rows(model, draft, name: str, ids: list[list[int]], max_new: int,
                  methods: list[str], ks: list[int], adaptive: bool, auto: bool,
                  rounds: int) -> list[dict]:
  prompt_tokens = sum(map(len, ids))
  loop_off = lambda: loop_call(model, ids, max_new, None)
  plain = loop_off()
  plain_ids = [t for t, _ in plain]
  rows = []
  for method in methods:
    for k in ks:
      for adapt in ((False, True) if adaptive else (False,)):
        make = spec_factory(method, k, adapt, draft)
        calls, t_off, t = side_by_side(
            loop_off, lambda spec: loop_call(model, ids, max_new, spec), rounds, make)
        rows.append(row(name, "loop", method, k, adapt, calls, t, plain_ids, t_off,
                        prompt_tokens))
        _progress(f"{name} loop {method} k={k}{' adaptive' if adapt else ''}", rows[-1])
  if auto:
    engine_off = lambda: engine_call(model, ids, max_new, None)
    for k in ks:
      make = spec_factory("auto", k, True, draft)
      calls, t_off, t = side_by_side(
          engine_off, lambda spec: engine_call(model, ids, max_new, spec), rounds, make)
      rows.append(row(name, "engine", "auto", k, True, calls, t, plain_ids, t_off,
                      prompt_tokens))
      _progress(f"{name} engine auto k={k}", rows[-1])
  # The paths' own plain speeds, side by side (each row above is against its own path's off).
  if auto:
    offs, t_loop, t_engine = side_by_side(loop_off, lambda _: engine_off(), rounds)
    rows.insert(0, row(name, "loop", "off", 0, False, [plain] * rounds, t_loop, plain_ids,
                       t_loop, prompt_tokens))
    rows.insert(1, row(name, "engine", "off", 0, False, offs, t_engine, plain_ids, t_engine,
                       prompt_tokens))
    rows[1]["speedup_vs_loop_off"] = t_loop / t_engine
  else:
    _, t_loop = timed(loop_off, rounds)
    rows.insert(0, row(name, "loop", "off", 0, False, [plain], t_loop, plain_ids, t_loop,
                       prompt_tokens))
  return rows


def learning_curve(model, draft, ids: list[list[int]], max_new: int, k: int, reps: int,
                   auto: bool) -> list[dict]:
  """`reps` timed repetitions of one workload with one `NgramMemory` kept across them: drafter
  "learned" on the loop path (and "auto" on the engine path), each timed right after a call of
  its path's `off`, which it is compared with."""
  loop_off = lambda: loop_call(model, ids, max_new, None)
  plain = loop_off()
  plain_ids = [t for t, _ in plain]
  paths = [("loop", "learned", loop_call, loop_off)]
  if auto:
    paths.append(("engine", "auto", engine_call,
                  lambda: engine_call(model, ids, max_new, None)))
  curve = []
  for path, method, call, off in paths:
    with_draft = method == "auto" and draft is not None

    def make(memory):
      return SpeculativeConfig(method, k, draft.config if with_draft else None,
                               draft.params if with_draft else None, memory=memory,
                               adaptive=method == "auto")
    # Compiles (twice: the table the first call returns is committed to the device, a fresh
    # one is not, and each compiles its own program); the warm-up table is thrown away.
    warm = NgramMemory()
    off()
    for _ in range(2):
      call(model, ids, max_new, make(warm))
    memory = NgramMemory()
    for rep in range(1, reps + 1):
      _, t_base = timed(off, 1)
      spec = make(memory)
      got, t = timed(lambda: call(model, ids, max_new, spec), 1)
      r = row("agent", path, method, k, method == "auto", [got], t, plain_ids, t_base,
              sum(map(len, ids)))
      r["repetition"] = rep
      curve.append(r)
      print(f"  learning curve {path} {method} repetition {rep}: accepted length "
            f"{r['mean_accepted_length']:.2f}, speedup {r['speedup']:.2f}", file=sys.stderr)
    jax.clear_caches()
  return curve


# ---- report ----------------------------------------------------------------------------------

def print_table(rows: list[dict], repetition: bool = False) -> None:
  first = f"{'rep':>3} " if repetition else ""
  header = (f"{first}{'workload':8} {'B':>2} {'path':6} {'method':8} {'K':>2} {'adapt':5} "
            f"{'acc.len':>7} {'acc.rate':>8} {'accepted at 1/2/..':18} {'tok/s':>8} "
            f"{'speedup':>7} {'calls':>5} identical")
  print(header)
  print("-" * len(header))
  for r in rows:
    lead = f"{r['repetition']:>3} " if repetition else ""
    at = "/".join(f"{a:.2f}" for a in r.get("accepted_at_rate", [])[:4]) or "-"
    print(f"{lead}{r['workload']:8} {r['batch']:>2} {r['path']:6} {r['method']:8} {r['k']:>2} "
          f"{'yes' if r['adaptive'] else 'no':5} {r['mean_accepted_length']:7.2f} "
          f"{r['acceptance_rate']:8.2f} {at:18} {r['tok_s']:8.1f} {r['speedup']:7.2f} "
          f"{r['calls']:>5} {r['identical']}")
  for r in rows:
    if r["method"] != "off" and not r["drafted"]:
      why = ", or its estimates and cost table kept it plain" if r["adaptive"] else ""
      print(f"  {r['workload']} B={r['batch']} {r['method']} K={r['k']}: drafted nothing: "
            f"the drafter proposed none{why} (cost table: {r.get('cost_table')})")


def targets(rows: list[dict]) -> dict:
  """The issue's targets, judged on the rows (each speedup against its own path's `off`)."""
  spec = [r for r in rows if r["method"] != "off"]
  agent = [r for r in spec if r["workload"] == "agent"]
  fresh_adaptive = [r for r in spec if r["workload"] == "fresh" and r["adaptive"]]
  best_len = max(agent, key=lambda r: r["mean_accepted_length"], default=None)
  best_speed = max(agent, key=lambda r: r["speedup"], default=None)
  worst = min(fresh_adaptive, key=lambda r: r["speedup"], default=None)

  def name(r):
    if r is None:
      return None
    adaptive = " adaptive" if r["adaptive"] and r["method"] != "auto" else ""
    return f"{r['path']} {r['method']} K={r['k']}{adaptive}"
  return dict(
      agent_best_accepted_length=best_len and best_len["mean_accepted_length"],
      agent_best_accepted_length_row=name(best_len),
      agent_best_speedup=best_speed and best_speed["speedup"],
      agent_best_speedup_row=name(best_speed),
      fresh_worst_adaptive_speedup=worst and worst["speedup"],
      fresh_worst_adaptive_row=name(worst),
      met_agent_accepted_length=bool(best_len and best_len["mean_accepted_length"] >= 3),
      met_agent_speedup=bool(best_speed and best_speed["speedup"] >= 2.5),
      met_fresh_adaptive=bool(worst is None or worst["speedup"] >= 0.95),
      all_identical=all(r["identical"] for r in rows))


def main(argv):
  del argv
  model = moejax.load(FLAGS.checkpoint, progress=False, dtype=FLAGS.dtype)
  wants_draft = "draft" in FLAGS.methods or FLAGS.auto
  draft = (moejax.load(FLAGS.draft_checkpoint, progress=False, dtype=FLAGS.dtype)
           if wants_draft and FLAGS.draft_checkpoint else None)
  ks = sorted({int(k) for k in FLAGS.num_draft})
  batches = [int(b) for b in FLAGS.batch]
  rows, curve, agent = [], [], None

  def write(**extra):  # after every stage: a crash late in a long run keeps what it measured
    if FLAGS.out:
      with open(FLAGS.out, "w") as fh:
        json.dump(dict(checkpoint=FLAGS.checkpoint, batch=batches, dtype=FLAGS.dtype,
                       max_new_tokens=FLAGS.max_new_tokens, num_draft=ks, rows=rows,
                       learning_curve=curve, **extra), fh, indent=1)

  for b in batches:
    fresh = fresh_prompts(model, b)
    agent = agent_turns(model, fresh, FLAGS.max_new_tokens, FLAGS.agent_context)
    for name, ids in (("fresh", [model.encode(p) for p in fresh]), ("agent", agent)):
      rows += workload_rows(model, draft, name, ids, FLAGS.max_new_tokens, FLAGS.methods, ks,
                            FLAGS.adaptive, FLAGS.auto, FLAGS.rounds)
      write()
  if FLAGS.learning_curve:
    curve = learning_curve(model, draft, agent, FLAGS.max_new_tokens, max(ks),
                           FLAGS.learning_curve, FLAGS.auto)

  print_table(rows)
  print("speedup: over plain engine.generate (both groups of rows run the same path)")
  for r in rows:
    if r["path"] == "engine" and r["method"] == "off":
      print(f"engine off vs loop off ({r['workload']}): {r['speedup_vs_loop_off']:.2f}x")
  if curve:
    print(f"\nlearning curve: agent workload, one learned table across {FLAGS.learning_curve} "
          "repetitions")
    print_table(curve, repetition=True)
  goals = targets(rows)
  print("\ntargets: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in goals.items()))
  write(targets=goals)
  return 0


if __name__ == "__main__":
  app.run(main)
