"""Kimi K2.5 as it ships: the kimi_k25 layout with compressed-tensors INT4 routed experts kept
packed on the device and computed from directly.

The fixture (`tests/golden/fixtures/kimi_k25_int4`, made by `tests/golden/make_golden_k25.py`)
is a miniature K2.5 written by transformers' own `Kimi_K25ForConditionalGeneration` with its
routed experts compressed by the compressed-tensors library; its golden logits are
transformers' on the model it decompresses (W = (nibble - 8).to(bf16) * scale, a bf16 product,
then float32). The engine keeps the experts packed, dequantizes by the same rule inside the
jitted program and computes in float32, so the two forwards see identical weights: logits must
agree to the golden tolerance (relative 1e-4; float32 accumulation order is all that differs)
and the 32 greedy tokens exactly.
"""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import engine
from engine.model import quantized
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import ConfigError, config_from_dict, without_vision
from engine.model.hf_loader import CheckpointError, load_hf_params
from engine.model.params import init_params, layer_params, unstack_layers
from engine.model.safetensors_io import load_file
from engine.model.transformer import forward_logits
from pallas_kernels.moe import reference as moe_ref
from pallas_kernels.quant import Int4Weight, dequantize, dequantize_np, unpack_int4
from tests import golden_check
from tests.generation import generate_ids, loaded
from tests.hf_fixtures import write_checkpoint

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURE = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "kimi_k25_int4")
E, H, IM = 8, 64, 32


@pytest.fixture(scope="module")
def model():
  return engine.load(FIXTURE, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(os.path.join(FIXTURE, "golden.npz")))


