"""Kimi K2.5 on 8 H200 (`tensor:8`: attention, dense and shared MLPs and the head split 8 ways;
routed experts whole, 48 per device), one request: tokens/s with and without speculation, from
bytes per device, kernel efficiencies and a per-forward overhead. An estimate, not a
measurement: every input is a flag, and the defaults say where each comes from.

    python -m bench.k25_projection                       # today's kernels and the targets
    python -m bench.k25_projection --expert_frac=0.31 --overhead_ms=2.2   # after a GPU run

A forward over T positions of one sequence (T = 1 decode; T = K + 1 a speculative verify)
waits at each MoE layer's all-reduce for the device holding the most of the step's distinct
experts, so the routed experts cost E[max over 8 devices of the experts it holds] per layer
(uniform routing, Monte Carlo; real routing of one sequence's consecutive tokens overlaps more,
so this is the pessimistic side). Time per forward:
  other weights / (ceiling x other_frac) + critical experts' bytes / (ceiling x expert_frac)
  + attention (61 layers, max of a per-call floor and the latent cache / its bandwidth)
  + overhead (collectives and launch gaps: the slice's gap_us scaled to 61 layers, plus
    121 all-reduces and 61-122 all-gathers, neither measured yet)
"Today's" experts use the W4A16 kernel's measured rate instead (BENCHMARKS "First GPU run":
~6 GB/s per SM, work items of 64 columns, 132 SMs; it reproduces 275 us at 8 experts).
With speculation: tokens per verify tau, K drafts each costing a one-layer draft forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import numpy as np

from bench.expert_bytes import INT4, KIMI_K25_TEXT

LAYERS, MOE_LAYERS, EXPERTS, TOP_K, DEVICES = 61, 60, 384, 8, 8
HIDDEN, WIDTH = 7168, 2048
EXPERT_BYTES = 3 * HIDDEN * WIDTH * (0.5 + 2 / 32)  # INT4, group-32 bf16 scales: 24.77 MB
LATENT_BYTES_PER_TOKEN = LAYERS * 576 * 2


@functools.lru_cache(maxsize=None)
def busiest_device_experts(tokens: int, draws: int = 4000, seed: int = 0,
                           balanced: bool = False) -> np.ndarray:
  """Samples of the largest number of distinct experts any one device holds when `tokens`
  tokens each pick TOP_K of EXPERTS (48 whole experts per device). `balanced`: every expert
  split over the 8 devices by width (expert-TP), so each device reads 1/8 of each."""
  rng = np.random.default_rng(seed)
  out = np.empty(draws)
  per = EXPERTS // DEVICES
  for i in range(draws):
    hit = np.unique(np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K])
    out[i] = len(hit) / DEVICES if balanced else np.bincount(hit // per, minlength=DEVICES).max()
  return out


@functools.lru_cache(maxsize=None)
def other_bytes_per_device() -> float:
  """Weights besides the routed experts a step reads on one device: attention, dense and
  shared MLPs and head over 8 (bf16), routers replicated (float32); not the embedding."""
  import jax
  from engine.model.config import config_from_dict
  from engine.model.params import abstract_params, path_str
  cfg = dataclasses.replace(config_from_dict(KIMI_K25_TEXT), int4=INT4)
  total = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
    name = path_str(path)
    if ".experts." in name or name == "embed":
      continue
    nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
    total += nbytes if name.endswith("router") or name.endswith("router_bias") or \
        name.endswith("norm") else nbytes / DEVICES
  return total


def int4_kernel_today_s(experts: np.ndarray, per_sm_gbps: float = 6.0,
                        glue_us: float = 17.0) -> float:
  """Mean seconds per MoE layer of today's W4A16 kernel pair for these expert counts: gate/up
  work items of 64 columns over all 7168 inputs (516 KB), down items of 64 of 7168 columns
  over 2048 inputs (74 KB), one CTA per SM streaming at `per_sm_gbps`."""
  gate_up = np.ceil(experts * (WIDTH // 64) / 132) * 2 * HIDDEN * 64 * 0.5625
  down = np.ceil(experts * (HIDDEN // 64) / 132) * WIDTH * 64 * 0.5625
  return float(np.mean((gate_up + down) / (per_sm_gbps * 1e9))) + glue_us * 1e-6


@dataclasses.dataclass(frozen=True)
class Kernels:
  name: str
  expert_frac: float | None  # of the ceiling; None: today's kernel's rate model
  attention_us: float  # per layer call at 8k context, batch 1 (the floor of a launch-bound call)
  attention_frac: float  # of the ceiling, for the latent cache
  other_frac: float  # XLA's GEMVs and the rest, of the ceiling


def forward_s(k: Kernels, width: int, context: int, overhead_s: float, ceiling: float,
              other: float, balanced: bool = False) -> float:
  crit = busiest_device_experts(width, balanced=balanced)
  if k.expert_frac is None:
    experts = MOE_LAYERS * int4_kernel_today_s(crit)
  else:
    experts = MOE_LAYERS * float(np.mean(crit)) * EXPERT_BYTES / (ceiling * k.expert_frac)
  kv = context * LATENT_BYTES_PER_TOKEN / (ceiling * k.attention_frac)
  attention = max(LAYERS * k.attention_us * 1e-6, kv)
  return other / (ceiling * k.other_frac) + experts + attention + overhead_s


def project(k: Kernels, overheads_ms: list[float], ceiling: float, context: int, tau: float,
            drafts: int, draft_gb: float, draft_overhead_ms: float, balanced: bool = False
            ) -> list[dict]:
  other = other_bytes_per_device()
  rows = []
  for o in overheads_ms:
    step = forward_s(k, 1, context, o * 1e-3, ceiling, other, balanced)
    verify = forward_s(k, drafts + 1, context, o * 1e-3, ceiling, other, balanced)
    draft = draft_gb * 1e9 / (ceiling * k.other_frac) + draft_overhead_ms * 1e-3
    spec = verify + drafts * draft
    rows.append(dict(kernels=k.name, overhead_ms=o, step_ms=step * 1e3, tok_s=1 / step,
                     verify_ms=verify * 1e3, spec_ms=spec * 1e3, spec_tok_s=tau / spec,
                     balanced=balanced))
  return rows


# An EAGLE-3 MLA head for K2.5 (lightseekorg/kimi-k2.5-eagle3-mla: hidden 7168, q_lora 1536,
# kv_lora 512, 64 heads, MLP 18432; it shares the target's embedding): fc 3H -> H, the MLA
# attention on 2H inputs, the MLP, and the lm_head over its draft vocabulary.
HEAD_BODY_PARAMS = (3 * HIDDEN * HIDDEN + 2 * HIDDEN * 1536 + 1536 * 64 * 192
                    + 2 * HIDDEN * 576 + 512 * 64 * 256 + 64 * 128 * HIDDEN + 3 * HIDDEN * 18432)


def head_gb(draft_vocab: int, split: int = DEVICES) -> float:
  """GB (bf16) one EAGLE-3 draft step reads per device: the head's body and its lm_head over
  `draft_vocab` ids, split `split` ways (tensor-parallel as the target's attention)."""
  return (HEAD_BODY_PARAMS + draft_vocab * HIDDEN) * 2 / split / 1e9


def speculators(k: Kernels, overhead_ms: float, ceiling: float, context: int, drafts: int,
                draft_overhead_ms: float) -> list[dict]:
  """Tokens/s per request = accepted length / (verify + K draft steps), per speculator, at
  published acceptance (`tau`: mean accepted length at K = 3, greedy chains)."""
  cases = [("n-gram (prompt lookup / learned)", 1.5, 0.0, 0.0),
           ("n-gram (prompt lookup / learned)", 2.0, 0.0, 0.0),
           ("EAGLE-3 MHA (AQ-MedAI, lightseekorg), 32k draft vocab", 2.7, head_gb(32000), None),
           ("EAGLE-3 MHA (AQ-MedAI, lightseekorg), 32k draft vocab", 3.3, head_gb(32000), None),
           ("EAGLE-3 MLA (lightseekorg), full vocab", 2.9, head_gb(163840), None),
           ("EAGLE-3 MLA (lightseekorg), full vocab", 3.1, head_gb(163840), None),
           ("EAGLE-3 MLA, full vocab, head not split", 3.0, head_gb(163840, 1), None)]
  rows = []
  for name, tau, gb, extra_ms in cases:
    r = project(k, [overhead_ms], ceiling, context, tau, drafts, gb,
                draft_overhead_ms if extra_ms is None else extra_ms)[0]
    rows.append(dict(r, speculator=name, tau=tau, draft_gb=gb,
                     draft_ms=(r["spec_ms"] - r["verify_ms"]) / drafts))
  return rows


TODAY = Kernels("today (measured INT4 rate; MLA est.)", None, 20.0, 0.3, 0.75)
TARGETS = Kernels("issues 52/53 targets", 0.80, 5.0, 0.85, 0.75)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--ceiling_gbps", type=float, default=4300.0,
                 help="H200 copy, torch, read + write (KINDS.md; XLA's x + 1 gave 3,223)")
  p.add_argument("--context", type=int, default=8192)
  p.add_argument("--overhead_ms", type=float, nargs="+", default=[1.5, 3.0, 5.0])
  p.add_argument("--expert_frac", type=float, default=None,
                 help="measured INT4 kernel fraction of the ceiling (adds a 'measured' row)")
  p.add_argument("--attention_us", type=float, default=5.0)
  p.add_argument("--tau", type=float, default=3.0,
                 help="tokens per verify (EAGLE-3 on K2.5: mean accepted length 2.7-3.3)")
  p.add_argument("--drafts", type=int, default=3)
  p.add_argument("--draft_gb", type=float, default=0.41,
                 help="bytes one draft forward reads per device (an MTP-sized layer + head/8)")
  p.add_argument("--draft_overhead_ms", type=float, default=0.15)
  p.add_argument("--speculators", action="store_true",
                 help="tokens/s per speculator at published acceptance (the targets' kernels, "
                      "the first --overhead_ms)")
  a = p.parse_args(argv)
  ceiling = a.ceiling_gbps * 1e9
  if a.speculators:
    print("| kernels | speculator | tokens per verify | draft GB / device | draft ms | "
          "verify ms | ms per verify + K drafts | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for k in (TODAY, TARGETS):
      for r in speculators(k, a.overhead_ms[0], ceiling, a.context, a.drafts,
                           a.draft_overhead_ms):
        print(f"| {k.name} | {r['speculator']} | {r['tau']} | {r['draft_gb']:.2f} | "
              f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['spec_ms']:.2f} | "
              f"{r['spec_tok_s']:.0f} |")
    return
  kinds = [(TODAY, False), (TARGETS, False), (TARGETS, True)]
  if a.expert_frac:
    kinds.append((Kernels("measured", a.expert_frac, a.attention_us, 0.85, 0.75), False))
  print("| kernels | experts | overhead ms | step ms | tok/s | verify ms (T=K+1) | "
        "spec ms | tok/s with speculation |")
  print("|---|---|---|---|---|---|---|---|")
  for k, balanced in kinds:
    for r in project(k, a.overhead_ms, ceiling, a.context, a.tau, a.drafts, a.draft_gb,
                     a.draft_overhead_ms, balanced):
      print(f"| {r['kernels']} | {'width-split' if balanced else 'whole (EP)'} | "
            f"{r['overhead_ms']} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | "
            f"{r['verify_ms']:.2f} | {r['spec_ms']:.2f} | {r['spec_tok_s']:.0f} |")


if __name__ == "__main__":
  main()
