"""FP8 block-quantized weights (DeepSeek-V3 / Kimi-K2-Instruct) kept as float8_e4m3fn + float32
weight_scale_inv on the device, against the same checkpoint dequantized at load.

The checkpoint: a tiny DeepSeek-V3 whose every linear is FP8 with a float32 scale per 32 x 32
block (`weight_block_size` [32, 32]; real checkpoints use 128: the block is a parameter). By
default `engine.load` keeps every FP8 linear FP8 (routed experts, attention projections,
dense and shared MLPs); an explicit dtype dequantizes everything at load as before. Both give bitwise the
same expert weights where a program uses them (the float32 product w * scale_inv, then the
compute dtype), so the forwards can differ only by the expert formulation's float32
accumulation order (kept experts run one expert / tile at a time): logits must agree within
1e-5 relative in float32 (measured: bitwise equal, float32 and bf16), greedy tokens identical.
"""

import functools
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import engine
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import config_from_dict
from engine.model.hf_export import hf_tensors
from engine.model.hf_loader import checkpoint_config, load_hf_params
from engine.model.params import init_params, layer_params
from engine.model.safetensors_io import load_file
from engine.model.transformer import forward_logits
from pallas_kernels.quant import Fp8Weight, dequantize
from tests import hf_fixtures as fx
from tests.generation import generate_ids, loaded
from tests.hf_fixtures import BF16, quantize_fp8, write_checkpoint

jax.config.update("jax_default_matmul_precision", "highest")
BLOCK = (32, 32)
E, H, IM = 8, 64, 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  cfg_dict = dict(fx.DEEPSEEK_V3, quantization_config={
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": list(BLOCK)})
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg, seed=2, scale=2.0), dtype=BF16)
  for name in list(tensors):
    if name.endswith("_proj.weight") or name.endswith("proj_with_mqa.weight"):
      q, s = quantize_fp8(tensors[name].astype(np.float32), BLOCK)
      tensors[name], tensors[name + "_scale_inv"] = q, s
  out = str(tmp_path_factory.mktemp("fp8") / "dsv3_fp8")
  write_checkpoint(cfg_dict, tensors, out, shards=3)
  return out


def _logits(cfg, params, dtype):
  tokens = np.array([[1, 17, 42, 99, 5, 230, 7, 8], [1, 3, 250, 9, 0, 0, 0, 0]], np.int32)
  lens = np.array([8, 4], np.int32)
  pt = contiguous_page_table(2, 16, 8)
  out, _ = forward_logits(params, init_cache(cfg, pt.size, 8, dtype), jnp.asarray(tokens),
                          jnp.zeros(2, jnp.int32), jnp.asarray(lens), jnp.asarray(pt), cfg=cfg)
  return np.asarray(out, np.float64)


