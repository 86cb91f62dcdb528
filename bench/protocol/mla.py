"""Stage `mla`: the Mosaic GPU MLA decode kernels at Kimi K2.5 shapes: correctness first, then
the split sweep, then times over batch x context x heads x T, then the flash kernel's baseline
and pages of 16 against 64.

    python -m bench.protocol.mla OUT

Latent 512 + rope 64 per cached token, bf16; 8 heads per device (tensor:8) and 64
(data-parallel attention); decode (T = 1) and verify blocks (T = 4). Rows, in this order (a
stage cut at its time limit keeps what it measured, so the order is the priority):

1. `check`: the split-KV decode kernel (`kernel="decode"`: `mla_decode_mgpu` + its combine)
   against the XLA reference on ragged batches (lengths 1, 64, 700, 4k, 8k), 8 and 64 heads,
   T = 1 and 4, pages of 16 and 64, float32 and bf16 partials: `rel_err_vs_reference` and
   `ok` (within 2e-2 of the reference's largest value).
2. `sweep`: the split policy measured, not guessed: at batch 1 / 4k the minimum KV blocks per
   part (1, 2, 4, 8: 64 down to 8 parts) and the combine's columns per CUDA block (32, 64,
   128; also at batch 64); at batch 1 / 32k the parts (66, 132, 264) and bf16
   partials; on a ragged batch of 64 (512 and 8k alternating) the per-segment overhead (0, 2,
   5 blocks); at 64 heads / 64k bf16 partials (132 x 128 KiB of float32 partials otherwise);
   at 64 heads / 32k the combine's 64-row groups (its default at batch 1 is 8: 8x the CUDA
   blocks, 8 slots per tile) and 4 or 8 blocks per part (fewer, larger partials).
3. `grid`: the decode kernel at defaults: 8 heads, batch 1 / 8 / 64 x 4k / 8k / 32k / 64k; 8
   heads verify (T = 4) at batch 1 / 8 / 64 x 4k / 32k; 64 heads decode at batch 1 / 8 / 64 x
   4k / 32k and verify at batch 1 / 8 x 4k / 32k (the cases of BENCHMARKS' issue 53 prediction).
4. `baseline`: the flash kernel (`kernel="flash"`, the kernel before issue 53) at four of them.
5. `page`: pages of 16 tokens (the serving default) against the grid's 64.

Times by CUPTI. `us` is what one layer's attention costs in a model step: the decode path's
two Mosaic kernels (its schedule, a function of the step's lengths, is computed once per step
for all layers: XLA keeps one copy), or all of the flash path's kernels (its split combine runs
per layer in XLA); `call_us` all kernels of the standalone call; `kernels` the per-kernel
breakdown. Bytes = every cached token's 576 values once plus queries and outputs, so GB/s and
the fractions of this run's ceilings. A case reading less than twice the L2 takes a different
set of pages each timed iteration. Dry run: toy shapes (latent 128 + rope 64) in the
interpreter, each distinct GPU configuration lowered for CUDA at its real shape.
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
TOL = 2e-2
K, M = 1024, 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  context: int  # every sequence's length, or the longest of `lens`
  heads: int
  q_len: int = 1
  page: int = 64
  group: str = "grid"  # check / sweep / grid / baseline / page
  kernel: str = "decode"  # "decode" (split-KV) or "flash"
  lens: tuple[int, ...] | None = None  # a ragged batch (batch = len(lens))
  parts: int | None = None  # decode: parts per query block (None: SMs / query blocks)
  min_blocks: int = 1
  overhead: int | None = None  # decode: blocks charged per segment (None: the default)
  partials: str = "f32"
  combine_chunk: int | None = None  # decode: the combine's columns per CUDA block
  combine_rows: int | None = None  # decode: the combine's rows per CUDA block
  check: bool = False  # against the XLA reference
  dc: int = 512
  dr: int = 64

  @property
  def lengths(self) -> tuple[int, ...]:
    return self.lens if self.lens is not None else (self.context,) * self.batch

  @property
  def name(self) -> str:
    ctx = (f"lens={'/'.join(map(str, sorted(set(self.lens))))}" if self.lens is not None
           else f"ctx={self.context}")
    s = f"{self.kernel} B={self.batch} {ctx} h={self.heads} T={self.q_len} page={self.page}"
    if self.parts is not None:
      s += f" parts={self.parts}"
    if self.min_blocks != 1:
      s += f" min_blocks={self.min_blocks}"
    if self.overhead is not None:
      s += f" overhead={self.overhead}"
    if self.partials != "f32":
      s += f" partials={self.partials}"
    if self.combine_chunk is not None:
      s += f" combine_chunk={self.combine_chunk}"
    if self.combine_rows is not None:
      s += f" combine_rows={self.combine_rows}"
    return s

  def kv_bytes(self) -> int:
    return sum(self.lengths) * (self.dc + self.dr) * 2

  def bytes(self) -> int:
    q_out = self.batch * self.q_len * self.heads * (2 * self.dc + self.dr) * 2
    return self.kv_bytes() + q_out

  def kwargs(self) -> dict:
    kw = dict(softmax_scale=(self.dc + self.dr) ** -0.5, kernel=self.kernel)
    if self.kernel == "decode":
      kw.update(min_blocks_per_part=self.min_blocks,
                partial_dtype=jnp.float32 if self.partials == "f32" else jnp.bfloat16)
      if self.parts is not None:
        kw["num_parts"] = self.parts
      if self.overhead is not None:
        kw["overhead_blocks"] = self.overhead
      if self.combine_chunk is not None:
        kw["combine_chunk"] = self.combine_chunk
      if self.combine_rows is not None:
        kw["combine_rows"] = self.combine_rows
    return kw

  def lowering_key(self) -> tuple:
    """What decides whether a configuration lowers (not the lengths)."""
    return (self.kernel, self.heads, self.q_len, self.page, self.partials, self.combine_chunk,
            self.combine_rows, self.dc, self.dr)


def gpu_cases() -> list[Case]:
  c = Case
  h8, h64 = 8, 64
  ragged = tuple([512, 8192] * 32)
  checks = [c(4, 4096, h8, page=16, lens=(1, 64, 700, 4096), group="check", check=True),
            c(2, 8192, h8, q_len=4, lens=(130, 8192), partials="bf16", group="check",
              check=True),
            c(3, 4096, h64, lens=(1, 2049, 4096), group="check", check=True),
            c(2, 4096, h64, q_len=4, page=16, lens=(300, 4096), group="check", check=True)]
  sweep = ([c(1, 4 * K, h8, min_blocks=n, group="sweep") for n in (2, 4, 8)]
           + [c(1, 4 * K, h8, combine_chunk=n, group="sweep") for n in (32, 128)]
           + [c(64, 4 * K, h8, combine_chunk=128, group="sweep")]
           + [c(1, 32 * K, h8, parts=p, group="sweep") for p in (66, 264)]
           + [c(1, 32 * K, h8, partials="bf16", group="sweep")]
           + [c(64, 8192, h8, lens=ragged, overhead=o, group="sweep") for o in (0, 2, 5)]
           + [c(1, 64 * K, h64, partials="bf16", group="sweep")]
           + [c(1, 32 * K, h64, combine_rows=64, group="sweep")]
           + [c(1, 32 * K, h64, min_blocks=n, group="sweep") for n in (4, 8)])
  grid = ([c(b, n * K, h8) for b in (1, 8, 64) for n in (4, 8, 32, 64)]
          + [c(b, n * K, h8, q_len=4) for b in (1, 8, 64) for n in (4, 32)]
          + [c(b, n * K, h64) for b in (1, 8, 64) for n in (4, 32)]
          + [c(b, n * K, h64, q_len=4) for b in (1, 8) for n in (4, 32)])
  baseline = [c(1, 4 * K, h8, kernel="flash", group="baseline"),
              c(1, 32 * K, h8, kernel="flash", group="baseline"),
              c(64, 4 * K, h8, kernel="flash", group="baseline"),
              c(8, 8 * K, h64, q_len=4, kernel="flash", group="baseline")]
  page = [c(1, 4 * K, h8, page=16, group="page"), c(64, 4 * K, h8, page=16, group="page"),
          c(1, 32 * K, h8, page=16, group="page")]
  return checks + sweep + grid + baseline + page


def toy_cases() -> list[Case]:
  c = lambda *a, **k: Case(*a, dc=128, dr=64, **k)
  return timing.first([
      c(3, 200, 8, page=16, lens=(1, 64, 200), parts=4, group="check", check=True),
      c(2, 150, 8, q_len=4, page=32, lens=(40, 150), parts=3, partials="bf16", group="check",
        check=True),
      c(1, 256, 8, page=32, parts=6, min_blocks=2, group="sweep"),
      c(1, 200, 8, page=32, kernel="flash", group="baseline")])


def rotations(case: Case) -> int:
  return 1 if dry_run() else max(1, min(8, math.ceil(2 * L2_BYTES / case.kv_bytes())))


def pages_needed(case: Case) -> int:
  return sum(-(-n // case.page) for n in case.lengths)


def tables(case: Case, pool_pages: int, seed: int) -> list[jax.Array]:
  """One shuffled page table per rotation, each over pages no other rotation uses; a ragged
  row's unused entries name page 0."""
  width = -(-case.context // case.page)
  perm = np.random.default_rng(seed).permutation(pool_pages)
  out, used = [], 0
  for _ in range(rotations(case)):
    table = np.zeros((case.batch, width), np.int32)
    for b, n in enumerate(case.lengths):
      need = -(-n // case.page)
      table[b, :need] = perm[used:used + need]
      used += need
    out.append(jnp.asarray(table))
  return out


def attention(case: Case):
  kw = case.kwargs()
  fn = lambda *a: mla.mla_paged_attention(*a, **kw)
  return fn if dry_run() else jax.jit(fn)


def inputs(case: Case, key) -> tuple[jax.Array, ...]:
  kq, kr = jax.random.split(key)
  shape = (case.batch, case.q_len, case.heads)
  q_lat = timing.random_array(kq, shape + (case.dc,), jnp.bfloat16)
  q_rope = timing.random_array(kr, shape + (case.dr,), jnp.bfloat16)
  kv_lens = jnp.asarray(case.lengths, jnp.int32)
  pos = kv_lens[:, None] - case.q_len + jnp.arange(case.q_len, dtype=jnp.int32)[None]
  return q_lat, q_rope, jnp.maximum(pos, 0), kv_lens


def _is_kernel(case: Case):
  """Which CUPTI kernels a layer pays for (see the module docstring)."""
  if case.kernel == "flash":
    return lambda name: True
  return lambda name: "mosaic" in name.lower()


def measure(rec: Recorder, case: Case, pools: dict[int, jax.Array], key) -> None:
  pool = pools[case.page]
  q_lat, q_rope, pos, kv_lens = inputs(case, key)
  tabs = tables(case, pool.shape[0], seed=case.batch + case.context)
  fn = attention(case)
  run = lambda i: fn(q_lat, q_rope, pool, tabs[i % len(tabs)], pos, kv_lens)
  row = dict(group=case.group, kernel=case.kernel, batch=case.batch, context=case.context,
             heads=case.heads, q_len=case.q_len, page=case.page, parts=case.parts,
             min_blocks=case.min_blocks, overhead=case.overhead, partials=case.partials,
             ragged=case.lens is not None, rotations=len(tabs), bytes=case.bytes())
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
          layer = timing.summarize_kernels(per_iter, _is_kernel(case))
          timed.update(us=layer.get("kernel_us"), call_us=all_k["kernel_us"],
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
    err = timing.rel_err(out, ref(*args))
    row.update(rel_err_vs_reference=err, ok=bool(err <= TOL))
  rec.row("mosaic_gpu", case.name, **row, **timed)


def export_rows(rec: Recorder) -> None:
  """Dry run: each distinct GPU configuration (`Case.lowering_key`) lowered for CUDA at its
  real shape."""
  s = jax.ShapeDtypeStruct
  seen = set()
  for case in gpu_cases():
    if case.lowering_key() in seen:
      continue
    seen.add(case.lowering_key())
    if timing.quick() and len(seen) > 1:
      break
    shape = (case.batch, case.q_len, case.heads)
    found = timing.cuda_export(
        jax.jit(attention(case)) if dry_run() else attention(case),
        s(shape + (case.dc,), jnp.bfloat16), s(shape + (case.dr,), jnp.bfloat16),
        s((pages_needed(case) + 1, case.page, case.dc + case.dr), jnp.bfloat16),
        s((case.batch, -(-case.context // case.page)), jnp.int32),
        s((case.batch, case.q_len), jnp.int32), s((case.batch,), jnp.int32))
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
