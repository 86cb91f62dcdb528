"""The parameter pytree: its layout, its shapes, and a random initialiser.

Parameters are plain nested dicts of arrays (a pytree any JAX transform accepts). Matrices are
stored as `x @ W`, i.e. [in, out], with the head axis explicit where there is one, so sharding
rules can name it.

The decoder layers are stacked: `params["stacks"][r]` holds the run of identical layers
`cfg.layer_stacks[r] = (start, stop)` (DeepSeek-V3 / Kimi: the dense prefix, then the MoE
body; one run for the other families) as one layer dict whose every leaf has a leading layer
axis of stop - start (INT4 / FP8 weights: their children do), so the forward scans it
(`transformer.py`). Checkpoints name layers one by one: the per-layer layout
(`per_layer_shapes`, `params["layers"][i]` below, layer i's shapes without the layer axis) is
what the loaders fill and `export_hf` writes; `stack_layers` / `unstack_layers` convert, and
`stacked_leaf` maps a per-layer leaf to its stack and position.

    embed            [V, H]
    final_norm       [H]
    lm_head          [H, V]             (absent when tie_word_embeddings: embed.T is used)
    stacks[r]        layers[start:stop] of the per-layer layout, stacked: [stop - start, ...]
    layers[i]:       (per-layer layout only)
      input_norm     [H]
      post_attn_norm [H]
      attn (MLA):
        q            [H, nH, dn+dr]     (when q_lora_rank is null)
        q_a          [H, q_lora]        q_a_norm [q_lora]      q_b [q_lora, nH, dn+dr]
        kv_a         [H, kv_lora+dr]    kv_a_norm [kv_lora]
        kv_b         [kv_lora, nH, dn+dv]   (W_UK = kv_b[..., :dn], W_UV = kv_b[..., dn:])
        o            [nH, dv, H]
      attn (GQA):
        q [H, nH, hd]   k [H, nKV, hd]   v [H, nKV, hd]   o [nH, hd, H]
        q_norm [hd], k_norm [hd]                      (qk_norm models: Qwen3)
        q_bias [nH, hd], k_bias [nKV, hd], v_bias [nKV, hd], o_bias [H]   (attention_bias)
      mlp (dense layer):  gate [H, I]   up [H, I]   down [I, H]
      moe (MoE layer):
        router       [H, E]     float32 always (routing is computed in float32)
        router_bias  [E]        float32; `e_score_correction_bias` (noaux_tc only)
        experts:     gate [E, H, Im]   up [E, H, Im]   down [E, Im, H]
                     or, for compressed-tensors INT4 checkpoints (`cfg.experts_int4(i)`), each
                     an `Int4Weight` (pallas_kernels/quant.py) of the same logical shape:
                     packed uint8 [E, N, K/2] and scale bf16 [E, K/group, N]; for FP8
                     experts kept quantized (`cfg.experts_fp8(i)`) an `Fp8Weight`: w
                     float8_e4m3fn [E, K, N] and scale_inv float32 [E, K/bk, N/bn]
        shared:      gate [H, Is]   up [H, Is]   down [Is, H]  with Is = Im * n_shared (if any)
    mtp[k]       DeepSeek multi-token prediction (num_nextn_predict_layers > 0): a decoder layer,
                 not stacked (the keys above, MoE or dense as layer num_layers + k) plus
      enorm [H]  hnorm [H]  eh_proj [2H, H] (input: [enorm(embed(next)), hnorm(hidden)])
      final_norm [H]      (its output head reuses `embed`/`lm_head` of the main model)

    vision       Kimi K2.5's vision tower and projector (`cfg.vision`; `engine.model.vision`),
                 D = vision hidden, p = patch size, nV heads of hd, I = MLP width, M = merged
                 patches (4), Ht = the text hidden size; never quantized:
      patch_embed [3*p*p, D]  patch_bias [D]        (the stride-p conv as a matmul)
      pos_emb     [pos_emb_height, pos_emb_width, D] (bicubically resampled per image)
      layers[i]:  attn_norm, attn_norm_bias [D]   q, k, v [D, nV, hd]  q_bias, k_bias, v_bias
                  [nV, hd] (q, k in rotate-half layout)   o [nV, hd, D]  o_bias [D]
                  mlp_norm, mlp_norm_bias [D]   fc1 [D, I]  fc1_bias [I]  fc2 [I, D]  fc2_bias [D]
      final_norm, final_norm_bias [D]
      proj_norm, proj_norm_bias [D]  proj_in [M*D, M*D]  proj_in_bias [M*D]
      proj_out [M*D, Ht]  proj_out_bias [Ht]

dn/dr/dv: qk_nope_head_dim, qk_rope_head_dim, v_head_dim.
"""

