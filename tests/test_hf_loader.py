"""HF safetensors -> params: round trips for every family, layouts, casts, FP8, and errors."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.model import hf_loader, vision_checkpoint
from engine.model.config import config_from_dict
from engine.model.hf_loader import CheckpointError, load_hf_params
from engine.model.hf_mapping import hf_tensor_shapes
from engine.model.params import init_params, layer_params, path_str
from engine.model.safetensors_io import SafetensorsFile, load_file
from tests import hf_fixtures as fx
from tests.hf_fixtures import BF16, export_hf, hf_tensors, quantize_fp8, write_checkpoint


def _flat(tree):
  return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_same(got, want):
  g, w = _flat(got), _flat(want)
  assert g.keys() == w.keys()
  for k in w:
    assert g[k].dtype == w[k].dtype, k
    assert g[k].shape == w[k].shape, k
    assert g[k].tobytes() == w[k].tobytes(), k


def _setup(tmp_path, name, layout="hub", shards=1, dtype=None, seed=0):
  cfg_dict = fx.CONFIGS[name]
  cfg = config_from_dict(cfg_dict)
  params = init_params(cfg, seed=seed)
  ckpt = str(tmp_path / name)
  tensors = export_hf(cfg_dict, params, ckpt, layout=layout, shards=shards, dtype=dtype)
  return cfg, params, ckpt, tensors


@pytest.mark.parametrize("name", sorted(fx.CONFIGS))
def test_round_trip_float32_exact(tmp_path, name):
  cfg, params, ckpt, _ = _setup(tmp_path, name)
  got = load_hf_params(ckpt, cfg, dtype=jnp.float32, progress=False)
  _assert_same(got, params)
  # The layers come stacked, one stack per run of identical layers.
  assert len(got["stacks"]) == len(cfg.layer_stacks) and "layers" not in got
  assert ("lm_head" in got) == (not cfg.tie_word_embeddings)


def test_large_stacks_are_filled_in_place_on_device(tmp_path, monkeypatch):
  """Stacked leaves above HOST_STACK_MAX_BYTES are allocated on the device and written layer
  by layer (the small ones go through the host): the same values, placed as asked."""
  cfg, params, ckpt, _ = _setup(tmp_path, "deepseek_v3")
  monkeypatch.setattr(hf_loader, "HOST_STACK_MAX_BYTES", 0)
  dev = jax.devices()[0]
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), params)
  got = load_hf_params(ckpt, cfg, dtype=jnp.float32, shardings=shardings, progress=False)
  _assert_same(got, params)
  assert all(x.sharding == jax.sharding.SingleDeviceSharding(dev) for x in jax.tree.leaves(got))


@pytest.mark.parametrize("layout", ["stacked", "stacked_split"])
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_stacked_expert_layouts(tmp_path, name, layout):
  cfg, params, ckpt, tensors = _setup(tmp_path, name, layout=layout)
  assert not any(".experts.0." in k for k in tensors)
  _assert_same(load_hf_params(ckpt, cfg, dtype=jnp.float32, progress=False), params)


def test_sharded_index_and_cfg_from_dir(tmp_path):
  cfg, params, ckpt, _ = _setup(tmp_path, "deepseek_v3", shards=4)
  assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) == 4
  _assert_same(load_hf_params(ckpt, dtype=jnp.float32, progress=False), params)


def test_bf16_checkpoint_and_cast(tmp_path):
  cfg, params, ckpt, _ = _setup(tmp_path, "deepseek_v3", dtype=BF16)
  got = load_hf_params(ckpt, cfg, dtype=jnp.bfloat16, progress=False)
  # The exporter keeps routing tensors float32 (as transformers does) and the loader keeps them
  # float32; the rest are the bf16 values.
  want = jax.tree_util.tree_map_with_path(
      lambda p, x: x if path_str(p).endswith(("router", "router_bias")) else x.astype(
          jnp.bfloat16), params)
  _assert_same(got, want)
  assert layer_params(cfg, got, 1)["moe"]["router"].dtype == jnp.float32


def test_float32_checkpoint_cast_to_bf16(tmp_path):
  cfg, params, ckpt, _ = _setup(tmp_path, "qwen3_moe")
  got = load_hf_params(ckpt, cfg, dtype=jnp.bfloat16, progress=False)
  want = jax.tree_util.tree_map_with_path(
      lambda p, x: x if path_str(p).endswith("router") else x.astype(jnp.bfloat16), params)
  _assert_same(got, want)


def test_shardings_pytree(tmp_path):
  cfg, params, ckpt, _ = _setup(tmp_path, "qwen3")
  dev = jax.devices()[0]
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), params)
  got = load_hf_params(ckpt, cfg, dtype=jnp.float32, shardings=shardings, progress=False)
  _assert_same(got, params)
  for x in jax.tree.leaves(got):
    assert x.sharding == jax.sharding.SingleDeviceSharding(dev)
  bad = dict(shardings)
  del bad["embed"]
  with pytest.raises(ValueError, match="embed"):
    load_hf_params(ckpt, cfg, shardings=bad, progress=False)


def test_kimi_k25_prefix_vision_skipped_and_mtp_loaded(tmp_path):
  cfg_dict = dict(fx.KIMI_K25)
  cfg_dict["text_config"] = dict(fx.DEEPSEEK_V3, num_nextn_predict_layers=1)
  cfg = config_from_dict(cfg_dict)
  params = init_params(cfg, seed=3)
  assert len(params["mtp"]) == 1 and "moe" in params["mtp"][0]
  extra = {
      "vision_tower.encoder.blocks.0.wqkv.weight": np.ones((6, 4), np.float32),
      "mm_projector.proj.0.weight": np.ones((4, 4), np.float32),
      "language_model.model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
  }
  ckpt = str(tmp_path / "k25")
  tensors = export_hf(cfg_dict, params, ckpt, extra=extra, shards=2)
  assert "language_model.model.embed_tokens.weight" in tensors
  # The MTP layer (index == num_hidden_layers) with DeepSeek's copies of embedding and head.
  assert "language_model.model.layers.3.eh_proj.weight" in tensors
  assert "language_model.model.layers.3.shared_head.head.weight" in tensors
  _assert_same(load_hf_params(ckpt, cfg, dtype=jnp.float32, progress=False), params)


def test_missing_mtp_tensor_is_named(tmp_path):
  cfg_dict = dict(fx.DEEPSEEK_V3, num_nextn_predict_layers=1)
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg, seed=4))
  del tensors["model.layers.3.hnorm.weight"]
  ckpt = str(tmp_path / "mtp")
  write_checkpoint(cfg_dict, tensors, ckpt)
  with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\.hnorm\.weight'"):
    load_hf_params(ckpt, cfg, progress=False)


def test_layer_beyond_mtp_is_unexpected(tmp_path):
  cfg, params, ckpt, tensors = _setup(tmp_path, "deepseek_v3")
  tensors["model.layers.3.input_layernorm.weight"] = np.ones(64, np.float32)
  write_checkpoint(fx.DEEPSEEK_V3, tensors, ckpt)
  with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.3\."):
    load_hf_params(ckpt, cfg, progress=False)


def test_tied_checkpoint_with_lm_head_ignores_it(tmp_path):
  cfg, params, ckpt, tensors = _setup(tmp_path, "qwen3")
  tensors["lm_head.weight"] = np.zeros((320, 64), np.float32)
  write_checkpoint(fx.QWEN3, tensors, ckpt)
  _assert_same(load_hf_params(ckpt, cfg, dtype=jnp.float32, progress=False), params)


def test_hf_tensor_shapes_matches_export():
  for name in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "llama"):
    cfg = config_from_dict(fx.CONFIGS[name])
    tensors = hf_tensors(fx.CONFIGS[name], init_params(cfg), layout="stacked")
    shapes = hf_tensor_shapes(cfg, expert_layout="fused")
    assert shapes == {k: v.shape for k, v in tensors.items()}


# ---- FP8 block quantization ------------------------------------------------------------------

def _dequant_ref(q, scale, block):
  out = np.zeros(q.shape, np.float32)
  b0, b1 = block
  for r in range(scale.shape[0]):
    for c in range(scale.shape[1]):
      sl = (slice(r * b0, (r + 1) * b0), slice(c * b1, (c + 1) * b1))
      out[sl] = q[sl].astype(np.float32) * scale[r, c]
  return out


@pytest.mark.parametrize("block", [None, (32, 32), (16, 24)])
def test_fp8_block_dequant(tmp_path, block):
  cfg_dict = dict(fx.DEEPSEEK_V3)
  if block is not None:
    cfg_dict["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic",
                                       "weight_block_size": list(block)}
  eff_block = block or (128, 128)
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg), dtype=BF16)
  quantized = ["model.layers.0.self_attn.kv_b_proj.weight",  # [112, 32]: 112 % 32 != 0
               "model.layers.1.self_attn.o_proj.weight",
               "model.layers.1.mlp.experts.5.down_proj.weight",
               "model.layers.2.mlp.shared_experts.up_proj.weight"]
  refs = {}
  for name in quantized:
    q, s = quantize_fp8(tensors[name].astype(np.float32), eff_block)
    tensors[name] = q
    tensors[name + "_scale_inv"] = s
    refs[name] = _dequant_ref(q, s, eff_block)
  ckpt = str(tmp_path / "fp8")
  write_checkpoint(cfg_dict, tensors, ckpt, shards=3)
  got = load_hf_params(ckpt, cfg, dtype=jnp.float32, progress=False)
  nH, dn, dv = 4, 16, 12
  kv_b = np.asarray(layer_params(cfg, got, 0)["attn"]["kv_b"])
  np.testing.assert_array_equal(kv_b, refs[quantized[0]].reshape(nH, dn + dv, 32).transpose(2, 0, 1))
  o = np.asarray(layer_params(cfg, got, 1)["attn"]["o"])
  np.testing.assert_array_equal(o, refs[quantized[1]].T.reshape(nH, dv, 64))
  down5 = np.asarray(layer_params(cfg, got, 1)["moe"]["experts"]["down"][5])
  np.testing.assert_array_equal(down5, refs[quantized[2]].T)
  up = np.asarray(layer_params(cfg, got, 2)["moe"]["shared"]["up"])
  np.testing.assert_array_equal(up, refs[quantized[3]].T)
  # bf16 target: the float32 dequantized values rounded once.
  got16 = load_hf_params(ckpt, cfg, dtype=jnp.bfloat16, progress=False)
  np.testing.assert_array_equal(np.asarray(layer_params(cfg, got16, 0)["attn"]["kv_b"]),
                                kv_b.astype(ml_dtypes.bfloat16))


def test_fp8_errors(tmp_path):
  cfg = config_from_dict(fx.DEEPSEEK_V3)
  tensors = hf_tensors(fx.DEEPSEEK_V3, init_params(cfg))
  name = "model.layers.0.self_attn.kv_b_proj.weight"
  q, s = quantize_fp8(tensors[name], (128, 128))
  ckpt = str(tmp_path / "e")
  write_checkpoint(fx.DEEPSEEK_V3, dict(tensors, **{name: q}), ckpt)
  with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight'.*F8_E4M3.*weight_scale_inv"):
    load_hf_params(ckpt, cfg, progress=False)
  write_checkpoint(fx.DEEPSEEK_V3, dict(tensors, **{name: q, name + "_scale_inv":
                                                     np.ones((2, 2), np.float32)}), ckpt)
  with pytest.raises(CheckpointError, match=r"scale_inv' has shape \(2, 2\), expected \(1, 1\)"):
    load_hf_params(ckpt, cfg, progress=False)


def test_other_quantization_not_implemented(tmp_path):
  # compressed-tensors tensors without a compressed-tensors config: refused, naming the tensor.
  cfg_dict = dict(fx.DEEPSEEK_V3)
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg))
  name = "model.layers.1.mlp.experts.0.down_proj.weight"
  del tensors[name]
  tensors[name + "_packed"] = np.zeros((64, 4), np.int32)
  tensors[name + "_scale"] = np.zeros((64, 1), np.float32)
  ckpt = str(tmp_path / "int4")
  write_checkpoint(cfg_dict, tensors, ckpt)
  with pytest.raises(NotImplementedError, match=r"down_proj\.weight_(packed|scale)'.*"
                                                r"compressed-tensors"):
    load_hf_params(ckpt, cfg, progress=False)
  # A compressed-tensors config the engine cannot compute from is refused, naming the field.
  with pytest.raises(ValueError, match=r"quantization_config\.config_groups = None"):
    config_from_dict(dict(cfg_dict, quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized"}))
  # Any other method is refused at load, naming it.
  bad = dict(cfg_dict, quantization_config={"quant_method": "gptq", "bits": 4})
  write_checkpoint(bad, hf_tensors(cfg_dict, init_params(cfg)), ckpt)
  with pytest.raises(NotImplementedError, match="quant_method='gptq'"):
    load_hf_params(ckpt, config_from_dict(bad), progress=False)


# ---- errors: all found from headers, before any data is read ---------------------------------

@pytest.fixture
def no_data_reads(monkeypatch):
  def forbidden(self, name):
    raise AssertionError(f"data of {name!r} read before validation finished")
  monkeypatch.setattr(SafetensorsFile, "get", forbidden)


def _broken(tmp_path, edit, name="deepseek_v3"):
  cfg_dict = fx.CONFIGS[name]
  cfg = config_from_dict(cfg_dict)
  tensors = hf_tensors(cfg_dict, init_params(cfg))
  edit(tensors)
  ckpt = str(tmp_path / "broken")
  write_checkpoint(cfg_dict, tensors, ckpt, shards=2)
  return cfg, ckpt


def test_missing_tensor(tmp_path, no_data_reads):
  cfg, ckpt = _broken(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.7.up_proj.weight"))
  with pytest.raises(CheckpointError) as e:
    load_hf_params(ckpt, cfg, progress=False)
  msg = str(e.value)
  assert "missing tensor 'model.layers.2.mlp.experts.7.up_proj.weight'" in msg
  assert "expected shape (32, 64)" in msg


def test_missing_tensor_named_with_k25_prefix(tmp_path, no_data_reads):
  cfg, ckpt = _broken(tmp_path, lambda t: t.pop("language_model.model.norm.weight"), "kimi_k25")
  with pytest.raises(CheckpointError, match=r"missing tensor 'language_model\.model\.norm"
                                            r"\.weight' \(expected shape \(64,\)\)"):
    load_hf_params(ckpt, cfg, progress=False)


def test_unexpected_tensor(tmp_path, no_data_reads):
  cfg, ckpt = _broken(tmp_path, lambda t: t.update(
      {"model.layers.0.self_attn.extra_proj.weight": np.zeros((3, 4), np.float32)}))
  with pytest.raises(CheckpointError,
                     match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra_proj\.weight'"):
    load_hf_params(ckpt, cfg, progress=False)


def test_misshaped_tensor(tmp_path, no_data_reads):
  name = "model.layers.1.self_attn.kv_b_proj.weight"
  cfg, ckpt = _broken(tmp_path, lambda t: t.update({name: np.zeros((112, 31), np.float32)}))
  with pytest.raises(CheckpointError) as e:
    load_hf_params(ckpt, cfg, progress=False)
  assert f"tensor {name!r}" in str(e.value)
  assert "has shape (112, 31), expected (112, 32)" in str(e.value)


def test_misshaped_stacked_experts(tmp_path, no_data_reads):
  cfg = config_from_dict(fx.QWEN3_MOE)
  tensors = hf_tensors(fx.QWEN3_MOE, init_params(cfg), layout="stacked")
  tensors["model.layers.1.mlp.experts.down_proj"] = np.zeros((8, 32, 64), np.float32)
  ckpt = str(tmp_path / "s")
  write_checkpoint(fx.QWEN3_MOE, tensors, ckpt)
  with pytest.raises(CheckpointError, match=r"experts\.down_proj' .*shape \(8, 32, 64\), "
                                            r"expected \(8, 64, 32\)"):
    load_hf_params(ckpt, cfg, progress=False)


def test_non_float_tensor(tmp_path, no_data_reads):
  cfg, ckpt = _broken(tmp_path, lambda t: t.update(
      {"model.norm.weight": np.zeros(64, np.int32)}), "llama")
  with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*dtype I32"):
    load_hf_params(ckpt, cfg, progress=False)


def test_duplicate_across_shards(tmp_path):
  cfg, _, ckpt, tensors = _setup(tmp_path, "llama", shards=2)
  dup = "model.embed_tokens.weight"
  shard2 = os.path.join(ckpt, "model-00002-of-00002.safetensors")
  assert dup in load_file(os.path.join(ckpt, "model-00001-of-00002.safetensors"))
  save_file(dict(load_file(shard2), **{dup: tensors[dup]}), shard2)
  with pytest.raises(CheckpointError, match=rf"'{dup}' appears in two shards"):
    load_hf_params(ckpt, cfg, progress=False)


def test_index_points_at_missing_shard(tmp_path):
  cfg, _, ckpt, _ = _setup(tmp_path, "llama", shards=3)
  os.remove(os.path.join(ckpt, "model-00002-of-00003.safetensors"))
  with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors.*does not exist"):
    load_hf_params(ckpt, cfg, progress=False)


def test_index_disagrees_with_shard(tmp_path):
  cfg, _, ckpt, _ = _setup(tmp_path, "llama", shards=2)
  index_path = os.path.join(ckpt, "model.safetensors.index.json")
  index = json.load(open(index_path))
  shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
  index["weight_map"]["model.norm.weight"] = next(
      s for s in shards if s != index["weight_map"]["model.norm.weight"])
  json.dump(index, open(index_path, "w"))
  with pytest.raises(CheckpointError, match=r"maps tensor 'model\.norm\.weight'"):
    load_hf_params(ckpt, cfg, progress=False)


def test_truncated_shard(tmp_path):
  cfg, _, ckpt, _ = _setup(tmp_path, "llama", shards=2)
  path = os.path.join(ckpt, "model-00002-of-00002.safetensors")
  blob = open(path, "rb").read()
  open(path, "wb").write(blob[:len(blob) // 2])
  with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*truncated"):
    load_hf_params(ckpt, cfg, progress=False)


def test_pickle_only_refused_without_opening(tmp_path):
  ckpt = tmp_path / "pt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(fx.LLAMA))
  (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04 not a real pickle")
  with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors is required"):
    load_hf_params(str(ckpt), progress=False)
  (ckpt / "pytorch_model.bin").unlink()
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    load_hf_params(str(ckpt), progress=False)


def test_many_problems_listed_and_counted(tmp_path, no_data_reads):
  def drop_experts(t):
    for k in [k for k in t if ".experts." in k]:
      del t[k]
  cfg, ckpt = _broken(tmp_path, drop_experts)
  with pytest.raises(CheckpointError, match=r"(?s)48 problem\(s\).*and 40 more"):
    load_hf_params(ckpt, cfg, progress=False)


def test_progress_lines(tmp_path, monkeypatch, capsys):
  cfg, params, ckpt, _ = _setup(tmp_path, "llama", shards=2)
  load_hf_params(ckpt, cfg, progress=True)
  assert "shard" not in capsys.readouterr().err  # small load, stderr not a terminal
  monkeypatch.setattr(hf_loader, "PROGRESS_MIN_BYTES", 0)
  load_hf_params(ckpt, cfg, progress=True)
  err = capsys.readouterr().err
  assert "shard 1/2" in err and "shard 2/2" in err and "GB read" in err


def test_nothing_returned_on_late_error(tmp_path, monkeypatch):
  """A failure after some leaves were placed raises; no partial params escape."""
  cfg, _, ckpt, _ = _setup(tmp_path, "llama", shards=2)
  calls = []
  real = hf_loader._place

  def flaky(buf, sharding):
    calls.append(1)
    if len(calls) == 5:
      raise OSError("device lost")
    return real(buf, sharding)
  monkeypatch.setattr(hf_loader, "_place", flaky)
  with pytest.raises(OSError, match="device lost"):
    load_hf_params(ckpt, cfg, progress=False)
  assert len(calls) == 5


def test_k25_prefixed_and_bare_name_collide(tmp_path, no_data_reads):
  cfg, ckpt = _broken(tmp_path, lambda t: t.update(
      {"model.norm.weight": t["language_model.model.norm.weight"]}), "kimi_k25")
  with pytest.raises(CheckpointError, match=r"both provide 'model\.norm\.weight'"):
    load_hf_params(ckpt, cfg, progress=False)


# ---- golden fixtures written by transformers' save_pretrained (Hub expert layout) ------------

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "fixtures")
GOLDEN_CASES = sorted(d for d in os.listdir(GOLDEN)
                      if os.path.isfile(os.path.join(GOLDEN, d, "config.json"))) \
    if os.path.isdir(GOLDEN) else []


@pytest.mark.skipif(not GOLDEN_CASES, reason="no golden fixtures")
@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_fixture_loads_and_maps_back_exactly(case):
  ckpt = os.path.join(GOLDEN, case)
  params = load_hf_params(ckpt, dtype=jnp.float32, progress=False)
  # Mapping the loaded params back to HF names must give the file's tensors bit for bit.
  raw_cfg = json.load(open(os.path.join(ckpt, "config.json")))
  files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
  on_disk = {}
  for f in files:
    on_disk.update(load_file(os.path.join(ckpt, f)))
  mapped = hf_tensors(raw_cfg, params)
  if raw_cfg["model_type"] == "kimi_k25":  # exported in the hub's spelling
    assert "vision" in params
    on_disk = {vision_checkpoint.canonical(k): v for k, v in on_disk.items()}
  assert mapped.keys() == on_disk.keys()
  for name, want in on_disk.items():
    assert mapped[name].tobytes() == want.tobytes(), name
