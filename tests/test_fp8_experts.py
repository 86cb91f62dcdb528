"""FP8 block-quantized routed experts (DeepSeek-V3 / Kimi-K2-Instruct) kept as float8_e4m3fn +
float32 weight_scale_inv on the device, against the same checkpoint dequantized at load.

The checkpoint: a tiny DeepSeek-V3 whose every linear is FP8 with a float32 scale per 32 x 32
block (`weight_block_size` [32, 32]; real checkpoints use 128: the block is a parameter). By
default `engine.load` keeps the routed experts FP8 (the other FP8 linears are still dequantized
at load); an explicit dtype dequantizes everything at load as before. Both give bitwise the
same expert weights where a program uses them (the float32 product w * scale_inv, then the
compute dtype), so the forwards can differ only by the expert formulation's float32
accumulation order (kept experts run one expert / tile at a time): logits must agree within
1e-5 relative in float32 (measured: bitwise equal, float32 and bf16), greedy tokens identical.
"""

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
from engine.model.params import init_params
from engine.model.safetensors_io import load_file
from engine.model.transformer import forward_logits
from engine.runtime.generate import generate_tokens
from pallas_kernels.quant import Fp8Weight, dequantize
from tests import hf_fixtures as fx
from tests.hf_fixtures import BF16, write_checkpoint

jax.config.update("jax_default_matmul_precision", "highest")
BLOCK = (32, 32)
E, H, IM = 8, 64, 32


def _quantize_fp8(w, block):
  b0, b1 = block
  rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
  scale = np.zeros((rows, cols), np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for r in range(rows):
    for c in range(cols):
      blk = w[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1]
      s = max(float(np.abs(blk).max()), 1e-12) / 448.0
      scale[r, c] = s
      q[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
  return q, scale


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  cfg_dict = dict(fx.DEEPSEEK_V3, quantization_config={
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": list(BLOCK)})
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg, seed=2, scale=2.0), dtype=BF16)
  for name in list(tensors):
    if name.endswith("_proj.weight") or name.endswith("proj_with_mqa.weight"):
      q, s = _quantize_fp8(tensors[name].astype(np.float32), BLOCK)
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
      w = kept.params["layers"][i]["moe"]["experts"][name]
      assert isinstance(w, Fp8Weight) and w.block == (32, 32)
      assert w.w.dtype == jnp.float8_e4m3fn and w.w.shape == (E, k, n)
      assert w.scale_inv.dtype == jnp.float32 and w.scale_inv.shape == (E, k // 32, n // 32)
      assert w.nbytes == E * k * n + 4 * E * (k // 32) * (n // 32)
  assert kept.params["layers"][1]["attn"]["o"].dtype == jnp.bfloat16  # dequantized at load
  mem = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine.load")]
  assert len(mem) == 1 and "fp8 experts" in mem[0] and "bfloat16" in mem[0], mem
  plain = engine.load(ckpt, dtype="bfloat16", progress=False)  # explicit: dequantized at load
  assert plain.config.fp8_experts is None
  assert plain.params["layers"][1]["moe"]["experts"]["gate"].dtype == jnp.bfloat16


def test_kept_weights_equal_load_time_dequant_bitwise(ckpt):
  cfg_kept = checkpoint_config(ckpt, keep_fp8=True)
  kept = load_hf_params(ckpt, cfg_kept, dtype=jnp.float32, progress=False)
  plain = load_hf_params(ckpt, checkpoint_config(ckpt), dtype=jnp.float32, progress=False)
  for i in (1, 2):
    for name in ("gate", "up", "down"):
      got = jax.jit(lambda w: dequantize(w, jnp.float32))(kept["layers"][i]["moe"]["experts"][name])
      np.testing.assert_array_equal(np.asarray(got),
                                    np.asarray(plain["layers"][i]["moe"]["experts"][name]))


def test_kept_forward_equals_dequantized_at_load(ckpt):
  cfg_kept, cfg_plain = checkpoint_config(ckpt, keep_fp8=True), checkpoint_config(ckpt)
  kept = load_hf_params(ckpt, cfg_kept, dtype=jnp.float32, progress=False)
  plain = load_hf_params(ckpt, cfg_plain, dtype=jnp.float32, progress=False)
  a, b = _logits(cfg_kept, kept, jnp.float32), _logits(cfg_plain, plain, jnp.float32)
  rel = np.abs(a - b).max() / np.abs(b).max()
  assert rel <= 1e-5, rel
  prompts = [[1, 17, 42, 99, 5], [1, 3, 250]]
  g1 = generate_tokens(kept, cfg_kept, prompts, max_new_tokens=12, ignore_eos=True)
  g2 = generate_tokens(plain, cfg_plain, prompts, max_new_tokens=12, ignore_eos=True)
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
  names = [n for n in on_disk if ".mlp.experts." in n]
  assert len(names) == 2 * 2 * E * 3
  for n in names:
    assert mapped[n].dtype == on_disk[n].dtype and mapped[n].tobytes() == on_disk[n].tobytes(), n


def test_partly_fp8_experts_are_dequantized_at_load(tmp_path):
  """A checkpoint with only some expert matrices FP8 is not kept FP8 (one format per leaf)."""
  cfg_dict = dict(fx.DEEPSEEK_V3, quantization_config={
      "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)})
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg), dtype=BF16)
  name = "model.layers.1.mlp.experts.5.down_proj.weight"
  tensors[name], tensors[name + "_scale_inv"] = _quantize_fp8(tensors[name].astype(np.float32),
                                                              BLOCK)
  out = str(tmp_path / "partial")
  write_checkpoint(cfg_dict, tensors, out)
  assert checkpoint_config(out, keep_fp8=True).fp8_experts is None
  m = engine.load(out, progress=False)
  assert m.params["layers"][1]["moe"]["experts"]["down"].dtype == jnp.bfloat16


@pytest.mark.parametrize("k, n", [(64, 96), (48, 40)])  # whole blocks; partial edge blocks
def test_dequantize_equals_loader_dequant(k, n):
  from engine.model import quantized
  rng = np.random.default_rng(k)
  w = np.clip(rng.standard_normal((3, k, n)) * 32, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  s = rng.random((3, -(-k // 32), -(-n // 32))).astype(np.float32)
  got = jax.jit(lambda a, b: dequantize(Fp8Weight(a, b, (32, 32)), jnp.float32))(w, s)
  np.testing.assert_array_equal(np.asarray(got), quantized.dequant_fp8(w, s, (32, 32)))
