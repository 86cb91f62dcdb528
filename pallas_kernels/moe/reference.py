"""Plain-JAX MoE routing and expert computation: the reference for the Pallas kernels.

Routing follows the model families exactly:
* `noaux_tc` (DeepSeek-V3, Kimi-K2): sigmoid scores; choice = scores + e_score_correction_bias;
  keep the `topk_group` groups whose two best choices sum highest; top-k of the choice; weights are
  the *uncorrected* scores of the chosen experts, optionally normalised, times
  `routed_scaling_factor`.
* `greedy` (DeepSeek-V2, Qwen3-MoE): softmax scores, top-k.
* `group_limited_greedy` (DeepSeek-V2): groups ranked by their best score, others zeroed, top-k.
For the last two, DeepSeek-V2's rule applies: normalise when `norm_topk_prob`, else scale by
`routed_scaling_factor`.

Shapes: T tokens, H hidden, E experts, k experts per token, I expert width.

Expert weights may be plain arrays or kept quantized (`pallas_kernels.quant.Int4Weight` INT4,
`Fp8Weight` FP8 blocks; same logical shapes). Quantized experts are dequantized inside the
program, only where used: the gathered formulation dequantizes the copies' gathered experts;
the all-experts and tiled ones run one expert (one tile's expert) at a time in a `lax.map`, so
the float copy of every expert never exists; `lax.ragged_dot` (which wants whole float
weights) is not used for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import dequantize, is_quantized


def route(router_logits: jax.Array, correction_bias: jax.Array | None, *, scoring_func: str,
          topk_method: str, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
          routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
  """Chooses experts per token.

  Args:
    router_logits: [T, E] float32 (hidden @ router).
    correction_bias: [E] float32 for noaux_tc, else None.
  Returns:
    (weights [T, k] float32, expert_ids [T, k] int32).
  """
  logits = router_logits.astype(jnp.float32)
  t, e = logits.shape
  if scoring_func == "sigmoid":
    scores = jax.nn.sigmoid(logits)
  else:
    scores = jax.nn.softmax(logits, axis=-1)

  if topk_method == "noaux_tc":
    choice = scores if correction_bias is None else scores + correction_bias[None, :]
    if n_group > 1:
      grouped = choice.reshape(t, n_group, e // n_group)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
      choice = _keep_top_groups(grouped, group_scores, topk_group, -jnp.inf).reshape(t, e)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
  else:
    choice = scores
    if topk_method == "group_limited_greedy" and n_group > 1:
      grouped = scores.reshape(t, n_group, e // n_group)
      group_scores = jnp.max(grouped, axis=-1)
      choice = _keep_top_groups(grouped, group_scores, topk_group, 0.0).reshape(t, e)
    weights, ids = jax.lax.top_k(choice, top_k)
  return finish_weights(weights, topk_method, norm_topk_prob, routed_scaling_factor), \
      ids.astype(jnp.int32)


def finish_weights(weights: jax.Array, topk_method: str, norm_topk_prob: bool,
                   routed_scaling_factor: float) -> jax.Array:
  """The chosen experts' weights [T, k] as DeepSeek combines them: noaux_tc renormalises (if
  norm_topk_prob) and always scales; the greedy methods renormalise (k > 1) or else scale."""
  normalise = norm_topk_prob and (topk_method == "noaux_tc" or weights.shape[-1] > 1)
  if normalise:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  if topk_method == "noaux_tc" or not normalise:
    weights = weights * routed_scaling_factor
  return weights


def _keep_top_groups(grouped: jax.Array, group_scores: jax.Array, topk_group: int,
                     fill: float) -> jax.Array:
  """Replaces the experts of all but the best `topk_group` groups with `fill`."""
  _, top_groups = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
  n_group = group_scores.shape[-1]
  keep = jnp.any(top_groups[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)
  return jnp.where(keep[:, :, None], grouped, fill)


def _deq(w, dtype):
  """A quantized (INT4 / FP8) weight dequantized to `dtype`; a plain array unchanged."""
  return dequantize(w, dtype) if is_quantized(w) else w


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """down(silu(x @ gate) * (x @ up)) for x [..., H], gate/up [H, I], down [I, H] (arrays, or
  quantized weights dequantized here to x's dtype)."""
  w_gate, w_up, w_down = (_deq(w, x.dtype) for w in (w_gate, w_up, w_down))
  h = jax.nn.silu(x @ w_gate) * (x @ w_up)
  return h @ w_down


def _mapped_mlp(xb: jax.Array, sel: jax.Array, w_gate, w_up, w_down) -> jax.Array:
  """For packed weights: [G, M, H] rows, [G] expert per block -> [G, M, H], one block (and
  one expert dequantized) at a time."""
  def one(args):
    xg, e = args
    return swiglu_mlp(xg, w_gate[e], w_up[e], w_down[e])
  return jax.lax.map(one, (xb, sel))


def layer_of(w, layer):
  """Layer `layer` of stacked expert weights [L, E, ...] (arrays or quantized weights)."""
  return jax.tree.map(lambda a: a[layer], w)


def moe_experts(x: jax.Array, weights: jax.Array, expert_ids: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, *, expert_offset: int = 0,
                layer: jax.Array | int | None = None) -> jax.Array:
  """Weighted sum of the chosen experts' SwiGLU MLPs, over a local shard of experts.

  Picks one of four equivalent formulations by the (static) shapes, cheapest first on CPU:
  * few copies (T*k <= E_local, decode sizes, see `_gather_pays`): each copy gathers its
    expert's weights (`moe_experts_gathered`), so a step reads only the chosen experts;
  * few tokens (`_dense_pays`): every expert on every token as one wide MLP
    (`moe_experts_all`), E_local/k times the work but three plain matmuls;
  * more tokens: copies sorted by expert into row tiles of one expert each
    (`moe_experts_tiled`), a batched matmul over the tiles;
  * when the tiles' gathered weights would be too big: `lax.ragged_dot` groups
    (`moe_experts_ragged`). XLA:CPU lowers `ragged_dot` to a loop over every expert over all
    copies (E_local times the work): measured on the demo model's shapes (E 8, k 2, H 256,
    I 160) it was 2-5x slower than the others at 32 to 2048 tokens.
  Copies routed to experts outside [expert_offset, expert_offset + E_local) contribute zero, so
  expert-parallel shards can sum their partial outputs.

  Args:
    x: [T, H].
    weights: [T, k] float32 routing weights; expert_ids: [T, k] int32 global expert ids.
    w_gate, w_up: [E_local, H, I]; w_down: [E_local, I, H]; or, with `layer`, stacks of L
      layers' experts ([L, E_local, H, I], [L, E_local, I, H]) of which layer `layer` runs.
    layer: int32 scalar (a scanned layer stack's position). The layer's experts are indexed in
      the stack where each formulation reads them (XLA fuses the index into the gathers and
      the quantized experts' dequantization; XLA:CPU materialises a dot's operand).
  Returns:
    [T, H] in x's dtype.
  """
  if layer is not None:
    w_gate, w_up, w_down = (layer_of(w, layer) for w in (w_gate, w_up, w_down))
  args = (x, weights, expert_ids, w_gate, w_up, w_down)
  if _gather_pays(expert_ids.size, w_gate):
    return moe_experts_gathered(*args, expert_offset=expert_offset)
  tile = _tile_rows(expert_ids.size, w_gate.shape[0])
  if _dense_pays(x.shape[0], expert_ids.size, w_gate.shape[0], tile):
    return moe_experts_all(*args, expert_offset=expert_offset)
  if is_quantized(w_gate):  # tiles run one at a time: the gathered tile weights never all exist
    return moe_experts_tiled(*args, expert_offset=expert_offset, tile=tile)
  num_tiles = -(-expert_ids.size // tile) + w_gate.shape[0]
  if num_tiles * _expert_bytes(w_gate) <= GATHER_MAX_BYTES:
    return moe_experts_tiled(*args, expert_offset=expert_offset, tile=tile)
  return moe_experts_ragged(*args, expert_offset=expert_offset)


def moe_experts_ragged(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                       w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                       expert_offset: int = 0) -> jax.Array:
  """`moe_experts` as token copies sorted by expert, run as ragged groups (`lax.ragged_dot`),
  combined back in token order."""
  t, h = x.shape
  k = expert_ids.shape[1]
  if is_quantized(w_gate):
    raise NotImplementedError("moe_experts_ragged takes float expert weights (lax.ragged_dot); "
                              "quantized experts use moe_experts_tiled")
  e_local = w_gate.shape[0]
  local = expert_ids.reshape(-1) - expert_offset  # [T*k]
  in_shard = (local >= 0) & (local < e_local)
  # Out-of-shard copies sort last, into a group of their own that no expert computes.
  sort_key = jnp.where(in_shard, local, e_local)
  order = jnp.argsort(sort_key, stable=True)
  token_of_copy = order // k
  xs = x[token_of_copy]  # [T*k, H]
  group_sizes = jnp.bincount(sort_key, length=e_local + 1).astype(jnp.int32)[:e_local]
  gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
  up = jax.lax.ragged_dot(xs, w_up, group_sizes)
  y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [T*k, H]
  y_copies = jnp.zeros_like(y).at[order].set(y)  # back to copy order [T*k, H]
  return _combine(y_copies.reshape(t, k, h), weights, in_shard.reshape(t, k), x.dtype)


def _expert_bytes(w_gate: jax.Array) -> int:
  """Bytes of one expert's three matrices once gathered in float (quantized: as bf16)."""
  _, h, i = w_gate.shape
  return 3 * h * i * (2 if is_quantized(w_gate) else w_gate.dtype.itemsize)


def _tile_rows(copies: int, e_local: int) -> int:
  """Rows per tile of `moe_experts_tiled`: about copies / E_local (so padding, at most one
  partial tile per expert, stays near the real work), a power of two in [64, 256]."""
  per_expert = max(copies // e_local, 1)
  return min(256, max(64, 1 << (per_expert.bit_length() - 1)))


def _dense_pays(tokens: int, copies: int, e_local: int, tile: int) -> bool:
  """Every expert on every token costs tokens * E_local rows; the tiles cost up to
  (ceil(copies / tile) + E_local) * tile rows plus the sort and gathers."""
  return tokens * e_local <= (-(-copies // tile) + e_local) * tile


def moe_experts_all(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                    w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                    expert_offset: int = 0) -> jax.Array:
  """`moe_experts` with every local expert run on every token (batched over experts,
  [E_local, T, H] outputs); each token then takes its k chosen experts' rows (`_combine`)."""
  e_local = w_gate.shape[0]
  local = expert_ids - expert_offset  # [T, k]
  in_shard = (local >= 0) & (local < e_local)
  # Batched over experts ([E, T, H] x [E, H, I]): contracting H of [E, H, I] against [T, H]
  # directly makes XLA:CPU transpose every expert's weights on every call.
  xb = jnp.broadcast_to(x[None], (e_local,) + x.shape)
  if is_quantized(w_gate):
    y = _mapped_mlp(xb, jnp.arange(e_local), w_gate, w_up, w_down)  # [E, T, H]
  else:
    gate = jnp.einsum("eth,ehi->eti", xb, w_gate)
    up = jnp.einsum("eth,ehi->eti", xb, w_up)
    y = jnp.einsum("eti,eih->eth", jax.nn.silu(gate) * up, w_down)  # [E, T, H]
  tokens = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
  return _combine(y[jnp.clip(local, 0, e_local - 1), tokens], weights, in_shard, x.dtype)


def _combine(y: jax.Array, weights: jax.Array, in_shard: jax.Array, dtype) -> jax.Array:
  """sum_j weights[t, j] * y[t, j] over a token's k copies [T, k, H], in float32 and slot
  order. Every formulation combines through here and computes each copy's MLP row by row in
  the same dtype, so a token's output depends on the formulation its token count picked only
  through the dots' float32 accumulation order, which XLA:CPU's kernel for each dot shape (and
  the CPU's instruction set) decides: equal in float32 to rounding, in bf16 to one rounding
  of an element now and then (`tests/test_moe_reference.py`)."""
  w = jnp.where(in_shard, weights, 0.0).astype(jnp.float32)
  return jnp.sum(y.astype(jnp.float32) * w[:, :, None], axis=1).astype(dtype)


def moe_experts_tiled(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                      w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                      expert_offset: int = 0, tile: int = 128) -> jax.Array:
  """`moe_experts` with copies sorted by expert into `tile`-row tiles of one expert each (each
  expert's group padded to whole tiles: at most ceil(T*k / tile) + E_local tiles), one batched
  matmul over the tiles with each tile's expert weights gathered. Gathers only, no scatters."""
  t, h = x.shape
  k = expert_ids.shape[1]
  e_local = w_gate.shape[0]
  n = t * k
  local = expert_ids.reshape(-1) - expert_offset
  in_shard = (local >= 0) & (local < e_local)
  key = jnp.where(in_shard, local, e_local)  # out-of-shard copies: a group nobody computes
  order = jnp.argsort(key, stable=True).astype(jnp.int32)  # sorted slot -> copy
  sizes = jnp.bincount(key, length=e_local + 1).astype(jnp.int32)[:e_local]
  padded = (sizes + tile - 1) // tile * tile
  pad_end = jnp.cumsum(padded)
  pad_start = pad_end - padded
  sorted_start = jnp.cumsum(sizes) - sizes
  num_tiles = -(-n // tile) + e_local
  rows = jnp.arange(num_tiles * tile, dtype=jnp.int32)
  row_expert = jnp.minimum(jnp.searchsorted(pad_end, rows, side="right"), e_local - 1)
  within = rows - pad_start[row_expert]
  real = within < sizes[row_expert]
  copy = order[jnp.where(real, sorted_start[row_expert] + within, 0)]
  xt = jnp.where(real[:, None], x[copy // k], 0).reshape(num_tiles, tile, h)
  te = row_expert[::tile]  # each tile's expert
  if is_quantized(w_gate):
    y = _mapped_mlp(xt, te, w_gate, w_up, w_down).reshape(-1, h)
  else:
    gate = jnp.einsum("gmh,ghi->gmi", xt, w_gate[te])
    up = jnp.einsum("gmh,ghi->gmi", xt, w_up[te])
    y = jnp.einsum("gmi,gih->gmh", jax.nn.silu(gate) * up, w_down[te]).reshape(-1, h)
  # Back from padded rows to copies: copy c sits at sorted slot inv[c].
  inv = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
  e_of = jnp.minimum(key, e_local - 1)
  row = jnp.clip(pad_start[e_of] + inv - sorted_start[e_of], 0, num_tiles * tile - 1)
  return _combine(y[row].reshape(t, k, h), weights, in_shard.reshape(t, k), x.dtype)


GATHER_MAX_BYTES = 1 << 30


def _gather_pays(copies: int, w_gate: jax.Array) -> bool:
  """Gather per-copy weights when there are at most a quarter as many copies as local experts
  and the gathered weights stay under GATHER_MAX_BYTES. Measured on CPU (demo model, 8 experts,
  verify probes of `SpecPolicy.measure_costs`): 8 copies gathered took 3.3 ms per forward
  against 1.6 ms for every expert on every token, 4 copies 2.2 ms against 1.5 ms; 2 copies
  gathered were the fastest."""
  return 4 * copies <= w_gate.shape[0] and copies * _expert_bytes(w_gate) <= GATHER_MAX_BYTES


def moe_experts_gathered(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                         expert_offset: int = 0) -> jax.Array:
  """`moe_experts` for a few tokens: every token copy gathers its own expert's weights, so a
  step reads only the chosen experts ([T, k, H, I] gathered; use when T * k <= E_local)."""
  e_local = w_gate.shape[0]
  local = expert_ids - expert_offset  # [T, k]
  in_shard = (local >= 0) & (local < e_local)
  idx = jnp.clip(local, 0, e_local - 1)
  # Packed experts: only the copies' experts are gathered (still packed) and dequantized.
  wg, wu, wd = (_deq(w[idx], x.dtype) for w in (w_gate, w_up, w_down))
  gate = jnp.einsum("th,tkhi->tki", x, wg)
  up = jnp.einsum("th,tkhi->tki", x, wu)
  y = jnp.einsum("tki,tkih->tkh", jax.nn.silu(gate) * up, wd)  # [T, k, H]
  return _combine(y, weights, in_shard, x.dtype)


def moe_experts_dense(x: jax.Array, weights: jax.Array, expert_ids: jax.Array,
                      w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                      expert_offset: int = 0) -> jax.Array:
  """`moe_experts` as a dense loop over the local experts: every expert runs on every token and
  is weighted by the routing weight the token gave it (0 if it did not choose it). Slow (E
  times the work), obviously correct: the reference the grouped kernels are tested against.
  """
  e_local = w_gate.shape[0]
  local = expert_ids - expert_offset  # [T, k]

  def one_expert(acc, e):
    w = jnp.sum(jnp.where(local == e, weights, 0.0), axis=-1)  # [T]
    y = swiglu_mlp(x, w_gate[e], w_up[e], w_down[e])
    return acc + y.astype(jnp.float32) * w[:, None], None

  out, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32),
                        jnp.arange(e_local, dtype=jnp.int32))
  return out.astype(x.dtype)
