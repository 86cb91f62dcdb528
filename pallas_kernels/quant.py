"""Quantized weights kept packed in device memory, and their dequantization inside a program.

Two formats: `Int4Weight` (below) and `Fp8Weight` (DeepSeek-style FP8 with a float32 scale per
128 x 128 block, its expert axis leading in the same way).

`Int4Weight` is a stacked [E, K, N] matrix (x @ W layout: K inputs, N outputs per expert) held
as symmetric INT4 with one scale per group of `group` consecutive inputs, the compressed-tensors
"pack-quantized" scheme Kimi K2.5 / K2-Thinking ship their routed experts in, its packed bytes
in the checkpoint's own order (each expert's [out, in] = [N, K] rows, K contiguous):

    packed  uint8 [E, N, K/2]          byte [e, n, j] = elements k = 2j (low nibble) and
                                       k = 2j + 1 (high nibble) of column n, each stored as q + 8
                                       (compressed-tensors' int32 words [N, K/8] viewed as bytes)
    scale   bf16 (as stored) [E, K/group, N]
    W[e, k, n] = (nibble - 8).astype(scale.dtype) * scale[e, k // group, n]

K-contiguous rows are what the W4A16 kernel (`moe/w4a16_mgpu.py`) loads into WGMMA's register
operand: a weight row is the MMA's M row, its inputs the K columns, so the loader's repack is a
byte view of the stored words with no transpose.

The product is taken in the scale's dtype, as compressed-tensors' `dequantize` does (for bf16
scales a bf16-rounded product), and only then cast to the compute dtype, so a float32 forward
sees exactly the weights the library's decompression gives. The expert axis leads: indexing
or gathering experts (`w[ids]`) keeps the result packed, and sharding splits whole experts, so
no packed byte is ever split. An `Int4Weight` is a pytree (children `packed`, `scale`) and goes
through jit, shard_map and device_put like the plain array it replaces; `shape` is the logical
[E, K, N].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INT4_OFFSET = 8  # stored nibble = q + 8, q in [-8, 7]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
  """Symmetric group-quantized INT4 [..., K, N] (see the module docstring)."""
  packed: Any  # uint8 [..., N, K/2]
  scale: Any  # [..., K/group, N]

  @property
  def group(self) -> int:
    return 2 * self.packed.shape[-1] // self.scale.shape[-2]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.packed.shape[:-2]) + (2 * self.packed.shape[-1], self.packed.shape[-2])

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(self.packed.nbytes) + int(self.scale.nbytes)

  def __getitem__(self, idx: Any) -> "Int4Weight":
    """Indexes the leading (expert) axes only: the result is still packed."""
    return Int4Weight(self.packed[idx], self.scale[idx])


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
  """FP8 block-quantized weight (DeepSeek-V3 / Kimi-K2-Instruct): float8_e4m3fn values in the
  parameter's own layout and a float32 scale per (bk x bn) block of the [K, N] matrix it
  flattens to: `lead` leading axes (those scale_inv shares with w: the expert axis of stacked
  experts, a stack's layer axis), then `n_in` input axes (K is their product), then the output
  axes (N). W = w * scale_inv[..., k // bk, n // bn]. Indexing or stacking the children
  (`jax.tree.map`) keeps it valid: `lead` follows scale_inv's rank."""
  w: Any  # float8_e4m3fn, e.g. [E, K, N] experts, [q_lora, nH, d] q_b, [nH, dv, H] o
  scale_inv: Any  # float32 [*lead, ceil(K/bk), ceil(N/bn)]
  block: tuple[int, int] = (128, 128)  # (bk, bn), static
  n_in: int = 1  # static

  @property
  def lead(self) -> int:
    return len(self.scale_inv.shape) - 2

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.w.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(self.w.nbytes) + int(self.scale_inv.nbytes)

  def __getitem__(self, idx: Any) -> "Fp8Weight":
    """Indexes the leading (expert) axes only."""
    if not self.lead:
      raise TypeError("an Fp8Weight without leading axes is not indexable")
    return Fp8Weight(self.w[idx], self.scale_inv[idx], self.block, self.n_in)


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["w", "scale_inv"],
                                 meta_fields=["block", "n_in"])


def is_int4(w: Any) -> bool:
  return isinstance(w, Int4Weight)


def is_fp8(w: Any) -> bool:
  return isinstance(w, Fp8Weight)


def is_quantized(w: Any) -> bool:
  """A weight kept quantized in memory (dequantized where a program uses it)."""
  return isinstance(w, (Int4Weight, Fp8Weight))


def unpack_int4(packed: jax.Array) -> jax.Array:
  """uint8 [..., N, K/2] -> int8 q in [-8, 7] [..., K, N] (low nibble first along K)."""
  p = packed.astype(jnp.uint8)
  lo = (p & 0xF).astype(jnp.int8) - INT4_OFFSET
  hi = (p >> 4).astype(jnp.int8) - INT4_OFFSET
  q = jnp.stack([lo, hi], axis=-1)  # [..., N, K/2, 2]
  return jnp.swapaxes(q.reshape(*p.shape[:-1], 2 * p.shape[-1]), -1, -2)


def dequantize(w: Any, dtype: Any) -> jax.Array:
  """The float [..., K, N] matrix in `dtype`: `w` itself when it is not quantized. FP8: the
  float32 product w * scale_inv (as the loader's load-time dequantization), then `dtype`."""
  if is_fp8(w):
    shape = w.w.shape
    lead = shape[:w.lead]
    k = int(np.prod(shape[w.lead:w.lead + w.n_in]))
    n = int(np.prod(shape[w.lead + w.n_in:]))
    bk, bn = w.block
    v = w.w.astype(jnp.float32).reshape(*lead, k, n)
    if k % bk == 0 and n % bn == 0:  # whole blocks: broadcast each scale over its block
      deq = v.reshape(*lead, k // bk, bk, n // bn, bn) * w.scale_inv[..., :, None, :, None]
    else:
      deq = v * jnp.repeat(jnp.repeat(w.scale_inv, bk, axis=-2), bn, axis=-1)[..., :k, :n]
    return deq.reshape(shape).astype(dtype)
  if not is_int4(w):
    return w.astype(dtype) if w.dtype != dtype else w
  q = unpack_int4(w.packed)
  k, n = q.shape[-2], q.shape[-1]
  g = w.group
  grouped = q.reshape(*q.shape[:-2], k // g, g, n).astype(w.scale.dtype)
  deq = grouped * w.scale[..., :, None, :]  # in the scale's dtype, as compressed-tensors
  return deq.reshape(*q.shape[:-2], k, n).astype(dtype)


def dequantize_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """Host twin of `dequantize` (float32 result of the scale-dtype product), for tests/tools."""
  p = np.asarray(packed, np.uint8)
  q = np.stack([(p & 0xF).astype(np.int8) - INT4_OFFSET, (p >> 4).astype(np.int8) - INT4_OFFSET],
               axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1]).swapaxes(-1, -2)
  s = np.asarray(scale)
  g = q.shape[-2] // s.shape[-2]
  grouped = q.reshape(*q.shape[:-2], q.shape[-2] // g, g, q.shape[-1]).astype(s.dtype)
  deq = (grouped * s[..., :, None, :]).astype(s.dtype)
  return deq.reshape(q.shape).astype(np.float32)


