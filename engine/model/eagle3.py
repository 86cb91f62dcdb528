"""An EAGLE-3 head's forward pass, as pure functions of its params pytree (`eagle3_loader`).

Read top to bottom: `combine_aux` runs `fc` (after EAGLE-3.1's per-state `fc_norm`) over the
target's aux hidden states; `draft_step` runs the head's one decoder layer over a block of
tokens and returns draft-vocabulary logits and the carry the next chained step takes;
`draft_token_ids` maps top-1 draft ids to target ids; `draft_chain` is the first pass plus
chained steps, top-1 all the way, as a speculative loop runs it.

The composition is vLLM's and SGLang's (`deepseek_eagle3.py`, `llama_eagle3.py`):

    res, g = g, hidden_norm(g)               # norm_before_residual: res = g = hidden_norm(g)
    x      = [input_layernorm(embed(tok)), g] # 2H: the attention's first projections take 2H
    h      = res + attn(x)                    # MLA or MHA, causal, the head's own RoPE
    h      = h + mlp(post_attn_norm(h))       # dense SwiGLU
    logits = lm_head(final_norm(h))           # draft vocabulary, float32
    carry  = final_norm(h) if norm_output else h

A first pass takes, at every newly verified position t, g = combine_aux(aux[t]) and the token at
t + 1 (the input ids shifted left by one; the last slot is the token the target just sampled),
at RoPE position t. A chained step takes one token per row, the previous draft, with the
previous step's carry, one position further.

The attention is the target's module of the head's kind (`modules.MLAAttention` /
`GQAAttention` over the head's `attn` params, whose first projections take 2H inputs). KV: it
writes the block's entries into a page pool and reads it through a page table, as
`pallas_kernels/attention/reference.py` defines them (via `engine.model.kernels`, so a kernel
choice applies): the MLA head's pool is {"latent": [N, P, kv_lora_rank + qk_rope_head_dim]}, one
more layer of the target's cache (same width, same page ids); the MHA head's is {"k", "v":
[N, P, nKV, hd]}, arrays of its own indexed by the target's page ids and page table
(`init_pool`). Padding (t >= n_new) writes nothing; positions written by drafts that the target
rejects are overwritten by the next first pass, and nothing past a row's length is ever read.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from engine.model.eagle3_config import Eagle3Config
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.modules import attention_module
from engine.model.params import Params
from engine.model.transformer import _Ctx, rms_norm
from pallas_kernels.moe.reference import swiglu_mlp

Pool = dict[str, jax.Array]


# ---- the KV pool -----------------------------------------------------------------------------

def pool_shapes(cfg: Eagle3Config, num_pages: int, page_size: int) -> dict[str, tuple[int, ...]]:
  """The head's page arrays: MLA {"latent"} (the target's layer shape), MHA {"k", "v"}."""
  lc = cfg.layer
  if cfg.is_mla:
    return {"latent": (num_pages, page_size, lc.latent_dim)}
  kv = (num_pages, page_size, lc.num_kv_heads, lc.head_dim)
  return {"k": kv, "v": kv}


def init_pool(cfg: Eagle3Config, num_pages: int, page_size: int,
              dtype: Any = jnp.bfloat16) -> Pool:
  """A zeroed pool with the target's page count and size (the MLA head's is a target layer's)."""
  return {k: jnp.zeros(s, dtype) for k, s in pool_shapes(cfg, num_pages, page_size).items()}


# ---- the head --------------------------------------------------------------------------------

def combine_aux(params: Params, aux: jax.Array, cfg: Eagle3Config) -> jax.Array:
  """aux [B, T, num_aux * Ht] (the target's residual streams entering `cfg.aux_layers`,
  concatenated in that order) -> g [B, T, H]: fc, after EAGLE-3.1's fc_norm per state."""
  if cfg.fc_norm:
    chunks = jnp.split(aux, cfg.num_aux, axis=-1)
    aux = jnp.concatenate([rms_norm(c, params["fc_norm"][i], cfg.layer.rms_norm_eps)
                           for i, c in enumerate(chunks)], axis=-1)
  return aux.astype(params["fc"].dtype) @ params["fc"]


def head_logits(params: Params, out: jax.Array, cfg: Eagle3Config) -> jax.Array:
  """Post-norm hidden [..., H] -> float32 draft-vocabulary logits [..., Vd]."""
  if cfg.tie_word_embeddings:
    return jnp.einsum("...h,vh->...v", out, params["embed"], preferred_element_type=jnp.float32)
  return jnp.einsum("...h,hv->...v", out, params["lm_head"], preferred_element_type=jnp.float32)


def carry_logits(params: Params, carry: jax.Array, cfg: Eagle3Config) -> jax.Array:
  """Draft-vocabulary logits of a step whose chained-step carry is `carry` [..., H]."""
  out = carry.astype(params["final_norm"].dtype)
  if not cfg.norm_output:  # (the carry is the pre-norm output)
    out = rms_norm(out, params["final_norm"], cfg.layer.rms_norm_eps)
  return head_logits(params, out, cfg)


