"""Stage `int4`: the W4A16 expert kernel (`w4a16_mgpu`, the MoE layer `int4_mlp_mgpu`) at Kimi
K2.5 shapes: correctness first, then a configuration sweep, then its time at every case.

    python -m bench.protocol.int4 OUT       (gpu_check.sh: Mosaic GPU's SASS and ptxas dumps on,
                                             stdout to the file SASS_LOG names)

Rows (stage `int4`, the protocol's format: GB/s and fractions of this run's ceilings), in
order:
1. `plan registers` / `plan smem`: the register plan bitwise. One-hot activations through one
   kernel call return each dequantized weight exactly (a misplaced nibble, pair or scale shows
   as a mismatch count), groups 32 and 128, the register and the SMEM operand paths.
2. `mosaic_gpu` at E=384 T=1: the engine's MoE call (`moe_mgpu.moe_experts`: permutation, the
   two kernels, combine) against the plain-JAX reference (`rel_err_vs_reference`, and
   `reference_ok` within 2e-2).
3. The sweep at E=384 T=1 (`sweep()`): `mosaic_gpu <changes>` per `Int4Config` variant, each
   output against the default's (`rel_err_vs_default`).
4. E=384 at 8 tokens (then `SWEEP_T8`) and 64, the 8-way expert shard E=48 at 1 and 8 tokens
   (tokens still routed over 384), each against the reference.
5. `sass`: per compiled kernel its SASS instruction count, opcode families, registers and
   spills, ptxas's warnings (a serialised WGMMA shows there) (`sass.py`).
Times: `us` = the two Mosaic kernels' own time (CUPTI), `gate_up_us` / `down_us` each;
`call_us` = the whole call's wall time (glue included); bytes = the hit experts' bytes as
stored. Each sample routes anew (8 routings in turn), so a shard's few experts are not re-read
from L2. If the register path fails its bitwise check, the SMEM-operand variant is timed
instead (`timed` in the `summary` row).

The stage has a deadline (`--deadline_s`, default the stage's limit less 10 s): a sweep variant
starts only while the cases after it still fit at the slowest program so far; a case that no
longer fits writes a skip row. In the dry run: toy shapes in Mosaic GPU's interpreter (which
runs the SMEM-operand path: it cannot run the register path's inline code), and the GPU
programs lowered for CUDA at K2.5 shapes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.protocol import experts, timing
from bench.protocol.rows import Recorder, dry_run
from pallas_kernels.moe import int4_mlp_mgpu, w4a16_layout, w4a16_mgpu
from pallas_kernels.quant import dequantize

K25 = experts.K25
TOY = dict(hidden=256, inter=128, experts=16, top_k=4)
BYTES_PER_WEIGHT = experts.BYTES_PER_WEIGHT["int4"]  # nibble + a bf16 scale per 32


def sweep(real: bool) -> list[dict[str, Any]]:
  """`Int4Config` changes tried at 384 experts x 1 token besides the default, most telling
  first (the deadline cuts the tail): the A operand through SMEM, MMAs waited per chunk, no K
  split, ring depth, K step, forced splits, the split model's unit cost."""
  if not real:
    return timing.first([dict(a_operand="smem", max_stages=2)], 0)
  return [dict(a_operand="smem"), dict(mma_depth=1), dict(splits=1), dict(max_stages=4),
          dict(block_k=128), dict(splits=2), dict(splits=4), dict(max_stages=2),
          dict(split_overhead=0.0), dict(split_overhead=3.0), dict(max_stages=3)]


SWEEP_T8 = [dict(splits=1), dict(a_operand="smem")]  # also tried at 8 tokens


def impl_name(changes: dict[str, Any]) -> str:
  return "mosaic_gpu" + ("" if not changes else " " + ",".join(
      f"{k}={v}" for k, v in changes.items()))


def moe_call(changes: dict[str, Any], jit: bool = True):
  """The MoE call with `changes` to the kernel's configuration: none = the engine's path."""
  if not changes:
    return experts.engine_call(jit)
  cfg = int4_mlp_mgpu.Int4Config(**{**({} if jit else {"num_sms": 4}), **changes})
  fn = lambda x, w, ids, *ws: int4_mlp_mgpu.moe_experts_int4(x, w, ids, *ws, cfg=cfg)
  return jax.jit(fn) if jit else fn


