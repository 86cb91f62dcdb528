"""Stages `int4` and `experts`: the routed-expert kernels at Kimi K2.5 decode shapes.

    python -m bench.protocol.experts OUT --formats=int4            (stage int4)
    python -m bench.protocol.experts OUT --formats=fp8,bf16        (stage experts)

Kimi K2.5's routed experts: hidden 7168, width 2048, top-8 of 384. Per format and case (all
384 experts, or one 8-way expert-parallel shard of 48: the tokens still route over 384), the
MoE call `moe_mgpu.moe_experts` (the engine's "mosaic_gpu" path: permutation, two kernels,
combine) is timed two ways: `us` = the Mosaic kernels' own time (CUPTI, glue excluded), from
which GB/s = the hit experts' bytes as stored / us and the fractions of this run's ceilings;
`call_us` = the whole call's wall time. Each timed iteration takes the next of 8 routings, so
a shard's one or two hit experts are not re-read from L2.

INT4 also sweeps the kernel's configuration at 1 token (`DequantConfig`: CTAs per SM,
pipeline depth, K step), each variant's output checked against the default's, and, with
`SASS_LOG` naming the file its stdout goes to and Mosaic GPU's SASS and ptxas dumps on
(gpu_check.sh does both), counts each kernel's SASS opcodes, registers and spills (`sass.py`). The default kernel is checked against the plain-JAX reference at 1 token.

Weights: INT4 packed nibbles and FP8 values are random bits; scales and bf16 weights random
normals. In the dry run: toy shapes in Mosaic GPU's interpreter, and every GPU program above
exported for CUDA at its real shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.protocol import timing
from bench.protocol.rows import Recorder, dry_run
from pallas_kernels.moe import dequant_mlp_mgpu, fp8_mlp_mgpu, int4_mlp_mgpu, moe_mgpu, reference
from pallas_kernels.quant import Fp8Weight, Int4Weight

K25 = dict(hidden=7168, inter=2048, experts=384, top_k=8)
TOY = dict(hidden=128, inter=128, experts=16, top_k=4)
ROTATIONS = 8
BYTES_PER_WEIGHT = {"bf16": 2.0, "int4": 0.5 + 2 / 32, "fp8": 1.0 + 4 / (128 * 128)}


def cases(fmt: str, gpu: bool) -> list[tuple[int, int]]:
  """(local experts, tokens) per format, most important first (the dry run's toy subset: the
  interpreter takes seconds per call)."""
  if not gpu:
    e = TOY["experts"]
    return timing.first([(e, 1), (e // 8, 1)] if fmt == "int4" else [(e, 1)])
  e, shard = K25["experts"], K25["experts"] // 8
  if fmt == "int4":
    return [(e, 1), (e, 8), (e, 64), (shard, 1), (shard, 8)]
  if fmt == "fp8":
    return [(e, 1), (e, 8), (e, 64)]
  return [(e, 1), (e, 8)]


def sweep(gpu: bool) -> list[dequant_mlp_mgpu.DequantConfig]:
  """INT4 configurations tried besides the default (132 CTAs, 4 stages, block_k 128): two CTAs
  per SM (at 8-token slots the kernel's SMEM allows it), a shallower pipeline for a third CTA,
  a longer K step."""
  c = dequant_mlp_mgpu.DequantConfig
  if not gpu:
    return timing.first([c(num_sms=8, max_concurrent_steps=2)], 0)
  return [c(num_sms=264), c(num_sms=264, max_concurrent_steps=2),
          c(num_sms=396, max_concurrent_steps=2), c(block_k=256)]


def make_weights(fmt: str, e: int, shape: dict, seed: int):
  """(gate, up, down) [E, K, N] in `fmt`, generated on the device."""
  h, i = shape["hidden"], shape["inter"]
  ks = iter(timing.keys(seed, 6))
  out = []
  for k, n in ((h, i), (h, i), (i, h)):
    if fmt == "int4":
      out.append(Int4Weight(timing.random_array(next(ks), (e, k // 2, n), jnp.uint8),
                            timing.random_array(next(ks), (e, k // 32, n), jnp.bfloat16,
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
      out.append(Int4Weight(s((e, k // 2, n), jnp.uint8), s((e, k // 32, n), jnp.bfloat16)))
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


def _impl(cfg: dequant_mlp_mgpu.DequantConfig | None) -> str:
  if cfg is None:
    return "mosaic_gpu"
  default = dequant_mlp_mgpu.DequantConfig()
  diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
          if getattr(cfg, f.name) != getattr(default, f.name)]
  return "mosaic_gpu " + ",".join(diff)


def call(fmt: str, cfg: dequant_mlp_mgpu.DequantConfig | None, jit: bool = True):
  """The MoE call: the engine's path (cfg None) or the INT4 / FP8 kernel pair with a
  configuration of the sweep. Jitted, except in the interpreter (op by op: its kernels nested
  in an outer CPU program run slower, and have hung on 2 cores)."""
  if cfg is None:  # (the interpreter runs every CTA: a few, not 132)
    sms = dict(num_sms=4) if not jit else {}
    fn = lambda x, w, ids, *ws: moe_mgpu.moe_experts(x, w, ids, *ws, **sms)
  else:
    kernel = int4_mlp_mgpu.moe_experts_int4 if fmt == "int4" else fp8_mlp_mgpu.moe_experts_fp8
    fn = lambda x, w, ids, *ws: kernel(x, w, ids, *ws, cfg=cfg)
  return jax.jit(fn) if jit else fn


def measure(rec: Recorder, fmt: str, e: int, t: int, ws, rots, shape: dict,
            cfg=None, baseline=None, check_reference: bool = False):
  """One row: the call timed (kernels alone and whole), its output kept for the sweep's check."""
  per_expert = 3 * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT[fmt]
  hit = experts_hit(rots, e)
  row = dict(format=fmt, tokens=t, local_experts=e, experts_hit=hit, bytes=int(hit * per_expert))
  case = f"{fmt} E={e} T={t}"
  f = call(fmt, cfg, jit=not dry_run())
  try:
    with timing.kernels_runnable():
      t0 = time.perf_counter()
      out = jax.block_until_ready(f(*rots[0], *ws))
      if dry_run():  # the interpreter's time says nothing: one call, its time kept
        t_ = dict(us=(time.perf_counter() - t0) * 1e6)
      else:
        run = lambda i: f(*rots[i % len(rots)], *ws)
        t_ = timing.time_call(run, iterations=10, reps=5, keep=_mosaic)
  except Exception as err:  # a configuration the kernel refuses is a result
    return rec.row(_impl(cfg), case, **row, error=f"{type(err).__name__}: {err}"[:600]), None
  if baseline is not None:
    row["rel_err_vs_default"] = timing.rel_err(out, baseline)
  if check_reference:
    want = jax.jit(lambda x, w, ids, *a: reference.moe_experts(x, w, ids, *a))(*rots[0], *ws)
    row["rel_err_vs_reference"] = timing.rel_err(out, want)
  kernel_us = t_.get("kernel_us")
  rec.row(_impl(cfg), case, **row, us=kernel_us or t_["us"], call_us=t_["us"],
          call_gbps=row["bytes"] / t_["us"] / 1e3, glue_us=t_["us"] - kernel_us if kernel_us
          else None, kernels=t_.get("kernels"), timed_by="cupti" if kernel_us else "wall")
  return row, out


def export_rows(rec: Recorder, fmt: str, shape: dict) -> None:
  """Dry run: each GPU program of this format lowered for CUDA at its real shape."""
  s = jax.ShapeDtypeStruct
  configs = [None] + (sweep(gpu=True) if fmt == "int4" else [])
  programs = [(e, t, cfg) for e, t in cases(fmt, gpu=True)
              for cfg in (configs if (e, t) == (K25["experts"], 1) else [None])]
  for e, t, cfg in timing.first(programs):
    args = (s((t, K25["hidden"]), jnp.bfloat16), s((t, K25["top_k"]), jnp.float32),
            s((t, K25["top_k"]), jnp.int32), *weight_specs(fmt, e, K25))
    found = timing.cuda_export(call(fmt, cfg), *args)
    rec.row("cuda_export", f"{fmt} {_impl(cfg)} E={e} T={t}", format=fmt, **found)


def run(out_dir: str, formats: list[str], stage: str) -> None:
  rec = Recorder(out_dir, stage, **timing.labels())
  shape = TOY if dry_run() else K25
  for fmt in formats:
    weights = {}
    for e, t in cases(fmt, gpu=not dry_run()):
      if e not in weights:
        weights.clear()
        gc.collect()
        weights[e] = jax.block_until_ready(make_weights(fmt, e, shape, seed=e))
      rots = routings(t, shape, seed=t)
      first = (e, t) == (shape["experts"], 1)
      _, out = measure(rec, fmt, e, t, weights[e], rots, shape, check_reference=first)
      if fmt == "int4" and first and out is not None:
        for cfg in sweep(gpu=not dry_run()):
          measure(rec, fmt, e, t, weights[e], rots, shape, cfg=cfg, baseline=out)
    weights.clear()
    gc.collect()
    if dry_run():
      export_rows(rec, fmt, shape)
  listing = os.environ.get("SASS_LOG")  # this process's stdout (gpu_check.sh), where Mosaic
  if listing and os.path.exists(listing):  # GPU printed each kernel's SASS and ptxas report
    from bench.protocol import sass
    sys.stdout.flush()
    with open(listing, errors="replace") as fh:
      for r in sass.summarize(fh.read()):
        rec.row("sass", r.pop("module"), **r)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  p.add_argument("--formats", default="int4", help="comma-separated: int4, fp8, bf16")
  p.add_argument("--stage", default=None, help="row label (default: int4 or experts)")
  args = p.parse_args(argv)
  formats = args.formats.split(",")
  run(args.out, formats, args.stage or ("int4" if formats == ["int4"] else "experts"))


if __name__ == "__main__":
  main()
