"""The W4A16 expert kernel (`w4a16_mgpu`, `int4_mlp_mgpu`): its register plan against Mosaic's own
layouts, interpret-mode equality with the dequantize-then-compute reference (groups 32 and 128,
K splits, 64-row slots, an expert shard), compressed-tensors' nibble order through the kernel,
the race detector, and the CUDA lowering at Kimi K2.5 shapes.

Interpret mode cannot run the register path (inline Mosaic code, WGMMA with a register
operand): there the kernel dequantizes each K step with `w4a16_layout.dequantize_step` (the same
tables, whole arrays) into SMEM and multiplies from there; everything else (producer and
consumer warpgroups, barriers, work units, splits, epilogues, the K permutation) is the code
the GPU runs. The register path is checked here by its plan (every thread, every register,
against Mosaic's `TiledLayout`s) and its lowering; the GPU protocol's `int4` stage
(`bench/protocol/int4.py`) checks it on a GPU.
"""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cuda_export import MOSAIC_CALL, export_cuda_calls, gpu_interpret
from engine.model import quantized
from jax.experimental.mosaic.gpu import fragmented_array as fa
from pallas_kernels.moe import int4_mlp_mgpu, moe_mgpu, w4a16_layout as layout
from pallas_kernels.moe import w4a16_mgpu
from pallas_kernels.quant import Int4Weight, dequantize
from quantized_moe_checks import assert_close, reference_f32, routed_problem

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURE = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "kimi_k25_int4")
SMALL = int4_mlp_mgpu.Int4Config(num_sms=2, max_stages=2)