def draft_step(params: Params, pool: Pool, hidden: jax.Array, tokens: jax.Array,
               start: jax.Array, n_new: jax.Array, page_table: jax.Array, *,
               cfg: Eagle3Config, impl: KernelChoice = REFERENCE
               ) -> tuple[jax.Array, jax.Array, Pool]:
  """One pass of the head's layer over a block of tokens.

  Args:
    params: the head's pytree (`eagle3_loader`).
    pool: the head's KV pages (`init_pool`; for the MLA head, its layer of the target's cache).
    hidden: [B, T, H] g: `combine_aux` of the aux states (a first pass) or the previous step's
      carry (a chained step).
    tokens: [B, T] target-vocabulary ids: at position t, the token at t + 1.
    start, n_new, page_table: as the target's `forward`: row b's tokens sit at positions
      start[b] + t, the first n_new[b] real (the rest write nothing).
  Returns:
    (float32 logits [B, T, Vd], carry [B, T, H] for the next chained step, updated pool).
  """
  lc = cfg.layer
  eps = lc.rms_norm_eps
  ctx = _Ctx(start, n_new, tokens.shape[1], page_table)
  emb = params["embed"][tokens]
  g = hidden.astype(emb.dtype)
  if cfg.norm_before_residual:
    g = rms_norm(g, params["hidden_norm"], eps)
    residual = g
  else:
    residual, g = g, rms_norm(g, params["hidden_norm"], eps)
  x = jnp.concatenate([rms_norm(emb, params["input_norm"], eps), g], axis=-1)
  # The target's attention module of the head's kind, its first projections taking 2H inputs.
  a, pool = attention_module(lc, params["attn"])(x, pool, ctx, impl)
  h = residual + a
  m = params["mlp"]
  h = h + swiglu_mlp(rms_norm(h, params["post_attn_norm"], eps), m["gate"], m["up"], m["down"])
  out = rms_norm(h, params["final_norm"], eps)
  return head_logits(params, out, cfg), (out if cfg.norm_output else h), pool


def draft_token_ids(params: Params, logits: jax.Array) -> jax.Array:
  """Top-1 of draft-vocabulary logits [..., Vd] as int32 target ids (through d2t when the
  vocabulary is reduced)."""
  ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if "draft_to_target" in params:
    ids = params["draft_to_target"][ids]
  return ids


def target_vocab_logits(params: Params, logits: jax.Array, cfg: Eagle3Config) -> jax.Array:
  """Draft logits [..., Vd] spread over the target vocabulary [..., V], -inf outside the draft
  vocabulary (vLLM's `compute_logits`): what a probabilistic verifier takes as q."""
  if "draft_to_target" not in params:
    return logits
  full = jnp.full(logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, logits.dtype)
  return full.at[..., params["draft_to_target"]].set(logits)


@functools.partial(jax.jit, static_argnames=("cfg", "num_drafts", "impl"),
                   donate_argnames=("pool",))
def draft_chain(params: Params, pool: Pool, aux: jax.Array, tokens: jax.Array,
                start: jax.Array, n_new: jax.Array, page_table: jax.Array, *,
                cfg: Eagle3Config, num_drafts: int, impl: KernelChoice = REFERENCE
                ) -> tuple[jax.Array, jax.Array, jax.Array, Pool]:
  """The first pass over a block of newly verified positions, then num_drafts - 1 chained
  steps from each row's last real position, top-1: the drafting of one speculative step.

  Args:
    aux: [B, T, num_aux * Ht] the target's residual streams at the block's positions.
    tokens: [B, T] the next token at each position (the last real slot: the token the target
      just sampled); start, n_new, page_table as in `draft_step` (n_new[b] = 0: an idle row,
      which writes nothing).
  Returns:
    (first-pass logits [B, T, Vd], chained logits [B, num_drafts - 1, Vd], draft target ids
    [B, num_drafts], updated pool). Row b's last slot is the token at position start + n_new,
    its drafts the tokens at start + n_new + 1 .. start + n_new + num_drafts; the chained steps
    write the head's KV at positions start + n_new .. start + n_new + num_drafts - 2.
  """
  first, carry, pool = draft_step(params, pool, combine_aux(params, aux, cfg), tokens, start,
                                  n_new, page_table, cfg=cfg, impl=impl)
  last = jnp.maximum(n_new - 1, 0)
  rows = jnp.arange(tokens.shape[0])
  draft = draft_token_ids(params, first[rows, last])  # [B]
  carry = carry[rows, last][:, None]  # [B, 1, H]
  live = (n_new > 0).astype(n_new.dtype)

  def chained(state, j):
    pool, carry, draft = state
    logits, carry, pool = draft_step(params, pool, carry, draft[:, None], start + n_new + j,
                                     live, page_table, cfg=cfg, impl=impl)
    draft = draft_token_ids(params, logits[:, 0])
    return (pool, carry, draft), (logits[:, 0], draft)

  (pool, _, _), (chain, drafts) = jax.lax.scan(
      chained, (pool, carry, draft), jnp.arange(num_drafts - 1, dtype=start.dtype))
  drafts = jnp.concatenate([draft[:, None], jnp.moveaxis(drafts, 0, 1)], axis=1)
  return first, jnp.moveaxis(chain, 0, 1), drafts, pool
