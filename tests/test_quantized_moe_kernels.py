"""The quantized-expert Mosaic GPU kernels through the engine: W8A16 on FP8 block-scaled experts
(`fp8_mlp_mgpu`) in GPU interpret mode on CPU against the dequantize-then-compute reference, the
MoE layer with INT4 (the W4A16 kernel itself: `tests/test_w4a16_mgpu.py`) and FP8 experts, and
the CUDA lowering (an abstract H200) of each kernel pair at Kimi K2.5 shapes.

Interpret mode poisons unwritten memory with NaN, so a kernel that skips part of a tile fails.
The references take the same dequantized weights (INT4: compressed-tensors' bf16 product; FP8:
the float32 product rounded to bf16, as the kernels do) in float32: the kernels' only other
roundings are bf16 h between the two kernels and their bf16 output.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.expert_bytes import INT4
from cuda_export import MOSAIC_CALL, export_cuda_calls, gpu_interpret
from engine.model.cache import init_cache
from engine.model.config import config_from_dict
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import init_params, layer_params
from engine.model.transformer import forward, moe as moe_layer
from model_configs import CONFIGS
from quantized_moe_checks import assert_close, reference_f32, routed_problem
from pallas_kernels.moe import dequant_mlp_mgpu, fp8_mlp_mgpu, moe_mgpu
from pallas_kernels.quant import Fp8Weight, Int4Weight, dequantize

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep

jax.config.update("jax_default_matmul_precision", "highest")

SMALL = dequant_mlp_mgpu.DequantConfig(block_k=128, max_concurrent_steps=2, num_sms=3)


def _fp8(rng, e, k, n):
  w = jnp.asarray(np.clip(rng.standard_normal((e, k, n)) * 32, -448, 448), jnp.float8_e4m3fn)
  scale = (0.5 + rng.random((e, k // 128, -(-n // 128)))) / (32 * np.sqrt(k))
  return Fp8Weight(w, jnp.asarray(scale, jnp.float32))


def _fp8_problem(seed, t, e, k, h, i, ids=None):
  return routed_problem(seed, t, e, k, h, i, _fp8, ids)


@pytest.mark.slow
def test_kernel_reads_one_layer_of_stacked_fp8_experts():
  """A scanned stack's FP8 experts, [L, E, ...] leaves, and a layer index: the W8A16 kernels
  read that layer's experts in place (`permute.expert_pool`), as if given it alone; an expert
  shard's offset still applies. (INT4: `test_w4a16_mgpu`.)"""
  x, w, ids, *layer1 = _fp8_problem(19, 3, 6, 2, 128, 128)
  _, _, _, *layer0 = _fp8_problem(20, 3, 6, 2, 128, 128)
  stacks = [jax.tree.map(lambda a, b: jnp.stack([a, b]), u, v) for u, v in zip(layer0, layer1)]
  with gpu_interpret():
    got = moe_mgpu.moe_experts(x, w, ids, *stacks, layer=jnp.int32(1))
    shard = fp8_mlp_mgpu.moe_experts_fp8(x, w, ids, *(v[:, 2:] for v in stacks),
                                         expert_offset=2, layer=jnp.int32(1), cfg=SMALL)
  assert_close(got, reference_f32(x, w, ids, *layer1))
  assert_close(shard, reference_f32(x, w, ids, *(v[2:] for v in layer1), expert_offset=2))


# ---- FP8 (W8A16) ---------------------------------------------------------------------------

FP8_CASES = {
    # name: (t, experts, top-k, hidden, expert width, block_k, expert ids or None)
    "decode_1_token_bk256": (1, 6, 2, 256, 256, 256, None),  # two scale rows per K step
    "prefill_one_huge_group_empty_experts": (70, 6, 2, 256, 128, 128, "4,1"),
}

@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_kernel_equals_reference(name):
  t, e, k, h, i, bk, ids = FP8_CASES[name]
  ids = None if ids is None else np.tile([int(v) for v in ids.split(",")], (t, 1))
  args = _fp8_problem(hash(name) % 1000, t, e, k, h, i, ids)
  with gpu_interpret():
    got = fp8_mlp_mgpu.moe_experts_fp8(*args, cfg=dataclasses.replace(SMALL, block_k=bk))
  assert_close(got, reference_f32(*args))


