"""MoE routing and expert computation against straightforward numpy loops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.reference import moe_experts, route

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep

jax.config.update("jax_default_matmul_precision", "highest")


def _np_route(logits, bias, scoring, method, k, n_group, topk_group, norm, scale):
  """Token-by-token transcription of the DeepSeek/Qwen routing rules."""
  t, e = logits.shape
  out_w, out_i = [], []
  for row in range(t):
    x = logits[row].astype(np.float64)
    s = 1 / (1 + np.exp(-x)) if scoring == "sigmoid" else np.exp(x - x.max()) / np.exp(
        x - x.max()).sum()
    if method == "noaux_tc":
      choice = s + bias
      if n_group > 1:
        g = choice.reshape(n_group, -1)
        gs = np.sort(g, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-gs, kind="stable")[:topk_group]
        choice = np.where(np.isin(np.arange(e) // (e // n_group), keep), choice, -np.inf)
      ids = np.argsort(-choice, kind="stable")[:k]
      w = s[ids]
      if norm:
        w = w / (w.sum() + 1e-20)
      w = w * scale
    else:
      choice = s
      if method == "group_limited_greedy" and n_group > 1:
        gs = s.reshape(n_group, -1).max(1)
        keep = np.argsort(-gs, kind="stable")[:topk_group]
        choice = np.where(np.isin(np.arange(e) // (e // n_group), keep), s, 0.0)
      ids = np.argsort(-choice, kind="stable")[:k]
      w = choice[ids]
      w = w / (w.sum() + 1e-20) if norm and k > 1 else w * scale
    out_w.append(w)
    out_i.append(ids)
  return np.array(out_w), np.array(out_i)


CASES = [
    ("sigmoid", "noaux_tc", 4, 4, 2, True, 2.5),  # DeepSeek-V3
    ("sigmoid", "noaux_tc", 8, 1, 1, True, 2.827),  # Kimi-K2
    ("sigmoid", "noaux_tc", 2, 2, 1, False, 1.0),
    ("softmax", "greedy", 6, 1, 1, False, 1.0),  # DeepSeek-V2-Lite
    ("softmax", "greedy", 2, 1, 1, True, 1.0),  # Qwen3-MoE
    ("softmax", "group_limited_greedy", 3, 4, 2, False, 16.0),  # DeepSeek-V2
]


@pytest.mark.parametrize("scoring,method,k,n_group,topk_group,norm,scale", CASES)
def test_route_matches_numpy(scoring, method, k, n_group, topk_group, norm, scale):
  rng = np.random.default_rng(0)
  t, e = 37, 16
  logits = rng.standard_normal((t, e)).astype(np.float32) * 2
  bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
  w, ids = route(jnp.asarray(logits), jnp.asarray(bias) if method == "noaux_tc" else None,
                 scoring_func=scoring, topk_method=method, top_k=k, n_group=n_group,
                 topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
  want_w, want_ids = _np_route(logits, bias, scoring, method, k, n_group, topk_group, norm, scale)
  # Order within a token's k choices is irrelevant to the output: compare sorted by id.
  o, wo = np.argsort(np.asarray(ids), 1), np.argsort(want_ids, 1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), o, 1),
                                np.take_along_axis(want_ids, wo, 1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), o, 1),
                             np.take_along_axis(want_w, wo, 1), rtol=1e-5)


def _dense_loop(x, w, ids, gate, up, down):
  out = np.zeros_like(x, dtype=np.float64)
  for t in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = ids[t, j]
      h = x[t] @ gate[e]
      h = h / (1 + np.exp(-h)) * (x[t] @ up[e])
      out[t] += w[t, j] * (h @ down[e])
  return out


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 8, 3), (64, 16, 4)])
def test_moe_experts_matches_loop(t, e, k):
  rng = np.random.default_rng(t)
  h, i = 24, 40
  x = rng.standard_normal((t, h)).astype(np.float32)
  ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
  w = rng.random((t, k)).astype(np.float32)
  gate, up = (rng.standard_normal((e, h, i)).astype(np.float32) / 5 for _ in range(2))
  down = rng.standard_normal((e, i, h)).astype(np.float32) / 6
  got = moe_experts(*(jnp.asarray(a) for a in (x, w, ids, gate, up, down)))
  np.testing.assert_allclose(np.asarray(got), _dense_loop(x, w, ids, gate, up, down),
                             rtol=1e-4, atol=1e-4)


def test_expert_shards_sum_to_the_whole():
  rng = np.random.default_rng(5)
  t, h, i, e, k = 9, 16, 20, 8, 2
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  gate, up = (jnp.asarray(rng.standard_normal((e, h, i)) / 4, jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((e, i, h)) / 4, jnp.float32)
  whole = moe_experts(x, w, ids, gate, up, down)
  parts = sum(moe_experts(x, w, ids, gate[s:s + 2], up[s:s + 2], down[s:s + 2], expert_offset=s)
              for s in range(0, e, 2))
  np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,offset", [(1, 0), (3, 0), (2, 4), (5, 2)])
def test_gathered_decode_path_equals_dense_and_grouped(tokens, offset):
  from pallas_kernels.moe import reference as ref
  rng = np.random.default_rng(tokens + offset)
  e_local, e_total, h, i, k = 8, 16, 24, 12, 3
  x = jnp.asarray(rng.normal(size=(tokens, h)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(e_total, k, replace=False) for _ in range(tokens)]),
                    jnp.int32)
  w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
  gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
                    for s in [(e_local, h, i), (e_local, h, i), (e_local, i, h)])
  gathered = ref.moe_experts_gathered(x, w, ids, gate, up, down, expert_offset=offset)
  dense = ref.moe_experts_dense(x, w, ids, gate, up, down, expert_offset=offset)
  np.testing.assert_allclose(gathered, dense, rtol=1e-5, atol=1e-5)
  # Past the dispatch threshold the grouped path runs; both agree on the same inputs.
  xs, ws, idss = (jnp.tile(a, (4, 1)) for a in (x, w, ids))
  assert not ref._gather_pays(idss.size, gate)
  grouped = ref.moe_experts(xs, ws, idss, gate, up, down, expert_offset=offset)
  np.testing.assert_allclose(grouped[:tokens], gathered, rtol=1e-5, atol=1e-5)
  if ref._gather_pays(tokens * k, gate):
    np.testing.assert_allclose(ref.moe_experts(x, w, ids, gate, up, down, expert_offset=offset),
                               gathered, rtol=0, atol=0)


@pytest.mark.parametrize("tokens,offset,dtype", [(6, 0, jnp.float32), (40, 4, jnp.float32),
                                                 (300, 2, jnp.float32), (300, 0, jnp.bfloat16)])
def test_every_formulation_equals_ragged(tokens, offset, dtype):
  """all-experts, tiled and ragged agree, with out-of-shard and padding (-1) ids; moe_experts
  dispatches to the formulation its shapes pick."""
  from pallas_kernels.moe import reference as ref
  rng = np.random.default_rng(tokens + offset)
  e_local, e_total, h, i, k = 8, 16, 24, 12, 3
  x = jnp.asarray(rng.normal(size=(tokens, h)), dtype)
  ids = np.stack([rng.choice(e_total, k, replace=False) for _ in range(tokens)]).astype(np.int32)
  ids[::7] = -1  # padding tokens go to no expert
  ids = jnp.asarray(ids)
  w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
  gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.3, dtype)
                    for s in [(e_local, h, i), (e_local, h, i), (e_local, i, h)])
  args = (x, w, ids, gate, up, down)

  def run(fn, **kw):  # jitted, as the model runs them (op by op: ~150 small compiles a case)
    return np.asarray(jax.jit(functools.partial(fn, expert_offset=offset, **kw))(*args),
                      np.float32)

  want = run(ref.moe_experts_ragged)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  for name, got in [("all", run(ref.moe_experts_all)),
                    ("tiled", run(ref.moe_experts_tiled, tile=64)),
                    ("tiled16", run(ref.moe_experts_tiled, tile=16)),
                    ("dispatch", run(ref.moe_experts))]:
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)
  assert not np.any(run(ref.moe_experts_tiled)[::7])


def test_dispatch_picks_by_shape():
  from pallas_kernels.moe import reference as ref
  e, h, i, k = 8, 256, 160, 2  # the demo model
  gate = jnp.zeros((e, h, i), jnp.float32)
  assert ref._gather_pays(1 * k, gate) and not ref._gather_pays(32 * k, gate)
  assert ref._dense_pays(32, 32 * k, e, ref._tile_rows(32 * k, e))
  assert not ref._dense_pays(512, 512 * k, e, ref._tile_rows(512 * k, e))
  assert ref._tile_rows(512 * k, e) == 128 and ref._tile_rows(4096 * k, e) == 256


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 8])
def test_bf16_formulations_agree_to_bf16_precision(k):
  """What holds on any CPU: every formulation, and any token count, gives each token's output
  to bf16 precision of the others, and almost always the same bits. Not bitwise by
  construction: each formulation's dots accumulate in float32 in the order of whichever kernel
  XLA:CPU picks for that dot shape (YNNPACK's bf16 kernels for the batched expert matmuls,
  dispatched on the CPU's own instructions; an f32 matrix-vector loop for the per-copy
  matvecs), so a sum next to a bf16 rounding boundary can round either way, and a rounded
  intermediate carries on into the down projection (seen: 1 of 3,072 elements one ulp apart on
  an AVX-512 Intel Xeon, none on AMD EPYC; `lax.ragged_dot` ~0.4% of elements). Greedy
  identity of speculative and plain decoding is therefore asserted in float32."""
  from pallas_kernels.moe import reference as ref
  rng = np.random.default_rng(k)
  e_local, h, i, tokens = 8, 256, 160, 12
  x = jnp.asarray(rng.normal(size=(tokens, h)), jnp.bfloat16)
  ids = jnp.asarray(np.stack([rng.choice(e_local, k, replace=False) for _ in range(tokens)]),
                    jnp.int32)
  w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
  gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.1, jnp.bfloat16)
                    for s in [(e_local, h, i), (e_local, h, i), (e_local, i, h)])
  args = (x, w, ids, gate, up, down)
  want = np.asarray(ref.moe_experts_tiled(*args, tile=64), np.float32)
  scale = np.sqrt(np.mean(want ** 2))
  outs = {"all": ref.moe_experts_all(*args), "tiled16": ref.moe_experts_tiled(*args, tile=16),
          "gathered": ref.moe_experts_gathered(*args), "picked": ref.moe_experts(*args),
          "ragged": ref.moe_experts_ragged(*args)}
  for n in (1, 3, 5):  # fewer tokens pick other formulations
    outs[f"{n} tokens"] = ref.moe_experts(x[:n], w[:n], ids[:n], gate, up, down)
  for name, got in outs.items():
    got = np.asarray(got, np.float32)
    diff = np.abs(got - want[:got.shape[0]])
    # bf16 keeps 8 significant bits: 2^-6 of the output's scale is a few roundings.
    assert diff.max() <= 2.0 ** -6 * scale, (name, float(diff.max() / scale))
    # Differences are ties broken the other way, rare on random data; many would mean the
    # formulations compute different things.
    assert np.mean(diff > 0) < 0.02, (name, float(np.mean(diff > 0)))
