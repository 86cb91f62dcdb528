"""Where each KV block of an MLA decode goes: a balanced split of the batch's KV over the GPU's
SMs, computed in XLA from the actual lengths (FlashMLA's `get_mla_metadata`, closed-form).

The batch is laid out on a line of "cost units": sequence b takes `overhead` units (its query
load and epilogue, priced in KV blocks) followed by its `n_b = ceil(kv_len_b / BLOCK_KV)` KV
blocks. Part p (one CUDA block per query block, persistent) owns the units [p W, (p + 1) W),
W = max(ceil(total / num_parts), min_blocks). So every part streams about the same number of
blocks whatever the lengths, a long sequence is split over many parts, short ones share one, and
a part's range may span several sequences (its "segments"). Everything is a function of
`kv_lens` on the device: no host round trip, one small XLA fusion that every layer of a step
shares (the same `kv_lens`).

A segment (sequence b, part p) writes its partial context and log-sum-exp to slot `b + p`:
along the line b and p never decrease, so b + p is unique among non-empty segments, and the
slots of sequence b are the consecutive `first_slot[b] .. first_slot[b] + count[b] - 1`
(`count = 0` for an empty sequence). Slots number at most B + P - 1.

Shapes (B sequences, P parts):
  part_meta  [P, 4] int32  first sequence, last sequence, and the part's unit range [lo, hi)
  seq_meta   [B, 2] int32  the sequence's first block unit on the line, its block count
  first_slot [B]    int32
  count      [B]    int32
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_KV = 64  # KV tokens per pipeline step (one 64 x 576 tile; FlashMLA's page block)
BLOCK_Q = 64  # query rows per CUDA block (WGMMA's M)
DEFAULT_SMS = 132  # H100 / H200 SXM
# A segment's fixed cost in KV blocks: its query load and its partial's write, which a part
# pays once per sequence it touches (FlashMLA prices it at 5 of its 64-token blocks). The
# protocol's split sweep measures 0, 2 and 5.
DEFAULT_OVERHEAD_BLOCKS = 2


class DecodeSchedule(NamedTuple):
  part_meta: jax.Array
  seq_meta: jax.Array
  first_slot: jax.Array
  count: jax.Array


def partial_rows(rows: int) -> int:
  """Rows a sequence's partial keeps for `rows` = T x nH query rows: padded to 8, 16, 32 or a
  multiple of 64, so that a 64-row tile of the flattened partials holds whole sequences' rows
  (the combine kernel folds them) and TMA boxes stay 8-row aligned."""
  if rows <= 0:
    raise ValueError(f"rows={rows} must be positive")
  for r in (8, 16, 32):
    if rows <= r:
      return r
  return -(-rows // BLOCK_Q) * BLOCK_Q


def num_q_blocks(rows_padded: int) -> int:
  return max(1, rows_padded // BLOCK_Q)


def num_parts_for(q_blocks: int, num_sms: int = DEFAULT_SMS) -> int:
  """Parts per query block: one CUDA block per SM over all query blocks (FlashMLA's
  num_sm_parts)."""
  return max(1, num_sms // q_blocks)


def num_slots(batch: int, parts: int) -> int:
  """Slots the partials need: B + P - 1 segments at most, plus 8: a combine tile holds up to 8
  consecutive slots, so it reads at most 7 past a sequence's last."""
  return batch + parts + 8


def decode_schedule(kv_lens: jax.Array, *, num_parts: int,
                    overhead_blocks: int = DEFAULT_OVERHEAD_BLOCKS,
                    min_blocks_per_part: int = 1) -> DecodeSchedule:
  """The balanced split of `kv_lens` [B] over `num_parts` parts (see the module docstring)."""
  if overhead_blocks < 0 or min_blocks_per_part < 1 or num_parts < 1:
    raise ValueError(f"need overhead_blocks >= 0, min_blocks_per_part >= 1, num_parts >= 1; "
                     f"got {overhead_blocks}, {min_blocks_per_part}, {num_parts}")
  kv_lens = jnp.maximum(kv_lens.astype(jnp.int32), 0)
  n = (kv_lens + (BLOCK_KV - 1)) // BLOCK_KV
  cost = n + overhead_blocks
  ends = jnp.cumsum(cost)  # where each sequence's units end on the line
  start = ends - n  # its first block unit
  total = ends[-1]
  # (a zero-cost line only when every sequence is empty with no overhead: W >= 1 regardless)
  width = jnp.maximum((total + (num_parts - 1)) // num_parts, min_blocks_per_part)
  lo = jnp.arange(num_parts, dtype=jnp.int32) * width
  hi = lo + width
  b_first = jnp.sum(ends[None, :] <= lo[:, None], axis=1, dtype=jnp.int32)
  b_last = jnp.sum(start[None, :] < hi[:, None], axis=1, dtype=jnp.int32) - 1
  p_lo = start // width
  p_hi = (start + n - 1) // width
  b = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
  return DecodeSchedule(
      part_meta=jnp.stack([b_first, b_last, lo, hi], axis=1).astype(jnp.int32),
      seq_meta=jnp.stack([start, n], axis=1).astype(jnp.int32),
      first_slot=(b + p_lo).astype(jnp.int32),
      count=jnp.where(n > 0, p_hi - p_lo + 1, 0).astype(jnp.int32))


def segments(schedule: DecodeSchedule) -> list[tuple[int, int, int, int]]:
  """Host-side listing of the non-empty segments (part, sequence, first block, blocks), in the
  order each part runs them: what the kernels iterate, for tests and the protocol's rows."""
  part_meta, seq_meta = np.asarray(schedule.part_meta), np.asarray(schedule.seq_meta)
  out = []
  for p, (b_first, b_last, lo, hi) in enumerate(part_meta):
    for b in range(b_first, b_last + 1):
      start, n = seq_meta[b]
      first = max(start, lo) - start
      steps = min(start + n, hi) - start - first
      if steps > 0:
        out.append((p, b, int(first), int(steps)))
  return out


def combine_reference(partial: jax.Array, lse: jax.Array,
                      schedule: DecodeSchedule) -> jax.Array:
  """XLA merge of the slots (the combine kernel's reference): [S, R, Dv] partials + [S, R]
  log-sum-exps -> [B, R, Dv] float32; rows no slot saw come out 0. Slots outside a sequence's
  range (unwritten memory) are selected away, never multiplied by 0."""
  s = jnp.arange(partial.shape[0], dtype=jnp.int32)
  first, count = schedule.first_slot, schedule.count
  mine = (s[None, :] >= first[:, None]) & (s[None, :] < (first + count)[:, None])  # [B, S]
  lse_b = jnp.where(mine[:, :, None], lse[None], -jnp.inf)  # [B, S, R]
  m = jnp.max(lse_b, axis=1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_b - m)
  den = jnp.sum(w, axis=1)
  part = jnp.where(mine[:, :, None, None] & (w > 0)[..., None], partial[None].astype(jnp.float32),
                   0.0)
  num = jnp.einsum("bsr,bsrd->brd", w, part)
  return num / jnp.where(den > 0, den, 1.0)[..., None]
