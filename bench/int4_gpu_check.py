"""The W4A16 expert kernel (`w4a16_mgpu`) on a GPU, in one short process: correctness first, then
its time alone at Kimi K2.5 shapes with a configuration sweep, then its SASS opcode counts.

    python3 -m bench.int4_gpu_check OUT            on a GPU (~3-4 min, compilation included)
    DRY_RUN=1 python -m bench.int4_gpu_check OUT   on the CPU: toy shapes in Mosaic GPU's
                                                   interpreter, and every GPU program of the
                                                   sweep lowered for CUDA at its real shape

Rows go to OUT/results.jsonl as they are measured (appended, flushed; the fields of the GPU
protocol, issue 51: stage, impl, case, us, bytes, gbps, frac_copy / frac_read / frac_ceiling of
this run's ceilings, device, jax, commit, dry_run), a table to stdout at the end.

1. `int4_check`: the register plan bitwise (one-hot activations return each dequantized weight
   exactly: a misplaced nibble, pair or scale shows as a mismatch count) for the register and
   the SMEM operand paths, groups 32 and 128; then the MoE call (`moe_mgpu.moe_experts`, the
   engine's path) against the plain-JAX reference at K2.5 shapes. Everything after this runs
   even if it fails (the SMEM path may still be right), but the rows say so.
2. `int4_ceilings`: XLA copy (x + 1, counted read + write) and read-only reduction (float32 sum)
   over 2 GiB, unless OUT/results.jsonl already has the protocol's `ceilings` rows.
3. `int4`: per configuration of `sweep()` at 384 experts and 1 token (each variant's output
   checked against the default's), then the default at 384 experts x 1 / 8 / 64 tokens (with
   `SWEEP_T8` at 8) and an 8-way shard (48 experts) x 1 / 8 tokens: `us` = the two Mosaic kernels' own time (CUPTI),
   `gate_up_us` / `down_us` each, `call_us` = the whole call's wall time (permutation and
   combine included); bytes = the hit experts' bytes as stored. Each sample routes anew (8
   routings in turn), so a shard's few experts are not re-read from L2.
4. `int4_sass`: with MOSAIC_GPU_DUMP_SASS=1 and MOSAIC_GPU_DUMP_PTXAS=1 set here, Mosaic GPU
   prints each kernel's SASS and ptxas report to stdout, which this process sends to
   OUT/int4_sass.txt (gzipped at the end): per kernel the instruction count, opcode families,
   registers and ptxas's warnings (a serialised WGMMA shows there).

If the register path fails its bitwise check, the timings use `a_operand="smem"` (the summary
row says which was timed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

K25 = dict(hidden=7168, inter=2048, experts=384, top_k=8)
TOY = dict(hidden=256, inter=128, experts=16, top_k=4)
BYTES_PER_WEIGHT = 0.5 + 2 / 32  # INT4 group 32: nibble + bf16 scale per 32
ROTATIONS = 8


def dry_run() -> bool:
  return os.environ.get("DRY_RUN", "") not in ("", "0")


class Recorder:
  """One JSON row per measurement in OUT/results.jsonl (the protocol's row format)."""

  def __init__(self, out_dir: str, labels: dict[str, Any]):
    self.path = os.path.join(out_dir, "results.jsonl")
    self.labels = labels
    self.ceil: dict[str, float] = {}
    self.rows: list[dict[str, Any]] = []

  def row(self, stage: str, impl: str, case: str = "", **fields: Any) -> dict[str, Any]:
    r = dict(stage=stage, impl=impl, case=case, **fields)
    if r.get("us") and r.get("bytes") and "gbps" not in r:
      r["gbps"] = r["bytes"] / r["us"] / 1e3
    if r.get("gbps"):
      copy, read = self.ceil.get("copy_gbps"), self.ceil.get("read_gbps")
      if copy:
        r["frac_copy"] = r["gbps"] / copy
      if read:
        r["frac_read"] = r["gbps"] / read
      if copy or read:
        r["frac_ceiling"] = r["gbps"] / max(copy or 0, read or 0)
    r.update(self.labels)
    with open(self.path, "a") as fh:
      fh.write(json.dumps(r, default=str) + "\n")
      fh.flush()
      os.fsync(fh.fileno())
    self.rows.append(r)
    print(f"[{stage}] {impl} {case} " + " ".join(
        f"{k}={_fmt(r[k])}" for k in ("us", "gbps", "frac_ceiling", "rel_err", "mismatches",
                                      "error") if r.get(k) is not None), file=sys.stderr,
          flush=True)
    return r


def _fmt(v: Any) -> str:
  return f"{v:.4g}" if isinstance(v, float) else str(v)[:300]


def _labels() -> dict[str, Any]:
  import jax
  import jaxlib
  commit = os.environ.get("COMMIT")
  if not commit:
    try:
      commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
      commit = "unknown"
  return dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, jaxlib=jaxlib.__version__, commit=commit, dry_run=dry_run())