from __future__ import annotations

from typing import Any

import math

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig, VisionConfig
from pallas_kernels.quant import Fp8Weight, Int4Weight

Params = dict[str, Any]

# Leaves kept in float32 whatever the checkpoint dtype (routing decisions are precision-sensitive).
FLOAT32_LEAVES = ("router", "router_bias")
# The children of an `Int4Weight` (INT4 routed experts): packed nibbles and bf16 group scales.
# The children of an `Fp8Weight` (FP8 routed experts kept quantized): values and block scales.
QUANT_LEAF_DTYPES = {"packed": jnp.uint8, "scale": jnp.bfloat16, "w": jnp.float8_e4m3fn,
                     "scale_inv": jnp.float32}


def _attn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  H, nH = cfg.hidden_size, cfg.num_heads
  if cfg.is_mla:
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    s: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank is None:
      s["q"] = (H, nH, dn + dr)
    else:
      s["q_a"] = (H, cfg.q_lora_rank)
      s["q_a_norm"] = (cfg.q_lora_rank,)
      s["q_b"] = (cfg.q_lora_rank, nH, dn + dr)
    s["kv_a"] = (H, cfg.kv_lora_rank + dr)
    s["kv_a_norm"] = (cfg.kv_lora_rank,)
    s["kv_b"] = (cfg.kv_lora_rank, nH, dn + dv)
    s["o"] = (nH, dv, H)
    return s
  hd, nKV = cfg.head_dim, cfg.num_kv_heads
  s = {"q": (H, nH, hd), "k": (H, nKV, hd), "v": (H, nKV, hd), "o": (nH, hd, H)}
  if cfg.qk_norm:
    s["q_norm"] = (hd,)
    s["k_norm"] = (hd,)
  if cfg.attention_bias:
    s.update(q_bias=(nH, hd), k_bias=(nKV, hd), v_bias=(nKV, hd), o_bias=(H,))
  return s


def _mlp_shapes(H: int, inter: int) -> dict[str, tuple[int, ...]]:
  return {"gate": (H, inter), "up": (H, inter), "down": (inter, H)}


# Linears of the attention whose logical shape is [in axes..., out axes...]: the number of
# input axes (`o` [nH, dv, H] flattens its first two into HF's input).
_FP8_DENSE_N_IN = {"q": 1, "q_a": 1, "q_b": 1, "kv_a": 1, "kv_b": 1, "o": 2,
                   "gate": 1, "up": 1, "down": 1}


