#!/usr/bin/env python3
"""Generate `tests/golden/fixtures/eagle3/`: tiny EAGLE-3 heads as published, beside a tiny
Kimi K2.5 INT4 target, with PyTorch goldens of their draft steps.

    .venv-ref/bin/python tests/golden/make_golden_eagle3.py

(the reference environment of `make_golden_k25.py`: python 3.11, torch 2.13.0+cpu,
transformers 5.24.0, compressed-tensors 0.20.1; any interpreter holding those runs it, e.g.
`/path/to/venv/bin/python tests/golden/make_golden_eagle3.py`). Deterministic (fixed seeds),
CPU, about ten seconds.

The reference head is SGLang's / vLLM's composition (sglang `models/deepseek_eagle3.py` and
`llama_eagle3.py`, vllm `model_executor/models/deepseek_eagle3.py` and `llama_eagle3.py`,
TorchSpec `models/draft/deepseek_eagle.py`) on transformers' DeepSeek-V3 and Llama blocks:

    g      = fc(concat(fc_norm_i(aux_i)))            # first pass only; fc_norm: EAGLE-3.1
    res, g = g, hidden_norm(g)                        # (norm_before_residual: res = hidden_norm(g))
    x      = concat(input_layernorm(embed(token)), g) # 2H: the attention's first projections
    h      = res + attn(x)                            #    take 2H (q_a / kv_a, or q / k / v)
    h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                         # draft vocabulary
    carry  = norm(h) if norm_output else h            # what the next chained step takes as g

The MLA head is `DeepseekV3Attention` with `q_a_proj` / `kv_a_proj_with_mqa` 2H wide, DeepSeek's
interleaved RoPE and the YaRN mscale^2 softmax scale, its `q_a_layernorm` / `kv_a_layernorm`
built with the head's `rms_norm_eps` as vLLM / SGLang / TorchSpec build them (transformers'
class fixes them at 1e-6); the MHA head is `LlamaAttention` with q / k / v 2H wide. Each head
uses its own RoPE and eps, never the target's.

What it writes (fixtures/eagle3/):
* `target/`: a 5-layer miniature Kimi K2.5 with compressed-tensors INT4 experts, made by
  `make_golden_k25.py`'s machinery with `num_hidden_layers` 5 (so both aux-id conventions name
  layers inside it: output-of [1, 2, 3] = input-to [2, 3, 4]).
* `target_states.npz`: for the two prompts of `make_golden`, `prompt_{i}`, the target's greedy
  `next_token_{i}`, and `residual_{i}` [L + 1, T, H]: the pre-norm residual stream entering
  layer l (l = L: after the last layer, before the final norm), by forward pre-hooks.
* one directory per head variant (`HEADS`): `config.json`, `model.safetensors` (or shards +
  index), bf16 weights as published, and `golden.npz` with, per prompt i:
  `first_logits_{i}` [T, Vd] (the first pass over every prompt position t: aux at t, token
  t + 1, the last slot the target's next token; RoPE position t), `chain_logits_{i}` [K, Vd]
  (K = 3 chained steps after it, one token each at positions T .. T + K - 1, fed the previous
  draft token and the previous step's carry), `draft_tokens_{i}` [K + 1] (greedy, target ids:
  through d2t for a reduced vocabulary), and `aux_layers` (the target layers, input-to
  convention, the aux states were taken from). Everything in float32 from the bf16 weights.
* `GENERATED.json`: seeds, versions, per-head margins and ablation effects (what an off-by-one
  aux layer or the wrong chained carry changes).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.dont_write_bytecode = True
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import compressed_tensors  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV3Config, DynamicCache, LlamaConfig  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention, DeepseekV3MLP, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding)

import make_golden_k25 as k25  # noqa: E402
from golden_cases import EXPECTED_TRANSFORMERS, MIN_GREEDY_MARGIN, MIN_ROUTER_GAP  # noqa: E402
from golden_quality import RouterMonitor, top2_margin  # noqa: E402
from make_golden import case_seed, make_prompts, run_prompt  # noqa: E402

OUT = HERE / "fixtures" / "eagle3"
TARGET_LAYERS = 5
K = 3  # chained steps after the first pass
DRAFT_VOCAB = 96  # the reduced heads' draft vocabulary (of the target's 320)
MIN_DRAFT_MARGIN = 0.05  # top1 - top2 at every greedy draft choice
MIN_ABLATION = 0.5  # max |d logits| an off-by-one aux layer / the wrong carry must cause
MIN_DISTINCT_DRAFTS = 2  # distinct tokens among each prompt's K + 1 drafts

_MLA = dict(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="kimi_k2",
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-5)
_MHA = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5,
            attention_bias=False, rope_theta=1000000.0, rope_scaling=None)
# The head's own YaRN (the target's is theta 5e4, factor 4, mscale = mscale_all_dim = 1):
# mscale != mscale_all_dim makes both the cos/sin factor and the softmax scale differ from 1.
_YARN = dict(rope_theta=10000.0, rope_scaling=dict(
    type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
    mscale=0.9, mscale_all_dim=0.707))

# name -> (config fields beyond the common ones, layout: prefix, own embed_tokens, reduced
# vocabulary, shards). Published counterparts: lightseekorg/kimi-k2.5-eagle3-mla (mla),
# TorchSpec's vLLM export (mla_reduced's layers.0.), the K2.6 3.1 heads (mla_eagle31),
# AQ-MedAI/Kimi-K25-eagle3 (mha_reduced), lightseekorg/kimi-k2.5-eagle3 (mha_full, 2 shards).
HEADS = {
    "mla": (dict(_MLA, **_YARN, eagle_config=dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                                                  use_aux_hidden_state=True)),
            dict(prefix="midlayer.", embed=True, reduced=False, shards=1)),
    "mla_reduced": (dict(_MLA, rope_theta=50000.0, rope_scaling=None,
                         eagle_config=dict(eagle_aux_hidden_state_layer_ids=[2, 3, 4])),
                    dict(prefix="layers.0.", embed=False, reduced=True, shards=1)),
    "mla_eagle31": (dict(_MLA, **_YARN, fc_norm=True, norm_output=True,
                         eagle_config=dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3])),
                    dict(prefix="midlayer.", embed=False, reduced=False, shards=1)),
    "mha_reduced": (dict(_MHA, eagle_config=dict(eagle_aux_hidden_state_layer_ids=[2, 3, 4])),
                    dict(prefix="midlayer.", embed=False, reduced=True, shards=1)),
    "mha_full": (dict(_MHA, norm_before_residual=True,
                      eagle_aux_hidden_state_layer_ids=[1, 2, 3]),
                 dict(prefix="layers.0.", embed=True, reduced=False, shards=2)),
}


# ---- the reference head ----------------------------------------------------------------------

def aux_ids(spec: dict) -> list[int]:
    ids = (spec.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        spec["eagle_aux_hidden_state_layer_ids"]
    # SGLang's rule (PR #25454): a list starting with 1 names layer outputs (+1 = the input of
    # the next layer), else layer inputs.
    return [i + 1 for i in ids] if ids[0] == 1 else list(ids)


def _hf_config(spec: dict, hidden: int, vocab: int):
    rope = dict(spec["rope_scaling"] or {}, rope_theta=spec["rope_theta"])
    rope["rope_type"] = rope.pop("type", "default")
    common = dict(hidden_size=hidden, intermediate_size=spec["intermediate_size"],
                  num_attention_heads=spec["num_attention_heads"],
                  num_key_value_heads=spec["num_key_value_heads"], vocab_size=vocab,
                  num_hidden_layers=1, rms_norm_eps=spec["rms_norm_eps"],
                  max_position_embeddings=spec["max_position_embeddings"],
                  attention_bias=False, rope_parameters=rope)
    if spec["model_type"] == "llama":
        cfg = LlamaConfig(head_dim=spec["head_dim"], **common)
    else:
        cfg = DeepseekV3Config(q_lora_rank=spec["q_lora_rank"], kv_lora_rank=spec["kv_lora_rank"],
                               qk_nope_head_dim=spec["qk_nope_head_dim"],
                               qk_rope_head_dim=spec["qk_rope_head_dim"],
                               v_head_dim=spec["v_head_dim"], rope_interleave=True,
                               n_routed_experts=1, first_k_dense_replace=1, **common)
    cfg._attn_implementation = "eager"
    return cfg


class MidLayer(nn.Module):
    """`midlayer.*`: the decoder layer whose attention reads [input_layernorm(embed), g]."""

    def __init__(self, spec: dict, cfg, hidden: int):
        super().__init__()
        eps = spec["rms_norm_eps"]
        if spec["model_type"] == "llama":
            Norm, self.self_attn = LlamaRMSNorm, LlamaAttention(cfg, layer_idx=0)
            a = self.self_attn
            for n in ("q_proj", "k_proj", "v_proj"):
                setattr(a, n, nn.Linear(2 * hidden, getattr(a, n).out_features, bias=False))
            self.mlp = LlamaMLP(cfg)
        else:
            Norm, self.self_attn = DeepseekV3RMSNorm, DeepseekV3Attention(cfg, layer_idx=0)
            a = self.self_attn
            a.q_a_proj = nn.Linear(2 * hidden, cfg.q_lora_rank, bias=False)
            a.kv_a_proj_with_mqa = nn.Linear(2 * hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                             bias=False)
            a.q_a_layernorm.variance_epsilon = eps  # vLLM / SGLang: the config's eps
            a.kv_a_layernorm.variance_epsilon = eps
            self.mlp = DeepseekV3MLP(cfg, intermediate_size=spec["intermediate_size"])
        self.input_layernorm = Norm(hidden, eps=eps)
        self.hidden_norm = Norm(hidden, eps=eps)
        self.post_attention_layernorm = Norm(hidden, eps=eps)


class Eagle3Head(nn.Module):
    def __init__(self, spec: dict, hidden: int, vocab: int, draft_vocab: int, n_aux: int):
        super().__init__()
        self.spec, self.cfg = spec, _hf_config(spec, hidden, vocab)
        Norm = LlamaRMSNorm if spec["model_type"] == "llama" else DeepseekV3RMSNorm
        eps = spec["rms_norm_eps"]
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.fc = nn.Linear(n_aux * hidden, hidden, bias=False)
        if spec.get("fc_norm"):
            self.fc_norm = nn.ModuleList([Norm(hidden, eps=eps) for _ in range(n_aux)])
        self.midlayer = MidLayer(spec, self.cfg, hidden)
        self.norm = Norm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        Rope = LlamaRotaryEmbedding if spec["model_type"] == "llama" else DeepseekV3RotaryEmbedding
        self.rotary_emb = Rope(self.cfg)  # non-persistent buffers: not in the state dict

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [1, T, n*H] (the target's residual streams, concatenated) -> g [1, T, H]."""
        if hasattr(self, "fc_norm"):
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(self, embeds, g, positions, cache):
        """One pass over T tokens at `positions` ([1, T]) -> (logits [1, T, Vd], carry)."""
        m = self.midlayer
        if self.spec.get("norm_before_residual"):
            g = m.hidden_norm(g)
            residual = g
        else:
            residual, g = g, m.hidden_norm(g)
        x = torch.cat([m.input_layernorm(embeds), g], dim=-1)
        cos_sin = self.rotary_emb(x, positions)
        t, past = x.shape[1], cache.get_seq_length()
        mask = torch.full((t, past + t), torch.finfo(torch.float32).min).triu(past + 1)
        a, _ = m.self_attn(x, position_embeddings=cos_sin, attention_mask=mask[None, None],
                           cache=cache)
        h = residual + a
        h = h + m.mlp(m.post_attention_layernorm(h))
        out = self.norm(h)
        return self.lm_head(out), (out if self.spec.get("norm_output") else h)


