"""Expert SwiGLU MLP for decode-sized batches (1-64 tokens): Pallas Mosaic GPU, weight streaming.

With few tokens the MoE layer is memory-bound: the cost is reading the weights of the experts
that received tokens. The kernels visit only active experts: each active local expert owns one
*slot* of `block_tokens` rows in the permuted layout (`permute.py` with block_rows =
block_tokens >= T, so no expert overflows its slot), and work items are (slot, output tile) for
slots < num_slots; unused slots are skipped without touching their weights. A step with T tokens
reads at most min(T * k, E_local) experts' weights (~8 per token), never all of them.

The MMA is "swapped" so the tokens sit on WGMMA's N axis (multiple of 8, up to 256) and the
weights on M (64 rows per warpgroup), instead of padding 1-64 tokens to a 64-row M tile:

  gate_up:  hT[s, I, Nt] = silu(w_gate[e]^T @ xs[s]^T) * (w_up[e]^T @ xs[s]^T)
  down:     yT[s, H, Nt] = w_down[e]^T @ h[s]^T            with h[s] = hT[s]^T   (XLA transpose)

Both operands are transposed SMEM views (`ref.transpose((1, 0))`), which WGMMA supports for
16-bit types only. The h transpose between the kernels moves S * Nt * I values, under 1% of the
weight bytes (an expert's gate+up+down is 3 * H * I).

Shapes: xs [S * Nt, H] (S slots of Nt = block_tokens rows), w_gate/w_up [E, H, I],
w_down [E, I, H], slot_expert [S] int32, num_slots [1] int32. `decode_swiglu` returns
ys [S * Nt, H]; the kernels leave unused slots unwritten and `decode_swiglu` zeroes them.

Limits: bf16/f16 only (f32 WGMMA cannot take transposed operands); block_tokens a multiple of 8,
at most 256; I and H multiples of 64 and of block_k.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import permute as permute_lib

# WGMMA's M: one warpgroup computes 64 rows (here: 64 weight columns) per instruction.
_WEIGHT_TILE = 64


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """block_k: contraction step (bytes in flight per stage = 64 * block_k * 2 per weight);
  max_concurrent_steps: TMA pipeline depth (deep: the kernel is latency/bandwidth bound);
  num_sms: persistent CTAs."""
  block_k: int = 128
  max_concurrent_steps: int = 4
  num_sms: int = 132


def block_tokens_for(num_tokens: int) -> int:
  """Slot height: tokens rounded up to WGMMA's N granularity (8)."""
  return max(8, -(-num_tokens // 8) * 8)


def _check(dtype, k: int, n: int, nt: int, cfg: DecodeConfig) -> None:
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"Mosaic GPU decode MLP takes bf16/f16 operands, got {dtype}")
  if nt % 8 or nt > 256:
    raise ValueError(f"block_tokens={nt} must be a multiple of 8, at most 256")
  if k % cfg.block_k or n % _WEIGHT_TILE:
    raise ValueError(f"K={k} must be a multiple of block_k={cfg.block_k}, N={n} of 64")


def _swapped_matmul(act: jax.Array, weights: tuple[jax.Array, ...], slot_expert: jax.Array,
                    num_slots: jax.Array, nt: int, cfg: DecodeConfig) -> jax.Array:
  """outT[s, N, nt] = w[e]^T @ act[s]^T (one weight) or the SwiGLU of two, per active slot."""
  rows, k = act.shape
  n = weights[0].shape[2]
  _check(act.dtype, k, n, nt, cfg)
  slots = rows // nt
  grid_n = n // _WEIGHT_TILE
  bk = cfg.block_k

  def body(slot_expert_gmem, num_slots_gmem, act_gmem, *refs):
    w_gmems, out_gmem = refs[:-1], refs[-1]
    used_slots = num_slots_gmem[0]

    # Slot-major order: consecutive SMs take neighbouring column tiles of one expert.
    @plgpu.nd_loop((slots, grid_n), collective_axes="sm")
    def _work_item(loop_info: plgpu.NDLoopInfo):
      si, ni = loop_info.index

      @pl.when(si < used_slots)
      def _():
        expert = slot_expert_gmem[si]

        def acc_scope(*accs):
          def step(_, a_smem, *w_smems):
            for acc, w_smem in zip(accs, w_smems):
              plgpu.wgmma(acc, w_smem.transpose((1, 0)), a_smem.transpose((1, 0)))

          w_spec = plgpu.BlockSpec((bk, _WEIGHT_TILE), lambda kk: (kk, ni), delay_release=1)
          plgpu.emit_pipeline(
              step,
              grid=(k // bk,),
              in_specs=[plgpu.BlockSpec((nt, bk), lambda kk: (si, kk), delay_release=1)]
              + [w_spec] * len(accs),
              max_concurrent_steps=cfg.max_concurrent_steps,
          )(act_gmem, *(w.at[expert] for w in w_gmems))
          return tuple(acc[...] for acc in accs)

        accs = pl.run_scoped(acc_scope, *[plgpu.ACC((_WEIGHT_TILE, nt))] * len(weights))
        store_slot_tile(accs, out_gmem, si, ni)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((slots, n, nt), act.dtype),
      grid=(cfg.num_sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(slot_expert, num_slots, act, *weights)


def store_slot_tile(accs: tuple[jax.Array, ...], out_gmem: Any, si: jax.Array,
                    ni: jax.Array) -> None:
  """A slot kernel's work-item epilogue (inside the kernel): silu(gate) * up of the two
  accumulators [tile, Nt] (one: as it is) to out_gmem[si, ni * tile:(ni + 1) * tile] through
  SMEM, waiting until the TMA has read it (the next work item reuses the SMEM)."""
  result = (accs[0] / (1.0 + jnp.exp(-accs[0])) * accs[1]) if len(accs) == 2 else accs[0]
  tile = result.shape[0]

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(result.shape, out_gmem.dtype))
  def _store(o_smem):
    o_smem[...] = result.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[si, pl.ds(ni * tile, tile)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def decode_swiglu(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
                  w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, block_tokens: int,
                  cfg: DecodeConfig = DecodeConfig()) -> jax.Array:
  """ys [S * Nt, H] = down(silu(xs @ gate) * (xs @ up)) per slot's expert; rows of unused
  slots are zero."""
  nt = block_tokens
  slots = xs.shape[0] // nt
  h_t = _swapped_matmul(xs, (w_gate, w_up), slot_expert, num_slots, nt, cfg)  # [S, I, nt]
  # Unused slots were never written: zero them so nothing uninitialised flows on.
  used = (jnp.arange(slots) < num_slots[0])[:, None, None]
  h = jnp.where(used, h_t, 0).transpose(0, 2, 1).reshape(slots * nt, -1)
  y_t = _swapped_matmul(h, (w_down,), slot_expert, num_slots, nt, cfg)  # [S, H, nt]
  return jnp.where(used, y_t, 0).transpose(0, 2, 1).reshape(slots * nt, -1)


# Plain JAX of `decode_swiglu` (slots of block_tokens rows).
decode_swiglu_reference = permute_lib.tiled_swiglu_reference


def moe_experts_decode(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                       w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                       expert_offset: int = 0, layer: jax.Array | int | None = None,
                       cfg: DecodeConfig = DecodeConfig()) -> jax.Array:
  """`reference.moe_experts` contract through the decode kernels (T <= 256 tokens; each token's
  k expert ids distinct, as routing produces, so no expert gets more than T copies); with
  `layer`, the weights are stacks and the kernels read layer `layer`'s experts in place."""
  t, k = expert_ids.shape
  (w_gate, w_up, w_down), e_local, base = permute_lib.expert_pool((w_gate, w_up, w_down), layer)
  nt = block_tokens_for(t)
  rows = permute_lib.padded_rows(t * k, e_local, nt, max_group_size=t)
  perm = permute_lib.route_copies(expert_ids, num_local_experts=e_local,
                                  expert_offset=expert_offset, block_rows=nt, num_rows=rows)
  xs = permute_lib.permute(x, perm, top_k=k, num_rows=rows)
  ys = decode_swiglu(xs, perm.tile_expert + base, perm.num_tiles, w_gate, w_up, w_down, nt,
                     cfg)
  return permute_lib.combine(ys, perm, weights, x.dtype)
