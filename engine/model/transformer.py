"""The decoder forward pass: the `Transformer` module, and the pure functions of a parameter
pytree every jitted program calls.

Read top to bottom: `forward(params, ...)` binds the parameter pytree to the Flax modules
(`bind`: `nnx.merge` with a cached graphdef, at trace time) and calls `Transformer`, which
embeds tokens, runs every layer (`modules.DecoderLayer`: attention writes its new cache
entries, then reads the paged cache; then a dense MLP or a MoE), normalises and returns hidden
states; `compute_logits` applies the LM head.

The layers run stack by stack (`cfg.layer_stacks`: runs of identical layers, their parameters
and pages stacked on a leading layer axis), each stack as one `lax.scan` whose body is one
decoder layer, so the program XLA compiles has one layer body per stack however deep the model
(`scan_layers=False`: one call per layer, the unrolled reference). No layer's pages or routed
experts are sliced out for the scan: the body reaches its pages in the stack's pool through a
shifted page table (`_run_stack`), hands the MoE kernels the stacked experts with the layer
index, and indexes its other parameters at its layer (on XLA:CPU a dot reads whole buffers, so
a weight an XLA dot reads is copied out of its stack per iteration: BENCHMARKS, issue 49).
`forward_hidden_states` splits the scans at given layers to return the residual stream
entering them.

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
from flax import nnx

from engine.model import modules
from engine.model.cache import Cache, layer_table, mtp_entry
from engine.model.config import ModelConfig
from engine.model.expert_parallel import split_batch_over_data
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.modules import DecoderLayer, MTPLayer, ParamInit, rms_norm
from engine.model.params import Params
from engine.model.rope import rope_cos_sin
from engine.model.vision import VisionTower

# ---- the layer modules, called on one layer's parameters -----------------------------------
# (the forward itself merges whole stacks: `Transformer`; these serve tests and tools)

def _layer_of_kind(cfg: ModelConfig, moe: bool) -> int:
  """A layer index whose kind is dense or MoE as asked (a graphdef depends only on that)."""
  n = cfg.num_layers + cfg.num_nextn_predict_layers
  return next((i for i in range(n) if cfg.is_moe_layer(i) == moe), 0)


def mla_attention(p: Params, x: jax.Array, layer_cache: dict[str, jax.Array], ctx: "_Ctx",
                  cfg: ModelConfig, impl: KernelChoice) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`modules.MLAAttention` on one layer's `attn` parameters: x [B, T, H] -> ([B, T, H],
  updated pool)."""
  return modules.mla_module(cfg, p)(x, layer_cache, ctx, impl)


def moe(p: Params, x: jax.Array, cfg: ModelConfig, impl: KernelChoice,
        ctx: "_Ctx | None" = None, layer: Any = None) -> jax.Array:
  """`modules.MoE` on one layer's `moe` parameters: x [B, T, H] -> [B, T, H]. p["experts"] is
  one layer's, or with `layer` a stack's (the kernels read layer `layer` in place)."""
  return modules.moe_module(cfg, _layer_of_kind(cfg, True), p)(x, impl, ctx, layer)[0]


