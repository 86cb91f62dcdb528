"""The shipped demo checkpoints (checkpoints/demo): config, shapes, size, quality, generation."""

import json
import os
import tempfile

import jax
import numpy as np
import pytest

import engine
from checkpoints import demo_corpus, train_demo
from checkpoints.ngram_baseline import KneserNeyLM
from engine.model.params import check_params

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints",
                    "demo")
# The tokenized corpus, kept between runs in the temporary folder (not the user's cache).
CORPUS_CACHE = os.path.join(tempfile.gettempdir(), "moejax-test-corpus")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "target", "moejax.json")),
                                reason="demo checkpoints not trained yet")


@pytest.fixture(scope="module")
def target():
  return engine.load(os.path.join(DEMO, "target"), progress=False)


@pytest.fixture(scope="module")
def draft():
  return engine.load(os.path.join(DEMO, "draft"), progress=False)


def _dir_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_configs_and_shapes(target, draft):
  cfg = target.config
  assert cfg.model_type == "deepseek_v3" and cfg.is_mla
  assert cfg.num_nextn_predict_layers == 1 and cfg.topk_method == "noaux_tc"
  assert cfg.moe_layers[0] is False and all(cfg.moe_layers[1:])
  assert cfg.num_shared_experts >= 1 and cfg.rope.rope_type == "yarn"
  check_params(cfg, target.params)
  check_params(draft.config, draft.params)
  assert draft.config.vocab_size == cfg.vocab_size
  n_target = sum(x.size for x in jax.tree.leaves(target.params))
  n_draft = sum(x.size for x in jax.tree.leaves(draft.params))
  assert n_draft * 4 < n_target
  with open(os.path.join(DEMO, "target", "config.json")) as fh:
    assert json.load(fh)["architectures"] == ["DeepseekV3ForCausalLM"]
  assert _dir_bytes(DEMO) <= 25 * 2**20


@pytest.mark.slow
def test_target_beats_draft_and_4gram_on_heldout(target, draft):
  """On the same held-out windows (evenly spaced over the split, no context across windows):
  cross-entropy of the shipped (bf16) target < draft, and < the smoothed 4-gram."""
  tok = demo_corpus.load_tokenizer(os.path.join(DEMO, "tokenizer.json"))
  train_ids, heldout_ids = demo_corpus.tokenized_corpus(CORPUS_CACHE, tok)
  windows = train_demo.heldout_windows(heldout_ids, 256)
  windows = windows[np.linspace(0, len(windows) - 1, 48).astype(int)]
  t = train_demo.evaluate(target.params, target.config, windows, batch=8)
  d = train_demo.evaluate(draft.params, draft.config, windows, batch=8)
  lm = KneserNeyLM(train_ids, n=4, vocab_size=tok.get_vocab_size())
  # Score what the model scores: tokens 1..T of each window, given the window before them.
  ngram = float(np.mean(np.concatenate(
      [-lm.log_probs(w[:-1])[int(w[0] != demo_corpus.BOS_ID):] for w in windows])))
  assert t["ce"] < d["ce"] and t["ce"] < ngram - 0.05, (t, d, ngram)
  # The MTP head mostly agrees with what the target itself predicts next.
  assert t["mtp_agree"] > 0.5, t


@pytest.mark.slow
def test_generates_python(target):
  prompt = target.encode("def read_config(path):")  # no trailing newline (BPE merges it)
  assert prompt[0] == demo_corpus.BOS_ID  # the tokenizer frames prompts like training documents
  # (32 new tokens: the README's notebook snippet generates as many from a prompt of the same
  # page-table size, so a run's compilation cache gives it these programs)
  out = engine.generate(target, prompt, max_new_tokens=32)
  assert len(out.token_ids) > 4
  text = out.text
  # A function body: a new line indented one level under the header, then words.
  assert text.startswith("\n    ") and len(text.split()) >= 5, text
  # (32 new tokens as above: the same compiled prefill and decode programs serve both prompts)
  method = engine.generate(target, target.encode("    def close(self):"), max_new_tokens=32)
  assert method.text.startswith("\n        "), method.text
