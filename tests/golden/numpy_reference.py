#!/usr/bin/env python3
"""Independent NumPy (float64) re-implementation of the golden-fixture models.

Purpose: an executable, framework-free spec of exactly what the HF reference computes
for each fixture (MLA + YaRN + DeepSeek routers, Qwen3-MoE, Llama/llama3-rope, Qwen3),
used to cross-check the fixtures written by ``make_golden.py`` without torch/transformers.
It reads only ``config.json`` + safetensors (sharded or not, tied or not) + ``golden.npz``.

For every case it runs ONE causal full-sequence forward over
``prompt_i ++ greedy_i[:-1]`` (no KV cache) and checks that
  * rows [0, L_i)        match ``prefill_logits_i``
  * rows [L_i, L_i + 31) match ``decode_logits_i``  (i.e. cached decode == full recompute)
  * argmaxes reproduce ``greedy_i``.

Run (needs numpy + safetensors only, e.g. the reference environment):
    .venv-ref/bin/python tests/golden/numpy_reference.py [case ...]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

FIXTURES = Path(__file__).resolve().parent / "fixtures"


# ------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------


def load_weights(d: Path, cfg: dict) -> dict[str, np.ndarray]:
    idx = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() else ["model.safetensors"]
    w = {}
    for f in files:
        w.update({k: v.astype(np.float64) for k, v in load_file(str(d / f)).items()})
    if cfg.get("tie_word_embeddings"):
        assert "lm_head.weight" not in w
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    return w


# ------------------------------------------------------------------------------------------
# primitives
# ------------------------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    x = x - x.max(axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis, keepdims=True)


def mlp(x, w, p):
    return (silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def causal_attention(q, k, v, scale):
    """q: [Hq, T, d], k: [Hkv, T, d], v: [Hkv, T, dv] -> [T, Hq*dv] (GQA by head repetition)."""
    rep = q.shape[0] // k.shape[0]
    k = np.repeat(k, rep, axis=0)
    v = np.repeat(v, rep, axis=0)
    s = np.einsum("htd,hsd->hts", q, k) * scale
    T = q.shape[1]
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    o = np.einsum("hts,hsd->htd", softmax(s), v)
    return o.transpose(1, 0, 2).reshape(T, -1)


# ------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------


def yarn_get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rp: dict, dim: int, max_pos: int):
    """Returns (inv_freq [dim/2], cos/sin multiplier) like transformers.modeling_rope_utils."""
    base = rp.get("rope_theta", 10000.0)
    t = rp.get("rope_type", "default")
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if t == "default":
        return inv, 1.0
    if t == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        mid = (wl >= hi_wl) & (wl <= lo_wl)
        return np.where(mid, smoothed, out), 1.0
    if t == "yarn":
        factor = rp.get("factor") or max_pos / rp["original_max_position_embeddings"]
        orig = rp["original_max_position_embeddings"]
        ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
        if rp.get("attention_factor") is not None:
            att = rp["attention_factor"]
        elif ms and msa:
            att = yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, msa)
        else:
            att = yarn_get_mscale(factor)
        bf, bs = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def corr_dim(n_rot):
            return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr_dim(bf), corr_dim(bs)
        if rp.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrap = 1 - ramp  # weight of the un-scaled (extrapolated) frequency
        return (inv / factor) * (1 - extrap) + inv * extrap, att
    raise NotImplementedError(t)


def rope_half(x, cos, sin):
    """Non-interleaved (rotate_half) RoPE; x [..., T, d], cos/sin [T, d/2]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rope_pairs(x, cos, sin, deinterleave_output: bool):
    """RoPE on adjacent pairs (x0,x1),(x2,x3)... (DeepSeek layout).

    DeepSeek-V3 in HF (rope_interleave=True) writes the result de-interleaved
    ([all rotated evens, all rotated odds]); DeepSeek-V2 keeps the pair layout. Both are applied
    identically to q and k, so q.k (and the logits) are the same either way."""
    a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if deinterleave_output:
        return np.concatenate([ra, rb], -1)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = ra, rb
    return out


