"""Speculative decoding in the serving engine (in process): each drafter and "auto" per request.

    python -m bench.spec_serving                          # demo target + demo draft model
    python -m bench.spec_serving --batch=4 --max_new_tokens=64 --adaptive_k --out=r.json

One `Engine` with every drafter enabled (ngram, learned, mtp, draft; `--num_draft_tokens` K)
serves the same batches with each request's drafter set by `SamplingParams(drafter=...)`:
"off", each drafter, and "auto" (the loop picks per row and iteration from the request's own
acceptance). Workloads of `--batch` prompts, greedy, `--max_new_tokens` each (EOS ignored):
* novel: 48 tokens of code from modules the demo model never trained on, new ones every pass
  (first-encounter traffic: nothing learned applies);
* fresh: short code openings (little to copy; the same every pass, so the table learns them);
* agent: a later turn that resends the conversation (prompt, the model's answer, the prompt
  again), so the answer repeats earlier context;
* mixed: half fresh, half agent in one batch (rows that should draft differently).
For each: output tok/s (median over `--repeats` rounds after a warm-up pass; every round runs
each mode once, in a shuffled order, so that load from elsewhere on the machine slows all modes
alike), tokens per target forward of drafting rows, speedup over "off" on the same engine (the
ratio of medians, and the range of the per-round ratios), the goodput model's calibration (tokens it
expected over tokens emitted in iterations that drafted: above 1, its acceptance estimates run
ahead of what is accepted), the share of decode calls that ran the speculative loop, and
whether every output equals "off"'s. The learned table keeps
what earlier passes taught it (it learns across requests). Prints a table and writes JSON
(`--out`). On CPU the times describe the reference path.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import sys
import time
from typing import Callable

from absl import app, flags

import engine as moejax
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams

from bench.spec_workloads import FRESH, agent_turn, novel_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", os.path.join(ROOT, "checkpoints", "demo", "target"),
                    "Target checkpoint (default: the demo model).")
flags.DEFINE_string("draft_checkpoint", os.path.join(ROOT, "checkpoints", "demo", "draft"),
                    "Draft model (drafter 'draft'); empty: no draft model.")
flags.DEFINE_list("modes", ["off", "ngram", "learned", "mtp", "draft", "auto"],
                  "Per-request drafters to compare ('off': the baseline).")
flags.DEFINE_integer("batch", 4, "Prompts per workload.")
flags.DEFINE_list("workloads", ["novel", "fresh", "agent", "mixed"], "Workloads to run.")
flags.DEFINE_integer("max_new_tokens", 64, "Generated tokens per prompt.")
flags.DEFINE_integer("num_draft_tokens", 4, "K: the most drafts per iteration.")
flags.DEFINE_bool("adaptive_k", True, "Choose the block width and per-row drafts every "
                  "iteration from the goodput model (costs measured at warm-up).")
flags.DEFINE_integer("repeats", 3, "Timed rounds (each runs every mode once; medians kept).")
flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"], "Parameter dtype (float32: "
                  "greedy outputs comparable token for token on CPU).")
flags.DEFINE_string("out", "", "Write the results as JSON here.")


def _workloads(eng: Engine, model, n: int, max_new: int) -> dict[str, Callable[[int], list]]:
  """name -> the prompts of pass i (the same every pass but for "novel")."""
  fresh = [model.encode(p) for p in (FRESH * 4)[:n]]
  agent = []
  if {"agent", "mixed"} & set(FLAGS.workloads):  # (the answers teach the engine's table)
    answers = eng.generate(fresh, SamplingParams(drafter="off"),
                           StopParams(max_tokens=max_new, ignore_eos=True))
    agent = [agent_turn(model, p, ids, r.output_ids)
             for ids, r, p in zip(fresh, answers, (FRESH * 4)[:n])]
  half = n // 2
  loads = {"novel": lambda i: novel_prompts(model, n, i), "fresh": lambda i: fresh,
           "agent": lambda i: agent, "mixed": lambda i: fresh[:half] + agent[half:n]}
  return {name: loads[name] for name in FLAGS.workloads}


def _pass(eng: Engine, ids, drafter: str, max_new: int):
  stats0 = eng.stats()
  t0 = time.perf_counter()
  got = eng.generate(ids, SamplingParams(drafter=drafter),
                     StopParams(max_tokens=max_new, ignore_eos=True))
  dt = time.perf_counter() - t0
  stats1 = eng.stats()
  delta = {k: stats1[k] - stats0.get(k, 0) for k in stats1
           if k.startswith("spec_") and isinstance(stats1[k], (int, float))}
  return dt, [r.output_ids for r in got], delta


def main(argv):
  del argv
  model = moejax.load(FLAGS.checkpoint, progress=False, dtype=FLAGS.dtype)
  drafters = ["ngram", "learned"]
  if model.config.num_nextn_predict_layers > 0:
    drafters.append("mtp")
  draft = None
  if FLAGS.draft_checkpoint:
    draft = moejax.load(FLAGS.draft_checkpoint, progress=False, dtype=FLAGS.dtype)
    drafters.append("draft")
  modes = [m for m in FLAGS.modes if m in ("off", "auto") or m in drafters]
  max_len = 4 * FLAGS.max_new_tokens + 256
  # Pages for every row at full length (the CPU default) on any device: left to itself, the
  # engine would give a GPU's free memory to the demo model's cache (millions of pages).
  config = EngineConfig(max_num_seqs=max(FLAGS.batch, 1), max_num_batched_tokens=512,
                        num_pages=max(FLAGS.batch, 1) * -(-max_len // 16) + 1,
                        max_model_len=max_len, max_decode_steps=16, drafters=tuple(drafters),
                        num_draft_tokens=FLAGS.num_draft_tokens, adaptive_k=FLAGS.adaptive_k)
  eng = Engine.from_model(model, config, draft_model=draft)
  t0 = time.perf_counter()
  eng.warmup()
  warmup_s = time.perf_counter() - t0
  costs = {k: v for k, v in eng.stats().items() if k.startswith("spec_cost")}  # the table
  print(f"warm-up {warmup_s:.0f}s; costs: {costs}", file=sys.stderr)

  def write(rows, complete):
    # After every workload, so that a run cut short by a time limit keeps what it measured.
    if FLAGS.out:
      with open(FLAGS.out, "w") as fh:
        json.dump(dict(checkpoint=FLAGS.checkpoint, batch=FLAGS.batch, drafters=drafters,
                       num_draft_tokens=FLAGS.num_draft_tokens, adaptive_k=FLAGS.adaptive_k,
                       warmup_s=warmup_s, complete=complete, **costs, rows=rows), fh, indent=1)

  loads = _workloads(eng, model, FLAGS.batch, FLAGS.max_new_tokens)
  rng = random.Random(0)
  rows = []
  for name, prompts in loads.items():
    passes = {m: [] for m in modes}  # (seconds, outputs, stats delta) per timed round
    n_pass = itertools.count()
    for mode in modes:  # warm (first execution of each branch)
      _pass(eng, prompts(next(n_pass)), mode, FLAGS.max_new_tokens)
    for _ in range(FLAGS.repeats):
      for mode in rng.sample(modes, len(modes)):
        passes[mode].append(_pass(eng, prompts(next(n_pass)), mode, FLAGS.max_new_tokens))
    # (novel prompts differ every pass: no output to compare)
    ref = passes["off"][0][1] if "off" in passes and name != "novel" else None
    base = [dt for dt, _, _ in passes["off"]] if "off" in passes else None
    for mode in modes:
      times = [dt for dt, _, _ in passes[mode]]
      spec = {}
      for _, _, delta in passes[mode]:  # (summed over the rounds)
        for k, v in delta.items():
          spec[k] = spec.get(k, 0) + v
      n_tokens = sum(map(len, passes[mode][0][1]))
      ratios = [b / t for b, t in zip(base, times)] if base else None
      steps = spec.get("spec_steps", 0)
      rows.append(dict(
          workload=name, mode=mode, tok_s=n_tokens / statistics.median(times),
          speedup=statistics.median(base) / statistics.median(times) if base else None,
          speedup_range=(min(ratios), max(ratios)) if ratios else None,
          tokens_per_forward=(1 + spec.get("spec_accepted", 0) / steps) if steps else 1.0,
          identical=all(out == ref for _, out, _ in passes[mode]) if ref is not None else None,
          k_loops={k: v for k, v in spec.items() if k.startswith("spec_k")},
          auto_choice={k[len("spec_auto_choice_"):]: v for k, v in spec.items()
                       if k.startswith("spec_auto_choice_") and v},
          speculative_calls=spec.get("spec_loop_calls", 0),
          plain_calls=spec.get("spec_plain_calls", 0),
          # the goodput model's tokens expected / emitted in iterations that drafted
          expected_over_emitted=(spec["spec_model_expected_tokens"]
                                 / spec["spec_model_emitted_tokens"])
          if spec.get("spec_model_emitted_tokens") else None))
    print(f"  {name} done", file=sys.stderr)
    write(rows, complete=False)

  header = (f"{'workload':8} {'mode':8} {'tok/s':>8} {'speedup':>7} {'(rounds)':>11} "
            f"{'tok/fwd':>7} {'exp/emit':>8} {'spec/all':>9} identical  "
            "auto chose (row iterations)")
  print(header)
  print("-" * len(header))
  for r in rows:
    sp = f"{r['speedup']:7.2f}" if r["speedup"] is not None else f"{'-':>7}"
    lo_hi = r["speedup_range"]
    sp += f" {lo_hi[0]:5.2f}-{lo_hi[1]:4.2f}" if lo_hi else f" {'-':>10}"
    cal = r["expected_over_emitted"]
    cal = f"{cal:8.2f}" if cal is not None else f"{'-':>8}"
    calls = r["speculative_calls"] + r["plain_calls"]
    cost = f"{r['speculative_calls']:>4}/{calls:<4}" if calls else f"{'-':>9}"
    print(f"{r['workload']:8} {r['mode']:8} {r['tok_s']:8.1f} {sp} "
          f"{r['tokens_per_forward']:7.2f} {cal} {cost} {str(r['identical']):9}  "
          f"{r['auto_choice'] or ''}")
  write(rows, complete=True)
  return 0


if __name__ == "__main__":
  app.run(main)