# ---- 1. the register plan, bitwise ---------------------------------------------------------

def check_plan(rec: Recorder) -> dict[str, bool]:
  """One-hot activations through one kernel call: outputs = dequantized weights, bitwise.
  {a_operand: every case bitwise}."""
  ok: dict[str, bool] = {}
  k, n, nt = 512, 256, 8
  for a_operand, group in timing.first([("registers", 32), ("registers", 128), ("smem", 32)]):
    w = experts.make_weights("int4", 3, dict(hidden=k, inter=n), seed=group, group=group)[0]
    rng = np.random.default_rng(0)
    rows = np.stack([rng.permutation(k)[:nt] for _ in range(2)])
    xs = jnp.asarray(np.eye(k)[rows.reshape(-1)], jnp.bfloat16)
    slot_expert = jnp.asarray([2, 0], jnp.int32)
    cfg = w4a16_mgpu.W4A16Config(a_operand=a_operand, num_sms=4)
    case = f"one-hot K={k} N={n} group={group}"
    try:
      with timing.kernels_runnable():
        got = jax.jit(lambda x, se, s, w: w4a16_mgpu.expert_matmul(
            w4a16_layout.permute_k(x), (w,), se, s, nt, cfg, final=True))(
                xs, slot_expert, jnp.asarray([2, 1], jnp.int32), w)
      want = np.asarray(dequantize(w, jnp.bfloat16), np.float32)[
          np.asarray(slot_expert)[:, None], rows].transpose(0, 2, 1)
      got = np.asarray(got, np.float32)
      bad = int(np.sum(got != want))
      rec.row(f"plan {a_operand}", case, mismatches=bad, bitwise=bad == 0,
              max_abs_diff=float(np.max(np.abs(got - want))))
      ok[a_operand] = ok.get(a_operand, True) and bad == 0
    except Exception as e:  # a failure here is the finding; the rest still runs
      rec.row(f"plan {a_operand}", case, error=f"{type(e).__name__}: {e}"[:800])
      ok[a_operand] = False
  return ok


# ---- 2-4. the MoE call timed -----------------------------------------------------------------

def measure(rec: Recorder, e: int, t: int, ws, shape: dict, changes=None, baseline=None,
            reference: bool = False):
  """One row: the MoE call with `changes` at E=e local experts and t tokens, its two kernels
  timed alone and the whole call; checked against `baseline` (the default's output) or the
  reference. Returns the output (None if the call failed)."""
  changes = changes or {}
  rots = _routings(t, tuple(shape.items()))
  hit = experts.experts_hit(rots, e)
  per_expert = 3 * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT
  case = f"int4 E={e} T={t}"
  row = dict(format="int4", tokens=t, local_experts=e, experts_hit=hit,
             bytes=int(hit * per_expert))
  try:
    with timing.kernels_runnable():
      out, timed = experts.time_moe(moe_call(changes, jit=not dry_run()), rots, ws)
  except Exception as err:  # a configuration the kernel refuses is a result too
    rec.row(impl_name(changes), case, **row, error=f"{type(err).__name__}: {err}"[:800])
    return None
  if baseline is not None:
    row["rel_err_vs_default"] = timing.rel_err(out, baseline)
  if reference:
    try:
      row["rel_err_vs_reference"] = timing.rel_err(out, experts.reference_call()(*rots[0], *ws))
      row["reference_ok"] = row["rel_err_vs_reference"] <= 2e-2
    except Exception as err:  # (the reference dequantizes every hit expert: memory)
      row["reference_error"] = f"{type(err).__name__}: {err}"[:300]
  split = timed.get("mosaic_us") or []
  if len(split) == 2:  # gate/up (+ SwiGLU) first, then down
    row.update(gate_up_us=split[0], down_us=split[1],
               gate_up_gbps=hit * 2 * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT
               / split[0] / 1e3,
               down_gbps=hit * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT
               / split[1] / 1e3)
  rec.row(impl_name(changes), case, **row, **timed,
          call_gbps=row["bytes"] / timed["call_us"] / 1e3)
  return out


@functools.cache
def _routings(t: int, shape: tuple) -> list:
  """The routings of t tokens, made once (each making compiles a program)."""
  return experts.routings(t, dict(shape), seed=t)