# ------------------------------------------------------------------------------------------
# attention blocks
# ------------------------------------------------------------------------------------------


def mla(x, w, p, cfg, cos, sin):
    T = x.shape[0]
    H, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    eps = cfg["rms_norm_eps"]
    if cfg.get("q_lora_rank") is None:
        q = x @ w[p + "q_proj.weight"].T
    else:
        qa = rms_norm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], eps)
        q = qa @ w[p + "q_b_proj.weight"].T
    q = q.reshape(T, H, dn + dr).transpose(1, 0, 2)
    q_nope, q_rot = q[..., :dn], q[..., dn:]
    ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    kv_lat = rms_norm(ckv[:, : cfg["kv_lora_rank"]], w[p + "kv_a_layernorm.weight"], eps)
    k_rot = ckv[None, :, cfg["kv_lora_rank"]:]  # [1, T, dr] shared by all heads
    if cfg["model_type"] == "deepseek_v3" and not cfg.get("rope_interleave", True):
        q_rot, k_rot = rope_half(q_rot, cos, sin), rope_half(k_rot, cos, sin)
    else:
        de = cfg["model_type"] == "deepseek_v3"
        q_rot, k_rot = rope_pairs(q_rot, cos, sin, de), rope_pairs(k_rot, cos, sin, de)
    kv = (kv_lat @ w[p + "kv_b_proj.weight"].T).reshape(T, H, dn + dv).transpose(1, 0, 2)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(k_rot, (H, T, dr))], -1)
    qf = np.concatenate([q_nope, q_rot], -1)
    scale = (dn + dr) ** -0.5
    rp = cfg["rope_parameters"]
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        scale *= yarn_get_mscale(rp["factor"], rp["mscale_all_dim"]) ** 2
    o = causal_attention(qf, k, kv[..., dn:], scale)
    return o @ w[p + "o_proj.weight"].T


def gqa(x, w, p, cfg, cos, sin, qk_norm: bool):
    T = x.shape[0]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // H
    q = (x @ w[p + "q_proj.weight"].T).reshape(T, H, d).transpose(1, 0, 2)
    k = (x @ w[p + "k_proj.weight"].T).reshape(T, Hkv, d).transpose(1, 0, 2)
    v = (x @ w[p + "v_proj.weight"].T).reshape(T, Hkv, d).transpose(1, 0, 2)
    if qk_norm:
        q = rms_norm(q, w[p + "q_norm.weight"], cfg["rms_norm_eps"])
        k = rms_norm(k, w[p + "k_norm.weight"], cfg["rms_norm_eps"])
    q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
    return causal_attention(q, k, v, d**-0.5) @ w[p + "o_proj.weight"].T


# ------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------


def num_experts(cfg):
    # NB: transformers 5.x saves Qwen3-MoE's expert count as "num_local_experts" (Hub configs say "num_experts")
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            return cfg[key]
    raise KeyError("expert count")


def topk_idx(s, k):
    return np.argsort(-s, axis=-1, kind="stable")[:, :k]


def group_mask(group_scores, topk_group, per_group):
    gi = topk_idx(group_scores, topk_group)
    gm = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(gm, gi, True, axis=1)
    return np.repeat(gm, per_group, axis=1)


