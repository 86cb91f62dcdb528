"""W4A16 expert matmul on packed INT4 experts: Pallas Mosaic GPU for Hopper, built to stream the
hit experts' bytes at the memory's rate.

  outT[s, N, nt] = W[e]^T @ act[s]^T   per used slot s (expert e = slot_expert[s]), for one
  weight (down) or two read together (gate and up: their SwiGLU, or both partial products)

The weights are `quant.Int4Weight` as loaded (packed uint8 [E, N, K/2] in compressed-tensors'
order, bf16 scales [E, K/group, N]); the activations come in `w4a16_layout.permute_k` order.

Structure (one CTA per SM, persistent; 3 warpgroups):
* warpgroup 2, the producer (40 registers): walks this CTA's work units and their K steps and
  TMA-loads per step the packed tile [128 rows, bk/2] (128-byte swizzle), the scales
  [bk/group, 128] and the activations [nt, bk] of every weight into a ring of `stages` SMEM
  slots; it runs ahead across unit boundaries, so a unit's first steps are in flight while the
  previous unit finishes.
* warpgroups 0 and 1, the consumers (232 registers): 64 weight rows each (the CTA's 128 rows).
  Per step and 64-input chunk they load their rows' bytes (one 64-bit shared load per row),
  dequantize them in registers straight into WGMMA's A operand (`w4a16_layout`: no bf16 tile
  in SMEM, no shuffles) and issue WGMMA m64 n{nt} k16 against the activations in SMEM; the
  last `mma_depth` chunks' MMAs stay in flight while the next chunk converts. A step's slot
  is released once its MMAs are done; at a unit's end the f32 accumulators go out through
  SMEM and TMA.
* Work units are (slot, 128-row tile, K split): with few used slots (a decode step's 1-8
  experts) the K range is split so that every SM has work; `splits` (a kernel input, chosen
  on device from the used slot count: `int4_mlp_mgpu.choose_splits`) may vary per call.
  Split units write f32 partial products [max_splits, S, nw, N, nt], summed outside; with
  `final`, (max_splits 1) the kernel writes the result itself: bf16 silu(g) * u for two
  weights, f32 for one.

Interpret mode (the CPU tests) cannot run the register path's inline Mosaic code nor a WGMMA
with a register operand: there the same K step is dequantized by `w4a16_layout.
dequantize_step` (same tables, whole arrays), stored to SMEM and multiplied from there, which is
also the `a_operand="smem"` variant on a GPU.

Shapes: act [S * nt, K] bf16, slot_expert [S] int32, sched [2] int32 (used slots, splits).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.interpret import interpreting
from pallas_kernels.moe import w4a16_layout as layout
from pallas_kernels.quant import Int4Weight

ROWS = layout.ROWS  # weight rows per consumer warpgroup
CTA_ROWS = 2 * ROWS  # two consumer warpgroups
SMEM_BYTES = 227 * 1024  # H100 / H200 dynamic SMEM per block


@dataclasses.dataclass(frozen=True)
class W4A16Config:
  """block_k: inputs per K step (128 or 256: the packed tile's rows are bk/2 bytes, swizzled);
  max_stages: SMEM ring depth (fewer when they do not fit); num_sms: persistent CTAs;
  max_splits: K splits per unit at most; a_operand: "registers" (dequantized into WGMMA's A
  registers) or "smem" (through an SMEM tile; what interpret mode runs); mma_depth: chunks whose
  MMAs stay in flight (1: wait for each); split_overhead: a unit's fixed cost in K steps, for
  the split choice; partial_budget: bytes of f32 partials allowed; splits: a fixed K split
  count (0: chosen per call; the sweep and tests force it)."""
  block_k: int = 256
  max_stages: int = 8
  num_sms: int = 132
  max_splits: int = 8
  a_operand: str = "registers"
  mma_depth: int = 2
  split_overhead: float = 1.0
  partial_budget: int = 64 << 20
  splits: int = 0


def _swizzled(minor_bytes: int, bits: int) -> tuple:
  swizzle = plgpu.find_swizzle(minor_bytes * 8, "W4A16 operand")
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def stage_bytes(nt: int, nw: int, group: int, cfg: W4A16Config) -> int:
  bk = cfg.block_k
  return nt * bk * 2 + nw * (CTA_ROWS * bk // 2 + bk // group * CTA_ROWS * 2)


def fixed_bytes(nt: int, nw: int, final: bool, a_smem: bool, cfg: W4A16Config) -> int:
  out = 2 * ROWS * nt * (2 if final and nw == 2 else 4) * (1 if final else nw)
  a_tiles = 2 * nw * cfg.mma_depth * ROWS * layout.CHUNK * 2 if a_smem else 0
  return out + a_tiles + 1024  # (barriers and alignment)


def num_stages(nt: int, nw: int, group: int, final: bool, a_smem: bool,
               cfg: W4A16Config) -> int:
  """The deepest SMEM ring (at most cfg.max_stages) that fits beside the fixed buffers; 0 when
  not even 2 do."""
  room = SMEM_BYTES - fixed_bytes(nt, nw, final, a_smem, cfg)
  stages = min(cfg.max_stages, room // stage_bytes(nt, nw, group, cfg))
  return stages if stages >= 2 else 0


def uses_smem_operand(cfg: W4A16Config) -> bool:
  return interpreting() or cfg.a_operand == "smem"


def expert_matmul(act: jax.Array, weights: Sequence[Int4Weight], slot_expert: jax.Array,
                  sched: jax.Array, nt: int, cfg: W4A16Config, *, final: bool,
                  max_splits: int = 1) -> jax.Array:
  """See the module docstring. Returns final: [S, N, nt] (bf16 SwiGLU of two weights, f32 of
  one); else f32 partials [max_splits, S, nw, N, nt] (rows of splits >= sched[1] and slots
  >= sched[0] unwritten)."""
  rows, k = act.shape
  slots = rows // nt
  nw = len(weights)
  _, _, n = weights[0].shape
  group = weights[0].group
  bk = cfg.block_k
  k_steps = k // bk
  n_tiles = n // CTA_ROWS
  a_smem = uses_smem_operand(cfg)
  if final and max_splits != 1:
    raise ValueError("final output needs max_splits == 1")
  stages = num_stages(nt, nw, group, final, a_smem, cfg)
  if not stages:
    raise ValueError(f"W4A16: block_tokens={nt}, block_k={bk} leave SMEM for fewer than 2 "
                     f"pipeline stages")
  grid = min(cfg.num_sms, slots * n_tiles * max_splits)  # (no CTA without a possible unit)
  depth_wait = nw * (cfg.mma_depth - 1)

  def body(sched_gmem, slot_expert_gmem, act_gmem, *refs):
    w_gmems = [refs[2 * i:2 * i + 2] for i in range(nw)]
    out_gmem = refs[2 * nw]
    x_smem, w_smem, s_smem, o_smem, full, empty, *a_scratch = refs[2 * nw + 1:]
    used, splits = sched_gmem[0], sched_gmem[1]
    per_slot = n_tiles * splits
    total = used * per_slot
    cta = lax.axis_index("sm")
    local_units = lax.div(jnp.maximum(total - cta, 0) + grid - 1, grid)

    def unit_of(i):
      u = cta + i * grid
      si = lax.div(u, per_slot)
      rem = lax.rem(u, per_slot)
      tile, part = lax.div(rem, splits), lax.rem(rem, splits)
      # Split `part` of `splits` takes K steps [part * k / splits, (part + 1) * k / splits):
      # floor and ceiling sizes, none empty while splits <= k_steps.
      return (si, tile, part, lax.div(part * k_steps, splits),
              lax.div((part + 1) * k_steps, splits))

    wg = lax.axis_index("wg")

    def producer():
      plgpu.set_max_registers(40, action="decrease")

      def unit(i, t):
        si, tile, _, k0, k1 = unit_of(i)
        expert = slot_expert_gmem[si]

        def step(kk, t):
          slot = lax.rem(t, stages)

          @pl.when(t >= stages)
          def _():
            plgpu.barrier_wait(empty.at[slot])

          plgpu.copy_gmem_to_smem(act_gmem.at[pl.ds(si * nt, nt), pl.ds(kk * bk, bk)],
                                  x_smem.at[slot], full.at[slot])
          for wi, (packed, scale) in enumerate(w_gmems):
            plgpu.copy_gmem_to_smem(
                packed.at[expert, pl.ds(tile * CTA_ROWS, CTA_ROWS), pl.ds(kk * (bk // 2), bk // 2)],
                w_smem.at[wi, slot], full.at[slot])
            plgpu.copy_gmem_to_smem(
                scale.at[expert, pl.ds(kk * (bk // group), bk // group),
                         pl.ds(tile * CTA_ROWS, CTA_ROWS)],
                s_smem.at[wi, slot], full.at[slot])
          return t + 1

        return lax.fori_loop(k0, k1, step, t)

      t_end = lax.fori_loop(0, local_units, unit, jnp.int32(0))

      # Take the consumers' last releases, so every barrier ends its phases balanced.
      @pl.loop(jnp.maximum(t_end - stages, 0), t_end)
      def _drain(t):
        plgpu.barrier_wait(empty.at[lax.rem(t, stages)])

    def consumer():
      plgpu.set_max_registers(232, action="increase")
      rows_wg = pl.ds(wg * ROWS, ROWS)

      def mma_step(slot, accs):
        if a_smem:
          a_buf = a_scratch[0]
          if interpreting():
            tiles = [layout.dequantize_step(w_smem[wi, slot, rows_wg], s_smem[wi, slot, :, rows_wg],
                                            group) for wi in range(nw)]
        packed = [plgpu.load(w_smem.at[wi, slot, rows_wg], layout=layout.BYTE_LAYOUT)
                  for wi in range(nw)] if not interpreting() else None
        for c in range(bk // layout.CHUNK):
          x_chunk = x_smem.at[slot, :, pl.ds(c * layout.CHUNK, layout.CHUNK)].T
          for wi in range(nw):
            if interpreting():
              a = tiles[wi][:, c * layout.CHUNK:(c + 1) * layout.CHUNK]
            else:
              a = layout.convert_chunk(c, group)(packed[wi], s_smem.at[wi, slot, :, rows_wg])
            if a_smem:
              buf = c % cfg.mma_depth  # (the MMA that read it last is done: mma_step's wait)
              a_buf[wg, wi, buf] = a
              plgpu.commit_smem()
              a = a_buf.at[wg, wi, buf]
            plgpu.wgmma(accs[wi], a, x_chunk)
          plgpu.wgmma_wait(depth_wait)

      def unit(i, t):
        si, tile, part, k0, k1 = unit_of(i)

        def acc_scope(*accs):
          def step(kk, t):
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(full.at[slot])
            mma_step(slot, accs)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(empty.at[slot])
            return t + 1

          t_next = lax.fori_loop(k0, k1, step, t)
          return t_next, tuple(acc[...] for acc in accs)

        t_next, res = pl.run_scoped(acc_scope, *[plgpu.ACC((ROWS, nt), jnp.float32)] * nw)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's store read o_smem
        row0 = tile * CTA_ROWS + wg * ROWS
        if final:
          g = res[0]
          y = (g / (1.0 + jnp.exp(-g)) * res[1]) if nw == 2 else g
          o_smem[wg, 0] = y.astype(o_smem.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem.at[wg, 0], out_gmem.at[si, pl.ds(row0, ROWS)])
        else:
          for wi in range(nw):
            o_smem[wg, wi] = res[wi]
          plgpu.commit_smem()
          for wi in range(nw):
            plgpu.copy_smem_to_gmem(o_smem.at[wg, wi],
                                    out_gmem.at[part, si, wi, pl.ds(row0, ROWS)])
        return t_next

      lax.fori_loop(0, local_units, unit, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    # One if/else of the two roles: what ptxas needs to honour setmaxnreg (HOPPER.md).
    lax.cond(wg == 2, producer, consumer)

  if final:
    out_dtype = act.dtype if nw == 2 else jnp.float32
    out_type = jax.ShapeDtypeStruct((slots, n, nt), out_dtype)
    o_scratch = plgpu.SMEM((2, 1, ROWS, nt), out_dtype)
  else:
    out_type = jax.ShapeDtypeStruct((max_splits, slots, nw, n, nt), jnp.float32)
    o_scratch = plgpu.SMEM((2, nw, ROWS, nt), jnp.float32)
  scratch = [
      plgpu.SMEM((stages, nt, bk), act.dtype, transforms=_swizzled(bk * 2, 16)),
      plgpu.SMEM((nw, stages, CTA_ROWS, bk // 2), jnp.uint8, transforms=_swizzled(bk // 2, 8)),
      plgpu.SMEM((nw, stages, bk // group, CTA_ROWS), jnp.bfloat16),
      o_scratch,
      plgpu.Barrier(num_arrivals=1 + 2 * nw, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
  ]
  if a_smem:
    scratch.append(plgpu.SMEM((2, nw, cfg.mma_depth, ROWS, layout.CHUNK), jnp.bfloat16,
                              transforms=_swizzled(layout.CHUNK * 2, 16)))
  kernel = plgpu.kernel(
      body, out_type=out_type, grid=(grid,), grid_names=("sm",), num_threads=3,
      thread_name="wg", scratch_types=scratch)
  leaves = [a for w in weights for a in (w.packed, w.scale)]
  return kernel(sched, slot_expert, act, *leaves)


def check(dtype, w: Int4Weight, nt: int, cfg: W4A16Config) -> None:
  """The kernel's limits for one weight: ValueError / NotImplementedError naming the field."""
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    raise NotImplementedError(f"Mosaic GPU W4A16 takes bf16 activations, got {dtype}")
  _, k, n = w.shape
  bk, g = cfg.block_k, w.group
  if bk not in (128, 256):
    raise ValueError(f"W4A16 block_k={bk}: 128 or 256")
  if g % 16 or bk % g:
    raise NotImplementedError(f"W4A16: INT4 group {g} must be a multiple of 16 dividing "
                              f"block_k={bk}")
  if k % bk:
    raise NotImplementedError(f"W4A16: input width {k} is not a multiple of block_k={bk}")
  if n % CTA_ROWS:
    raise NotImplementedError(f"W4A16: output width {n} is not a multiple of {CTA_ROWS}")
  if nt % 8 or nt > 64:
    raise ValueError(f"W4A16: block_tokens={nt} must be a multiple of 8, at most 64")
  if cfg.a_operand not in ("registers", "smem") or cfg.mma_depth not in (1, 2):
    raise ValueError(f"W4A16: a_operand={cfg.a_operand!r}, mma_depth={cfg.mma_depth}")

