"""The model runner: executes step descriptions on the device.

    runner = ModelRunner(cfg, params, EngineConfig(...), num_pages=..., cache_dtype=...)
    outputs = runner.execute(StepDescription(MIXED, arrays, scalars))   # host numpy outputs

It owns what lives on the device between steps: the parameters, the paged KV cache (donated to
every program and replaced by its result), the drafters' device state (the learned table, the
draft model's cache) and their own weights. It knows the engine's static configuration (model,
kernels, drafters, loop sizes) and nothing about requests: each `StepDescription` (host arrays
and scalars, `step_description.py`) carries a program's every input, and `program` turns it
into the jitted function and its arguments (also what warm-up compiles ahead, `warmup.py`).
The engine core (`engine.py`) decides the steps; a follower host of a multi-host replica runs
its runner alone, fed the leader's descriptions (`on_step`, `engine.service.multihost`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import clear_page, init_cache
from engine.model.config import ModelConfig
from engine.model.params import Params
from engine.model.sharding import cache_sharding
from engine.runtime import steps
from engine.runtime.engine_config import EngineConfig
from engine.runtime.page_pool import NULL_PAGE
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative import loop
from engine.runtime.speculative.drafters import Drafter
from engine.runtime.step_description import (CLEAR_NULL_PAGE, DECODE, DRAFTER, ENCODE, MASKED,
                                             MIXED, SPEC_DECODE, StepDescription)


@dataclasses.dataclass
class Program:
  """A description's jitted function and arguments; `keep(result)` stores what stays on the
  device (cache, drafter state) and returns the host outputs."""
  fn: Callable
  args: tuple
  kwargs: dict
  keep: Callable[[Any], dict[str, Any]]


def _sampling(a: dict[str, np.ndarray]) -> SamplingArrays:
  return SamplingArrays(**{f.name: a[f"sampling.{f.name}"]
                           for f in dataclasses.fields(SamplingArrays)})


def _decode_batch(a: dict[str, np.ndarray], sc: dict[str, Any]) -> steps.DecodeBatch:
  return steps.DecodeBatch(
      tokens=a["tokens"], n_cached=a["n_cached"], page_table=a["page_table"],
      sampling=_sampling(a), stop_ids=a["stop_ids"], remaining=a["remaining"],
      min_before_stop=a["min_before_stop"], num_steps=np.int32(sc["num_steps"]),
      want_logprobs=np.bool_(sc["want_logprobs"]))


def _lps(lps: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  return tuple(np.asarray(x) for x in lps)


class ModelRunner:
  """Device state and compiled programs of one engine (see the module docstring)."""

  def __init__(self, cfg: ModelConfig, params: Params, config: EngineConfig, *,
               num_pages: int, cache_dtype: Any, mesh: Any = None,
               drafters: tuple[Drafter, ...] = (), own_params: dict[str, Params] | None = None):
    self.cfg, self.params, self.config, self.mesh = cfg, params, config, mesh
    self.impl = config.kernels
    self.devices = jax.tree.leaves(params)[0].sharding.device_set
    # Drafters' own entries (an EAGLE-3 head's KV) after the model's, on the same pages.
    self.extra_entries = tuple(e for d in drafters for e in d.cache_entries())
    extra = (tuple(s for d in drafters for s in d.cache_shardings(mesh)) if mesh is not None
             else ())
    self.cache = self.place_cache(init_cache(cfg, num_pages, config.page_size, cache_dtype,
                                             extra=self.extra_entries), cfg, extra=extra)
    self.drafters = {d.name: d for d in drafters}
    self.own_params = dict(own_params or {})
    # Device state is committed where the weights are from the start (like the cache): a
    # commitment that changed after the first call would compile the loop twice.
    self.state = {}
    for d in drafters:
      st = d.init_state(num_pages, config.page_size, cache_dtype, self.place_cache,
                        self.place_state)
      if st is not None:
        self.state[d.name] = st
    self.learners = tuple(d for d in drafters if d.learns_from_plain)
    self.observers = tuple(d for d in drafters if d.observes_prefill)
    # Model drafters of constrained rows: the masked step keeps them current and proposes.
    self.constrained_drafters = tuple(d for d in drafters if d.drafts_constrained)
    k = config.num_draft_tokens
    self.loop_config = loop.LoopConfig(
        max_steps=config.max_decode_steps * (k + 1),
        widths=(0, k) if config.adaptive_k else (k,), drafters=tuple(drafters), cfg=cfg,
        impl=self.impl) if drafters else None
    self.vision_params = params.get("vision") if isinstance(params, dict) else None
    # A multi-host leader's hooks (`engine.service.multihost.lead`): each description goes to
    # the followers before its program runs here, and warm-up tells them to compile ahead.
    self.on_step: Callable[[StepDescription], None] | None = None
    self.on_warmup: Callable[[], None] | None = None

  # ---- placement -------------------------------------------------------------------------------

  def place_cache(self, cache: Any, cfg: ModelConfig, extra: tuple = ()) -> Any:
    """`cache` placed: on a mesh, the model's entries by `cache_sharding`, its last
    len(extra) entries (drafters' own) by `extra` (`Drafter.cache_shardings`)."""
    if self.mesh is not None:
      n = len(cache) - len(extra)
      return jax.device_put(cache, [cache_sharding(cfg, self.mesh)] * n + list(extra))
    if len(self.devices) == 1:
      # Commit the cache where the weights are: jit outputs are committed when an input is,
      # and a cache whose commitment changes after the first step would compile twice.
      return jax.device_put(cache, next(iter(self.devices)))
    return cache

  def place_state(self, tree: Any) -> Any:
    if self.mesh is None and len(self.devices) == 1:
      return jax.device_put(tree, next(iter(self.devices)))
    return tree

  def on_mesh(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  # ---- execution ------------------------------------------------------------------------------

  def execute(self, desc: StepDescription) -> dict[str, Any]:
    """Runs the description's program; returns its host outputs."""
    if self.on_step is not None:
      self.on_step(desc)
    with self.on_mesh():
      prog = self.program(desc)
      return prog.keep(prog.fn(*prog.args, **prog.kwargs))

  def program(self, desc: StepDescription) -> Program:
    """The jitted function and arguments of a description (what `execute` runs)."""
    a, sc = desc.arrays, desc.scalars
    kernels = dict(impl=self.impl)
    if desc.kind == MIXED:
      observe = "next_tokens" in a
      own = {d.name: self.own_params[d.name] for d in self.observers
             if observe and d.name in self.own_params}
      args = (self.params, self.cache, a["tokens"], a["start"], a["n_new"], a["page_table"],
              _sampling(a), a.get("features"), a.get("feature_mask"), a.get("next_tokens"),
              own or None)
      return Program(steps.model_step, args,
                     dict(cfg=self.cfg, observers=self.observers if observe else (), **kernels),
                     self._keep_mixed)
    if desc.kind == DECODE:
      batch = _decode_batch(a, sc)
      if self.learners:  # (the description carries each learner's `plain_inputs`)
        inputs = {d.name: desc.with_prefix(d.name) for d in self.learners}
        state = {d.name: self.state[d.name] for d in self.learners}
        return Program(loop.decode_loop_learning, (self.params, self.cache, batch, state,
                                                   inputs),
                       dict(max_steps=self.config.max_decode_steps, cfg=self.cfg,
                            learners=self.learners, **kernels), self._keep_learning)
      return Program(steps.decode_loop, (self.params, self.cache, batch),
                     dict(max_steps=self.config.max_decode_steps, cfg=self.cfg, **kernels),
                     self._keep_decode)
    if desc.kind == SPEC_DECODE:
      return self._spec_program(a, sc)
    if desc.kind == MASKED:
      args = (self.params, self.cache, a["tokens"], a["start"], a["n_draft"], a["page_table"],
              _sampling(a), a["bitmask"], np.bool_(sc["want_logprobs"]))
      extra = {}
      if self.constrained_drafters:  # (absent arrays: warm-up's junk rows, which write nothing)
        b = a["tokens"].shape[0]
        extra = dict(
            rows={d.name: a.get(f"rows.{d.name}", np.zeros((b, d.row_width()), np.float32))
                  for d in self.constrained_drafters},
            own_params={d.name: self.own_params.get(d.name) for d in self.constrained_drafters},
            live=a.get("live", np.zeros((b,), bool)),
            drafting=a.get("drafting", np.zeros((b,), np.int32)))
      return Program(steps.masked_step, args,
                     dict(cfg=self.cfg, drafters=self.constrained_drafters,
                          k=self.config.num_draft_tokens if self.constrained_drafters else 0,
                          **extra, **kernels),
                     self._keep_masked)
    if desc.kind == DRAFTER:
      name = sc["drafter"]
      fn, args, kwargs = self.drafters[name].program(self.state.get(name),
                                                     self.own_params.get(name), a, **kernels)

      def keep(state, name=name):
        self.state[name] = state
        return {}
      return Program(fn, args, kwargs, keep)
    if desc.kind == ENCODE:
      from engine.model import vision
      return Program(vision.encode_images, (self.vision_params, a["pixels"], a["grids"]),
                     dict(cfg=self.cfg.vision, num_patches=int(sc["num_patches"])),
                     lambda out: {"features": np.asarray(jax.device_get(out))})
    if desc.kind == CLEAR_NULL_PAGE:
      return Program(self._clear_null_page, (), {}, lambda out: {})
    raise ValueError(f"no program for step kind {desc.kind!r}")

  def _spec_program(self, a: dict[str, np.ndarray], sc: dict[str, Any]) -> Program:
    b = a["tokens"].shape[0]
    spec = loop.SpecInputs(
        history=a["history"], history_len=a["history_len"], row_drafter=a["row_drafter"],
        row_auto=a["row_auto"], row_max_draft=a["row_max_draft"], row_accept=a["row_accept"],
        accept=a["accept"], auto_allowed=a["auto_allowed"], fed=a["fed"], costs=a["costs"],
        time_budget=np.float32(sc["time_budget"]), force_width=np.int32(sc["force_width"]))
    junk = bool(sc.get("junk", False))  # (warm-up, timing: junk rows must teach nothing)
    guarded = {n for n, d in self.drafters.items() if junk and d.junk_changes_state}
    state = {n: jax.tree.map(jnp.copy, s) if n in guarded else s for n, s in self.state.items()}
    rows = {}
    for name, d in self.drafters.items():
      if d.row_width():
        rows[name] = a.get(f"rows.{name}", np.zeros((b, d.row_width()), np.float32))

    def keep(out):
      result, self.cache, new_state = out
      for n, s in new_state.items():
        if n not in guarded:
          self.state[n] = s
      host = jax.device_get({f.name: getattr(result, f.name)
                             for f in dataclasses.fields(result)})
      host["lps"] = _lps(host["lps"])
      return host
    return Program(loop.speculative_decode_loop,
                   (self.params, self.cache, _decode_batch(a, sc), spec, state, rows,
                    self.own_params), dict(config=self.loop_config), keep)

  # ---- what stays on the device, what comes back ----------------------------------------------

  def _keep_mixed(self, out) -> dict[str, Any]:
    sampled, lps, rows, self.cache = out
    sampled, lps, rows = jax.device_get((sampled, lps, rows))
    return {"sampled": np.asarray(sampled), "lps": _lps(lps),
            **{f"rows.{n}": np.asarray(r) for n, r in rows.items()}}

  def _keep_decode(self, out) -> dict[str, Any]:
    tokens, count, _, lps, self.cache = out
    tokens, count, lps = jax.device_get((tokens, count, lps))
    return {"out": np.asarray(tokens), "count": np.asarray(count), "lps": _lps(lps)}

  def _keep_learning(self, out) -> dict[str, Any]:
    *head, state = out
    self.state.update(state)
    return self._keep_decode(tuple(head))

  def _keep_masked(self, out) -> dict[str, Any]:
    emitted, counts, lps, rows, drafts, self.cache = out
    emitted, counts, lps, rows, drafts = jax.device_get((emitted, counts, lps, rows, drafts))
    return {"out": np.asarray(emitted), "count": np.asarray(counts), "lps": _lps(lps),
            "drafts": np.asarray(drafts), **{f"rows.{n}": np.asarray(r) for n, r in rows.items()}}

  def _clear_null_page(self) -> None:
    self.cache = clear_page(self.cache, NULL_PAGE, self.cfg)
    for name, d in self.drafters.items():
      if name in self.state:
        self.state[name] = d.clear_null_page(self.state[name])