@torch.no_grad()
def run_head(head: Eagle3Head, embed: torch.Tensor, aux: np.ndarray, prompt: np.ndarray,
             next_token: int, draft_to_target: np.ndarray, carry_override=None) -> dict:
    """The first pass over the prompt's positions, then K chained steps (greedy)."""
    t = len(prompt)
    tokens = torch.tensor(np.append(prompt[1:], next_token)[None], dtype=torch.long)
    cache = DynamicCache()
    logits, carry = head.step(embed[tokens], head.combine(torch.from_numpy(aux)[None]),
                              torch.arange(t)[None], cache)
    first, chain = logits[0], []
    drafts = [int(draft_to_target[int(first[-1].argmax())])]
    margins = [float(top2_margin(first[-1]))]
    carry = carry[:, -1:]
    for j in range(K):
        if carry_override is not None:
            carry = carry_override(carry)
        step, carry = head.step(embed[torch.tensor([[drafts[-1]]])], carry,
                                torch.tensor([[t + j]]), cache)
        chain.append(step[0, 0])
        drafts.append(int(draft_to_target[int(step[0, 0].argmax())]))
        margins.append(float(top2_margin(step[0, 0])))
    return dict(first=first.numpy(), chain=torch.stack(chain).numpy(),
                drafts=np.array(drafts, np.int32), margins=np.array(margins),
                first_margins=top2_margin(first).numpy())


