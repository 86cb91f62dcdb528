"""Kimi K2.5's vision tower (MoonViT) and patch-merger projector, as Flax NNX modules
(`VisionBlock`, `VisionTower`) run by one jitted program over `params["vision"]`.

    feats = encode_images(params["vision"], batch.pixel_values, batch.grid_thws, cfg=cfg.vision)
    # [sum over images of (h/2)(w/2), text hidden]: image 0's tokens, then image 1's, ...

The computation, as transformers 5.24's `Kimi_K25VisionModel` + `Kimi_K25MultimodalProjection`:
patches [N, 3, p, p] -> the stride-p conv as a matmul -> + the learned [Hp, Wp, D] position
table resampled bicubically (Keys a = -0.75, half-pixel centres, edge clamped) to each image's
patch grid -> `num_layers` pre-LayerNorm blocks (attention with 2D rotary embeddings on q and k,
within each image only; GELU-tanh MLP) -> final LayerNorm -> each 2x2 group of patches (raster
order of the merged grid) concatenated [M*D] after a LayerNorm over each patch's D -> Linear ->
GELU (erf) -> Linear to the text width.

Shapes and compilation: `encode_images` is a host function (it reads `grid_thws`) that builds
the per-patch index arrays (`vision_inputs`, numpy) and calls one jitted program,
`encode_patches`, whose shapes depend only on the padded patch count `num_patches` (a multiple
of merge_size; by default the batch's own count, so one compile per distinct total; pass a
bucket to share programs across image sets). Padding patches form their own attention segment
and feed no output token. Attention within each image is a segment mask over all patches,
computed in query blocks of `ATTN_BLOCK` so memory stays O(block * patches).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from engine.model.config import VisionConfig  # noqa: F401  (re-exported: the tower's config)
from engine.model.modules import ParamInit
from engine.model.params import vision_param_shapes

Params = dict[str, Any]
ATTN_BLOCK = 512  # query rows per attention block


class VisionInputs(NamedTuple):
  """Per-patch index arrays for one batch of images (host numpy, or device arrays)."""
  pos_index: Any  # int32 [P, 16]: bicubic taps into the flattened position table
  pos_weight: Any  # float32 [P, 16]
  rope_hw: Any  # int32 [P, 2]: (row, column) of the patch in its image
  segment: Any  # int32 [P]: image index; -1 for padding patches
  merge_index: Any  # int32 [P // M, M]: the patches each output token concatenates


# ---- host-side indices ----------------------------------------------------------------------

def _bicubic_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
  """4 taps and weights per target position, as transformers'
  `_interpolation_axis_taps_weights(mode="bicubic", align_corners=False)`, in float32."""
  src = (index.astype(np.float32) + np.float32(0.5)) * np.float32(side) / np.float32(size) \
      - np.float32(0.5)
  floor = np.floor(src)
  offsets = np.arange(-1, 3)
  taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
  d = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)).astype(np.float32)
  a = np.float32(-0.75)
  near = ((a + 2) * d - (a + 3)) * d * d + 1
  far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
  return taps, np.where(d <= 1, near, far).astype(np.float32)


def vision_inputs(grid_thws: Any, cfg: VisionConfig, num_patches: int | None = None
                  ) -> VisionInputs:
  """The index arrays for images with these (t, h, w) patch grids, padded to `num_patches`."""
  grids = np.asarray(grid_thws, np.int64).reshape(-1, 3)
  kh, kw = cfg.merge_kernel
  if (grids[:, 0] != 1).any():
    raise ValueError(f"only images (t = 1) are supported, got grid_thws {grids.tolist()}")
  if (grids[:, 1] % kh).any() or (grids[:, 2] % kw).any() or (grids[:, 1:] < 1).any():
    raise ValueError(f"grid_thws {grids.tolist()}: h and w must be positive multiples of the "
                     f"merge kernel {cfg.merge_kernel}")
  total = int((grids[:, 1] * grids[:, 2]).sum())
  P = total if num_patches is None else int(num_patches)
  M = cfg.merge_size
  if P < total or P % M:
    raise ValueError(f"num_patches {P} must be >= {total} patches and a multiple of {M}")
  side_h, side_w = cfg.pos_emb_height, cfg.pos_emb_width
  pos_index = np.zeros((P, 16), np.int32)
  pos_weight = np.zeros((P, 16), np.float32)
  rope_hw = np.zeros((P, 2), np.int32)
  segment = np.full((P,), -1, np.int32)
  merge_index = np.zeros((P // M, M), np.int32)
  start = tok = 0
  for i, (_, h, w) in enumerate(grids.tolist()):
    rows, cols = np.divmod(np.arange(h * w), w)
    ht, hw_ = _bicubic_taps(rows, h, side_h)
    wt, ww = _bicubic_taps(cols, w, side_w)
    sl = slice(start, start + h * w)
    pos_index[sl] = (ht[:, :, None] * side_w + wt[:, None, :]).reshape(-1, 16)
    pos_weight[sl] = (hw_[:, :, None] * ww[:, None, :]).reshape(-1, 16)
    rope_hw[sl] = np.stack([rows, cols], -1)
    segment[sl] = i
    # Token (r, c) of the merged grid takes patches (kh*r + a, kw*c + b), a-major.
    grid = np.arange(h * w).reshape(h // kh, kh, w // kw, kw).transpose(0, 2, 1, 3)
    n_tok = (h // kh) * (w // kw)
    merge_index[tok:tok + n_tok] = start + grid.reshape(n_tok, M)
    start, tok = start + h * w, tok + n_tok
  return VisionInputs(pos_index, pos_weight, rope_hw, segment, merge_index)


def num_tokens(grid_thws: Any, cfg: VisionConfig) -> int:
  grids = np.asarray(grid_thws, np.int64).reshape(-1, 3)
  return int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum()) // cfg.merge_size


# ---- the tower ------------------------------------------------------------------------------

def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis in float32, returned in x's dtype."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(rope_hw: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
  """[P, hd] cos, sin of the axial 2D rotary embedding in rotate-half layout: frequency j of
  the first half is (w * f_j, h * f_j) for pairs j, repeated in the second half."""
  quarter = cfg.head_dim // 2  # the per-axis rotary width
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, quarter, 2, dtype=jnp.float32) / quarter))
  f = rope_hw.astype(jnp.float32)[:, :, None] * inv_freq  # [P, 2 (h, w), hd/4]
  wh = jnp.stack([f[:, 1], f[:, 0]], axis=-1).reshape(f.shape[0], -1)  # [P, hd/2]
  full = jnp.concatenate([wh, wh], axis=-1)
  return jnp.cos(full), jnp.sin(full)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [P, nH, hd] rotated in float32 (rotate-half layout), returned in x's dtype."""
  xf = x.astype(jnp.float32)
  half = xf.shape[-1] // 2
  rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


