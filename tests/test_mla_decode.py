"""The MLA decode kernels (`mla_decode_mgpu`, `mla_combine_mgpu`) and their schedule
(`mla_decode_schedule`): the balanced split covers every KV block once and gives each sequence
consecutive slots; the kernels (GPU interpret mode on the CPU) against the plain-JAX reference
over lengths 1, a page boundary, 4k and ragged batches, 8 and 64 heads, decode and verify
blocks, float32 and bf16 partials; the partials against the segments' own attention and only
the scheduled slots written; the combine against its XLA reference; CUDA lowering at Kimi
K2.5 shapes; what the decode path refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import MOSAIC_CALL, export_cuda_calls, gpu_interpret
from pallas_kernels.attention import mla_combine_mgpu, mla_decode_mgpu
from pallas_kernels.attention import mla_decode_schedule as sched
from pallas_kernels.attention import mla_paged_attention_mgpu as mla
from pallas_kernels.attention import reference


def _inputs(seed, b, t, nh, dc, dr, page, kv_lens):
  """Shuffled page tables (rows' pages interleave); queries at each row's last t positions."""
  rng = np.random.default_rng(seed)
  max_pages = -(-max(kv_lens) // page) + 1
  num_pages = b * max_pages + 3
  table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  kv_lens = np.asarray(kv_lens, np.int32)
  q_pos = kv_lens[:, None] - t + np.arange(t, dtype=np.int32)[None]
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  return (bf16(b, t, nh, dc), bf16(b, t, nh, dr), bf16(num_pages, page, dc + dr),
          jnp.asarray(table), jnp.asarray(q_pos), jnp.asarray(kv_lens))


# ---- the schedule ----

def test_schedule_covers_every_block_once_with_consecutive_slots_per_sequence():
  rng = np.random.default_rng(0)
  # (a few static configurations, many lengths each: one compile per configuration)
  for parts, overhead, min_blocks in [(1, 0, 1), (3, 2, 1), (7, 5, 2), (40, 2, 1), (40, 0, 3)]:
    schedule = jax.jit(lambda lens: sched.decode_schedule(
        lens, num_parts=parts, overhead_blocks=overhead, min_blocks_per_part=min_blocks))
    for _ in range(20):
      b = 12
      lens = rng.integers(0, 5000, b) * (rng.random(b) > 0.2)  # some sequences empty
      lens[rng.random(b) < 0.3] = rng.integers(0, 200)  # short ones
      s = schedule(jnp.asarray(lens, jnp.int32))
      segs = sched.segments(s)
      owner, slots, per_part = {}, set(), np.zeros(parts, int)
      for p, seq, first, steps in segs:
        for blk in range(first, first + steps):
          assert (seq, blk) not in owner
          owner[seq, blk] = p
        assert seq + p not in slots  # a segment's slot is b + p: never shared
        slots.add(seq + p)
        per_part[p] += steps + overhead
      blocks = -(-lens // sched.BLOCK_KV)
      assert len(owner) == blocks.sum()  # every block of every sequence, once
      assert max(slots, default=0) < sched.num_slots(b, parts)
      first_slot, count = np.asarray(s.first_slot), np.asarray(s.count)
      for seq in range(b):
        mine = sorted(seq + p for p, sq, _, _ in segs if sq == seq)
        assert mine == list(range(first_slot[seq], first_slot[seq] + count[seq]))
      # Balanced: no part carries more than its share plus one segment's overhead.
      width = max(-(-(blocks + overhead).sum() // parts), min_blocks)
      assert per_part.max() <= width + overhead


def test_schedule_spreads_one_long_sequence_over_all_parts():
  s = sched.decode_schedule(jnp.asarray([32768]), num_parts=132)
  segs = sched.segments(s)  # 512 blocks + 2 of overhead over 132 parts: 4 per part
  assert len(segs) == int(s.count[0]) == 129 and max(steps for *_, steps in segs) == 4
  # 64 sequences of 4k over 132 parts: 2 segments per part at most, 4096 blocks in all.
  segs = sched.segments(sched.decode_schedule(jnp.full((64,), 4096), num_parts=132))
  per_part = np.bincount([p for p, *_ in segs], minlength=132)
  assert per_part.max() == 2 and sum(steps for *_, steps in segs) == 64 * 64


def test_partial_rows():
  assert [sched.partial_rows(r) for r in (1, 8, 9, 24, 32, 33, 64, 65, 256)] == [
      8, 8, 16, 32, 32, 64, 64, 128, 256]


# ---- the kernels against the reference (interpret mode) ----

CASES = {
    # name: (B, T, nH, Dc, Dr, page, kv_lens, parts, partial dtype, combine chunk and rows
    # (interpret mode's time grows with the combine's CUDA blocks), races)
    # 8 heads (tensor:8): lengths 1, a 64-token boundary and 4k in one ragged batch; 16-token
    # pages (4 TMA copies per 64-token block); the 4k row split over the 5 parts.
    "h8_decode_len1_boundary_4k_page16_f32": (3, 1, 8, 128, 64, 16, [1, 64, 4096], 5,
                                              jnp.float32, 64, None, False),
    # Kimi K2.5's 512 + 64, an 8-head verify block (T = 4: 32 rows, two slots per combine
    # tile), bf16 partials, 32-column combine blocks.
    "k25_h8_verify_t4_bf16": (2, 4, 8, 512, 64, 64, [4, 130], 3, jnp.bfloat16, 32, 32, False),
    # 64 heads verify (T = 4: 256 rows, 4 query blocks side by side), races tracked.
    "h64_verify_t4_races": (2, 4, 64, 128, 64, 32, [40, 200], 3, jnp.bfloat16, 128, 64, True),
}


@pytest.mark.parametrize("name", CASES)
def test_decode_kernel_matches_reference(name):
  b, t, nh, dc, dr, page, kv_lens, parts, pdtype, chunk, rows, races = CASES[name]
  args = _inputs(len(name), b, t, nh, dc, dr, page, kv_lens)
  scale = (dc + dr) ** -0.5
  with gpu_interpret(detect_races=races):
    got = mla.mla_paged_attention(*args, softmax_scale=scale, kernel="decode", num_parts=parts,
                                  partial_dtype=pdtype, combine_chunk=chunk,
                                  combine_rows=rows)
  want = reference.mla_paged_attention(*args, softmax_scale=scale)
  assert got.shape == want.shape and got.dtype == want.dtype
  got = np.asarray(got, np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def _segment_attention(q, pages, table, limit, seq, first, steps, scale, dv):
  """float64 attention of one sequence's rows over blocks [first, first + steps): (context
  normalised over those keys, log-sum-exp), as a partial should hold."""
  kv = np.concatenate([pages[p] for p in table[seq]]).astype(np.float64)
  lo, hi = first * sched.BLOCK_KV, (first + steps) * sched.BLOCK_KV
  s = q[seq].astype(np.float64) @ kv[lo:hi].T * scale  # [R, keys]
  pos = np.arange(lo, hi)
  s = np.where(pos[None] < limit[seq][:, None], s, -np.inf)
  m = s.max(axis=1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  w = np.exp(s - m)
  den = w.sum(axis=1, keepdims=True)
  out = np.where(den > 0, w @ kv[lo:hi, :dv] / np.where(den > 0, den, 1.0), 0.0)
  lse = np.where(den[:, 0] > 0, m[:, 0] + np.log(np.where(den[:, 0] > 0, den[:, 0], 1.0)),
                 -np.inf)
  return out, lse


def test_partials_are_the_segments_attention_and_the_combine_merges_them():
  """The raw kernel outputs: each scheduled slot holds its segment's normalised context and
  log-sum-exp for the real rows; no other slot is written (NaN here: fresh interpreter memory
  is NaN); the combine kernel equals its XLA reference, zero for a sequence with no KV."""
  b, nh, dc, dr, page = 4, 2, 128, 64, 32  # 2 heads: 2 rows padded to 8 per sequence
  q_latent, q_rope, pages, table, _, kv_lens = _inputs(3, b, 1, nh, dc, dr, page,
                                                       [300, 1, 0, 129])
  rows = sched.partial_rows(nh)
  ql = jnp.pad(q_latent.reshape(b, nh, dc), ((0, 0), (0, rows - nh), (0, 0)))
  qr = jnp.pad(q_rope.reshape(b, nh, dr), ((0, 0), (0, rows - nh), (0, 0)))
  limit = jnp.pad(jnp.repeat(kv_lens[:, None], nh, axis=1), ((0, 0), (0, rows - nh)))
  s = sched.decode_schedule(kv_lens, num_parts=3, overhead_blocks=1)
  with gpu_interpret():
    partial, lse = mla_decode_mgpu.decode_partials(ql, qr, pages, table, limit, s,
                                                   softmax_scale=0.1)
    out = mla_combine_mgpu.combine_partials(partial, lse, s.first_slot, s.count,
                                            out_dtype=jnp.float32)
  partial, lse = np.asarray(partial), np.asarray(lse)
  q = np.concatenate([np.asarray(ql, np.float32), np.asarray(qr, np.float32)], -1)
  written = set()
  for part, seq, first, steps in sched.segments(s):
    slot = seq + part
    written.add(slot)
    want, want_lse = _segment_attention(q, np.asarray(pages, np.float32), np.asarray(table),
                                        np.asarray(limit), seq, first, steps, 0.1, dc)
    np.testing.assert_allclose(partial[slot], want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse[slot][:nh], want_lse[:nh], rtol=1e-3, atol=1e-3)
    assert np.isneginf(lse[slot][nh:]).all() and (partial[slot][nh:] == 0).all()  # padded rows
  assert int(s.count[0]) == 2 and len(written) == b  # the 300-token row split in two
  assert np.isnan(np.delete(lse, sorted(written), axis=0)).all()
  want = sched.combine_reference(jnp.asarray(partial), jnp.asarray(lse), s)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert (np.asarray(out)[2] == 0).all()  # no KV at all
  full = reference.mla_paged_attention(q_latent, q_rope, pages, table,
                                       kv_lens[:, None] - 1, kv_lens, softmax_scale=0.1)
  np.testing.assert_allclose(np.asarray(out)[:, :nh], np.asarray(full, np.float32)[:, 0],
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows,lens,parts,dtype,group_rows", [
    # 8 rows of 3 sequences: 32-column blocks, 8 slots per tile in one TMA copy; 79 slots
    # wrap the 8-tile ring (`auto_config`).
    (8, [5000, 64, 700], 96, jnp.float32, None),
    # 64 rows of few sequences: 8-row groups (`lane_rows`), 8 slots per tile, a copy per slot.
    pytest.param(64, [1200, 0], 7, jnp.bfloat16, None, marks=pytest.mark.slow),
    # (64-row groups, one slot per tile: the 64-head verify case above)
])
def test_combine_of_many_slots_matches_its_reference(rows, lens, parts, dtype, group_rows):
  """The combine alone, on random partials laid out by a real schedule (slots past the
  scheduled ones NaN, some rows unseen in some slots), against the XLA merge."""
  assert (group_rows or mla_combine_mgpu.lane_rows(len(lens), rows, 1)) == (group_rows or 8)
  s = sched.decode_schedule(jnp.asarray(lens), num_parts=parts, overhead_blocks=0)
  slots, dv = sched.num_slots(len(lens), parts), 64
  rng = np.random.default_rng(rows)
  partial = np.full((slots, rows, dv), np.nan, np.float32)
  lse = np.full((slots, rows), np.nan, np.float32)
  for part, seq, _, _ in sched.segments(s):
    partial[seq + part] = rng.standard_normal((rows, dv))
    lse[seq + part] = rng.normal(0.0, 3.0, rows)
    lse[seq + part, rng.random(rows) < 0.2] = -np.inf  # rows this split never saw
  for seq, part in [(0, 0)]:  # (a row unseen everywhere in the first sequence)
    first, n = int(s.first_slot[seq]), int(s.count[seq])
    lse[first:first + n, 3] = -np.inf
  partial = jnp.asarray(partial, dtype)
  with gpu_interpret():
    got = mla_combine_mgpu.combine_partials(partial, jnp.asarray(lse), s.first_slot, s.count,
                                            out_dtype=jnp.float32, group_rows=group_rows)
  want = np.asarray(sched.combine_reference(partial, jnp.asarray(lse), s))
  lanes = sched.BLOCK_Q // (group_rows or 8)
  stages = mla_combine_mgpu.auto_config(len(lens), rows, dv)[2]
  if rows != 64:  # (the first and last cases: more tiles than the ring has stages)
    assert int(s.count[0]) > stages * lanes
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert (np.asarray(got)[0, 3] == 0).all()
  if lens[-1] == 0:
    assert (np.asarray(got)[-1] == 0).all()


# ---- CUDA lowering at Kimi K2.5 shapes (no GPU needed) ----

@pytest.mark.parametrize("b,t,nh,page,max_pages,partials", [
    (1, 1, 8, 16, 256, jnp.float32),    # tensor:8 decode, 4k context, 16-token pages
    (64, 4, 8, 64, 128, jnp.bfloat16),  # tensor:8 verify of 3 drafts, 8k context
    (8, 4, 64, 64, 128, jnp.float32),   # 64 heads verify: 4 query blocks
    (1, 1, 64, 64, 2048, jnp.float32),  # 64 heads, 128k context
])
def test_decode_lowers_for_cuda(b, t, nh, page, max_pages, partials):
  s, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  fn = lambda *a: mla.mla_paged_attention(*a, softmax_scale=576 ** -0.5, partial_dtype=partials)
  calls = export_cuda_calls(fn, s((b, t, nh, 512), bf16), s((b, t, nh, 64), bf16),
                            s((4096, page, 576), bf16), s((b, max_pages), i32), s((b, t), i32),
                            s((b,), i32))
  assert calls.count(MOSAIC_CALL) == 2, calls  # the decode kernel and its combine


def test_what_the_decode_path_refuses():
  assert mla.decode_problem(8, 512, 64, 16, jnp.bfloat16) is None
  assert "512" in mla.decode_problem(1024, 512, 64, 64, jnp.bfloat16)  # a prefill chunk
  assert "Dc" in mla.decode_problem(8, 64, 16, 16, jnp.bfloat16)  # the demo model: flash
  assert "24" in mla.decode_problem(8, 512, 64, 24, jnp.bfloat16)
  assert "float32" in mla.decode_problem(8, 512, 64, 64, jnp.float32)
  args = _inputs(0, 1, 1, 4, 64, 16, 16, [20])
  with pytest.raises(ValueError, match="decode kernel does not apply"):
    mla.mla_paged_attention(*args, softmax_scale=0.1, kernel="decode")
  with pytest.raises(ValueError, match="kernel="):
    mla.mla_paged_attention(*args, softmax_scale=0.1, kernel="splitk")