# ---- inputs ------------------------------------------------------------------------------------

def make_weights(e: int, shape: dict, seed: int, group: int = 32):
  """(gate, up, down) Int4Weight [E, K, N]: random bits for the nibbles, scales ~1/sqrt(K)."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.quant import Int4Weight

  def one(key, k: int, n: int):
    kp, ks = jax.random.split(key)
    packed = jax.random.bits(kp, (e, n, k // 2), jnp.uint8)
    scale = (0.5 + jax.random.uniform(ks, (e, k // group, n))) / (4.6 * k ** 0.5)
    return packed, scale.astype(jnp.bfloat16)

  h, i = shape["hidden"], shape["inter"]
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(Int4Weight(*jax.jit(one, static_argnums=(1, 2))(kk, k, n))
               for kk, (k, n) in zip(keys, ((h, i), (h, i), (i, h))))


def routings(t: int, shape: dict, seed: int):
  """ROTATIONS inputs (x, weights, ids) routed over all experts as Kimi does (top-k of sigmoid
  scores, normalised, scaled)."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def one(key):
    kx, kl = jax.random.split(key)
    x = jax.random.normal(kx, (t, shape["hidden"]), jnp.bfloat16)
    scores = jax.nn.sigmoid(jax.random.normal(kl, (t, shape["experts"]), jnp.float32))
    w, ids = jax.lax.top_k(scores, shape["top_k"])
    return x, w / jnp.sum(w, -1, keepdims=True) * 2.827, ids.astype(jnp.int32)
  return [one(k) for k in jax.random.split(jax.random.key(seed), ROTATIONS)]


def rel_err(got, want) -> float:
  import numpy as np
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if not np.isfinite(got).all():
    return float("inf")
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


# ---- time ----------------------------------------------------------------------------------------

def kernel_times(fn, args) -> list[tuple[str, float]] | None:
  """[(kernel name, us)] of one call of fn(*args) (CUPTI), None off a GPU."""
  import jax
  if jax.default_backend() != "gpu":
    return None
  from jax.experimental.mosaic.gpu import profiler
  _, t = profiler.measure(fn, aggregate=False)(*args)
  return [(name, ms * 1e3) for name, ms in (t or [])]