class Deadline:
  """Whether a program may start: `required` ones while one slowest program still fits,
  optional ones (the sweep) only while every required one after them fits too."""

  def __init__(self, seconds: float, now=time.perf_counter):
    self.now = now
    self.end = now() + seconds
    self.slowest = 0.0

  def left(self) -> float:
    return self.end - self.now()

  def allows(self, required_after: int, optional: bool) -> bool:
    need = max(self.slowest, 5.0) * (1 + (required_after if optional else 0))
    return self.left() >= need

  def run(self, rec: Recorder, case: str, changes: dict, required_after: int, optional: bool,
          fn, *args, **kwargs):
    """fn(*args, **kwargs) if it may start (its time kept), else a skip row and None."""
    if not self.allows(required_after, optional):
      rec.row(impl_name(changes), case, skipped=f"deadline: {self.left():.0f}s left, slowest "
              f"program {self.slowest:.0f}s, {required_after} required case(s) after")
      return None
    t0 = self.now()
    out = fn(*args, **kwargs)
    self.slowest = max(self.slowest, self.now() - t0)
    return out


def export_rows(rec: Recorder) -> None:
  """Dry run: the GPU programs lowered for CUDA at K2.5 shapes: the default at every case, each
  sweep variant at 384 x 1."""
  s = jax.ShapeDtypeStruct
  h, k = K25["hidden"], K25["top_k"]
  e = K25["experts"]
  programs = [(e, 1, {}), (e, 8, {}), (e, 64, {}), (e // 8, 1, {}), (e // 8, 8, {})] + [
      (e, 1, c) for c in sweep(real=True)] + [(e, 8, c) for c in SWEEP_T8]
  for ee, t, changes in timing.first(programs):
    found = timing.cuda_export(moe_call(changes), s((t, h), jnp.bfloat16),
                               s((t, k), jnp.float32), s((t, k), jnp.int32),
                               *experts.weight_specs("int4", ee, K25))
    rec.row("cuda_export", f"{impl_name(changes)} E={ee} T={t}", format="int4", **found)


def run(out_dir: str, deadline_s: float) -> None:
  rec = Recorder(out_dir, "int4", **timing.labels())
  real = not dry_run()
  shape = K25 if real else TOY
  t0 = time.perf_counter()
  clock = Deadline(deadline_s)
  plan_ok = check_plan(rec)
  # If the register path is wrong on this GPU, time the SMEM-operand path (the same kernel but
  # for the operand's route) rather than nothing.
  default = {} if plan_ok.get("registers", True) else {"a_operand": "smem"}
  e_all = shape["experts"]
  shard = e_all // 8
  # The required cases after the first, in order: (E, T).
  later = [(e_all, 8), (e_all, 64), (shard, 1), (shard, 8)] if real else \
      timing.first([(shard, 1)], 0)
  plan = [(e_all, 1, {}, False)] + [(e_all, 1, c, True) for c in sweep(real)]
  for e, t in later:
    plan += [(e, t, {}, False)] + [(e, t, c, True) for c in SWEEP_T8 if (e, t) == (e_all, 8)]
  weights: dict[int, Any] = {}
  outs: dict[tuple[int, int], Any] = {}  # the default's output per case
  for i, (e, t, changes, optional) in enumerate(plan):
    c = {**default, **changes}
    if optional and c == default:
      continue
    if e not in weights:  # (one set of experts on the device at a time)
      weights.clear()
      gc.collect()
      weights[e] = jax.block_until_ready(
          experts.make_weights("int4", e, shape, seed=1 if e == e_all else 2))
    after = sum(not p[3] for p in plan[i + 1:])
    out = clock.run(rec, f"int4 E={e} T={t}", c, after, optional, measure, rec, e, t,
                    weights[e], shape, c, baseline=outs.get((e, t)) if optional else None,
                    reference=not optional)
    if not optional:
      outs[(e, t)] = out
  weights.clear()
  outs.clear()
  gc.collect()
  if not real:
    export_rows(rec)
  rec.row("summary", plan_bitwise=plan_ok, timed=impl_name(default),
          seconds=round(time.perf_counter() - t0, 1))
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
  p.add_argument("--deadline_s", type=float,
                 default=float(os.environ.get("STAGE_LIMIT_S", "200")) - 10,
                 help="seconds after which no program starts (default: the stage's limit "
                 "from gpu_check.sh, less 10 for start-up and the SASS rows)")
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  run(args.out, args.deadline_s)


if __name__ == "__main__":
  main()