def test_fp8_dequantized_tiles_are_bitwise_the_reference_weights():
  # One-hot activations pick single weight rows: each output is one bf16 weight times 1,
  # accumulated alone in f32, so the kernel must return the reference's dequantized weights
  # exactly (the float32 product, then bf16), every input row k of both K steps included.
  rng = np.random.default_rng(21)
  k, n, nt = 256, 128, 64
  w = _fp8(rng, 3, k, n)
  rows = np.stack([rng.permutation(k)[:nt] for _ in range(2)])  # [slots, nt] input rows
  xs = jnp.asarray(np.eye(k)[rows.reshape(-1)], jnp.bfloat16)  # [2 * nt, k]
  slot_expert = jnp.asarray([2, 0], jnp.int32)
  used = jnp.asarray([2], jnp.int32)
  with gpu_interpret():
    got = fp8_mlp_mgpu._fp8_swapped_matmul(xs, (w,), slot_expert, used, nt, SMALL)
  want = np.asarray(dequantize(w, jnp.bfloat16), np.float32)[np.asarray(slot_expert)[:, None],
                                                             rows]  # [slots, nt, n]
  np.testing.assert_array_equal(np.asarray(got, np.float32), want.transpose(0, 2, 1))


def test_fp8_matmul_half_scale_block_and_shard():
  # N = 192: the last 64-column tile is the first half of a 128-column scale block, whose
  # second half does not exist; experts 3.. of a shard (offset scales index by local expert).
  rng = np.random.default_rng(8)
  wt = _fp8(rng, 5, 128, 192)[2:]
  nt = 8
  xs = jnp.asarray(rng.standard_normal((2 * nt, 128)), jnp.bfloat16)
  slot_expert = jnp.asarray([2, 0], jnp.int32)
  with gpu_interpret():
    got = fp8_mlp_mgpu._fp8_swapped_matmul(xs, (wt,), slot_expert, jnp.asarray([2], jnp.int32),
                                           nt, SMALL)
  deq = dequantize(wt, jnp.bfloat16).astype(jnp.float32)
  want = jnp.einsum("stk,skn->snt", xs.astype(jnp.float32).reshape(2, nt, 128),
                    deq[slot_expert])
  assert_close(got, want)


def test_fp8_kernel_refuses_other_blocks():
  x, w, ids, wg, wu, wd = _fp8_problem(2, 2, 4, 2, 128, 128)
  other = Fp8Weight(wg.w, wg.scale_inv, block=(64, 128))
  with pytest.raises(NotImplementedError, match="128 x 128"):
    fp8_mlp_mgpu.moe_experts_fp8(x, w, ids, other, wu, wd)


# ---- the MoE layer through the engine's switch ------------------------------------------------

def _quantized_moe_config(fmt):
  d = dict(CONFIGS["deepseek_v3"], hidden_size=128, moe_intermediate_size=128,
           intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2)
  cfg = config_from_dict(d)
  if fmt == "int4":
    return dataclasses.replace(cfg, int4=INT4)
  return dataclasses.replace(cfg, fp8_experts=(128, 128))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_moe_layer_with_quantized_experts_uses_the_kernel_and_equals_reference(fmt):
  cfg = _quantized_moe_config(fmt)
  params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
  p = layer_params(cfg, params, 1)["moe"]
  assert isinstance(p["experts"]["gate"], Int4Weight if fmt == "int4" else Fp8Weight)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 3, cfg.hidden_size)),
                  jnp.bfloat16)
  # (the reference in float32; FP8 experts as the bf16 weights the kernel multiplies)
  f32 = jax.tree.map(lambda v: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v, p)
  if fmt == "fp8":
    f32["experts"] = {n: dequantize(v, jnp.bfloat16).astype(jnp.float32)
                      for n, v in p["experts"].items()}
  want = moe_layer(f32, x.astype(jnp.float32), cfg, REFERENCE)
  with gpu_interpret():
    got = moe_layer(p, x, cfg, KernelChoice(moe="mosaic_gpu"))
  assert_close(got, want)


# ---- lowering for CUDA at Kimi K2.5 shapes -----------------------------------------------------

KIMI_H, KIMI_I, KIMI_K = 7168, 2048, 8