def test_engine_load_keeps_fp8_experts(ckpt, caplog):
  with caplog.at_level(logging.INFO, logger="moejax"):
    kept = engine.load(ckpt, progress=False)
  assert kept.config.fp8_experts == BLOCK
  for i in (1, 2):
    for name, (k, n) in (("gate", (H, IM)), ("up", (H, IM)), ("down", (IM, H))):
      w = layer_params(kept.config, kept.params, i)["moe"]["experts"][name]
      assert isinstance(w, Fp8Weight) and w.block == (32, 32)
      assert w.w.dtype == jnp.float8_e4m3fn and w.w.shape == (E, k, n)
      assert w.scale_inv.dtype == jnp.float32 and w.scale_inv.shape == (E, k // 32, n // 32)
      assert w.nbytes == E * k * n + 4 * E * (k // 32) * (n // 32)
  assert kept.config.fp8_dense
  layer = functools.partial(layer_params, kept.config, kept.params)
  o = layer(1)["attn"]["o"]  # [nH, dv, H]: two input axes flattened in HF
  assert isinstance(o, Fp8Weight) and o.w.dtype == jnp.float8_e4m3fn and o.w.shape == (4, 12, 64)
  assert o.scale_inv.shape == (2, 2) and (o.lead, o.n_in) == (0, 2)
  for leaf in (layer(0)["mlp"]["gate"], layer(2)["moe"]["shared"]["down"], layer(0)["attn"]["q_b"]):
    assert isinstance(leaf, Fp8Weight) and leaf.w.dtype == jnp.float8_e4m3fn
  assert kept.params["embed"].dtype == jnp.bfloat16  # not a linear: never FP8 in checkpoints
  mem = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine.load")]
  assert len(mem) == 1 and "fp8 experts" in mem[0] and "fp8 " in mem[0], mem
  assert "bfloat16" in mem[0], mem
  plain = engine.load(ckpt, dtype="bfloat16", progress=False)  # explicit: dequantized at load
  assert plain.config.fp8_experts is None
  assert layer_params(plain.config, plain.params, 1)["moe"]["experts"]["gate"].dtype == jnp.bfloat16


def test_kept_weights_equal_load_time_dequant_bitwise(ckpt):
  cfg_kept = checkpoint_config(ckpt, keep_fp8=True)
  kept = load_hf_params(ckpt, cfg_kept, dtype=jnp.float32, progress=False)
  plain = load_hf_params(ckpt, checkpoint_config(ckpt), dtype=jnp.float32, progress=False)
  flat_kept = jax.tree_util.tree_flatten_with_path(
      kept, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]
  flat_plain = dict(jax.tree_util.tree_flatten_with_path(plain)[0])
  n_fp8 = 0
  for path, leaf in flat_kept:
    want = np.asarray(flat_plain[path])
    if isinstance(leaf, Fp8Weight):
      n_fp8 += 1
      leaf = jax.jit(lambda w: dequantize(w, jnp.float32))(leaf)
    np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=jax.tree_util.keystr(path))
  # Stacked (the dense layer; the 2 MoE layers): 3 experts leaves + 2 stacks x 5 attention
  # linears + 3 dense + 3 shared
  assert n_fp8 == 3 + 10 + 3 + 3


@pytest.mark.slow
def test_kept_forward_equals_dequantized_at_load(ckpt):
  cfg_kept, cfg_plain = checkpoint_config(ckpt, keep_fp8=True), checkpoint_config(ckpt)
  kept = load_hf_params(ckpt, cfg_kept, dtype=jnp.float32, progress=False)
  plain = load_hf_params(ckpt, cfg_plain, dtype=jnp.float32, progress=False)
  a, b = _logits(cfg_kept, kept, jnp.float32), _logits(cfg_plain, plain, jnp.float32)
  rel = np.abs(a - b).max() / np.abs(b).max()
  assert rel <= 1e-5, rel
  prompts = [[1, 17, 42, 99, 5], [1, 3, 250]]
  g1 = generate_ids(loaded(cfg_kept, kept), prompts, max_new_tokens=12, ignore_eos=True)
  g2 = generate_ids(loaded(cfg_plain, plain), prompts, max_new_tokens=12, ignore_eos=True)
  assert [c.token_ids for c in g1] == [c.token_ids for c in g2]


def test_export_round_trip_keeps_fp8_bytes(ckpt):
  import json
  kept = load_hf_params(ckpt, checkpoint_config(ckpt, keep_fp8=True), dtype=jnp.bfloat16,
                        progress=False)
  raw_cfg = json.load(open(os.path.join(ckpt, "config.json")))
  mapped = hf_tensors(raw_cfg, kept)
  on_disk = {}
  for f in os.listdir(ckpt):
    if f.endswith(".safetensors"):
      on_disk.update(load_file(os.path.join(ckpt, f)))
  names = [n for n in on_disk if n.endswith("_scale_inv") or on_disk[n].dtype.itemsize == 1]
  assert len(names) == 2 * (2 * E * 3 + 15 + 3 + 6)
  for n in names:
    assert mapped[n].dtype == on_disk[n].dtype and mapped[n].tobytes() == on_disk[n].tobytes(), n


def test_partly_fp8_experts_are_dequantized_at_load(tmp_path):
  """A checkpoint with only some expert matrices FP8 is not kept FP8 (one format per leaf)."""
  cfg_dict = dict(fx.DEEPSEEK_V3, quantization_config={
      "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)})
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg), dtype=BF16)
  name = "model.layers.1.mlp.experts.5.down_proj.weight"
  tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensors[name].astype(np.float32),
                                                              BLOCK)
  out = str(tmp_path / "partial")
  write_checkpoint(cfg_dict, tensors, out)
  assert checkpoint_config(out, keep_fp8=True).fp8_experts is None
  m = engine.load(out, progress=False)
  assert layer_params(m.config, m.params, 1)["moe"]["experts"]["down"].dtype == jnp.bfloat16


@pytest.mark.parametrize("k, n", [(64, 96), (48, 40)])  # whole blocks; partial edge blocks
def test_dequantize_equals_loader_dequant(k, n):
  from engine.model import quantized
  rng = np.random.default_rng(k)
  w = np.clip(rng.standard_normal((3, k, n)) * 32, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  s = rng.random((3, -(-k // 32), -(-n // 32))).astype(np.float32)
  got = jax.jit(lambda a, b: dequantize(Fp8Weight(a, b, (32, 32)), jnp.float32))(w, s)
  np.testing.assert_array_equal(np.asarray(got), quantized.dequant_fp8(w, s, (32, 32)))


def test_fp8_dense_only_when_every_linear_is_fp8(tmp_path):
  """Experts all FP8 but one attention projection bf16: experts kept FP8, the rest dequantized
  at load (one format per leaf kind)."""
  cfg_dict = dict(fx.DEEPSEEK_V3, quantization_config={
      "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)})
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg), dtype=BF16)
  for name in list(tensors):
    if name.endswith("_proj.weight") and "layers.0.self_attn.o_proj" not in name:
      tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(
          tensors[name].astype(np.float32), BLOCK)
  out = str(tmp_path / "mixed")
  write_checkpoint(cfg_dict, tensors, out)
  c = checkpoint_config(out, keep_fp8=True)
  assert c.fp8_experts == BLOCK and not c.fp8_dense
  m = engine.load(out, progress=False)
  assert isinstance(layer_params(m.config, m.params, 1)["moe"]["experts"]["up"], Fp8Weight)
  assert layer_params(m.config, m.params, 1)["attn"]["q_b"].dtype == jnp.bfloat16


@pytest.mark.slow
def test_fp8_kept_sharded_on_eight_devices(ckpt):
  """Placed by the sharding rules (tensor-parallel attention values split by head, block
  scales replicated; experts split whole), the kept-FP8 forward equals one device's."""
  import json
  import subprocess
  import sys
  child = os.path.join(os.path.dirname(__file__), "int4_sharding_child.py")
  run = subprocess.run([sys.executable, child, "fp8", ckpt], capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  res = json.loads(run.stdout.strip().splitlines()[-1])
  # (stacked layers: a leading layer axis, never split)
  assert res["tensor:4,expert:2"]["q_b_spec"] == "P(None, None, 'tensor', None)", res
  for spec, r in res.items():
    assert r["rel_err"] <= 1e-5 and r["q_b_dtype"] == "float8_e4m3fn", (spec, r)
    assert r["expert_spec"] == "P(None, ('expert', 'tensor'), None, None)", (spec, r)
