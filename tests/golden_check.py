"""The golden logits check shared by the parity tests: our prefill and paged decode logits
against transformers' (tests/golden/fixtures/<case>/golden.npz), both prompts as one batch."""

import jax.numpy as jnp
import numpy as np

from engine.model.cache import contiguous_page_table, init_cache
from engine.model.transformer import forward_logits

REL_TOL = 1e-4  # max|ours - theirs| / max|theirs|, float32


def rel_err(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def assert_logits_match(params, cfg, g, label: str, page_size: int = 8) -> None:
  """Prefill logits, then every decode step's, feeding transformers' greedy tokens one at a
  time through our cache; each within REL_TOL."""
  prompts = [g["prompt_0"], g["prompt_1"]]
  lens = np.array([len(p) for p in prompts], np.int32)
  steps = g["decode_logits_0"].shape[0]
  pt = contiguous_page_table(2, int(lens.max()) + steps + 1, page_size)
  cache = init_cache(cfg, pt.size, page_size, jnp.float32)
  tokens = np.zeros((2, 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  logits, cache = forward_logits(params, cache, jnp.asarray(tokens), jnp.zeros(2, jnp.int32),
                                 jnp.asarray(lens), jnp.asarray(pt), cfg=cfg)
  for i in range(2):
    err = rel_err(np.asarray(logits)[i, :lens[i]], g[f"prefill_logits_{i}"])
    assert err <= REL_TOL, f"{label} prompt {i} prefill: relative error {err:.2e}"
  for t in range(steps):
    tok = np.array([[g["greedy_0"][t]], [g["greedy_1"][t]]], np.int32)
    logits, cache = forward_logits(params, cache, jnp.asarray(tok), jnp.asarray(lens + t),
                                   jnp.ones(2, jnp.int32), jnp.asarray(pt), cfg=cfg)
    for i in range(2):
      err = rel_err(np.asarray(logits)[i, 0], g[f"decode_logits_{i}"][t])
      assert err <= REL_TOL, f"{label} prompt {i} decode step {t}: relative error {err:.2e}"
