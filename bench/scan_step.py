"""The scanned layer stack against the layers as separate arrays: decode-step time in one
process, interleaved.

    python -m bench.scan_step --batch=1,32 --pairs=16 --out=scan_step.json        # CPU ok
    python -m bench.scan_step --model=dsv2_lite --layers=8 --kernels=auto         # a GPU

Per batch size B (one new token per row, `--context` cached tokens, a page table of
`--context + --steps` tokens), three programs, each a jitted `fori_loop` of `--steps` decode
steps (forward, greedy logits; the cache donated):
* `separate`: every layer called on its own arrays (sliced out of the stacks before the
  program, as b40a247's per-layer parameters were), no scan: no layer's weights are sliced out
  of a stack inside the program;
* `scan`: the forward as served (`lax.scan` over each stack, `SCAN_UNROLL`);
* `scan_u2`: the same with two layers per iteration.
Runs alternate program by program (A B C, C B A, ...) and each timed call's process CPU (host
CPUs) or wall time (a GPU) is compared with the `separate` call of its round: ratios, median
and range. The greedy tokens of the three must agree. On XLA:CPU the scan's body copies layer
j's slice of every weight an XLA dot reads (BENCHMARKS, issue 49): this measures what that
costs, and reads from the compiled `scan` program the bytes each layer iteration copies out of
slices (`slice_copies`; on a GPU, none means the gemms read the stacked weights in place).
Prints a table, writes JSON.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from engine.model import kernels, transformer
from engine.model.cache import contiguous_page_table, init_cache, layer_table
from engine.model.params import layer_params
from engine.model.transformer import compute_logits, forward, rms_norm

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when run as a script only (absl refuses a flag defined
  twice in one process, and other command lines share these names)."""
  flags.DEFINE_enum("model", "demo", ["demo", "tiny", "dsv2_lite"], "Which model "
                    "(`bench.decode_profile`'s).")
  flags.DEFINE_integer("layers", 0, "tiny / dsv2_lite with this many layers (0: as published).")
  flags.DEFINE_list("batch", ["1", "32"], "Batch sizes.")
  flags.DEFINE_integer("context", 64, "Cached tokens per row.")
  flags.DEFINE_integer("page_size", 16, "Tokens per page (the Mosaic MLA kernels read 64).")
  flags.DEFINE_integer("steps", 32, "Decode steps per timed call.")
  flags.DEFINE_integer("pairs", 12, "Timed rounds (each runs every program once).")
  flags.DEFINE_string("kernels", "reference", "Kernel choice (`bench.decode_profile`'s).")
  flags.DEFINE_string("dtype", None, "Parameter dtype of the demo model (default: float32).")
  flags.DEFINE_string("out", "", "Write JSON here.")


PROGRAMS = ("separate", "scan", "scan_u2")


def _model():
  if FLAGS.model == "demo":
    import engine
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    m = engine.load(os.path.join(root, "checkpoints", "demo", "target"),
                    dtype=FLAGS.dtype or "float32", progress=False)
    return m.config, m.params
  from bench.decode_profile import DSV2_LITE, TINY, random_params_on_device
  from engine.model.config import config_from_dict
  shape = dict(DSV2_LITE if FLAGS.model == "dsv2_lite" else TINY)
  if FLAGS.layers:
    shape["num_hidden_layers"] = FLAGS.layers
  cfg = config_from_dict(shape)
  return cfg, random_params_on_device(cfg, jnp.bfloat16)


def _program(name: str, cfg, batch: int, table, impl, context: int, steps: int):
  """The jitted decode loop of program `name` (PROGRAMS, or "unrolled": the forward with
  `scan_layers=False`, one call per layer on its stack's slice) of `steps` steps after
  `context` cached tokens: (params, per_layer, cache, tokens) -> (cache, tokens)."""

  def step(params, per_layer, cache, tok, start):
    n_new = jnp.ones((batch,), jnp.int32)
    if name != "separate":
      return forward(params, cache, tok[:, None], start, n_new, table, cfg=cfg, impl=impl,
                     scan_layers=name != "unrolled")
    ctx = transformer._Ctx(start, n_new, 1, table)
    ctx.cos_sin(cfg)
    x, cache = params["embed"][tok[:, None]], list(cache)
    for i in range(cfg.num_layers):
      r, j = cfg.layer_stack_of(i)
      first, last = cfg.layer_stacks[r]
      pages = next(iter(cache[r].values())).shape[0] // (last - first)
      lctx = ctx.with_page_table(layer_table(table, j, pages))
      x, cache[r], _ = transformer.decoder_layer(per_layer[i], x, cache[r], lctx, cfg, impl)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache

  @functools.partial(jax.jit, donate_argnums=(2,))
  def run(params, per_layer, cache, tok):
    def body(i, carry):
      cache, tok = carry
      start = jnp.full((batch,), context, jnp.int32) + i
      hidden, cache = step(params, per_layer, cache, tok, start)
      return cache, jnp.argmax(compute_logits(params, hidden[:, 0], cfg), -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, steps, body, (cache, tok))

  return run


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "f8e4m3fn": 1}