def time_moe(fn, rots, ws, samples: int) -> dict[str, Any]:
  """The MoE call on `samples` routings in turn: median us of the Mosaic kernels (CUPTI) and
  each of the two (gate_up first), median wall time per call, the other kernels."""
  import jax
  jax.block_until_ready(fn(*rots[0], *ws))
  mosaic, first, second, other = [], [], [], []
  for i in range(samples):
    ks = kernel_times(fn, (*rots[i % len(rots)], *ws))
    if ks is None:
      break
    m = [us for name, us in ks if "mosaic" in name.lower()]
    if len(m) == 2:
      first.append(m[0])
      second.append(m[1])
    mosaic.append(sum(m))
    other.append(sum(us for name, us in ks if "mosaic" not in name.lower()))
  t0 = time.perf_counter()
  reps = 3 if dry_run() else 20
  for i in range(reps):
    out = fn(*rots[i % len(rots)], *ws)
  jax.block_until_ready(out)
  call_us = (time.perf_counter() - t0) / reps * 1e6
  med = lambda v: statistics.median(v) if v else None
  return dict(us=med(mosaic) or call_us, gate_up_us=med(first), down_us=med(second),
              other_kernels_us=med(other), call_us=call_us,
              timed_by="cupti" if mosaic else "wall")


def ceilings(rec: Recorder, out_dir: str) -> None:
  """This run's copy and read rates: the protocol's `ceilings` rows if present, else measured."""
  path = os.path.join(out_dir, "results.jsonl")
  if os.path.exists(path):
    for line in open(path):
      try:
        r = json.loads(line)
      except ValueError:
        continue
      if r.get("stage") == "ceilings" and r.get("impl") in ("xla_copy", "xla_read") and \
          r.get("gbps"):
        rec.ceil["copy_gbps" if r["impl"] == "xla_copy" else "read_gbps"] = r["gbps"]
  if len(rec.ceil) == 2:
    return
  import jax
  import jax.numpy as jnp
  n = (1 << 20) if dry_run() else (1 << 30)  # bf16 elements: 2 GiB on the GPU
  x = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.bfloat16))(jax.random.key(0))
  for name, f, nbytes in (("xla_copy", jax.jit(lambda v: v + 1), 2 * x.nbytes),
                          ("xla_read", jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)),
                           x.nbytes)):
    jax.block_until_ready(f(x))
    ks = [kernel_times(f, (x,)) for _ in range(5)]
    us = statistics.median(sum(t for _, t in k) for k in ks) if ks[0] else None
    if us is None:
      t0 = time.perf_counter()
      for _ in range(5):
        y = f(x)
      jax.block_until_ready(y)
      us = (time.perf_counter() - t0) / 5 * 1e6
    r = rec.row("int4_ceilings", name, f"{x.nbytes / 2**30:.3g} GiB bf16", us=us, bytes=nbytes)
    rec.ceil["copy_gbps" if name == "xla_copy" else "read_gbps"] = r["gbps"]
  del x


# ---- 1. correctness ------------------------------------------------------------------------------

