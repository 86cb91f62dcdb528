"""Which Hugging Face tensor fills which leaf of the parameter pytree (`params.py`), and how:
a `Plan` built for one config and one expert layout maps each HF tensor name to its fills
(leaf path, index into a stacked leaf, expected shape, transform to our [in, out] layout with
explicit head axes, allowed dtypes). `hf_loader.py` checks a checkpoint against it and reads by
it; `hf_tensor_shapes` lists what a checkpoint for a config holds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from engine.model import quantized, vision_checkpoint
from engine.model.config import ModelConfig

# Kimi-K2.5 is a vision-language checkpoint: its language model under this prefix, the vision
# tower and projector (`vision_checkpoint.py`) loaded when the config has them (`cfg.vision`).
K25_PREFIX = "language_model."
K25_VISION_PREFIXES = vision_checkpoint.PREFIXES
FP8_SCALE_SUFFIX = ".weight_scale_inv"

Transform = Callable[[np.ndarray], np.ndarray]


def shown(name: str, cfg: ModelConfig) -> str:
  """The name as the checkpoint would spell it (Kimi-K2.5 prefixes its language model)."""
  if cfg.model_type != "kimi_k25" or name.startswith(K25_VISION_PREFIXES):
    return name
  return K25_PREFIX + name



@dataclasses.dataclass(frozen=True)
class Fill:
  """One HF tensor's contribution to one leaf: leaf[index] = fn(hf_tensor)."""
  leaf: str  # path_str of the leaf, e.g. "layers.3.moe.experts.gate"; "" checks only
  index: tuple[int, ...]  # () for the whole leaf, (e,) for expert e of a stacked leaf
  hf_shape: tuple[int, ...]
  fn: Transform
  dtypes: tuple[str, ...] | None = None  # safetensors dtypes allowed; None: any float


def _same(x: np.ndarray) -> np.ndarray:
  return x


def _t(x: np.ndarray) -> np.ndarray:
  return x.T


def _heads_in(n: int, d: int) -> Transform:
  """[n*d, X] (HF out, in) -> [X, n, d]."""
  return lambda x: x.reshape(n, d, x.shape[-1]).transpose(2, 0, 1)


def _heads_out(n: int, d: int) -> Transform:
  """[X, n*d] (HF o_proj: out=X, in=heads) -> [n, d, X]."""
  return lambda x: x.T.reshape(n, d, x.shape[0])


def _reshape(*shape: int) -> Transform:
  return lambda x: x.reshape(shape)


def _stacked_t(lo: int | None = None, hi: int | None = None) -> Transform:
  """[E, out, in] (optionally rows lo:hi of out) -> [E, in, out]."""
  return lambda x: x[:, lo:hi, :].transpose(0, 2, 1)