def slice_copies(hlo: str, min_bytes: int = 64 << 10) -> list[dict]:
  """The loops of a compiled program (`compile().as_text()`) whose body copies slices out of
  bigger arrays: per body, its trip count and the bytes its loop fusions write from a
  `dynamic-slice` (a layer's weights copied for a dot that cannot read them in place, also
  where the copy is a conversion the dot needs anyway, bf16 weights on a CPU; buffers under
  `min_bytes`, index bookkeeping, left out). A dynamic-slice an XLA:GPU gemm reads in place is
  a custom fusion, not counted."""
  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  out = []
  for m in re.finditer(r" while\(.*body=%([\w.\-]+).*$", hlo, re.M):
    body = m.group(1)
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', m.group(0))
    copied = 0
    for line in comps.get(body, []):
      f = re.match(r"^\s+(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\{[^}]*\} fusion\(.*kind=kLoop, "
                   r"calls=%([\w.\-]+)", line)
      fused = comps.get(f.group(3), []) if f else []
      # (a gather reads rows it picks, the layer index fused in: the formulation's own copy)
      if any("dynamic-slice(" in x for x in fused) and not any(" gather(" in x for x in fused):
        n = _BYTES.get(f.group(1), 4) * math.prod(int(d) for d in f.group(2).split(",") if d)
        copied += n if n >= min_bytes else 0
    if copied:
      out.append(dict(body=body, trip_count=int(trips.group(1)) if trips else None,
                      bytes_per_iteration=copied))
  return out


def measure(cfg, params, per_layer, batch: int, impl) -> dict:
  """Per program: the median seconds per step, and its ratios to `separate` round by round."""
  page = FLAGS.page_size
  table = jnp.asarray(contiguous_page_table(batch, FLAGS.context + FLAGS.steps, page))
  dtype = params["embed"].dtype
  cpu = jax.default_backend() == "cpu"
  clock = time.process_time if cpu else time.perf_counter
  runs, state, tokens = {}, {}, {}
  for name in PROGRAMS:
    transformer.SCAN_UNROLL = 2 if name == "scan_u2" else 1  # (read when tracing)
    try:
      runs[name] = _program(name, cfg, batch, table, impl, FLAGS.context, FLAGS.steps)
      state[name] = jax.block_until_ready(runs[name](
          params, per_layer, init_cache(cfg, int(table.size), page, dtype),
          jnp.ones((batch,), jnp.int32)))
    finally:
      transformer.SCAN_UNROLL = 1
    tokens[name] = state[name][1]
    # (a second call: the first's outputs come back committed, which the jit cache tells apart)
    state[name] = jax.block_until_ready(runs[name](params, per_layer, *state[name]))
  agree = all(bool(jnp.all(tokens[n] == tokens["separate"])) for n in PROGRAMS)
  times = {n: [] for n in PROGRAMS}
  for p in range(FLAGS.pairs):
    for name in (PROGRAMS if p % 2 == 0 else PROGRAMS[::-1]):
      t = clock()
      state[name] = jax.block_until_ready(runs[name](params, per_layer, *state[name]))
      times[name].append((clock() - t) / FLAGS.steps)
  args = (params, per_layer, state["scan"][0], state["scan"][1])
  copies = slice_copies(runs["scan"].lower(*args).compile().as_text())
  out = dict(batch=batch, clock="process CPU" if cpu else "wall", tokens_agree=agree,
             scan_slice_copies=copies)
  for name in PROGRAMS:
    ratios = [a / b for a, b in zip(times[name], times["separate"])]
    out[name] = dict(ms_per_step=statistics.median(times[name]) * 1e3,
                     ratio_median=statistics.median(ratios), ratio_min=min(ratios),
                     ratio_max=max(ratios))
  return out


def main(argv):
  del argv
  cfg, params = _model()
  impl = kernels.KernelChoice(attention=FLAGS.kernels, moe=FLAGS.kernels)
  if FLAGS.kernels == "auto":
    impl = kernels.announce(kernels.resolve_for_params(
        impl, cfg, params, page_size=FLAGS.page_size)).choice
  # Each layer's arrays of its own (copies made before any program runs).
  per_layer = [jax.tree.map(lambda a: jnp.array(a, copy=True), layer_params(cfg, params, i))
               for i in range(cfg.num_layers)]
  results = [measure(cfg, params, per_layer, int(b), impl) for b in FLAGS.batch]
  print(f"{'batch':>5} {'program':>9} {'ms/step':>8} {'/ separate: median':>19} {'range':>13}")
  for r in results:
    for name in PROGRAMS:
      m = r[name]
      print(f"{r['batch']:5d} {name:>9} {m['ms_per_step']:8.2f} {m['ratio_median']:19.3f} "
            f"{m['ratio_min']:6.3f}-{m['ratio_max']:.3f}")
    for c in r["scan_slice_copies"]:
      print(f"{r['batch']:5d} scan: loop {c['body']} ({c['trip_count']} trips) copies "
            f"{c['bytes_per_iteration'] / 2**20:.2f} MiB of slices per iteration")
    if not r["tokens_agree"]:
      print(f"batch {r['batch']}: the programs' greedy tokens differ")
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(dict(model=FLAGS.model, layers=cfg.num_layers, kernels=FLAGS.kernels,
                     page_size=FLAGS.page_size, context=FLAGS.context, steps=FLAGS.steps,
                     pairs=FLAGS.pairs,
                     backend=jax.default_backend(), results=results), fh, indent=1)
  return 0 if all(r["tokens_agree"] for r in results) else 1


if __name__ == "__main__":
  define_flags()
  app.run(main)
