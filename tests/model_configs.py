"""Small model configurations (Hugging Face config.json dicts) shared by the tests, and
`perturbed`, a draft model made from a target's parameters."""

from __future__ import annotations

_MLA_BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, bos_token_id=1,
    eos_token_id=2, rms_norm_eps=1e-6)

CONFIGS = {
    "deepseek_v3": dict(_MLA_BASE, model_type="deepseek_v3", n_group=2, topk_group=1,
                        first_k_dense_replace=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5,
                        rope_scaling=dict(type="yarn", factor=4.0, beta_fast=32, beta_slow=1,
                                          mscale=1.0, mscale_all_dim=1.0,
                                          original_max_position_embeddings=64)),
    "deepseek_v3_noq": dict(_MLA_BASE, model_type="deepseek_v3", q_lora_rank=None, n_group=1,
                            topk_group=1, first_k_dense_replace=0, tie_word_embeddings=True),
    "deepseek_v2": dict(_MLA_BASE, model_type="deepseek_v2", q_lora_rank=None,
                        topk_method="greedy", n_shared_experts=2, first_k_dense_replace=1),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=320, hidden_size=64,
                      intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2),
    "llama": dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=32)),
    "qwen3": dict(model_type="qwen3", vocab_size=320, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=24, max_position_embeddings=256, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2),
}


def perturbed(params, scale, seed=0):
  """The target with noise added: a draft model that agrees with it often, not always."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  leaves, tree = jax.tree_util.tree_flatten(params)
  rng = np.random.default_rng(seed)
  out = []
  for x in leaves:  # (in numpy: op-by-op jax compiles three programs per leaf)
    v = np.asarray(x, np.float32)
    out.append(jnp.asarray(v + scale * v.std() * rng.standard_normal(v.shape), x.dtype))
  return jax.tree_util.tree_unflatten(tree, out)