class Plan:
  """HF tensor name -> the fills it makes; built for one config and one expert layout."""

  def __init__(self) -> None:
    self.fills: dict[str, list[Fill]] = {}

  def add(self, hf: str, leaf: str, hf_shape: tuple[int, ...], fn: Transform,
          index: tuple[int, ...] = (), dtypes: tuple[str, ...] | None = None) -> None:
    self.fills.setdefault(hf, []).append(Fill(leaf, index, tuple(hf_shape), fn, dtypes))

  def linear(self, hf: str, leaf: str, hf_shape: tuple[int, ...], fn: Transform,
             fp8: tuple[int, int] | None) -> None:
    """A Linear's weight; kept FP8 (values + scale_inv, `Fp8Weight`) when `fp8` is a block."""
    if fp8 is None:
      return self.add(hf, leaf, hf_shape, fn)
    self.add(hf, leaf + ".w", hf_shape, fn, dtypes=("F8_E4M3",))
    self.add(hf[:-len(".weight")] + FP8_SCALE_SUFFIX, leaf + ".scale_inv",
             tuple(-(-d // b) for d, b in zip(hf_shape, fp8)), _t, dtypes=("F32",))

  def hf_shape(self, hf: str) -> tuple[int, ...]:
    return self.fills[hf][0].hf_shape


def _plan_mlp(plan: Plan, hf: str, ours: str, H: int, inter: int,
              fp8: tuple[int, int] | None = None) -> None:
  plan.linear(hf + "gate_proj.weight", ours + "gate", (inter, H), _t, fp8)
  plan.linear(hf + "up_proj.weight", ours + "up", (inter, H), _t, fp8)
  plan.linear(hf + "down_proj.weight", ours + "down", (H, inter), _t, fp8)


def _plan_mla(plan: Plan, cfg: ModelConfig, hf: str, ours: str) -> None:
  H, nH = cfg.hidden_size, cfg.num_heads
  dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  kv, f8 = cfg.kv_lora_rank, _fp8_dense(cfg)
  if cfg.q_lora_rank is None:
    plan.linear(hf + "q_proj.weight", ours + "q", (nH * (dn + dr), H), _heads_in(nH, dn + dr), f8)
  else:
    ql = cfg.q_lora_rank
    plan.linear(hf + "q_a_proj.weight", ours + "q_a", (ql, H), _t, f8)
    plan.add(hf + "q_a_layernorm.weight", ours + "q_a_norm", (ql,), _same)
    plan.linear(hf + "q_b_proj.weight", ours + "q_b", (nH * (dn + dr), ql),
                _heads_in(nH, dn + dr), f8)
  plan.linear(hf + "kv_a_proj_with_mqa.weight", ours + "kv_a", (kv + dr, H), _t, f8)
  plan.add(hf + "kv_a_layernorm.weight", ours + "kv_a_norm", (kv,), _same)
  plan.linear(hf + "kv_b_proj.weight", ours + "kv_b", (nH * (dn + dv), kv),
              _heads_in(nH, dn + dv), f8)
  plan.linear(hf + "o_proj.weight", ours + "o", (H, nH * dv), _heads_out(nH, dv), f8)


def _fp8_dense(cfg: ModelConfig) -> tuple[int, int] | None:
  """The FP8 block of the non-expert linears when they are kept FP8 (cfg.fp8_dense)."""
  return cfg.fp8_experts if cfg.fp8_dense else None


def _plan_gqa(plan: Plan, cfg: ModelConfig, hf: str, ours: str) -> None:
  H, nH, nKV, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  plan.add(hf + "q_proj.weight", ours + "q", (nH * hd, H), _heads_in(nH, hd))
  plan.add(hf + "k_proj.weight", ours + "k", (nKV * hd, H), _heads_in(nKV, hd))
  plan.add(hf + "v_proj.weight", ours + "v", (nKV * hd, H), _heads_in(nKV, hd))
  plan.add(hf + "o_proj.weight", ours + "o", (H, nH * hd), _heads_out(nH, hd))
  if cfg.qk_norm:
    plan.add(hf + "q_norm.weight", ours + "q_norm", (hd,), _same)
    plan.add(hf + "k_norm.weight", ours + "k_norm", (hd,), _same)
  if cfg.attention_bias:
    plan.add(hf + "q_proj.bias", ours + "q_bias", (nH * hd,), _reshape(nH, hd))
    plan.add(hf + "k_proj.bias", ours + "k_bias", (nKV * hd,), _reshape(nKV, hd))
    plan.add(hf + "v_proj.bias", ours + "v_bias", (nKV * hd,), _reshape(nKV, hd))
    plan.add(hf + "o_proj.bias", ours + "o_bias", (H,), _same)


EXPERT_LAYOUTS = ("hub", "fused", "stacked")


def _plan_moe(plan: Plan, cfg: ModelConfig, hf: str, ours: str, layout: str,
              int4: bool = False, fp8: bool = False) -> None:
  H, E, Im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  plan.add(hf + "gate.weight", ours + "router", (E, H), _t)
  if cfg.topk_method == "noaux_tc":
    plan.add(hf + "gate.e_score_correction_bias", ours + "router_bias", (E,), _same)
  ex_hf, ex = hf + "experts.", ours + "experts."
  if int4:  # compressed-tensors per-expert tensors, kept packed (`quantized.py`)
    quantized.plan_int4_experts(plan.add, ex_hf, ex, E, H, Im, cfg.int4, _same)
  elif fp8:  # FP8 blocks kept: values and float32 scale_inv, both transposed to [in, out]
    quantized.plan_fp8_experts(plan.add, ex_hf, ex, E, H, Im, cfg.fp8_experts, _t)
  elif layout == "hub":
    for e in range(E):
      plan.add(f"{ex_hf}{e}.gate_proj.weight", ex + "gate", (Im, H), _t, (e,))
      plan.add(f"{ex_hf}{e}.up_proj.weight", ex + "up", (Im, H), _t, (e,))
      plan.add(f"{ex_hf}{e}.down_proj.weight", ex + "down", (H, Im), _t, (e,))
  elif layout == "fused":
    plan.add(ex_hf + "gate_up_proj", ex + "gate", (E, 2 * Im, H), _stacked_t(0, Im))
    plan.add(ex_hf + "gate_up_proj", ex + "up", (E, 2 * Im, H), _stacked_t(Im, None))
    plan.add(ex_hf + "down_proj", ex + "down", (E, H, Im), _stacked_t())
  else:
    plan.add(ex_hf + "gate_proj", ex + "gate", (E, Im, H), _stacked_t())
    plan.add(ex_hf + "up_proj", ex + "up", (E, Im, H), _stacked_t())
    plan.add(ex_hf + "down_proj", ex + "down", (E, H, Im), _stacked_t())
  if cfg.num_shared_experts:
    _plan_mlp(plan, hf + "shared_experts.", ours + "shared.", H, Im * cfg.num_shared_experts,
              _fp8_dense(cfg))


def _expert_layout(names: set[str] | None, layer: int) -> str:
  """Which expert layout layer `layer` uses in a checkpoint with these (canonical) names."""
  if names is None:
    return "hub"
  pre = f"model.layers.{layer}.mlp.experts."
  if pre + "gate_up_proj" in names:
    return "fused"
  if pre + "gate_proj" in names:
    return "stacked"
  return "hub"


def build_plan(cfg: ModelConfig, names: set[str] | None) -> Plan:
  plan = Plan()
  H, V = cfg.hidden_size, cfg.vocab_size
  plan.add("model.embed_tokens.weight", "embed", (V, H), _same)
  plan.add("model.norm.weight", "final_norm", (H,), _same)
  if not cfg.tie_word_embeddings:
    plan.add("lm_head.weight", "lm_head", (V, H), _t)
  n_mtp = cfg.num_nextn_predict_layers if cfg.is_mla else 0
  for i in range(cfg.num_layers + n_mtp):
    # DeepSeek's MTP layers are stored as the decoder layers after the last one.
    hf = f"model.layers.{i}."
    ours = f"layers.{i}." if i < cfg.num_layers else f"mtp.{i - cfg.num_layers}."
    plan.add(hf + "input_layernorm.weight", ours + "input_norm", (H,), _same)
    plan.add(hf + "post_attention_layernorm.weight", ours + "post_attn_norm", (H,), _same)
    (_plan_mla if cfg.is_mla else _plan_gqa)(plan, cfg, hf + "self_attn.", ours + "attn.")
    if cfg.is_moe_layer(i):
      _plan_moe(plan, cfg, hf + "mlp.", ours + "moe.", _expert_layout(names, i),
                cfg.experts_int4(i), cfg.experts_fp8(i))
    else:
      _plan_mlp(plan, hf + "mlp.", ours + "mlp.", H, cfg.intermediate_size, _fp8_dense(cfg))
    if i >= cfg.num_layers:
      plan.add(hf + "enorm.weight", ours + "enorm", (H,), _same)
      plan.add(hf + "hnorm.weight", ours + "hnorm", (H,), _same)
      plan.add(hf + "eh_proj.weight", ours + "eh_proj", (H, 2 * H), _t)
      plan.add(hf + "shared_head.norm.weight", ours + "final_norm", (H,), _same)
  if cfg.vision is not None:
    vision_checkpoint.plan_vision(plan.add, cfg.vision)
  if cfg.int4 is not None:
    quantized.refuse_other_int4(plan.fills, cfg.int4, lambda m: shown(m, cfg))
  return plan


def hf_tensor_shapes(cfg: ModelConfig, expert_layout: str = "hub") -> dict[str, tuple[int, ...]]:
  """{HF tensor name: shape} a checkpoint for `cfg` holds (MTP layers included, no prefixes)."""
  if expert_layout not in EXPERT_LAYOUTS:
    raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
  names = None
  if expert_layout != "hub":
    key = "gate_up_proj" if expert_layout == "fused" else "gate_proj"
    names = {f"model.layers.{i}.mlp.experts.{key}" for i in range(cfg.num_layers)}
  plan = build_plan(cfg, names)
  return {hf: plan.hf_shape(hf) for hf in plan.fills}
