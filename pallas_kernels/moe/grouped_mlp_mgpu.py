"""Grouped expert SwiGLU MLP for prefill-sized batches: Pallas Mosaic GPU (Hopper WGMMA).

Two persistent kernels over the permuted, tile-padded layout of `permute.py` (every row tile of
`block_m` rows belongs to one expert):

  gate_up:  h[R, I] = silu(xs @ w_gate[e]) * (xs @ w_up[e])   two WGMMA accumulators per tile,
                                                               SiLU-and-multiply in registers
  down:     y[R, H] = h @ w_down[e]

Shapes: xs [R, H] (R a multiple of block_m), w_gate/w_up [E, H, I], w_down [E, I, H],
tile_expert [R / block_m] int32, num_tiles [1] int32. Output rows of unused tiles
(tile >= num_tiles) are not written.

Structure (after jax's `ops/gpu/ragged_dot_mgpu.py`): one CTA per SM loops over (row tile,
column tile) work items (`plgpu.nd_loop` over the "sm" axis, `planar_snake` order so
neighbouring SMs share weight tiles); each item pipelines K with TMA loads into swizzled SMEM
(`plgpu.emit_pipeline`) feeding `plgpu.wgmma`; the epilogue goes registers -> SMEM -> TMA store.
Differences from jax's op: the tile -> expert map is computed outside the kernel (jax's op
unrolls a loop over all groups per tile, which is fine for 16 groups, not for 384 experts;
tokamax's sm90 kernel also precomputes it), and groups are padded to whole tiles, so every store
is a full tile (jax's op and tokamax keep groups unpadded and store a tile's rows with a ladder
of power-of-two TMA stores). Padding costs up to E * (block_m - 1) extra rows of xs/h/y memory
(at T = 8192, E = 384: +37%); MMA work is the same as with ragged tiles (a partial tile costs a
full 64-row WGMMA either way) and unused tiles are skipped.

Limits: WGMMA needs 16-bit operands here (bf16/f16): f32 WGMMA (tf32) cannot take the
transposed (N-fastest) weight layout [K, N], so f32 raises NotImplementedError (f32 models keep
moe="reference"; no silent fallback). block_m is a
multiple of 64 (one warpgroup's WGMMA M). A tile with few real rows still costs a full 64-row
MMA, so small batches should use `decode_mlp_mgpu` (tokens on the MMA N axis).

Comparison with tokamax's Mosaic GPU `ragged_dot` (the maintained grouped GEMM) needs a GPU, which
this task did not have; `lax.ragged_dot` is not a GPU candidate (XLA pads it to dense).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import permute as permute_lib


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
  """Tile sizes. block_m: rows per tile (multiple of 64); block_n: output columns per tile;
  block_k: contraction step; max_concurrent_steps: TMA pipeline depth; grid_block_n: snake width;
  num_sms: persistent CTAs (132 on H100/H200 SXM)."""
  block_m: int = 64
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  grid_block_n: int = 1
  num_sms: int = 132


def _check(dtype, k: int, n: int, cfg: GroupedConfig) -> None:
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"Mosaic GPU grouped MLP takes bf16/f16 operands, got {dtype}")
  if cfg.block_m % 64:
    raise ValueError(f"block_m={cfg.block_m} must be a multiple of 64 (WGMMA M)")
  if k % cfg.block_k or n % cfg.block_n:
    raise ValueError(f"K={k}, N={n} must be multiples of block_k={cfg.block_k}, "
                     f"block_n={cfg.block_n}")


def _silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
  # exp and division lower in Mosaic GPU's warpgroup semantics (jax.nn.silu's logistic too, but
  # spelled out it is one exp and one divide per element).
  return gate / (1.0 + jnp.exp(-gate)) * up


def _grouped_matmul(xs: jax.Array, weights: tuple[jax.Array, ...], tile_expert: jax.Array,
                    num_tiles: jax.Array, cfg: GroupedConfig, out_dtype) -> jax.Array:
  """out[R, N] = xs @ w[e] per row tile (one weight), or silu(xs @ wg[e]) * (xs @ wu[e]) (two)."""
  rows, k = xs.shape
  n = weights[0].shape[2]
  _check(xs.dtype, k, n, cfg)
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  if rows % bm:
    raise ValueError(f"rows={rows} must be a multiple of block_m={bm}")
  grid_m, grid_n = rows // bm, n // bn
  fused = len(weights) == 2

  def body(tile_expert_gmem, num_tiles_gmem, xs_gmem, *refs):
    w_gmems, out_gmem = refs[:-1], refs[-1]
    used_tiles = num_tiles_gmem[0]

    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def _work_item(loop_info: plgpu.NDLoopInfo):
      mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, cfg.grid_block_n)

      @pl.when(mi < used_tiles)
      def _():
        expert = tile_expert_gmem[mi]

        def acc_scope(*accs):
          def step(_, x_smem, *w_smems):
            for acc, w_smem in zip(accs, w_smems):
              plgpu.wgmma(acc, x_smem, w_smem)

          w_spec = plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1)
          plgpu.emit_pipeline(
              step,
              grid=(k // bk,),
              in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (mi, kk), delay_release=1)]
              + [w_spec] * len(accs),
              max_concurrent_steps=cfg.max_concurrent_steps,
          )(xs_gmem, *(w.at[expert] for w in w_gmems))
          return tuple(acc[...] for acc in accs)

        accs = pl.run_scoped(acc_scope, *[plgpu.ACC((bm, bn))] * len(weights))
        result = _silu_mul(*accs) if fused else accs[0]

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_gmem.dtype))
        def _store(o_smem):
          o_smem[...] = result.astype(o_smem.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
          # The next work item reuses this SMEM: wait until the TMA has read it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
      grid=(cfg.num_sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(tile_expert, num_tiles, xs, *weights)


def grouped_swiglu(xs: jax.Array, tile_expert: jax.Array, num_tiles: jax.Array,
                   w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   cfg: GroupedConfig = GroupedConfig()) -> jax.Array:
  """ys [R, H] = down(silu(xs @ gate) * (xs @ up)) per row tile's expert; xs [R, H]."""
  h = _grouped_matmul(xs, (w_gate, w_up), tile_expert, num_tiles, cfg, xs.dtype)
  return _grouped_matmul(h, (w_down,), tile_expert, num_tiles, cfg, xs.dtype)


# Plain JAX of `grouped_swiglu` (tiles of block_m rows).
grouped_swiglu_reference = permute_lib.tiled_swiglu_reference


def moe_experts_grouped(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                        expert_offset: int = 0, layer: jax.Array | int | None = None,
                        cfg: GroupedConfig = GroupedConfig()) -> jax.Array:
  """`reference.moe_experts` contract through the grouped kernels (prefill path); with `layer`,
  the weights are stacks and the kernels read layer `layer`'s experts in place."""
  t, k = expert_ids.shape
  (w_gate, w_up, w_down), e_local, base = permute_lib.expert_pool((w_gate, w_up, w_down), layer)
  rows = permute_lib.padded_rows(t * k, e_local, cfg.block_m, max_group_size=t)
  perm = permute_lib.route_copies(expert_ids, num_local_experts=e_local,
                                  expert_offset=expert_offset, block_rows=cfg.block_m,
                                  num_rows=rows)
  xs = permute_lib.permute(x, perm, top_k=k, num_rows=rows)
  ys = grouped_swiglu(xs, perm.tile_expert + base, perm.num_tiles, w_gate, w_up, w_down, cfg)
  return permute_lib.combine(ys, perm, weights, x.dtype)
