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
import re
import sys
from typing import Callable

import jax
import numpy as np

from engine.model.params import abstract_params
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
# "mosaic_gpu": MLA decode / verify blocks take the split-KV decode kernel, prefill chunks the
# flash-decoding kernel; "mosaic_gpu_flash": the flash kernel for every MLA block (A/B runs, a
# fallback); GQA has the one kernel under both names.
_MLA_ATTENTION: dict[str, Callable | _Deferred] = {
    "reference": attn_ref.mla_paged_attention,
    "mosaic_gpu": _Deferred(_MGPU_ATTENTION + "mla_paged_attention_mgpu", "mla_paged_attention"),
    "mosaic_gpu_flash": _Deferred(_MGPU_ATTENTION + "mla_paged_attention_mgpu",
                                  "mla_paged_attention_flash")}
_GQA_ATTENTION: dict[str, Callable | _Deferred] = {
    "reference": attn_ref.gqa_paged_attention,
    "mosaic_gpu": _Deferred(_MGPU_ATTENTION + "gqa_paged_attention_mgpu", "gqa_paged_attention"),
    "mosaic_gpu_flash": _Deferred(_MGPU_ATTENTION + "gqa_paged_attention_mgpu",
                                  "gqa_paged_attention")}
_WRITE_PAGES: dict[str, Callable | _Deferred] = {"reference": attn_ref.write_pages}
_ROUTE: dict[str, Callable | _Deferred] = {
    "reference": moe_ref.route, "mosaic_gpu": _Deferred("pallas_kernels.moe.moe_mgpu", "route")}
_MOE_EXPERTS: dict[str, Callable | _Deferred] = {
    "reference": moe_ref.moe_experts,
    "mosaic_gpu": _Deferred("pallas_kernels.moe.moe_mgpu", "moe_experts")}


def _pick(table: dict[str, Callable | _Deferred], name: str, what: str) -> Callable:
  if name == "auto":
    raise ValueError(f"{what}: the kernel choice 'auto' must be resolved first "
                     "(`kernels.resolve`; engine.load and Engine do)")
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


# ---- "auto": the kernels a device and a model allow, chosen once at load ----------------------

AUTO = KernelChoice(attention="auto", moe="auto")
MOSAIC_GPU = "mosaic_gpu"
# Hopper (sm_90): the Mosaic GPU kernels are written for WGMMA and TMA, which Blackwell's
# tcgen05 path does not share; device kinds as jax reports them ("NVIDIA H100 80GB HBM3",
# "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA H20").
_HOPPER = re.compile(r"\bG?H(100|200|800|20)\b")


def is_hopper(device_kind: str, platform: str = "gpu") -> bool:
  return platform in ("gpu", "cuda") and bool(_HOPPER.search(device_kind))


@dataclasses.dataclass(frozen=True)
class Resolution:
  """A resolved `KernelChoice` and, per hot path that "auto" left on the plain-JAX reference,
  why (path, reason)."""
  choice: KernelChoice
  reasons: tuple[tuple[str, str], ...] = ()

  def line(self) -> str:
    """`kernels: attention=mosaic_gpu moe=reference (moe: ...)`: the one stderr line."""
    why = "; ".join(f"{path}: {reason}" if path else reason for path, reason in self.reasons)
    return (f"kernels: attention={self.choice.attention} moe={self.choice.moe}"
            + (f" ({why})" if why else ""))


def _first_problem(checks) -> str | None:
  """The first failing check's message, shortened to one line (a check raises the kernel's
  own ValueError / NotImplementedError / TypeError for shapes or dtypes it cannot take)."""
  for check in checks:
    try:
      check()
    except (ValueError, NotImplementedError, TypeError) as e:
      msg = " ".join(str(e).split())
      return msg if len(msg) <= 160 else msg[:157] + "..."
  return None


def _attention_problem(cfg, cache_dtype, page_size: int) -> str | None:
  """Why the Mosaic GPU attention kernel cannot take this model's cache, or None: the kernel
  wrapper traced (`jax.eval_shape`, nothing compiled) at the model's head dims and page size,
  so its own checks decide (dtype, page size, head dims against the swizzle tiling)."""
  s, i32 = jax.ShapeDtypeStruct, jax.numpy.int32
  pick = KernelChoice(attention=MOSAIC_GPU)
  nh, table = cfg.num_heads, (s((1, 2), i32), s((1, 1), i32), s((1,), i32))
  if cfg.is_mla:
    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    args = (s((1, 1, nh, dc), cache_dtype), s((1, 1, nh, dr), cache_dtype),
            s((2, page_size, dc + dr), cache_dtype), *table)
    fn = mla_attention(pick)
  else:
    hd, nkv = cfg.head_dim, cfg.num_kv_heads
    pages = s((2, page_size, nkv, hd), cache_dtype)
    args = (s((1, 1, nh, hd), cache_dtype), pages, pages, *table)
    fn = gqa_attention(pick)
  return _first_problem([lambda: jax.eval_shape(
      functools.partial(fn, softmax_scale=cfg.softmax_scale), *args)])


