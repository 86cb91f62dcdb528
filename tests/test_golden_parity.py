"""Parity with Hugging Face transformers on tiny random models (fixtures in tests/golden).

Each fixture holds a checkpoint written by transformers' `save_pretrained` and the logits and
greedy tokens transformers computed for two prompts (see tests/golden/README.md). We load the
checkpoint through our own loader and require, in float32:
* prefill logits and every decode step's logits through the paged cache: relative error
  max|ours - theirs| / max|theirs| <= 1e-4;
* the 32 greedy tokens of the jitted generation loop: identical.
Both prompts run together as one batch of different lengths.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.transformer import forward_logits
from engine.runtime.generate import generate_tokens

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "golden", "fixtures")
CASES = sorted(json.load(open(os.path.join(FIXTURES, "MANIFEST.json")))["cases"]) if (
    os.path.exists(os.path.join(FIXTURES, "MANIFEST.json"))) else []
REL_TOL = 1e-4


def _rel_err(got, want):
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module", params=CASES)
def case(request):
  path = os.path.join(FIXTURES, request.param)
  model = engine.load(path, dtype="float32", progress=False)
  golden = dict(np.load(os.path.join(path, "golden.npz")))
  return request.param, model, golden


def test_fixture_families_cover_the_issue():
  families = {json.load(open(os.path.join(FIXTURES, c, "config.json")))["model_type"]
              for c in CASES}
  assert {"deepseek_v3", "deepseek_v2", "qwen3_moe", "llama", "qwen3"} <= families


def test_prefill_and_decode_logits(case):
  name, model, g = case
  cfg, params, _ = model
  prompts = [g["prompt_0"], g["prompt_1"]]
  lens = np.array([len(p) for p in prompts], np.int32)
  steps = g["decode_logits_0"].shape[0]
  page_size = 8
  pt = contiguous_page_table(2, int(lens.max()) + steps + 1, page_size)
  cache = init_cache(cfg, pt.size, page_size, jnp.float32)
  tokens = np.zeros((2, 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  logits, cache = forward_logits(params, cache, jnp.asarray(tokens), jnp.zeros(2, jnp.int32),
                                 jnp.asarray(lens), jnp.asarray(pt), cfg=cfg)
  for i in range(2):
    err = _rel_err(np.asarray(logits)[i, :lens[i]], g[f"prefill_logits_{i}"])
    assert err <= REL_TOL, f"{name} prompt {i} prefill: relative error {err:.2e}"
  # Decode: feed transformers' greedy tokens one at a time through our cache.
  for t in range(steps):
    tok = np.array([[g["greedy_0"][t]], [g["greedy_1"][t]]], np.int32)
    logits, cache = forward_logits(params, cache, jnp.asarray(tok), jnp.asarray(lens + t),
                                   jnp.ones(2, jnp.int32), jnp.asarray(pt), cfg=cfg)
    for i in range(2):
      err = _rel_err(np.asarray(logits)[i, 0], g[f"decode_logits_{i}"][t])
      assert err <= REL_TOL, f"{name} prompt {i} decode step {t}: relative error {err:.2e}"


def test_greedy_tokens_identical(case):
  name, model, g = case
  cfg, params, _ = model
  prompts = [g["prompt_0"].tolist(), g["prompt_1"].tolist()]
  n = len(g["greedy_0"])
  out = generate_tokens(params, cfg, prompts, max_new_tokens=n, ignore_eos=True)
  for i in range(2):
    assert out[i].token_ids == g[f"greedy_{i}"].tolist(), f"{name} prompt {i}"
