"""DeepSeek's multi-token-prediction layer as a drafter (`mtp`): its entries live in the target's
paged cache as one more layer (after the decoder layers), so prefix caching, preemption and page
freeing cover them. It observes every prefill chunk (`observe_prefill`) and every verified block
(`observe`), keeping each row's MTP hidden state at its newest cached position (the row state,
on the host between calls); `propose` chains the layer on its own output hidden state. Draft j
(1-based) is the token at position n_cached + j. Constrained rows (structured outputs) draft
with it too: the masked step runs its `observe` over each verified block and its `propose`
(`speculative/constrained.py`), so the layer sees every block there as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.transformer import Cache, compute_logits, forward_mtp
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative.acceptance import draft_sample
from engine.runtime.speculative.drafters.base import (Drafter, LoopContext, Proposal,
                                                      propose_when_used)
from engine.runtime.speculative.inplace import run_if


def mtp_observe(params: Params, cache: Cache, hidden: jax.Array, next_tokens: jax.Array,
                start: jax.Array, n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
                impl: KernelChoice) -> tuple[jax.Array, Cache]:
  """Runs the MTP layer over a verified block and keeps its output at the block's last real
  position. hidden [B, T, H] (target, after the final norm); next_tokens [B, T] (token i+1 for
  every position i); start, n_new [B]. Returns (MTP hidden [B, H], cache)."""
  out, cache = forward_mtp(params, cache, hidden, next_tokens, start, n_new, page_table,
                           cfg=cfg, impl=impl)
  last = jnp.maximum(n_new - 1, 0)[:, None, None]
  return jnp.take_along_axis(out, last, axis=1)[:, 0], cache


def mtp_propose(params: Params, cache: Cache, mtp_hidden: jax.Array, n_cached: jax.Array,
                live: jax.Array, page_table: jax.Array, sampling: SamplingArrays, *, k: int,
                cfg: ModelConfig, impl: KernelChoice
                ) -> tuple[jax.Array, jax.Array, Cache]:
  """K drafts from the MTP layer, mtp_hidden [B, H] its output at position n_cached - 1.
  Returns (draft [B, K], q [B, K, V], cache); the chained steps' cache entries (positions
  n_cached .. n_cached + K - 2) are overwritten by the next `mtp_observe`."""
  h = mtp_hidden
  drafts, qs = [], []
  for j in range(1, k + 1):
    if j > 1:
      out, cache = forward_mtp(params, cache, h[:, None], drafts[-1][:, None],
                               n_cached + j - 2, live.astype(jnp.int32), page_table, cfg=cfg,
                               impl=impl)
      h = out[:, 0]
    tok, q = draft_sample(compute_logits(params, h, cfg), sampling, n_cached + j)
    drafts.append(tok)
    qs.append(q)
  return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), cache


@dataclasses.dataclass(frozen=True)
class MtpDrafter(Drafter):
  name = "mtp"
  observes_prefill = True
  needs_every_block = True
  drafts_constrained = True
  refuses_images = ("images: not served by an engine with the mtp drafter (its layer would "
                    "see placeholder ids, not the image)")
  cfg: ModelConfig

  @classmethod
  def unsupported(cls, cfg: ModelConfig, draft_cfg: ModelConfig | None,
                  head_cfg=None) -> str | None:
    if cfg.num_nextn_predict_layers < 1:
      return f"drafter 'mtp' needs an MTP layer: {cfg.no_mtp_reason}"
    return None

  def roofline_cost(self) -> float:
    return 1.0 / max(self.cfg.num_layers, 1)  # one decoder layer of the target's

  def row_width(self) -> int:
    return self.cfg.hidden_size

  def start(self, state: Any, rows: jax.Array, b: int, k_max: int) -> dict:
    return {"hidden": rows}

  def propose(self, ctx: LoopContext, st: dict, cache: Any, k: int
              ) -> tuple[Proposal, dict, Any]:
    proposal, cache = propose_when_used(
        ctx, k, lambda cache: mtp_propose(ctx.params, cache, st["hidden"], ctx.n_cached,
                                          ctx.live, ctx.page_table, ctx.sampling, k=k,
                                          cfg=self.cfg, impl=ctx.impl),
        cache)
    return proposal, st, cache

  def observe(self, ctx: LoopContext, st: dict, cache: Any, v: Any, k: int
              ) -> tuple[dict, Any]:
    """The layer sees every verified block, so its cache entries cover every position."""
    live = ctx.live

    def observe(s):
      h, c = mtp_observe(ctx.params, s[1], v.hidden, v.emitted, ctx.n_cached,
                         (v.n_accepted + 1) * live.astype(jnp.int32), ctx.page_table,
                         cfg=self.cfg, impl=ctx.impl)
      return jnp.where(live[:, None], h.astype(s[0].dtype), s[0]), c

    hidden, cache = run_if(jnp.any(ctx.fed), observe, (st["hidden"], cache))
    return {"hidden": hidden}, cache

  def finish(self, ctx: LoopContext, st: dict) -> tuple[None, jax.Array]:
    return None, st["hidden"]

  def observe_prefill(self, params, cache, hidden, next_tokens, start, n_new, page_table, *,
                      impl, own_params=None, aux=None):
    h, cache = mtp_observe(params, cache, hidden, next_tokens, start, n_new, page_table,
                           cfg=self.cfg, impl=impl)
    return h.astype(jnp.float32), cache