def _attend_block(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array,
                  scale: float) -> jax.Array:
  """q [Q, nH, hd] against all keys, only where the segments match. -> [Q, nH, hd]."""
  s = jnp.einsum("qnh,knh->nqk", q, k, preferred_element_type=jnp.float32) * scale
  s = jnp.where((seg_q[:, None] == seg_k[None, :])[None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("nqk,knh->qnh", p, v)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array,
                      scale: float) -> jax.Array:
  """Bidirectional attention of each patch over the patches of its own image."""
  P = q.shape[0]
  if P <= ATTN_BLOCK:
    return _attend_block(q, k, v, segment, segment, scale)
  n = -(-P // ATTN_BLOCK)
  pad = n * ATTN_BLOCK - P
  qb = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(n, ATTN_BLOCK, *q.shape[1:])
  sb = jnp.pad(segment, (0, pad), constant_values=-1).reshape(n, ATTN_BLOCK)
  out = jax.lax.map(lambda a: _attend_block(a[0], k, v, a[1], segment, scale), (qb, sb))
  return out.reshape(n * ATTN_BLOCK, *q.shape[1:])[:P]


def _params(module: nnx.Module, names: Any) -> dict[str, jax.Array]:
  return {n: getattr(module, n)[...] for n in names}


class VisionBlock(nnx.Module):
  """One pre-LayerNorm block: 2D-rotary attention within each image, then a GELU-tanh MLP.
  q, k, v [D, nV, hd] (q, k in rotate-half layout), o [nV, hd, D], fc1 [D, I], fc2 [I, D]."""

  def __init__(self, cfg: VisionConfig, init: ParamInit):
    self.cfg = cfg
    for name, shape in vision_param_shapes(cfg)["layers"][0].items():
      setattr(self, name, init(name, shape))

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment: jax.Array
               ) -> jax.Array:
    """x [P, D] -> [P, D]; patches attend only to those of their own segment (image)."""
    cfg = self.cfg
    p = _params(self, vision_param_shapes(cfg)["layers"][0])
    eps = cfg.layer_norm_eps
    h = layer_norm(x, p["attn_norm"], p["attn_norm_bias"], eps)
    q = _rotate(jnp.einsum("pd,dnh->pnh", h, p["q"]) + p["q_bias"], cos, sin)
    k = _rotate(jnp.einsum("pd,dnh->pnh", h, p["k"]) + p["k_bias"], cos, sin)
    v = jnp.einsum("pd,dnh->pnh", h, p["v"]) + p["v_bias"]
    a = segment_attention(q, k, v, segment, cfg.head_dim ** -0.5)
    x = x + jnp.einsum("pnh,nhd->pd", a, p["o"]) + p["o_bias"]
    h = layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], eps)
    h = jax.nn.gelu(h @ p["fc1"] + p["fc1_bias"], approximate=True)
    return x + h @ p["fc2"] + p["fc2_bias"]


