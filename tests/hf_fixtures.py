"""Tiny Hugging Face-layout checkpoints for tests, written from a moejax params pytree.

The writer is `engine.model.hf_export` (the inverse of `hf_loader`, written independently of
it); this module adds small configs for every family. The golden fixtures, written by
transformers itself, anchor both sides.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from engine.model.hf_export import (EXPERT_LAYOUTS, export_hf, hf_tensors,  # noqa: F401
                                    write_checkpoint)

# Small configs for every supported family (values kept tiny; shapes all distinct where it helps).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1,
    first_k_dense_replace=1, max_position_embeddings=256)
DEEPSEEK_V3_NO_QLORA_TIED = dict(DEEPSEEK_V3, q_lora_rank=None, tie_word_embeddings=True)
DEEPSEEK_V2 = dict(
    model_type="deepseek_v2", vocab_size=320, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=6,
    n_shared_experts=2, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    max_position_embeddings=256)
QWEN3_MOE = dict(
    model_type="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
    max_position_embeddings=256)
LLAMA = dict(
    model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
    max_position_embeddings=256)
QWEN3 = dict(
    model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
    tie_word_embeddings=True, max_position_embeddings=256)
KIMI_K25 = dict(model_type="kimi_k25", text_config=dict(DEEPSEEK_V3, model_type="kimi_k2"))

CONFIGS = dict(deepseek_v3=DEEPSEEK_V3, deepseek_v3_no_qlora_tied=DEEPSEEK_V3_NO_QLORA_TIED,
               deepseek_v2=DEEPSEEK_V2, qwen3_moe=QWEN3_MOE, llama=LLAMA, qwen3=QWEN3,
               kimi_k25=KIMI_K25)

BF16 = ml_dtypes.bfloat16


def quantize_fp8(w, block):
  """[out, in] float32 -> (F8_E4M3 weight, float32 scale_inv [ceil(out/b0), ceil(in/b1)]): the
  block scaling of DeepSeek-V3's FP8 checkpoints (each block's largest magnitude to 448)."""
  b0, b1 = block
  rows, cols = math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)
  scale = np.zeros((rows, cols), np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for r in range(rows):
    for c in range(cols):
      blk = w[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1]
      s = max(float(np.abs(blk).max()), 1e-12) / 448.0
      scale[r, c] = s
      q[r * b0:(r + 1) * b0, c * b1:(c + 1) * b1] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
  return q, scale