@torch.no_grad()
def init_head(head: Eagle3Head, seed: int) -> None:
    """make_golden's re-initialisation: linears N(0, 1/fan_in), embeddings N(0, 1), norms
    1 + 0.1 N(0, 1), lm_head N(0, 12^2/H); then rounded to bf16 (the heads ship bf16)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        r = torch.randn(*p.shape, generator=gen)
        if name == "embed_tokens.weight":
            p.copy_(r)
        elif name == "lm_head.weight":
            p.copy_(r * 12.0 / p.shape[1] ** 0.5)
        elif p.ndim == 1:
            p.copy_(1.0 + 0.1 * r)
        else:
            p.copy_(r / p.shape[1] ** 0.5)
        p.copy_(p.to(torch.bfloat16).float())


# ---- the target ------------------------------------------------------------------------------

def build_target(prompts) -> tuple[object, int, int, float, list]:
    """make_golden_k25's fixture with TARGET_LAYERS layers, its seed chosen by the same checks."""
    k25.TEXT_CONFIG = dict(k25.TEXT_CONFIG, num_hidden_layers=TARGET_LAYERS)
    k25.OUT = OUT / "target"
    for attempt in range(20):
        seed = case_seed("eagle3_target", attempt)
        if k25.OUT.exists():
            shutil.rmtree(k25.OUT)
        k25.OUT.mkdir(parents=True)
        k25.write_fixture(k25.build(seed), k25.OUT)
        ref = k25.load_reference(k25.OUT)
        mon = RouterMonitor(ref)
        runs = [run_prompt(ref, p) for p in prompts]
        gap = mon.min_gap()
        mon.remove()
        margin = min(float(r["choice_margins"].min()) for r in runs)
        print(f"target attempt {attempt} seed {seed}: greedy margin {margin:.4f}, router gap "
              f"{gap:.2e}")
        if margin >= MIN_GREEDY_MARGIN and gap >= MIN_ROUTER_GAP:
            k25.check_decompressed(ref, k25.OUT)
            return ref, seed, attempt, gap, runs
    sys.exit("no acceptable target seed")