class VisionTower(nnx.Module):
  """MoonViT and the patch-merger projector: patch embedding + resampled position table,
  `num_layers` `VisionBlock`s, final LayerNorm, 2x2 patch merge -> Linear -> GELU -> Linear to
  the text width. Never quantized."""

  _OWN = ("patch_embed", "patch_bias", "pos_emb", "final_norm", "final_norm_bias", "proj_norm",
          "proj_norm_bias", "proj_in", "proj_in_bias", "proj_out", "proj_out_bias")

  def __init__(self, cfg: VisionConfig, init: ParamInit):
    self.cfg = cfg
    shapes = vision_param_shapes(cfg)
    for name in self._OWN:
      setattr(self, name, init(name, shapes[name]))
    self.layers = nnx.List([VisionBlock(cfg, init) for _ in range(cfg.num_layers)])

  def __call__(self, pixel_values: jax.Array, inputs: VisionInputs) -> jax.Array:
    """pixel_values [P, 3, p, p] -> [P // M, text hidden] (`VisionInputs` for P patches)."""
    cfg = self.cfg
    p = _params(self, self._OWN)
    dtype = p["patch_embed"].dtype
    P = pixel_values.shape[0]
    x = pixel_values.reshape(P, -1).astype(dtype) @ p["patch_embed"] + p["patch_bias"]
    table = p["pos_emb"].reshape(-1, cfg.hidden_size).astype(jnp.float32)
    pos = jnp.zeros(x.shape, jnp.float32)
    for t in range(inputs.pos_index.shape[1]):  # tap by tap: never a [P, 16, D] gather
      pos = pos + inputs.pos_weight[:, t, None] * table[inputs.pos_index[:, t]]
    x = x + pos.astype(dtype)
    cos, sin = rope_cos_sin(inputs.rope_hw, cfg)
    for layer in self.layers:
      x = layer(x, cos, sin, inputs.segment)
    x = layer_norm(x, p["final_norm"], p["final_norm_bias"], cfg.layer_norm_eps)
    merged = layer_norm(x[inputs.merge_index], p["proj_norm"], p["proj_norm_bias"],
                        cfg.projection_ln_eps)  # [T, M, D]
    h = merged.reshape(merged.shape[0], -1) @ p["proj_in"] + p["proj_in_bias"]
    h = jax.nn.gelu(h, approximate=False)
    return h @ p["proj_out"] + p["proj_out_bias"]


@functools.cache
def _tower_graphdef(cfg: VisionConfig) -> Any:
  return nnx.graphdef(VisionTower(cfg, ParamInit(None)))


def tower(params: Params, cfg: VisionConfig) -> VisionTower:
  """`params["vision"]` (arrays or tracers) as a `VisionTower`."""
  state = dict(params, layers=dict(enumerate(params["layers"])))
  return nnx.merge(_tower_graphdef(cfg), state)


def _encode_patches(params: Params, pixel_values: jax.Array, inputs: VisionInputs, *,
                    cfg: VisionConfig) -> jax.Array:
  return tower(params, cfg)(pixel_values, inputs)


# Jitted per (num_patches, cfg, dtypes): -> [num_patches // M, text hidden].
encode_patches = jax.jit(_encode_patches, static_argnames=("cfg",))


def encode_images(params: Params, pixel_values: Any, grid_thws: Any, *, cfg: VisionConfig,
                  num_patches: int | None = None) -> jax.Array:
  """Image features for the <|media_pad|> slots: [sum of tokens, text hidden], image by image.

  params: `params["vision"]`. pixel_values: float32 [sum of patches, 3, p, p] (as
  `image_processing.preprocess` returns them); grid_thws: int [n_images, 3] (host values).
  num_patches: pad the patches to this many (a shape bucket; >= the real count, a multiple of
  the merge size), so batches of different images share one compiled program.
  """
  pixel_values = np.asarray(pixel_values, np.float32)
  inputs = vision_inputs(grid_thws, cfg, num_patches)
  P = inputs.segment.shape[0]
  if pixel_values.shape[0] != int((inputs.segment >= 0).sum()):
    raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thws "
                     f"{np.asarray(grid_thws).tolist()} describe {int((inputs.segment >= 0).sum())}")
  if P > pixel_values.shape[0]:
    pixel_values = np.concatenate(
        [pixel_values, np.zeros((P - pixel_values.shape[0],) + pixel_values.shape[1:],
                                np.float32)])
  out = encode_patches(params, jnp.asarray(pixel_values), VisionInputs(*map(jnp.asarray, inputs)),
                       cfg=cfg)
  n = num_tokens(grid_thws, cfg)
  return out if n == out.shape[0] else out[:n]
