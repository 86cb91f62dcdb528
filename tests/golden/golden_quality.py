"""Quality statistics for candidate random inits of the golden-fixture models.

Part of ``tests/golden/make_golden.py`` (the driver; see its docstring for the full picture).
* ``top2_margin``: top1-top2 logit margin (greedy choices must not be near-ties);
* ``router_gaps`` / ``RouterMonitor``: forward hooks on every MoE router that record, per token,
  the smallest score gap between the last selected and the first rejected expert (and group);
* ``ablations`` / ``ablation_effects``: remove one component at a time (attention, routed /
  shared / dense MLP, correction bias, norm weights, router) and measure how much the logits move.
The thresholds these numbers are compared against live in ``golden_cases.py``.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


# ----------------------------------------------------------------------------------------------
# Logit margins
# ----------------------------------------------------------------------------------------------


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    t = logits.float().topk(2, dim=-1).values
    return t[..., 0] - t[..., 1]


# ----------------------------------------------------------------------------------------------
# Router margin instrumentation
# ----------------------------------------------------------------------------------------------


def _gap(sorted_desc: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row gap between the k-th and (k+1)-th largest values (inf if no (k+1)-th candidate)."""
    if sorted_desc.shape[-1] <= k:
        return torch.full(sorted_desc.shape[:-1], float("inf"))
    g = sorted_desc[..., k - 1] - sorted_desc[..., k]
    return torch.where(torch.isfinite(sorted_desc[..., k]), g, torch.full_like(g, float("inf")))


def router_gaps(gate, router_logits: torch.Tensor) -> torch.Tensor:
    """Smallest selection gap per token for one router call (float32, like HF)."""
    logits = router_logits.float()
    cls = type(gate).__name__
    E = logits.shape[-1]
    k = gate.top_k
    gaps = []
    if cls == "DeepseekV3TopkRouter":
        scores = logits.sigmoid()
        sfc = scores + gate.e_score_correction_bias
        G, TG = gate.num_group, gate.topk_group
        if G > 1 and TG < G:
            gs = sfc.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
            gaps.append(_gap(gs.sort(-1, descending=True)[0], TG))
            gidx = gs.topk(TG, dim=-1)[1]
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool()
            smask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            sfc = sfc.masked_fill(~smask, float("-inf"))
        gaps.append(_gap(sfc.sort(-1, descending=True)[0], k))
    elif cls == "DeepseekV2TopkRouter":
        scores = logits.softmax(-1)
        if gate.topk_method == "group_limited_greedy":
            G, TG = gate.num_group, gate.topk_group
            gs = scores.view(-1, G, E // G).max(-1).values
            gaps.append(_gap(gs.sort(-1, descending=True)[0], TG))
            gidx = gs.topk(TG, dim=-1)[1]
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool()
            smask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            scores = scores.masked_fill(~smask, 0.0)
        gaps.append(_gap(scores.sort(-1, descending=True)[0], k))
    elif cls == "Qwen3MoeTopKRouter":
        scores = logits.softmax(-1)
        gaps.append(_gap(scores.sort(-1, descending=True)[0], k))
    else:
        raise RuntimeError(f"unknown router {cls}")
    return torch.stack(gaps, 0).min(0).values


class RouterMonitor:
    def __init__(self, model):
        self.handles = []
        self.gaps: list[torch.Tensor] = []
        self.n_routers = 0
        for name, mod in model.named_modules():
            if type(mod).__name__ in ("DeepseekV3TopkRouter", "DeepseekV2TopkRouter", "Qwen3MoeTopKRouter"):
                self.n_routers += 1
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, inputs, output):
        self.gaps.append(router_gaps(mod, output[0].detach()))

    def min_gap(self) -> float:
        if not self.gaps:
            return float("inf")
        return float(torch.cat(self.gaps).min())

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------------------------
# Ablations: every component must matter
# ----------------------------------------------------------------------------------------------


def ablations(model) -> dict:
    """name -> function(model_copy) that removes one component in place."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    abl = {}

    def zero_matching(pred):
        def f(m):
            with torch.no_grad():
                for n, p in list(m.named_parameters()) + list(m.named_buffers()):
                    if pred(n):
                        p.zero_()
        return f

    abl["attention(o_proj=0)"] = zero_matching(lambda n: n.endswith("self_attn.o_proj.weight"))
    if any(n.endswith("experts.down_proj") for n in names):
        abl["routed_experts(down=0)"] = zero_matching(lambda n: n.endswith("experts.down_proj"))
    if any("shared_experts" in n for n in names):
        abl["shared_experts(down=0)"] = zero_matching(lambda n: n.endswith("shared_experts.down_proj.weight"))
    if any(n.endswith("e_score_correction_bias") for n in names):
        abl["e_score_correction_bias=0"] = zero_matching(lambda n: n.endswith("e_score_correction_bias"))
    dense = [n for n in names if n.endswith("mlp.down_proj.weight") and "experts" not in n]
    if dense:
        abl["dense_mlp(down=0)"] = zero_matching(lambda n: n in dense)

    def norms_to_one(m):
        with torch.no_grad():
            for n, p in m.named_parameters():
                leaf = n.split(".")[-2] if n.endswith(".weight") else ""
                if p.ndim == 1 and "norm" in leaf:
                    p.fill_(1.0)

    abl["norm_weights=1"] = norms_to_one
    if any(n.endswith("mlp.gate.weight") for n in names):
        # route by a different (permuted-expert) router: tests that routing choices matter
        def permute_router(m):
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n.endswith("mlp.gate.weight"):
                        p.copy_(p.roll(1, dims=0))
        abl["router_rows_rolled"] = permute_router
    return abl


@torch.no_grad()
def ablation_effects(model, prompt: np.ndarray) -> dict:
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    ref = model(input_ids=ids, use_cache=False).logits[0].float()
    std = float(ref.std())
    res = {}
    for name, fn in ablations(model).items():
        m2 = copy.deepcopy(model)
        fn(m2)
        lg = m2(input_ids=ids, use_cache=False).logits[0].float()
        res[name] = dict(
            rel_mean_abs_change=round(float((lg - ref).abs().mean()) / std, 4),
            argmax_changed_frac=round(float((lg.argmax(-1) != ref.argmax(-1)).float().mean()), 3),
        )
    return res

