"""Stage `experts`: the FP8 and bf16 routed-expert kernels at Kimi K2.5 decode shapes (INT4,
Kimi K2.5's own format, has its stage: `int4.py`, which builds its inputs here).

    python -m bench.protocol.experts OUT --formats=fp8,bf16        (stage experts)

Kimi K2.5's routed experts: hidden 7168, width 2048, top-8 of 384. Per format and case, the
MoE call `moe_mgpu.moe_experts` (the engine's "mosaic_gpu" path: permutation, two kernels,
combine) is timed two ways: `us` = the Mosaic kernels' own time (CUPTI, glue excluded), from
which GB/s = the hit experts' bytes as stored / us and the fractions of this run's ceilings;
`call_us` = the whole call's wall time. Each timed iteration takes the next of 8 routings, so
few hit experts are not re-read from L2. The first case is checked against the plain-JAX
reference.

Weights: INT4 packed nibbles and FP8 values are random bits (INT4 as `Int4Weight` stores them:
compressed-tensors' [E, N, K/2] bytes); scales and bf16 weights random normals. In the dry
run: toy shapes in Mosaic GPU's interpreter, and every GPU program above exported for CUDA at
its real shape.
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.protocol import timing
from bench.protocol.rows import Recorder, dry_run
from pallas_kernels.moe import moe_mgpu, reference
from pallas_kernels.quant import Fp8Weight, Int4Weight

K25 = dict(hidden=7168, inter=2048, experts=384, top_k=8)
TOY = dict(hidden=128, inter=128, experts=16, top_k=4)
ROTATIONS = 8
BYTES_PER_WEIGHT = {"bf16": 2.0, "int4": 0.5 + 2 / 32, "fp8": 1.0 + 4 / (128 * 128)}


def cases(fmt: str, gpu: bool) -> list[tuple[int, int]]:
  """(local experts, tokens) per format, most important first (the dry run's toy subset: the
  interpreter takes seconds per call)."""
  if not gpu:
    return [(TOY["experts"], 1)]
  e = K25["experts"]
  if fmt == "fp8":
    return [(e, 1), (e, 8), (e, 64)]
  return [(e, 1), (e, 8)]


def make_weights(fmt: str, e: int, shape: dict, seed: int, group: int = 32):
  """(gate, up, down) of logical shape [E, K, N] in `fmt`, generated on the device (INT4:
  packed [E, N, K/2], scales [E, K/group, N] ~ 1/(4.6 sqrt(K)), so that outputs stay ~1)."""
  h, i = shape["hidden"], shape["inter"]
  ks = iter(timing.keys(seed, 6))
  out = []
  for k, n in ((h, i), (h, i), (i, h)):
    if fmt == "int4":
      out.append(Int4Weight(timing.random_array(next(ks), (e, n, k // 2), jnp.uint8),
                            timing.random_array(next(ks), (e, k // group, n), jnp.bfloat16,
                                                (1 / k) ** 0.5 / 4.6)))
    elif fmt == "fp8":
      out.append(Fp8Weight(timing.random_array(next(ks), (e, k, n), jnp.float8_e4m3fn),
                           timing.random_array(next(ks), (e, k // 128, n // 128), jnp.float32,
                                               (1 / k) ** 0.5 / 64)))
    else:
      out.append(timing.random_array(next(ks), (e, k, n), jnp.bfloat16, (1 / k) ** 0.5))
      next(ks)
  return tuple(out)


def weight_specs(fmt: str, e: int, shape: dict):
  s = jax.ShapeDtypeStruct
  h, i = shape["hidden"], shape["inter"]
  out = []
  for k, n in ((h, i), (h, i), (i, h)):
    if fmt == "int4":
      out.append(Int4Weight(s((e, n, k // 2), jnp.uint8), s((e, k // 32, n), jnp.bfloat16)))
    elif fmt == "fp8":
      out.append(Fp8Weight(s((e, k, n), jnp.float8_e4m3fn), s((e, k // 128, n // 128),
                                                               jnp.float32)))
    else:
      out.append(s((e, k, n), jnp.bfloat16))
  return tuple(out)


def routings(t: int, shape: dict, seed: int) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
  """ROTATIONS inputs (x [T, H], weights [T, k], ids [T, k]) routed over all experts (top-k
  of sigmoid scores, weights normalised and scaled as Kimi's)."""
  @jax.jit
  def one(key):
    kx, kl = jax.random.split(key)
    x = jax.random.normal(kx, (t, shape["hidden"]), jnp.bfloat16)
    scores = jax.nn.sigmoid(jax.random.normal(kl, (t, shape["experts"]), jnp.float32))
    w, ids = jax.lax.top_k(scores, shape["top_k"])
    return x, w / jnp.sum(w, -1, keepdims=True) * 2.827, ids.astype(jnp.int32)
  return [one(k) for k in timing.keys(seed, ROTATIONS)]


def experts_hit(rots, e_local: int) -> float:
  hits = [len(np.unique(ids[(ids >= 0) & (ids < e_local)])) for ids in
          (np.asarray(r[2]) for r in rots)]
  return float(np.mean(hits))


def _mosaic(name: str) -> bool:
  return "mosaic" in name.lower()


def engine_call(jit: bool = True):
  """The engine's "mosaic_gpu" MoE call (`moe_mgpu.moe_experts`: the experts' format picks the
  kernels). Jitted, except in the interpreter (op by op: its kernels nested in an outer CPU
  program run slower, and have hung on 2 cores), where it runs a few CTAs, not 132."""
  if jit:
    return jax.jit(moe_mgpu.moe_experts)
  return lambda x, w, ids, *ws: moe_mgpu.moe_experts(x, w, ids, *ws, num_sms=4)


def reference_call():
  return jax.jit(lambda x, w, ids, *ws: reference.moe_experts(x, w, ids, *ws))


def time_moe(f, rots, ws) -> tuple[jax.Array, dict]:
  """f(*routing, *ws) run once (its output returned), then timed on the routings in turn:
  {us: the Mosaic kernels' own time per call (CUPTI; the wall time where there is none),
  call_us: wall per call, glue_us, mosaic_us: [each Mosaic launch's median us, in launch
  order], kernels: every kernel by time, timed_by}. In the dry run one call, its wall time:
  the interpreter's time says nothing."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(f(*rots[0], *ws))
  if dry_run():
    us = (time.perf_counter() - t0) * 1e6
    return out, dict(us=us, call_us=us, timed_by="wall")
  run = lambda i: f(*rots[i % len(rots)], *ws)
  per_iter = timing.kernel_times(run, 2 * len(rots))
  wall = timing.wall_us(run, iterations=5, reps=len(rots))
  t = dict(call_us=wall, timed_by="wall", us=wall)
  found = timing.summarize_kernels(per_iter, keep=_mosaic)
  if found:
    launches = [[us for name, us in it if _mosaic(name)] for it in per_iter]
    n = min(len(x) for x in launches)
    t.update(us=found["kernel_us"], glue_us=wall - found["kernel_us"], timed_by="cupti",
             kernels=found["kernels"],
             mosaic_us=[float(np.median([x[j] for x in launches])) for j in range(n)])
  return out, t


def measure(rec: Recorder, fmt: str, e: int, t: int, ws, rots, shape: dict,
            check_reference: bool = False):
  """One row: the engine's call timed (kernels alone and whole)."""
  per_expert = 3 * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT[fmt]
  hit = experts_hit(rots, e)
  row = dict(format=fmt, tokens=t, local_experts=e, experts_hit=hit, bytes=int(hit * per_expert))
  case = f"{fmt} E={e} T={t}"
  try:
    with timing.kernels_runnable():
      out, t_ = time_moe(engine_call(jit=not dry_run()), rots, ws)
  except Exception as err:  # an OOM or a refused shape is a result
    return rec.row("mosaic_gpu", case, **row, error=f"{type(err).__name__}: {err}"[:600])
  if check_reference:
    row["rel_err_vs_reference"] = timing.rel_err(out, reference_call()(*rots[0], *ws))
  return rec.row("mosaic_gpu", case, **row, **t_, call_gbps=row["bytes"] / t_["call_us"] / 1e3)


def export_rows(rec: Recorder, fmt: str) -> None:
  """Dry run: each GPU program of this format lowered for CUDA at its real shape."""
  s = jax.ShapeDtypeStruct
  for e, t in timing.first(cases(fmt, gpu=True)):
    args = (s((t, K25["hidden"]), jnp.bfloat16), s((t, K25["top_k"]), jnp.float32),
            s((t, K25["top_k"]), jnp.int32), *weight_specs(fmt, e, K25))
    found = timing.cuda_export(engine_call(), *args)
    rec.row("cuda_export", f"{fmt} mosaic_gpu E={e} T={t}", format=fmt, **found)


def run(out_dir: str, formats: list[str]) -> None:
  rec = Recorder(out_dir, "experts", **timing.labels())
  shape = TOY if dry_run() else K25
  for fmt in formats:
    weights = {}
    for e, t in cases(fmt, gpu=not dry_run()):
      if e not in weights:
        weights.clear()
        gc.collect()
        weights[e] = jax.block_until_ready(make_weights(fmt, e, shape, seed=e))
      rots = routings(t, shape, seed=t)
      measure(rec, fmt, e, t, weights[e], rots, shape,
              check_reference=(e, t) == (shape["experts"], 1))
    weights.clear()
    gc.collect()
    if dry_run():
      export_rows(rec, fmt)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  p.add_argument("--formats", default="fp8,bf16", help="comma-separated: fp8, bf16")
  args = p.parse_args(argv)
  formats = args.formats.split(",")
  if "int4" in formats:
    p.error("INT4 experts have their own stage: python -m bench.protocol.int4")
  run(args.out, formats)


if __name__ == "__main__":
  main()
