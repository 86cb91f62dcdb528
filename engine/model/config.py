"""Model configuration parsed from a Hugging Face `config.json`.

One frozen dataclass, `ModelConfig`, describes every supported family:

* MLA families (`attention == "mla"`): `deepseek_v3`, `kimi_k2`, `kimi_k25` (its `text_config`),
  `deepseek_v2` (including DeepSeek-V2-Lite, `q_lora_rank` null, softmax scoring).
* GQA families (`attention == "gqa"`): `qwen3_moe`, `llama`, `qwen3`.

The config is static (hashable) so that jitted functions take it as a static argument.
A missing required field or an unknown `model_type` raises `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from engine.model.quantized import (Int4Scheme, QuantizationConfigError, layer_experts_int4,
                                    parse_quantization_config)


class ConfigError(ValueError):
  """A config.json that this engine cannot serve, with the field named."""


MLA_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v2")
GQA_TYPES = ("qwen3_moe", "llama", "qwen3")
SUPPORTED_MODEL_TYPES = MLA_TYPES + GQA_TYPES


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding parameters (`rope_type` default, linear, yarn or llama3)."""
  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  # YaRN
  original_max_position_embeddings: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  # Layout of the rotated dimensions: True rotates adjacent pairs (x0, x1), (x2, x3), ... as
  # DeepSeek's checkpoints do; False rotates the two halves (Llama's rotate_half).
  interleave: bool = False


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Kimi K2.5's MoonViT tower and patch-merger projector (`vision_config` of config.json,
  transformers' names, its defaults for missing fields; the hub's remote-code names
  `init_pos_emb_*`, `mm_hidden_size`, `projector_ln_eps` accepted too)."""
  patch_size: int = 14
  hidden_size: int = 1152
  num_heads: int = 16
  num_layers: int = 27
  intermediate_size: int = 4304
  pos_emb_height: int = 64
  pos_emb_width: int = 64
  merge_kernel: tuple[int, int] = (2, 2)
  rope_theta: float = 10000.0
  text_hidden_size: int = 7168  # the projector's output width
  projection_ln_eps: float = 1e-5
  layer_norm_eps: float = 1e-5  # the tower's LayerNorms (fixed in transformers' code)

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def merge_size(self) -> int:
    """Patches merged into one token (4 for the 2x2 kernel)."""
    return self.merge_kernel[0] * self.merge_kernel[1]

  @property
  def merged_dim(self) -> int:
    """The projector's input width: merge_size patches of hidden_size."""
    return self.hidden_size * self.merge_size


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder-only model. Field names follow Hugging Face where they exist."""
  model_type: str
  attention: str  # "mla" or "gqa"
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  intermediate_size: int  # dense MLP width
  rms_norm_eps: float
  rope: RopeConfig
  max_position_embeddings: int
  tie_word_embeddings: bool = False
  hidden_act: str = "silu"
  # GQA
  head_dim: int = 0
  qk_norm: bool = False
  attention_bias: bool = False
  # MLA
  q_lora_rank: int | None = None
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # MoE (num_experts == 0 means a dense model)
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  num_shared_experts: int = 0
  scoring_func: str = "softmax"  # "softmax" or "sigmoid"
  topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = False
  routed_scaling_factor: float = 1.0
  # Per layer, True if its MLP is a MoE; DeepSeek's multi-token-prediction (MTP) layers follow
  # the decoder layers here (index num_layers + k).
  moe_layers: tuple[bool, ...] = ()
  num_nextn_predict_layers: int = 0
  # MTP layers config.json declares that the checkpoint holds no weights for (`without_mtp`;
  # transformers' save_pretrained writes none): the model serves without them.
  mtp_layers_absent: int = 0
  # compressed-tensors INT4 (routed experts kept packed; `engine.model.quantized`), or None.
  int4: Int4Scheme | None = None
  # FP8 block-quantized routed experts kept as float8 + float32 scale_inv: the checkpoint's
  # weight_block_size [out, in] (`hf_loader.checkpoint_config(keep_fp8=True)`), or None
  # (dequantized at load).
  fp8_experts: tuple[int, int] | None = None
  # With fp8_experts: the attention projections, dense and shared MLPs kept FP8 too (every one
  # of them stored F8 with a scale), else those are dequantized at load.
  fp8_dense: bool = False
  # Kimi K2.5's `vision_config` as canonical JSON, and the tower it describes (`vision`, None
  # for a text-only model: then no `params["vision"]`); images' features replace the
  # embeddings of `media_pad_token_id` (<|media_pad|>, 163605 in K2.5).
  vision_config_json: str = ""
  vision: VisionConfig | None = None
  media_pad_token_id: int | None = None
  # Tokens
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  # ---- derived sizes -------------------------------------------------------------------
  @property
  def is_mla(self) -> bool:
    return self.attention == "mla"

  @property
  def qk_head_dim(self) -> int:
    """Width of one query/key head as the model scores it."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

  @property
  def latent_dim(self) -> int:
    """MLA cache width per token per layer: kv_lora_rank + qk_rope_head_dim (576 for V3)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def rope_dim(self) -> int:
    return self.qk_rope_head_dim if self.is_mla else self.head_dim

  @property
  def softmax_scale(self) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(mscale_all_dim)^2 for MLA as in DeepSeek."""
    scale = self.qk_head_dim ** -0.5
    r = self.rope
    if self.is_mla and r.rope_type == "yarn" and r.mscale_all_dim:
      m = yarn_get_mscale(r.factor, r.mscale_all_dim)
      scale *= m * m
    return scale

  def is_moe_layer(self, i: int) -> bool:
    return bool(self.moe_layers) and self.moe_layers[i]

  @property
  def no_mtp_reason(self) -> str:
    """Why the model has no MTP layer to draft with (for errors refusing drafter "mtp")."""
    if self.mtp_layers_absent:
      return (f"config.json declares num_nextn_predict_layers={self.mtp_layers_absent} but the "
              f"checkpoint holds no MTP weights (transformers' save_pretrained saves none)")
    return "the model has no MTP layer (num_nextn_predict_layers = 0)"

  @property
  def vision_config(self) -> dict[str, Any] | None:
    return json.loads(self.vision_config_json) if self.vision_config_json else None

  def experts_fp8(self, i: int) -> bool:
    """Whether MoE layer i's routed experts are kept as FP8 blocks (`fp8_experts`)."""
    return self.is_moe_layer(i) and self.fp8_experts is not None and not self.experts_int4(i)

  def experts_int4(self, i: int) -> bool:
    """Whether MoE layer i's routed experts are stored (and kept) as packed INT4."""
    return self.is_moe_layer(i) and layer_experts_int4(self.int4, i, self.num_experts)

  def layer_kind(self, i: int) -> tuple[bool, bool, bool]:
    """What decides decoder layer i's parameter structure: (MoE, INT4 experts, FP8 experts)."""
    return self.is_moe_layer(i), self.experts_int4(i), self.experts_fp8(i)

  @property
  def layer_stacks(self) -> tuple[tuple[int, int], ...]:
    """The decoder layers as maximal runs [start, stop) of layers with one structure
    (DeepSeek-V3 / Kimi: the dense prefix, then the MoE body; one run for the other families).
    Each run's parameters and cache pages are stacked on a leading layer axis and run as one
    scanned body (`engine.model.params`, `engine.model.transformer`)."""
    stacks, start = [], 0
    for i in range(1, self.num_layers + 1):
      if i == self.num_layers or self.layer_kind(i) != self.layer_kind(start):
        stacks.append((start, i))
        start = i
    return tuple(stacks)

  def layer_stack_of(self, i: int) -> tuple[int, int]:
    """(stack r, position j within it) of decoder layer i."""
    for r, (start, stop) in enumerate(self.layer_stacks):
      if start <= i < stop:
        return r, i - start
    raise IndexError(f"layer {i} outside the {self.num_layers} decoder layers")

  @property
  def display_name(self) -> str:
    return f"{self.model_type}(L={self.num_layers}, H={self.hidden_size}, E={self.num_experts})"


