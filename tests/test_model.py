"""Forward-pass invariants: absorbed MLA equals naive MLA, cached decode equals a full forward,
and results do not depend on padding, page size or which pages a sequence owns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.cache import contiguous_page_table, init_cache, layer_pages
from engine.model.config import config_from_dict
from engine.model.kernels import REFERENCE
from engine.model.params import init_params, layer_params
from engine.model.rope import apply_rope, rope_cos_sin
from engine.model.transformer import _Ctx, forward_logits, mla_attention, rms_norm
from model_configs import CONFIGS

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep

jax.config.update("jax_default_matmul_precision", "highest")


def _run(cfg, params, tokens, start, n_new, page_table, cache):
  return forward_logits(params, cache, jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(start, jnp.int32), jnp.asarray(n_new, jnp.int32),
                        jnp.asarray(page_table), cfg=cfg)


def _naive_mla(p, x, cfg):
  """Textbook MLA with per-head keys and values, as transformers computes it."""
  b, t, _ = x.shape
  dn, dc = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  if cfg.q_lora_rank is None:
    q = jnp.einsum("bth,hnd->btnd", x, p["q"])
  else:
    q = jnp.einsum("btr,rnd->btnd", rms_norm(x @ p["q_a"], p["q_a_norm"], cfg.rms_norm_eps),
                   p["q_b"])
  kv = x @ p["kv_a"]
  c = rms_norm(kv[..., :dc], p["kv_a_norm"], cfg.rms_norm_eps)
  cos, sin = rope_cos_sin(cfg.rope, cfg.rope_dim, jnp.broadcast_to(jnp.arange(t), (b, t)))
  k_rope = apply_rope(kv[..., dc:], cos, sin, cfg.rope.interleave)
  q_rope = apply_rope(q[..., dn:], cos, sin, cfg.rope.interleave)
  kvb = jnp.einsum("btc,cnd->btnd", c, p["kv_b"])
  k = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_rope[:, :, None, :],
                                                        (*kvb.shape[:3], k_rope.shape[-1]))], -1)
  v = kvb[..., dn:]
  qf = jnp.concatenate([q[..., :dn], q_rope], -1)
  s = jnp.einsum("bqnd,bknd->bnqk", qf, k) * cfg.softmax_scale
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  o = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, -1), v)
  return jnp.einsum("btnv,nvh->bth", o, p["o"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2"])
def test_absorbed_mla_matches_naive(name):
  cfg = config_from_dict(CONFIGS[name])
  params = init_params(cfg, seed=1)
  p = layer_params(cfg, params, 0)["attn"]
  b, t, ps = 2, 11, 4
  x = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, cfg.hidden_size)), jnp.float32)
  pt = jnp.asarray(contiguous_page_table(b, 16, ps))
  cache = layer_pages(init_cache(cfg, pt.size, ps, jnp.float32)[0], 1, 0)  # stack 0: layer 0
  ctx = _Ctx(jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32), t, pt)
  got, _ = mla_attention(p, x, cache, ctx, cfg, REFERENCE)
  want = _naive_mla(p, x, cfg)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_equals_full_forward(name):
  cfg = config_from_dict(CONFIGS[name])
  params = init_params(cfg, seed=2)
  b, L, ps = 2, 13, 4
  toks = np.random.default_rng(1).integers(3, cfg.vocab_size, (b, L))
  lens = np.array([L, L - 4])
  pt = contiguous_page_table(b, 32, ps)
  full, _ = _run(cfg, params, toks, [0, 0], lens, pt, init_cache(cfg, pt.size, ps, jnp.float32))
  # Prefill a 5-token chunk, then a 3-token chunk, then one token at a time. The chunks sit at
  # the start of L-wide blocks (the rest padding, as the engine's rows pad): one compiled
  # program for the full forward and the chunks, one for the single tokens.
  cache = init_cache(cfg, pt.size, ps, jnp.float32)
  outs, pos = [], 0
  for width in [5, 3] + [1] * (L - 8):
    n = np.clip(lens - pos, 0, width)
    block = np.zeros((b, L if width > 1 else 1), toks.dtype)
    block[:, :width] = toks[:, pos:pos + width]
    lg, cache = _run(cfg, params, block, [pos, pos], n, pt, cache)
    outs.append(np.asarray(lg)[:, :width])
    pos += width
  inc = np.concatenate([np.asarray(o) for o in outs], axis=1)
  for i in range(b):
    np.testing.assert_allclose(inc[i, :lens[i]], np.asarray(full)[i, :lens[i]],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_independent_of_padding_page_size_and_page_placement(name):
  cfg = config_from_dict(CONFIGS[name])
  params = init_params(cfg, seed=3)
  L = 9
  toks = np.random.default_rng(2).integers(3, cfg.vocab_size, (1, L))
  pt = contiguous_page_table(1, 16, 4)
  ref, _ = _run(cfg, params, toks, [0], [L], pt, init_cache(cfg, pt.size, 4, jnp.float32))
  # Extra padding columns in the block change nothing for the real tokens.
  padded = np.concatenate([toks, np.full((1, 7), 5)], axis=1)
  got, _ = _run(cfg, params, padded, [0], [L], pt, init_cache(cfg, pt.size, 4, jnp.float32))
  np.testing.assert_allclose(np.asarray(got)[:, :L], np.asarray(ref), rtol=1e-5, atol=1e-5)
  # A scrambled set of pages out of a larger pool, with page size 2.
  perm = np.random.default_rng(3).permutation(20)[:8].reshape(1, 8).astype(np.int32)
  got, _ = _run(cfg, params, toks, [0], [L], perm, init_cache(cfg, 20, 2, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_idle_rows_write_nothing():
  cfg = config_from_dict(CONFIGS["deepseek_v3"])
  params = init_params(cfg, seed=4)
  pt = contiguous_page_table(2, 8, 4)
  cache = init_cache(cfg, pt.size, 4, jnp.float32)
  _, cache = _run(cfg, params, [[7, 8, 9], [7, 8, 9]], [0, 0], [3, 0], pt, cache)
  lat = np.asarray(layer_pages(cache[0], 1, 0)["latent"])  # stack 0: layer 0
  assert np.abs(lat[pt[0]]).sum() > 0
  assert np.abs(lat[pt[1]]).sum() == 0


@pytest.mark.slow
def test_mtp_layer_cached_equals_full_and_leaves_main_cache_alone():
  from engine.model import transformer
  # Jitted (as the engine runs them): op by op, each chunk's shapes compiled ~450 small programs.
  forward, forward_mtp = (jax.jit(f, static_argnames=("cfg",))
                          for f in (transformer.forward, transformer.forward_mtp))
  compute_logits = transformer.compute_logits
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
  params = init_params(cfg, seed=6)
  L, ps = 10, 4
  toks = np.random.default_rng(7).integers(3, cfg.vocab_size, (1, L + 1))
  pt = jnp.asarray(contiguous_page_table(1, 16, ps))

  def run(cache, lo, hi):
    start, n = jnp.asarray([lo]), jnp.asarray([hi - lo])
    h, cache = forward(params, cache, jnp.asarray(toks[:, lo:hi]), start, n, pt, cfg=cfg)
    stacks = len(cfg.layer_stacks)
    before = [np.asarray(c["latent"]) for c in cache[:stacks]]
    m, cache = forward_mtp(params, cache, h, jnp.asarray(toks[:, lo + 1:hi + 1]), start, n, pt,
                           cfg=cfg)
    for b, c in zip(before, cache[:stacks]):
      np.testing.assert_array_equal(b, np.asarray(c["latent"]))
    return compute_logits(params, m, cfg), cache

  cache = init_cache(cfg, pt.size, ps, jnp.float32)
  # One entry per stack of layers (dense, then MoE; its layers' pools end to end), then the
  # MTP layer's.
  assert [c["latent"].shape[0] for c in cache] == [n * pt.size for n in (1, cfg.num_layers - 1, 1)]
  full, _ = run(cache, 0, L)
  cache = init_cache(cfg, pt.size, ps, jnp.float32)
  a, cache = run(cache, 0, 6)
  b, cache = run(cache, 6, L)
  np.testing.assert_allclose(np.concatenate([a, b], 1), np.asarray(full), rtol=1e-4, atol=1e-4)
  assert float(jnp.std(full)) > 0.1