def check_plan(rec: Recorder) -> dict[str, bool]:
  """One-hot activations through one kernel call: outputs = dequantized weights, bitwise.
  {a_operand: every case bitwise}."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.moe import w4a16_layout, w4a16_mgpu
  from pallas_kernels.quant import dequantize
  ok: dict[str, bool] = {}
  for a_operand, group in (("registers", 32), ("registers", 128), ("smem", 32)):
    k, n, nt = 512, 256, 8
    w = make_weights(3, dict(hidden=k, inter=n), seed=group, group=group)[0]
    rng = np.random.default_rng(0)
    rows = np.stack([rng.permutation(k)[:nt] for _ in range(2)])
    xs = jnp.asarray(np.eye(k)[rows.reshape(-1)], jnp.bfloat16)
    slot_expert = jnp.asarray([2, 0], jnp.int32)
    cfg = w4a16_mgpu.W4A16Config(a_operand=a_operand, num_sms=4)
    case = f"one-hot K={k} N={n} group={group}"
    try:
      with _runnable():
        got = jax.jit(lambda x, se, s, w: w4a16_mgpu.expert_matmul(
            w4a16_layout.permute_k(x), (w,), se, s, nt, cfg, final=True))(
                xs, slot_expert, jnp.asarray([2, 1], jnp.int32), w)
      want = np.asarray(dequantize(w, jnp.bfloat16), np.float32)[
          np.asarray(slot_expert)[:, None], rows].transpose(0, 2, 1)
      got = np.asarray(got, np.float32)
      bad = int(np.sum(got != want))
      rec.row("int4_check", f"plan {a_operand}", case, mismatches=bad, bitwise=bad == 0,
              max_abs_diff=float(np.max(np.abs(got - want))))
      ok[a_operand] = ok.get(a_operand, True) and bad == 0
    except Exception as e:  # a failure here is the finding; the sweep still runs
      rec.row("int4_check", f"plan {a_operand}", case, error=f"{type(e).__name__}: {e}"[:800])
      ok[a_operand] = False
  return ok


def moe_call(cfg=None):
  import jax
  from pallas_kernels.moe import int4_mlp_mgpu, moe_mgpu
  if cfg is None:  # the engine's path
    kw = dict(num_sms=4) if dry_run() else {}
    return jax.jit(lambda x, w, ids, *ws: moe_mgpu.moe_experts(x, w, ids, *ws, **kw))
  return jax.jit(lambda x, w, ids, *ws: int4_mlp_mgpu.moe_experts_int4(x, w, ids, *ws, cfg=cfg))


# ---- 3. the sweep --------------------------------------------------------------------------------

def sweep(real: bool) -> list[dict[str, Any]]:
  """Configurations tried at 384 experts x 1 token besides the default (W4A16Config()): the
  A operand through SMEM, MMAs waited per chunk, ring depth, K step, forced K splits, the split
  model's unit cost."""
  if not real:
    return [dict(a_operand="smem", max_stages=2)]
  return [dict(a_operand="smem"), dict(mma_depth=1), dict(max_stages=2), dict(max_stages=3),
          dict(max_stages=4), dict(block_k=128), dict(splits=1), dict(splits=2),
          dict(splits=4), dict(split_overhead=0.0), dict(split_overhead=3.0)]


SWEEP_T8 = [dict(splits=1), dict(a_operand="smem")]  # also tried at 8 tokens


def _name(changes: dict[str, Any]) -> str:
  return "w4a16 " + (",".join(f"{k}={v}" for k, v in changes.items()) or "default")


def measure(rec: Recorder, e: int, t: int, ws, shape: dict, changes=None, baseline=None,
            reference: bool = False):
  import jax
  import numpy as np
  from pallas_kernels.moe import int4_mlp_mgpu, reference as ref
  rots = routings(t, shape, seed=t)
  hit = float(np.mean([len(np.unique(np.asarray(r[2])[np.asarray(r[2]) < e])) for r in rots]))
  per_expert = 3 * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT
  case = f"int4 E={e} T={t}"
  row = dict(tokens=t, local_experts=e, experts_hit=hit, bytes=int(hit * per_expert))
  cfg = int4_mlp_mgpu.Int4Config(**{**({"num_sms": 4} if dry_run() else {}), **(changes or {})})
  f = moe_call(cfg)
  try:
    with _runnable():
      out = jax.block_until_ready(f(*rots[0], *ws))
      timed = time_moe(f, rots, ws, samples=1 if dry_run() else 3 * ROTATIONS)
  except Exception as err:  # a configuration the kernel refuses is a result too
    rec.row("int4", _name(changes or {}), case, **row, error=f"{type(err).__name__}: {err}"[:800])
    return None
  if baseline is not None:
    row["rel_err_vs_default"] = rel_err(out, baseline)
  if reference:
    want = jax.jit(ref.moe_experts)(*rots[0], *ws)
    row["rel_err"] = rel_err(out, want)
    row["reference_ok"] = row["rel_err"] <= 2e-2
  if timed.get("gate_up_us"):
    row["gate_up_gbps"] = hit * 2 * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT \
        / timed["gate_up_us"] / 1e3
    row["down_gbps"] = hit * shape["hidden"] * shape["inter"] * BYTES_PER_WEIGHT \
        / timed["down_us"] / 1e3
  rec.row("int4", _name(changes or {}), case, **row, **timed)
  return out


