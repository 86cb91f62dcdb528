"""An EAGLE-3 head as a drafter (`eagle3`; the head: `engine.model.eagle3`, loaded by
`eagle3_loader.load_eagle3`).

Like the MTP layer it observes every prefill chunk (`observe_prefill`) and every verified block
(`observe`): the head's first pass runs `fc` over the target's residual streams entering the
head's aux layers (`aux_layers`: the verify forward and the mixed step return them,
`forward_hidden_states`) at each newly verified position t, with the token at t + 1, and keeps
its output (the carry) at the row's newest cached position as the row state, on the host
between calls. `propose` drafts a top-1 chain (greedy rows; sampled rows draw from the head's
distribution, verified by the rejection rule as the other model drafters): draft 1 from the
carry, then chained steps, each feeding the previous draft and the previous carry one position
further. Draft j (1-based) is the token at position n_cached + j.

KV: the head's pool is one more entry of the target's paged cache (`cache_entries`; the MLA
head's has a target MLA layer's shape, the MHA head's its own K / V arrays), so it shares the
target's page ids and page table, and prefix caching, preemption and page freeing cover it (on a
mesh, sharded as a target layer of its kind: `cache_shardings`, `sharding.shard_head`). The
chained steps' entries (positions n_cached .. n_cached + K - 2) are overwritten by the next
first pass; nothing past a row's length is read.

Images: at `<|media_pad|>` positions the head takes the plain token embedding of the pad id (its
aux states carry the image, as the target saw it), as vLLM and SGLang run EAGLE-3 heads on
multimodal targets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from engine.model import eagle3
from engine.model.cache import first_extra_entry
from engine.model.config import ModelConfig
from engine.model.eagle3_config import Eagle3Config
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.sharding import cache_sharding
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative.acceptance import draft_sample
from engine.runtime.speculative.drafters.base import (Drafter, LoopContext, Proposal,
                                                      propose_when_used)
from engine.runtime.speculative.inplace import run_if


def eagle3_observe(params: Params, pool: eagle3.Pool, aux: jax.Array, next_tokens: jax.Array,
                   start: jax.Array, n_new: jax.Array, page_table: jax.Array, *,
                   cfg: Eagle3Config, impl: KernelChoice) -> tuple[jax.Array, eagle3.Pool]:
  """The head's first pass over a block of verified positions: aux [B, T, n_aux * Ht] (the
  target's residual streams there), next_tokens [B, T] (token t + 1 at position t). Returns
  (its carry at each row's last real position [B, H], pool)."""
  _, carry, pool = eagle3.draft_step(params, pool, eagle3.combine_aux(params, aux, cfg),
                                     next_tokens, start, n_new, page_table, cfg=cfg, impl=impl)
  last = jnp.maximum(n_new - 1, 0)[:, None, None]
  return jnp.take_along_axis(carry, last, axis=1)[:, 0], pool


def eagle3_propose(params: Params, pool: eagle3.Pool, carry: jax.Array, n_cached: jax.Array,
                   live: jax.Array, page_table: jax.Array, sampling: SamplingArrays, *, k: int,
                   cfg: Eagle3Config, impl: KernelChoice
                   ) -> tuple[jax.Array, jax.Array, eagle3.Pool]:
  """K drafts from the head's carry [B, H] at position n_cached - 1. Returns (draft [B, K] in
  target ids, q [B, K, V] over the target vocabulary, pool)."""
  h = carry
  logits = eagle3.carry_logits(params, h, cfg)
  drafts, qs = [], []
  for j in range(1, k + 1):
    if j > 1:
      step_logits, out, pool = eagle3.draft_step(
          params, pool, h[:, None], drafts[-1][:, None], n_cached + j - 2,
          live.astype(jnp.int32), page_table, cfg=cfg, impl=impl)
      logits, h = step_logits[:, 0], out[:, 0]
    tok, q = draft_sample(eagle3.target_vocab_logits(params, logits, cfg), sampling,
                          n_cached + j)
    drafts.append(tok)
    qs.append(q)
  return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), pool


