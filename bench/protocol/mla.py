"""Stage `mla`: the Mosaic GPU MLA decode kernel at Kimi K2.5 shapes, with a split sweep.

    python -m bench.protocol.mla OUT

Latent 512 + rope 64 per cached token, bf16, pages of 64 tokens (16 where a row says so);
8 heads per device (tensor:8) and 64 (data-parallel attention). Per case: the attention call
(`mla_paged_attention_mgpu.mla_paged_attention`: the kernel, then the split combine in XLA)
timed by CUPTI (`us`: all its kernels; `kernel_us`: the Mosaic kernel alone) over bytes = every
cached token's 576 values once plus queries and outputs, so GB/s and the fractions of this
run's ceilings. Cases: batch 1 at 4k / 32k / 128k, batch 64 at 4k / 16k, 64 heads at batch 64,
speculative verify blocks (T = 4), the split sweep at batch 1 / 4k (the default against 32,
64 and 132 splits of at least 64 tokens), and pages of 16 tokens (the serving default) against
64 at the same shape. A case reading less than twice the L2 takes a different set of pages
each timed iteration. Two cases are checked against the XLA reference. Dry run: toy shapes in
the interpreter, the GPU cases lowered for CUDA.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.protocol import timing
from bench.protocol.rows import Recorder, dry_run
from pallas_kernels.attention import mla_paged_attention_mgpu as mla
from pallas_kernels.attention import reference

L2_BYTES = 60 << 20


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  context: int
  heads: int
  q_len: int = 1
  page: int = 64
  splits: int | None = None  # None: the kernel's default
  min_tokens_per_split: int = 512
  check: bool = False  # against the XLA reference
  dc: int = 512
  dr: int = 64

  @property
  def name(self) -> str:
    s = f"B={self.batch} ctx={self.context} h={self.heads} T={self.q_len} page={self.page}"
    if self.splits is not None:
      s += f" splits={self.splits} min={self.min_tokens_per_split}"
    return s

  def kv_bytes(self) -> int:
    return self.batch * self.context * (self.dc + self.dr) * 2

  def bytes(self) -> int:
    q_out = self.batch * self.q_len * self.heads * (2 * self.dc + self.dr) * 2
    return self.kv_bytes() + q_out


def gpu_cases() -> list[Case]:
  c = Case
  sweep = [c(1, 4096, 8, splits=s, min_tokens_per_split=64) for s in (32, 64, 132)]
  return [c(1, 4096, 8, check=True), c(1, 32768, 8), c(1, 131072, 8), c(64, 4096, 8),
          c(64, 16384, 8), c(64, 4096, 64), c(32, 8192, 8, q_len=4),
          c(8, 8192, 64, q_len=4, check=True), *sweep, c(64, 4096, 8, page=16),
          c(1, 4096, 8, page=16)]


def toy_cases() -> list[Case]:
  c = lambda *a, **k: Case(*a, dc=64, dr=32, **k)
  return timing.first([c(1, 200, 8, page=32, check=True), c(2, 150, 8, q_len=4, page=32),
                       c(1, 200, 8, page=32, splits=4, min_tokens_per_split=32),
                       c(1, 200, 8, page=16)])


def rotations(case: Case) -> int:
  return 1 if dry_run() else max(1, min(8, math.ceil(2 * L2_BYTES / case.kv_bytes())))


def pages_needed(case: Case) -> int:
  return case.batch * -(-case.context // case.page)


def tables(case: Case, pool_pages: int, seed: int) -> list[jax.Array]:
  """One shuffled page table per rotation, each over pages no other rotation uses."""
  need = -(-case.context // case.page)
  perm = np.random.default_rng(seed).permutation(pool_pages)
  out = []
  for r in range(rotations(case)):
    chunk = perm[r * case.batch * need:(r + 1) * case.batch * need]
    out.append(jnp.asarray(chunk.reshape(case.batch, need), jnp.int32))
  return out


def attention(case: Case):
  kw = dict(softmax_scale=(case.dc + case.dr) ** -0.5,
            min_tokens_per_split=case.min_tokens_per_split)
  if case.splits is not None:
    kw["num_splits"] = case.splits
  fn = lambda *a: mla.mla_paged_attention(*a, **kw)
  return fn if dry_run() else jax.jit(fn)


def inputs(case: Case, key) -> tuple[jax.Array, ...]:
  kq, kr = jax.random.split(key)
  shape = (case.batch, case.q_len, case.heads)
  q_lat = timing.random_array(kq, shape + (case.dc,), jnp.bfloat16)
  q_rope = timing.random_array(kr, shape + (case.dr,), jnp.bfloat16)
  kv_lens = jnp.full((case.batch,), case.context, jnp.int32)
  pos = kv_lens[:, None] - case.q_len + jnp.arange(case.q_len, dtype=jnp.int32)[None]
  return q_lat, q_rope, pos, kv_lens


def measure(rec: Recorder, case: Case, pools: dict[int, jax.Array], key) -> None:
  pool = pools[case.page]
  q_lat, q_rope, pos, kv_lens = inputs(case, key)
  tabs = tables(case, pool.shape[0], seed=case.batch + case.context)
  fn = attention(case)
  run = lambda i: fn(q_lat, q_rope, pool, tabs[i % len(tabs)], pos, kv_lens)
  row = dict(batch=case.batch, context=case.context, heads=case.heads, q_len=case.q_len,
             page=case.page, splits=case.splits, rotations=len(tabs), bytes=case.bytes())
  try:
    with timing.kernels_runnable():
      t0 = time.perf_counter()
      out = jax.block_until_ready(run(0))
      if dry_run():
        timed = dict(us=(time.perf_counter() - t0) * 1e6)
      else:
        per_iter = timing.kernel_times(run, 20)
        timed = dict(wall_us=timing.wall_us(run, 5, 5))
        if per_iter:
          all_k = timing.summarize_kernels(per_iter)
          mosaic = timing.summarize_kernels(per_iter, lambda n: "mosaic" in n.lower())
          timed.update(us=all_k["kernel_us"], kernel_us=mosaic.get("kernel_us"),
                       kernels=all_k["kernels"][:6])
        else:
          timed["us"] = timed["wall_us"]
  except Exception as err:
    rec.row("mosaic_gpu", case.name, **row, error=f"{type(err).__name__}: {err}"[:600])
    return
  if case.check:
    ref = jax.jit(lambda *a: reference.mla_paged_attention(
        *a, softmax_scale=(case.dc + case.dr) ** -0.5))
    args = (q_lat, q_rope, pool, tabs[0], pos, kv_lens)
    row["rel_err_vs_reference"] = timing.rel_err(out, ref(*args))
    if not dry_run():
      rec.row("xla_reference", case.name, **row, us=timing.wall_us(lambda i: ref(*args), 3, 3))
  rec.row("mosaic_gpu", case.name, **row, **timed)


def export_rows(rec: Recorder) -> None:
  """Dry run: each GPU case's attention call lowered for CUDA at its real shape."""
  s = jax.ShapeDtypeStruct
  for case in timing.first(gpu_cases()):
    need = -(-case.context // case.page)
    shape = (case.batch, case.q_len, case.heads)
    found = timing.cuda_export(
        jax.jit(attention(case)) if dry_run() else attention(case),
        s(shape + (case.dc,), jnp.bfloat16), s(shape + (case.dr,), jnp.bfloat16),
        s((case.batch * need + 1, case.page, case.dc + case.dr), jnp.bfloat16),
        s((case.batch, need), jnp.int32), s((case.batch, case.q_len), jnp.int32),
        s((case.batch,), jnp.int32))
    rec.row("cuda_export", case.name, **found)


def run(out_dir: str) -> None:
  rec = Recorder(out_dir, "mla", **timing.labels())
  cases = toy_cases() if dry_run() else gpu_cases()
  width = cases[0].dc + cases[0].dr
  # One pool of 64-token (toy: 32) pages for every case, the 16-token cases viewing it finer.
  base = max(c.page for c in cases)
  tokens = max(pages_needed(c) * c.page * rotations(c) for c in cases) + base
  pool = timing.random_array(jax.random.key(7), (tokens // base + 1, base, width), jnp.bfloat16)
  pools = {p: pool if p == base else pool.reshape(-1, p, width)
           for p in sorted({c.page for c in cases})}
  rec.row("pool", f"{pool.shape}", bytes=int(pool.nbytes))
  for case, key in zip(cases, timing.keys(3, len(cases))):
    measure(rec, case, pools, key)
  if dry_run():
    export_rows(rec)


if __name__ == "__main__":
  run(sys.argv[1])
