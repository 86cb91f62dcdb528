"""Mosaic GPU interpret mode with a public way for a kernel to know it is being interpreted.

Interpret mode (the CPU tests) lacks a few GPU features, so a kernel may take a different but
equivalent path under it (`paged_flash_mgpu`'s P @ V accumulation). jax keeps the mode in a private
config value; this wrapper records it in a context variable of our own instead.
"""

from __future__ import annotations

import contextlib
import contextvars

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
