"""The Mosaic GPU matmul skeleton of the W8A16 kernel (`fp8_mlp_mgpu`; W4A16 has its own,
`w4a16_mgpu`): tokens on WGMMA's N axis, each K step's weight tile dequantized by the format's
own code from SMEM (TMA-loaded, still quantized) into a bf16 SMEM tile for the MMA.

  outT[s, N, nt] = W[e]^T @ act[s]^T            (one weight), or
                   silu(Wg[e]^T @ act[s]^T) * (Wu[e]^T @ act[s]^T)   (two: gate, up)

per active slot s (its expert e = slot_expert[s], slots >= num_slots skipped without reading
their weights). A work item is (slot, 64 output columns); one CTA per SM loops over them.
Per K step of bk inputs: TMA the activations [nt, bk] and the format's tiles (block (rows, 64)
at block index (k step, column tile)); the format writes W's [bk, 64] tile as bf16 into one of
two SMEM buffers (alternating by step, so a step's dequant overlaps the previous step's MMA);
`commit_smem`; WGMMA acc[64, nt] += tile^T @ act^T (f32); keep at most the last MMA in
flight (`wgmma_wait(1)`), so the buffer written next and the inputs the pipeline refills next
are no longer read. Epilogue: registers -> SMEM -> TMA store of the [64, nt] tile.

Shapes: act [S * nt, K] bf16, slot_expert [S] int32, num_slots [1] int32 -> [S, N, nt].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.decode_mlp_mgpu import block_tokens_for, store_slot_tile

WEIGHT_TILE = 64  # WGMMA's M: weight columns per work item


@dataclasses.dataclass(frozen=True)
class DequantConfig:
  """block_k: inputs per K step (the formats need multiples of 128); max_concurrent_steps: TMA
  pipeline depth; num_sms: persistent CTAs (132 on H100/H200 SXM)."""
  block_k: int = 128
  max_concurrent_steps: int = 4
  num_sms: int = 132


@dataclasses.dataclass(frozen=True)
class WeightTiles:
  """One quantized weight as the skeleton sees it. tiled: [E, ...] arrays TMA-loaded per K step
  in blocks of `block_rows[i]` x 64 columns; side: [E, ...] arrays left in GMEM for the
  format's scalar reads; dequantize(kk, ni, expert, tile_smems, side_gmems, dst, fetched)
  writes the bf16 [bk, 64] tile of K step kk, column tile ni into the SMEM ref dst. prefetch
  (kk, ni, expert, side_gmems), if given, reads what step kk needs from GMEM one step ahead
  (carried through the pipeline, so the load's latency hides behind a step's work); its
  result for kk arrives as `fetched`."""
  tiled: Sequence[jax.Array]
  block_rows: Sequence[int]
  side: Sequence[jax.Array]
  dequantize: Callable[..., None]
  prefetch: Callable[..., Any] | None = None


def swapped_matmul(act: jax.Array, weights: Sequence[WeightTiles], n: int,
                   slot_expert: jax.Array, num_slots: jax.Array, nt: int,
                   cfg: DequantConfig) -> jax.Array:
  """outT [S, n, nt] (see the module docstring); n output columns, a multiple of 64."""
  rows, k = act.shape
  slots = rows // nt
  grid_n = n // WEIGHT_TILE
  bk = cfg.block_k
  nw = len(weights)
  counts = [(len(w.tiled), len(w.side)) for w in weights]

  def body(slot_expert_gmem, num_slots_gmem, act_gmem, *refs, w_smem):
    out_gmem, refs = refs[-1], list(refs[:-1])
    tiled_gmems, side_gmems = [], []
    for n_tiled, n_side in counts:
      tiled_gmems.append(refs[:n_tiled])
      side_gmems.append(refs[n_tiled:n_tiled + n_side])
      refs = refs[n_tiled + n_side:]
    used_slots = num_slots_gmem[0]

    # Slot-major order: consecutive SMs take neighbouring column tiles of one expert.
    @plgpu.nd_loop((slots, grid_n), collective_axes="sm")
    def _work_item(loop_info: plgpu.NDLoopInfo):
      si, ni = loop_info.index

      @pl.when(si < used_slots)
      def _():
        expert = slot_expert_gmem[si]

        def fetch(kk):
          return tuple(None if w.prefetch is None else
                       w.prefetch(kk, ni, expert, side_gmems[wi])
                       for wi, w in enumerate(weights))

        def acc_scope(*accs):
          def step(idx, a_smem, *tile_smems_and_carry):
            *tile_smems, fetched = tile_smems_and_carry
            kk = idx[0]
            buf = jax.lax.rem(kk, 2)
            ahead = fetch(jnp.minimum(kk + 1, k // bk - 1))
            for wi, w in enumerate(weights):
              mine, tile_smems = tile_smems[:len(w.tiled)], tile_smems[len(w.tiled):]
              w.dequantize(kk, ni, expert, mine, side_gmems[wi], w_smem.at[wi, buf],
                           fetched[wi])
            plgpu.commit_smem()  # generic-proxy stores -> visible to WGMMA (async proxy)
            for wi, acc in enumerate(accs):
              plgpu.wgmma(acc, w_smem.at[wi, buf].transpose((1, 0)), a_smem.transpose((1, 0)))
            # At most the last MMA in flight: the previous step's are done, so the next step
            # may overwrite their bf16 buffer and the pipeline may refill their inputs.
            plgpu.wgmma_wait(1)
            return ahead

          specs = [plgpu.BlockSpec((nt, bk), lambda kk: (si, kk), delay_release=1)]
          for w in weights:
            specs += [plgpu.BlockSpec((r, WEIGHT_TILE), lambda kk: (kk, ni), delay_release=1)
                      for r in w.block_rows]
          plgpu.emit_pipeline(
              step, grid=(k // bk,), in_specs=specs,
              max_concurrent_steps=cfg.max_concurrent_steps, init_carry=fetch(0),
          )(act_gmem, *(ref.at[expert] for refs_w in tiled_gmems for ref in refs_w))
          plgpu.wgmma_wait(0)
          return tuple(acc[...] for acc in accs)

        accs = pl.run_scoped(acc_scope, *[plgpu.ACC((WEIGHT_TILE, nt))] * nw)
        store_slot_tile(accs, out_gmem, si, ni)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((slots, n, nt), act.dtype),
      grid=(cfg.num_sms,),
      grid_names=("sm",),
      scratch_types=dict(w_smem=plgpu.SMEM((nw, 2, bk, WEIGHT_TILE), act.dtype)),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  leaves: list[Any] = [a for w in weights for a in (*w.tiled, *w.side)]
  return kernel(slot_expert, num_slots, act, *leaves)


def swiglu_two_kernels(xs: jax.Array, num_slots: jax.Array, nt: int,
                       gate_up: Callable[[jax.Array], jax.Array],
                       down: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """ys [S * nt, H] from the two kernel calls (gate_up(xs) -> hT [S, I, nt], down(h) ->
  yT [S, H, nt]); unused slots' rows are zero (the kernels never write them)."""
  slots = xs.shape[0] // nt
  used = (jnp.arange(slots) < num_slots[0])[:, None, None]
  h = jnp.where(used, gate_up(xs), 0).transpose(0, 2, 1).reshape(slots * nt, -1)
  return jnp.where(used, down(h), 0).transpose(0, 2, 1).reshape(slots * nt, -1)


PREFILL_TOKENS = 64  # slot height above the decode sizes (tokens on WGMMA N)


def block_tokens(num_tokens: int) -> int:
  """Slot height: the decode sizes' (tokens rounded up to 8, so up to 64 tokens each active
  expert owns exactly one slot), PREFILL_TOKENS above them (a big group spans several)."""
  return min(block_tokens_for(num_tokens), PREFILL_TOKENS)
