"""The W4A16 Mosaic GPU expert kernel (`pallas_kernels/moe/int4_mlp_mgpu.py`) on packed INT4
experts: GPU interpret mode on CPU against the dequantize-then-compute reference, and the CUDA
lowering (an abstract H200) of the kernel at Kimi K2.5 shapes and of the MoE layer that uses it.

Interpret mode poisons unwritten memory with NaN, so a kernel that skips part of a tile fails.
The references take the same dequantized weights (compressed-tensors' bf16 product) in float32:
the kernel's only roundings are bf16 h between the two kernels and its bf16 output.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # races, state reset
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.expert_bytes import INT4
from cuda_export import H200, MOSAIC_CALL, export_cuda_calls
from engine.model.config import config_from_dict
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import init_params
from engine.model.transformer import moe as moe_layer
from model_configs import CONFIGS
from pallas_kernels.moe import int4_mlp_mgpu, moe_mgpu, reference
from pallas_kernels.quant import Int4Weight, dequantize

jax.config.update("jax_default_matmul_precision", "highest")

SMALL = int4_mlp_mgpu.Int4Config(block_k=128, max_concurrent_steps=2, num_sms=3)
TOL = 2e-2  # of the reference's largest magnitude: bf16 h and output


@contextlib.contextmanager
def gpu_interpret(detect_races: bool = False):
  interpret_pallas_call.gpu_callbacks.reset_gpu_interpret_mode_state()
  with jax.sharding.use_abstract_mesh(H200), plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=detect_races)):
    yield


def _int4(rng, e, k, n, group=32):
  """Random packed experts: every nibble value, scales ~1/sqrt(k) (so outputs stay O(1))."""
  packed = jnp.asarray(rng.integers(0, 256, (e, k // 2, n)), jnp.uint8)
  scale = (0.5 + rng.random((e, k // group, n))) / (4.6 * np.sqrt(k))
  return Int4Weight(packed, jnp.asarray(scale, jnp.bfloat16))


def _problem(seed, t, e, k, h, i, group=32, ids=None):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  if ids is None:
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
  w = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
  ws = (_int4(rng, e, h, i, group), _int4(rng, e, h, i, group), _int4(rng, e, i, h, group))
  return x, w, jnp.asarray(ids, jnp.int32), *ws


def _reference_f32(x, w, ids, wg, wu, wd, expert_offset=0):
  deq = [dequantize(v, jnp.float32) for v in (wg, wu, wd)]
  return reference.moe_experts_dense(x.astype(jnp.float32), w, ids, *deq,
                                     expert_offset=expert_offset)


def _assert_close(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all(), "kernel left output unwritten (NaN poison)"
  scale = np.abs(want).max()
  assert scale > 0
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * scale)


CASES = {
    # name: (t, experts, top-k, hidden, expert width, group, block_k, expert ids or None)
    "decode_1_token": (1, 6, 2, 128, 128, 32, 128, None),
    "decode_5_tokens_bk256": (5, 6, 3, 256, 256, 32, 256, None),
    "decode_group_128": (3, 4, 2, 128, 256, 128, 128, None),
    # 70 tokens: 64-row slots; expert 4 takes every token (two slots), 1 takes every token,
    # the others none.
    "prefill_one_huge_group_empty_experts": (70, 6, 2, 128, 128, 32, 128, "4,1"),
    "prefill_ragged": (90, 8, 3, 128, 256, 32, 128, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_int4_kernel_equals_reference(name):
  t, e, k, h, i, group, bk, ids = CASES[name]
  ids = None if ids is None else np.tile([int(v) for v in ids.split(",")], (t, 1))
  args = _problem(hash(name) % 1000, t, e, k, h, i, group, ids)
  cfg = dataclasses.replace(SMALL, block_k=bk)
  with gpu_interpret():
    got = int4_mlp_mgpu.moe_experts_int4(*args, cfg=cfg)
  _assert_close(got, _reference_f32(*args))


@pytest.mark.parametrize("t", [3, 70])
def test_int4_kernel_expert_shards_sum_to_whole(t):
  x, w, ids, wg, wu, wd = _problem(11, t, 6, 3, 128, 128)
  parts = []
  for s in (0, 3):
    shard = [v[s:s + 3] for v in (wg, wu, wd)]
    with gpu_interpret():
      part = int4_mlp_mgpu.moe_experts_int4(x, w, ids, *shard, expert_offset=s, cfg=SMALL)
    _assert_close(part, _reference_f32(x, w, ids, *shard, expert_offset=s))
    parts.append(np.asarray(part, np.float32))
  _assert_close(sum(parts), _reference_f32(x, w, ids, wg, wu, wd))


def test_int4_swiglu_skips_unused_slots_and_equals_its_reference():
  # Hand-made layout: slots 0..2 used (experts 2, 0, 2), slot 3 not.
  rng = np.random.default_rng(5)
  nt = 16
  xs = jnp.asarray(rng.standard_normal((4 * nt, 128)), jnp.bfloat16)
  *_, wg, wu, wd = _problem(5, 1, 4, 1, 128, 128)
  slot_expert = jnp.asarray([2, 0, 2, 3], jnp.int32)
  num_slots = jnp.asarray([3], jnp.int32)
  with gpu_interpret():
    raw = np.asarray(int4_mlp_mgpu._int4_swapped_matmul(
        int4_mlp_mgpu.permute_k(xs, 128), (wg, wu), slot_expert, num_slots, nt, SMALL),
        np.float32)
    got = int4_mlp_mgpu.int4_swiglu(xs, slot_expert, num_slots, wg, wu, wd, nt, SMALL)
  assert np.isnan(raw[3]).all() and np.isfinite(raw[:3]).all()  # slot 3's weights never read
  want = int4_mlp_mgpu.int4_swiglu_reference(xs, slot_expert, num_slots, wg, wu, wd, nt)
  _assert_close(got, want)
  assert not np.asarray(got)[3 * nt:].any()


def test_int4_kernel_has_no_races():
  # Several work items per simulated SM: the double-buffered bf16 tile, SMEM reuse across
  # items and TMA/WGMMA ordering, checked by the interpreter's race detector.
  args = _problem(13, 5, 6, 3, 256, 128)
  with gpu_interpret(detect_races=True):
    out = jax.block_until_ready(int4_mlp_mgpu.moe_experts_int4(*args, cfg=SMALL))
  assert not interpret_pallas_call.get_races().races_found
  _assert_close(out, _reference_f32(*args))


def test_int4_kernel_refuses_what_it_cannot_compute():
  x, w, ids, wg, wu, wd = _problem(1, 2, 4, 2, 128, 128)
  with pytest.raises(NotImplementedError, match="bf16"):
    int4_mlp_mgpu.moe_experts_int4(x.astype(jnp.float32), w, ids, wg, wu, wd)
  with pytest.raises(ValueError, match="block_k"):
    int4_mlp_mgpu.moe_experts_int4(x, w, ids, wg, wu, wd,
                                   cfg=dataclasses.replace(SMALL, block_k=256))
  x, w, ids, wg, wu, wd = _problem(1, 2, 4, 2, 64, 128)  # hidden 64: not a whole K step
  with pytest.raises(NotImplementedError, match="multiples of 128"):
    moe_mgpu.moe_experts(x, w, ids, wg, wu, wd)


# ---- the MoE layer through the engine's switch ------------------------------------------------

def _int4_moe_config():
  d = dict(CONFIGS["deepseek_v3"], hidden_size=128, moe_intermediate_size=128,
           intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2)
  return dataclasses.replace(config_from_dict(d), int4=INT4)


def test_moe_layer_with_int4_experts_uses_the_kernel_and_equals_reference():
  cfg = _int4_moe_config()
  params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
  p = params["layers"][1]["moe"]
  assert isinstance(p["experts"]["gate"], Int4Weight)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 3, cfg.hidden_size)),
                  jnp.bfloat16)
  f32 = jax.tree.map(lambda v: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v, p)
  want = moe_layer(f32, x.astype(jnp.float32), cfg, REFERENCE)
  with gpu_interpret():
    got = moe_layer(p, x, cfg, KernelChoice(moe="mosaic_gpu"))
  _assert_close(got, want)


# ---- lowering for CUDA at Kimi K2.5 shapes -----------------------------------------------------

KIMI_H, KIMI_I, KIMI_K = 7168, 2048, 8


def _int4_spec(e, k, n):
  s = jax.ShapeDtypeStruct
  return Int4Weight(s((e, k // 2, n), jnp.uint8), s((e, k // 32, n), jnp.bfloat16))


@pytest.mark.parametrize("t,e,offset", [(1, 384, 0), (64, 384, 0), (512, 48, 96)])
def test_int4_moe_experts_lowers_for_cuda_at_kimi_shapes(t, e, offset):
  s = jax.ShapeDtypeStruct
  calls = export_cuda_calls(
      lambda *a: moe_mgpu.moe_experts(*a, expert_offset=offset),
      s((t, KIMI_H), jnp.bfloat16), s((t, KIMI_K), jnp.float32), s((t, KIMI_K), jnp.int32),
      _int4_spec(e, KIMI_H, KIMI_I), _int4_spec(e, KIMI_H, KIMI_I), _int4_spec(e, KIMI_I, KIMI_H))
  assert calls.count(MOSAIC_CALL) == 2, calls  # gate/up + SwiGLU, down


def test_int4_moe_layer_lowers_for_cuda():
  cfg = _int4_moe_config()
  p = init_params(cfg, seed=3, dtype=jnp.bfloat16)["layers"][1]["moe"]
  specs = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), p)
  x = jax.ShapeDtypeStruct((2, 4, cfg.hidden_size), jnp.bfloat16)
  calls = export_cuda_calls(lambda p, x: moe_layer(p, x, cfg, KernelChoice(moe="mosaic_gpu")),
                            specs, x)
  assert calls.count(MOSAIC_CALL) == 2, calls
  assert export_cuda_calls(lambda p, x: moe_layer(p, x, cfg, REFERENCE),
                           specs, x).count(MOSAIC_CALL) == 0