def decoder_layer(p: Params, x: jax.Array, pool: dict[str, jax.Array], ctx: "_Ctx",
                  cfg: ModelConfig, impl: KernelChoice, experts_layer: Any = None
                  ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
  """`modules.DecoderLayer` on one layer's parameters. Returns (x, updated pool, [E] router
  counts or None)."""
  layer = modules.layer_module(cfg, _layer_of_kind(cfg, "moe" in p), p)
  return layer(x, pool, ctx, impl, experts_layer)


# ---- the layer stacks ------------------------------------------------------------------------

# Layers per iteration of a stack's scan (`lax.scan`'s unroll). 1 keeps the compiled body one
# layer; on the CPU 2 was no better in general (batch-32 decode 1.00-1.04x the separate-arrays
# forward at 3 layers, 1.07-1.15x at 16 where 1 read 1.03-1.09x: BENCHMARKS, issue 49), and a
# GPU step-time A/B decides GPU policy.
SCAN_UNROLL = 1


def _layer_view(stack: Params, j: Any) -> Params:
  """Layer j's parameters out of a stack's state: every leaf at position j, except the routed
  experts, which stay stacked (the MoE kernels read layer j in place: `experts_layer`)."""
  view = jax.tree.map(lambda w: w[j], {k: v for k, v in stack.items() if k != "moe"})
  if "moe" in stack:
    rest = {k: v for k, v in stack["moe"].items() if k != "experts"}
    view["moe"] = dict(jax.tree.map(lambda w: w[j], rest), experts=stack["moe"]["experts"])
  return view


def _run_stack(stack: DecoderLayer, entry: dict[str, jax.Array], num_pages: int, x: jax.Array,
               ctx: "_Ctx", impl: KernelChoice, first: int, last: int, scan: bool
               ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
  """Layers first..last-1 of a stack (positions in it) over x, as one `lax.scan` (or one call
  per layer when not `scan`, or for one layer).

  The stack is split into its graphdef and state (`nnx.split`); the scan's body merges layer
  j's view of the state into a one-layer `DecoderLayer` and calls it. The stack's pages
  (`entry`, its layers' pools end to end, `num_pages` each) ride in the scan's carry; layer j
  reaches its own through the page table shifted by j * num_pages (the writes are in-place
  scatters into the donated cache, never a copy of it), and its parameters are indexed at j
  inside the body. XLA fuses that index into the gathers and elementwise ops reading them; a
  dot on XLA:CPU reads a whole buffer, so layer j's slice of a weight an XLA dot reads is
  copied per iteration (XLA:GPU's dynamic-slice fusion, on by default, can read it in place:
  unchecked on a GPU; the MoE kernels take the stacked experts and the index). Returns (x,
  updated entry, [last - first, E] router counts or None)."""
  graphdef, state = nnx.split(stack)
  state = nnx.to_pure_dict(state)

  def layer(carry, j):
    x, entry = carry
    lctx = ctx.with_page_table(layer_table(ctx.page_table, j, num_pages))
    # (an array even for a static j: kernels behind `_jit_per_static_kwargs` then share one
    # lowering across the layers of an unrolled stack)
    x, entry, counts = nnx.merge(graphdef, _layer_view(state, j))(
        x, entry, lctx, impl, experts_layer=jnp.asarray(j, jnp.int32))
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


class Transformer(nnx.Module):
  """The decoder: token table, the stacks of layers (`cfg.layer_stacks`, each a `DecoderLayer`
  with a leading layer axis), final norm, output head (absent when tied), the MTP layers and
  Kimi K2.5's vision tower (`vision.VisionTower`, run by its own program) when present.

  Its state, as a pure dict (`to_params`), is the parameter pytree (`engine.model.params`);
  `bind(cfg, params)` rebuilds the module from one inside a jitted program."""

  def __init__(self, cfg: ModelConfig, init: ParamInit, *, mtp: bool = True,
               vision: bool = True):
    self.cfg = cfg
    H, V = cfg.hidden_size, cfg.vocab_size
    self.embed = init("embed", (V, H))
    self.stacks = nnx.List([DecoderLayer(cfg, start, init.stacked(stop - start))
                            for start, stop in cfg.layer_stacks])
    self.final_norm = init("final_norm", (H,))
    if not cfg.tie_word_embeddings:
      self.lm_head = init("lm_head", (H, V))
    if mtp and cfg.num_nextn_predict_layers:
      self.mtp = nnx.List([MTPLayer(cfg, k, init)
                           for k in range(cfg.num_nextn_predict_layers)])
    if vision and cfg.vision is not None:
      self.vision = VisionTower(cfg.vision, init)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> the token table's rows [B, T, H]."""
    return self.embed[...][tokens]

  def __call__(self, cache: Cache, tokens: jax.Array, start: jax.Array, n_new: jax.Array,
               page_table: jax.Array, *, impl: KernelChoice, router_counts: bool,
               input_embeds: jax.Array | None = None, hidden_at: tuple[int, ...] = (),
               scan_layers: bool = True) -> tuple[jax.Array, Cache, Any, Any]:
    """Runs the decoder over a block of new tokens (the arguments: `_forward`)."""
    cfg = self.cfg
    bad = [l for l in hidden_at if not 0 <= l <= cfg.num_layers]
    if bad:
      raise ValueError(f"hidden states asked for layers {bad}, outside [0, {cfg.num_layers}]")
    ctx = _Ctx(start, n_new, tokens.shape[1], page_table, router_counts)
    ctx.cos_sin(cfg)  # computed once, before any scan body (every layer reuses it)
    if input_embeds is None:
      x = self.embed_tokens(tokens)
    else:
      if input_embeds.shape != tokens.shape + (cfg.hidden_size,):
        raise ValueError(f"input_embeds has shape {input_embeds.shape}, expected "
                         f"{tokens.shape + (cfg.hidden_size,)}")
      x = input_embeds.astype(self.embed.dtype)
    x = split_batch_over_data(x)
    # MTP layers' cache entries (after the stacks') pass through untouched.
    new_cache, counts, states = list(cache), [], {}
    for r, (first, last) in enumerate(cfg.layer_stacks):
      num_pages = next(iter(cache[r].values())).shape[0] // (last - first)
      cuts = sorted({first, last} | {l for l in hidden_at if first < l < last})
      for a, b in zip(cuts, cuts[1:]):
        states.setdefault(a, x)
        x, new_cache[r], c = _run_stack(self.stacks[r], new_cache[r], num_pages, x, ctx, impl,
                                        a - first, b - first, scan_layers)
        if c is not None:
          counts.append(c)
    states.setdefault(cfg.num_layers, x)
    hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    if router_counts:
      counts = (jnp.concatenate(counts) if counts
                else jnp.zeros((0, cfg.num_experts), jnp.int32))
    captured = jnp.stack([states[l] for l in hidden_at]) if hidden_at else None
    return hidden, new_cache, counts if router_counts else None, captured

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] -> float32 logits [..., V] (tied embeddings use embed.T)."""
    if self.cfg.tie_word_embeddings:
      return jnp.einsum("...h,vh->...v", hidden, self.embed[...],
                        preferred_element_type=jnp.float32)
    return jnp.einsum("...h,hv->...v", hidden, self.lm_head[...],
                      preferred_element_type=jnp.float32)


_PARTS = ("embed", "stacks", "final_norm", "lm_head", "mtp", "vision")


@functools.cache
def _model_graphdef(cfg: ModelConfig, mtp: bool, vision: bool) -> Any:
  return nnx.graphdef(Transformer(cfg, ParamInit(None), mtp=mtp, vision=vision))


def _as_state(tree: Any) -> Any:
  """A parameter pytree as the nested dict `nnx.merge` takes: lists as int-keyed dicts."""
  if isinstance(tree, (list, tuple)):
    return {i: _as_state(v) for i, v in enumerate(tree)}
  if isinstance(tree, dict):
    return {k: _as_state(v) for k, v in tree.items()}
  return tree


def to_params(state: Any) -> Params:
  """A module's state (`nnx.State` or its pure dict) -> the parameter pytree: int-keyed dicts
  back to lists (`stacks`, `mtp`, the vision tower's `layers`)."""
  if isinstance(state, nnx.State):
    state = nnx.to_pure_dict(state)
  if isinstance(state, dict):
    if state and all(isinstance(k, int) for k in state):
      return [to_params(state[i]) for i in range(len(state))]
    return {k: to_params(v) for k, v in state.items()}
  return state


def bind(cfg: ModelConfig, params: Params) -> Transformer:
  """The `Transformer` whose parameters are `params` (a pytree of arrays or tracers): the
  cached graphdef merged with them. Cheap, so jitted functions call it at trace time."""
  graphdef = _model_graphdef(cfg, "mtp" in params, "vision" in params)
  return nnx.merge(graphdef, _as_state({k: params[k] for k in _PARTS if k in params}))


def init_model(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> Transformer:
  """A randomly initialised `Transformer` (`modules.ParamInit`'s values), drawn by one
  compiled program (not op by op), compiled once per (cfg, dtype)."""
  return _init_program(cfg, jnp.dtype(dtype))(jax.random.key(seed))


@functools.cache
def _init_program(cfg: ModelConfig, dtype: Any) -> Any:
  return nnx.jit(lambda key: Transformer(cfg, ParamInit(nnx.Rngs(key), dtype)))


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
  """Runs the decoder (`Transformer.__call__` on `bind(cfg, params)`) over a block of new
  tokens.

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
  return bind(cfg, params)(cache, tokens, start, n_new, page_table, impl=impl,
                           router_counts=router_counts, input_embeds=input_embeds,
                           hidden_at=hidden_at, scan_layers=scan_layers)


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
  layer = modules.mtp_module(cfg, depth, params["mtp"][depth])
  ctx = _Ctx(start, n_new, next_tokens.shape[1], page_table, router_counts)
  i = mtp_entry(cfg, depth)
  cache = list(cache)
  out, cache[i], counts = layer(params["embed"][next_tokens], hidden, cache[i], ctx, impl)
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