def _moe_problem(cfg, dtype) -> str | None:
  """Why the Mosaic GPU expert kernels cannot take some MoE layer's routed experts (bf16, INT4
  or FP8 as stored), or None: `moe_experts` traced as the model calls it (a stack's experts
  with a layer index, an MTP layer's alone) for a decode (1 token) and a prefill (256 tokens)
  batch, which take different kernels."""
  if not cfg.num_experts:
    return "the model has no routed experts"
  tree = abstract_params(cfg, dtype)
  s = jax.ShapeDtypeStruct
  formats = {}  # one check per distinct expert layout: (experts, layer index or None)
  for layers, layer in [(tree["stacks"], s((), np.int32)), (tree.get("mtp", []), None)]:
    for p in layers:
      if "moe" in p:
        experts = p["moe"]["experts"]
        key = str(jax.tree.map(lambda a: (a.shape[layer is not None:], a.dtype), experts))
        formats.setdefault(key, (experts, layer))
  fn = moe_experts(KernelChoice(moe=MOSAIC_GPU))
  k = cfg.num_experts_per_tok
  def call(x, weights, ids, gate, up, down, layer=None):
    return fn(x, weights, ids, gate, up, down, **({} if layer is None else {"layer": layer}))

  return _first_problem(
      lambda ex=ex, i=i, t=t: jax.eval_shape(
          call, s((t, cfg.hidden_size), dtype), s((t, k), np.float32), s((t, k), np.int32),
          ex["gate"], ex["up"], ex["down"], *(() if i is None else (i,)))
      for ex, i in formats.values() for t in (1, 256))


def resolve(choice: KernelChoice, cfg, *, device_kind: str, platform: str, dtype,
            cache_dtype=None, page_size: int = 16) -> Resolution:
  """Each "auto" path of `choice` made concrete for this device and model: "mosaic_gpu" where
  the device is Hopper and the path's kernel takes the model's dtypes and shapes (attention:
  cache dtype, head dims, `page_size`; MoE: activation dtype, hidden and expert widths, the
  experts' format), "reference" (plain JAX) otherwise, with the reason. Paths named explicitly
  are kept as named. `dtype`: the parameters' (activations'); `cache_dtype` defaults to it.
  A function of its arguments only (no device is touched)."""
  wanted = {"attention": choice.attention, "moe": choice.moe}
  if "auto" not in wanted.values():
    return Resolution(choice)
  hopper = is_hopper(device_kind, platform)
  problems = {"attention": lambda: _attention_problem(cfg, cache_dtype or dtype, page_size),
              "moe": lambda: _moe_problem(cfg, dtype)}
  picked, reasons = dict(wanted), []
  if not hopper:
    reasons.append(("", f"no Hopper GPU: {device_kind or platform}"))
  for path, name in wanted.items():
    if name != "auto":
      continue
    problem = problems[path]() if hopper else "not Hopper"
    picked[path] = "reference" if problem else MOSAIC_GPU
    if problem and hopper:
      reasons.append((path, problem))
  return Resolution(dataclasses.replace(choice, **picked), tuple(reasons))


def resolve_for_params(choice: KernelChoice, cfg, params, *, mesh=None, cache_dtype=None,
                       page_size: int = 16) -> Resolution:
  """`resolve` for the devices holding `params` (the mesh's first device if given), their
  dtype (the embedding's) and `page_size`."""
  if mesh is not None:
    device = mesh.devices.flat[0]
  else:  # (host arrays: JAX's default device)
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    device = next(iter(sharding.device_set)) if sharding is not None else jax.devices()[0]
  dtype = params["embed"].dtype
  return resolve(choice, cfg, device_kind=device.device_kind, platform=device.platform,
                 dtype=dtype, cache_dtype=cache_dtype or dtype, page_size=page_size)


_ANNOUNCED: set[str] = set()


def announce(resolution: Resolution) -> Resolution:
  """Prints `resolution.line()` on stderr, once per distinct line in this process (a model
  loaded, then its engine built with the same page size, say it once)."""
  line = resolution.line()
  if line not in _ANNOUNCED:
    _ANNOUNCED.add(line)
    print(line, file=sys.stderr, flush=True)
  return resolution
