"""Sampling cost: the candidate prefilter (lax.top_k) against the full-vocabulary sort.

    python -m bench.sampling --out sampling.json

For each vocabulary size and row count (rows = batch x (K + 1) verified positions), times one
jitted `sample` call over model-like logits (standard normal x 4: a peaked distribution) with
temperature 0.8 / top_p 0.95, once through `over_kept_tokens`' candidate path and once forced
through the full sort, alternating, best of `--repeats`. Also checks that both choose the same
tokens. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime import sampling
from engine.runtime.sampling import SamplingArrays, SamplingParams


def _timed(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best


def measure(vocab: int, rows: int, repeats: int) -> dict:
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 4.0, jnp.float32)
  s = SamplingArrays.from_params([SamplingParams(temperature=0.8, top_p=0.95, seed=i)
                                  for i in range(rows)])
  pos = jnp.arange(rows, dtype=jnp.int32)
  # Separate wrappers: jax.jit of the same function object would share one trace cache.
  fast = jax.jit(lambda *a: sampling.sample(*a))
  full = jax.jit(lambda *a: sampling.sample(*a))
  with mock.patch.object(sampling, "PREFILTER_CANDIDATES", vocab):  # traced: full sort
    full_tokens = np.asarray(full(logits, s, pos))
  same = bool((np.asarray(fast(logits, s, pos)) == full_tokens).all())
  t_fast = t_full = float("inf")
  for _ in range(2):  # alternate so load changes hit both
    t_fast = min(t_fast, _timed(fast, logits, s, pos, repeats=repeats))
    with mock.patch.object(sampling, "PREFILTER_CANDIDATES", vocab):
      t_full = min(t_full, _timed(full, logits, s, pos, repeats=repeats))
  return dict(vocab=vocab, rows=rows, prefilter_ms=t_fast * 1e3, full_sort_ms=t_full * 1e3,
              speedup=t_full / t_fast, same_tokens=same)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", default="8192,163840")
  parser.add_argument("--rows", default="1,8,40")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  results = [measure(v, r, args.repeats) for v in map(int, args.vocab.split(","))
             for r in map(int, args.rows.split(","))]
  print(f"backend {jax.default_backend()}, candidates {sampling.PREFILTER_CANDIDATES}")
  print("| vocab | rows | prefilter ms | full sort ms | speedup | same tokens |")
  print("|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['vocab']} | {r['rows']} | {r['prefilter_ms']:.2f} | {r['full_sort_ms']:.2f} "
          f"| {r['speedup']:.2f}x | {r['same_tokens']} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(backend=jax.default_backend(), results=results), f, indent=1)


if __name__ == "__main__":
  main()
