"""Mosaic GPU interpret mode with a public way for a kernel to know it is being interpreted.

Interpret mode (the CPU tests) lacks a few GPU features, so a kernel may take a different but
equivalent path under it (`wgmma_accumulate`, the attention kernels' P @ V). jax keeps the mode in a
private config value; this wrapper records it in a context variable of our own instead.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_INTERPRETING = contextvars.ContextVar("moejax_gpu_interpret", default=False)


@contextlib.contextmanager
def gpu_interpret_mode(params: plgpu.InterpretGPUParams | None = None):
  """`plgpu.force_gpu_interpret_mode(params)`, visible to kernels through `interpreting()`."""
  token = _INTERPRETING.set(True)
  try:
    with plgpu.force_gpu_interpret_mode(params or plgpu.InterpretGPUParams()):
      yield
  finally:
    _INTERPRETING.reset(token)


def interpreting() -> bool:
  """Whether kernels are being traced under `gpu_interpret_mode`."""
  return _INTERPRETING.get()


def wgmma_accumulate(acc: jax.Array, a, b) -> jax.Array:
  """acc + a @ b by WGMMA (acc: a float32 `plgpu.Layout.WGMMA` value; a, b: SMEM refs). On the
  GPU it accumulates in place (a second accumulator of acc's size may not fit in registers:
  64 x 256 float32 does not beside the softmax's). Interpret mode implements neither
  `pl.run_state` nor accumulator stores, so there the product goes to a fresh accumulator and is
  added in registers."""
  if not interpreting():
    def in_place(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(in_place)(plgpu.ACC.init(acc))

  def fresh(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]
  return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
