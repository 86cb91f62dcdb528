"""Constants and per-case configurations for the golden-fixture generator.

Part of ``tests/golden/make_golden.py`` (the driver; see its docstring for the full picture).
This module holds the fixed numbers shared by all cases (vocab, special-token ids, prompt
lengths and seed, number of greedy tokens), the quality gates a random init must pass, and
``CASES``: one dict per fixture directory with the transformers model / config class, the
config kwargs, the knobs exercised (free text copied into MANIFEST.json), whether the
checkpoint is saved sharded, and the init gains.  Needs transformers (reference venv only).
"""

from __future__ import annotations

import copy

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
# Shared settings
# ----------------------------------------------------------------------------------------------


def _config(base: dict, **overrides) -> dict:
    """``base`` with ``overrides`` (a fresh deep copy); every ``...`` in ``base`` must be set."""
    cfg = copy.deepcopy(dict(base, **overrides))
    unset = [k for k, v in cfg.items() if v is ...]
    if unset:
        raise ValueError(f"config keys left unset: {unset}")
    return cfg


def _rope(theta: float = 10000.0) -> dict:
    return dict(rope_type="default", rope_theta=theta)


def _yarn(factor: float, mscale: float, mscale_all_dim: float, original_max: int) -> dict:
    return dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=factor,
        beta_fast=32,
        beta_slow=1,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        original_max_position_embeddings=original_max,
    )


def _case(classes: tuple, config: dict, knobs: list, gains: dict, sharded: bool = False) -> dict:
    """One CASES entry; ``classes`` is (model class, config class)."""
    model_cls, config_cls = classes
    return dict(
        model_cls=model_cls,
        config_cls=config_cls,
        config=config,
        knobs=knobs,
        sharded=sharded,
        gains=dict(gains),
    )


# Per-family base configs.  ``...`` marks a key every case of the family sets itself; it is in
# the base only so that the key keeps its place in the config kwargs.  ``_config`` merges a base
# with a case's overrides: a base key keeps its position, a new key goes at the end.

_DSV3 = (DeepseekV3ForCausalLM, DeepseekV3Config)
_DSV2 = (DeepseekV2ForCausalLM, DeepseekV2Config)
_QWEN3_MOE = (Qwen3MoeForCausalLM, Qwen3MoeConfig)
_LLAMA = (LlamaForCausalLM, LlamaConfig)
_QWEN3 = (Qwen3ForCausalLM, Qwen3Config)

# MLA attention + DeepSeek MoE; V2 adds topk_method before the group keys, V3 adds num_mtp_layers.
_MLA_HEAD = dict(
    COMMON,
    num_hidden_layers=..., first_k_dense_replace=..., intermediate_size=...,
    num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=..., kv_lora_rank=..., qk_nope_head_dim=..., qk_rope_head_dim=..., v_head_dim=...,
    n_routed_experts=8, num_experts_per_tok=...,
)
_MLA_TAIL = dict(
    n_group=..., topk_group=..., moe_intermediate_size=..., n_shared_experts=...,
    routed_scaling_factor=..., norm_topk_prob=..., tie_word_embeddings=False, rope_parameters=...,
)
_DSV3_CONFIG = dict(_MLA_HEAD, **_MLA_TAIL, num_mtp_layers=0)
_DSV2_CONFIG = dict(_MLA_HEAD, topk_method=..., **_MLA_TAIL)

_QWEN3_MOE_CONFIG = dict(
    COMMON,
    num_hidden_layers=2, intermediate_size=..., num_attention_heads=4, num_key_value_heads=2,
    head_dim=24, num_experts=8, num_experts_per_tok=..., moe_intermediate_size=...,
    norm_topk_prob=..., decoder_sparse_step=1, mlp_only_layers=..., tie_word_embeddings=False,
    rope_parameters=_rope(1000000.0),
)

# Dense models: each case appends tie_word_embeddings / rope_parameters (Qwen3 head_dim first).
_DENSE_CONFIG = dict(
    COMMON, hidden_size=48, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2,
)

# Init gains (see make_golden.py, "Why the weights are re-initialized"): untied models scale
# lm_head; tied ones raise attention/MLP gains and the final norm instead.  Dense: router=None.
_GAINS = dict(attn=1.0, mlp=1.0, router=2.0, lm=12.0)
_TIED_GAINS = dict(attn=2.0, mlp=2.0, router=2.0, lm=None, final_norm=1.5)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------
# Each case: model / config class, config kwargs, the knobs exercised (free text for the
# manifest), init gains, and whether the checkpoint is saved sharded.

