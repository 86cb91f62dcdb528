"""Config parsing for every supported family, and its errors."""

import json

import pytest

from engine.model.config import ConfigError, config_from_dict, load_config
from model_configs import CONFIGS


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parses_every_family(name):
  cfg = config_from_dict(CONFIGS[name])
  assert cfg.num_layers == CONFIGS[name]["num_hidden_layers"]
  assert len(cfg.moe_layers) == cfg.num_layers + cfg.num_nextn_predict_layers
  hash(cfg)  # static argument of jitted functions


def test_deepseek_v3_fields():
  cfg = config_from_dict(CONFIGS["deepseek_v3"])
  assert cfg.is_mla and cfg.latent_dim == 32 + 8
  assert cfg.moe_layers == (False, True, True)
  assert (cfg.scoring_func, cfg.topk_method) == ("sigmoid", "noaux_tc")
  assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 4.0 and cfg.rope.interleave
  # DeepSeek's softmax scale carries mscale(mscale_all_dim)^2.
  m = 0.1 * 1.0 * __import__("math").log(4.0) + 1.0
  assert cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5 * m * m)


def test_mtp_layers_follow_decoder_layers():
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
  assert cfg.num_nextn_predict_layers == 1
  assert cfg.moe_layers == (False, True, True, True)


def test_v2_lite_shape():
  cfg = config_from_dict(CONFIGS["deepseek_v2"])
  assert cfg.q_lora_rank is None
  assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob) == ("softmax", "greedy", False)


def test_kimi_k2_and_k25():
  k2 = dict(CONFIGS["deepseek_v3"], model_type="kimi_k2")
  assert config_from_dict(k2).model_type == "kimi_k2"
  text = dict(CONFIGS["deepseek_v3"], model_type="deepseek_v3")
  del text["eos_token_id"]
  k25 = {"model_type": "kimi_k25", "text_config": text, "eos_token_id": 7,
         "vision_config": {"hidden_size": 8, "num_attention_heads": 2},
         "projection_hidden_size": 8}
  cfg = config_from_dict(k25)
  assert cfg.model_type == "kimi_k25" and cfg.is_mla and cfg.eos_token_ids == (7,)
  # transformers' defaults fill the rest of the vision config; <|media_pad|> by default
  assert (cfg.vision.hidden_size, cfg.vision.head_dim, cfg.vision.num_layers) == (8, 4, 27)
  assert cfg.vision.text_hidden_size == cfg.hidden_size and cfg.media_pad_token_id == 163605
  assert config_from_dict(dict(k25, image_token_id=77)).media_pad_token_id == 77
  assert config_from_dict({k: v for k, v in k25.items() if k != "vision_config"}).vision is None
  with pytest.raises(ConfigError, match="num_attention_heads 16"):
    config_from_dict(dict(k25, vision_config={"hidden_size": 8}))
  with pytest.raises(ConfigError, match="projection_hidden_size 1152"):
    config_from_dict(dict(k25, projection_hidden_size=1152))


def test_qwen3_moe_layers_and_gqa():
  d = dict(CONFIGS["qwen3_moe"], num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=1)
  cfg = config_from_dict(d)
  assert cfg.moe_layers == (True, False, True, True)
  assert cfg.qk_norm and cfg.num_kv_heads == 2 and cfg.head_dim == 16


def test_rope_parameters_v5_style():
  d = dict(CONFIGS["llama"])
  del d["rope_scaling"]
  d["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
  assert config_from_dict(d).rope.theta == 500000.0


def test_unknown_model_type():
  with pytest.raises(ConfigError, match="unknown model_type 'mixtral'"):
    config_from_dict(dict(CONFIGS["llama"], model_type="mixtral"))


@pytest.mark.parametrize("field", ["kv_lora_rank", "hidden_size", "n_routed_experts",
                                   "q_lora_rank"])
def test_missing_field_is_named(field):
  d = dict(CONFIGS["deepseek_v3"])
  del d[field]
  with pytest.raises(ConfigError, match=f"'{field}'"):
    config_from_dict(d)


def test_missing_model_type_and_bad_json(tmp_path):
  with pytest.raises(ConfigError, match="model_type"):
    config_from_dict({"hidden_size": 4})
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ConfigError, match="not valid JSON"):
    load_config(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen3"]))
  assert load_config(str(tmp_path)).model_type == "qwen3"


def test_unsupported_activation():
  with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
    config_from_dict(dict(CONFIGS["llama"], hidden_act="gelu"))