def _assert_packed(params):
  layers = unstack_layers(params)["layers"]
  experts = layers[1]["moe"]["experts"]
  for name, (k, n) in (("gate", (H, IM)), ("up", (H, IM)), ("down", (IM, H))):
    w = experts[name]
    assert isinstance(w, Int4Weight), name
    assert w.packed.dtype == jnp.uint8 and w.packed.shape == (E, n, k // 2), name
    assert w.scale.dtype == jnp.bfloat16 and w.scale.shape == (E, k // 32, n), name
    assert w.shape == (E, k, n)
    # 4 bits per weight plus a bf16 scale per 32: 4.5 bits, not 16 or 32.
    assert w.nbytes == E * k * n // 2 + E * (k // 32) * n * 2, name
  assert "experts" not in layers[0].get("mlp", {})  # layer 0 is the dense MLP


# ---- the golden: transformers' logits and greedy tokens ---------------------------------------

def test_config_kimi_k25_layout(model):
  cfg = model.config
  assert cfg.model_type == "kimi_k25" and cfg.num_layers == 2 and cfg.is_moe_layer(1)
  assert cfg.int4 is not None and cfg.int4.group_size == 32
  assert cfg.experts_int4(1) and not cfg.experts_int4(0)
  assert cfg.vision_config["model_type"] == "kimi_k25_vision"
  assert cfg.vision is not None and "vision" in model.params  # the tower loads, float
  assert not cfg.tie_word_embeddings and "lm_head" in model.params


def test_prefill_and_decode_logits_from_packed_experts(model, golden):
  cfg, params, _ = model
  _assert_packed(params)
  golden_check.assert_logits_match(params, cfg, golden, "kimi_k25_int4")
  _assert_packed(params)  # still packed after running


def test_greedy_tokens_identical(model, golden):
  cfg, params, _ = model
  prompts = [golden["prompt_0"].tolist(), golden["prompt_1"].tolist()]
  out = generate_ids(loaded(cfg, params), prompts, max_new_tokens=len(golden["greedy_0"]),
                     ignore_eos=True)
  for i in range(2):
    assert out[i].token_ids == golden[f"greedy_{i}"].tolist(), f"prompt {i}"


def test_dequant_matches_compressed_tensors_rule(model):
  """The engine's in-program dequantization equals the bf16-product rule on the stored
  tensors (which the generator checked bitwise against compressed-tensors' decompress)."""
  stored = load_file(os.path.join(FIXTURE, "model-00001-of-00004.safetensors"))
  stored.update(load_file(os.path.join(FIXTURE, "model-00002-of-00004.safetensors")))
  h = "language_model.model.layers.1.mlp.experts.0.gate_proj."
  q = np.asarray(stored[h + "weight_packed"]).view(np.uint8)  # little-endian words as bytes
  nib = np.stack([q & 0xF, q >> 4], axis=-1).reshape(IM, H).astype(np.int8) - 8
  scale = np.asarray(stored[h + "weight_scale"])
  want = (nib.astype(ml_dtypes.bfloat16) * np.repeat(scale, 32, axis=1)).astype(np.float32)
  w = layer_params(model.config, model.params, 1)["moe"]["experts"]["gate"]
  got = np.asarray(jax.jit(lambda w: dequantize(w[0], jnp.float32))(w))  # [H, IM]
  np.testing.assert_array_equal(got, want.T)
  exact = nib.astype(np.float32) * np.repeat(scale.astype(np.float32), 32, axis=1)
  assert np.any(want != exact)  # the bf16 rounding of the product is real, and matched


def test_quantization_config_at_top_level_loads_the_same(tmp_path, model):
  ckpt = tmp_path / "top"
  shutil.copytree(FIXTURE, ckpt)
  cfg = json.loads((ckpt / "config.json").read_text())
  cfg["quantization_config"] = cfg["text_config"].pop("quantization_config")
  (ckpt / "config.json").write_text(json.dumps(cfg))
  other = engine.load(str(ckpt), dtype="float32", progress=False)
  assert other.config == model.config
  for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_logs_bytes_by_kind_and_vision_skip_when_text_only(caplog):
  with caplog.at_level(logging.INFO, logger="moejax"):
    m = engine.load(FIXTURE, dtype="bfloat16", progress=False)
  assert not [r for r in caplog.records if "vision" in r.getMessage()]
  assert m.params["vision"]["proj_out"].dtype == jnp.bfloat16  # the tower: float, not INT4
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="moejax"):
    text_only = load_hf_params(FIXTURE, without_vision(m.config), progress=False)
  vision = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
  assert len(vision) == 1 and "23 vision tensors skipped" in vision[0], vision
  assert "vision" not in text_only
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="moejax"):
    m = engine.load(FIXTURE, dtype="bfloat16", progress=False)
  mem = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine.load")]
  assert len(mem) == 1, mem
  experts = layer_params(m.config, m.params, 1)["moe"]["experts"]
  int4 = sum(x.nbytes for x in jax.tree.leaves(experts))
  assert int4 == 3 * (E * H * IM // 2 + E * (H // 32) * IM * 2)
  assert f"int4 experts {int4 / 1e3:.2f} KB" in mem[0] and "bfloat16" in mem[0], mem[0]


# ---- the packing: compressed-tensors' pack_to_int32 and the documented bit layout ------------

def test_unpack_equals_pack_to_int32_cases():
  cases = np.load(os.path.join(FIXTURE, "unpack_cases.npz"))
  for i in range(3):
    values, packed = cases[f"values_{i}"], cases[f"packed_{i}"]
    assert packed.dtype == np.int32 and packed.shape == (values.shape[0], values.shape[1] // 8)
    ours = np.asarray(unpack_int4(jnp.asarray(quantized.repack(packed))))  # [cols, rows]
    np.testing.assert_array_equal(ours.T, values)


def test_unpack_hand_built_word():
  # Word c holds elements 8c + j in bits [4j, 4j + 4), each stored as q + 8.
  q = [-8, -1, 0, 1, 7, 3, -5, 6]
  word = sum((v + 8) << (4 * j) for j, v in enumerate(q))
  packed = np.array([[word - (1 << 32) if word >= 1 << 31 else word]], np.int32)
  got = np.asarray(unpack_int4(jnp.asarray(quantized.repack(packed))))[:, 0]
  assert got.tolist() == q


# ---- every formulation of the MoE reference from packed weights -------------------------------

def _random_int4(rng, e, k, n, group=32):
  packed = rng.integers(0, 256, size=(e, n, k // 2), dtype=np.uint8)
  scale = (0.02 + 0.02 * rng.random((e, k // group, n))).astype(ml_dtypes.bfloat16)
  return Int4Weight(jnp.asarray(packed), jnp.asarray(scale))


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 3, 40, 300])
def test_formulations_from_packed_equal_float_reference(tokens):
  """Each formulation `moe_experts` picks (gathered, all experts, tiled) on packed weights
  equals the dense loop over the dequantized float weights, with and without an offset."""
  rng = np.random.default_rng(tokens)
  e, h, i, k = 16, 64, 32, 2
  wg, wu, wd = _random_int4(rng, e, h, i), _random_int4(rng, e, h, i), _random_int4(rng, e, i, h)
  x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
  ids = jnp.asarray(np.argsort(rng.random((tokens, 2 * e)), axis=1)[:, :k] % (2 * e), jnp.int32)
  w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
  fl = [jnp.asarray(dequantize_np(np.asarray(m.packed), np.asarray(m.scale)))
        for m in (wg, wu, wd)]
  for offset in (0, e):  # ids span 2 E experts: half the copies fall outside each shard
    want = moe_ref.moe_experts_dense(x, w, ids, *fl, expert_offset=offset)
    got = jax.jit(lambda *a: moe_ref.moe_experts(*a, expert_offset=offset))(x, w, ids, wg, wu,
                                                                           wd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    for f in (moe_ref.moe_experts_gathered, moe_ref.moe_experts_all, moe_ref.moe_experts_tiled):
      got = jax.jit(lambda *a: f(*a, expert_offset=offset))(x, w, ids, wg, wu, wd)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5,
                                 err_msg=f.__name__)


def test_no_float_copy_of_all_experts_in_the_program():
  """The compiled MoE on packed experts holds no [E, K, N] float buffer (only per-expert or
  per-tile dequantized slices)."""
  rng = np.random.default_rng(0)
  e, h, i = 16, 64, 32
  wg, wu, wd = _random_int4(rng, e, h, i), _random_int4(rng, e, h, i), _random_int4(rng, e, i, h)
  for t in (8, 300):  # all-experts and tiled formulations
    x = jnp.zeros((t, h), jnp.float32)
    ids = jnp.zeros((t, 2), jnp.int32)
    w = jnp.ones((t, 2), jnp.float32)
    hlo = jax.jit(moe_ref.moe_experts).lower(x, w, ids, wg, wu, wd).compile().as_text()
    for shape in (f"f32[{e},{h},{i}]", f"f32[{e},{i},{h}]"):
      assert shape not in hlo, (t, shape)
    assert "u8[16,32,32]" in hlo  # the packed weights are the program's inputs


def test_mosaic_gpu_refuses_packed_experts_it_cannot_tile():
  # (the W4A16 kernel itself: tests/test_quantized_moe_kernels.py)
  from pallas_kernels.moe import moe_mgpu
  rng = np.random.default_rng(0)
  wg = _random_int4(rng, 4, 64, 64)
  with pytest.raises(NotImplementedError, match="INT4 MoE needs hidden"):
    moe_mgpu.moe_experts(jnp.zeros((2, 64), jnp.bfloat16), jnp.ones((2, 1)),
                         jnp.zeros((2, 1), jnp.int32), wg, wg, wg)


# ---- bad checkpoints: each a clear error, found before anything is placed ---------------------

PACKED = "language_model.model.layers.1.mlp.experts.3.up_proj.weight_packed"


def _fixture_tensors():
  tensors = {}
  for f in sorted(os.listdir(FIXTURE)):
    if f.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(FIXTURE, f)))
  return tensors


def _fixture_config():
  with open(os.path.join(FIXTURE, "config.json")) as fh:
    return json.load(fh)


def _write(tmp_path, tensors=None, cfg=None):
  out = str(tmp_path / "bad")
  write_checkpoint(cfg or _fixture_config(), tensors or _fixture_tensors(), out, shards=3)
  return out


@pytest.fixture
def nothing_placed(monkeypatch):
  from engine.model import hf_loader

  def forbidden(buf, sharding):
    raise AssertionError("a leaf was placed before validation finished")
  monkeypatch.setattr(hf_loader, "_place", forbidden)


def test_rewritten_fixture_loads(tmp_path):
  """The helper's rewrite of the fixture (3 shards, other order) is itself a valid checkpoint."""
  m = engine.load(_write(tmp_path), dtype="float32", progress=False)
  _assert_packed(m.params)


def test_truncated_shard(tmp_path, nothing_placed):
  ckpt = tmp_path / "trunc"
  shutil.copytree(FIXTURE, ckpt)
  shard = ckpt / "model-00003-of-00004.safetensors"
  size = shard.stat().st_size
  with open(shard, "r+b") as fh:
    fh.truncate(size - 100)
  with pytest.raises(CheckpointError, match=r"model-00003-of-00004\.safetensors: truncated"):
    engine.load(str(ckpt), progress=False)


def test_wrong_weight_packed_shape(tmp_path, nothing_placed):
  t = _fixture_tensors()
  t[PACKED] = np.ascontiguousarray(t[PACKED][:, :4])
  with pytest.raises(CheckpointError, match=rf"{PACKED}' in .* has shape \(32, 4\), "
                                            r"expected \(32, 8\)"):
    engine.load(_write(tmp_path, t), progress=False)


def test_missing_weight_scale(tmp_path, nothing_placed):
  t = _fixture_tensors()
  del t[PACKED.replace("packed", "scale")]
  with pytest.raises(CheckpointError, match=r"missing tensor 'language_model\.model\.layers\.1\."
                                            r"mlp\.experts\.3\.up_proj\.weight_scale' "
                                            r"\(expected shape \(32, 2\)\)"):
    engine.load(_write(tmp_path, t), progress=False)


def test_wrong_dtypes_named(tmp_path, nothing_placed):
  t = _fixture_tensors()
  scale = PACKED.replace("packed", "scale")
  t[scale] = t[scale].astype(np.float32)
  t[PACKED] = t[PACKED].astype(np.int64)
  with pytest.raises(CheckpointError, match=r"2 problem") as e:
    engine.load(_write(tmp_path, t), progress=False)
  assert f"{scale}' in" in str(e.value) and "has dtype F32, expected BF16" in str(e.value)
  assert f"{PACKED}' in" in str(e.value) and "has dtype I64, expected I32" in str(e.value)


def test_wrong_weight_shape_value(tmp_path, nothing_placed):
  t = _fixture_tensors()
  name = PACKED.replace("packed", "shape")
  t[name] = np.array([64, 32], np.int32)  # swapped [out, in]
  with pytest.raises(CheckpointError, match=rf"{name}' is \[64, 32\], expected \[32, 64\]"):
    engine.load(_write(tmp_path, t), progress=False)


@pytest.mark.parametrize("extra", ["weight_zero_point", "weight_g_idx"])
def test_zero_points_and_g_idx_refused(tmp_path, extra, nothing_placed):
  t = _fixture_tensors()
  t[PACKED.replace("weight_packed", extra)] = np.zeros((32, 2), np.int32)
  with pytest.raises(CheckpointError, match=rf"unexpected tensor '.*up_proj\.{extra}'"):
    engine.load(_write(tmp_path, t), progress=False)


def _weights_edit(**kw):
  def edit(qc):
    qc["config_groups"]["group_0"]["weights"].update(kw)
  return edit


@pytest.mark.parametrize("edit, field", [
    (_weights_edit(symmetric=False), r"weights\.symmetric = False"),
    (_weights_edit(actorder="group"), r"weights\.actorder = 'group'"),
    (_weights_edit(num_bits=8), r"weights\.num_bits = 8"),
    (_weights_edit(type="float"), r"weights\.type = 'float'"),
    (_weights_edit(strategy="channel"), r"weights\.strategy = 'channel'"),
    (_weights_edit(group_size=None), r"weights\.group_size = None"),
    (_weights_edit(scale_dtype="float16"), r"weights\.scale_dtype = 'float16'"),
    (lambda qc: qc.update(format="marlin-24"), r"\.format = 'marlin-24'"),
    (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float"}), r"input_activations = "),
    (lambda qc: qc["config_groups"].update(group_1=qc["config_groups"]["group_0"]),
     r"config_groups = \['group_0', 'group_1'\]"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme = "),
])
def test_unsupported_schemes_name_the_field(edit, field):
  cfg = _fixture_config()
  edit(cfg["text_config"]["quantization_config"])
  with pytest.raises(ConfigError, match=rf"text_config\.quantization_config.*{field}"):
    config_from_dict(cfg)


def test_quantization_config_at_both_levels_must_agree():
  cfg = _fixture_config()
  cfg["quantization_config"] = dict(cfg["text_config"]["quantization_config"], format="dense")
  with pytest.raises(ConfigError, match="quantization_config and text_config"):
    config_from_dict(cfg)


def test_ignore_list_honoured(tmp_path):
  # Attention not ignored: the config says it is INT4, which only routed experts can be.
  cfg = _fixture_config()
  qc = cfg["text_config"]["quantization_config"]
  qc["ignore"] = [i for i in qc["ignore"] if "self_attn" not in i]
  with pytest.raises(NotImplementedError, match=r"quantizes 'language_model\.model\.layers\.0\."
                                                r"self_attn\.q_a_proj'"):
    engine.load(_write(tmp_path, cfg=cfg), progress=False)
  # Experts ignored: the config says they are float, the checkpoint has them packed.
  cfg = _fixture_config()
  cfg["text_config"]["quantization_config"]["ignore"].append("re:.*mlp\\.experts\\..*")
  assert not config_from_dict(cfg).experts_int4(1)
  with pytest.raises(CheckpointError, match=r"96 problem\(s\):\n  missing tensor 'language_"
                                            r"model\.model\.layers\.1\.mlp\.experts\.0\."
                                            r"gate_proj\.weight'"):
    engine.load(_write(tmp_path, cfg=cfg), progress=False)  # 24 missing, 72 unexpected
  # The hub's "lm_head" names the text model's head, stored as language_model.lm_head.
  assert not quantized.module_quantized(config_from_dict(_fixture_config()).int4, "lm_head")


def test_int4_sharded_over_expert_axis():
  from jax.sharding import AbstractMesh, PartitionSpec as P
  from engine.model import sharding
  from engine.model.params import param_shapes
  cfg = config_from_dict(_fixture_config())
  mesh = AbstractMesh((1, 4, 2), ("data", "expert", "tensor"))
  specs = sharding.param_specs(cfg, param_shapes(cfg), mesh)
  for name in ("gate", "up", "down"):
    w = specs["stacks"][1]["moe"]["experts"][name]  # the MoE layers' stack: [L, E, ...]
    assert isinstance(w, Int4Weight)
    assert w.packed == P(None, ("expert", "tensor"), None, None) == w.scale, name


def test_init_params_int4_runs():
  cfg = config_from_dict(_fixture_config())
  params = init_params(cfg, seed=0)
  _assert_packed(params)
  pt = contiguous_page_table(1, 8, 8)
  logits, _ = forward_logits(params, init_cache(cfg, pt.size, 8, jnp.float32),
                             jnp.ones((1, 4), jnp.int32), jnp.zeros(1, jnp.int32),
                             jnp.full((1,), 4, jnp.int32), jnp.asarray(pt), cfg=cfg)
  assert np.all(np.isfinite(np.asarray(logits)))


@pytest.mark.slow
def test_packed_experts_split_whole_over_eight_devices():
  """engine.load(mesh=...) places each device's whole experts, still packed; the psum and the
  token-dispatch forwards equal one device's logits."""
  import subprocess
  import sys
  child = os.path.join(os.path.dirname(__file__), "int4_sharding_child.py")
  run = subprocess.run([sys.executable, child], capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  res = json.loads(run.stdout.strip().splitlines()[-1])
  for spec, r in res.items():
    assert r["rel_err"] <= 1e-5, (spec, r)
    assert r["packed_dtype"] == "uint8" and r["devices"] == 8, (spec, r)
    # The MoE layer's stack of one: [1, E, ...], whole experts per device.
    assert r["packed_shards"] == [[1, 1, 32, 32]], (spec, r)
    assert r["scale_shards"] == [[1, 1, 2, 32]], (spec, r)
    assert r["spec"] == "P(None, ('expert', 'tensor'), None, None)", (spec, r)
    # The memory log's per-device INT4 bytes: one expert's 3 packed matrices and scales each.
    assert r["int4_bytes_per_device"] == [3 * (H * IM // 2 + (H // 32) * IM * 2)], (spec, r)
    assert r["log_lines"] == 8, (spec, r)


def test_k2_thinking_layout_loads_the_same(tmp_path, model):
  """Kimi K2-Thinking: `kimi_k2` config with the quantization_config at the top level and
  DeepseekV3ForCausalLM names (no `language_model.` prefix, no vision tower), same INT4."""
  k25 = _fixture_config()
  cfg = dict(k25["text_config"], architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2")
  cfg["quantization_config"] = cfg.pop("quantization_config")
  tensors = {k[len("language_model."):]: v for k, v in _fixture_tensors().items()
             if k.startswith("language_model.")}
  assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in tensors
  out = str(tmp_path / "k2")
  write_checkpoint(cfg, tensors, out, shards=2)
  k2 = engine.load(out, dtype="float32", progress=False)
  assert k2.config.model_type == "kimi_k2" and k2.config.experts_int4(1)
  _assert_packed(k2.params)
  for a, b in zip(jax.tree.leaves(k2.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_conversion_keeps_experts_packed(tmp_path, model):
  from checkpoints.convert import convert
  out = str(tmp_path / "orbax")
  convert(FIXTURE, out, dtype="float32")
  restored = engine.load(out, progress=False)
  _assert_packed(restored.params)
  got, want = jax.tree.leaves(restored.params), jax.tree.leaves(model.params)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_serving_engine_reproduces_transformers_greedy(model, golden):
  from engine.runtime.engine import Engine, EngineConfig
  from engine.runtime.request import StopParams
  eng = Engine(model.config, model.params, EngineConfig(
      page_size=8, max_num_seqs=2, max_num_batched_tokens=32, row_widths=(16,),
      max_model_len=64, cache_dtype=jnp.float32))
  outs = eng.generate([golden["prompt_0"].tolist(), golden["prompt_1"].tolist()],
                      stop=StopParams(max_tokens=32, ignore_eos=True))
  for i, r in enumerate(outs):
    assert r.output_ids == golden[f"greedy_{i}"].tolist(), i


@pytest.mark.parametrize("t", [1, 16])
def test_forward_with_packed_experts_lowers_for_cuda(t):
  """The plain-JAX INT4 path (gathered / per-expert / per-tile dequantization) exports for
  CUDA under an abstract H200 (bf16 activations), the packed experts as the inputs."""
  import sys
  sys.path.insert(0, os.path.dirname(__file__))
  from cuda_export import export_cuda_calls
  from engine.model.params import abstract_params
  cfg = config_from_dict(_fixture_config())
  params = abstract_params(cfg, jnp.bfloat16)
  assert params["stacks"][1]["moe"]["experts"]["gate"].packed.dtype == jnp.uint8
  cache = jax.eval_shape(lambda: init_cache(cfg, 9, 8, jnp.bfloat16))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
  export_cuda_calls(forward_logits, params, cache, i32(2, t), i32(2), i32(2), i32(2, 4), cfg=cfg)


def test_bench_bytes_per_step_agree_with_placed_bytes():
  """bench/quantized_experts.py's per-step expert bytes (4.5 bits INT4, 1 B + block scales FP8,
  2 B bf16) equal the bytes of the leaves the engine actually holds, and Kimi K2.5's are the
  formula's: 60 MoE layers x 8 experts x 3 x 7168 x 2048 weights at batch 1."""
  import math
  from bench import expert_bytes as qe
  from engine.model.params import abstract_params
  k25 = config_from_dict(qe.KIMI_K25_TEXT)
  b1 = {f: qe.step_weight_bytes(k25, f, 1) for f in qe.FORMATS}
  weights = 60 * 8 * 3 * 7168 * 2048
  assert b1["int4"]["experts"] == pytest.approx(weights * 0.5625)
  assert b1["bf16"]["experts"] == pytest.approx(weights * 2)
  assert b1["fp8"]["experts"] == pytest.approx(weights * (1 + 4 / 128 ** 2))
  assert b1["int4"]["other"] == b1["bf16"]["other"]
  for fmt, cfg in (("int4", dataclasses_replace(k25, int4=qe.INT4)),
                   ("fp8", dataclasses_replace(k25, fp8_experts=(128, 128))), ("bf16", k25)):
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params(cfg, jnp.bfloat16))[0]
    held = sum(math.prod(x.shape) * x.dtype.itemsize for p, x in leaves
               if "experts" in jax.tree_util.keystr(p))
    all_experts = qe.step_weight_bytes(cfg, fmt, 10 ** 6)["experts"]  # every expert hit
    assert held == pytest.approx(all_experts, rel=1e-9), fmt


def dataclasses_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)
