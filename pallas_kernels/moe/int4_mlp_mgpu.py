"""W4A16 expert SwiGLU MLP on INT4 experts (Kimi K2.5's routed experts): the MoE layer around
the `w4a16_mgpu` kernel.

  gate_up:  hT[s, I, nt] = silu(Wg[e]^T @ xs[s]^T) * (Wu[e]^T @ xs[s]^T)
  down:     yT[s, H, nt] = Wd[e]^T @ h[s]^T

Every active local expert owns slots of `block_tokens` rows in `permute.py`'s layout: 8 rows up
to 64 tokens (a decode or verify step: an expert gets ~T k / E copies, so 8-row slots, with an
overflow slot for a busier expert, keep the MMA and the activation traffic at the tokens that
exist), 64 rows above. Unused slots are skipped without reading their weights.

Per kernel call the K split is chosen on device from the used slot count (`choose_splits`: the
fewest rounds of work units over the SMs, each unit paying `split_overhead` steps), up to a
static `max_splits` (f32 partials of at most `partial_budget` bytes). With one split at most
the kernel writes its result itself (gate/up: the bf16 SwiGLU h); otherwise XLA sums the
partials (reading only the splits used) and applies the SwiGLU, and the down partials go
straight into the weighted combine. The activations enter each kernel in the K order of
`w4a16_layout.permute_k` (a transpose XLA fuses into the permutation's gather).

Shapes: x [T, H] bf16, weights [T, k] f32, expert_ids [T, k] int32 (global ids, distinct per
token), w_gate / w_up `Int4Weight` [E_local, H, I], w_down [E_local, I, H] -> [T, H]; with
`layer` (int32), stacks [L, E_local, ...] of which layer `layer`'s experts run.
Limits (`problem`): bf16 activations; H and I multiples of 128; group a multiple of 16 that
divides the K step (Kimi's 32; 128 too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.moe import permute as permute_lib
from pallas_kernels.moe import w4a16_mgpu
from pallas_kernels.moe.w4a16_layout import permute_k
from pallas_kernels.quant import Int4Weight, dequantize, is_int4

Int4Config = w4a16_mgpu.W4A16Config
DECODE_TOKENS = 64  # up to here 8-row slots
PREFILL_BLOCK_TOKENS = 64


def block_tokens(num_tokens: int) -> int:
  """Slot height for a call with `num_tokens` tokens."""
  return 8 if num_tokens <= DECODE_TOKENS else PREFILL_BLOCK_TOKENS


def fit_config(k: int, nt: int, nw: int, group: int, final: bool, cfg: Int4Config) -> Int4Config:
  """cfg with a K step that divides k (cfg's, else 128) and whose SMEM ring takes 2 stages at
  least (at 64-row slots the SMEM-operand variant needs 128)."""
  a_smem = w4a16_mgpu.uses_smem_operand(cfg)
  for bk in dict.fromkeys((cfg.block_k, 128)):
    c = dataclasses.replace(cfg, block_k=bk)
    if k % bk == 0 and w4a16_mgpu.num_stages(nt, nw, group, final, a_smem, c):
      return c
  return cfg  # (the kernel's own check names the problem)


def max_splits(slots: int, nw: int, n: int, nt: int, k: int, cfg: Int4Config) -> int:
  """Static bound on a call's K splits: cfg.max_splits, one K step per split, and the f32
  partial buffer [splits, slots, nw, n, nt] within cfg.partial_budget."""
  per_split = slots * nw * n * nt * 4
  return max(1, min(cfg.max_splits, k // cfg.block_k, cfg.partial_budget // per_split))


def split_candidates(k_steps: int, bound: int) -> list[int]:
  """Split counts up to `bound`, one K step per split at least."""
  return list(range(1, min(bound, k_steps) + 1))


def choose_splits(used, n_tiles: int, k_steps: int, bound: int, cfg: Int4Config, xp=jnp):
  """The split count with the least modelled time: rounds of units over the SMs times (steps
  per unit + cfg.split_overhead); the smallest among equals. `used` may be traced (xp=jnp)
  or an int (xp=np)."""
  cands = split_candidates(k_steps, bound)
  s = xp.asarray(cands, xp.int32)
  rounds = (used * n_tiles * s + cfg.num_sms - 1) // cfg.num_sms
  cost = rounds * (xp.asarray([-(-k_steps // c) for c in cands], xp.float32)
                   + cfg.split_overhead)
  return s[xp.argmin(cost)]


def _matmul(act, ws, slot_expert, used, nt, cfg):
  """[S, nw, n, nt] f32 (or, with one split at most, the kernel's final [S, n, nt]) and
  whether it is final."""
  slots, k = act.shape[0] // nt, act.shape[1]
  n, nw, group = ws[0].shape[2], len(ws), ws[0].group
  bound = max_splits(slots, nw, n, nt, k, _k_step(k, cfg))
  final = bound == 1
  cfg = fit_config(k, nt, nw, group, final, cfg)  # (may shorten the K step: SMEM)
  for w in ws:
    w4a16_mgpu.check(act.dtype, w, nt, cfg)
  bound = 1 if final else min(bound, max_splits(slots, nw, n, nt, k, cfg))
  if final:
    sched = jnp.stack([used, jnp.int32(1)]).astype(jnp.int32)
    return w4a16_mgpu.expert_matmul(act, ws, slot_expert, sched, nt, cfg, final=True), True
  if cfg.splits:
    splits = jnp.int32(max(s for s in split_candidates(k // cfg.block_k, bound)
                           if s <= cfg.splits))
  else:
    splits = choose_splits(used, n // w4a16_mgpu.CTA_ROWS, k // cfg.block_k, bound, cfg)
  sched = jnp.stack([used, splits]).astype(jnp.int32)
  part = w4a16_mgpu.expert_matmul(act, ws, slot_expert, sched, nt, cfg, final=False,
                                  max_splits=bound)
  # Splits >= `splits` were never written: read split min(j, splits - 1) instead (the same
  # bytes again, from L2) and drop it.
  j = jnp.arange(bound)
  taken = part[jnp.minimum(j, splits - 1)]
  return jnp.sum(jnp.where((j < splits)[:, None, None, None, None], taken, 0.0), axis=0), False


def _k_step(k: int, cfg: Int4Config) -> Int4Config:
  return cfg if k % cfg.block_k == 0 else dataclasses.replace(cfg, block_k=128)


def swiglu_f32(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
               w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, nt: int,
               cfg: Int4Config = Int4Config()) -> jax.Array:
  """ys [S * nt, H] float32 = down(silu(xs @ gate) * (xs @ up)) per used slot's expert; rows of
  unused slots are zero. xs [S * nt, H] bf16 in natural K order."""
  slots = xs.shape[0] // nt
  used = num_slots[0].astype(jnp.int32)
  live = (jnp.arange(slots) < used)[:, None, None]
  gu, final = _matmul(permute_k(xs), (w_gate, w_up), slot_expert, used, nt, cfg)
  if not final:
    g, u = gu[:, 0], gu[:, 1]
    gu = (g / (1.0 + jnp.exp(-g)) * u).astype(xs.dtype)
  h = jnp.where(live, gu, 0).transpose(0, 2, 1).reshape(slots * nt, -1)  # [S * nt, I]
  y, final = _matmul(permute_k(h), (w_down,), slot_expert, used, nt, cfg)
  if not final:
    y = y[:, 0]
  return jnp.where(live, y, 0.0).transpose(0, 2, 1).reshape(slots * nt, -1)


def int4_swiglu(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
                w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, block_tokens: int,
                cfg: Int4Config = Int4Config()) -> jax.Array:
  """`swiglu_f32` in xs's dtype (the tiled kernels' contract)."""
  return swiglu_f32(xs, slot_expert, num_slots, w_gate, w_up, w_down, block_tokens,
                    cfg).astype(xs.dtype)


def int4_swiglu_reference(xs: jax.Array, slot_expert: jax.Array, num_slots: jax.Array,
                          w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight,
                          block_tokens: int, cfg: Int4Config = Int4Config()) -> jax.Array:
  """Plain JAX of `int4_swiglu`: the weights dequantized (bf16 product, as compressed-tensors),
  then the tiled SwiGLU reference of the bf16 kernels."""
  del cfg
  w = [dequantize(v, xs.dtype) for v in (w_gate, w_up, w_down)]
  return permute_lib.tiled_swiglu_reference(xs, slot_expert, num_slots, *w, block_tokens)


def problem(x_dtype, w_gate, w_up, w_down, cfg: Int4Config = Int4Config()) -> str | None:
  """Why the W4A16 kernels cannot take these experts (the first reason), or None: the fit
  predicate `moe="auto"` resolves with (through `moe_mgpu.moe_experts`' own checks)."""
  if not all(is_int4(w) for w in (w_gate, w_up, w_down)):
    return "W4A16 takes Int4Weight experts"
  _, h, i = w_gate.shape
  if h % 128 or i % 128:
    return (f"mosaic_gpu INT4 MoE needs hidden ({h}) and expert width ({i}) to be multiples "
            f"of 128 (its K step and row tile)")
  try:
    for w, k in ((w_gate, h), (w_up, h), (w_down, i)):
      w4a16_mgpu.check(x_dtype, w, 8, _k_step(k, cfg))
  except (ValueError, NotImplementedError) as e:
    return str(e)
  return None


def moe_experts_int4(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                     w_gate: Int4Weight, w_up: Int4Weight, w_down: Int4Weight, *,
                     expert_offset: int = 0,
                     layer: jax.Array | int | None = None,
                     cfg: Int4Config = Int4Config()) -> jax.Array:
  """`reference.moe_experts` contract through the W4A16 kernels, any token count; with
  `layer`, the weights are stacks [L, E_local, ...] and the kernels read layer `layer`'s
  experts in place (`permute.expert_pool`)."""
  if not all(is_int4(w) for w in (w_gate, w_up, w_down)):
    raise TypeError("moe_experts_int4 takes Int4Weight experts")
  (w_gate, w_up, w_down), e_local, base = permute_lib.expert_pool((w_gate, w_up, w_down), layer)
  why = problem(x.dtype, w_gate, w_up, w_down, cfg)
  if why:
    raise NotImplementedError(why)
  return permute_lib.moe_experts_slots(
      x, weights, expert_ids,
      lambda xs, se, ns, nt: swiglu_f32(xs, se, ns, w_gate, w_up, w_down, nt, cfg),
      num_local_experts=e_local, expert_offset=expert_offset,
      block_rows=block_tokens(expert_ids.shape[0]), base=base)
