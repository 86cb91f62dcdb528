"""Every Pallas kernel, compiled (not interpreted), against its plain-JAX reference on the GPU.

    python -m bench.kernel_check --out=kernels.json       # on a GPU; exit status 1 on a mismatch

The kernels are reached through the engine's kernel switch (`KernelChoice(...="mosaic_gpu")`),
exactly as the model calls them. Shapes: MLA decode / speculative verify / prefill chunk over a
paged latent cache (shuffled page tables, ragged lengths, Kimi widths 512 + 64), GQA decode and
prefill, MoE experts at decode (1, 8, 64 tokens) and prefill (512) sizes with an expert-parallel
shard, in bf16 and with the experts kept INT4 / FP8 (the W4A16 / W8A16 kernels against the
plain-JAX path on the same quantized experts). bf16 inputs, relative tolerance 2e-2 of the
reference's largest magnitude. Off a GPU it says so and exits 0 without checking (the CPU tests run these kernels in interpret mode).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from engine.model import kernels
from engine.model.kernels import KernelChoice

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "Write JSON here.")
flags.DEFINE_string("name", "mosaic_gpu", "Kernel implementation to check.")
flags.DEFINE_string("results", "", "Also append one row per case to DIR/results.jsonl (the GPU "
                    "protocol's rows, stage kernel_check).")
TOL = 2e-2


def _paged(key, batch, lens, page, width_shape, dtype):
  """Pages [N, page, *width] with a shuffled table giving each row ceil(len / page) pages."""
  need = [-(-l // page) for l in lens]
  max_pages = max(need)
  n = sum(need) + 1
  perm = np.random.default_rng(0).permutation(np.arange(1, n))
  table = np.zeros((batch, max_pages), np.int32)
  i = 0
  for b, k in enumerate(need):
    table[b, :k] = perm[i:i + k]
    i += k
  pages = jax.random.normal(key, (n, page, *width_shape), jnp.float32).astype(dtype)
  return pages, jnp.asarray(table)


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def attention_cases(impl: KernelChoice):
  ref = KernelChoice()
  out = []
  key = jax.random.key(0)
  for heads, lens, q_len in [(64, [1, 700, 4096], 1), (8, [8192], 1), (64, [300, 2049], 4),
                             (16, [1000, 64], 128)]:
    b = len(lens)
    k1, k2, k3, key = jax.random.split(key, 4)
    pages, table = _paged(k1, b, lens, 64, (576,), jnp.bfloat16)
    q_lat = jax.random.normal(k2, (b, q_len, heads, 512), jnp.float32).astype(jnp.bfloat16)
    q_rope = jax.random.normal(k3, (b, q_len, heads, 64), jnp.float32).astype(jnp.bfloat16)
    kv_lens = jnp.asarray(lens, jnp.int32)
    pos = kv_lens[:, None] - q_len + jnp.arange(q_len)[None, :]
    pos = jnp.maximum(pos, 0)
    args = (q_lat, q_rope, pages, table, pos, kv_lens)
    got = jax.jit(lambda *a: kernels.mla_attention(impl)(*a, softmax_scale=0.1))(*args)
    want = jax.jit(lambda *a: kernels.mla_attention(ref)(*a, softmax_scale=0.1))(*args)
    out.append(dict(kernel="mla", heads=heads, lens=lens, q_len=q_len,
                    rel_err=_rel_err(got, want)))
  for lens, q_len in [([1, 3000, 8192], 1), ([500, 1500], 64)]:
    b = len(lens)
    k1, k2, k3, key = jax.random.split(key, 4)
    kp, table = _paged(k1, b, lens, 64, (8, 128), jnp.bfloat16)
    vp = jax.random.normal(k2, kp.shape, jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(k3, (b, q_len, 32, 128), jnp.float32).astype(jnp.bfloat16)
    kv_lens = jnp.asarray(lens, jnp.int32)
    pos = jnp.maximum(kv_lens[:, None] - q_len + jnp.arange(q_len)[None, :], 0)
    args = (q, kp, vp, table, pos, kv_lens)
    got = jax.jit(lambda *a: kernels.gqa_attention(impl)(*a, softmax_scale=0.088))(*args)
    want = jax.jit(lambda *a: kernels.gqa_attention(ref)(*a, softmax_scale=0.088))(*args)
    out.append(dict(kernel="gqa", lens=lens, q_len=q_len, rel_err=_rel_err(got, want)))
  return out


def moe_cases(impl: KernelChoice):
  ref = KernelChoice()
  out = []
  h, inter, e, k = 7168, 2048, 48, 8
  keys = jax.random.split(jax.random.key(1), 6)
  w = [(jax.random.normal(keys[i], s, jnp.float32) * 0.02).astype(jnp.bfloat16)
       for i, s in enumerate([(e, h, inter), (e, h, inter), (e, inter, h)])]
  for tokens in (1, 8, 64, 512):
    x = jax.random.normal(keys[3], (tokens, h), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(keys[4], (tokens, 384), jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.sigmoid(logits), k)
    offset = 96  # the third expert-parallel shard of eight
    f = lambda name: jax.jit(lambda *a: kernels.moe_experts(name)(*a, expert_offset=offset))
    got = f(impl)(x, weights, ids.astype(jnp.int32), *w)
    want = f(ref)(x, weights, ids.astype(jnp.int32), *w)
    out.append(dict(kernel="moe_experts", tokens=tokens, rel_err=_rel_err(got, want)))
  from bench.moe_kernels import _quantized  # the benchmark's INT4 / FP8 experts
  for fmt in ("int4", "fp8"):
    wq = _quantized(fmt, w)
    for tokens in (1, 64, 512):
      x = jax.random.normal(keys[3], (tokens, h), jnp.float32).astype(jnp.bfloat16)
      logits = jax.random.normal(keys[4], (tokens, 384), jnp.float32)
      weights, ids = jax.lax.top_k(jax.nn.sigmoid(logits), k)
      f = lambda name: jax.jit(lambda *a: kernels.moe_experts(name)(*a, expert_offset=96))
      got = f(impl)(x, weights, ids.astype(jnp.int32), *wq)
      want = f(ref)(x, weights, ids.astype(jnp.int32), *wq)
      out.append(dict(kernel=f"moe_experts_{fmt}", tokens=tokens, rel_err=_rel_err(got, want)))
  return out


def main(argv):
  del argv
  if jax.default_backend() != "gpu":
    print("kernel_check: no GPU here; the Mosaic GPU kernels are checked in interpret mode by "
          "the CPU tests. Nothing checked.")
    if FLAGS.results:
      from bench.protocol.rows import Recorder
      Recorder(FLAGS.results, "kernel_check").skip("no GPU: the CPU tests interpret the kernels")
    return 0
  impl = KernelChoice(attention=FLAGS.name, moe=FLAGS.name)
  rows = []
  for fn in (attention_cases, moe_cases):
    try:
      rows += fn(impl)
    except Exception as e:  # a kernel that fails to compile is a result, not a crash
      rows.append(dict(kernel=fn.__name__, error=f"{type(e).__name__}: {e}"[:2000]))
  ok = all("error" not in r and r["rel_err"] <= TOL for r in rows)
  for r in rows:
    status = "ERROR" if "error" in r else ("ok" if r["rel_err"] <= TOL else "MISMATCH")
    detail = r.get("error") or f"rel_err {r['rel_err']:.2e}"
    print(f"{status:8} {json.dumps({k: v for k, v in r.items() if k not in ('error', 'rel_err')})}"
          f"  {detail}")
  if FLAGS.results:
    from bench.protocol import timing
    from bench.protocol.rows import Recorder
    rec = Recorder(FLAGS.results, "kernel_check", **timing.labels())
    for r in rows:
      r = dict(r)
      rec.row(FLAGS.name, r.pop("kernel"), ok="error" not in r and r["rel_err"] <= TOL, **r)
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, tolerance=TOL, ok=ok, rows=rows), fh,
                indent=1)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
