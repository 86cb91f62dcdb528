"""Weight bytes a decode step reads with routed experts in INT4 / FP8 / bf16 (no flags: shared
by `bench/quantized_experts.py` and the tests)."""

from __future__ import annotations

import dataclasses
import math

import jax

from engine.model.params import per_layer_shapes
from engine.model.quantized import Int4Scheme

HUB_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")
INT4 = Int4Scheme(group_size=32, targets=("Linear",), ignore=HUB_IGNORE)
FORMATS = ("int4", "fp8", "bf16")

KIMI_K25_TEXT = dict(
    model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=1,
    num_attention_heads=64, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1,
    n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, max_position_embeddings=262144, num_nextn_predict_layers=0,
    rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    rope_theta=50000.0)


def expert_bytes_per_weight(fmt: str, k: int, n: int) -> float:
  """Bytes per expert weight element of a [K, N] matrix in `fmt` (scales included)."""
  if fmt == "int4":
    return 0.5 + 2 / 32
  if fmt == "fp8":
    return 1 + 4 * math.ceil(k / 128) * math.ceil(n / 128) / (k * n)
  return 2.0


def step_weight_bytes(cfg, fmt: str, batch: int) -> dict[str, float]:
  """Weight bytes one decode step of `batch` tokens reads (uniform routing), by part: the
  logical (float) layout of `cfg`, its routed experts priced in `fmt`."""
  shapes = per_layer_shapes(dataclasses.replace(cfg, int4=None, fp8_experts=None))
  other = expert = 0.0
  for path, s in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(
      x, tuple) and all(isinstance(d, int) for d in x))[0]:
    name = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    if ".experts." in name:
      expert += math.prod(s) * expert_bytes_per_weight(fmt, s[1], s[2])
    elif name != "embed":  # a step reads only B rows of the embedding
      other += math.prod(s) * 2
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  touched = e * (1 - (1 - k / e) ** batch)
  return dict(other=other, experts=expert * touched / e, distinct_experts_per_layer=touched)
