"""MTP weights are optional: a config declaring MTP layers the checkpoint does not hold.

`tests/golden/fixtures/dsv3_mtp_unsaved` was saved by transformers 5.24: its config.json says
num_nextn_predict_layers=1 (DeepseekV3Config's default) and it holds no MTP tensor, as no
checkpoint transformers saves does. Its logits parity is in test_golden_parity.py; here: the
loaded config, the refusal of drafter "mtp", and checkpoints that do hold MTP weights.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import engine
from checkpoints.convert import convert
from engine.model.config import config_from_dict, load_config
from engine.model.hf_loader import CheckpointError, checkpoint_config, load_hf_params
from engine.model.params import init_params
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.llm import SpeculativeConfig
from tests import hf_fixtures as fx

FIXTURE = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "dsv3_mtp_unsaved")
REASON = r"declares num_nextn_predict_layers=1 but the checkpoint holds no MTP weights"


@pytest.fixture(scope="module")
def model():
  return engine.load(FIXTURE, dtype="float32", progress=False)


def test_declared_but_absent_mtp_loads_without_it(model):
  assert json.load(open(os.path.join(FIXTURE, "config.json")))["num_nextn_predict_layers"] == 1
  cfg = model.config
  assert (cfg.num_nextn_predict_layers, cfg.mtp_layers_absent) == (0, 1)
  assert len(cfg.moe_layers) == cfg.num_layers == 2
  assert "mtp" not in model.params
  out = engine.generate(model, [1, 5, 6], max_new_tokens=3)
  assert len(out.token_ids) == 3


def test_mtp_drafter_refused_with_the_reason(model):
  cfg, params, _ = model
  with pytest.raises(ValueError, match=REASON):
    Engine(cfg, params, EngineConfig(max_num_seqs=2, max_model_len=64, speculative="mtp"))
  with pytest.raises(ValueError, match=REASON):
    Engine(cfg, params, EngineConfig(max_num_seqs=2, max_model_len=64, speculative="auto",
                                     drafters=("ngram", "mtp")))
  with pytest.raises(ValueError, match=REASON):
    engine.generate(model, [1, 5, 6], max_new_tokens=2,
                    speculative=SpeculativeConfig("mtp", num_draft_tokens=2))
  assert "mtp" not in SpeculativeConfig("auto").drafters(cfg)


def test_explicit_config_with_mtp_names_the_cause():
  with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.[\s\S]*"
                     r"declares num_nextn_predict_layers=1 but the checkpoint holds no MTP"):
    load_hf_params(FIXTURE, load_config(FIXTURE), progress=False)


def _mtp_checkpoint(tmp_path, drop=None):
  cfg_dict = dict(fx.DEEPSEEK_V3, num_nextn_predict_layers=1)
  cfg = config_from_dict(cfg_dict)
  tensors = fx.hf_tensors(cfg_dict, init_params(cfg, seed=4))
  if drop:
    del tensors[drop]
  ckpt = str(tmp_path / "mtp")
  fx.write_checkpoint(cfg_dict, tensors, ckpt)
  return cfg, ckpt


def test_present_mtp_is_used(tmp_path):
  cfg, ckpt = _mtp_checkpoint(tmp_path)
  assert checkpoint_config(ckpt) == cfg
  params = load_hf_params(ckpt, dtype=jnp.float32, progress=False)
  assert len(params["mtp"]) == 1


def test_partial_mtp_is_an_error_not_dropped(tmp_path):
  _, ckpt = _mtp_checkpoint(tmp_path, drop="model.layers.3.hnorm.weight")
  assert checkpoint_config(ckpt).num_nextn_predict_layers == 1
  with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\.hnorm\.weight'"):
    load_hf_params(ckpt, progress=False)


def test_convert_writes_a_config_without_mtp(model, tmp_path):
  out = str(tmp_path / "orbax")
  convert(FIXTURE, out, dtype="float32", progress=False)
  assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 0
  restored = engine.load(out, progress=False)
  assert restored.config.num_nextn_predict_layers == 0
  np.testing.assert_array_equal(np.asarray(restored.params["embed"]),
                                np.asarray(model.params["embed"]))
