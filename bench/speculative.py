"""Speculative decoding benchmark on the demo model: accepted length, tok/s, speedup, identity.

    python -m bench.speculative                                   # demo target + demo draft
    python -m bench.speculative --methods=ngram,mtp --num_draft=2,4 --out=spec.json

Two workloads of `--batch` prompts, greedy, `--max_new_tokens` each (EOS ignored):
* fresh: short code openings the model continues freely (little to copy);
* agent: agent-style repetition: a later turn that resends the conversation: the fresh prompt,
  the model's own greedy continuation of it, a blank line, and the same prompt again, so the
  answer repeats earlier context (as re-sent tool calls and code edits do).

For each method and K: one warm-up call (compiles), then the best of two timed calls; mean
accepted length
(tokens per target forward), acceptance rate, tok/s, speedup over `off`, and whether the output
is identical to plain greedy. The learned table starts empty in the timed call (no credit for
having seen the same prompts in the warm-up). Prints a table and writes JSON (`--out`). On CPU
the times describe the reference path and depend on the machine's load.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

import engine as moejax
from engine.runtime.generate import SpeculativeConfig, generate_tokens
from engine.runtime.speculative.learned import NgramMemory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", os.path.join(ROOT, "checkpoints", "demo", "target"),
                    "Target checkpoint (default: the demo model).")
flags.DEFINE_string("draft_checkpoint", os.path.join(ROOT, "checkpoints", "demo", "draft"),
                    "Draft model for method 'draft'.")
flags.DEFINE_list("methods", ["ngram", "mtp", "draft", "learned"], "Drafters to compare.")
flags.DEFINE_list("num_draft", ["2", "4"], "K values.")
flags.DEFINE_integer("batch", 4, "Prompts per workload.")
flags.DEFINE_integer("max_new_tokens", 64, "Generated tokens per prompt.")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Parameter dtype (default: the "
                  "checkpoint's). In bfloat16 on CPU, a (k+1)-token verify forward can round "
                  "differently from 1-token decoding, so greedy outputs may differ slightly.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")

FRESH = ["def read_config(path):\n", "class Point:\n    def __init__(self, x, y):\n",
         "import os\nimport sys\n\n\ndef main(argv):\n", "    for i, item in enumerate(items):\n",
         "def parse_args():\n    parser = argparse.ArgumentParser(", "    @property\n    def name"]


def _run(model, ids, spec, max_new, repeats=1):
  """(completions, best wall time of `repeats` calls); `spec` is a factory (fresh state)."""
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = generate_tokens(model.params, model.config, ids, max_new_tokens=max_new,
                          ignore_eos=True, speculative=spec())
    best = min(best, time.perf_counter() - t0)
  return out, best


def _agent_turns(model, prompts: list[str], max_new: int) -> list[list[int]]:
  first = [model.encode(p) for p in prompts]
  answers = generate_tokens(model.params, model.config, first, max_new_tokens=max_new,
                            ignore_eos=True)
  return [ids + a.token_ids + model.encode("\n\n" + p) for ids, a, p in
          zip(first, answers, prompts)]


def main(argv):
  del argv
  model = moejax.load(FLAGS.checkpoint, progress=False, dtype=FLAGS.dtype)
  draft = (moejax.load(FLAGS.draft_checkpoint, progress=False, dtype=FLAGS.dtype)
           if "draft" in FLAGS.methods else None)
  fresh = FRESH[:FLAGS.batch]
  workloads = {"fresh": [model.encode(p) for p in fresh],
               "agent": _agent_turns(model, fresh, FLAGS.max_new_tokens)}
  rows = []
  for name, ids in workloads.items():
    _run(model, ids, lambda: None, FLAGS.max_new_tokens)
    plain, t_plain = _run(model, ids, lambda: None, FLAGS.max_new_tokens, repeats=2)
    n_tokens = sum(len(c.token_ids) for c in plain)
    rows.append(dict(workload=name, method="off", k=0, mean_accepted_length=1.0,
                     acceptance_rate=0.0, tok_s=n_tokens / t_plain, speedup=1.0,
                     identical=True, prompt_tokens=sum(map(len, ids))))
    for method in FLAGS.methods:
      for k in map(int, FLAGS.num_draft):
        def spec():
          return SpeculativeConfig(method, k, draft.config if draft else None,
                                   draft.params if draft else None,
                                   memory=NgramMemory() if method == "learned" else None)
        _run(model, ids, spec, FLAGS.max_new_tokens)
        got, t = _run(model, ids, spec, FLAGS.max_new_tokens, repeats=2)
        steps = sum(c.spec["steps"] for c in got)
        drafted = sum(c.spec["drafted"] for c in got)
        rows.append(dict(
            workload=name, method=method, k=k,
            mean_accepted_length=sum(len(c.token_ids) - 1 for c in got) / max(steps, 1),
            acceptance_rate=sum(c.spec["accepted"] for c in got) / max(drafted, 1),
            tok_s=n_tokens / t, speedup=t_plain / t,
            identical=[c.token_ids for c in got] == [c.token_ids for c in plain],
            prompt_tokens=sum(map(len, ids))))
        print(f"  {name} {method} k={k} done", file=sys.stderr)

  header = (f"{'workload':8} {'method':8} {'K':>2} {'acc.len':>7} {'acc.rate':>8} "
            f"{'tok/s':>8} {'speedup':>7} identical")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['workload']:8} {r['method']:8} {r['k']:>2} {r['mean_accepted_length']:7.2f} "
          f"{r['acceptance_rate']:8.2f} {r['tok_s']:8.1f} {r['speedup']:7.2f} {r['identical']}")
  result = dict(checkpoint=FLAGS.checkpoint, batch=FLAGS.batch,
                max_new_tokens=FLAGS.max_new_tokens, rows=rows)
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(result, fh, indent=1)
  return 0


if __name__ == "__main__":
  app.run(main)
