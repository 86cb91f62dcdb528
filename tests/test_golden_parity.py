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
import numpy as np
import pytest

import engine
from tests import golden_check
from tests.generation import generate_ids, loaded

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = os.path.join(os.path.dirname(__file__), "golden", "fixtures")
CASES = sorted(json.load(open(os.path.join(FIXTURES, "MANIFEST.json")))["cases"]) if (
    os.path.exists(os.path.join(FIXTURES, "MANIFEST.json"))) else []


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
  golden_check.assert_logits_match(params, cfg, g, name)


@pytest.mark.slow
def test_greedy_tokens_identical(case):
  name, model, g = case
  cfg, params, _ = model
  prompts = [g["prompt_0"].tolist(), g["prompt_1"].tolist()]
  n = len(g["greedy_0"])
  out = generate_ids(loaded(cfg, params), prompts, max_new_tokens=n, ignore_eos=True)
  for i in range(2):
    assert out[i].token_ids == g[f"greedy_{i}"].tolist(), f"{name} prompt {i}"