def without_mtp(cfg: ModelConfig) -> ModelConfig:
  """`cfg` without its MTP layers, for a checkpoint that holds none of their weights."""
  if not cfg.num_nextn_predict_layers:
    return cfg
  return dataclasses.replace(cfg, num_nextn_predict_layers=0,
                             moe_layers=cfg.moe_layers[:cfg.num_layers],
                             mtp_layers_absent=cfg.num_nextn_predict_layers)


def without_vision(cfg: ModelConfig) -> ModelConfig:
  """`cfg` serving text only: no vision tower is loaded (its tensors are skipped)."""
  return dataclasses.replace(cfg, vision=None)


def config_dict_without_mtp(d: dict[str, Any]) -> dict[str, Any]:
  """A config.json dict with num_nextn_predict_layers 0 (in `text_config` for kimi_k25)."""
  d = dict(d)
  if d.get("model_type") == "kimi_k25" and isinstance(d.get("text_config"), dict):
    d["text_config"] = dict(d["text_config"], num_nextn_predict_layers=0)
  else:
    d["num_nextn_predict_layers"] = 0
  return d


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


# ---- parsing -------------------------------------------------------------------------------

_MISSING = object()


class _Fields:
  """Reads fields from a config dict, naming the missing one in the error."""

  def __init__(self, d: dict[str, Any], model_type: str):
    self.d = d
    self.model_type = model_type

  def req(self, name: str) -> Any:
    v = self.d.get(name, _MISSING)
    if v is _MISSING or v is None:
      raise ConfigError(
          f"config.json: missing required field {name!r} for model_type {self.model_type!r}")
    return v

  def opt(self, name: str, default: Any) -> Any:
    v = self.d.get(name, _MISSING)
    return default if v is _MISSING or v is None else v


