"""The switch between kernel implementations for the model's hot paths.

The model calls attention, cache writes, routing and expert computation only through this module,
so that Pallas kernels (attention and MoE issues) drop in behind a name without touching the
model. Every implementation has the signature of the plain-JAX reference in `pallas_kernels/`.

`KernelChoice` is static (hashable) and travels with the jitted functions.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import jax
import numpy as np

from pallas_kernels.attention import reference as attn_ref
from pallas_kernels.moe import reference as moe_ref


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """Which implementation each hot path uses ("reference" = plain JAX, runs everywhere)."""
  attention: str = "reference"
  moe: str = "reference"
  # How routed experts are combined over an expert-parallel group (`expert_parallel.py`):
  # "psum" (replicated tokens, one all-reduce), "dispatch" (tokens split over the group and
  # exchanged with the experts' owners), "auto" (dispatch from DISPATCH_MIN_TOKENS per device).
  expert_parallel: str = "psum"


REFERENCE = KernelChoice()


@dataclasses.dataclass(frozen=True)
class _Deferred:
  """An implementation imported when first picked: the Mosaic GPU kernels import
  `jax.experimental.pallas.mosaic_gpu`, ~0.5 s of CPU that every process (each command line,
  each test worker) paid at `import engine` although few ever choose them."""
  module: str
  attr: str

  def load(self) -> Callable:
    return getattr(importlib.import_module(self.module), self.attr)


# Mosaic GPU attention kernels (NVIDIA Hopper; bf16/f16 caches). Cache writes keep the XLA
# scatter (`write_pages` falls back to the reference for this name): with the pages donated it
# updates in place and moves only the new tokens.
_MGPU_ATTENTION = "pallas_kernels.attention."
_MLA_ATTENTION: dict[str, Callable | _Deferred] = {
    "reference": attn_ref.mla_paged_attention,
    "mosaic_gpu": _Deferred(_MGPU_ATTENTION + "mla_paged_attention_mgpu", "mla_paged_attention")}
_GQA_ATTENTION: dict[str, Callable | _Deferred] = {
    "reference": attn_ref.gqa_paged_attention,
    "mosaic_gpu": _Deferred(_MGPU_ATTENTION + "gqa_paged_attention_mgpu", "gqa_paged_attention")}
_WRITE_PAGES: dict[str, Callable | _Deferred] = {"reference": attn_ref.write_pages}
_ROUTE: dict[str, Callable | _Deferred] = {
    "reference": moe_ref.route, "mosaic_gpu": _Deferred("pallas_kernels.moe.moe_mgpu", "route")}
_MOE_EXPERTS: dict[str, Callable | _Deferred] = {
    "reference": moe_ref.moe_experts,
    "mosaic_gpu": _Deferred("pallas_kernels.moe.moe_mgpu", "moe_experts")}


def _pick(table: dict[str, Callable | _Deferred], name: str, what: str) -> Callable:
  try:
    fn = table[name]
  except KeyError:
    raise ValueError(f"no {what} implementation named {name!r}; have {sorted(table)}") from None
  if isinstance(fn, _Deferred):
    fn = table[name] = _jit_per_static_kwargs(fn.load())
  return fn


def _jit_per_static_kwargs(fn: Callable) -> Callable:
  """fn behind one `jax.jit` per set of static keyword arguments (those holding no array), the
  arrays passed through it: every layer's call site then shares one lowered (and compiled)
  kernel per shape instead of each lowering its own, which took a 27-layer decode step ~95 s
  to compile on an H200 (BENCHMARKS.md, second GPU run). jit's cache already sees shapes and
  jax's trace context (abstract mesh, shard_map axes, jax's own interpret mode); the key adds
  what the kernels read besides: `interpreting()`, a context variable of ours."""
  from pallas_kernels.interpret import interpreting  # (imports Mosaic GPU: only when picked)

  @functools.lru_cache(maxsize=None)
  def jitted(static: tuple, interpret: bool) -> Callable:
    return jax.jit(functools.partial(fn, **{k: v for k, _, v in static}))

  @functools.wraps(fn)
  def call(*args, **kwargs):
    dynamic = {k: v for k, v in kwargs.items()
               if any(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(v))}
    static = tuple(sorted((k, type(v), v) for k, v in kwargs.items() if k not in dynamic))
    for k, _, v in static:
      try:
        hash(v)
      except TypeError:
        raise TypeError(f"{fn.__module__}.{fn.__name__}: keyword argument {k}={v!r} holds no "
                        "array, so it is static, and must be hashable") from None
    return jitted(static, interpreting())(*args, **dynamic)

  return call


def register(path: str, name: str, fn: Callable) -> None:
  """Registers an implementation (`path` one of mla_attention, gqa_attention, write_pages,
  route, moe_experts) under `name`, for kernels that live outside this module. Called as given
  (not behind `_jit_per_static_kwargs`: a test's checking wrapper may keep Python state)."""
  tables = {"mla_attention": _MLA_ATTENTION, "gqa_attention": _GQA_ATTENTION,
            "write_pages": _WRITE_PAGES, "route": _ROUTE, "moe_experts": _MOE_EXPERTS}
  tables[path][name] = fn


def mla_attention(k: KernelChoice) -> Callable:
  return _pick(_MLA_ATTENTION, k.attention, "MLA attention")


def gqa_attention(k: KernelChoice) -> Callable:
  return _pick(_GQA_ATTENTION, k.attention, "GQA attention")


def write_pages(k: KernelChoice) -> Callable:
  return _pick(_WRITE_PAGES, k.attention if k.attention in _WRITE_PAGES else "reference",
               "cache write")


def route(k: KernelChoice) -> Callable:
  return _pick(_ROUTE, k.moe if k.moe in _ROUTE else "reference", "routing")


def moe_experts(k: KernelChoice) -> Callable:
  return _pick(_MOE_EXPERTS, k.moe, "MoE experts")

