"""Serving-engine benchmark (in process): throughput vs concurrency, prefix-cache TTFT, compiles.

    python -m bench.engine_throughput                       # the bundled demo model
    python -m bench.engine_throughput --checkpoint=DIR --concurrency=1,4,16,64 --out=r.json

1. Aggregate output tokens/s at each concurrency on a fixed-length workload (random prompts of
   `--prompt_len` tokens, exactly `--output_len` generated, EOS ignored), all requests queued
   at once, after warm-up.
2. TTFT of a follow-up turn that resends a `--prefix_len`-token conversation plus a short new
   message: cold (prefix cache reset) vs cached. Target: cached <= 15% of cold.
3. XLA compilations after warm-up, across everything above (serving must trigger none).

Prints a table and writes JSON (`--out`). On CPU the numbers describe the reference path.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from absl import app, flags

import engine as moejax
from engine.runtime.buckets import CompileCounter
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.service import mesh_flags

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "checkpoints", "demo", "target")
FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", DEMO, "Checkpoint directory (default: the demo model).")
flags.DEFINE_list("concurrency", ["1", "4", "16", "64"], "Concurrent requests per run.")
flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per request (throughput runs).")
flags.DEFINE_integer("output_len", 64, "Generated tokens per request (throughput runs).")
flags.DEFINE_integer("prefix_len", 2000, "Shared conversation length for the TTFT test.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Engine token budget per step.")
flags.DEFINE_integer("page_size", 16, "Tokens per cache page.")
flags.DEFINE_integer("max_decode_steps", 16, "Longest on-device decode loop.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
  return [rng.randrange(3, vocab) for _ in range(n)]


def main(argv):
  del argv
  model = moejax.load(FLAGS.checkpoint, mesh=mesh_flags.setup(),
                      kernels=mesh_flags.kernel_choice())
  conc = sorted(int(c) for c in FLAGS.concurrency)
  max_len = max(FLAGS.prompt_len + FLAGS.output_len, FLAGS.prefix_len + 64)
  config = EngineConfig(page_size=FLAGS.page_size, max_num_seqs=max(conc),
                        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                        max_model_len=max_len, max_decode_steps=FLAGS.max_decode_steps)
  eng = Engine.from_model(model, config)
  t0 = time.perf_counter()
  n_programs = eng.warmup(lambda i, n, what: print(f"\rcompiling {i}/{n} {what}   ", end="",
                                                   file=sys.stderr, flush=True))
  print(file=sys.stderr)
  warmup_s = time.perf_counter() - t0
  rng = random.Random(0)
  vocab = model.config.vocab_size
  stop = StopParams(max_tokens=FLAGS.output_len, ignore_eos=True)
  rows = []
  with CompileCounter() as compiles:
    for c in conc:
      eng.pool.reset_prefix_cache()  # random prompts would not hit anyway; keep runs equal
      ids = [eng.add_request(_prompt(rng, FLAGS.prompt_len, vocab), SamplingParams(), stop)
             for _ in range(c)]
      t = time.perf_counter()
      for _ in eng.run():
        pass
      dt = time.perf_counter() - t
      reqs = [eng.requests[i] for i in ids]
      out_tokens = sum(len(r.output_ids) for r in reqs)
      ttft = sorted(r.timings.ttft_s for r in reqs)
      rows.append(dict(concurrency=c, seconds=dt, output_tokens=out_tokens,
                       output_tok_s=out_tokens / dt, per_request_tok_s=out_tokens / dt / c,
                       ttft_median_s=ttft[len(ttft) // 2]))
      for i in ids:
        eng.release(i)

    # Turn 1, then its follow-up (turn 1 + its answer + a new message): cold, then cached
    # from turn 1's pages.
    conversation = _prompt(rng, FLAGS.prefix_len, vocab)
    turn1 = StopParams(max_tokens=8, ignore_eos=True)
    first = eng.generate([conversation], SamplingParams(), turn1)[0]
    follow_up = first.all_ids + _prompt(rng, 16, vocab)
    ttft = {}
    for label in ("cold", "cached"):
      eng.pool.reset_prefix_cache()
      if label == "cached":
        eng.generate([conversation], SamplingParams(), turn1)
      r = eng.generate([follow_up], SamplingParams(), StopParams(max_tokens=1))[0]
      ttft[label] = dict(ttft_s=r.timings.ttft_s, cached_tokens=r.usage().cached_tokens)

  result = dict(checkpoint=FLAGS.checkpoint, device=str(eng.cache[0][next(iter(eng.cache[0]))]
                                                         .devices()),
                kernels=str(eng.config.kernels), programs_compiled=n_programs,
                warmup_s=warmup_s, throughput=rows, follow_up_ttft=ttft,
                cached_over_cold=ttft["cached"]["ttft_s"] / ttft["cold"]["ttft_s"],
                compiles_after_warmup=compiles.count)
  print(f"\n{'concurrency':>11} {'output tok/s':>13} {'tok/s/request':>14} {'median TTFT s':>14}")
  for r in rows:
    print(f"{r['concurrency']:>11} {r['output_tok_s']:>13.1f} {r['per_request_tok_s']:>14.1f} "
          f"{r['ttft_median_s']:>14.3f}")
  print(f"\nfollow-up turn ({len(follow_up)} tokens): TTFT cold {ttft['cold']['ttft_s']:.3f} s, "
        f"cached {ttft['cached']['ttft_s']:.3f} s ({ttft['cached']['cached_tokens']} tokens "
        f"cached) -> {100 * result['cached_over_cold']:.1f}% of cold (target <= 15%)")
  print(f"programs compiled at warm-up: {n_programs} ({warmup_s:.1f} s); "
        f"compilations after warm-up: {compiles.count}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
