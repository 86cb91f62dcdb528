"""The reference MLA attention's blocked path (long query blocks: prefill chunks) against its
one-pass path: chunked prefill at different starts, padding queries, idle rows, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import reference

# Shape and case sweeps: the fast tier runs each one's first case (tests/conftest.py).
pytestmark = pytest.mark.sweep


def _inputs(seed, t, starts, n_new, page=16, max_pages=None):
  rng = np.random.default_rng(seed)
  b, nh, dc, dr = len(starts), 4, 16, 8
  max_pages = max_pages or -(-(max(starts) + t) // page) + 1
  table = (1 + rng.permutation(b * max_pages)).reshape(b, max_pages).astype(np.int32)
  pages = rng.normal(size=(b * max_pages + 1, page, dc + dr)).astype(np.float32)
  ql = rng.normal(size=(b, t, nh, dc)).astype(np.float32)
  qr = rng.normal(size=(b, t, nh, dr)).astype(np.float32)
  starts, n_new = np.asarray(starts, np.int32), np.asarray(n_new, np.int32)
  pos = starts[:, None] + np.arange(t, dtype=np.int32)[None]
  return [jnp.asarray(a) for a in (ql, qr, pages, table, pos, starts + n_new)], pos < (starts + n_new)[:, None]


def _one_pass(monkeypatch, *args):
  monkeypatch.setattr(reference, "BLOCKED_MIN_QUERIES", 1 << 30)
  monkeypatch.setattr(reference, "BLOCKED_MIN_KEYS", 1 << 30)
  try:
    return np.asarray(reference.mla_paged_attention(*args, softmax_scale=0.25))
  finally:
    monkeypatch.undo()


@pytest.mark.parametrize("t,starts,n_new", [(40, [0, 0, 0], [40, 17, 0]),
                                            (100, [0, 37, 130], [100, 63, 100]),
                                            (300, [0, 200, 5], [300, 1, 250])])
def test_blocked_equals_one_pass(monkeypatch, t, starts, n_new):
  assert t >= reference.BLOCKED_MIN_QUERIES
  args, real = _inputs(t, t, starts, n_new)
  blocked = np.asarray(reference.mla_paged_attention(*args, softmax_scale=0.25))
  want = _one_pass(monkeypatch, *args)
  # Real queries agree; padding queries (past kv_len) are never read by the model.
  np.testing.assert_allclose(blocked[real], want[real], rtol=2e-5, atol=2e-5)
  assert np.all(np.isfinite(blocked))


def test_blocked_path_is_differentiable(monkeypatch):
  """Training runs the model's forward through the reference: the blocked path has gradients,
  equal to the one-pass path's."""
  args, real = _inputs(3, 64, [0, 10], [64, 50])
  mask = jnp.asarray(real)[:, :, None, None]

  def loss(ql, pages):
    out = reference.mla_paged_attention(ql, args[1], pages, *args[3:], softmax_scale=0.25)
    return jnp.sum(jnp.where(mask, out, 0.0) ** 2)

  g_blocked = jax.grad(loss, argnums=(0, 1))(args[0], args[2])
  monkeypatch.setattr(reference, "BLOCKED_MIN_QUERIES", 1 << 30)
  monkeypatch.setattr(reference, "BLOCKED_MIN_KEYS", 1 << 30)
  g_one = jax.grad(loss, argnums=(0, 1))(args[0], args[2])
  for a, b in zip(g_blocked, g_one):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [1, 5])
def test_decode_over_a_wide_page_table_reads_only_used_blocks(monkeypatch, t):
  """Decode / verification over a page table wider than BLOCKED_MIN_KEYS (a serving engine's,
  sized for max_model_len) runs blocked: only key blocks below the longest row are gathered.
  Rows whose pages run past the first key blocks, a row at the table's very end and an idle row
  (kv_len 0) all equal the one-pass path."""
  page, max_pages = 16, 64  # 1,024 positions
  assert page * max_pages >= reference.BLOCKED_MIN_KEYS
  starts = [3, 150, 700, page * max_pages - t, 0]
  n_new = [t, t, t, t, 0]
  args, real = _inputs(7 + t, t, starts, n_new, page, max_pages)
  blocked = np.asarray(reference.mla_paged_attention(*args, softmax_scale=0.25))
  want = _one_pass(monkeypatch, *args)
  np.testing.assert_allclose(blocked[real], want[real], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(blocked[4], 0.0)  # idle row: nothing visible
