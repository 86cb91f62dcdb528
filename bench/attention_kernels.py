"""Benchmarks the paged attention kernels against the XLA reference at Kimi-K2.5 shapes.

    python -m bench.attention_kernels --out attention.json

On a GPU, per kernel and shape: time, achieved GB/s (bytes the attention must read: the KV
tokens of every sequence plus queries and outputs) and that as a fraction of the device-to-device
copy bandwidth measured in the same run, beside the XLA reference. Shapes: MLA with 64 heads per
device (or 8 with tensor parallelism), latent 512 + rope 64, page 64; GQA 32 query / 8 KV heads,
D 128; contexts 1k-128k; batch 1-128; decode (T=1), speculative verify (T=4), a prefill chunk.

Without a GPU it runs the reference only, on small shapes, and says so: those numbers describe
the CPU, not the kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import gqa_paged_attention_mgpu, mla_paged_attention_mgpu, reference

PAGE = 64


@dataclasses.dataclass(frozen=True)
class Case:
  kernel: str  # "mla" or "gqa"
  batch: int
  context: int  # cached tokens per sequence (including the new ones)
  q_len: int
  heads: int
  kv_heads: int = 1
  head_dim: int = 128  # GQA
  latent: int = 512  # MLA
  rope: int = 64  # MLA


def gpu_cases() -> list[Case]:
  cases = []
  for heads in (64, 8):
    for batch, context in [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 8192),
                           (32, 8192), (128, 1024), (128, 8192), (8, 131072)]:
      cases.append(Case("mla", batch, context, 1, heads))
    cases.append(Case("mla", 32, 8192, 4, heads))  # speculative verify, 3 drafts
    cases.append(Case("mla", 2, 8192, 256, heads))  # prefill chunk over a cached prefix
  for batch, context in [(1, 8192), (1, 131072), (32, 8192), (128, 8192)]:
    cases.append(Case("gqa", batch, context, 1, 32, 8))
  cases.append(Case("gqa", 2, 8192, 256, 32, 8))
  return cases


def cpu_cases() -> list[Case]:
  return [Case("mla", 2, 256, 1, 8), Case("mla", 1, 512, 4, 8),
          Case("gqa", 2, 256, 1, 8, 2, 64)]


def make_inputs(case: Case, dtype=jnp.bfloat16, seed: int = 0):
  """Random inputs with a shuffled page table, every sequence `context` tokens long."""
  pages_per_seq = -(-case.context // PAGE)
  num_pages = case.batch * pages_per_seq
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.permutation(num_pages).reshape(case.batch, pages_per_seq), jnp.int32)
  kv_lens = jnp.full((case.batch,), case.context, jnp.int32)
  q_pos = kv_lens[:, None] - case.q_len + jnp.arange(case.q_len, dtype=jnp.int32)[None]
  keys = jax.random.split(jax.random.key(seed), 3)
  b, t, h = case.batch, case.q_len, case.heads
  if case.kernel == "mla":
    q_latent = jax.random.normal(keys[0], (b, t, h, case.latent), dtype)
    q_rope = jax.random.normal(keys[1], (b, t, h, case.rope), dtype)
    pages = jax.random.normal(keys[2], (num_pages, PAGE, case.latent + case.rope), dtype)
    return (q_latent, q_rope, pages, table, q_pos, kv_lens)
  q = jax.random.normal(keys[0], (b, t, h, case.head_dim), dtype)
  kv_shape = (num_pages, PAGE, case.kv_heads, case.head_dim)
  return (q, jax.random.normal(keys[1], kv_shape, dtype), jax.random.normal(keys[2], kv_shape, dtype),
          table, q_pos, kv_lens)


def bytes_moved(case: Case, itemsize: int = 2) -> int:
  """HBM bytes the attention cannot avoid: every cached token once, queries, outputs."""
  tokens = case.batch * case.context
  if case.kernel == "mla":
    kv = tokens * (case.latent + case.rope)
    q_out = case.batch * case.q_len * case.heads * (2 * case.latent + case.rope)
  else:
    kv = tokens * 2 * case.kv_heads * case.head_dim
    q_out = case.batch * case.q_len * case.heads * 2 * case.head_dim
  return (kv + q_out) * itemsize


def flops(case: Case) -> int:
  """Matmul FLOPs with causal masking ignored (the new tokens are a small part of the context)."""
  rows = case.batch * case.q_len * case.heads
  if case.kernel == "mla":
    return 2 * rows * case.context * (case.latent + case.rope + case.latent)
  return 2 * rows * case.context * 2 * case.head_dim


def time_fn(fn, args, iters: int) -> float:
  """Median seconds per call of a jitted fn (compiled and warmed up first).

  On a GPU: the summed time of the call's kernels (CUPTI, `mosaic.gpu.profiler.measure`), so
  launch overhead does not swamp microsecond kernels; elsewhere wall clock.
  """
  out = fn(*args)
  jax.block_until_ready(out)
  if jax.default_backend() == "gpu":
    from jax.experimental.mosaic.gpu import profiler
    _, ms = profiler.measure(fn, iterations=iters)(*args)
    if ms:
      return statistics.median(ms) / 1e3
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def copy_bandwidth(num_bytes: int, iters: int) -> float:
  """Device-to-device copy bandwidth in GB/s (a read and a write of every byte)."""
  x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
  copy = jax.jit(lambda v: -v)  # a real elementwise pass; XLA cannot elide it
  return 2 * x.nbytes / time_fn(copy, (x,), iters) / 1e9


def implementations(case: Case, on_gpu: bool):
  scale = (case.latent + case.rope) ** -0.5 if case.kernel == "mla" else case.head_dim ** -0.5
  ref = reference.mla_paged_attention if case.kernel == "mla" else reference.gqa_paged_attention
  impls = {"xla_reference": jax.jit(lambda *a: ref(*a, softmax_scale=scale))}
  if on_gpu:
    kern = (mla_paged_attention_mgpu.mla_paged_attention if case.kernel == "mla"
            else gqa_paged_attention_mgpu.gqa_paged_attention)
    impls["mosaic_gpu"] = jax.jit(lambda *a: kern(*a, softmax_scale=scale))
  return impls


def run(cases: list[Case], on_gpu: bool, iters: int, copy_bytes: int,
        max_reference_tokens: int, report=lambda result: None) -> dict:
  """The benchmark; `report(result)` after each row (a run stopped at its time limit keeps what
  it measured)."""
  copy_gbps = copy_bandwidth(copy_bytes, iters)
  result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                copy_gbps=copy_gbps, rows=[])
  for case in cases:
    args = make_inputs(case)
    for impl, fn in implementations(case, on_gpu).items():
      row = dict(dataclasses.asdict(case), impl=impl)
      # The reference gathers every sequence's pages in float32: skip what would not fit.
      if impl == "xla_reference" and case.batch * case.context > max_reference_tokens:
        row["skipped"] = f"over {max_reference_tokens} tokens for the gathering reference"
      else:
        try:
          seconds = time_fn(fn, args, iters)
        except Exception as e:  # a failed shape is a result to report, not a reason to stop
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:
          gbps = bytes_moved(case) / seconds / 1e9
          row.update(time_us=seconds * 1e6, gbps=gbps, frac_copy=gbps / copy_gbps,
                     tflops=flops(case) / seconds / 1e12)
      result["rows"].append(row)
      report(result)
    del args
  return result


def format_header(result: dict) -> str:
  return (f"device: {result['device']} ({result['backend']}); "
          f"copy bandwidth {result['copy_gbps']:.0f} GB/s\n"
          f"{'kernel':6} {'impl':14} {'B':>4} {'ctx':>7} {'T':>4} {'heads':>5} "
          f"{'time_us':>10} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8}")


def format_row(r: dict) -> str:
  head = (f"{r['kernel']:6} {r['impl']:14} {r['batch']:>4} {r['context']:>7} {r['q_len']:>4} "
          f"{r['heads']:>5} ")
  if "time_us" in r:
    return head + (f"{r['time_us']:>10.1f} {r['gbps']:>8.1f} {100 * r['frac_copy']:>5.1f}% "
                   f"{r['tflops']:>8.2f}")
  return head + (r.get("skipped") or r.get("error"))


def format_table(result: dict) -> str:
  return "\n".join([format_header(result), *map(format_row, result["rows"])])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="where to write the JSON results")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--copy_mib", type=int, default=2048,
                      help="size of the copy that measures bandwidth (GPU)")
  parser.add_argument("--max_reference_tokens", type=int, default=1 << 20)
  args = parser.parse_args(argv)

  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:
    cases, copy_bytes, iters = gpu_cases(), args.copy_mib << 20, args.iters
    note = "GPU: Mosaic GPU kernels and the XLA reference"
  else:
    cases, copy_bytes, iters = cpu_cases(), 64 << 20, min(args.iters, 3)
    note = ("NO GPU: only the XLA reference ran, on small shapes; the Mosaic GPU kernels need an "
            "NVIDIA Hopper GPU. These numbers describe this CPU, not the kernels.")
  print(note, flush=True)
  def report(result):  # the JSON kept current, each row printed as it is measured
    with open(args.out, "w") as f:
      json.dump(dict(result, note=note), f, indent=1)
    if len(result["rows"]) == 1:
      print(format_header(result), flush=True)
    print(format_row(result["rows"][-1]), flush=True)
  result = run(cases, on_gpu, iters, copy_bytes, args.max_reference_tokens, report)
  result["note"] = note
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
