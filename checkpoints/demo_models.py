"""Hugging Face configs of the bundled demo models (trained by `checkpoints.train_demo`).

* target: DeepSeek-V3 architecture at small scale: MLA with q/kv compression, one dense first
  layer then MoE layers (8 routed experts, top-2, one shared expert, `noaux_tc` sigmoid routing
  with 2 groups), YaRN rope, and one MTP layer for DeepSeek-style MTP drafting.
* draft: a much smaller dense Llama model with the same tokenizer (for draft-model speculation).

Both are valid `config.json` files for transformers (`DeepseekV3ForCausalLM`,
`LlamaForCausalLM`), so the exported safetensors copies run unchanged there.
"""

from __future__ import annotations

from checkpoints.demo_corpus import BOS_ID, EOS_ID, PAD_ID

VOCAB_SIZE = 8192
MAX_POSITIONS = 4096
YARN_ORIGINAL = 1024  # trained context; YaRN stretches it 4x

_TOKENS = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)

TARGET = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=640,
    moe_intermediate_size=160,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    moe_layer_freq=1,
    num_nextn_predict_layers=1,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=MAX_POSITIONS,
    rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=MAX_POSITIONS / YARN_ORIGINAL, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=YARN_ORIGINAL),
    rope_interleave=True,
    attention_bias=False,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    **_TOKENS,
)

DRAFT = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=MAX_POSITIONS,
    rope_theta=10000.0,
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    **_TOKENS,
)

MODELS = {"target": TARGET, "draft": DRAFT}
