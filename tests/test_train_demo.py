"""The demo-model training step: losses fall, balancing moves the bias, batches are a pure
function of (seed, step), the MTP evaluation is well formed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import train_demo
from engine.model.config import config_from_dict
from engine.model.params import init_params
from model_configs import CONFIGS


def _tiny():
  cfg_dict = dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1, vocab_size=64,
                  num_hidden_layers=2)  # a dense layer, a MoE layer, the MTP layer
  cfg = config_from_dict(cfg_dict)
  params = init_params(cfg, seed=0)
  params["embed"] = params["embed"] * 0.02
  return cfg, params


def _markov_ids(n, vocab=64, seed=0):
  rng = np.random.default_rng(seed)
  nxt = rng.integers(3, vocab, size=vocab)
  ids = [3]
  for _ in range(n - 1):
    ids.append(nxt[ids[-1]] if rng.random() < 0.9 else rng.integers(3, vocab))
  return np.asarray(ids, np.int32)


def test_batches_depend_only_on_seed_and_step():
  ids = np.arange(1000, dtype=np.int32)
  a = train_demo.batch_windows(ids, 7, 4, 16, seed=1)
  assert a.shape == (4, 18)
  np.testing.assert_array_equal(a, train_demo.batch_windows(ids, 7, 4, 16, seed=1))
  assert not np.array_equal(a, train_demo.batch_windows(ids, 8, 4, 16, seed=1))
  np.testing.assert_array_equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows


@pytest.mark.slow
def test_training_lowers_both_losses_and_balances_experts():
  cfg, params = _tiny()
  opt = train_demo.make_optimizer(params, steps=60, lr=1e-2, warmup=5, weight_decay=0.1)
  step = train_demo.make_train_step(cfg, opt, mtp_weight=0.3, bias_rate=1e-3)
  opt_state = opt.init(params)
  ids = _markov_ids(5000)
  bias0 = np.asarray(params["stacks"][1]["moe"]["router_bias"])  # the MoE layers' [L, E]
  first = None
  for k in range(60):
    params, opt_state, m = step(params, opt_state,
                                jnp.asarray(train_demo.batch_windows(ids, k, 4, 32, seed=0)))
    first = first or {key: float(v) for key, v in m.items()}
  assert float(m["ce"]) < first["ce"] - 1.0
  assert float(m["mtp_ce"]) < first["mtp_ce"] - 0.5
  bias = np.asarray(params["stacks"][1]["moe"]["router_bias"])
  assert 0 < np.max(np.abs(bias - bias0)) <= 60 * 1e-3 + 1e-6  # moved only by the balancing rule
  assert "router_bias" in params["mtp"][0]["moe"]


def test_evaluate_reports_mtp_agreement():
  cfg, params = _tiny()
  ids = _markov_ids(2000, seed=1)
  r = train_demo.evaluate(params, cfg, train_demo.heldout_windows(ids, 32, limit=8), batch=4)
  assert r["windows"] == 8
  assert 0.0 <= r["mtp_agree"] <= 1.0 and r["ce"] > 0 and r["mtp_ce"] > 0


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted(tmp_path):
  """`python -m checkpoints.train_demo` stopped after 2 steps and rerun gives the same weights as
  one run of 4 steps (batches are a function of (seed, step); state is restored exactly)."""
  import json
  import os
  import subprocess
  import sys

  import engine
  from model_configs import CONFIGS

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg_path = tmp_path / "config.json"
  cfg_path.write_text(json.dumps(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1,
                                      vocab_size=8192, num_hidden_layers=2)))

  def run(name, steps, extra=()):
    cmd = [sys.executable, "-m", "checkpoints.train_demo", f"--config_json={cfg_path}",
           f"--steps={steps}", "--batch_size=2", "--seq_len=16", "--save_every=2",
           f"--workdir={tmp_path / name / 'work'}", f"--out={tmp_path / name / 'out'}",
           "--eval_windows=4", *extra]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]

  run("straight", 4)
  run("resumed", 4, ["--max_minutes=1e-9"])  # stops (and saves) after its first step
  assert not (tmp_path / "resumed" / "out").exists()
  run("resumed", 4)
  a = engine.load(str(tmp_path / "straight" / "out"), progress=False).params
  b = engine.load(str(tmp_path / "resumed" / "out"), progress=False).params
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