def _spec(fmt, e, k, n):
  s = jax.ShapeDtypeStruct
  if fmt == "int4":
    return Int4Weight(s((e, n, k // 2), jnp.uint8), s((e, k // 32, n), jnp.bfloat16))
  return Fp8Weight(s((e, k, n), jnp.float8_e4m3fn), s((e, k // 128, n // 128), jnp.float32))


@pytest.mark.parametrize("fmt,t,e,offset", [("int4", 1, 384, 0), ("int4", 64, 384, 0),
                                            ("int4", 512, 48, 96), ("fp8", 8, 384, 0),
                                            ("fp8", 512, 48, 96)])
def test_quantized_moe_experts_lower_for_cuda_at_kimi_shapes(fmt, t, e, offset):
  s = jax.ShapeDtypeStruct
  calls = export_cuda_calls(
      lambda *a: moe_mgpu.moe_experts(*a, expert_offset=offset),
      s((t, KIMI_H), jnp.bfloat16), s((t, KIMI_K), jnp.float32), s((t, KIMI_K), jnp.int32),
      _spec(fmt, e, KIMI_H, KIMI_I), _spec(fmt, e, KIMI_H, KIMI_I), _spec(fmt, e, KIMI_I, KIMI_H))
  assert calls.count(MOSAIC_CALL) == 2, calls  # gate/up + SwiGLU, down


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_moe_layer_lowers_for_cuda(fmt):
  cfg = _quantized_moe_config(fmt)
  p = layer_params(cfg, init_params(cfg, seed=3, dtype=jnp.bfloat16), 1)["moe"]
  specs = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), p)
  x = jax.ShapeDtypeStruct((2, 4, cfg.hidden_size), jnp.bfloat16)
  calls = export_cuda_calls(lambda p, x: moe_layer(p, x, cfg, KernelChoice(moe="mosaic_gpu")),
                            specs, x)
  assert calls.count(MOSAIC_CALL) == 2, calls
  assert export_cuda_calls(lambda p, x: moe_layer(p, x, cfg, REFERENCE),
                           specs, x).count(MOSAIC_CALL) == 0


def test_int4_decode_forward_lowers_for_cuda():
  # A whole decode forward (T = 1, 4 rows) with INT4 experts: every MoE layer's experts go
  # through the W4A16 kernel pair, lowered once for all of them (`kernels.py`: identical calls
  # share one jit); the rest is plain JAX.
  cfg = _quantized_moe_config("int4")
  params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
  spec = lambda tree: jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), tree)
  b, pages, ps = 4, 8, 16
  cache = init_cache(cfg, pages, ps, jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  fwd = jax.jit(lambda *a: forward(*a, cfg=cfg, impl=KernelChoice(moe="mosaic_gpu")))
  calls = export_cuda_calls(fwd, spec(params), spec(cache), i32(b, 1), i32(b), i32(b),
                            i32(b, pages // b))
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
  assert n_moe > 1 and calls.count(MOSAIC_CALL) == 2, calls


@pytest.mark.slow
@pytest.mark.parametrize("fmt,mode", [("int4", "psum"), ("int4", "dispatch"), ("bf16", "psum")])
def test_experts_split_over_8_h200s_lower_for_cuda(fmt, mode):
  # Expert parallelism over an abstract mesh of 8 H200s (expert:8): each device's kernel pair
  # gets its 48 experts (INT4: still packed, both leaves split by whole experts). The psum
  # path's per-device expert offset once broke tracing (searchsorted in `permute`), bf16 too.
  from jax.sharding import NamedSharding, PartitionSpec as P
  from engine.model import expert_parallel, sharding
  mesh = jax.sharding.AbstractMesh((1, 8, 1), sharding.MESH_AXES,
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3,
                                   abstract_device=jax.sharding.AbstractDevice(
                                       device_kind="NVIDIA H200", platform="gpu",
                                       num_cores=132))
  t, e = 64, 384
  tok = NamedSharding(mesh, P(("data", "expert", "tensor")) if mode == "dispatch" else P())
  exp = NamedSharding(mesh, P(("expert", "tensor")))
  s = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
  if fmt == "int4":
    w = lambda k, n: Int4Weight(s((e, n, k // 2), jnp.uint8, exp),
                                s((e, k // 32, n), jnp.bfloat16, exp))
  else:
    w = lambda k, n: s((e, k, n), jnp.bfloat16, exp)
  impl = KernelChoice(moe="mosaic_gpu", expert_parallel=mode)

  def fn(x, w, ids, gate, up, down):
    return expert_parallel.routed_experts(impl, x, w, ids, dict(gate=gate, up=up, down=down))

  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c)
                         for c in (MOSAIC_CALL, "ragged_all_to_all")])(
            s((t, KIMI_H), jnp.bfloat16, tok), s((t, KIMI_K), jnp.float32, tok),
            s((t, KIMI_K), jnp.int32, tok), w(KIMI_H, KIMI_I), w(KIMI_H, KIMI_I),
            w(KIMI_I, KIMI_H))
  text = exported.mlir_module()
  assert exported.nr_devices == 8
  assert text.count(f"custom_call @{MOSAIC_CALL}") == 2
  if fmt == "int4":
    assert "tensor<48x2048x3584xui8>" in text  # a device's packed gate / up
