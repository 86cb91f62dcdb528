"""Routed-expert problems with quantized experts and their float32 reference, shared by the
quantized MoE kernel tests (`test_quantized_moe_kernels.py`: FP8; `test_w4a16_mgpu.py`: INT4)."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import reference
from pallas_kernels.quant import dequantize

TOL = 2e-2  # of the reference's largest magnitude: the kernels' bf16 h (and bf16 output)


def routed_problem(seed, t, e, k, h, i, experts, ids=None):
  """(x [t, h] bf16, routing weights [t, k], ids [t, k], gate, up, down): random tokens routed
  to k of e experts each (`ids` given: those), experts(rng, e, k_in, n_out) making each
  quantized [E, K, N] weight."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  if ids is None:
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
  w = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
  return (x, w, jnp.asarray(ids, jnp.int32),
          experts(rng, e, h, i), experts(rng, e, h, i), experts(rng, e, i, h))


def reference_f32(x, w, ids, wg, wu, wd, expert_offset=0):
  """The MoE in float32 over the weights the kernels multiply: dequantized to bf16 first (for
  FP8 the float32 product rounded, as the kernels do)."""
  deq = [dequantize(v, jnp.bfloat16).astype(jnp.float32) for v in (wg, wu, wd)]
  return reference.moe_experts_dense(x.astype(jnp.float32), w, ids, *deq,
                                     expert_offset=expert_offset)


def assert_close(got, want):
  """Every output written (interpret mode poisons the unwritten with NaN) and within TOL of the
  reference's largest magnitude."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all(), "kernel left output unwritten (NaN poison)"
  scale = np.abs(want).max()
  assert scale > 0
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * scale)
