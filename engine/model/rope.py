"""Rotary position embeddings: default, linear, YaRN (DeepSeek's mscale) and Llama-3 scaling.

The inverse frequencies are computed in numpy at trace time (they depend only on the config),
following transformers' `modeling_rope_utils` so that logits match the reference implementation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import RopeConfig, yarn_get_mscale


@functools.lru_cache(maxsize=None)
def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [dim // 2] float32, attention_factor applied to cos and sin)."""
  base = rope.theta
  inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  if rope.rope_type in ("default",):
    return inv.astype(np.float32), 1.0
  if rope.rope_type == "linear":
    return (inv / rope.factor).astype(np.float32), 1.0
  if rope.rope_type == "llama3":
    factor, lo, hi = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  if rope.rope_type == "yarn":
    return _yarn(rope, dim)
  raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  factor = rope.factor
  attention_factor = rope.attention_factor
  if attention_factor is None:
    if rope.mscale and rope.mscale_all_dim:
      attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(
          factor, rope.mscale_all_dim)
    else:
      attention_factor = yarn_get_mscale(factor)
  base, orig = rope.theta, rope.original_max_position_embeddings

  def correction_dim(num_rotations: float) -> float:
    return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
  if rope.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation_weight = 1 - ramp
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_extra = 1.0 / pos_freqs
  inv_inter = 1.0 / (factor * pos_freqs)
  inv = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
  return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(rope: RopeConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """positions [...] int -> (cos, sin) [..., dim // 2] float32, scaled by the attention factor."""
  inv, scale = inv_freq_and_scale(rope, dim)
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
  return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
  """Rotates x [B, T, (heads,) D] with cos/sin [B, T, D // 2].

  interleave=True rotates adjacent pairs and keeps them in place (DeepSeek layout); False
  rotates the first half against the second (Llama's rotate_half). Computed in float32.
  """
  dtype = x.dtype
  x = x.astype(jnp.float32)
  if x.ndim == cos.ndim + 1:  # a heads axis
    cos, sin = cos[..., None, :], sin[..., None, :]
  if interleave:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(dtype)
