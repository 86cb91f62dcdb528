"""MoE expert-layer benchmark: Mosaic GPU kernels vs `lax.ragged_dot` vs the dense reference.

  python -m bench.moe_kernels --out moe.json [--tokens 1 8 64 512 8192] [--experts 384 48]
      [--formats bf16 int4 fp8]

On a GPU: Kimi-K2.5 shapes (hidden 7168, expert width 2048, 384 routed experts, top-8; 48 local
experts = one expert-parallel shard of 8). Routing is real (`routing.route` on random logits).
The same run measures the device's copy bandwidth (x + 1 over 4 GiB: read + write) and bf16
matmul rate (8192^3), and reports each implementation as
  decode sizes (T <= 64): weight bytes actually needed (experts hit * 3 * H * I * 2) / time,
                          and the fraction of copy bandwidth;
  prefill sizes:          2 * 3 * H * I * (in-shard copies) / time, and the fraction of the
                          matmul rate.
`lax.ragged_dot` and the dense reference (every expert on every token) are baselines; each runs
only where it fits (failures are recorded, not fatal).

`--formats int4 fp8`: the routed experts kept quantized (`Int4Weight`: packed nibbles + bf16
scale per 32 inputs, 0.5625 bytes per weight; `Fp8Weight`: e4m3 + float32 scale per 128 x 128
block), each implementation's weight bytes counted in that format:
  mosaic_gpu           the W4A16 / W8A16 kernels (`int4_mlp_mgpu`, `fp8_mlp_mgpu`), reading the
                       hit experts' quantized tiles once;
  dequant_bf16_kernel  every local expert dequantized to bf16 in XLA, then the bf16 Mosaic
                       kernels (what the engine would do without a quantized kernel on a GPU);
  reference            the engine's plain-JAX path on quantized experts (dequantizes only the
                       gathered experts, or one at a time).

On CPU: reference implementations only, at small shapes (the Mosaic GPU kernels need a GPU;
interpret mode is a simulator, not a benchmark). The output says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import moe_mgpu, reference, routing
from pallas_kernels.quant import Fp8Weight, Int4Weight, dequantize

KIMI = dict(hidden=7168, inter=2048, experts=384, top_k=8, scale=2.827)
SMALL = dict(hidden=256, inter=128, experts=16, top_k=4, scale=2.827)


def _time(fn, *args, iters: int, reps: int) -> float:
  """Median seconds per call; `reps` calls are queued back to back per sample so that host
  dispatch overlaps device work."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / reps)
  return statistics.median(samples)


def measure_device_rates(iters: int) -> dict[str, float]:
  """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on this device."""
  n = 1 << 30  # 2 GiB of bf16 read, 2 GiB written
  a = jnp.ones((n,), jnp.bfloat16)
  copy_s = _time(jax.jit(lambda v: v + 1), a, iters=iters, reps=5)
  del a
  m = 8192
  ka, kb = jax.random.split(jax.random.key(0))
  x = jax.random.normal(ka, (m, m), jnp.bfloat16)
  y = jax.random.normal(kb, (m, m), jnp.bfloat16)
  mm_s = _time(jax.jit(jnp.matmul), x, y, iters=iters, reps=5)
  return {"copy_bytes_per_s": 2 * 2 * n / copy_s, "bf16_matmul_flops": 2 * m ** 3 / mm_s}


def _weights(e: int, h: int, i: int, seed: int):
  keys = jax.random.split(jax.random.key(seed), 3)
  make = jax.jit(lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16),
                 static_argnums=1)
  return make(keys[0], (e, h, i)), make(keys[1], (e, h, i)), make(keys[2], (e, i, h))


# Bytes per weight as stored, scales included (INT4: group 32; FP8: 128 x 128 blocks).
BYTES_PER_WEIGHT = {"bf16": 2.0, "int4": 0.5 + 2 / 32, "fp8": 1.0 + 4 / (128 * 128)}