def _int4(rng, e, k, n, group=32):
  """Random packed experts [E, K, N] (every nibble value), scales ~1/sqrt(k)."""
  packed = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
  scale = (0.5 + rng.random((e, k // group, n))) / (4.6 * np.sqrt(k))
  return Int4Weight(packed, jnp.asarray(scale, jnp.bfloat16))


def _problem(seed, t, e, k, h, i, group=32, ids=None):
  return routed_problem(seed, t, e, k, h, i, lambda *a: _int4(*a, group), ids)


# ---- the register plan (pure Python) -----------------------------------------------------------

def test_register_plan_matches_mosaic_layouts():
  # For every thread: the bytes `BYTE_LAYOUT` gives it, converted pair by pair, are exactly the
  # rows and K columns (in `permute_k` order) that `WGMMA_LAYOUT` says its A registers hold.
  byte, wgmma = layout.BYTE_MGPU_LAYOUT, fa.WGMMA_LAYOUT
  assert byte.registers_shape((64, 128)) == (1, 4, 1, 1, 2, 1, 1, 1, 1)
  assert wgmma.registers_shape((64, 64)) == (1, 8, 1, 1, 2, 1, 1, 1, 1)
  seen = set()
  for t in range(128):
    for c in range(4):
      for rh in range(2):
        for b in range(8):  # byte b of the thread's 8-byte load: word b // 4
          row, col = layout.thread_coords(byte, (64, 128), t, layout.byte_register(c, rh), b)
          assert col // 32 == c
          for half in range(2):  # low nibble: even input
            stored = 2 * (col - 32 * c) + half
            w, nib = divmod(8 * b + 4 * half, 32)
            pair, e = (nib // 4) % 4, nib // 16
            got = layout.thread_coords(wgmma, (64, 64), t,
                                       layout.wgmma_register(4 * w + pair, rh), e)
            assert got == (row, layout.k_column(stored)), (t, c, rh, b, half)
            seen.add((c, *got))
  assert len(seen) == 4 * 64 * 64  # every element of the 4 chunks, once


def _lop3(a, b, c, lut):
  """PTX lop3.b32 on uint32 arrays: bit = lut[(a << 2) | (b << 1) | c] per bit position."""
  out = np.zeros_like(a)
  for bit in range(32):
    idx = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
    out |= ((np.uint32(lut) >> idx) & 1) << bit
  return out


def test_register_conversion_ptx_is_compressed_tensors_product():
  # `_CONVERT_PAIR` emulated instruction by instruction on every word of 8 nibbles a shift
  # leaves (all 16 x 16 low/high nibble pairs) and a range of bf16 scales: the pair must be
  # (nibble - 8) * scale rounded to bf16 once, exactly `dequantize`'s product.
  ptx = layout._CONVERT_PAIR
  consts = [int(v, 16) for v in re.findall(r"0x[0-9A-Fa-f]+", ptx)]
  magic, mask, lut, bias = consts  # mov k, lop3 mask, lop3 lut, mov k (in program order)
  assert "lop3.b32 q, $1, " in ptx and "sub.bf16x2 q, q, k" in ptx and "mul.rn.bf16x2" in ptx
  lo, hi = np.meshgrid(np.arange(16, dtype=np.uint32), np.arange(16, dtype=np.uint32))
  word = (lo | hi << 16 | np.uint32(0xABC0_DEF0)).reshape(-1)  # junk in the other nibbles
  q = _lop3(word, np.uint32(mask), np.uint32(magic), lut)
  halves = np.stack([q & 0xFFFF, q >> 16], -1).astype(np.uint16).view(ml_dtypes.bfloat16)
  b = np.uint16(bias & 0xFFFF).view(ml_dtypes.bfloat16)
  assert bias >> 16 == bias & 0xFFFF
  diff = (halves.astype(np.float32) - np.float32(b)).astype(ml_dtypes.bfloat16)  # exact
  for scale in np.asarray([1.0, -0.5, 3.0e-3, 7.1e-5, 1.37], ml_dtypes.bfloat16):
    got = (diff.astype(np.float32) * np.float32(scale)).astype(ml_dtypes.bfloat16)
    want = ((np.stack([lo.reshape(-1), hi.reshape(-1)], -1).astype(np.int32) - 8)
            .astype(ml_dtypes.bfloat16) * scale).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_permute_k_is_the_plan_order():
  x = jnp.arange(3 * 128).reshape(3, 128)
  got = np.asarray(layout.permute_k(x))
  want = np.concatenate([np.asarray(x)[:, 64 * c + layout.K_ORDER] for c in range(2)], axis=1)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(layout.unpermute_k(layout.permute_k(x))), x)
  assert sorted(layout.K_ORDER) == list(range(64))
  assert layout.k_column(0) == 0 and layout.k_column(4) == 1 and layout.k_column(16) == 2


@pytest.mark.parametrize("group", [32, 128])
def test_dequantize_step_is_the_bf16_product_in_kernel_order(group):
  w = _int4(np.random.default_rng(group), 1, 256, 128, group)
  tile = layout.dequantize_step(w.packed[0], w.scale[0], group)  # [N, K] kernel order
  want = dequantize(w, jnp.bfloat16)[0].T  # [N, K] natural
  np.testing.assert_array_equal(np.asarray(layout.unpermute_k(tile)), np.asarray(want))


def test_split_choice_fills_the_sms_at_kimi_shapes():
  cfg = int4_mlp_mgpu.Int4Config()
  pick = lambda used, n, k_steps, bound: int(int4_mlp_mgpu.choose_splits(
      used, n // 128, k_steps, bound, cfg, xp=np))
  # 8 experts (batch 1, 384 experts): gate/up's 128 tiles fill 132 SMs; down's 448 in halves.
  assert pick(8, 2048, 28, 8) == 1 and pick(8, 7168, 8, 4) == 2
  # One expert on a device (an 8-way shard): its 16 tiles in 7 splits of 4 steps (8 splits
  # would take as long: 3-4 steps).
  assert pick(1, 2048, 28, 8) == 7
  assert pick(0, 2048, 28, 8) == 1
  assert int4_mlp_mgpu.split_candidates(8, 8) == list(range(1, 9))
  assert int4_mlp_mgpu.split_candidates(3, 8) == [1, 2, 3]  # a split has one K step at least
  # T = 64 (400 slots of 8): no split fits the partial budget, the kernel writes h itself.
  assert int4_mlp_mgpu.max_splits(400, 2, 2048, 8, 7168, cfg) == 1


# ---- interpret mode ----------------------------------------------------------------------------

CASES = {
    # name: (t, experts, top-k, hidden, expert width, group, config changes)
    "decode_1_token_group32": (1, 6, 2, 256, 128, 32, {}),
    # (group 128 and K splits: `test_kernel_has_no_races`)
    # 70 tokens: 64-row slots (K step 128 where the SMEM tile path needs it), one expert
    # taking every token (two slots, the second partial), others none.
    "prefill_70_tokens_one_hot_expert": (70, 5, 1, 256, 128, 32, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference(name):
  t, e, k, h, i, group, changes = CASES[name]
  ids = np.full((t, 1), 3) if name.startswith("prefill") else None
  args = _problem(len(name), t, e, k, h, i, group, ids)
  with gpu_interpret():
    got = int4_mlp_mgpu.moe_experts_int4(*args, cfg=dataclasses.replace(SMALL, **changes))
  assert_close(got, reference_f32(*args))


def test_expert_shard_and_unused_slots():
  # Experts 3..5 of 6 (global ids, offset 3): out-of-shard copies contribute zero; the kernel
  # pair skips slots >= num_slots without writing them (poisoned NaN unless masked).
  x, w, ids, wg, wu, wd = _problem(11, 2, 6, 3, 256, 128)
  shard = [v[3:] for v in (wg, wu, wd)]
  with gpu_interpret():
    got = int4_mlp_mgpu.moe_experts_int4(x, w, ids, *shard, expert_offset=3, cfg=SMALL)
  assert_close(got, reference_f32(x, w, ids, *shard, expert_offset=3))


@pytest.mark.slow
def test_reads_one_layer_of_stacked_experts():
  # A scanned stack hands the kernel its layers' experts, [L, E, ...] packed leaves, and the
  # layer's index: it reads that layer's experts in place (`permute.expert_pool`), as if given
  # that layer alone, an expert shard's offset applied; `moe_mgpu` passes the index through.
  x, w, ids, *layer1 = _problem(19, 3, 6, 2, 256, 128)
  _, _, _, *layer0 = _problem(20, 3, 6, 2, 256, 128)
  stacks = [jax.tree.map(lambda a, b: jnp.stack([a, b, a]), u, v) for u, v in zip(layer0, layer1)]
  with gpu_interpret():
    got = int4_mlp_mgpu.moe_experts_int4(x, w, ids, *(v[:, 2:] for v in stacks),
                                         expert_offset=2, layer=jnp.int32(1), cfg=SMALL)
    routed = moe_mgpu.moe_experts(x, w, ids, *stacks, layer=jnp.int32(1), num_sms=2)
  assert_close(got, reference_f32(x, w, ids, *(v[2:] for v in layer1), expert_offset=2))
  assert_close(routed, reference_f32(x, w, ids, *layer1))


def test_compressed_tensors_nibble_order_through_the_kernel():
  # Words packed by compressed-tensors' own `pack_to_int32` (the fixture's cases), loaded as the
  # engine loads them (`quantized.repack`), through the kernel with one-hot activations and unit
  # scales: every output is one weight, so it must be the library's int value exactly.
  cases = np.load(os.path.join(FIXTURE, "unpack_cases.npz"))
  values, words = cases["values_1"], cases["packed_1"]  # [5, 64] int, [5, 8] int32
  rows = np.arange(128) % values.shape[0]
  vals = np.concatenate([values[rows], -values[rows[::-1]]], axis=1)  # [128 out, 128 in]
  packed = np.concatenate([quantized.repack(words[rows]),
                           quantized.repack(words[rows[::-1]])], axis=1)
  # (the second half's words are the first half's, rows reversed; its values negated by a
  # -1 scale, so a swapped half shows)
  scale = np.ones((1, 4, 128), ml_dtypes.bfloat16)
  scale[:, 2:] = -1
  weight = Int4Weight(jnp.asarray(packed[None]), jnp.asarray(scale))
  pick = np.random.default_rng(0).permutation(128)[:16]
  xs = jnp.asarray(np.eye(128)[pick], jnp.bfloat16)  # 2 slots of 8 one-hot rows
  cfg = dataclasses.replace(SMALL, block_k=128)
  with gpu_interpret():
    got = w4a16_mgpu.expert_matmul(layout.permute_k(xs), (weight,), jnp.zeros((2,), jnp.int32),
                                   jnp.asarray([2, 1], jnp.int32), 8, cfg, final=True)
  got = np.asarray(got, np.float32)  # [2 slots, 128 out, 8]
  want = vals[:, pick].T.reshape(2, 8, 128).transpose(0, 2, 1)
  np.testing.assert_array_equal(got, want)


def test_dequantized_weights_are_bitwise_compressed_tensors_product():
  # One-hot activations: each output is one weight times 1, accumulated alone in f32, so the
  # kernel returns the bf16 product (nibble - 8) * scale exactly, for 2 K steps (the ring
  # wrapping) and slots of experts 2 and 0.
  rng = np.random.default_rng(21)
  k, n, nt = 512, 128, 8
  w = _int4(rng, 3, k, n)
  rows = np.stack([rng.permutation(k)[:nt] for _ in range(2)])  # [slots, nt] input rows
  xs = jnp.asarray(np.eye(k)[rows.reshape(-1)], jnp.bfloat16)
  slot_expert = jnp.asarray([2, 0], jnp.int32)
  with gpu_interpret():
    got = w4a16_mgpu.expert_matmul(layout.permute_k(xs), (w,), slot_expert,
                                   jnp.asarray([2, 1], jnp.int32), nt, SMALL, final=True)
  want = np.asarray(dequantize(w, jnp.bfloat16), np.float32)[np.asarray(slot_expert)[:, None],
                                                             rows]  # [slots, nt, n]
  np.testing.assert_array_equal(np.asarray(got, np.float32), want.transpose(0, 2, 1))


@pytest.mark.slow
def test_kernel_has_no_races():
  # Several units per simulated SM, 512 inputs = 2 K steps forced into 2 splits (f32 partials
  # summed outside), the SMEM ring wrapping around, group 128: the interpreter's race detector
  # over producer, consumers and the epilogue stores, and equality with the reference.
  args = _problem(13, 3, 4, 2, 512, 256, group=128)
  with gpu_interpret(detect_races=True):
    out = jax.block_until_ready(int4_mlp_mgpu.moe_experts_int4(
        *args, cfg=dataclasses.replace(SMALL, splits=2)))
  assert_close(out, reference_f32(*args))


def test_refuses_what_it_cannot_compute():
  x, w, ids, wg, wu, wd = _problem(1, 2, 4, 2, 256, 128)
  with pytest.raises(NotImplementedError, match="bf16"):
    int4_mlp_mgpu.moe_experts_int4(x.astype(jnp.float32), w, ids, wg, wu, wd)
  x, w, ids, wg, wu, wd = _problem(1, 2, 4, 2, 256, 128, group=8)
  with pytest.raises(NotImplementedError, match="group 8"):
    moe_mgpu.moe_experts(x, w, ids, wg, wu, wd)
  x, w, ids, wg, wu, wd = _problem(1, 2, 4, 2, 64, 128)
  with pytest.raises(NotImplementedError, match="multiples of 128"):
    moe_mgpu.moe_experts(x, w, ids, wg, wu, wd)
  assert int4_mlp_mgpu.problem(jnp.bfloat16, *_problem(1, 2, 4, 2, 256, 128)[3:]) is None


# ---- lowering for CUDA at Kimi K2.5 shapes -----------------------------------------------------

KIMI_H, KIMI_I, KIMI_K = 7168, 2048, 8


def _spec(e, k, n):
  s = jax.ShapeDtypeStruct
  return Int4Weight(s((e, n, k // 2), jnp.uint8), s((e, k // 32, n), jnp.bfloat16))


@pytest.mark.parametrize("t,e,offset,a_operand", [(1, 384, 0, "registers"),
                                                  (8, 384, 0, "registers"),
                                                  (64, 384, 0, "registers"),
                                                  (1, 48, 96, "registers"),
                                                  (8, 384, 0, "smem")])
def test_lowers_for_cuda_at_kimi_shapes(t, e, offset, a_operand):
  s = jax.ShapeDtypeStruct
  cfg = int4_mlp_mgpu.Int4Config(a_operand=a_operand)
  calls = export_cuda_calls(
      lambda *a: int4_mlp_mgpu.moe_experts_int4(*a, expert_offset=offset, cfg=cfg),
      s((t, KIMI_H), jnp.bfloat16), s((t, KIMI_K), jnp.float32), s((t, KIMI_K), jnp.int32),
      _spec(e, KIMI_H, KIMI_I), _spec(e, KIMI_H, KIMI_I), _spec(e, KIMI_I, KIMI_H))
  assert calls.count(MOSAIC_CALL) == 2, calls  # gate/up (+ SwiGLU), down


def test_gpu_check_sweeps_configurations_the_kernel_takes():
  # The protocol's int4 stage runs on a GPU without a second chance: every configuration it
  # sweeps must exist and pass the kernel's own checks at K2.5 shapes (its dry run lowers each).
  from bench.protocol import int4
  ws = (_spec(384, KIMI_H, KIMI_I), _spec(384, KIMI_H, KIMI_I), _spec(384, KIMI_I, KIMI_H))
  for changes in int4.sweep(real=True) + int4.SWEEP_T8:
    cfg = int4_mlp_mgpu.Int4Config(**changes)
    assert int4_mlp_mgpu.problem(jnp.bfloat16, *ws, cfg) is None, changes
  assert {"a_operand": "smem"} in int4.sweep(real=True)
