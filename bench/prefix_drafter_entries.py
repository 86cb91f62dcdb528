"""What a prefix hit on pages lacking the EAGLE-3 head's cache entries costs in acceptance.

    python -m bench.prefix_drafter_entries --answer_tokens=64,192 --out=prefix.json

A drafter-off turn decodes its answer in the plain loop, which writes no head KV; the next
turn (the prompt, the answer, the prompt again: `spec_workloads.agent_turn`) drafts with the
head and hits those pages in the prefix cache, so the head attends to what they hold (zeros on
a fresh pool; with `--fill`, other requests' head entries on pages handed out again). The same
turn on an engine without a prefix cache is the reference: exact head entries, no hit. Demo
target and head, float32, greedy, K = `--num_draft`, the roofline cost table: acceptance only,
the same on any machine. Both turns' outputs must be identical (lossless either way).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
from absl import app, flags

import engine as moejax
from engine.model.eagle3_loader import load_eagle3
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams

from bench import spec_workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_list("answer_tokens", ["64", "192"], "Tokens of the drafter-off turn's answer.")
flags.DEFINE_integer("num_prompts", 8, "Conversations (fresh prompts).")
flags.DEFINE_integer("new_tokens", 64, "Tokens of the eagle3 turn.")
flags.DEFINE_integer("num_draft", 3, "K.")
flags.DEFINE_bool("fill", False, "Before each conversation, other eagle3 requests fill a small "
                  "pool, so the off turn decodes over pages holding their head entries.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")


def conversation_rows(model, head, answer_tokens: int) -> list[dict]:
  cfg, params, _ = model
  config = dict(speculative="eagle3", num_draft_tokens=FLAGS.num_draft, page_size=16,
                measure_spec_costs=False, cache_dtype=jnp.float32, max_num_seqs=8,
                compilation_cache_dir=None)
  shared = Engine(cfg, params, EngineConfig(**config, num_pages=40 if FLAGS.fill else None),
                  head=head)
  reference = Engine(cfg, params, EngineConfig(**config, enable_prefix_cache=False), head=head)
  prompts = spec_workloads.fresh_prompts(model, 2 * FLAGS.num_prompts)
  fillers, prompts = prompts[FLAGS.num_prompts:], prompts[:FLAGS.num_prompts]
  greedy, stop = SamplingParams(), StopParams(max_tokens=FLAGS.new_tokens, ignore_eos=True)
  rows = []
  for i, p in enumerate(prompts):
    if FLAGS.fill:
      shared.generate([model.encode(f) for f in fillers[4 * (i % 2):4 * (i % 2) + 4]], greedy,
                      StopParams(max_tokens=120, ignore_eos=True))
    (off,) = shared.generate([model.encode(p)], SamplingParams(drafter="off"),
                             StopParams(max_tokens=answer_tokens, ignore_eos=True))
    ids = spec_workloads.agent_turn(model, p, model.encode(p), off.output_ids)
    lacking = shared.stats()["prefix_cache_hits_lacking_drafter_entries"]
    (hit,) = shared.generate([ids], greedy, stop)
    (ref,) = reference.generate([ids], greedy, stop)
    if hit.output_ids != ref.output_ids:
      raise SystemExit(f"prompt {i}: the turn's output differs with the prefix hit")
    lacking = (shared.stats()["prefix_cache_hits_lacking_drafter_entries"] - lacking) * 16
    rows.append(dict(prompt_tokens=len(ids), cached=hit.usage().cached_tokens, lacking=lacking,
                     hit=[hit.usage().spec_drafts, hit.usage().spec_accepted_tokens],
                     reference=[ref.usage().spec_drafts, ref.usage().spec_accepted_tokens]))
  return rows


def main(argv):
  del argv
  model = moejax.load(dtype="float32")
  head = load_eagle3(os.path.join(ROOT, "checkpoints", "demo", "eagle3"), model.config,
                     model.params, jnp.float32)
  result = []
  print("| answer tokens | prompt tokens | cached | of which lacking | accepted length: hit | "
        "reference |")
  print("|---|---|---|---|---|---|")
  for n in map(int, FLAGS.answer_tokens):
    rows = conversation_rows(model, head, n)
    total = lambda k: sum(r[k] for r in rows)
    length = lambda k: 1 + sum(r[k][1] for r in rows) / max(sum(r[k][0] for r in rows), 1)
    summary = dict(answer_tokens=n, fill=FLAGS.fill, prompt_tokens=total("prompt_tokens"),
                   cached=total("cached"), lacking=total("lacking"), hit=length("hit"),
                   reference=length("reference"), rows=rows)
    result.append(summary)
    print(f"| {n} | {summary['prompt_tokens']} | {summary['cached']} | {summary['lacking']} | "
          f"{summary['hit']:.3f} | {summary['reference']:.3f} |", flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