def _eos_tuple(v: Any) -> tuple[int, ...]:
  if v is None:
    return ()
  if isinstance(v, (list, tuple)):
    return tuple(int(x) for x in v)
  return (int(v),)


def _parse_rope(f: _Fields, interleave: bool) -> RopeConfig:
  d = f.d
  # transformers 5 writes `rope_parameters` (with rope_theta inside); older configs write
  # `rope_scaling` (with `type` or `rope_type`) and a top-level `rope_theta`.
  params = d.get("rope_parameters") or d.get("rope_scaling") or {}
  if not isinstance(params, dict):
    raise ConfigError(f"config.json: field 'rope_scaling' must be an object, got {params!r}")
  theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default")) or "default"
  if rope_type not in ("default", "linear", "yarn", "llama3"):
    raise ConfigError(f"config.json: unsupported rope type {rope_type!r} (rope_scaling.type)")
  factor = params.get("factor")
  orig = params.get("original_max_position_embeddings")
  if rope_type == "yarn" and factor is None:
    if orig is None:
      raise ConfigError("config.json: yarn rope_scaling needs 'factor' or "
                        "'original_max_position_embeddings'")
    factor = f.req("max_position_embeddings") / orig
  if rope_type in ("yarn", "llama3") and orig is None:
    raise ConfigError(
        f"config.json: rope_scaling type {rope_type!r} needs 'original_max_position_embeddings'")
  if rope_type in ("linear", "llama3") and factor is None:
    raise ConfigError(f"config.json: rope_scaling type {rope_type!r} needs 'factor'")
  return RopeConfig(
      theta=float(theta),
      rope_type=rope_type,
      factor=float(factor if factor is not None else 1.0),
      original_max_position_embeddings=orig,
      beta_fast=float(params.get("beta_fast") or 32.0),
      beta_slow=float(params.get("beta_slow") or 1.0),
      mscale=params.get("mscale"),
      mscale_all_dim=params.get("mscale_all_dim"),
      attention_factor=params.get("attention_factor"),
      truncate=bool(params.get("truncate", True)),
      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
      interleave=interleave,
  )


