"""The EAGLE-3 head's training (`checkpoints.train_eagle3`): the fast path (the target's states
computed once per sequence, `precompute` + `head_losses`) has the objective of the reference
path that runs the target inside the loss (`losses`): same loss, metrics and gradients."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

TARGET = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "eagle3", "target")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """The tiny Kimi K2.5 INT4 target of the EAGLE-3 goldens (5 layers; float32) and a fresh MLA
  head for it, as `train_eagle3` makes one (the demo target's forward compiles ~3x longer)."""
  from checkpoints import train_eagle3
  from engine.model.config import load_config
  from engine.model.eagle3_loader import load_eagle3
  from engine.model.hf_loader import load_hf_params
  cfg = load_config(TARGET)
  tparams = load_hf_params(TARGET, cfg, jnp.float32, progress=False)
  with open(os.path.join(TARGET, "config.json")) as fh:
    raw = json.load(fh)["text_config"]
  d = str(tmp_path_factory.mktemp("head"))
  conf = train_eagle3.head_config_dict(raw, 64, aux_ids=[2, 3, 4])
  train_eagle3.save_head(d, conf, train_eagle3.initial_tensors(conf, cfg, tparams, seed=1))
  hcfg, params = load_eagle3(d, cfg, tparams, jnp.float32)
  frozen = {"embed": params.pop("embed")}
  return cfg, tparams, hcfg, params, frozen


def test_soft_ce_against_numpy_and_the_reduced_vocabulary_rule():
  """sum 0.8^k CE_k against the target's distribution k + 2 ahead; with a draft vocabulary,
  the target renormalised over it, positions whose target top-1 is outside it left out, and
  draft ids mapped to target ids for agreement."""
  from checkpoints import train_eagle3
  rng = np.random.default_rng(0)
  v, t, k = 12, 5, 2
  tl = rng.standard_normal((2, t + k, v)).astype(np.float32)
  tl[0, 2, 7] = 9.0  # (a top-1 outside the draft vocabulary below)
  used = np.asarray([0, 2, 3, 5, 8, 11], np.int32)
  full = [rng.standard_normal((2, t, v)).astype(np.float32) for _ in range(k)]
  small = [lg[..., used] for lg in full]

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
  want, want_r = 0.0, 0.0
  for i in range(k):
    target = tl[:, i + 1:i + 1 + t]
    p = np.exp(log_softmax(target))
    want += 0.8 ** i * -np.mean(np.sum(p * log_softmax(full[i]), -1))
    inside = np.isin(target.argmax(-1), used)
    pr = np.exp(log_softmax(target[..., used]))
    per = -np.sum(pr * log_softmax(small[i]), -1)
    want_r += 0.8 ** i * per[inside].mean()
    if i == 1:
      assert not inside[0, 0]  # (step 1 at t = 0: the token at 2)
  got, m = train_eagle3.soft_ce([jnp.asarray(x) for x in full], jnp.asarray(tl))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  got_r, m_r = train_eagle3.soft_ce([jnp.asarray(x) for x in small], jnp.asarray(tl),
                                    jnp.asarray(used))
  np.testing.assert_allclose(float(got_r), want_r, rtol=1e-5)
  agree = np.mean(used[small[0].argmax(-1)] == tl[:, 1:1 + t].argmax(-1))
  np.testing.assert_allclose(float(m_r["agree0"]), agree)
  # d2t / t2d as published: target id = draft id + d2t, t2d marks the kept ids.
  vm = train_eagle3.vocab_map(used, v)
  assert (np.arange(len(used)) + vm["d2t"] == used).all() and vm["t2d"].sum() == len(used)
  assert vm["t2d"][used].all() and vm["d2t"].dtype == np.int64


@pytest.mark.slow
def test_precomputed_states_give_the_reference_loss_and_gradients(setup):
  """Both paths jitted, each as one program: the loss, metrics and gradients with the full
  vocabulary and the loss with a reduced one (op by op, the test compiled ~580 small programs,
  one per operation and shape: the reference path took ~3x its jitted time)."""
  from checkpoints import train_eagle3
  tcfg, tparams, hcfg, params, frozen = setup
  ids = np.random.default_rng(0).integers(3, tcfg.vocab_size, (4, 20)).astype(np.int32)
  k = 3
  # A reduced draft vocabulary: the same on both paths.
  used = jnp.asarray(train_eagle3.draft_vocab(ids, tcfg.vocab_size, 40))
  frozen_r = dict(frozen, draft_to_target=used)

  def both(loss):
    """(value and gradients of loss(train, frozen), loss(reduced train, frozen_r)'s value)."""
    def run(p, *args):
      small = dict(p, lm_head=p["lm_head"][:, used])
      return (jax.value_and_grad(lambda q: loss(q, frozen, *args), has_aux=True)(p),
              loss(small, frozen_r, *args)[0])
    return jax.jit(run)

  ref = both(lambda p, fr: train_eagle3.losses(p, fr, tparams, jnp.asarray(ids), tcfg=tcfg,
                                               hcfg=hcfg, k_steps=k))
  ((want, want_m), want_g), want_r = ref(params)
  # (two chunks of one shape: one compiled target forward; a third shape costs ~5 s)
  aux, final = train_eagle3.precompute(tparams, tcfg, hcfg, ids, chunk=2)
  assert aux.shape == (4, 20, 3 * tcfg.hidden_size) and final.shape == (4, 20, tcfg.hidden_size)
  fast = both(lambda p, fr, aux: train_eagle3.head_losses(
      p, fr, tparams["lm_head"], aux, jnp.asarray(final), jnp.asarray(ids), hcfg=hcfg,
      k_steps=k))
  ((got, got_m), got_g), got_r = fast(params, jnp.asarray(aux))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  assert set(got_m) == {f"{m}{i}" for m in ("ce", "agree") for i in range(k)}
  for name in want_m:
    np.testing.assert_allclose(float(got_m[name]), float(want_m[name]), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    scale = float(np.max(np.abs(np.asarray(b))))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5 * scale)
  # A sequence's states out of place (another sequence's) changes the loss: the test can fail.
  shifted = fast(params, jnp.asarray(aux[::-1]))[0][0][0]
  assert abs(float(shifted) - float(want)) > 1e-3
  np.testing.assert_allclose(float(got_r), float(want_r), rtol=1e-5)
  assert abs(float(got_r) - float(want)) > 1e-3
