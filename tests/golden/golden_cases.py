"""Constants and per-case configurations for the golden-fixture generator.

Part of ``tests/golden/make_golden.py`` (the driver; see its docstring for the full picture).
This module holds the fixed numbers shared by all cases (vocab, special-token ids, prompt
lengths and seed, number of greedy tokens), the quality gates a random init must pass, and
``CASES``: one dict per fixture directory with the transformers model / config class, the
config kwargs, the knobs exercised (free text copied into MANIFEST.json), whether the
checkpoint is saved sharded, and the init gains.  Needs transformers (reference venv only).
"""

from __future__ import annotations

from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

EXPECTED_TRANSFORMERS = "5.24"  # major.minor the fixtures were generated with

VOCAB = 320
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # byte b <-> token id b + 3 (ids 3..258); 259..319 unused by the tokenizer
PROMPT_LENS = (7, 13)
PROMPT_SEED = 1234
N_GREEDY = 32  # greedy tokens per prompt; decode_logits has N_GREEDY - 1 rows
HIDDEN = 64

# Quality gates for a candidate set of random weights (see module docstring).
MIN_MEAN_MARGIN = 2.0  # mean top1-top2 logit margin over all recorded logits
MIN_GREEDY_MARGIN = 0.02  # top1-top2 margin at every greedy choice
MIN_ROUTER_GAP = 2e-4  # min gap between the last selected and first rejected expert/group score
MIN_UNIQUE_GREEDY = 6  # distinct tokens among the 32 greedy tokens of each prompt
MIN_ABLATION_EFFECT = 0.03  # mean |d logits| / std(logits) when a component is removed
MAX_ATTEMPTS = 40

ROUNDTRIP_TEXT = "def hello():\n  return 42"

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    initializer_range=0.02,
    attention_dropout=0.0,
    use_cache=True,
)

# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------
# Each case: model / config class, config kwargs, the knobs exercised (free text for the
# manifest), whether the checkpoint is saved sharded, and init gains.

