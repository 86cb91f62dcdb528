"""The decoder forward pass, written as pure functions of a parameter pytree.

Read top to bottom: `forward` embeds tokens, runs every layer (attention writes its new cache
entries, then reads the paged cache; then a dense MLP or a MoE), normalises and returns hidden
states; `compute_logits` applies the LM head.

The layers run stack by stack (`cfg.layer_stacks`: runs of identical layers, their parameters
and pages stacked on a leading layer axis), each stack as one `lax.scan` whose body is one
decoder layer, so the program XLA compiles has one layer body per stack however deep the model
(`scan_layers=False`: one call per layer, the unrolled reference). No layer's pages or routed
experts are sliced out for the scan: the body reaches its pages in the stack's pool through a
shifted page table (`_run_stack`), hands the MoE kernels the stacked experts with the layer
index, and indexes its other parameters at its layer. `forward_hidden_states` splits the scans
at given layers to return the residual stream entering them.

One call processes a block of T new tokens per sequence: row b's tokens sit at positions
`start[b] .. start[b] + T - 1`, of which the first `n_new[b]` are real (the rest are padding and
write nothing). Prefill is `start = 0, n_new = prompt length`; decode is `T = 1`; speculative
verification is `T = k + 1`. The cache is paged (see `engine.model.cache`); which pages a row
owns is its row of `page_table`.

MLA (DeepSeek-V2/V3, Kimi) always runs in the absorbed form: the cache holds, per token and
layer, the normalised latent `c_kv` (kv_lora_rank) and the rotated rope key (qk_rope_head_dim);
queries are absorbed into the latent space with W_UK and the latent context is expanded with
W_UV. Per-head K/V are never materialised.
"""

from __future__ import annotations

import copy
import functools
from typing import Any
import jax
import jax.numpy as jnp

from engine.model import kernels
from engine.model.cache import Cache, layer_table, mtp_entry
from engine.model.config import ModelConfig
from engine.model.expert_parallel import (replicated_features, routed_experts,
                                          split_batch_over_data)
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.rope import apply_rope, rope_cos_sin
from pallas_kernels.moe.reference import swiglu_mlp
from pallas_kernels.quant import dequantize, is_quantized

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, returned in x's dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * xf).astype(x.dtype)


# ---- attention -------------------------------------------------------------------------------

def _weights(p: Params, dtype) -> Params:
  """The attention's parameters with FP8 linears kept quantized dequantized to `dtype`."""
  return {k: dequantize(v, dtype) if is_quantized(v) else v for k, v in p.items()}