def export_rows(rec: Recorder) -> None:
  """Dry run: each GPU program of the sweep lowered for CUDA at K2.5 shapes."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.moe import int4_mlp_mgpu
  from pallas_kernels.quant import Int4Weight
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  from cuda_export import MOSAIC_CALL, export_cuda_calls
  s = jax.ShapeDtypeStruct
  h, i, k = K25["hidden"], K25["inter"], K25["top_k"]
  spec = lambda e, kk, n: Int4Weight(s((e, n, kk // 2), jnp.uint8),
                                     s((e, kk // 32, n), jnp.bfloat16))
  programs = [(384, 1, c) for c in [{}] + sweep(real=True)] + [
      (384, 8, {}), (384, 64, {}), (48, 1, {}), (48, 8, {})]
  for e, t, changes in programs:
    t0 = time.perf_counter()
    try:
      calls = export_cuda_calls(moe_call(int4_mlp_mgpu.Int4Config(**changes)),
                                s((t, h), jnp.bfloat16), s((t, k), jnp.float32),
                                s((t, k), jnp.int32), spec(e, h, i), spec(e, h, i),
                                spec(e, i, h))
      rec.row("int4", "cuda_export", f"{_name(changes)} E={e} T={t}",
              mosaic_calls=calls.count(MOSAIC_CALL), export_s=time.perf_counter() - t0)
    except Exception as err:
      rec.row("int4", "cuda_export", f"{_name(changes)} E={e} T={t}",
              error=f"{type(err).__name__}: {err}"[:800])


# ---- 4. SASS -------------------------------------------------------------------------------------

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]*)?[\s;]")
FAMILIES = {"mma": ("HGMMA", "HMMA"), "smem_load": ("LDS", "LDSM"), "smem_store": ("STS",),
            "bit_ops": ("LOP3", "PRMT", "SEL", "SHF", "IMAD", "IADD3"),
            "bf16x2_math": ("HMUL2", "HFMA2", "HADD2"), "shuffle": ("SHFL",),
            "barrier": ("BAR", "SYNCS", "WARPSYNC"), "tma": ("UTMALDG", "UTMASTG")}


def sass_rows(rec: Recorder, path: str) -> None:
  """Per kernel listing in Mosaic GPU's dump: instructions, families, top opcodes, registers;
  ptxas's warnings (a serialised WGMMA shows there)."""
  import collections
  if not os.path.exists(path):
    return
  text = open(path, errors="replace").read()
  warnings = sorted(set(re.findall(r"ptxas[^\n]*(?:warning|Performance)[^\n]*", text)))[:10]
  starts = [m.start() for m in re.finditer(r"\.text\.[\w$.]+", text)] or [0]
  for n, (a, b) in enumerate(zip(starts, starts[1:] + [len(text)])):
    counts = collections.Counter(m.group(1) for m in _INSTR.finditer(text[a:b]))
    if not counts:
      continue
    regs = re.search(r"SHI_REGISTERS=(\d+)", text[a:b])
    rec.row("int4_sass", f"kernel#{n}", instructions=sum(counts.values()),
            families={f: sum(counts[o] for o in ops) for f, ops in FAMILIES.items()},
            top_opcodes=counts.most_common(16), registers=int(regs.group(1)) if regs else None,
            ptxas_warnings=warnings)


# ---- the run -------------------------------------------------------------------------------------