@torch.no_grad()
def residual_streams(ref, prompt: np.ndarray) -> np.ndarray:
    """[L + 1, T, H]: the residual stream entering each decoder layer, then the final norm."""
    lm = ref.model.language_model
    seen: list[torch.Tensor] = []

    def grab(_module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"])[0].clone())

    hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in [*lm.layers, lm.norm]]
    ref(input_ids=torch.tensor(prompt[None], dtype=torch.long))
    for h in hooks:
        h.remove()
    assert len(seen) == TARGET_LAYERS + 1, len(seen)
    return torch.stack(seen).numpy().astype(np.float32)


def draft_vocabulary(runs, prompts) -> np.ndarray:
    """SpecForge's rule (`process_token_dict_to_mappings`): the DRAFT_VOCAB most frequent tokens
    (here of the prompts and the target's greedy continuations, then random fill), sorted."""
    counts = np.zeros(k25.TEXT_CONFIG["vocab_size"], np.int64)
    for seq in [*prompts, *(r["greedy"] for r in runs)]:
        np.add.at(counts, seq, 1)
    order = sorted(np.flatnonzero(counts), key=lambda t: (-counts[t], t))[:DRAFT_VOCAB]
    rest = np.setdiff1d(np.arange(len(counts)), order)
    fill = np.random.default_rng(55).choice(rest, DRAFT_VOCAB - len(order), replace=False)
    return np.sort(np.concatenate([order, fill])).astype(np.int64)