def mla_attention(p: Params, x: jax.Array, layer_cache: dict[str, jax.Array], ctx: "_Ctx",
                  cfg: ModelConfig, impl: KernelChoice) -> tuple[jax.Array, dict[str, jax.Array]]:
  """x [B, T, H] -> ([B, T, H], updated pool). layer_cache: a page pool {"latent": [N, P, D]}
  holding this layer's pages where `ctx.page_table` points."""
  p = _weights(p, x.dtype)
  dn, dc = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  if cfg.q_lora_rank is None:
    q = jnp.einsum("bth,hnd->btnd", x, p["q"])
  else:
    q_a = rms_norm(replicated_features(x @ p["q_a"]), p["q_a_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btr,rnd->btnd", q_a, p["q_b"])
  q_nope, q_rope = q[..., :dn], q[..., dn:]

  kv = replicated_features(x @ p["kv_a"])  # [B, T, Dc + Dr] (columns split over tensor)
  c_kv = rms_norm(kv[..., :dc], p["kv_a_norm"], cfg.rms_norm_eps)
  cos, sin = ctx.cos_sin(cfg)
  k_rope = apply_rope(kv[..., dc:], cos, sin, cfg.rope.interleave)
  q_rope = apply_rope(q_rope, cos, sin, cfg.rope.interleave)

  latent = jnp.concatenate([c_kv, k_rope], axis=-1)
  pages = kernels.write_pages(impl)(layer_cache["latent"], ctx.page_table, ctx.positions,
                                    ctx.valid, latent)

  w_uk, w_uv = p["kv_b"][..., :dn], p["kv_b"][..., dn:]  # [Dc, nH, dn], [Dc, nH, dv]
  q_latent = jnp.einsum("btnd,cnd->btnc", q_nope, w_uk)
  ctx_latent = kernels.mla_attention(impl)(
      q_latent, q_rope, pages, ctx.page_table, ctx.positions, ctx.kv_lens,
      softmax_scale=cfg.softmax_scale)
  out = jnp.einsum("btnc,cnv->btnv", ctx_latent, w_uv)
  return jnp.einsum("btnv,nvh->bth", out, p["o"]), {"latent": pages}


def gqa_attention(p: Params, x: jax.Array, layer_cache: dict[str, jax.Array], ctx: "_Ctx",
                  cfg: ModelConfig, impl: KernelChoice) -> tuple[jax.Array, dict[str, jax.Array]]:
  """x [B, T, H] -> ([B, T, H], updated pool). layer_cache: a page pool {"k", "v": [N, P, nKV,
  hd]} holding this layer's pages where `ctx.page_table` points."""
  q = jnp.einsum("bth,hnd->btnd", x, p["q"])
  k = jnp.einsum("bth,hnd->btnd", x, p["k"])
  v = jnp.einsum("bth,hnd->btnd", x, p["v"])
  if cfg.attention_bias:
    q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  cos, sin = ctx.cos_sin(cfg)
  q = apply_rope(q, cos, sin, cfg.rope.interleave)
  k = apply_rope(k, cos, sin, cfg.rope.interleave)

  write = kernels.write_pages(impl)
  k_pages = write(layer_cache["k"], ctx.page_table, ctx.positions, ctx.valid, k)
  v_pages = write(layer_cache["v"], ctx.page_table, ctx.positions, ctx.valid, v)
  out = kernels.gqa_attention(impl)(q, k_pages, v_pages, ctx.page_table, ctx.positions,
                                    ctx.kv_lens, softmax_scale=cfg.qk_head_dim ** -0.5)
  out = jnp.einsum("btnd,ndh->bth", out, p["o"])
  if cfg.attention_bias:
    out = out + p["o_bias"]
  return out, {"k": k_pages, "v": v_pages}


# ---- feed-forward ----------------------------------------------------------------------------

def moe(p: Params, x: jax.Array, cfg: ModelConfig, impl: KernelChoice,
        ctx: "_Ctx | None" = None, layer: Any = None) -> jax.Array:
  """Routed experts plus shared experts. x [B, T, H] -> [B, T, H].

  p["experts"] is one layer's, or with `layer` a stack's (the kernels read layer `layer` in
  place: `kernels.moe_experts`)."""
  return _moe(p, x, cfg, impl, ctx, layer)[0]


def _moe(p: Params, x: jax.Array, cfg: ModelConfig, impl: KernelChoice, ctx: "_Ctx | None",
         layer: Any) -> tuple[jax.Array, jax.Array | None]:
  """`moe`, also returning [E] int32 tokens each expert received (real tokens only) when
  `ctx.collect_router_counts`, else None."""
  b, t, h = x.shape
  xf = x.reshape(b * t, h)
  router_logits = xf.astype(jnp.float32) @ p["router"]
  weights, ids = kernels.route(impl)(
      router_logits, p.get("router_bias"), scoring_func=cfg.scoring_func,
      topk_method=cfg.topk_method, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
      topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
      routed_scaling_factor=cfg.routed_scaling_factor)
  counts = None
  if ctx is not None and ctx.collect_router_counts:  # off on the serving path
    real = ctx.valid.reshape(-1, 1).astype(jnp.int32)
    onehot = (ids[:, :, None] == jnp.arange(cfg.num_experts)[None, None, :]) * real[:, :, None]
    counts = jnp.sum(onehot, axis=(0, 1))
  if ctx is not None:
    # Padding tokens (packed rows, idle rows) go to no expert: an id outside every shard
    # contributes zero, so a decode step streams only the experts real tokens chose.
    ids = jnp.where(ctx.valid.reshape(-1, 1), ids, -1)
  y = routed_experts(impl, xf, weights, ids, p["experts"], layer=layer)
  if "shared" in p:
    s = p["shared"]
    y = y + swiglu_mlp(xf, s["gate"], s["up"], s["down"])
  return y.reshape(b, t, h), counts


def decoder_layer(p: Params, x: jax.Array, pool: dict[str, jax.Array], ctx: "_Ctx",
                  cfg: ModelConfig, impl: KernelChoice, experts_layer: Any = None
                  ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
  """One decoder layer. pool: the page pool its attention reads and writes through
  `ctx.page_table`; experts_layer: with stacked routed experts, which layer of the stack.
  Returns (x, updated pool, [E] router counts or None)."""
  attend = mla_attention if cfg.is_mla else gqa_attention
  a, pool = attend(p["attn"], rms_norm(x, p["input_norm"], cfg.rms_norm_eps), pool, ctx, cfg,
                   impl)
  x = x + a
  hn = rms_norm(x, p["post_attn_norm"], cfg.rms_norm_eps)
  counts = None
  if "moe" in p:
    f, counts = _moe(p["moe"], hn, cfg, impl, ctx, experts_layer)
  else:
    f = swiglu_mlp(hn, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"])
  return x + f, pool, counts


# ---- the layer stacks ------------------------------------------------------------------------

# Layers per iteration of a stack's scan (`lax.scan`'s unroll). Measured on the CPU (BENCHMARKS,
# issue 49): 2 gained nothing in step time and doubles the body XLA compiles.
SCAN_UNROLL = 1


def _layer_view(stack: Params, j: Any) -> Params:
  """Layer j's parameters out of a stack: every leaf at position j, except the routed experts,
  which stay stacked (the MoE kernels read layer j in place: `experts_layer`)."""
  view = jax.tree.map(lambda w: w[j], {k: v for k, v in stack.items() if k != "moe"})
  if "moe" in stack:
    rest = {k: v for k, v in stack["moe"].items() if k != "experts"}
    view["moe"] = dict(jax.tree.map(lambda w: w[j], rest), experts=stack["moe"]["experts"])
  return view


def _run_stack(stack: Params, entry: dict[str, jax.Array], num_pages: int, x: jax.Array,
               ctx: "_Ctx", cfg: ModelConfig, impl: KernelChoice, first: int, last: int,
               scan: bool) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
  """Layers first..last-1 of a stack (positions in it) over x, as one `lax.scan` (or one call
  per layer when not `scan`, or for one layer).

  The stack's pages (`entry`, its layers' pools end to end, `num_pages` each) ride in the
  scan's carry; layer j reaches its own through the page table shifted by j * num_pages, and
  its parameters are indexed at j inside the body: neither is sliced out of its stack and
  copied per layer (the writes are in-place scatters into the donated cache). Returns (x,
  updated entry, [last - first, E] router counts or None)."""

  def layer(carry, j):
    x, entry = carry
    lctx = ctx.with_page_table(layer_table(ctx.page_table, j, num_pages))
    # (an array even for a static j: kernels behind `_jit_per_static_kwargs` then share one
    # lowering across the layers of an unrolled stack)
    x, entry, counts = decoder_layer(_layer_view(stack, j), x, entry, lctx, cfg, impl,
                                     experts_layer=jnp.asarray(j, jnp.int32))
    return (x, entry), counts

  if scan and last - first > 1:
    (x, entry), counts = jax.lax.scan(layer, (x, entry),
                                      jnp.arange(first, last, dtype=jnp.int32),
                                      unroll=SCAN_UNROLL)
    return x, entry, counts
  per_layer = []
  for j in range(first, last):
    (x, entry), c = layer((x, entry), j)
    per_layer.append(c)
  return x, entry, None if per_layer[0] is None else jnp.stack(per_layer)


# ---- the model -------------------------------------------------------------------------------

class _Ctx:
  """Per-call positional bookkeeping shared by all layers."""

  def __init__(self, start: jax.Array, n_new: jax.Array, t: int, page_table: jax.Array,
               collect_router_counts: bool = False):
    offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
    self.positions = start[:, None].astype(jnp.int32) + offsets  # [B, T]
    self.valid = offsets < n_new[:, None]  # [B, T]
    self.kv_lens = (start + n_new).astype(jnp.int32)  # [B]
    self.page_table = page_table
    self.collect_router_counts = collect_router_counts
    self._cos_sin = None

  def with_page_table(self, page_table: jax.Array) -> "_Ctx":
    """The same bookkeeping reading pages through another table (a layer of a stacked pool)."""
    other = copy.copy(self)
    other.page_table = page_table
    return other

  def cos_sin(self, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    if self._cos_sin is None:
      self._cos_sin = rope_cos_sin(cfg.rope, cfg.rope_dim, self.positions)
    return self._cos_sin


def embed_tokens(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
  """tokens [B, T] -> the token table's rows [B, T, H] (what `forward` embeds by default)."""
  del cfg  # one table for every family; kept so callers need not know
  return params["embed"][tokens]


def scatter_image_features(embeds: jax.Array, tokens: jax.Array, features: jax.Array,
                           pad_id: int) -> jax.Array:
  """embeds [B, T, H] with the positions where `tokens == pad_id` (<|media_pad|>) replaced by
  the rows of `features` [N, H], in row-major order (row 0's slots first). N must equal the
  number of such slots: the caller checks (inside a program, missing rows repeat the last)."""
  mask = tokens == pad_id
  order = jnp.cumsum(mask.reshape(-1)) - 1
  rows = features[jnp.clip(order, 0, features.shape[0] - 1)].reshape(embeds.shape)
  return jnp.where(mask[..., None], rows.astype(embeds.dtype), embeds)


def forward(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
            n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
            impl: KernelChoice = REFERENCE, input_embeds: jax.Array | None = None,
            scan_layers: bool = True) -> tuple[jax.Array, Cache]:
  """Runs the decoder over a block of new tokens: `forward_counting_experts` without the counts.
  Returns (hidden [B, T, H] after the final norm, updated cache)."""
  hidden, cache, _, _ = _forward(params, cache, tokens, start, n_new, page_table, cfg=cfg,
                                 impl=impl, router_counts=False, input_embeds=input_embeds,
                                 scan_layers=scan_layers)
  return hidden, cache


def forward_hidden_states(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
                          n_new: jax.Array, page_table: jax.Array, *, layers: tuple[int, ...],
                          cfg: ModelConfig, impl: KernelChoice = REFERENCE,
                          input_embeds: jax.Array | None = None, scan_layers: bool = True
                          ) -> tuple[jax.Array, Cache, jax.Array]:
  """`forward`, also returning the residual stream entering each of `layers` (static ints in
  [0, num_layers]; num_layers: the last layer's output before the final norm), in that order:
  [len(layers), B, T, H]. The scanned stacks are split at those layers, so only these are
  kept (never every layer's: EAGLE-3 takes three)."""
  hidden, cache, _, states = _forward(params, cache, tokens, start, n_new, page_table, cfg=cfg,
                                      impl=impl, router_counts=False, input_embeds=input_embeds,
                                      hidden_at=tuple(layers), scan_layers=scan_layers)
  return hidden, cache, states


def forward_counting_experts(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
                             n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
                             impl: KernelChoice = REFERENCE,
                             input_embeds: jax.Array | None = None
                             ) -> tuple[jax.Array, Cache, jax.Array]:
  """`forward`, also returning [n_moe_layers, E] int32 tokens routed to each expert (load
  statistics, DeepSeek's auxiliary-loss-free balancing in training)."""
  hidden, cache, counts, _ = _forward(params, cache, tokens, start, n_new, page_table, cfg=cfg,
                                      impl=impl, router_counts=True, input_embeds=input_embeds)
  return hidden, cache, counts


def _forward(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
             n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
             impl: KernelChoice, router_counts: bool,
             input_embeds: jax.Array | None = None, hidden_at: tuple[int, ...] = (),
             scan_layers: bool = True) -> tuple[jax.Array, Cache, Any, Any]:
  """Runs the decoder over a block of new tokens.

  Args:
    params: the parameter pytree (`engine.model.params`: stacked layers).
    cache: per stack of L layers, then per MTP layer (L = 1), {"latent": [L * N, P, Dc+Dr]}
      (MLA) or {"k", "v": [L * N, P, nKV, hd]} (GQA) (`engine.model.cache`).
    tokens: [B, T] int32 new tokens (right-padded).
    start: [B] int32 tokens already in the cache for each row.
    n_new: [B] int32 real tokens in this block (0 for an idle row).
    page_table: [B, max_pages] int32.
    router_counts: count the tokens routed to each expert ([n_moe_layers, E] int32).
    input_embeds: [B, T, H] used instead of the token table's rows (multimodal prefill:
      `embed_tokens` with image features scattered into the <|media_pad|> slots); `tokens`
      still gives the block's shape.
    hidden_at: layers whose entering residual stream to return (`forward_hidden_states`).
    scan_layers: False runs every layer as its own call (the unrolled reference).
  Returns:
    (hidden [B, T, H] after the final norm, updated cache, router counts or None, the hidden
    states at `hidden_at` [len, B, T, H] or None).
  """
  bad = [l for l in hidden_at if not 0 <= l <= cfg.num_layers]
  if bad:
    raise ValueError(f"hidden states asked for layers {bad}, outside [0, {cfg.num_layers}]")
  ctx = _Ctx(start, n_new, tokens.shape[1], page_table, router_counts)
  ctx.cos_sin(cfg)  # computed once, before any scan body (every layer reuses it)
  if input_embeds is None:
    x = embed_tokens(params, tokens, cfg)
  else:
    if input_embeds.shape != tokens.shape + (cfg.hidden_size,):
      raise ValueError(f"input_embeds has shape {input_embeds.shape}, expected "
                       f"{tokens.shape + (cfg.hidden_size,)}")
    x = input_embeds.astype(params["embed"].dtype)
  x = split_batch_over_data(x)
  # MTP layers' cache entries (after the stacks') pass through untouched.
  new_cache, counts, states = list(cache), [], {}
  for r, (first, last) in enumerate(cfg.layer_stacks):
    num_pages = next(iter(cache[r].values())).shape[0] // (last - first)
    cuts = sorted({first, last} | {l for l in hidden_at if first < l < last})
    for a, b in zip(cuts, cuts[1:]):
      states.setdefault(a, x)
      x, new_cache[r], c = _run_stack(params["stacks"][r], new_cache[r], num_pages, x, ctx, cfg,
                                      impl, a - first, b - first, scan_layers)
      if c is not None:
        counts.append(c)
  states.setdefault(cfg.num_layers, x)
  hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  if router_counts:
    counts = (jnp.concatenate(counts) if counts
              else jnp.zeros((0, cfg.num_experts), jnp.int32))
  captured = jnp.stack([states[l] for l in hidden_at]) if hidden_at else None
  return hidden, new_cache, counts if router_counts else None, captured


def forward_mtp(params: Params, cache: Cache, hidden: jax.Array, next_tokens: jax.Array,
                start: jax.Array, n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
                depth: int = 0, impl: KernelChoice = REFERENCE) -> tuple[jax.Array, Cache]:
  """The MTP layer (`forward_mtp_counting_experts` without the counts). Returns (hidden
  [B, T, H] to feed `compute_logits`, updated cache)."""
  out, cache, _ = _forward_mtp(params, cache, hidden, next_tokens, start, n_new, page_table,
                               cfg=cfg, depth=depth, impl=impl, router_counts=False)
  return out, cache


def forward_mtp_counting_experts(params: Params, cache: Cache, hidden: jax.Array,
                                 next_tokens: jax.Array, start: jax.Array, n_new: jax.Array,
                                 page_table: jax.Array, *, cfg: ModelConfig, depth: int = 0,
                                 impl: KernelChoice = REFERENCE
                                 ) -> tuple[jax.Array, Cache, jax.Array]:
  """`forward_mtp`, also returning [1, E] tokens per expert of the MTP layer (if a MoE)."""
  return _forward_mtp(params, cache, hidden, next_tokens, start, n_new, page_table, cfg=cfg,
                      depth=depth, impl=impl, router_counts=True)


def _forward_mtp(params: Params, cache: Cache, hidden: jax.Array, next_tokens: jax.Array,
                 start: jax.Array, n_new: jax.Array, page_table: jax.Array, *,
                 cfg: ModelConfig, depth: int, impl: KernelChoice, router_counts: bool
                 ) -> tuple[jax.Array, Cache, Any]:
  """DeepSeek multi-token prediction: one MTP layer on top of the main model.

  For each position i, combines the main model's final (normalised) hidden state h_i with the
  embedding of token i+1 and predicts token i+2 (as vLLM/SGLang run DeepSeek-V3's MTP):
  x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), one decoder layer at position i (with its
  own cache entry, `cache[mtp_entry(cfg, depth)]`), then `final_norm`; logits via
  `compute_logits` (the shared output head).

  Args:
    hidden: [B, T, H] main-model output of `forward` for the same block.
    next_tokens: [B, T] token i+1 for every position i of the block.
    start, n_new, page_table: as in `forward`.
    router_counts: count tokens per expert of the MTP layer ([1, E], if it is a MoE).
  Returns:
    (hidden [B, T, H] to feed `compute_logits`, updated cache, router counts or None).
  """
  p = params["mtp"][depth]
  ctx = _Ctx(start, n_new, next_tokens.shape[1], page_table, router_counts)
  emb = rms_norm(params["embed"][next_tokens], p["enorm"], cfg.rms_norm_eps)
  h = rms_norm(hidden, p["hnorm"], cfg.rms_norm_eps)
  x = jnp.concatenate([emb, h.astype(emb.dtype)], axis=-1) @ p["eh_proj"]
  i = mtp_entry(cfg, depth)
  cache = list(cache)
  x, cache[i], counts = decoder_layer(p, x, cache[i], ctx, cfg, impl)
  out = rms_norm(x, p["final_norm"], cfg.rms_norm_eps)
  if router_counts:
    counts = (counts[None] if counts is not None
              else jnp.zeros((0, cfg.num_experts), jnp.int32))
  return out, cache, counts if router_counts else None


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
  """hidden [..., H] -> float32 logits [..., V] (tied embeddings use embed.T)."""
  if cfg.tie_word_embeddings:
    w = params["embed"]
    return jnp.einsum("...h,vh->...v", hidden, w, preferred_element_type=jnp.float32)
  return jnp.einsum("...h,hv->...v", hidden, params["lm_head"],
                    preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "scan_layers"),
                   donate_argnames=("cache",))
def forward_logits(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
                   n_new: jax.Array, page_table: jax.Array, *, cfg: ModelConfig,
                   impl: KernelChoice = REFERENCE, input_embeds: jax.Array | None = None,
                   scan_layers: bool = True) -> tuple[jax.Array, Cache]:
  """Jitted `forward` returning float32 logits for every position: [B, T, V]. Donates `cache`."""
  hidden, cache = forward(params, cache, tokens, start, n_new, page_table, cfg=cfg, impl=impl,
                          input_embeds=input_embeds, scan_layers=scan_layers)
  return compute_logits(params, hidden, cfg), cache