def _fp8_dense(shapes: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """The linears of an attention / MLP shape dict as `Fp8Weight` shapes (cfg.fp8_dense)."""
  if not cfg.fp8_dense:
    return shapes
  b_out, b_in = cfg.fp8_experts
  out = dict(shapes)
  for name, n_in in _FP8_DENSE_N_IN.items():
    if name in shapes:
      s = shapes[name]
      k, n = math.prod(s[:n_in]), math.prod(s[n_in:])
      out[name] = Fp8Weight(w=s, scale_inv=(-(-k // b_in), -(-n // b_out)), block=(b_in, b_out),
                            n_in=n_in)
  return out


def _int4_shape(e: int, k: int, n: int, group: int) -> Int4Weight:
  return Int4Weight(packed=(e, n, k // 2), scale=(e, k // group, n))


def _moe_shapes(cfg: ModelConfig, i: int) -> dict[str, Any]:
  H, E, Im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  experts: dict[str, Any] = {"gate": (E, H, Im), "up": (E, H, Im), "down": (E, Im, H)}
  if cfg.experts_int4(i):
    g = cfg.int4.group_size
    experts = {k: _int4_shape(*shape, g) for k, shape in experts.items()}
  elif cfg.experts_fp8(i):
    b_out, b_in = cfg.fp8_experts  # HF weight_block_size is [out, in]; ours is [in, out]
    experts = {k: Fp8Weight(w=(e, kk, n), scale_inv=(e, -(-kk // b_in), -(-n // b_out)),
                            block=(b_in, b_out)) for k, (e, kk, n) in experts.items()}
  s: dict[str, Any] = {"router": (H, E), "experts": experts}
  if cfg.topk_method == "noaux_tc":
    s["router_bias"] = (E,)
  if cfg.num_shared_experts:
    s["shared"] = _fp8_dense(_mlp_shapes(H, Im * cfg.num_shared_experts), cfg)
  return s


def vision_param_shapes(v: VisionConfig) -> Params:
  """The `params["vision"]` subtree's shapes (see the layout above)."""
  D, nV, hd, I, M = v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size, v.merge_size

  def layer() -> dict[str, tuple[int, ...]]:
    return {"attn_norm": (D,), "attn_norm_bias": (D,),
            "q": (D, nV, hd), "k": (D, nV, hd), "v": (D, nV, hd),
            "q_bias": (nV, hd), "k_bias": (nV, hd), "v_bias": (nV, hd),
            "o": (nV, hd, D), "o_bias": (D,), "mlp_norm": (D,), "mlp_norm_bias": (D,),
            "fc1": (D, I), "fc1_bias": (I,), "fc2": (I, D), "fc2_bias": (D,)}

  return {"patch_embed": (3 * v.patch_size ** 2, D), "patch_bias": (D,),
          "pos_emb": (v.pos_emb_height, v.pos_emb_width, D),
          "layers": [layer() for _ in range(v.num_layers)],
          "final_norm": (D,), "final_norm_bias": (D,),
          "proj_norm": (D,), "proj_norm_bias": (D,), "proj_in": (M * D, M * D),
          "proj_in_bias": (M * D,), "proj_out": (M * D, v.text_hidden_size),
          "proj_out_bias": (v.text_hidden_size,)}


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, Any]:
  """Decoder layer i's shapes (i >= num_layers: MTP layer i - num_layers, without its extras)."""
  H = cfg.hidden_size
  shapes: dict[str, Any] = {"input_norm": (H,), "post_attn_norm": (H,),
                            "attn": _fp8_dense(_attn_shapes(cfg), cfg)}
  if cfg.is_moe_layer(i):
    shapes["moe"] = _moe_shapes(cfg, i)
  else:
    shapes["mlp"] = _fp8_dense(_mlp_shapes(H, cfg.intermediate_size), cfg)
  return shapes


def per_layer_shapes(cfg: ModelConfig) -> Params:
  """The per-layer layout's shapes (`params["layers"][i]`): what checkpoints name."""
  H, V = cfg.hidden_size, cfg.vocab_size
  tree: Params = {"embed": (V, H), "final_norm": (H,),
                  "layers": [layer_shapes(cfg, i) for i in range(cfg.num_layers)]}
  if not cfg.tie_word_embeddings:
    tree["lm_head"] = (H, V)
  if cfg.num_nextn_predict_layers:
    tree["mtp"] = [dict(layer_shapes(cfg, cfg.num_layers + k), enorm=(H,), hnorm=(H,),
                        eh_proj=(2 * H, H), final_norm=(H,))
                   for k in range(cfg.num_nextn_predict_layers)]
  if cfg.vision is not None:
    tree["vision"] = vision_param_shapes(cfg.vision)
  return tree


def param_shapes(cfg: ModelConfig) -> Params:
  """The pytree of parameter shapes (tuples) for `cfg`: the stacked layout the model runs."""
  tree = per_layer_shapes(cfg)
  layers = tree.pop("layers")
  tree["stacks"] = [jax.tree.map(lambda s, n=stop - start: (n,) + s, layers[start],
                                 is_leaf=is_shape) for start, stop in cfg.layer_stacks]
  return tree


def stack_layers(cfg: ModelConfig, tree: Params, stack: Any = None) -> Params:
  """The per-layer layout -> the stacked one (`stack`: jnp.stack by default, np.stack for host
  arrays). Other entries are kept as they are."""
  stack = jnp.stack if stack is None else stack
  out = {k: v for k, v in tree.items() if k != "layers"}
  out["stacks"] = [jax.tree.map(lambda *xs: stack(xs), *tree["layers"][start:stop])
                   for start, stop in cfg.layer_stacks]
  return out


def unstack_layers(params: Params) -> Params:
  """The stacked layout -> the per-layer one (each layer's leaves indexed out of its stack, in
  order: views of numpy arrays)."""
  out = {k: v for k, v in params.items() if k != "stacks"}
  out["layers"] = [jax.tree.map(lambda x, j=j: x[j], stack) for stack in params["stacks"]
                   for j in range(jax.tree.leaves(stack)[0].shape[0])]
  return out


def layer_params(cfg: ModelConfig, params: Params, i: int) -> Params:
  """Decoder layer i's parameters (its stack's leaves at its position)."""
  r, j = cfg.layer_stack_of(i)
  return jax.tree.map(lambda x: x[j], params["stacks"][r])


def stacked_leaf(cfg: ModelConfig, name: str) -> tuple[str, int | None]:
  """A per-layer leaf name -> (the stacked layout's leaf, position on its layer axis):
  `layers.5.attn.q` -> (`stacks.1.attn.q`, 4) when stack 1 starts at layer 1; other names are
  the same in both layouts (position None)."""
  head, _, rest = name.partition(".")
  if head != "layers":
    return name, None
  index, _, rest = rest.partition(".")
  r, j = cfg.layer_stack_of(int(index))
  return f"stacks.{r}.{rest}", j


def is_shape(x: Any) -> bool:
  """True for a leaf of `param_shapes` (a tuple of ints): its `is_leaf` for tree functions."""
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def shape_leaves(cfg: ModelConfig, per_layer: bool = False
                 ) -> dict[str, tuple[tuple[Any, ...], tuple[int, ...]]]:
  """{path_str: (key path, shape)} of every leaf of the layout (stacked, or `per_layer`), in
  pytree order."""
  shapes = per_layer_shapes(cfg) if per_layer else param_shapes(cfg)
  flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)[0]
  return {path_str(p): (p, s) for p, s in flat}


def leaf_dtype(path: tuple[Any, ...], dtype: Any) -> Any:
  """The dtype a leaf is stored in: float32 for routing leaves, uint8 / bf16 for the packed
  nibbles / scales of INT4 experts, float8_e4m3fn / float32 for kept FP8 experts' values /
  block scales, `dtype` otherwise."""
  name = _key_name(path[-1])
  if name in ("w", "scale_inv"):  # an Fp8Weight's children (no other leaf has these names)
    return QUANT_LEAF_DTYPES[name]
  if name in QUANT_LEAF_DTYPES and len(path) >= 3 and _key_name(path[-3]) == "experts":
    return QUANT_LEAF_DTYPES[name]
  return jnp.float32 if name in FLOAT32_LEAVES else dtype


def _key_name(k: Any) -> str:
  for attr in ("key", "idx", "name"):  # dict, sequence, dataclass (GetAttrKey) entries
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(path: tuple[Any, ...]) -> str:
  """`layers.3.moe.experts.gate` style name of a pytree path."""
  return ".".join(_key_name(k) for k in path)


def abstract_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> Params:
  """The pytree of `jax.ShapeDtypeStruct` (for restoring or lowering without weights)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, s: jax.ShapeDtypeStruct(s, leaf_dtype(p, dtype)),
      param_shapes(cfg), is_leaf=is_shape)


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32,
                scale: float = 1.0) -> Params:
  """Random parameters (numpy RNG, so independent of the JAX backend).

  Norm weights are 1 + 0.1 N(0,1); matrices N(0, scale / fan_in); the embedding N(0, 1);
  the correction bias small and nonzero. Meant for tests and benchmarks, not training. Drawn
  layer by layer (the per-layer layout), then stacked.
  """
  rng = np.random.default_rng(seed)

  def make(path, shape):
    name = _key_name(path[-1])
    if leaf_dtype(path, dtype) == jnp.uint8:  # INT4 nibbles, uniformly random
      return jnp.asarray(rng.integers(0, 256, size=shape), jnp.uint8)
    if leaf_dtype(path, dtype) == jnp.float8_e4m3fn:  # FP8 values; the scales set the size
      return jnp.asarray(np.clip(rng.standard_normal(shape) * 32, -448, 448), jnp.float8_e4m3fn)
    if name == "scale_inv" and leaf_dtype(path, dtype) == jnp.float32:
      fan_in = shape[-2] * 128  # input blocks of 128
      return jnp.asarray(np.sqrt(scale / fan_in) / 32 * (0.5 + rng.random(shape)), jnp.float32)
    if name == "scale" and leaf_dtype(path, dtype) == jnp.bfloat16:
      # q is ~uniform in [-8, 7] (std ~4.6): weights of std ~sqrt(scale / fan_in).
      fan_in = shape[1] * cfg.int4.group_size
      x = 0.5 + 0.5 * np.abs(rng.standard_normal(shape))
      return jnp.asarray(x * np.sqrt(scale / fan_in) / 4.6, jnp.bfloat16)
    if name.endswith("norm"):
      x = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name == "embed":
      x = rng.standard_normal(shape)
    elif name == "router_bias":
      x = 0.1 * rng.standard_normal(shape)
    elif name.endswith("bias"):
      x = 0.1 * rng.standard_normal(shape)
    else:
      # fan_in is the leading axis, after the expert axis for stacked experts.
      fan_in = shape[1] if len(path) >= 2 and _key_name(path[-2]) == "experts" else shape[0]
      if name == "o":
        fan_in = shape[0] * shape[1]
      x = rng.standard_normal(shape) * np.sqrt(scale / fan_in)
    return jnp.asarray(x, dtype=leaf_dtype(path, dtype))

  layers = jax.tree_util.tree_map_with_path(make, per_layer_shapes(cfg), is_leaf=is_shape)
  return stack_layers(cfg, layers)


def check_params(cfg: ModelConfig, params: Params) -> None:
  """Raises ValueError naming the first leaf whose presence or shape differs from the layout."""
  expected = {name: shape for name, (_, shape) in shape_leaves(cfg).items()}
  actual = {path_str(p): tuple(x.shape) for p, x in
            jax.tree_util.tree_flatten_with_path(params)[0]}
  for name, shape in expected.items():
    if name not in actual:
      raise ValueError(f"parameter {name!r} is missing (expected shape {shape})")
    if actual[name] != shape:
      raise ValueError(f"parameter {name!r} has shape {actual[name]}, expected {shape}")
  for name in actual:
    if name not in expected:
      raise ValueError(f"unexpected parameter {name!r}")


def shardings_by_leaf(shardings: Any, cfg: ModelConfig) -> dict[str, jax.sharding.Sharding]:
  """{path_str: Sharding} of a shardings pytree; ValueError unless it matches the layout."""
  expected = shape_leaves(cfg)
  flat = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}
  missing = sorted(set(expected) - set(flat))
  extra = sorted(set(flat) - set(expected))
  if missing or extra:
    raise ValueError(f"shardings do not match the parameter layout: missing {missing[:5]}, "
                     f"unexpected {extra[:5]}")
  bad = [k for k, s in flat.items() if not isinstance(s, jax.sharding.Sharding)]
  if bad:
    raise ValueError(f"shardings leaf {bad[0]!r} is not a jax.sharding.Sharding")
  return flat
