"""Model drafters for constrained rows (structured outputs): drafts proposed on the device, checked
against the grammar on the host, as vLLM runs EAGLE with structured outputs.

A drafter with `Drafter.drafts_constrained` (MTP, EAGLE-3) keeps its row state current in the
masked step (`steps.masked_step`), which runs, after verifying each constrained row's block
`[newest, d_1 .. d_k]`:

1. the drafter's `observe` over the verified positions (the MTP layer over the target's final
   hidden states there, the EAGLE-3 head's first pass over its residual streams, each with the
   emitted tokens), so its cache entries cover every position and its row state sits at the
   row's new newest cached position, as after the speculative loop;
2. its `propose` from there: a top-1 chain of K drafts (greedy whatever the row's temperature:
   the masked step verifies drafts against the target's own (seed, position) samples, so any
   draft is lossless and the top-1 one is the likeliest to match).

The drafts go back to the host with the position they start after (`RequestSpec.proposed`); the
next step's `structured.prepare` cuts them at the first token the grammar forbids and computes
the bitmask at every position along them, and the masked step verifies them under the masks.
A row's first masked step after prefill has no drafts yet (nothing proposed them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.transformer import Cache
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative.drafters import Drafter, LoopContext, drafter_id


@dataclasses.dataclass(frozen=True)
class Block:
  """A masked step's verified block (B rows): what a drafter's `observe` reads of the loop's
  `loop.Verified` (padding rows: n_accepted 0)."""
  hidden: jax.Array  # [B, T, H] the target's final hidden states over [newest, d_1 .. d_k]
  aux: dict[int, jax.Array]  # {layer: [B, T, H]} residual streams entering `aux_layers`
  n_accepted: jax.Array  # [B]
  extra: jax.Array  # [B] the token after the accepted drafts (the row's new newest token)
  emitted: jax.Array  # [B, T] d_1 .. d_a, extra, then don't-care (never negative)


def observe_and_propose(drafters: Sequence[Drafter], block: Block, *, params: Params,
                        own_params: dict[str, Any], cache: Cache, rows: dict[str, jax.Array],
                        tokens: jax.Array, start: jax.Array, live: jax.Array,
                        drafting: jax.Array, page_table: jax.Array, sampling: SamplingArrays,
                        k: int, cfg: ModelConfig, impl: KernelChoice
                        ) -> tuple[dict[str, jax.Array], jax.Array, Cache]:
  """Steps 1 and 2 of the module docstring for every drafter in `drafters`.

  tokens [B, T] the block (newest first), start [B] its position; live [B] bool: real rows
  (padding rows write nothing); drafting [B] int32: each row's drafter id (`drafter_id`; 0:
  none). Returns (each drafter's rows' state {name: [B, width]}, drafts [B, k] (each row its
  own drafter's; zeros where it has none), cache)."""
  b = tokens.shape[0]
  live_i = live.astype(jnp.int32)
  # (host zeros: `draft_sample` traces only the argmax)
  greedy = dataclasses.replace(sampling, temperature=np.zeros((b,), np.float32))
  new_rows, drafts = {}, jnp.zeros((b, k), jnp.int32)
  for d in drafters:
    before = LoopContext(params=params, own_params=own_params.get(d.name), cfg=cfg, impl=impl,
                         page_table=page_table, sampling=greedy, tok=tokens[:, 0],
                         n_cached=start, live=live, history=None, history_len=None,
                         uses=drafting == drafter_id(d.name), fed=live, k_max=k)
    st = d.start(None, rows[d.name], b, k)
    st, cache = d.observe(before, st, cache, block, tokens.shape[1] - 1)
    after = dataclasses.replace(before, tok=block.extra,
                                n_cached=start + (block.n_accepted + 1) * live_i)
    proposal, st, cache = d.propose(after, st, cache, k)
    drafts = jnp.where(after.uses[:, None], proposal.tokens, drafts)
    _, new_rows[d.name] = d.finish(after, st)
  return new_rows, drafts, cache
