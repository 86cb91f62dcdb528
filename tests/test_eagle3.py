"""EAGLE-3 heads (engine/model/eagle3*.py) against the PyTorch goldens of
tests/golden/make_golden_eagle3.py: tiny heads in the published layouts beside a 5-layer Kimi K2.5
INT4 target, the target's residual streams as the aux inputs.

Each variant: the first draft pass's logits at every prompt position, three chained steps' logits
and the greedy drafts, both prompts as one padded batch through a shuffled page table; then the
first pass in two chunks through the same pool; both aux-id conventions; the head's own RoPE;
heads that do not match the target and bad checkpoint directories refused, the field named.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bench.protocol.eagle3 import K25_MHA_HEAD, K25_MLA_HEAD  # the published heads' shapes
from engine.model import eagle3
from engine.model.cache import init_cache
from engine.model.config import load_config
from engine.model.eagle3_config import (Eagle3Error, default_aux_layer_ids,
                                        eagle3_config_from_dict, resolve_aux_layer_ids)
from engine.model.eagle3_loader import abstract_head_params, load_eagle3
from engine.model.hf_loader import load_hf_params
from engine.model.transformer import forward, forward_hidden_states, rms_norm

FIXTURES = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "eagle3")
VARIANTS = ("mla", "mla_reduced", "mla_eagle31", "mha_reduced", "mha_full")
REL_TOL = 1e-4  # max|ours - theirs| / max|theirs|, float32
PAGE = 4
NUM_DRAFTS = 4  # the first pass's draft and three chained steps (the goldens' K = 3)
_step = jax.jit(eagle3.draft_step, static_argnames=("cfg", "impl"))


def rel_err(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def target():
  cfg = load_config(os.path.join(FIXTURES, "target"))
  params = load_hf_params(os.path.join(FIXTURES, "target"), cfg, jnp.float32, progress=False)
  return cfg, params, np.load(os.path.join(FIXTURES, "target_states.npz"))


def batch(states, layers, width: int = 16):
  """Both prompts as one right-padded batch: aux [2, W, n*H], next tokens [2, W], lengths, and a
  shuffled page table (row 1's pages before row 0's, none of them page 0)."""
  n = [len(states[f"prompt_{i}"]) for i in range(2)]
  aux = np.zeros((2, width, len(layers) * states["residual_0"].shape[-1]), np.float32)
  tokens = np.zeros((2, width), np.int32)
  for i in range(2):
    aux[i, :n[i]] = np.concatenate([states[f"residual_{i}"][l] for l in layers], -1)
    tokens[i, :n[i]] = np.append(states[f"prompt_{i}"][1:], states[f"next_token_{i}"])
  per_row = -(-(width + NUM_DRAFTS) // PAGE)
  pages = 1 + np.random.default_rng(0).permutation(2 * per_row).astype(np.int32)
  return aux, tokens, np.array(n, np.int32), pages.reshape(2, per_row)


def check_against_golden(golden, first, chain, drafts, n, label):
  for i in range(2):
    err = rel_err(np.asarray(first)[i, :n[i]], golden[f"first_logits_{i}"])
    assert err <= REL_TOL, f"{label} prompt {i} first pass: relative error {err:.2e}"
    err = rel_err(np.asarray(chain)[i], golden[f"chain_logits_{i}"])
    assert err <= REL_TOL, f"{label} prompt {i} chained steps: relative error {err:.2e}"
    np.testing.assert_array_equal(np.asarray(drafts)[i], golden[f"draft_tokens_{i}"], label)


def run_chain(cfg, params, aux, tokens, n, page_table):
  pool = eagle3.init_pool(cfg, int(page_table.max()) + 1, PAGE, jnp.float32)
  return eagle3.draft_chain(params, pool, jnp.asarray(aux), jnp.asarray(tokens),
                            jnp.zeros(2, jnp.int32), jnp.asarray(n), jnp.asarray(page_table),
                            cfg=cfg, num_drafts=NUM_DRAFTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_matches_pytorch_golden(target, variant):
  tcfg, tparams, states = target
  cfg, params = load_eagle3(os.path.join(FIXTURES, variant), tcfg, tparams, jnp.float32)
  golden = np.load(os.path.join(FIXTURES, variant, "golden.npz"))
  assert cfg.aux_layers == tuple(golden["aux_layers"]) == (2, 3, 4)
  assert (jax.tree.map(lambda x: (x.shape, x.dtype), params)
          == jax.tree.map(lambda x: (x.shape, x.dtype), abstract_head_params(cfg, jnp.float32)))
  aux, tokens, n, pt = batch(states, cfg.aux_layers)
  first, chain, drafts, _ = run_chain(cfg, params, aux, tokens, n, pt)
  check_against_golden(golden, first, chain, drafts, n, variant)


@pytest.mark.parametrize("variant", ("mla", "mha_full"))
def test_first_pass_in_chunks_through_the_pool(target, variant):
  """The first pass split in two calls (the second reading the first's KV from the pool) gives
  the one-pass logits: the head's KV is written and read through the page table."""
  tcfg, tparams, states = target
  cfg, params = load_eagle3(os.path.join(FIXTURES, variant), tcfg, tparams, jnp.float32)
  golden = np.load(os.path.join(FIXTURES, variant, "golden.npz"))
  aux, tokens, n, pt = batch(states, cfg.aux_layers)
  g = eagle3.combine_aux(params, jnp.asarray(aux), cfg)
  pool = eagle3.init_pool(cfg, int(pt.max()) + 1, PAGE, jnp.float32)
  cut, w = 5, 8
  first = []
  for s in (0, cut):
    sl = slice(s, s + w)
    chunk = np.pad(tokens[:, sl], ((0, 0), (0, w - tokens[:, sl].shape[1])))
    hid = jnp.pad(g[:, sl], ((0, 0), (0, w - g[:, sl].shape[1]), (0, 0)))
    n_new = np.clip(n - s, 0, cut if s == 0 else w).astype(np.int32)
    logits, _, pool = _step(params, pool, hid, jnp.asarray(chunk), jnp.full(2, s, jnp.int32),
                            jnp.asarray(n_new), jnp.asarray(pt), cfg=cfg)
    first.append(np.asarray(logits)[:, :n_new.max()])
  first = np.concatenate(first, axis=1)
  for i in range(2):
    err = rel_err(first[i, :n[i]], golden[f"first_logits_{i}"])
    assert err <= REL_TOL, f"{variant} prompt {i} chunked first pass: relative error {err:.2e}"


def test_head_uses_its_own_rope_not_the_targets(target):
  tcfg, tparams, states = target
  cfg, params = load_eagle3(os.path.join(FIXTURES, "mla"), tcfg, tparams, jnp.float32)
  head_config = json.load(open(os.path.join(FIXTURES, "mla", "config.json")))
  assert cfg.layer.rope.theta == head_config["rope_theta"] != tcfg.rope.theta
  assert cfg.layer.rope.mscale == 0.9 and cfg.layer.rope.rope_type == "yarn"
  assert cfg.layer.rms_norm_eps == head_config["rms_norm_eps"] != tcfg.rms_norm_eps
  golden = np.load(os.path.join(FIXTURES, "mla", "golden.npz"))
  aux, tokens, n, pt = batch(states, cfg.aux_layers)
  wrong = dataclasses.replace(cfg, layer=dataclasses.replace(cfg.layer, rope=tcfg.rope))
  first, _, _, _ = run_chain(wrong, params, aux, tokens, n, pt)
  assert rel_err(np.asarray(first)[1, :n[1]], golden["first_logits_1"]) > 100 * REL_TOL


def copy_head(tmp_path, variant, edit=None, drop=(), rename=None):
  """A copy of a fixture head with its config edited and tensors dropped or renamed."""
  d = tmp_path / variant
  shutil.copytree(os.path.join(FIXTURES, variant), d)
  if edit is not None:
    c = json.loads((d / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
  if drop or rename:
    t = load_file(str(d / "model.safetensors"))
    t = {(rename or {}).get(k, k): v for k, v in t.items() if k not in drop}
    save_file(t, str(d / "model.safetensors"))
  return d


def test_aux_id_conventions_give_identical_drafts(target, tmp_path):
  """The same weights with aux ids written output-of [1, 2, 3] and input-to [2, 3, 4]."""
  tcfg, tparams, states = target
  out_cfg, out_params = load_eagle3(os.path.join(FIXTURES, "mla"), tcfg, tparams, jnp.float32)

  def to_input_convention(c):
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]

  d = copy_head(tmp_path, "mla", edit=to_input_convention)
  in_cfg, in_params = load_eagle3(str(d), tcfg, tparams, jnp.float32)
  assert out_cfg.aux_ids_in_config == (1, 2, 3) and in_cfg.aux_ids_in_config == (2, 3, 4)
  assert out_cfg.aux_layers == in_cfg.aux_layers == (2, 3, 4) and out_cfg == in_cfg
  aux, tokens, n, pt = batch(states, in_cfg.aux_layers)
  a = run_chain(out_cfg, out_params, aux, tokens, n, pt)
  b = run_chain(in_cfg, in_params, aux, tokens, n, pt)
  for x, y in zip(a[:3], b[:3]):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_aux_id_rule():
  assert resolve_aux_layer_ids([1, 29, 57], 61) == (2, 30, 58)  # TorchSpec / SpecForge
  assert resolve_aux_layer_ids([2, 30, 58], 61) == (2, 30, 58)  # exported / AQ-MedAI
  assert default_aux_layer_ids(61) == (2, 30, 58)
  assert resolve_aux_layer_ids([1, 2, 4], 5) == (2, 3, 5)  # 5: after the last layer
  with pytest.raises(Eagle3Error, match="eagle_aux_hidden_state_layer_ids.*outputs of layers"):
    resolve_aux_layer_ids([1, 2, 5], 5)
  with pytest.raises(Eagle3Error, match="eagle_aux_hidden_state_layer_ids"):
    resolve_aux_layer_ids([], 5)


def test_draft_vocabulary_maps_to_target_ids(target):
  tcfg, tparams, _ = target
  cfg, params = load_eagle3(os.path.join(FIXTURES, "mla_reduced"), tcfg, tparams, jnp.float32)
  assert cfg.reduced_vocab and cfg.draft_vocab_size == 96 and params["lm_head"].shape == (64, 96)
  d = load_file(os.path.join(FIXTURES, "mla_reduced", "model.safetensors"))
  np.testing.assert_array_equal(params["draft_to_target"], np.arange(96) + d["d2t"])
  assert d["t2d"].sum() == 96 and d["t2d"][np.asarray(params["draft_to_target"])].all()
  logits = jax.random.normal(jax.random.key(0), (3, 96))
  full = eagle3.target_vocab_logits(params, logits, cfg)
  assert full.shape == (3, tcfg.vocab_size) and int(jnp.isfinite(full).sum()) == 3 * 96
  np.testing.assert_array_equal(jnp.argmax(full, -1), eagle3.draft_token_ids(params, logits))
  # The head ships no embed_tokens: the target's embedding array serves it, not a copy.
  assert params["embed"] is tparams["embed"]


def test_head_without_lm_head_takes_the_targets(target, tmp_path):
  tcfg, tparams, _ = target
  d = copy_head(tmp_path, "mla", drop=("lm_head.weight",))
  _, params = load_eagle3(str(d), tcfg, tparams, jnp.float32)
  np.testing.assert_array_equal(params["lm_head"], tparams["lm_head"])
  d = copy_head(tmp_path / "r", "mla_reduced", drop=("lm_head.weight",))
  with pytest.raises(Eagle3Error, match="lm_head.weight"):
    load_eagle3(str(d), tcfg, tparams, jnp.float32)


@pytest.mark.parametrize("field,value,named", [
    ("vocab_size", 321, "vocab_size"),
    ("target_hidden_size", 48, "target_hidden_size"),
    ("hidden_size", 48, "hidden_size"),
    ("kv_lora_rank", 16, "kv_lora_rank"),
    ("num_hidden_layers", 2, "num_hidden_layers"),
    ("norm_before_fc", True, "norm_before_fc"),
    ("draft_vocab_size", 400, "draft_vocab_size"),
    ("architectures", ["Eagle3Speculator"], "architectures"),
    ("intermediate_size", None, "/mla/config.json: missing required field 'intermediate_size'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
])
def test_mismatched_head_is_refused_naming_the_field(target, field, value, named):
  tcfg = target[0]
  d = json.load(open(os.path.join(FIXTURES, "mla", "config.json")))
  d[field] = value
  with pytest.raises(Eagle3Error, match=named):
    eagle3_config_from_dict(d, tcfg, where=os.path.join(FIXTURES, "mla", "config.json"))


def test_head_config_defaults_as_vllm():
  """No q_lora_rank: q_proj (vLLM's hasattr fallback); no max_position_embeddings: 8192; no
  draft_vocab_size: the full vocabulary; no aux ids: [2, L // 2, L - 3]."""
  tcfg = load_config(os.path.join(FIXTURES, "target"))
  d = json.load(open(os.path.join(FIXTURES, "mla", "config.json")))
  for k in ("q_lora_rank", "max_position_embeddings", "draft_vocab_size", "eagle_config"):
    del d[k]
  cfg = eagle3_config_from_dict(d, tcfg)
  assert cfg.layer.q_lora_rank is None and cfg.layer.max_position_embeddings == 8192
  assert cfg.draft_vocab_size == tcfg.vocab_size and not cfg.reduced_vocab
  assert cfg.aux_layers == default_aux_layer_ids(5) == (2, 2, 2) and cfg.aux_ids_in_config == ()


def test_mha_head_on_the_mla_target_keeps_its_own_kv(target):
  tcfg = target[0]
  d = json.load(open(os.path.join(FIXTURES, "mha_reduced", "config.json")))
  cfg = eagle3_config_from_dict(d, tcfg)
  assert not cfg.is_mla and cfg.layer.num_kv_heads == 2 and cfg.layer.head_dim == 24
  assert eagle3.pool_shapes(cfg, 10, PAGE) == {"k": (10, PAGE, 2, 24), "v": (10, PAGE, 2, 24)}
  mla = eagle3_config_from_dict(json.load(open(os.path.join(FIXTURES, "mla", "config.json"))),
                                tcfg)
  assert eagle3.pool_shapes(mla, 10, PAGE) == {"latent": (10, PAGE, tcfg.latent_dim)}


def test_bad_checkpoint_directory_is_a_clear_error(target, tmp_path):
  tcfg, tparams, _ = target
  with pytest.raises(Eagle3Error, match="not a directory"):
    load_eagle3(str(tmp_path / "nowhere"), tcfg, tparams)
  (tmp_path / "empty").mkdir()
  with pytest.raises(Eagle3Error, match="no config.json"):
    load_eagle3(str(tmp_path / "empty"), tcfg, tparams)
  d = copy_head(tmp_path, "mla_reduced")
  os.remove(d / "model.safetensors")
  with pytest.raises(Eagle3Error, match="no model.safetensors"):
    load_eagle3(str(d), tcfg, tparams)
  (d / "pytorch_model.bin").write_bytes(b"\x80")
  with pytest.raises(Eagle3Error, match="pickle"):
    load_eagle3(str(d), tcfg, tparams)
  (d / "config.json").write_text("{")
  with pytest.raises(Eagle3Error, match="not valid JSON"):
    load_eagle3(str(d), tcfg, tparams)
  cases = [(dict(drop=("fc.weight",)), "missing tensors: fc.weight"),
           (dict(drop=("d2t",)), "no 'd2t'"),
           (dict(rename={"layers.0.mlp.up_proj.weight": "layers.1.mlp.up_proj.weight"}),
            "single-layer"),
           (dict(rename={"norm.weight": "final_norm.weight"}),
            "unexpected tensors: final_norm.weight")]
  for i, (kw, message) in enumerate(cases):
    with pytest.raises(Eagle3Error, match=message):
      load_eagle3(str(copy_head(tmp_path / str(i), "mla_reduced", **kw)), tcfg, tparams)
  d = copy_head(tmp_path / "shape", "mla_reduced")
  t = load_file(str(d / "model.safetensors"))
  t["fc.weight"] = t["fc.weight"][:, :128]
  save_file(t, str(d / "model.safetensors"))
  with pytest.raises(Eagle3Error, match=r"'fc.weight' has shape \[64, 128\], expected \[64, 192\]"):
    load_eagle3(str(d), tcfg, tparams)
  (d / "model.safetensors").write_bytes(b"\x08\x00")
  with pytest.raises(Eagle3Error, match="truncated or corrupt"):
    load_eagle3(str(d), tcfg, tparams)


def test_target_fixture_gives_the_captured_residual_streams(target):
  """The JAX target reproduces the states the goldens were fed: its final hidden state is the
  final norm of the stream after the last layer, its next token the one recorded."""
  tcfg, tparams, states = target
  assert tcfg.num_layers == states["residual_0"].shape[0] - 1 == 5 and tcfg.int4 is not None
  p = states["prompt_1"]
  pt = jnp.arange(1, 5, dtype=jnp.int32)[None]
  cache = init_cache(tcfg, 5, 4, jnp.float32)
  hidden, _ = jax.jit(forward, static_argnames=("cfg",))(
      tparams, cache, jnp.asarray(p[None]), jnp.zeros(1, jnp.int32),
      jnp.full(1, len(p), jnp.int32), pt, cfg=tcfg)
  want = rms_norm(jnp.asarray(states["residual_1"][-1]), tparams["final_norm"], tcfg.rms_norm_eps)
  assert rel_err(hidden[0], np.asarray(want)) <= REL_TOL
  assert int(jnp.argmax(hidden[0, -1] @ tparams["lm_head"])) == int(states["next_token_1"])


def test_target_forward_returns_the_residual_streams_entering_given_layers(target):
  """`forward_hidden_states`, as the EAGLE-3 loop asks it (the scanned stacks split at the aux
  layers): the residual stream entering every layer and after the last, against the states
  transformers' forward recorded (the aux layers' convention: "input to layer")."""
  tcfg, tparams, states = target
  p = states["prompt_1"]
  layers = tuple(range(tcfg.num_layers + 1))
  _, _, got = jax.jit(forward_hidden_states, static_argnames=("cfg", "layers"))(
      tparams, init_cache(tcfg, 5, 4, jnp.float32), jnp.asarray(p[None]),
      jnp.zeros(1, jnp.int32), jnp.full(1, len(p), jnp.int32),
      jnp.arange(1, 5, dtype=jnp.int32)[None], layers=layers, cfg=tcfg)
  for l in layers:
    assert rel_err(got[l, 0], states["residual_1"][l]) <= REL_TOL, l


@pytest.mark.parametrize("head", ["mla", "mha"])
def test_k25_shaped_head_lowers_for_cuda_with_mosaic_attention(target, head):
  """The drafting program of a K2.5-sized head (bf16, no weights: shapes only) exported for
  CUDA with the Mosaic GPU attention kernels: the first pass and the chained steps' kernels."""
  from cuda_export import MOSAIC_CALL, export_cuda_calls
  from engine.model.kernels import KernelChoice
  k25 = dataclasses.replace(target[0], hidden_size=7168, vocab_size=163840, kv_lora_rank=512,
                            qk_rope_head_dim=64, num_layers=61)
  cfg = eagle3_config_from_dict(K25_MLA_HEAD if head == "mla" else K25_MHA_HEAD, k25)
  assert cfg.aux_layers == (2, 30, 58) and cfg.reduced_vocab == (head == "mha")
  b, t, page, pages = 2, 8, 64, 4
  sds = jax.ShapeDtypeStruct
  pool = {k: sds(s, jnp.bfloat16) for k, s in eagle3.pool_shapes(cfg, b * pages, page).items()}
  row = sds((b,), jnp.int32)
  calls = export_cuda_calls(
      eagle3.draft_chain, abstract_head_params(cfg, jnp.bfloat16), pool,
      sds((b, t, cfg.num_aux * 7168), jnp.bfloat16), sds((b, t), jnp.int32), row, row,
      sds((b, pages), jnp.int32), cfg=cfg, num_drafts=3,
      impl=KernelChoice(attention="mosaic_gpu"))
  assert calls.count(MOSAIC_CALL) >= 2, calls
  assert not {c for c in calls if "callback" in c or c.startswith("lapack")}, calls
