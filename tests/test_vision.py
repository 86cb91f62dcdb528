"""Kimi K2.5's vision tower against transformers: preprocessing, image features, multimodal
logits and greedy tokens.

The fixture (`tests/golden/fixtures/kimi_k25_vision`, made by
`tests/golden/make_golden_k25_vision.py`) is a miniature K2.5 written by transformers' own
`Kimi_K25ForConditionalGeneration` with a 2-layer vision tower, hub tensor names, a
`preprocessor_config.json` with small patch limits and a Kimi tokenizer; its goldens are
transformers' (float32, eager) on the synthetic images of `tests/golden/vision_images.py`.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import engine
from engine.api import load_tokenizer
from engine.model import image_processing as ip
from engine.model import vision
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import without_vision
from engine.model.safetensors_io import load_file
from engine.model.orbax_io import save_orbax
from engine.model.transformer import embed_tokens, forward_logits, scatter_image_features
from tests import golden_check
from tests.golden.vision_images import IMAGE_CASES, make_image

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURE = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "kimi_k25_vision")
FEATURE_TOL = 1e-5  # max|ours - theirs| / max|theirs|, float32 (measured ~1e-6)
SINGLE_BUCKET = 64  # patches every single image is padded to: one compiled program for all


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(os.path.join(FIXTURE, "golden.npz")))


@pytest.fixture(scope="module")
def model():
  return engine.load(FIXTURE, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def proc_cfg():
  return ip.ImageProcessorConfig.from_dir(FIXTURE)


# ---- preprocessing ---------------------------------------------------------------------------

def test_preprocessor_config_and_tokenizer(proc_cfg, model):
  assert (proc_cfg.patch_size, proc_cfg.merge_size) == (14, 2)
  assert (proc_cfg.max_patches, proc_cfg.max_patches_per_side) == (40, 8)
  cfg = model.config
  assert cfg.vision.patch_size == 14 and cfg.vision.merge_kernel == (2, 2)
  tok = load_tokenizer(FIXTURE)
  # Kimi's special table after the 256 byte ranks: <|media_pad|> is offset 21.
  ids = tok.encode("<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
                   allow_special_tokens=True).ids
  assert ids == [274, *b"image", 275, cfg.media_pad_token_id, 276]
  assert cfg.media_pad_token_id == 277


@pytest.mark.parametrize("i", range(len(IMAGE_CASES)))
def test_pixel_values_equal_transformers(i, golden, proc_cfg):
  """Bit for bit, for sizes that fit, need padding, are smaller than a patch or hit the
  per-side or total patch limit, and for RGBA and grayscale images."""
  batch = ip.preprocess([make_image(i)], proc_cfg)
  assert batch.grid_thws.tolist() == golden[f"grid_thw_{i}"].tolist()
  assert batch.pixel_values.dtype == np.float32
  np.testing.assert_array_equal(batch.pixel_values, golden[f"pixel_values_{i}"])
  h, w, _ = IMAGE_CASES[i]
  assert ip.image_grid(h, w, proc_cfg) == tuple(golden[f"grid_thw_{i}"][0])
  assert batch.num_tokens(proc_cfg) == [int(golden["image_tokens"][i])]


def test_preprocess_batches_in_order_and_refuses_non_images(golden, proc_cfg):
  batch = ip.preprocess([make_image(i) for i in (3, 0)], proc_cfg)
  np.testing.assert_array_equal(
      batch.pixel_values, np.concatenate([golden["pixel_values_3"], golden["pixel_values_0"]]))
  assert batch.grid_thws.tolist() == [golden["grid_thw_3"][0].tolist(),
                                      golden["grid_thw_0"][0].tolist()]
  with pytest.raises(ip.ImageError, match="expected a PIL image"):
    ip.preprocess([np.zeros((4, 4, 3), np.uint8)], proc_cfg)
  with pytest.raises(ip.ImageError, match="no images"):
    ip.preprocess([], proc_cfg)


def test_orbax_round_trip_keeps_the_tower_and_the_preprocessor(tmp_path, model, proc_cfg):
  out = str(tmp_path / "orbax")
  save_orbax(out, FIXTURE, model.params)
  again = engine.load(out, progress=False)
  assert again.config.vision == model.config.vision
  assert again.config.media_pad_token_id == model.config.media_pad_token_id
  for a, b in zip(jax.tree.leaves(again.params["vision"]), jax.tree.leaves(model.params["vision"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert ip.ImageProcessorConfig.from_dir(out) == proc_cfg


def test_expand_image_placeholders_matches_the_golden_prompt(golden, proc_cfg, model):
  """The chat template writes one <|media_pad|> per image; the processor's expansion gives the
  prompt transformers ran."""
  pad = model.config.media_pad_token_id
  want = golden["prompt_1"].tolist()
  n = [int(golden["image_tokens"][i]) for i in golden["prompt_images_1"]]
  one_each, i = [], 0
  while i < len(want):  # collapse each run of pads to one
    one_each.append(want[i])
    i += n[len([t for t in one_each if t == pad]) - 1] if want[i] == pad else 1
  assert one_each.count(pad) == 2
  assert ip.expand_image_placeholders(one_each, n, pad) == want
  with pytest.raises(ip.ImageError, match="2 image placeholders .* for 1 images"):
    ip.expand_image_placeholders(one_each, n[:1], pad)


def test_checkpoint_without_vision_tensors_loads_text_only(tmp_path, model):
  ckpt = tmp_path / "text_only"
  ckpt.mkdir()
  for f in ("config.json", "tiktoken.model", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIXTURE, f), ckpt / f)
  tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
  save_file({k: v for k, v in tensors.items() if k.startswith("language_model.")},
            str(ckpt / "model.safetensors"))
  text = engine.load(str(ckpt), dtype="float32", progress=False)
  assert text.config.vision is None and "vision" not in text.params
  assert text.config == without_vision(model.config)


# ---- the tower -------------------------------------------------------------------------------

def _rel_err(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def test_image_features_equal_transformers(model, golden):
  """All 8 images in one call (attention within each image only), then each image alone
  padded to one shape bucket."""
  cfg = model.config
  pixels = np.concatenate([golden[f"pixel_values_{i}"] for i in range(len(IMAGE_CASES))])
  grids = np.concatenate([golden[f"grid_thw_{i}"] for i in range(len(IMAGE_CASES))])
  want = golden["image_features"]
  feats = vision.encode_images(model.params["vision"], pixels, grids, cfg=cfg.vision)
  assert feats.shape == want.shape == (int(golden["image_tokens"].sum()), cfg.hidden_size)
  assert _rel_err(feats, want) <= FEATURE_TOL
  offsets = np.concatenate([[0], np.cumsum(golden["image_tokens"])])
  for i in (1, 2, 4, 6):  # 1, 8 (upsampled table), 16 (8x8 grid) and 6 tokens
    one = vision.encode_images(model.params["vision"], golden[f"pixel_values_{i}"],
                               golden[f"grid_thw_{i}"], cfg=cfg.vision, num_patches=SINGLE_BUCKET)
    err = _rel_err(one, want[offsets[i]:offsets[i + 1]])
    assert err <= FEATURE_TOL, f"image {i}: relative error {err:.2e}"


def test_scatter_image_features_fills_slots_in_order():
  embeds = jnp.zeros((2, 4, 3))
  tokens = jnp.array([[5, 9, 9, 1], [9, 2, 3, 9]])
  feats = jnp.arange(12.0).reshape(4, 3) + 1
  out = np.asarray(scatter_image_features(embeds, tokens, feats, 9))
  np.testing.assert_array_equal(out[0, 1:3], feats[:2])
  np.testing.assert_array_equal(out[1, [0, 3]], feats[2:])
  assert not out[0, [0, 3]].any() and not out[1, 1:3].any()


# ---- the multimodal model --------------------------------------------------------------------

def _prompt_embeds(model, golden, prompts, width):
  """[B, width, H] input embeddings: the token table with each prompt's images' features in
  its <|media_pad|> slots (all prompts' images encoded in one call)."""
  cfg, params = model.config, model.params
  idx = [int(i) for j in range(len(prompts)) for i in golden[f"prompt_images_{j}"]]
  feats = vision.encode_images(
      params["vision"], np.concatenate([golden[f"pixel_values_{i}"] for i in idx]),
      np.concatenate([golden[f"grid_thw_{i}"] for i in idx]), cfg=cfg.vision)
  tokens = np.zeros((len(prompts), width), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  assert int((tokens == cfg.media_pad_token_id).sum()) == feats.shape[0]
  embeds = scatter_image_features(embed_tokens(params, jnp.asarray(tokens), cfg),
                                  jnp.asarray(tokens), feats, cfg.media_pad_token_id)
  return tokens, embeds


def test_multimodal_logits_and_greedy_tokens_equal_transformers(model, golden):
  """One prompt with one image and one with two, as a batch: prefill logits with the image
  features scattered in, then 31 greedy steps through the paged cache, each token our own
  argmax (equal to transformers') and its logits compared."""
  cfg, params = model.config, model.params
  prompts = [golden["prompt_0"], golden["prompt_1"]]
  lens = np.array([len(p) for p in prompts], np.int32)
  width = int(-(-lens.max() // 16) * 16)
  tokens, embeds = _prompt_embeds(model, golden, prompts, width)
  steps = golden["decode_logits_0"].shape[0]
  pt = contiguous_page_table(2, width + steps + 1, 8)
  cache = init_cache(cfg, pt.size, 8, jnp.float32)
  logits, cache = forward_logits(params, cache, jnp.asarray(tokens), jnp.zeros(2, jnp.int32),
                                 jnp.asarray(lens), jnp.asarray(pt), cfg=cfg, input_embeds=embeds)
  logits = np.asarray(logits)
  for b in range(2):
    err = _rel_err(logits[b, :lens[b]], golden[f"prefill_logits_{b}"])
    assert err <= golden_check.REL_TOL, f"prompt {b} prefill: relative error {err:.2e}"
  greedy = [[int(logits[b, lens[b] - 1].argmax())] for b in range(2)]
  for t in range(steps):
    tok = np.array([[g[-1]] for g in greedy], np.int32)
    step, cache = forward_logits(params, cache, jnp.asarray(tok), jnp.asarray(lens + t),
                                 jnp.ones(2, jnp.int32), jnp.asarray(pt), cfg=cfg)
    step = np.asarray(step)[:, 0]
    for b in range(2):
      err = _rel_err(step[b], golden[f"decode_logits_{b}"][t])
      assert err <= golden_check.REL_TOL, f"prompt {b} decode step {t}: relative error {err:.2e}"
      greedy[b].append(int(step[b].argmax()))
  for b in range(2):
    assert greedy[b] == golden[f"greedy_{b}"].tolist(), f"prompt {b}"


def test_images_change_the_logits_and_token_embeds_match_the_table(model, golden):
  """The features matter (text-only embeddings at the image slots give other logits), and
  input_embeds = embed_tokens(tokens) is the token path."""
  cfg, params = model.config, model.params
  p = golden["prompt_0"]
  width = int(-(-len(p) // 16) * 16)
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :len(p)] = p
  args = (jnp.zeros(1, jnp.int32), jnp.array([len(p)], jnp.int32),
          jnp.asarray(contiguous_page_table(1, width, 8)))

  def run(**kw):
    cache = init_cache(cfg, width, 8, jnp.float32)
    return np.asarray(forward_logits(params, cache, jnp.asarray(tokens), *args, cfg=cfg,
                                     **kw)[0])[0, :len(p)]

  plain = run()
  np.testing.assert_array_equal(
      run(input_embeds=embed_tokens(params, jnp.asarray(tokens), cfg)), plain)
  assert _rel_err(plain, golden["prefill_logits_0"]) > 100 * golden_check.REL_TOL