def moe(x, w, p, cfg):
    mt = cfg["model_type"]
    E = num_experts(cfg)
    k = cfg["num_experts_per_tok"]
    logits = x @ w[p + "gate.weight"].T  # [T, E]
    if mt == "deepseek_v3":
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + w[p + "gate.e_score_correction_bias"]
        G, TG = cfg["n_group"], cfg["topk_group"]
        gs = np.sort(choice.reshape(-1, G, E // G), -1)[..., -2:].sum(-1)  # sum of top-2 per group
        choice = np.where(group_mask(gs, TG, E // G), choice, -np.inf)
        idx = topk_idx(choice, k)
        wts = np.take_along_axis(scores, idx, 1)
        if cfg["norm_topk_prob"]:
            wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
        wts = wts * cfg["routed_scaling_factor"]
    elif mt == "deepseek_v2":
        scores = softmax(logits)
        if cfg["topk_method"] == "group_limited_greedy":
            G, TG = cfg["n_group"], cfg["topk_group"]
            gs = scores.reshape(-1, G, E // G).max(-1)
            scores = np.where(group_mask(gs, TG, E // G), scores, 0.0)
        idx = topk_idx(scores, k)
        wts = np.take_along_axis(scores, idx, 1) * cfg["routed_scaling_factor"]  # norm_topk_prob unused
    elif mt == "qwen3_moe":
        scores = softmax(logits)
        idx = topk_idx(scores, k)
        wts = np.take_along_axis(scores, idx, 1)
        if cfg["norm_topk_prob"]:
            wts = wts / wts.sum(-1, keepdims=True)
    else:
        raise NotImplementedError(mt)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            e = idx[t, j]
            out[t] += wts[t, j] * mlp(x[t : t + 1], w, f"{p}experts.{e}.")[0]
    if "n_shared_experts" in cfg and cfg["n_shared_experts"]:
        out = out + mlp(x, w, p + "shared_experts.")
    return out


def is_moe_layer(cfg, i):
    mt = cfg["model_type"]
    if mt in ("deepseek_v2", "deepseek_v3"):
        return i >= cfg["first_k_dense_replace"]
    if mt == "qwen3_moe":
        return i not in cfg["mlp_only_layers"] and num_experts(cfg) > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0
    return False


# ------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------


def forward(cfg, w, ids):
    mt = cfg["model_type"]
    T = len(ids)
    eps = cfg["rms_norm_eps"]
    rp = cfg["rope_parameters"]
    if mt in ("deepseek_v2", "deepseek_v3"):
        rdim = cfg["qk_rope_head_dim"]
    else:
        rdim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv, att = rope_inv_freq(rp, rdim, cfg["max_position_embeddings"])
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None]
    cos, sin = np.cos(ang) * att, np.sin(ang) * att
    h = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a_in = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        if mt in ("deepseek_v2", "deepseek_v3"):
            h = h + mla(a_in, w, p + "self_attn.", cfg, cos, sin)
        else:
            h = h + gqa(a_in, w, p + "self_attn.", cfg, cos, sin, qk_norm=mt in ("qwen3", "qwen3_moe"))
        m_in = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + (moe(m_in, w, p + "mlp.", cfg) if is_moe_layer(cfg, i) else mlp(m_in, w, p + "mlp."))
    h = rms_norm(h, w["model.norm.weight"], eps)
    return h @ w["lm_head.weight"].T


def check_case(d: Path) -> float:
    cfg = json.loads((d / "config.json").read_text())
    w = load_weights(d, cfg)
    g = np.load(d / "golden.npz")
    worst = 0.0
    for i in (0, 1):
        prompt, greedy = g[f"prompt_{i}"], g[f"greedy_{i}"]
        L = len(prompt)
        seq = np.concatenate([prompt, greedy[:-1]]).astype(np.int64)
        lg = forward(cfg, w, seq)
        ref = np.concatenate([g[f"prefill_logits_{i}"], g[f"decode_logits_{i}"]]).astype(np.float64)
        err = np.abs(lg - ref).max()
        worst = max(worst, err)
        assert err < 2e-3, f"{d.name} prompt {i}: max |numpy - golden| = {err:.2e}"
        assert np.array_equal(lg[L - 1 :].argmax(-1), greedy), f"{d.name} prompt {i}: greedy mismatch"
    return worst


def main(argv):
    names = argv or sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").exists())
    for n in names:
        err = check_case(FIXTURES / n)
        print(f"{n:22s} OK  max|numpy(float64) - HF golden(float32)| = {err:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
