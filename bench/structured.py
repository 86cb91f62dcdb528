"""Constrained (JSON schema) vs unconstrained decoding on the serving engine, side by side.

    PYTHONPATH=$PWD .venv/bin/python bench/structured.py --out structured.json

One warmed engine (demo model by default; the masked step compiled at warm-up), greedy rows,
a schema whose outputs run long (a list of records). Per batch size: tokens/s of every row
unconstrained, of every row constrained, and of a batch half of each (the unconstrained half's
and the constrained half's rates apart); per constrained run, the host time to compute the
masks per masked step and how much of it the engine thread waited for (the rest overlapped the
device loop of the other rows). Median of `--repeats` runs. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine  # noqa: E402
from engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from engine.runtime.grammar import StructuredOutputsParams  # noqa: E402
from engine.runtime.request import StopParams  # noqa: E402
from engine.runtime.sampling import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 24, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "size": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "size"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
PROMPTS = ["def load(path):\n    return json.loads(", "CONFIG = ", "data = ", "print("]


def _run(eng, n_constrained: int, n_free: int, max_tokens: int) -> dict:
  spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
  sampling = ([SamplingParams(structured_outputs=spec, drafter="off")] * n_constrained
              + [SamplingParams(drafter="off")] * n_free)
  prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_constrained + n_free)]
  before = dict(eng.stats())
  t0 = time.perf_counter()
  done = eng.generate(prompts, sampling, StopParams(max_tokens=max_tokens, ignore_eos=True),
                      closed=True)
  wall = time.perf_counter() - t0
  after = eng.stats()
  tokens_c = sum(len(r.output_ids) for r in done[:n_constrained])
  tokens_f = sum(len(r.output_ids) for r in done[n_constrained:])
  # A row's rate: its tokens over the time until it finished (rows finish at different times).
  def rate(rows):
    return sum(len(r.output_ids) for r in rows) / max(
        max(r.timings.finished for r in rows) - min(r.timings.arrival for r in rows), 1e-9)
  steps = after["structured_steps"] - before["structured_steps"]
  return dict(wall_s=wall, tokens_constrained=tokens_c, tokens_free=tokens_f,
              tok_s=(tokens_c + tokens_f) / wall,
              tok_s_constrained=rate(done[:n_constrained]) if n_constrained else None,
              tok_s_free=rate(done[n_constrained:]) if n_free else None,
              masked_steps=steps, engine_steps=after["steps"] - before["steps"],
              mask_ms_per_step=(1e3 * (after["structured_mask_seconds"]
                                       - before["structured_mask_seconds"]) / steps
                                if steps else None),
              mask_wait_ms_per_step=(1e3 * (after["structured_mask_wait_seconds"]
                                            - before["structured_mask_wait_seconds"]) / steps
                                     if steps else None),
              finish=sorted({r.finish_reason for r in done}))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
  ap.add_argument("--batch", default="1,16")
  ap.add_argument("--max_tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  model = engine.load(args.model, progress=False)
  sizes = [int(b) for b in args.batch.split(",")]
  eng = Engine.from_model(model, EngineConfig(
      max_num_seqs=max(sizes), max_num_batched_tokens=64, max_model_len=512,
      max_decode_steps=16, constrained_warmup=True))
  t0 = time.perf_counter()
  eng.warmup(progress=False)
  warm = time.perf_counter() - t0
  rows = []
  for b in sizes:
    cases = [("unconstrained", 0, b, None), ("json schema", b, 0, None)]
    if b > 1:  # (the loop cap while constrained rows run: EngineConfig.constrained_decode_steps)
      cases += [(f"mixed half/half, loop cap {cap}", b // 2, b - b // 2, cap)
                for cap in (eng.config.constrained_decode_steps, eng.config.max_decode_steps)]
      cases.append(("unconstrained half alone", 0, b - b // 2, None))
    default = eng.config
    runs = {name: [] for name, *_ in cases}
    for rep in range(args.repeats + 1):  # cases interleaved (the machine's load drifts)
      for name, nc, nf, cap in cases:
        eng.config = default if cap is None else dataclasses.replace(
            default, constrained_decode_steps=cap)
        res = _run(eng, nc, nf, args.max_tokens)
        if rep:  # (the first round: first runs of every branch)
          runs[name].append(res)
    eng.config = default
    for name, *_ in cases:
      rs = runs[name]
      rows.append(dict(batch=b, case=name, **{
          k: (statistics.median([r[k] for r in rs]) if isinstance(rs[0][k], float) else rs[0][k])
          for k in rs[0]}))
  cols = ["batch", "case", "tok_s", "tok_s_free", "tok_s_constrained", "engine_steps",
          "masked_steps",
          "mask_ms_per_step", "mask_wait_ms_per_step", "finish"]
  print(f"warm-up {warm:.1f} s; max_tokens {args.max_tokens}, ignore_eos, greedy")
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  for r in rows:
    print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                            for c in cols) + " |")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(warmup_s=warm, max_tokens=args.max_tokens, rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