CASES: dict[str, dict] = {
    "dsv3_qlora_yarn": dict(
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        config=dict(
            COMMON,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
                original_max_position_embeddings=64,
            ),
            num_mtp_layers=0,
        ),
        knobs=[
            "MLA with q_lora_rank=48 (q_a_proj -> q_a_layernorm -> q_b_proj)",
            "kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12",
            "sigmoid router + e_score_correction_bias (random, nonzero)",
            "group-limited routing n_group=4, topk_group=2 (group score = sum of top-2), 16 experts, top-4",
            "norm_topk_prob=True, routed_scaling_factor=2.5",
            "n_shared_experts=1",
            "first_k_dense_replace=1 (layer 0 dense MLP, layers 1-2 MoE)",
            "YaRN factor 4, beta_fast 32, beta_slow 1, mscale=mscale_all_dim=1 (cos/sin factor 1, softmax scale *(0.1 ln4 + 1)^2)",
            "rope_interleave=True (transformers default)",
            "untied embeddings",
            "SHARDED checkpoint (model.safetensors.index.json + shards)",
        ],
        sharded=True,
        gains=dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0),
    ),
    "dsv3_noqlora_dense2": dict(
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        config=dict(
            COMMON,
            num_hidden_layers=3,
            first_k_dense_replace=2,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=24,
            n_shared_experts=2,
            routed_scaling_factor=1.7,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            num_mtp_layers=0,
        ),
        knobs=[
            "MLA without q LoRA (q_proj), kv_lora_rank=24, nope=12, rope=8, v=16",
            "n_group=1, topk_group=1 (no group limiting), 8 experts, top-2",
            "first_k_dense_replace=2 (layers 0-1 dense, layer 2 MoE)",
            "n_shared_experts=2 (shared MLP width = 2 * moe_intermediate_size)",
            "routed_scaling_factor=1.7, norm_topk_prob=True",
            "default RoPE (no YaRN), rope_interleave=True (default)",
            "tied embeddings (no lm_head.weight in the checkpoint)",
        ],
        sharded=False,
        gains=dict(attn=2.0, mlp=2.0, router=2.0, lm=None, final_norm=1.5),
    ),
    "dsv3_dense0_mscale": dict(
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        config=dict(
            COMMON,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=40,
            qk_nope_head_dim=20,
            qk_rope_head_dim=16,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=24,
            n_shared_experts=1,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                beta_fast=32,
                beta_slow=1,
                mscale=0.9,
                mscale_all_dim=0.707,
                original_max_position_embeddings=32,
            ),
            num_mtp_layers=0,
        ),
        knobs=[
            "first_k_dense_replace=0 (every layer MoE; intermediate_size unused)",
            "q_lora_rank=32, kv_lora_rank=40, qk_nope_head_dim=20, qk_rope_head_dim=16, v_head_dim=12",
            "n_group=2, topk_group=1, 8 experts, top-3",
            "norm_topk_prob=False, routed_scaling_factor=2.0",
            "YaRN factor 8 (original_max_position_embeddings=32, max_position_embeddings=256), "
            "mscale=0.9 != mscale_all_dim=0.707: cos/sin scaled by attention_factor="
            "(0.1*0.9*ln8+1)/(0.1*0.707*ln8+1), softmax scale *(0.1*0.707*ln8+1)^2",
            "rope_interleave=True (transformers default)",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0),
    ),
    "dsv2_lite": dict(
        model_cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        config=dict(
            COMMON,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="greedy",
            n_group=None,
            topk_group=None,
            moe_intermediate_size=24,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=32,
                beta_slow=1,
                mscale=0.707,
                mscale_all_dim=0.707,
                original_max_position_embeddings=64,
            ),
        ),
        knobs=[
            "DeepSeek-V2-Lite in miniature: MLA without q LoRA, kv_lora_rank=32, nope=16, rope=8, v=16",
            "softmax router, topk_method='greedy', 8 experts, top-3, no correction bias",
            "norm_topk_prob=False (NB: DeepseekV2 modeling never reads norm_topk_prob), routed_scaling_factor=1.0",
            "n_shared_experts=2, first_k_dense_replace=1",
            "YaRN factor 4, mscale=mscale_all_dim=0.707 (as in V2-Lite: cos/sin factor 1, softmax scale *(0.0707 ln4 + 1)^2)",
            "V2 rope: complex multiply on interleaved pairs (x0,x1),(x2,x3).. output stays interleaved",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0),
    ),
    "dsv2_grouped": dict(
        model_cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        config=dict(
            COMMON,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            moe_intermediate_size=20,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        knobs=[
            "DeepSeek-V2 (full) style: q_lora_rank=48, kv_lora_rank=32, nope=16, rope=8, v=12",
            "softmax router, topk_method='group_limited_greedy', n_group=4 (group score = max), topk_group=2, 8 experts, top-3",
            "routed_scaling_factor=1.5, norm_topk_prob=False",
            "first_k_dense_replace=0 (all layers MoE), n_shared_experts=1",
            "default RoPE",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0),
    ),
    "qwen3_moe": dict(
        model_cls=Qwen3MoeForCausalLM,
        config_cls=Qwen3MoeConfig,
        config=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        knobs=[
            "GQA 4 q heads / 2 kv heads, head_dim=24 != hidden/heads=16",
            "per-head q_norm/k_norm (RMSNorm over head_dim) before RoPE",
            "softmax router, 8 experts, top-2, norm_topk_prob=True, no shared experts",
            "decoder_sparse_step=1, mlp_only_layers=[] (all layers MoE)",
            "rope_theta=1e6, non-interleaved (rotate_half) RoPE",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0),
    ),
    "qwen3_moe_mlp_only": dict(
        model_cls=Qwen3MoeForCausalLM,
        config_cls=Qwen3MoeConfig,
        config=dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=20,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        knobs=[
            "mlp_only_layers=[0]: layer 0 dense MLP (intermediate_size=80), layer 1 MoE",
            "8 experts, top-3, norm_topk_prob=False (weights are raw softmax probs)",
            "GQA 4/2, head_dim=24, q/k norm, rope_theta=1e6",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0),
    ),
    "llama": dict(
        model_cls=LlamaForCausalLM,
        config_cls=LlamaConfig,
        config=dict(
            COMMON,
            hidden_size=48,
            num_hidden_layers=2,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
        knobs=[
            "dense Llama, hidden_size=48, GQA 4 q heads / 2 kv heads, head_dim=12",
            "rope_theta=5e5 default RoPE (rotate_half)",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=None, lm=12.0),
    ),
    "llama_tied": dict(
        model_cls=LlamaForCausalLM,
        config_cls=LlamaConfig,
        config=dict(
            COMMON,
            hidden_size=48,
            num_hidden_layers=2,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        knobs=[
            "dense Llama, hidden_size=48, MQA (1 kv head), head_dim=12",
            "llama3 RoPE scaling: factor 8, low_freq_factor 1, high_freq_factor 4, "
            "original_max_position_embeddings 64 (frequencies hit all three branches)",
            "tied embeddings (no lm_head.weight in the checkpoint)",
        ],
        sharded=False,
        gains=dict(attn=2.0, mlp=2.0, router=None, lm=None, final_norm=1.5),
    ),
    "qwen3": dict(
        model_cls=Qwen3ForCausalLM,
        config_cls=Qwen3Config,
        config=dict(
            COMMON,
            hidden_size=48,
            num_hidden_layers=2,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        knobs=[
            "dense Qwen3, hidden_size=48, GQA 4/2, explicit head_dim=24 != hidden/heads=12 (q_proj out 96 > hidden)",
            "per-head q_norm/k_norm",
            "rope_theta=1e6",
            "untied embeddings",
        ],
        sharded=False,
        gains=dict(attn=1.0, mlp=1.0, router=None, lm=12.0),
    ),
}

SKIPPED: dict[str, str] = {}  # name -> reason (none: transformers supports every requested variant)
