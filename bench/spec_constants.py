"""What the speculative module constants do to acceptance on the demo model, value by value.

    python -m bench.spec_constants --out=constants.json

Acceptance does not depend on the machine: the engine is built with the roofline cost table
(`measure_costs=False`, no timing in any decision) in float32, greedy, so every figure here is a
function of the model, the prompts and the constant alone, the same on a CPU or a GPU. For each
value of each constant (set on its module, with every compiled program and kept engine dropped
first, since the constants are read when a program is traced):
* `ngram.NGRAM_MAX` (the longest suffix prompt lookup matches): drafter "ngram", K fixed;
* `learned.ORDERS` (the learned table's context lengths): drafter "learned", K fixed, one table
  kept across two passes of each workload (the first learns as it goes; the second finds what
  the first taught it);
* `learned.update`'s `decay` (how fast a context's candidate counts fade): as `learned.ORDERS`;
* `goodput.ROW_PRIOR_WEIGHT` (a row's prior from its drafter's engine-wide estimate): "auto"
  (adaptive: each row's drafter and draft length from its estimates).
Workloads (`bench.speculative`'s, `--batch` prompts, `--max_new_tokens` each): fresh, agent,
and mixed (half of each in one batch). Figure: tokens per target forward over the decode
(1 + accepted drafts per verify step); every output is checked against plain greedy decoding.
"""

from __future__ import annotations

import json
import os
import sys

import jax
from absl import app, flags

import engine as moejax
from engine import NgramMemory, SpeculativeConfig
from engine.runtime.speculative import goodput
from engine.runtime.speculative.drafters import learned, ngram

from bench.spec_workloads import FRESH, agent_turns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", os.path.join(ROOT, "checkpoints", "demo", "target"),
                    "Target checkpoint.")
flags.DEFINE_integer("batch", 4, "Prompts per workload.")
flags.DEFINE_integer("max_new_tokens", 64, "Generated tokens per prompt.")
flags.DEFINE_integer("num_draft", 4, "K.")
flags.DEFINE_list("constants", ["ngram", "orders", "row_prior"], "Which constants to vary.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")

# (module, attribute, values); the first value is the shipped one.
SWEEPS = {
    "ngram": (ngram, ("NGRAM_MAX",), [(8,), (3,), (5,), (12,)]),
    "orders": (learned, ("ORDERS",), [((3, 2),), ((4, 2),), ((5, 3),), ((4,),), ((6, 3),)]),
    "row_prior": (goodput, ("ROW_PRIOR_WEIGHT",), [(2.0,), (0.5,), (1.0,), (4.0,)]),
    # (a default argument: the function's __defaults__ is the attribute set)
    "learned_decay": (learned.update, ("__defaults__",),
                      [((0.95,),), ((0.5,),), ((0.8,),), ((0.99,),), ((1.0,),)]),
}
METHOD = {"ngram": "ngram", "orders": "learned", "row_prior": "auto", "learned_decay": "learned"}


def tokens_per_forward(model, ids, spec: SpeculativeConfig, plain: list[list[int]]
                       ) -> tuple[float, bool]:
  """(tokens per target forward over the decode, whether every output equals `plain`)."""
  model.llm.reset_prefix_caches()
  out = moejax.generate(model, ids, max_new_tokens=FLAGS.max_new_tokens, ignore_eos=True,
                        speculative=spec)
  steps = sum(c.spec["steps"] for c in out)
  return (sum(len(c.token_ids) - 1 for c in out) / steps,
          [c.token_ids for c in out] == plain)


def sweep(model, name: str, workloads: dict, plain: dict) -> list[dict]:
  module, attrs, values = SWEEPS[name]
  shipped = tuple(getattr(module, a) for a in attrs)
  two_passes = METHOD[name] == "learned"  # the second finds what the first taught the table
  rows = []
  try:
    for value in values:
      for a, v in zip(attrs, value):
        setattr(module, a, v)
      model.llm.release()
      jax.clear_caches()  # programs traced with the previous value
      for workload, ids in workloads.items():
        memory = NgramMemory() if two_passes else None
        for pass_ in range(1, 3 if two_passes else 2):
          spec = SpeculativeConfig(METHOD[name], FLAGS.num_draft, memory=memory,
                                   adaptive=name == "row_prior", measure_costs=False)
          tpf, same = tokens_per_forward(model, ids, spec, plain[workload])
          rows.append(dict(constant=name, value=dict(zip(attrs, value)),
                           shipped=value == shipped, method=METHOD[name], workload=workload,
                           pass_=pass_, tokens_per_forward=tpf, identical=same))
          print(f"  {name} {value} {workload} pass {pass_}: {tpf:.3f} tokens per forward"
                f"{'' if same else ' (output differs from greedy)'}", file=sys.stderr,
                flush=True)
  finally:
    for a, v in zip(attrs, shipped):
      setattr(module, a, v)
  return rows


def main(argv):
  del argv
  model = moejax.load(FLAGS.checkpoint, progress=False, dtype="float32")
  fresh = FRESH[:FLAGS.batch]
  fresh_ids = [model.encode(p) for p in fresh]
  agent_ids = agent_turns(model, fresh, FLAGS.max_new_tokens)
  half = FLAGS.batch // 2
  workloads = {"fresh": fresh_ids, "agent": agent_ids,
               "mixed": fresh_ids[:half] + agent_ids[half:]}
  plain = {w: [c.token_ids for c in moejax.generate(
      model, ids, max_new_tokens=FLAGS.max_new_tokens, ignore_eos=True)]
      for w, ids in workloads.items()}
  rows = []
  for name in FLAGS.constants:
    rows += sweep(model, name, workloads, plain)
    if FLAGS.out:
      with open(FLAGS.out, "w") as fh:
        json.dump(dict(batch=FLAGS.batch, max_new_tokens=FLAGS.max_new_tokens,
                       num_draft=FLAGS.num_draft, rows=rows), fh, indent=1)
  print(f"{'constant':10} {'value':24} {'workload':8} {'pass':>4} {'tok/fwd':>7}  identical")
  for r in rows:
    value = ", ".join(f"{k}={v}" for k, v in r["value"].items())
    print(f"{r['constant']:10} {value + (' *' if r['shipped'] else ''):24} {r['workload']:8} "
          f"{r['pass_']:>4} {r['tokens_per_forward']:7.3f}  {r['identical']}")
  print("* the shipped value")
  return 0


if __name__ == "__main__":
  app.run(main)