class _Runnable:
  """Nothing on a GPU; Mosaic GPU's interpreter under an abstract H200 on the CPU."""

  def __enter__(self):
    import jax
    if jax.default_backend() == "gpu":
      self.ctx = None
      return
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels.interpret import gpu_interpret_mode
    interpret_pallas_call.gpu_callbacks.reset_gpu_interpret_mode_state()
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", platform="gpu", num_cores=132))
    self.ctx = [jax.sharding.use_abstract_mesh(h200),
                gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan"))]
    for c in self.ctx:
      c.__enter__()

  def __exit__(self, *exc):
    for c in reversed(self.ctx or []):
      c.__exit__(*exc)


_runnable = _Runnable


def run(out_dir: str) -> list[dict[str, Any]]:
  import gc
  import jax
  os.makedirs(out_dir, exist_ok=True)
  rec = Recorder(out_dir, _labels())
  shape = TOY if dry_run() else K25
  t0 = time.perf_counter()
  plan_ok = check_plan(rec)
  # If the register path is wrong on this GPU, time the SMEM-operand path (the same kernel
  # but for the operand's route) rather than nothing.
  default = {} if plan_ok.get("registers") else {"a_operand": "smem"}
  ceilings(rec, out_dir)
  e_all = shape["experts"]
  ws = jax.block_until_ready(make_weights(e_all, shape, seed=1))
  base = measure(rec, e_all, 1, ws, shape, changes=default, reference=True)
  for changes in sweep(real=not dry_run()):
    if changes != default:
      measure(rec, e_all, 1, ws, shape, changes={**default, **changes}, baseline=base)
  for t in ((8, 64) if not dry_run() else ()):
    out = measure(rec, e_all, t, ws, shape, changes=default, reference=True)
    for changes in (SWEEP_T8 if t == 8 else []):
      if changes != default:
        measure(rec, e_all, t, ws, shape, changes={**default, **changes}, baseline=out)
  del ws
  gc.collect()
  shard = e_all // 8
  ws = jax.block_until_ready(make_weights(shard, shape, seed=2))
  for t in ((1, 8) if not dry_run() else (1,)):
    measure(rec, shard, t, ws, shape, changes=default, reference=t == 1)
  if dry_run():
    export_rows(rec)
  rec.row("int4_check", "summary", plan_bitwise=plan_ok, timed=_name(default),
          seconds=time.perf_counter() - t0)
  return rec.rows


def table(rows: list[dict[str, Any]]) -> str:
  """The printed summary (under 10,000 characters)."""
  out = [f"W4A16 ({rows[0].get('device')}, jax {rows[0].get('jax')}, {rows[0].get('commit')})"]
  for r in rows:
    if r["stage"] == "int4_sass":
      out.append(f"sass {r['impl']}: {r.get('instructions')} instr, regs {r.get('registers')},"
                 f" {r.get('families')}")
      continue
    bits = [r["stage"], r["impl"], r.get("case", "")]
    for k in ("us", "gate_up_us", "down_us", "call_us", "gbps", "frac_ceiling", "rel_err",
              "rel_err_vs_default", "mismatches", "mosaic_calls", "error"):
      if r.get(k) is not None:
        bits.append(f"{k}={_fmt(r[k])}")
    out.append(" | ".join(str(b) for b in bits if b != ""))
  return "\n".join(out)[-9500:]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  sass_path = os.path.join(args.out, "int4_sass.txt")
  if not dry_run():  # Mosaic GPU prints SASS / ptxas reports on fd 1 as it compiles
    os.environ.setdefault("MOSAIC_GPU_DUMP_SASS", "1")
    os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(os.open(sass_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
  try:
    rows = run(args.out)
  finally:
    if not dry_run():
      sys.stdout.flush()
      os.dup2(saved, 1)
  if not dry_run():
    rec = Recorder(args.out, {k: rows[0][k] for k in ("device", "backend", "jax", "jaxlib",
                                                      "commit", "dry_run")})
    sass_rows(rec, sass_path)
    rows += rec.rows
    _gzip(sass_path)  # (a few MB of listings: the device tool returns small files only)
  print(table(rows))


def _gzip(path: str) -> None:
  import gzip
  import shutil
  if os.path.exists(path):
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
      shutil.copyfileobj(src, dst)
    os.remove(path)


if __name__ == "__main__":
  main()

