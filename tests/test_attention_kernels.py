"""Mosaic GPU attention kernels against the plain-JAX reference (GPU interpret mode on the CPU),
CUDA lowering of the kernels at Kimi-K2.5 shapes, the reference against naive dense attention in
float64, the in-place cache write, and the engine's kernel switch."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model import kernels
from engine.model.cache import init_cache
from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.model.transformer import compute_logits, forward, forward_logits
from cuda_export import MOSAIC_CALL, export_cuda_calls, gpu_interpret
from model_configs import CONFIGS
from pallas_kernels.attention import gqa_paged_attention_mgpu, mla_paged_attention_mgpu
from pallas_kernels.attention import paged_flash_mgpu, reference

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep




def _tol(dtype):
  return dict(rtol=2e-2, atol=2e-2) if jnp.dtype(dtype).itemsize == 2 else dict(rtol=1e-5,
                                                                                atol=1e-5)


def _paged_inputs(seed, b, t, kv_lens, page_size, max_pages, num_pages):
  """Shuffled page tables (pages of different rows interleave), queries at the last t positions."""
  rng = np.random.default_rng(seed)
  table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  kv_lens = np.asarray(kv_lens, np.int32)
  assert kv_lens.max() <= max_pages * page_size and kv_lens.min() >= t
  q_positions = kv_lens[:, None] - t + np.arange(t, dtype=np.int32)[None]
  return jnp.asarray(table), jnp.asarray(q_positions), jnp.asarray(kv_lens)


def _normal(key, shape, dtype):
  """Standard normal test data, a function of the key (numpy's generator seeded with the key's
  bits: jax.random.normal compiled a program for every shape, ~25 in this module)."""
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
  return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


# ---- MLA flash kernel vs reference (interpret mode; the decode kernel: test_mla_decode.py) ----

MLA_CASES = {
    # name: (B, T, nH, Dc, Dr, page, max_pages, kv_lens, dtype, num_splits, detect_races)
    "decode_len1_boundary_ragged": (3, 1, 4, 64, 64, 32, 4, [1, 64, 77], jnp.bfloat16, 2, False),
    # 5 KV blocks of 32 in one split: the 3-slot ring wraps around while races are tracked.
    "spec_verify_t4_races": (2, 4, 8, 64, 64, 32, 5, [4, 150], jnp.bfloat16, 1, True),
    "prefill_chunk_with_prefix": (2, 20, 4, 32, 32, 32, 3, [33, 84], jnp.float16, 1, False),
    # Kimi's 512 + 64: two compute warpgroups (256 value columns each) share the KV ring and the
    # query buffer that becomes their output staging; 7 KV blocks wrap the 3-slot ring.
    "kimi_dims_512_64_races": (1, 2, 8, 512, 64, 64, 4, [200], jnp.bfloat16, 1, True),
}


@pytest.mark.parametrize("name", MLA_CASES)
def test_mla_kernel_matches_reference(name):
  b, t, nh, dc, dr, page, max_pages, kv_lens, dtype, splits, races = MLA_CASES[name]
  num_pages = b * max_pages + 3
  table, q_pos, kv_lens = _paged_inputs(len(name), b, t, kv_lens, page, max_pages, num_pages)
  k1, k2, k3 = jax.random.split(jax.random.key(len(name)), 3)
  q_latent = _normal(k1, (b, t, nh, dc), dtype)
  q_rope = _normal(k2, (b, t, nh, dr), dtype)
  pages = _normal(k3, (num_pages, page, dc + dr), dtype)
  scale = (dc + dr) ** -0.5
  with gpu_interpret(detect_races=races):
    got = mla_paged_attention_mgpu.mla_paged_attention(
        q_latent, q_rope, pages, table, q_pos, kv_lens, softmax_scale=scale, kernel="flash",
        num_splits=splits, min_tokens_per_split=1)
  want = reference.mla_paged_attention(q_latent, q_rope, pages, table, q_pos, kv_lens,
                                       softmax_scale=scale)
  assert got.shape == want.shape and got.dtype == want.dtype
  got = np.asarray(got, np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, np.asarray(want, np.float32), **_tol(dtype))


# ---- GQA kernel vs reference (interpret mode) ----

GQA_CASES = {
    # name: (B, T, nH, nKV, D, page, max_pages, kv_lens, dtype, num_splits, detect_races)
    "decode_len1_boundary_ragged": (3, 1, 8, 2, 32, 32, 3, [1, 64, 50], jnp.bfloat16, 2, False),
    # 4 KV blocks per split through a 3-slot ring, with race detection.
    "spec_verify_mqa_races": (2, 4, 4, 1, 64, 16, 8, [4, 100], jnp.bfloat16, 2, True),
    "prefill_chunk_with_prefix_p16": (2, 40, 4, 2, 16, 16, 6, [52, 95], jnp.float16, 1, False),
}


@pytest.mark.parametrize("name", GQA_CASES)
def test_gqa_kernel_matches_reference(name):
  b, t, nh, nkv, d, page, max_pages, kv_lens, dtype, splits, races = GQA_CASES[name]
  num_pages = b * max_pages + 2
  table, q_pos, kv_lens = _paged_inputs(len(name), b, t, kv_lens, page, max_pages, num_pages)
  k1, k2, k3 = jax.random.split(jax.random.key(len(name)), 3)
  q = _normal(k1, (b, t, nh, d), dtype)
  k_pages = _normal(k2, (num_pages, page, nkv, d), dtype)
  v_pages = _normal(k3, (num_pages, page, nkv, d), dtype)
  with gpu_interpret(detect_races=races):
    got = gqa_paged_attention_mgpu.gqa_paged_attention(
        q, k_pages, v_pages, table, q_pos, kv_lens, softmax_scale=d ** -0.5, num_splits=splits,
        min_tokens_per_split=1)
  want = reference.gqa_paged_attention(q, k_pages, v_pages, table, q_pos, kv_lens,
                                       softmax_scale=d ** -0.5)
  assert got.shape == want.shape and got.dtype == want.dtype
  got = np.asarray(got, np.float32)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, np.asarray(want, np.float32), **_tol(dtype))


@pytest.mark.slow
def test_kernel_partials_and_split_combine():
  """The raw kernel outputs: with more splits than KV blocks some splits are idle (lse -inf, their
  partial left unwritten: NaN here); active splits write every row; padded rows see nothing."""
  b, t, nh, d, page = 2, 1, 4, 32, 32
  table, q_pos, kv_lens = _paged_inputs(7, b, t, [1, 40], page, 2, 5)
  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  q = _normal(k1, (b, t, nh, d), jnp.bfloat16)
  k_pages = _normal(k2, (5, page, 1, d), jnp.bfloat16)
  v_pages = _normal(k3, (5, page, 1, d), jnp.bfloat16)
  rows = paged_flash_mgpu.BLOCK_Q
  limit = jnp.repeat(jnp.minimum(q_pos + 1, kv_lens[:, None]), nh, axis=1)
  row_limit, block_end = mla_paged_attention_mgpu.fold_rows(limit, rows)
  qf = jnp.pad(q.reshape(b, nh, d), ((0, 0), (0, rows - nh), (0, 0)))
  with gpu_interpret():
    out, lse = paged_flash_mgpu.paged_flash_attention(
        qf, k_pages, v_pages, table, row_limit, block_end, softmax_scale=0.2, num_splits=3,
        block_kv=16, min_tokens_per_split=16)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  assert not np.isnan(lse).any()
  # Sequence 0 (kv_len 1) has one KV block of 16: only split 0 works. Sequence 1 (40) has 3.
  assert np.isfinite(lse[0, 0, :nh]).all() and np.isneginf(lse[0, 1:]).all()
  assert np.isnan(out[0, 1:]).all()  # idle splits leave their partials unwritten
  assert np.isfinite(out[0, 0]).all() and np.isfinite(out[1]).all()
  assert np.isfinite(lse[1, :, :nh]).all() and np.isneginf(lse[:, :, nh:]).all()
  assert (out[1, :, nh:] == 0).all()  # padded rows of active splits
  got = np.asarray(paged_flash_mgpu.combine_splits(out, lse))
  assert np.isfinite(got).all() and (got[:, nh:] == 0).all()
  want = reference.gqa_paged_attention(q, k_pages, v_pages, table, q_pos, kv_lens,
                                       softmax_scale=0.2)
  np.testing.assert_allclose(got[:, :nh], np.asarray(want, np.float32).reshape(b, nh, d),
                             rtol=2e-2, atol=2e-2)


def test_float32_cache_is_rejected():
  q = jnp.ones((1, 1, 4, 64), jnp.float32)
  pages = jnp.ones((2, 32, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="bf16/f16"):
    mla_paged_attention_mgpu.mla_paged_attention(
        q, q, pages, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32),
        jnp.ones((1,), jnp.int32), softmax_scale=1.0)


# ---- CUDA lowering at Kimi-K2.5 shapes (no GPU needed) ----

def _export_for_cuda(fn, shapes):
  return export_cuda_calls(fn, *[jax.ShapeDtypeStruct(s, d) for s, d in shapes])


@pytest.mark.parametrize("b,t,nh,max_pages", [
    (1, 1, 64, 2048),   # 64 heads per device, 128k context, batch 1 (split-K)
    (64, 4, 8, 64),     # 8 heads (TP 8), speculative verify of 3 drafts
    (2, 128, 8, 64),    # chunked prefill: 128 new tokens over a cached prefix
])
def test_mla_lowers_for_cuda(b, t, nh, max_pages):
  bf16, i32 = jnp.bfloat16, jnp.int32
  calls = _export_for_cuda(
      lambda *a: mla_paged_attention_mgpu.mla_paged_attention(*a, softmax_scale=576 ** -0.5,
                                                             kernel="flash"),
      [((b, t, nh, 512), bf16), ((b, t, nh, 64), bf16), ((4096, 64, 576), bf16),
       ((b, max_pages), i32), ((b, t), i32), ((b,), i32)])
  assert calls.count(MOSAIC_CALL) == 1, calls


@pytest.mark.parametrize("b,t,max_pages", [(1, 1, 2048), (32, 1, 64), (4, 64, 32)])
def test_gqa_lowers_for_cuda(b, t, max_pages):
  bf16, i32 = jnp.bfloat16, jnp.int32
  calls = _export_for_cuda(
      lambda *a: gqa_paged_attention_mgpu.gqa_paged_attention(*a, softmax_scale=128 ** -0.5),
      [((b, t, 32, 128), bf16), ((4096, 64, 8, 128), bf16), ((4096, 64, 8, 128), bf16),
       ((b, max_pages), i32), ((b, t), i32), ((b,), i32)])
  assert calls.count(MOSAIC_CALL) == 1, calls


# ---- The reference against naive dense attention in float64 ----

def _dense_attention_f64(q, k, v, q_positions, kv_len, scale):
  """q [T, nH, Dk], k [S, nH or 1, Dk], v [S, nH or 1, Dv] of one sequence; full softmax."""
  s = np.einsum("thd,shd->hts", q, np.broadcast_to(k, (k.shape[0], q.shape[1], k.shape[2])))
  s = s * scale
  visible = (np.arange(k.shape[0])[None, :] <= q_positions[:, None]) & (
      np.arange(k.shape[0])[None, :] < kv_len)
  s = np.where(visible[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, np.broadcast_to(v, (v.shape[0], q.shape[1], v.shape[2])))


def test_references_match_dense_float64():
  b, t, nh, nkv, dc, dr, d, page, max_pages = 3, 3, 4, 2, 16, 8, 8, 4, 5
  table, q_pos, kv_lens = _paged_inputs(11, b, t, [3, 8, 17], page, max_pages, 18)
  ks = jax.random.split(jax.random.key(11), 6)
  ql, qr = _normal(ks[0], (b, t, nh, dc), jnp.float32), _normal(ks[1], (b, t, nh, dr), jnp.float32)
  latent = _normal(ks[2], (18, page, dc + dr), jnp.float32)
  q = _normal(ks[3], (b, t, nh, d), jnp.float32)
  kp, vp = _normal(ks[4], (18, page, nkv, d), jnp.float32), _normal(ks[5], (18, page, nkv, d),
                                                                    jnp.float32)
  mla = np.asarray(reference.mla_paged_attention(ql, qr, latent, table, q_pos, kv_lens,
                                                 softmax_scale=0.3))
  gqa = np.asarray(reference.gqa_paged_attention(q, kp, vp, table, q_pos, kv_lens,
                                                 softmax_scale=0.3))
  f64 = lambda x: np.asarray(x, np.float64)
  tbl, qpos, lens = np.asarray(table), np.asarray(q_pos), np.asarray(kv_lens)
  for i in range(b):
    # Each sequence's tokens, laid out contiguously from its own pages (no gather_pages).
    lat = np.concatenate([f64(latent)[p] for p in tbl[i]])
    want = _dense_attention_f64(np.concatenate([f64(ql[i]), f64(qr[i])], -1), lat[:, None],
                                lat[:, None, :dc], qpos[i], lens[i], 0.3)
    np.testing.assert_allclose(mla[i], want, rtol=1e-5, atol=1e-5)
    k_seq = np.concatenate([f64(kp)[p] for p in tbl[i]])
    v_seq = np.concatenate([f64(vp)[p] for p in tbl[i]])
    for h in range(nh):
      kvh = h // (nh // nkv)
      want = _dense_attention_f64(f64(q[i])[:, h:h + 1], k_seq[:, kvh:kvh + 1],
                                  v_seq[:, kvh:kvh + 1], qpos[i], lens[i], 0.3)
      np.testing.assert_allclose(gqa[i][:, h:h + 1], want, rtol=1e-5, atol=1e-5)


# ---- Cache write: the XLA scatter, donated, updates in place ----

def test_write_pages_updates_in_place_under_donation():
  pages = _normal(jax.random.key(1), (6, 4, 8), jnp.bfloat16)
  # A copy through a new device array: a NumPy view of `pages` itself would pin its buffer and
  # keep XLA from reusing it.
  before = np.asarray(pages.astype(jnp.float32))
  table = jnp.asarray([[4, 1], [0, 5]], jnp.int32)
  positions = jnp.asarray([[3, 4], [0, 1]], jnp.int32)
  valid = jnp.asarray([[True, True], [True, False]])
  new = _normal(jax.random.key(2), (2, 2, 8), jnp.float32)
  pointer = pages.unsafe_buffer_pointer()
  write = jax.jit(reference.write_pages, donate_argnums=0)
  out = write(pages, table, positions, valid, new)
  assert pages.is_deleted()
  assert out.unsafe_buffer_pointer() == pointer  # the same buffer: no copy of the pool
  want = before.copy()
  newb = np.asarray(new.astype(jnp.bfloat16), np.float32)
  want[4, 3], want[1, 0], want[0, 0] = newb[0, 0], newb[0, 1], newb[1, 0]
  np.testing.assert_array_equal(np.asarray(out, np.float32), want)


# ---- Engine wiring ----

def test_kernel_switch_picks_mosaic_gpu():
  choice = kernels.KernelChoice(attention="mosaic_gpu")
  # (behind one jit per set of static keyword arguments: `kernels._jit_per_static_kwargs`)
  assert kernels.mla_attention(choice).__wrapped__ is mla_paged_attention_mgpu.mla_paged_attention
  assert kernels.gqa_attention(choice).__wrapped__ is gqa_paged_attention_mgpu.gqa_paged_attention
  assert kernels.mla_attention(choice) is kernels.mla_attention(choice)
  flash = kernels.KernelChoice(attention="mosaic_gpu_flash")  # the flash kernel for every block
  assert (kernels.mla_attention(flash).__wrapped__
          is mla_paged_attention_mgpu.mla_paged_attention_flash)
  assert kernels.gqa_attention(flash).__wrapped__ is gqa_paged_attention_mgpu.gqa_paged_attention
  assert kernels.write_pages(choice) is reference.write_pages
  assert kernels.mla_attention(kernels.REFERENCE) is reference.mla_paged_attention


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides,page_size", [
    # The kernel needs head dims in whole swizzle tiles: latent 32 + rope 32 with 32-token pages.
    ("deepseek_v3", dict(kv_lora_rank=32, qk_rope_head_dim=32, num_hidden_layers=2), 32),
    ("qwen3_moe", dict(num_hidden_layers=1), 16),
])
def test_model_forward_with_mosaic_gpu_matches_reference(name, overrides, page_size):
  cfg = config_from_dict(dict(CONFIGS[name], **overrides))
  params = init_params(cfg, seed=5)
  tokens = jnp.asarray(np.random.default_rng(5).integers(3, cfg.vocab_size, (2, 6)), jnp.int32)
  start, n_new = jnp.asarray([0, 0], jnp.int32), jnp.asarray([6, 4], jnp.int32)
  table = jnp.asarray([[3, 0], [1, 2]], jnp.int32)

  def run(impl):
    # Op by op, not under forward_logits' jit: GPU interpret mode runs each warpgroup as a
    # thread that compiles and runs its own computation, with barriers blocking inside host
    # callbacks. Nested inside an outer CPU computation on this 2-core machine that has hung
    # (intermittently, e.g. after other tests changed the compilation cache), presumably
    # starving XLA:CPU's thread pool. Each kernel call at top level has never hung.
    cache = init_cache(cfg, 4, page_size, jnp.bfloat16)
    hidden, _ = forward(params, cache, tokens, start, n_new, table, cfg=cfg, impl=impl)
    return np.asarray(compute_logits(params, hidden, cfg))

  # The reference (no Pallas, no interpret mode) as the engine runs it: one jitted program, not
  # ~170 op-by-op compiles.
  want = np.asarray(forward_logits(params, init_cache(cfg, 4, page_size, jnp.bfloat16), tokens,
                                   start, n_new, table, cfg=cfg)[0])
  with gpu_interpret():
    got = run(kernels.KernelChoice(attention="mosaic_gpu"))
  for row, n in enumerate([6, 4]):
    np.testing.assert_allclose(got[row, :n], want[row, :n], rtol=2e-2, atol=2e-2)


# ---- The benchmark's CPU path ----

def test_bench_cpu_path_runs_reference_only(tmp_path, capsys):
  from bench import attention_kernels as bench
  if jax.default_backend() == "gpu":
    pytest.skip("checks the CPU path")
  result = bench.main(["--out", str(tmp_path / "attention.json"), "--iters", "1"])
  assert "NO GPU" in capsys.readouterr().out
  with open(tmp_path / "attention.json") as f:
    saved = json.load(f)
  assert saved["rows"] == result["rows"] and saved["copy_gbps"] > 0
  assert {r["impl"] for r in saved["rows"]} == {"xla_reference"}
  assert all(r["time_us"] > 0 and 0 < r["frac_copy"] for r in saved["rows"])


def test_bench_stopped_after_one_row_keeps_that_row(tmp_path, monkeypatch):
  """gpu_check.sh stops a stage at its time limit: what was measured is on disk by then."""
  from bench import attention_kernels as bench
  if jax.default_backend() == "gpu":
    pytest.skip("checks the CPU path")
  def stop(row):
    raise KeyboardInterrupt
  monkeypatch.setattr(bench, "format_row", stop)
  with pytest.raises(KeyboardInterrupt):
    bench.main(["--out", str(tmp_path / "attention.json"), "--iters", "1"])
  with open(tmp_path / "attention.json") as f:
    rows = json.load(f)["rows"]
  assert len(rows) == 1 and rows[0]["time_us"] > 0