CASES: dict[str, dict] = {
    "dsv3_qlora_yarn": _case(
        _DSV3,
        _config(
            _DSV3_CONFIG,
            num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=80,
            q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_parameters=_yarn(4.0, 1.0, 1.0, original_max=64),
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
        gains=_GAINS,
        sharded=True,
    ),
    "dsv3_noqlora_dense2": _case(
        _DSV3,
        _config(
            _DSV3_CONFIG,
            num_hidden_layers=3, first_k_dense_replace=2, intermediate_size=80,
            q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
            num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=24, n_shared_experts=2, routed_scaling_factor=1.7,
            norm_topk_prob=True, tie_word_embeddings=True, rope_parameters=_rope(),
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
        gains=_TIED_GAINS,
    ),
    "dsv3_dense0_mscale": _case(
        _DSV3,
        _config(
            _DSV3_CONFIG,
            num_hidden_layers=2, first_k_dense_replace=0, intermediate_size=96,
            q_lora_rank=32, kv_lora_rank=40, qk_nope_head_dim=20, qk_rope_head_dim=16, v_head_dim=12,
            num_experts_per_tok=3, n_group=2, topk_group=1,
            moe_intermediate_size=24, n_shared_experts=1, routed_scaling_factor=2.0,
            norm_topk_prob=False, rope_parameters=_yarn(8.0, 0.9, 0.707, original_max=32),
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
        gains=_GAINS,
    ),
    # No num_mtp_layers: DeepseekV3Config's default (1) is written to config.json, yet
    # save_pretrained stores no MTP layer (the modeling code builds none).
    "dsv3_mtp_unsaved": _case(
        _DSV3,
        {k: v for k, v in _config(
            _DSV3_CONFIG,
            num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=32,
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_parameters=_rope(),
        ).items() if k != "num_mtp_layers"},
        knobs=[
            "config.json says num_nextn_predict_layers=1 (DeepseekV3Config's default) but the "
            "checkpoint holds no MTP tensors (transformers never builds or saves the MTP layer)",
            "tiny: 2 layers (layer 0 dense, layer 1 MoE), 4 experts, top-2, 1 shared expert",
            "q_lora_rank=32, kv_lora_rank=16, nope=8, rope=8, v=8, default RoPE",
            "untied embeddings",
        ],
        gains=_GAINS,
    ),
    "dsv2_lite": _case(
        _DSV2,
        _config(
            _DSV2_CONFIG,
            num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=80,
            q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            num_experts_per_tok=3, topk_method="greedy", n_group=None, topk_group=None,
            moe_intermediate_size=24, n_shared_experts=2, routed_scaling_factor=1.0,
            norm_topk_prob=False, rope_parameters=_yarn(4.0, 0.707, 0.707, original_max=64),
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
        gains=_GAINS,
    ),
    "dsv2_grouped": _case(
        _DSV2,
        _config(
            _DSV2_CONFIG,
            num_hidden_layers=2, first_k_dense_replace=0, intermediate_size=96,
            q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            moe_intermediate_size=20, n_shared_experts=1, routed_scaling_factor=1.5,
            norm_topk_prob=False, rope_parameters=_rope(),
        ),
        knobs=[
            "DeepSeek-V2 (full) style: q_lora_rank=48, kv_lora_rank=32, nope=16, rope=8, v=12",
            "softmax router, topk_method='group_limited_greedy', n_group=4 (group score = max), topk_group=2, 8 experts, top-3",
            "routed_scaling_factor=1.5, norm_topk_prob=False",
            "first_k_dense_replace=0 (all layers MoE), n_shared_experts=1",
            "default RoPE",
            "untied embeddings",
        ],
        gains=_GAINS,
    ),
    "qwen3_moe": _case(
        _QWEN3_MOE,
        _config(
            _QWEN3_MOE_CONFIG,
            intermediate_size=96, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=True, mlp_only_layers=[],
        ),
        knobs=[
            "GQA 4 q heads / 2 kv heads, head_dim=24 != hidden/heads=16",
            "per-head q_norm/k_norm (RMSNorm over head_dim) before RoPE",
            "softmax router, 8 experts, top-2, norm_topk_prob=True, no shared experts",
            "decoder_sparse_step=1, mlp_only_layers=[] (all layers MoE)",
            "rope_theta=1e6, non-interleaved (rotate_half) RoPE",
            "untied embeddings",
        ],
        gains=_GAINS,
    ),
    "qwen3_moe_mlp_only": _case(
        _QWEN3_MOE,
        _config(
            _QWEN3_MOE_CONFIG,
            intermediate_size=80, num_experts_per_tok=3, moe_intermediate_size=20,
            norm_topk_prob=False, mlp_only_layers=[0],
        ),
        knobs=[
            "mlp_only_layers=[0]: layer 0 dense MLP (intermediate_size=80), layer 1 MoE",
            "8 experts, top-3, norm_topk_prob=False (weights are raw softmax probs)",
            "GQA 4/2, head_dim=24, q/k norm, rope_theta=1e6",
            "untied embeddings",
        ],
        gains=_GAINS,
    ),
    "llama": _case(
        _LLAMA,
        _config(_DENSE_CONFIG, tie_word_embeddings=False, rope_parameters=_rope(500000.0)),
        knobs=[
            "dense Llama, hidden_size=48, GQA 4 q heads / 2 kv heads, head_dim=12",
            "rope_theta=5e5 default RoPE (rotate_half)",
            "untied embeddings",
        ],
        gains=dict(_GAINS, router=None),
    ),
    "llama_tied": _case(
        _LLAMA,
        _config(
            _DENSE_CONFIG,
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
        gains=dict(_TIED_GAINS, router=None),
    ),
    "qwen3": _case(
        _QWEN3,
        _config(
            _DENSE_CONFIG,
            head_dim=24,
            tie_word_embeddings=False,
            rope_parameters=_rope(1000000.0),
        ),
        knobs=[
            "dense Qwen3, hidden_size=48, GQA 4/2, explicit head_dim=24 != hidden/heads=12 (q_proj out 96 > hidden)",
            "per-head q_norm/k_norm",
            "rope_theta=1e6",
            "untied embeddings",
        ],
        gains=dict(_GAINS, router=None),
    ),
}

SKIPPED: dict[str, str] = {}  # name -> reason (none: transformers supports every requested variant)