def _quantized(fmt: str, ws):
  """bf16 weights [E, K, N] -> the same experts kept quantized (random nibbles / e4m3 values
  with scales of the bf16 weights' size; values do not matter for timing)."""
  out = []
  for i, w in enumerate(ws):
    e, k, n = w.shape
    key = jax.random.key(100 + i)
    if fmt == "int4":
      packed = jax.jit(lambda kk: jax.random.randint(kk, (e, n, k // 2), 0, 256, jnp.int32)
                       .astype(jnp.uint8))(key)
      out.append(Int4Weight(packed, jnp.full((e, k // 32, n), 0.02 / 4.6, jnp.bfloat16)))
    else:
      vals = jax.jit(lambda v: jnp.clip(v.astype(jnp.float32) * 1600, -448, 448)
                     .astype(jnp.float8_e4m3fn))(w)
      out.append(Fp8Weight(vals, jnp.full((e, k // 128, -(-n // 128)), 1 / 1600, jnp.float32)))
  return tuple(out)


def _dequant_then_bf16_kernel(x, weights, ids, *ws, **kw):
  return moe_mgpu.moe_experts(x, weights, ids, *(dequantize(w, x.dtype) for w in ws), **kw)


def _impls(fmt: str, on_gpu: bool) -> dict:
  if fmt == "bf16":
    impls = {"ragged_dot": reference.moe_experts, "dense": reference.moe_experts_dense}
    return {"mosaic_gpu": moe_mgpu.moe_experts, **impls} if on_gpu else impls
  if on_gpu:
    return {"mosaic_gpu": moe_mgpu.moe_experts, "dequant_bf16_kernel": _dequant_then_bf16_kernel,
            "reference": reference.moe_experts}
  return {"reference": reference.moe_experts}


def run(args, report=lambda result: None) -> dict:
  """The benchmark; `report(result)` after the device rates and after each row (a run stopped
  at its time limit keeps what it measured)."""
  on_gpu = jax.default_backend() == "gpu"
  shape = KIMI if on_gpu and not args.small else SMALL
  h, inter, e_total, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
  result = {"platform": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "shape": shape, "rows": []}
  if on_gpu:
    result.update(measure_device_rates(args.iters))
  else:
    result["note"] = ("CPU: reference implementations only, small shapes; the Mosaic GPU "
                      "kernels need a GPU (no rates, no kernel timings)")
  report(result)
  route = jax.jit(lambda lg: routing.route(
      lg, jnp.zeros((e_total,), jnp.float32), scoring_func="sigmoid", topk_method="noaux_tc",
      top_k=k, n_group=1, topk_group=1, norm_topk_prob=True,
      routed_scaling_factor=shape["scale"]))
  experts_list = args.experts or ([e_total, e_total // 8] if on_gpu else [e_total, e_total // 4])
  for e_local in experts_list:
    for fmt in args.formats:
      ws = _weights(e_local, h, inter, seed=e_local)
      if fmt != "bf16":
        ws = _quantized(fmt, ws)
      for t in args.tokens:
        kx, kl = jax.random.split(jax.random.key(t))
        x = (jax.random.normal(kx, (t, h), jnp.float32)).astype(jnp.bfloat16)
        weights, ids = route(jax.random.normal(kl, (t, e_total), jnp.float32))
        local = np.asarray(ids).reshape(-1)
        local = local[local < e_local]  # the shard owns experts [0, e_local)
        experts_hit = len(np.unique(local))
        weight_bytes = int(experts_hit * 3 * h * inter * BYTES_PER_WEIGHT[fmt])
        flops = 2 * 3 * h * inter * len(local)
        for name, fn in _impls(fmt, on_gpu).items():
          row = {"impl": name, "format": fmt, "tokens": t, "local_experts": e_local,
                 "experts_hit": experts_hit, "weight_bytes": weight_bytes, "flops": flops}
          if name == "dense" and t > 64:
            row["skipped"] = "dense reference runs every expert on every token; decode sizes only"
          else:
            try:
              f = jax.jit(fn)
              s = _time(f, x, weights, ids, *ws, iters=args.iters, reps=args.reps)
              row.update(seconds=s, gb_per_s=weight_bytes / s / 1e9,
                         tflop_per_s=flops / s / 1e12)
              if on_gpu:
                row["frac_copy_bw"] = weight_bytes / s / result["copy_bytes_per_s"]
                row["frac_matmul"] = flops / s / result["bf16_matmul_flops"]
            except Exception as err:  # OOM or unsupported: record and go on
              row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
          result["rows"].append(row)
          report(result)
      del ws
  return result


def print_header(result: dict) -> None:
  print(f"platform {result['platform']} ({result['device']}), shape {result['shape']}")
  if "note" in result:
    print(result["note"])
  if "copy_bytes_per_s" in result:
    print(f"measured copy {result['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
          f"bf16 matmul {result['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
  print(f"{'impl':>19} {'fmt':>4} {'E':>4} {'T':>5} {'hit':>4} {'time us':>10} {'GB/s':>8} "
        f"{'%copy':>6} {'TFLOP/s':>8} {'%mm':>6}", flush=True)


def print_row(r: dict) -> None:
  head = (f"{r['impl']:>19} {r.get('format', 'bf16'):>4} {r['local_experts']:>4} "
          f"{r['tokens']:>5} {r['experts_hit']:>4}")
  if "seconds" not in r:
    print(f"{head} {r.get('skipped') or r.get('error')}", flush=True)
    return
  pc = f"{100 * r['frac_copy_bw']:6.1f}" if "frac_copy_bw" in r else f"{'-':>6}"
  pm = f"{100 * r['frac_matmul']:6.1f}" if "frac_matmul" in r else f"{'-':>6}"
  print(f"{head} {r['seconds'] * 1e6:10.1f} {r['gb_per_s']:8.1f} {pc} "
        f"{r['tflop_per_s']:8.2f} {pm}", flush=True)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="JSON results file")
  p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 8192])
  p.add_argument("--experts", type=int, nargs="+", default=None,
                 help="local expert counts (default: all, and one EP shard)")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--small", action="store_true", help="small shapes even on a GPU")
  p.add_argument("--formats", nargs="+", default=["bf16"], choices=sorted(BYTES_PER_WEIGHT),
                 help="routed expert formats (int4 / fp8: kept quantized)")
  args = p.parse_args(argv)
  def report(result):  # the JSON kept current, the header once, each row as it is measured
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
    if not result["rows"]:
      print_header(result)
    else:
      print_row(result["rows"][-1])
  return run(args, report)


if __name__ == "__main__":
  main()