def _aux(states: dict[int, jax.Array], layers: tuple[int, ...]) -> jax.Array:
  """The residual streams entering `layers`, concatenated in that order: [B, T, n * H]."""
  return jnp.concatenate([states[i] for i in layers], axis=-1)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(Drafter):
  name = "eagle3"
  observes_prefill = True
  needs_every_block = True
  uses_head = True
  drafts_constrained = True
  cfg: ModelConfig
  head: Eagle3Config | None = None
  entry: int = 0  # its cache entry (the first after the model's own)
  aux_layers: tuple[int, ...] = ()

  @classmethod
  def create(cls, cfg, config, draft_cfg, head_cfg=None) -> "Eagle3Drafter":
    return cls(cfg=cfg, head=head_cfg, entry=first_extra_entry(cfg),
               aux_layers=tuple(head_cfg.aux_layers))

  @classmethod
  def unsupported(cls, cfg: ModelConfig, draft_cfg: ModelConfig | None,
                  head_cfg: Eagle3Config | None = None) -> str | None:
    if head_cfg is None:
      return ("drafter 'eagle3' needs an EAGLE-3 head (--eagle3_checkpoint, "
              "SpeculativeConfig('eagle3', checkpoint=), Engine(head=))")
    if head_cfg.vocab_size != cfg.vocab_size:
      return (f"EAGLE-3 head: vocab_size {head_cfg.vocab_size} differs from the target's "
              f"{cfg.vocab_size}")
    if head_cfg.target_hidden_size != cfg.hidden_size:
      return (f"EAGLE-3 head: target hidden size {head_cfg.target_hidden_size} differs from "
              f"the target's hidden_size {cfg.hidden_size}")
    if max(head_cfg.aux_layers) > cfg.num_layers:
      return (f"EAGLE-3 head: aux layers {list(head_cfg.aux_layers)} outside the target's "
              f"{cfg.num_layers} layers")
    return None

  def roofline_cost(self) -> float:
    return 1.0 / max(self.cfg.num_layers, 1)  # about one decoder layer of the target's

  def row_width(self) -> int:
    return self.head.hidden_size

  def cache_entries(self) -> tuple[dict[str, tuple[int, ...]], ...]:
    return ({n: s[2:] for n, s in eagle3.pool_shapes(self.head, 1, 1).items()},)

  def cache_shardings(self, mesh: Any) -> tuple[dict[str, Any], ...]:
    """As a target layer of the head's kind: the MLA latent replicated, MHA K/V split by KV
    head over `tensor` (`sharding.cache_sharding`)."""
    return (cache_sharding(self.head.layer, mesh),)

  def start(self, state: Any, rows: jax.Array, b: int, k_max: int) -> dict:
    return {"hidden": rows}

  def propose(self, ctx: LoopContext, st: dict, cache: Any, k: int
              ) -> tuple[Proposal, dict, Any]:
    proposal, pool = propose_when_used(
        ctx, k, lambda pool: eagle3_propose(ctx.own_params, pool, st["hidden"], ctx.n_cached,
                                            ctx.live, ctx.page_table, ctx.sampling, k=k,
                                            cfg=self.head, impl=ctx.impl),
        cache[self.entry])
    cache = list(cache)
    cache[self.entry] = pool
    return proposal, st, cache

  def observe(self, ctx: LoopContext, st: dict, cache: Any, v: Any, k: int
              ) -> tuple[dict, Any]:
    """The head sees every verified block, so its KV covers every position."""
    live = ctx.live
    aux = _aux(v.aux, self.aux_layers)

    def observe(s):
      h, pool = eagle3_observe(ctx.own_params, s[1], aux, v.emitted, ctx.n_cached,
                               (v.n_accepted + 1) * live.astype(jnp.int32), ctx.page_table,
                               cfg=self.head, impl=ctx.impl)
      return jnp.where(live[:, None], h.astype(s[0].dtype), s[0]), pool

    hidden, pool = run_if(jnp.any(ctx.fed), observe, (st["hidden"], cache[self.entry]))
    cache = list(cache)
    cache[self.entry] = pool
    return {"hidden": hidden}, cache

  def finish(self, ctx: LoopContext, st: dict) -> tuple[None, jax.Array]:
    return None, st["hidden"]

  def observe_prefill(self, params, cache, hidden, next_tokens, start, n_new, page_table, *,
                      impl, own_params=None, aux=None):
    h, pool = eagle3_observe(own_params, cache[self.entry], aux, next_tokens, start, n_new,
                             page_table, cfg=self.head, impl=impl)
    cache = list(cache)
    cache[self.entry] = pool
    return h.astype(jnp.float32), cache
