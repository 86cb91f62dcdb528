"""MoE dispatch kernels: routing, permutation, Mosaic GPU grouped/decode expert MLPs.

The Mosaic GPU kernels run here in GPU interpret mode on CPU (an abstract H200 mesh); unwritten
output memory is NaN there (`uninitialized_memory="nan"`), so a kernel that skips part of a tile
fails the comparison. Every kernel is also exported for CUDA at Kimi-K2.5 shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # races, state reset

from engine.model import kernels
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import config_from_dict
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import init_params, layer_params
from engine.model.transformer import compute_logits, forward, moe as moe_layer
from cuda_export import MOSAIC_CALL, export_cuda_calls, gpu_interpret
from model_configs import CONFIGS
from pallas_kernels.moe import decode_mlp_mgpu, grouped_mlp_mgpu, moe_mgpu, permute, reference
from pallas_kernels.moe import routing

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep

jax.config.update("jax_default_matmul_precision", "highest")




# ---- routing ---------------------------------------------------------------------------------

ROUTE_CASES = [
    # scoring, method, k, n_group, topk_group, norm, scale
    ("sigmoid", "noaux_tc", 4, 4, 2, True, 2.5),  # DeepSeek-V3 style
    ("sigmoid", "noaux_tc", 8, 1, 1, True, 2.827),  # Kimi-K2
    ("sigmoid", "noaux_tc", 2, 2, 1, False, 1.0),
    ("softmax", "greedy", 6, 1, 1, False, 1.0),  # DeepSeek-V2-Lite
    ("softmax", "greedy", 2, 1, 1, True, 1.0),  # Qwen3-MoE
    ("softmax", "group_limited_greedy", 3, 4, 2, False, 16.0),  # DeepSeek-V2
]


def _route_both(logits, bias, scoring, method, k, n_group, topk_group, norm, scale):
  kw = dict(scoring_func=scoring, topk_method=method, top_k=k, n_group=n_group,
            topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
  b = jnp.asarray(bias) if method == "noaux_tc" else None
  got = jax.jit(lambda l, b: routing.route(l, b, **kw))(jnp.asarray(logits), b)
  want = reference.route(jnp.asarray(logits), b, **kw)
  return got, want


def _assert_same_route(got, want):
  # Same order too: best first, ties to the lower id, as lax.top_k.
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ROUTE_CASES)
@pytest.mark.parametrize("t,e", [(37, 16), (5, 384)])
def test_route_equals_reference(case, t, e):
  rng = np.random.default_rng(t)
  logits = rng.standard_normal((t, e)).astype(np.float32) * 2
  bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
  _assert_same_route(*_route_both(logits, bias, *case))


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_route_ties(case):
  # Few distinct logit values and a flat bias: many exact ties in scores, group scores and top-k.
  rng = np.random.default_rng(3)
  logits = rng.integers(-2, 2, (23, 16)).astype(np.float32)
  bias = np.repeat(np.float32([0.0, 0.5]), 8)
  _assert_same_route(*_route_both(logits, bias, *case))


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_route_all_tokens_to_one_expert(case):
  rng = np.random.default_rng(4)
  logits = rng.standard_normal((19, 16)).astype(np.float32) - 6.0
  logits[:, 5] = 6.0  # expert 5 dominates every token, and its group every group ranking
  bias = np.zeros(16, np.float32)
  got, want = _route_both(logits, bias, *case)
  _assert_same_route(got, want)
  assert (np.asarray(got[1])[:, 0] == 5).all()


def test_top_k_by_rank_equals_lax_top_k_with_ties_and_minus_inf():
  rng = np.random.default_rng(6)
  v = rng.integers(-3, 3, (9, 4, 12)).astype(np.float32)
  v[v < -2] = -np.inf  # whole -inf stretches, as masked groups produce
  want_v, want_i = jax.lax.top_k(jnp.asarray(v), 5)
  got_v, got_i = routing._top_k_by_rank(jnp.asarray(v), 5)
  np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
  np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


# ---- permutation -----------------------------------------------------------------------------

def _problem(t, e, k, h, i, dtype, seed=0, ids=None):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((t, h)), dtype)
  if ids is None:
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
  w = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
  wg, wu = (jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(h), dtype) for _ in range(2))
  wd = jnp.asarray(rng.standard_normal((e, i, h)) / np.sqrt(i), dtype)
  return x, w, jnp.asarray(ids, jnp.int32), wg, wu, wd


@pytest.mark.parametrize("block_rows", [1, 8])
@pytest.mark.parametrize("offset,e_local", [(0, 8), (2, 3)])
def test_permutation_layout(block_rows, offset, e_local):
  t, k, h = 11, 3, 5
  x, _, ids, *_ = _problem(t, 8, k, h, 4, jnp.float32, seed=1)
  rows = permute.padded_rows(t * k, e_local, block_rows)
  perm = permute.route_copies(ids, num_local_experts=e_local, expert_offset=offset,
                              block_rows=block_rows, num_rows=rows)
  xs = np.asarray(permute.permute(x, perm, top_k=k, num_rows=rows))
  row = np.asarray(perm.row_of_copy)
  local = np.asarray(ids).reshape(-1) - offset
  in_shard = (local >= 0) & (local < e_local)
  np.testing.assert_array_equal(np.asarray(perm.group_sizes),
                                np.bincount(local[in_shard], minlength=e_local))
  assert (row[~in_shard] == rows).all()
  rows_used = row[in_shard]
  assert len(set(rows_used)) == len(rows_used)  # a permutation of the in-shard copies
  np.testing.assert_array_equal(xs[rows_used], np.asarray(x)[np.arange(t * k)[in_shard] // k])
  tile_expert = np.asarray(perm.tile_expert)
  np.testing.assert_array_equal(tile_expert[rows_used // block_rows], local[in_shard])
  assert (np.asarray(perm.group_starts) % block_rows == 0).all()
  assert int(perm.num_tiles[0]) == sum(-(-s // block_rows) for s in np.asarray(perm.group_sizes))
  padding = np.setdiff1d(np.arange(rows), rows_used)
  assert not xs[padding].any()


@pytest.mark.parametrize("offset,e_local", [(0, 8), (4, 4)])
def test_permuted_reference_and_dense_reference_equal_moe_experts(offset, e_local):
  x, w, ids, wg, wu, wd = _problem(13, 8, 3, 16, 24, jnp.float32, seed=2)
  shard = (wg[offset:offset + e_local], wu[offset:offset + e_local], wd[offset:offset + e_local])
  want = reference.moe_experts(x, w, ids, *shard, expert_offset=offset)
  for fn in (permute.moe_experts_permuted, reference.moe_experts_dense):
    got = fn(x, w, ids, *shard, expert_offset=offset)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---- Mosaic GPU expert kernels (interpret mode) ----------------------------------------------

H, I, E = 128, 128, 6  # interpret mode is slow: small, but whole 64-row/64-col tiles
GROUPED = grouped_mlp_mgpu.GroupedConfig(block_m=64, block_n=64, block_k=64,
                                         max_concurrent_steps=2, num_sms=3)
DECODE = decode_mlp_mgpu.DecodeConfig(block_k=64, max_concurrent_steps=2, num_sms=3)
TOL = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}


def _assert_close(got, want, dtype):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all(), "kernel left output unwritten (NaN poison)"
  scale = np.abs(want).max()
  assert scale > 0
  np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale)


def _run_path(path, x, w, ids, wg, wu, wd, offset=0, detect_races=False, layer=None):
  with gpu_interpret(detect_races):
    if path == "grouped":
      return grouped_mlp_mgpu.moe_experts_grouped(x, w, ids, wg, wu, wd,
                                                  expert_offset=offset, layer=layer,
                                                  cfg=GROUPED)
    return decode_mlp_mgpu.moe_experts_decode(x, w, ids, wg, wu, wd, expert_offset=offset,
                                              layer=layer, cfg=DECODE)


@pytest.mark.parametrize("path,t", [("grouped", 40), ("grouped", 1), ("decode", 1),
                                    ("decode", 5)])
def test_kernel_random_bf16(path, t):
  args = _problem(t, E, 3, H, I, jnp.bfloat16, seed=t)
  _assert_close(_run_path(path, *args), reference.moe_experts_dense(*args), jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("path,t", [("grouped", 70), ("decode", 9)])
def test_kernel_one_huge_group_and_empty_groups(path, t):
  # Every token picks expert 4 (grouped: 70 copies span two 64-row tiles) plus expert 1;
  # experts 0, 2, 3, 5 get nothing.
  ids = np.tile([4, 1], (t, 1))
  args = _problem(t, E, 2, H, I, jnp.bfloat16, seed=7, ids=ids)
  _assert_close(_run_path(path, *args), reference.moe_experts_dense(*args), jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("path,t", [("grouped", 20), ("decode", 3)])
def test_kernel_expert_shards_sum_to_whole(path, t):
  x, w, ids, wg, wu, wd = _problem(t, E, 3, H, I, jnp.bfloat16, seed=11)
  whole = reference.moe_experts_dense(x, w, ids, wg, wu, wd)
  parts = [_run_path(path, x, w, ids, wg[s:s + 3], wu[s:s + 3], wd[s:s + 3], offset=s)
           for s in (0, 3)]
  for s, part in zip((0, 3), parts):  # each shard alone is its slice of the experts
    _assert_close(part, reference.moe_experts_dense(x, w, ids, wg[s:s + 3], wu[s:s + 3],
                                                     wd[s:s + 3], expert_offset=s),
                  jnp.bfloat16)
  summed = sum(np.asarray(p, np.float32) for p in parts)
  _assert_close(summed, whole, jnp.bfloat16)


@pytest.mark.parametrize("path,t,layer,offset", [("decode", 3, 2, 3)])
def test_kernel_reads_one_layer_of_stacked_experts(path, t, layer, offset):
  """A scanned layer stack hands the kernels its layers' experts stacked, [L, E, ...], and the
  layer's index: they read that layer's experts where they lie (as one pool of L * E experts),
  with that layer's result; an expert shard's offset still applies."""
  x, w, ids, wg, wu, wd = _problem(t, E, 3, H, I, jnp.bfloat16, seed=17)
  stacks = [jnp.stack([a[::-1], a, a * -1.5])[:, offset:] for a in (wg, wu, wd)]
  got = _run_path(path, x, w, ids, *stacks, offset=offset, layer=jnp.int32(layer))
  want = reference.moe_experts_dense(x, w, ids, *(a[layer] for a in stacks),
                                     expert_offset=offset)
  _assert_close(got, want, jnp.bfloat16)
  _assert_close(reference.moe_experts(x, w, ids, *stacks, expert_offset=offset,
                                      layer=jnp.int32(layer)), want, jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("path,t", [("grouped", 70), ("decode", 5)])
def test_kernel_has_no_races(path, t):
  # Several work items per simulated SM: SMEM reuse across items and TMA/WGMMA ordering are
  # checked by the interpreter's race detector (slow, so one small case per kernel).
  args = _problem(t, E, 3, H, I, jnp.bfloat16, seed=13)
  out = jax.block_until_ready(_run_path(path, *args, detect_races=True))
  assert not interpret_pallas_call.get_races().races_found
  _assert_close(out, reference.moe_experts_dense(*args), jnp.bfloat16)


def test_grouped_kernel_writes_used_tiles_only():
  # Direct call on a hand-made layout: tiles 0..2 used (experts 2, 0, 2), tile 3 not.
  rng = np.random.default_rng(5)
  xs = jnp.asarray(rng.standard_normal((4 * 64, H)), jnp.bfloat16)
  *_, wg, wu, wd = _problem(1, E, 1, H, I, jnp.bfloat16, seed=5)
  tile_expert = jnp.asarray([2, 0, 2, 5], jnp.int32)
  num_tiles = jnp.asarray([3], jnp.int32)
  with gpu_interpret():
    got = np.asarray(grouped_mlp_mgpu.grouped_swiglu(xs, tile_expert, num_tiles, wg, wu, wd,
                                                     GROUPED), np.float32)
  want = grouped_mlp_mgpu.grouped_swiglu_reference(xs, tile_expert, num_tiles, wg, wu, wd, 64)
  _assert_close(got[:192], np.asarray(want)[:192], jnp.bfloat16)
  assert np.isnan(got[192:]).all()  # the poison is there: the unused tile was skipped


@pytest.mark.parametrize("fn", [grouped_mlp_mgpu.moe_experts_grouped,
                                decode_mlp_mgpu.moe_experts_decode])
def test_kernels_refuse_f32(fn):
  # Hopper WGMMA takes f32 (tf32) operands only untransposed; our weight layouts need
  # transposed views, so f32 is refused with a clear error instead of computing something else.
  args = _problem(2, E, 2, H, I, jnp.float32)
  with pytest.raises(NotImplementedError, match="bf16/f16"):
    fn(*args)


def test_moe_experts_refuses_widths_that_are_not_whole_tiles():
  args = _problem(2, E, 2, 96, I, jnp.bfloat16)  # hidden 96: not a multiple of 64
  with pytest.raises(NotImplementedError, match="multiples of 64"):
    moe_mgpu.moe_experts(*args)


# ---- the MoE layer and the engine switch ------------------------------------------------------

def _tiny_moe_config(**overrides):
  d = dict(CONFIGS["deepseek_v3"], hidden_size=128, moe_intermediate_size=64,
           intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, **overrides)
  return config_from_dict(d)


@pytest.mark.parametrize("t", [3, 70])  # decode kernel, grouped kernel
def test_moe_layer_equals_reference(t):
  cfg = _tiny_moe_config()
  params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
  p = layer_params(cfg, params, 1)["moe"]
  x = jnp.asarray(np.random.default_rng(t).standard_normal((1, t, cfg.hidden_size)),
                  jnp.bfloat16)
  want = moe_layer(p, x, cfg, REFERENCE)
  with gpu_interpret():
    got = moe_layer(p, x, cfg, KernelChoice(moe="mosaic_gpu"))
  _assert_close(got, want, jnp.bfloat16)


@pytest.mark.slow
def test_tiny_model_forward_calls_mosaic_gpu_moe_and_matches_reference_per_layer():
  """The model reaches the kernel through the switch with real shapes, and every call matches
  the reference on the same inputs. (Whole-model logits are not compared: in eager bf16, the
  per-layer bf16 differences grow through random-weight layers; jitting the forward instead
  nests GPU interpret mode inside an outer CPU computation, which has hung on 2 cores.)"""
  cfg = _tiny_moe_config(num_hidden_layers=2)  # a dense layer, then a MoE layer
  params = init_params(cfg, seed=4, dtype=jnp.bfloat16)
  b, t, ps = 2, 5, 4
  tokens = jnp.asarray(np.random.default_rng(2).integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  page_table = jnp.asarray(contiguous_page_table(b, 8, ps))
  calls = []

  def checked(x, weights, ids, *w, **kw):
    got = moe_mgpu.moe_experts(x, weights, ids, *w, **kw)
    calls.append((got, reference.moe_experts(x, weights, ids, *w, **kw)))
    return got

  kernels.register("moe_experts", "checked_mosaic_gpu", checked)
  with gpu_interpret():
    cache = init_cache(cfg, page_table.size, ps, jnp.bfloat16)
    # Layer by layer (the unrolled path): the checker compares each call's values.
    hidden, _ = forward(params, cache, tokens, jnp.zeros((b,), jnp.int32),
                        jnp.full((b,), t, jnp.int32), page_table, cfg=cfg,
                        impl=KernelChoice(moe="checked_mosaic_gpu"), scan_layers=False)
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
  assert len(calls) == n_moe > 0
  for got, want in calls:
    _assert_close(got, want, jnp.bfloat16)
  assert np.isfinite(np.asarray(compute_logits(params, hidden, cfg))).all()


def test_engine_switch_registers_mosaic_gpu_and_keeps_default():
  mgpu = KernelChoice(moe="mosaic_gpu")
  assert kernels.moe_experts(mgpu).__wrapped__ is moe_mgpu.moe_experts  # (behind jit)
  assert kernels.route(mgpu).__wrapped__ is routing.route
  assert kernels.moe_experts(REFERENCE) is reference.moe_experts
  assert kernels.route(REFERENCE) is reference.route
  assert KernelChoice().moe == "reference"


# ---- lowering for CUDA at Kimi-K2.5 shapes ----------------------------------------------------

KIMI_H, KIMI_I, KIMI_K = 7168, 2048, 8


def _kimi_specs(t, e):
  s = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  return (s((t, KIMI_H), bf), s((t, KIMI_K), jnp.float32), s((t, KIMI_K), jnp.int32),
          s((e, KIMI_H, KIMI_I), bf), s((e, KIMI_H, KIMI_I), bf), s((e, KIMI_I, KIMI_H), bf))


@pytest.mark.parametrize("t", [8, 512])
@pytest.mark.parametrize("e,offset", [(384, 0), (48, 96)])
def test_moe_experts_lowers_for_cuda_at_kimi_shapes(t, e, offset):
  calls = export_cuda_calls(lambda *a: moe_mgpu.moe_experts(*a, expert_offset=offset),
                            *_kimi_specs(t, e))
  # Two kernels per layer (gate/up + SwiGLU, down), whichever path T selects.
  assert calls.count(MOSAIC_CALL) == 2, calls