# ---- writing ---------------------------------------------------------------------------------

def head_config(name: str, spec: dict, layout: dict) -> dict:
    cfg = dict(spec, hidden_size=k25.TEXT_CONFIG["hidden_size"], intermediate_size=96,
               num_hidden_layers=1, vocab_size=k25.TEXT_CONFIG["vocab_size"],
               max_position_embeddings=256, hidden_act="silu", tie_word_embeddings=False,
               torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg["draft_vocab_size"] = DRAFT_VOCAB if layout["reduced"] else cfg["vocab_size"]
    return cfg


def head_tensors(head: Eagle3Head, layout: dict, used: np.ndarray | None) -> dict:
    out = {}
    for k, v in head.state_dict().items():
        if k == "embed_tokens.weight" and not layout["embed"]:
            continue
        if k.startswith("midlayer."):
            k = layout["prefix"] + k[len("midlayer."):]
        out[k] = v.to(torch.bfloat16).contiguous()
    if used is not None:
        out["d2t"] = torch.from_numpy(used - np.arange(len(used)))  # int64 offsets
        t2d = np.zeros(head.cfg.vocab_size, bool)
        t2d[used] = True
        out["t2d"] = torch.from_numpy(t2d)
    return out


def write_head(d: Path, cfg: dict, tensors: dict, shards: int) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    # lightseekorg/kimi-k2.5-eagle3's split: everything but lm_head, then lm_head.
    groups = [{k: v for k, v in tensors.items() if k != "lm_head.weight"},
              {"lm_head.weight": tensors["lm_head.weight"]}]
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def make_head(name: str, target_embed: torch.Tensor, states: list, prompts, next_tokens,
              used: np.ndarray) -> dict:
    spec, layout = HEADS[name]
    cfg = head_config(name, spec, layout)
    layers = aux_ids(cfg)
    reduced = used if layout["reduced"] else None
    d2t_map = used if layout["reduced"] else np.arange(cfg["vocab_size"])
    for attempt in range(40):
        seed = case_seed("eagle3_" + name, attempt)
        torch.manual_seed(seed)
        head = Eagle3Head(cfg, cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"],
                          len(layers)).eval()
        init_head(head, seed)
        embed = head.embed_tokens.weight if layout["embed"] else target_embed
        runs = [run_head(head, embed, np.concatenate([s[l] for l in layers], -1), p, n, d2t_map)
                for s, p, n in zip(states, prompts, next_tokens)]
        margin = min(float(r["margins"].min()) for r in runs)
        first_margin = min(float(r["first_margins"].min()) for r in runs)
        distinct = min(len(set(r["drafts"].tolist())) for r in runs)
        if (margin >= MIN_DRAFT_MARGIN and first_margin >= MIN_GREEDY_MARGIN
                and distinct >= MIN_DISTINCT_DRAFTS):
            break
    else:
        sys.exit(f"{name}: no acceptable seed")
    # What the goldens detect: the aux states one layer off, and the other chained carry.
    shifted = [run_head(head, embed, np.concatenate([s[l - 1] for l in layers], -1), p, n,
                        d2t_map) for s, p, n in zip(states, prompts, next_tokens)]
    other = (lambda c: head.norm(c)) if not cfg.get("norm_output") else None
    effects = dict(aux_off_by_one=max(float(np.abs(a["first"] - b["first"]).max())
                                      for a, b in zip(runs, shifted)))
    if other is not None:
        post = [run_head(head, embed, np.concatenate([s[l] for l in layers], -1), p, n,
                         d2t_map, carry_override=other)
                for s, p, n in zip(states, prompts, next_tokens)]
        effects["post_norm_carry"] = max(float(np.abs(a["chain"] - b["chain"]).max())
                                         for a, b in zip(runs, post))
    assert min(effects.values()) >= MIN_ABLATION, (name, effects)
    write_head(OUT / name, cfg, head_tensors(head, layout, reduced), layout["shards"])
    arrays = {"aux_layers": np.array(layers, np.int32)}
    for i, r in enumerate(runs):
        arrays[f"first_logits_{i}"] = r["first"].astype(np.float32)
        arrays[f"chain_logits_{i}"] = r["chain"].astype(np.float32)
        arrays[f"draft_tokens_{i}"] = r["drafts"]
    np.savez(OUT / name / "golden.npz", **arrays)
    drafts = [r["drafts"].tolist() for r in runs]
    print(f"{name}: seed {seed} (attempt {attempt}), aux layers {layers}, drafts {drafts}, "
          f"min margins {margin:.3f} / {first_margin:.3f}, effects {effects}")
    return dict(seed=seed, attempt=attempt, aux_layers=layers, min_draft_margin=margin,
                min_first_pass_margin=first_margin, ablation_max_abs_logit_change=effects)


def main() -> None:
    tv = ".".join(transformers.__version__.split(".")[:2])
    if tv != EXPECTED_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} != {EXPECTED_TRANSFORMERS}.x")
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    prompts = make_prompts()
    ref, seed, attempt, gap, runs = build_target(prompts)
    states = [residual_streams(ref, p) for p in prompts]
    next_tokens = [int(r["greedy"][0]) for r in runs]
    arrays = {}
    for i, (p, s, n) in enumerate(zip(prompts, states, next_tokens)):
        arrays[f"prompt_{i}"], arrays[f"next_token_{i}"] = p.astype(np.int32), np.int32(n)
        arrays[f"residual_{i}"] = s
    np.savez(OUT / "target_states.npz", **arrays)
    embed = ref.model.language_model.embed_tokens.weight.detach().float()
    used = draft_vocabulary(runs, prompts)
    heads = {name: make_head(name, embed, states, prompts, next_tokens, used) for name in HEADS}
    meta = dict(generator="tests/golden/make_golden_eagle3.py", chained_steps=K,
                target=dict(seed=seed, attempt=attempt, layers=TARGET_LAYERS,
                            min_router_selection_gap=gap,
                            min_greedy_choice_margin=min(float(r["choice_margins"].min())
                                                         for r in runs)),
                heads=heads,
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              compressed_tensors=compressed_tensors.__version__,
                              python=sys.version.split()[0]))
    (OUT / "GENERATED.json").write_text(json.dumps(meta, indent=2) + "\n")
    files = [f for f in OUT.rglob("*") if f.is_file()]
    for f in files:
        f.chmod(0o644)
    print(f"wrote {OUT}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e3:.0f} KB")


if __name__ == "__main__":
    main()
