"""The decoder's building blocks as Flax NNX modules: attention (MLA, GQA), the dense MLP, the
MoE, the decoder layer, the MTP layer.

Each module declares its parameters (`nnx.Param`, named as the parameter pytree names them,
`engine.model.params`) and computes in `__call__`. The engine never holds these objects: it
holds the pure parameter dict, and a jitted program rebuilds the module tree from it at trace
time (`nnx.merge(graphdef, params)`: free at run time, the same HLO), calls it, and drops it.
That keeps every program a pure function of an explicit pytree (jit per bucket, donation,
sharding by leaf name, the loaders writing leaves) while the model reads as modules.

A stack of identical layers (`cfg.layer_stacks`) is one `DecoderLayer` whose every leaf has a
leading layer axis; the forward (`engine.model.transformer`) splits it (`nnx.split`) and runs a
`lax.scan` whose body merges layer j's view of that state.

Shapes: B batch, T new tokens per row, H hidden, nH heads, E routed experts.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from engine.model import kernels, params as layout
from engine.model.config import ModelConfig
from engine.model.expert_parallel import replicated_features, routed_experts
from engine.model.kernels import KernelChoice
from engine.model.rope import apply_rope
from pallas_kernels.moe.reference import swiglu_mlp
from pallas_kernels.quant import Fp8Weight, Int4Weight, dequantize, is_quantized


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, returned in x's dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * xf).astype(x.dtype)


# ---- parameters from the layout's shapes ------------------------------------------------------

class ParamInit:
  """Makes `nnx.Param`s from the layout's shape specs (`engine.model.params`): a tuple, or an
  `Int4Weight` / `Fp8Weight` of tuples. `lead`: leading axes (a stack's layer axis). Values:
  norms 1, biases 0, the token table N(0, 1), matrices N(0, 1/fan_in), quantized leaves random
  codes with matching scales: a runnable model (tests, a demo), though checkpoints fill the
  real ones. Without `rngs`, abstract: every value a `jax.ShapeDtypeStruct` (a module's
  structure for its graphdef, nothing drawn or traced)."""

  def __init__(self, rngs: nnx.Rngs | None, dtype: Any = jnp.float32,
               lead: tuple[int, ...] = ()):
    self.rngs, self.dtype, self.lead = rngs, dtype, tuple(lead)

  def stacked(self, n: int) -> "ParamInit":
    """The same initialiser with a leading layer axis of n (a stack of n layers)."""
    return ParamInit(self.rngs, self.dtype, (n,) + self.lead)

  def __call__(self, name: str, spec: Any, *, dtype: Any = None, fan_in_axis: int = 0
               ) -> nnx.Param:
    dtype = self.dtype if dtype is None else dtype
    lead = self.lead
    if self.rngs is None:
      def abstract(shape, dt):
        return jax.ShapeDtypeStruct(lead + tuple(shape), dt)
      if isinstance(spec, Int4Weight):
        return nnx.Param(Int4Weight(abstract(spec.packed, jnp.uint8),
                                    abstract(spec.scale, jnp.bfloat16)))
      if isinstance(spec, Fp8Weight):
        return nnx.Param(Fp8Weight(abstract(spec.w, jnp.float8_e4m3fn),
                                   abstract(spec.scale_inv, jnp.float32), spec.block, spec.n_in))
      return nnx.Param(abstract(spec, dtype))
    if isinstance(spec, Int4Weight):
      fan_in = 2 * spec.packed[-1]  # packed [..., N, K/2]
      packed = jax.random.randint(self.rngs.params(), lead + spec.packed, 0, 256, jnp.int32)
      scale = jnp.full(lead + spec.scale, (fan_in ** -0.5) / 4.6, jnp.bfloat16)
      return nnx.Param(Int4Weight(packed.astype(jnp.uint8), scale))
    if isinstance(spec, Fp8Weight):
      w = jax.random.normal(self.rngs.params(), lead + spec.w) * 32
      fan_in = spec.scale_inv[-2] * spec.block[0]
      scale = jnp.full(lead + spec.scale_inv, (fan_in ** -0.5) / 32, jnp.float32)
      return nnx.Param(Fp8Weight(jnp.clip(w, -448, 448).astype(jnp.float8_e4m3fn), scale,
                                 spec.block, spec.n_in))
    shape = lead + tuple(spec)
    if name.endswith("norm"):
      return nnx.Param(jnp.ones(shape, dtype))
    if name.endswith("bias"):
      return nnx.Param(jnp.zeros(shape, dtype))
    fan_in = 1 if name == "embed" else spec[fan_in_axis] * (spec[1] if name == "o" else 1)
    return nnx.Param((jax.random.normal(self.rngs.params(), shape) * fan_in ** -0.5
                      ).astype(dtype))


def _weights(module: nnx.Module, names: tuple[str, ...], dtype: Any) -> dict[str, Any]:
  """The module's parameters `names` present, FP8 linears kept quantized dequantized to dtype."""
  out = {}
  for n in sorted(names):  # (a fixed order: the program does not depend on the caller's dict)
    if hasattr(module, n):
      w = getattr(module, n).get_value()
      out[n] = dequantize(w, dtype) if is_quantized(w) else w
  return out


# ---- attention --------------------------------------------------------------------------------

class MLAAttention(nnx.Module):
  """Multi-head latent attention, absorbed (DeepSeek-V2/V3, Kimi). The pool holds per token
  the normalised latent and the rotated rope key: {"latent": [N, P, kv_lora + dr]}."""

  def __init__(self, cfg: ModelConfig, init: ParamInit):
    self.cfg = cfg
    for name, spec in layout._fp8_dense(layout._attn_shapes(cfg), cfg).items():
      setattr(self, name, init(name, spec))  # q | q_a, q_a_norm, q_b; kv_a, kv_a_norm, kv_b, o

  def __call__(self, x: jax.Array, pool: dict[str, jax.Array], ctx: Any, impl: KernelChoice
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, H] -> ([B, T, H], updated pool); the layer's pages where ctx.page_table points."""
    cfg = self.cfg
    p = _weights(self, ("q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o"),
                 x.dtype)
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
    pages = kernels.write_pages(impl)(pool["latent"], ctx.page_table, ctx.positions,
                                      ctx.valid, latent)

    w_uk, w_uv = p["kv_b"][..., :dn], p["kv_b"][..., dn:]  # [Dc, nH, dn], [Dc, nH, dv]
    q_latent = jnp.einsum("btnd,cnd->btnc", q_nope, w_uk)
    ctx_latent = kernels.mla_attention(impl)(
        q_latent, q_rope, pages, ctx.page_table, ctx.positions, ctx.kv_lens,
        softmax_scale=cfg.softmax_scale)
    out = jnp.einsum("btnc,cnv->btnv", ctx_latent, w_uv)
    return jnp.einsum("btnv,nvh->bth", out, p["o"]), {"latent": pages}


class GQAAttention(nnx.Module):
  """Grouped-query attention (Llama, Qwen3; q/k norms, biases where the config has them). The
  pool: {"k", "v": [N, P, nKV, hd]}."""

  def __init__(self, cfg: ModelConfig, init: ParamInit):
    self.cfg = cfg
    for name, spec in layout._fp8_dense(layout._attn_shapes(cfg), cfg).items():
      setattr(self, name, init(name, spec))  # q, k, v, o; q_norm, k_norm; *_bias

  def __call__(self, x: jax.Array, pool: dict[str, jax.Array], ctx: Any, impl: KernelChoice
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B, T, H] -> ([B, T, H], updated pool)."""
    cfg = self.cfg
    p = _weights(self, ("q", "k", "v", "o", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias",
                        "o_bias"), x.dtype)
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
    k_pages = write(pool["k"], ctx.page_table, ctx.positions, ctx.valid, k)
    v_pages = write(pool["v"], ctx.page_table, ctx.positions, ctx.valid, v)
    out = kernels.gqa_attention(impl)(q, k_pages, v_pages, ctx.page_table, ctx.positions,
                                      ctx.kv_lens, softmax_scale=cfg.qk_head_dim ** -0.5)
    out = jnp.einsum("btnd,ndh->bth", out, p["o"])
    if cfg.attention_bias:
      out = out + p["o_bias"]
    return out, {"k": k_pages, "v": v_pages}


# ---- feed-forward -----------------------------------------------------------------------------

class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up)). gate, up [H, I], down [I, H] (or `Fp8Weight`s)."""

  def __init__(self, shapes: dict[str, Any], init: ParamInit):
    self.gate = init("gate", shapes["gate"])
    self.up = init("up", shapes["up"])
    self.down = init("down", shapes["down"])

  def __call__(self, x: jax.Array) -> jax.Array:
    return swiglu_mlp(x, self.gate.get_value(), self.up.get_value(), self.down.get_value())


class Experts(nnx.Module):
  """Routed experts gate, up [E, H, Im], down [E, Im, H]: float, `Int4Weight` or `Fp8Weight`
  (kept quantized; the MoE kernels dequantize what they read). Computed by `MoE` through the
  kernel switch, so this module only holds them."""

  def __init__(self, shapes: dict[str, Any], init: ParamInit):
    for name in ("gate", "up", "down"):
      setattr(self, name, init(name, shapes[name], fan_in_axis=1))

  def as_dict(self) -> dict[str, Any]:
    return {n: getattr(self, n).get_value() for n in ("gate", "up", "down")}


class MoE(nnx.Module):
  """Routed experts plus shared experts (DeepSeek-V3 / Kimi, Qwen3-MoE, DeepSeek-V2)."""

  def __init__(self, cfg: ModelConfig, i: int, init: ParamInit):
    self.cfg = cfg
    shapes = layout._moe_shapes(cfg, i)
    self.router = init("router", shapes["router"], dtype=jnp.float32)
    if "router_bias" in shapes:  # noaux_tc's e_score_correction_bias
      self.router_bias = init("router_bias", shapes["router_bias"], dtype=jnp.float32)
    self.experts = Experts(shapes["experts"], init)
    if "shared" in shapes:
      self.shared = MLP(shapes["shared"], init)

  def __call__(self, x: jax.Array, impl: KernelChoice, ctx: Any = None, layer: Any = None
               ) -> tuple[jax.Array, jax.Array | None]:
    """x [B, T, H] -> ([B, T, H], [E] int32 tokens per expert (real tokens) when
    `ctx.collect_router_counts`, else None). With `layer`, the experts are a stack's
    [L, E, ...], of which the kernels read layer `layer` in place."""
    cfg = self.cfg
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    router_logits = xf.astype(jnp.float32) @ self.router[...]
    bias = self.router_bias[...] if hasattr(self, "router_bias") else None
    weights, ids = kernels.route(impl)(
        router_logits, bias, scoring_func=cfg.scoring_func, topk_method=cfg.topk_method,
        top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    counts = None
    if ctx is not None and ctx.collect_router_counts:  # off on the serving path
      real = ctx.valid.reshape(-1, 1).astype(jnp.int32)
      onehot = (ids[:, :, None] == jnp.arange(cfg.num_experts)[None, None, :]) * real[:, :, None]
      counts = jnp.sum(onehot, axis=(0, 1))
    if ctx is not None:
      # Padding tokens (packed rows, idle rows) go to no expert: an id outside every shard
      # contributes zero, so a decode step streams only the experts real tokens chose.
      ids = jnp.where(ctx.valid.reshape(-1, 1), ids, -1)
    y = routed_experts(impl, xf, weights, ids, self.experts.as_dict(), layer=layer)
    if hasattr(self, "shared"):
      y = y + self.shared(xf)
    return y.reshape(b, t, h), counts


# ---- the decoder layer ------------------------------------------------------------------------

class DecoderLayer(nnx.Module):
  """Pre-norm attention then a dense MLP or a MoE, each added to the residual stream. Layer i's
  kind (`cfg.layer_kind(i)`) decides MLA/GQA, MLP/MoE and the experts' format; with
  `init.lead = (L,)` it is a stack of L such layers."""

  def __init__(self, cfg: ModelConfig, i: int, init: ParamInit):
    self.cfg = cfg
    H = cfg.hidden_size
    self.input_norm = init("input_norm", (H,))
    self.attn = (MLAAttention if cfg.is_mla else GQAAttention)(cfg, init)
    self.post_attn_norm = init("post_attn_norm", (H,))
    if cfg.is_moe_layer(i):
      self.moe = MoE(cfg, i, init)
    else:
      self.mlp = MLP(layout._fp8_dense(layout._mlp_shapes(H, cfg.intermediate_size), cfg), init)

  def __call__(self, x: jax.Array, pool: dict[str, jax.Array], ctx: Any, impl: KernelChoice,
               experts_layer: Any = None
               ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
    """x [B, T, H] -> (x, updated pool, [E] router counts or None). pool: the page pool the
    attention reads and writes through `ctx.page_table`; experts_layer: with a stack's routed
    experts, which layer of it."""
    eps = self.cfg.rms_norm_eps
    a, pool = self.attn(rms_norm(x, self.input_norm[...], eps), pool, ctx, impl)
    x = x + a
    hn = rms_norm(x, self.post_attn_norm[...], eps)
    counts = None
    if hasattr(self, "moe"):
      f, counts = self.moe(hn, impl, ctx, experts_layer)
    else:
      f = self.mlp(hn)
    return x + f, pool, counts


class MTPLayer(DecoderLayer):
  """DeepSeek multi-token prediction: a decoder layer (layer num_layers + k's kind) fed
  eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then its own final norm."""

  def __init__(self, cfg: ModelConfig, k: int, init: ParamInit):
    super().__init__(cfg, cfg.num_layers + k, init)
    H = cfg.hidden_size
    self.enorm = init("enorm", (H,))
    self.hnorm = init("hnorm", (H,))
    self.eh_proj = init("eh_proj", (2 * H, H))
    self.final_norm = init("final_norm", (H,))

  def __call__(self, embeds: jax.Array, hidden: jax.Array, pool: dict[str, jax.Array],
               ctx: Any, impl: KernelChoice
               ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
    """embeds [B, T, H] (token i+1's), hidden [B, T, H] (the main model's normalised output at
    i) -> (normalised hidden [B, T, H] for the shared head, updated pool, router counts)."""
    eps = self.cfg.rms_norm_eps
    emb = rms_norm(embeds, self.enorm[...], eps)
    h = rms_norm(hidden, self.hnorm[...], eps)
    x = jnp.concatenate([emb, h.astype(emb.dtype)], axis=-1) @ self.eh_proj[...]
    x, pool, counts = super().__call__(x, pool, ctx, impl)
    return rms_norm(x, self.final_norm[...], eps), pool, counts


# ---- module trees from the parameter pytree ---------------------------------------------------

@functools.cache
def _graphdef(make: Any, *key: Any) -> Any:
  """The graphdef of `make(*key, init)`, built abstractly (nothing allocated or traced)."""
  return nnx.graphdef(make(*key, ParamInit(None)))


def _stack_init(cfg: ModelConfig, r: int, init: ParamInit) -> DecoderLayer:
  first, last = cfg.layer_stacks[r]
  return DecoderLayer(cfg, first, init.stacked(last - first))


def stack_module(cfg: ModelConfig, r: int, stack: dict[str, Any]) -> DecoderLayer:
  """`params["stacks"][r]` as a `DecoderLayer` module (leaves with a leading layer axis)."""
  return nnx.merge(_graphdef(_stack_init, cfg, r), stack)


def stack_graphdef(cfg: ModelConfig, r: int) -> Any:
  return _graphdef(_stack_init, cfg, r)


def layer_module(cfg: ModelConfig, i: int, p: dict[str, Any]) -> DecoderLayer:
  """Decoder layer i's parameters (one layer, no layer axis) as a `DecoderLayer`."""
  return nnx.merge(_graphdef(DecoderLayer, cfg, i), p)


def mtp_module(cfg: ModelConfig, k: int, p: dict[str, Any]) -> MTPLayer:
  """`params["mtp"][k]` as an `MTPLayer`."""
  return nnx.merge(_graphdef(MTPLayer, cfg, k), p)


def moe_module(cfg: ModelConfig, i: int, p: dict[str, Any]) -> MoE:
  """Layer i's `moe` parameters as a `MoE` module."""
  return nnx.merge(_graphdef(MoE, cfg, i), p)


def mla_module(cfg: ModelConfig, p: dict[str, Any]) -> MLAAttention:
  return nnx.merge(_graphdef(MLAAttention, cfg), p)


def attention_module(cfg: ModelConfig, p: dict[str, Any]) -> MLAAttention | GQAAttention:
  """A layer's `attn` parameters as the attention module of its kind (MLA or GQA by `cfg`)."""
  return nnx.merge(_graphdef(MLAAttention if cfg.is_mla else GQAAttention, cfg), p)