def _check_act(f: _Fields) -> str:
  act = f.opt("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ConfigError(f"config.json: unsupported hidden_act {act!r} (only silu)")
  return "silu"


def _common(f: _Fields) -> dict[str, Any]:
  return dict(
      vocab_size=int(f.req("vocab_size")),
      hidden_size=int(f.req("hidden_size")),
      num_layers=int(f.req("num_hidden_layers")),
      num_heads=int(f.req("num_attention_heads")),
      intermediate_size=int(f.req("intermediate_size")),
      rms_norm_eps=float(f.opt("rms_norm_eps", 1e-6)),
      max_position_embeddings=int(f.req("max_position_embeddings")),
      tie_word_embeddings=bool(f.opt("tie_word_embeddings", False)),
      hidden_act=_check_act(f),
      bos_token_id=f.opt("bos_token_id", None),
      eos_token_ids=_eos_tuple(f.d.get("eos_token_id")),
      pad_token_id=f.opt("pad_token_id", None),
  )


def _parse_mla(f: _Fields) -> ModelConfig:
  is_v3 = f.model_type in ("deepseek_v3", "kimi_k2", "kimi_k25")
  c = _common(f)
  if f.opt("attention_bias", False):
    raise ConfigError("config.json: attention_bias=true is not supported for MLA models")
  num_layers = c["num_layers"]
  n_experts = int(f.req("n_routed_experts"))
  first_dense = int(f.opt("first_k_dense_replace", 0))
  moe_freq = int(f.opt("moe_layer_freq", 1))
  n_mtp = int(f.opt("num_nextn_predict_layers", 0))
  moe_layers = tuple(n_experts > 0 and i >= first_dense and i % moe_freq == 0
                     for i in range(num_layers + n_mtp))
  if is_v3:
    scoring = f.opt("scoring_func", "sigmoid")
    topk_method = f.opt("topk_method", "noaux_tc")
    n_group_default, norm_default, scale_default = 1, True, 1.0
  else:
    scoring = f.opt("scoring_func", "softmax")
    topk_method = f.opt("topk_method", "greedy")
    n_group_default, norm_default, scale_default = 1, False, 1.0
  if scoring not in ("softmax", "sigmoid"):
    raise ConfigError(f"config.json: unsupported scoring_func {scoring!r}")
  if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
    raise ConfigError(f"config.json: unsupported topk_method {topk_method!r}")
  n_group = int(f.opt("n_group", n_group_default))
  if n_experts and n_experts % n_group:
    raise ConfigError(f"config.json: n_routed_experts={n_experts} is not divisible by "
                      f"n_group={n_group}")
  q_lora = f.d.get("q_lora_rank", _MISSING)
  if q_lora is _MISSING:
    raise ConfigError(f"config.json: missing required field 'q_lora_rank' for model_type "
                      f"{f.model_type!r} (use null for no query compression)")
  # DeepSeek checkpoints store the rope dimensions interleaved; V2 always rotates pairs,
  # V3 follows `rope_interleave` (transformers' default True).
  interleave = bool(f.opt("rope_interleave", True)) if is_v3 else True
  return ModelConfig(
      model_type=f.model_type,
      attention="mla",
      num_kv_heads=c["num_heads"],
      rope=_parse_rope(f, interleave),
      q_lora_rank=None if q_lora is None else int(q_lora),
      kv_lora_rank=int(f.req("kv_lora_rank")),
      qk_nope_head_dim=int(f.req("qk_nope_head_dim")),
      qk_rope_head_dim=int(f.req("qk_rope_head_dim")),
      v_head_dim=int(f.req("v_head_dim")),
      num_experts=n_experts,
      num_experts_per_tok=int(f.req("num_experts_per_tok")) if n_experts else 0,
      moe_intermediate_size=int(f.req("moe_intermediate_size")) if n_experts else 0,
      num_shared_experts=int(f.opt("n_shared_experts", 0)),
      scoring_func=scoring,
      topk_method=topk_method,
      n_group=n_group,
      topk_group=int(f.opt("topk_group", 1)),
      norm_topk_prob=bool(f.opt("norm_topk_prob", norm_default)),
      routed_scaling_factor=float(f.opt("routed_scaling_factor", scale_default)),
      moe_layers=moe_layers,
      num_nextn_predict_layers=n_mtp,
      **c,
  )


def _parse_gqa(f: _Fields) -> ModelConfig:
  c = _common(f)
  num_heads = c["num_heads"]
  head_dim = int(f.opt("head_dim", c["hidden_size"] // num_heads))
  kw: dict[str, Any] = {"moe_layers": (False,) * c["num_layers"]}
  if f.model_type == "qwen3_moe":
    # The Hub's configs say `num_experts`; transformers 5 writes `num_local_experts`.
    n_experts = int(f.d["num_local_experts"] if f.d.get("num_local_experts") is not None
                    else f.req("num_experts"))
    mlp_only = set(f.opt("mlp_only_layers", []) or [])
    step = int(f.opt("decoder_sparse_step", 1))
    kw = dict(
        num_experts=n_experts,
        num_experts_per_tok=int(f.req("num_experts_per_tok")),
        moe_intermediate_size=int(f.req("moe_intermediate_size")),
        scoring_func="softmax",
        topk_method="greedy",
        norm_topk_prob=bool(f.opt("norm_topk_prob", False)),
        moe_layers=tuple(i not in mlp_only and n_experts > 0 and (i + 1) % step == 0
                         for i in range(c["num_layers"])),
    )
  if f.opt("use_sliding_window", False):
    raise ConfigError("config.json: use_sliding_window=true is not supported")
  return ModelConfig(
      model_type=f.model_type,
      attention="gqa",
      num_kv_heads=int(f.opt("num_key_value_heads", num_heads)),
      head_dim=head_dim,
      qk_norm=f.model_type in ("qwen3", "qwen3_moe"),
      attention_bias=bool(f.opt("attention_bias", False)),
      rope=_parse_rope(f, interleave=False),
      **kw,
      **c,
  )


K25_MEDIA_PAD_ID = 163605  # <|media_pad|> in Kimi K2.5's tokenizer


def _media_pad_id(d: dict[str, Any]) -> int:
  for k in ("image_token_id", "media_placeholder_token_id"):
    for src in (d, d.get("text_config") or {}):
      if src.get(k) is not None:
        return int(src[k])
  return K25_MEDIA_PAD_ID


def _parse_vision(top: dict[str, Any], v: dict[str, Any], text_hidden: int) -> VisionConfig:
  def get(*names: str, default: Any) -> Any:
    for n in names:
      if v.get(n) is not None:
        return v[n]
    return default

  rope = v.get("rope_parameters") or {}
  merge = get("merge_kernel_size", default=(2, 2))
  if isinstance(merge, int):
    merge = (merge, merge)
  act = get("hidden_act", default="gelu_pytorch_tanh")
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ConfigError(f"config.json: vision_config.hidden_act {act!r} is not supported "
                      f"(gelu_pytorch_tanh)")
  vc = VisionConfig(
      patch_size=int(get("patch_size", default=14)),
      hidden_size=int(get("hidden_size", default=1152)),
      num_heads=int(get("num_attention_heads", default=16)),
      num_layers=int(get("num_hidden_layers", default=27)),
      intermediate_size=int(get("intermediate_size", default=4304)),
      pos_emb_height=int(get("pos_emb_height", "init_pos_emb_height", default=64)),
      pos_emb_width=int(get("pos_emb_width", "init_pos_emb_width", default=64)),
      merge_kernel=(int(merge[0]), int(merge[1])),
      rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
      text_hidden_size=text_hidden,
      projection_ln_eps=float(top.get("projection_layer_norm_eps")
                              or v.get("projector_ln_eps") or 1e-5))
  proj = top.get("projection_hidden_size") or v.get("mm_hidden_size") or vc.hidden_size
  if int(proj) != vc.hidden_size:
    raise ConfigError(f"config.json: projection_hidden_size {proj} != vision_config.hidden_size "
                      f"{vc.hidden_size} (the projector normalises each patch's features)")
  if vc.pos_emb_height != vc.pos_emb_width:
    raise ConfigError(f"config.json: vision_config pos_emb_height {vc.pos_emb_height} != "
                      f"pos_emb_width {vc.pos_emb_width} (transformers resamples a square table)")
  if vc.hidden_size % vc.num_heads or vc.head_dim % 4:
    raise ConfigError(f"config.json: vision_config.hidden_size {vc.hidden_size} must split into "
                      f"num_attention_heads {vc.num_heads} heads of a multiple of 4 (2D rotary)")
  return vc


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
  """Parses a Hugging Face config dict (as loaded from config.json)."""
  cfg = _config_from_dict(d)
  try:
    int4 = parse_quantization_config(d)
    if int4 is not None:
      cfg = dataclasses.replace(cfg, int4=int4)
      for i in range(len(cfg.moe_layers)):
        cfg.experts_int4(i)  # raises for a layer quantized in part
  except QuantizationConfigError as e:
    raise ConfigError(str(e)) from None
  return cfg


def _config_from_dict(d: dict[str, Any]) -> ModelConfig:
  model_type = d.get("model_type")
  if model_type is None:
    raise ConfigError("config.json: missing required field 'model_type'")
  if model_type == "kimi_k25":
    text = d.get("text_config")
    if not isinstance(text, dict):
      raise ConfigError("config.json: missing required field 'text_config' for model_type "
                        "'kimi_k25'")
    merged = dict(text)
    # The text config of Kimi-K2.5 is a deepseek_v3 config; token ids may sit at either level.
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
      if merged.get(k) is None and d.get(k) is not None:
        merged[k] = d[k]
    cfg = _parse_mla(_Fields(merged, "kimi_k25"))
    vision = d.get("vision_config")
    if isinstance(vision, dict):
      cfg = dataclasses.replace(cfg, vision_config_json=json.dumps(vision, sort_keys=True),
                                vision=_parse_vision(d, vision, cfg.hidden_size),
                                media_pad_token_id=_media_pad_id(d))
    return cfg
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ConfigError(f"config.json: unknown model_type {model_type!r}; supported: "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  f = _Fields(d, model_type)
  if model_type in MLA_TYPES:
    return _parse_mla(f)
  return _parse_gqa(f)


def load_config(path: str) -> ModelConfig:
  """Reads `config.json` from a checkpoint directory (or the file itself)."""
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"no config.json at {path}")
  with open(path) as fh:
    try:
      d = json.load(fh)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path}: not valid JSON ({e})") from e
  return config_from_dict(d)
