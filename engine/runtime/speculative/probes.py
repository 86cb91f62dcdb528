"""Timing probes for the adaptive draft length's cost model (measured, not assumed).

* `probe`: one compiled program on rows of the null page (page 0), run PROBE_REPEATS times:
  the verify forward over [B, T] (the first n_new real) and its logits, the MTP layer over
  [B, 1], or a [B, 1] decode;
* `forward_probes`: those probes for the verify forward at given k and the model drafters;
* `time_interleaved`: runs every probe once per round, rounds interleaved, and keeps each one's
  fastest time, so load from elsewhere on the machine slows all probes alike;
* `loop_costs`: the fixed-batch loop's time per iteration at each compiled k
  (`loop.speculative_decode`'s step_costs), timed on the loop itself once per process and
  shape;
* `learning_kept`: what the serving loop learns (table, acceptance counts, statistics) set
  back after probes and warm-up calls that ran it on junk rows.

The serving engine fits its own model from the same probes (`SpecRuntime.measure_costs`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from typing import Any, Callable, Hashable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice
from engine.model.params import Params
from engine.model.transformer import Cache, compute_logits, forward, forward_mtp


@contextlib.contextmanager
def learning_kept(spec: Any) -> Iterator[None]:
  """Sets `spec`'s (a `SpecRuntime`) learned state back on exit: calls of the serving loop on
  the null page (probes, warm-up) would teach the table junk and move the acceptance counts,
  the rest schedule and the statistics."""
  names = ("accept", "accept_seen", "k_steps", "rest", "_probe", "per_position", "calibration",
           "per_drafter")
  saved = {n: copy.copy(getattr(spec, n)) for n in names}  # (numpy arrays: copies)
  table = None if spec.table is None else jax.tree.map(jnp.copy, spec.table)
  try:
    yield
  finally:
    for n, v in saved.items():
      setattr(spec, n, v)
    spec.table = table


# Forwards per timed probe call: one call's dispatch and transfers (~1 ms on the CPU demo,
# as much as the forward) would otherwise swamp the differences the fit needs.
PROBE_REPEATS = 8


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "what"), donate_argnames=("cache",))
def probe(params: Params, cache: Cache, tokens: jax.Array, n_new: jax.Array,
          page_table: jax.Array, *, cfg: ModelConfig, impl: KernelChoice, what: str):
  """PROBE_REPEATS runs of one program on rows of the null page: "verify" (target forward over
  [B, T], of which the first n_new [B] real, and logits), "mtp" (the MTP layer over [B, 1] and
  logits) or "decode" (a [B, 1] forward). Each run depends on the last (through the cache and
  its tokens), so none is hoisted or skipped."""
  b, t = tokens.shape
  zeros = jnp.zeros((b,), jnp.int32)

  def once(_, carry):
    cache, toks = carry
    if what == "mtp":
      h = jnp.zeros((b, t, cfg.hidden_size), params["embed"].dtype)
      hidden, cache = forward_mtp(params, cache, h, toks, zeros, n_new, page_table, cfg=cfg,
                                  impl=impl)
    else:
      hidden, cache = forward(params, cache, toks, zeros, n_new, page_table, cfg=cfg,
                              impl=impl)
    picked = jnp.argmax(compute_logits(params, hidden, cfg), axis=-1).astype(jnp.int32)
    return cache, jnp.where(picked == toks, toks, toks ^ 1)  # (tokens stay random-like)

  cache, toks = jax.lax.fori_loop(0, PROBE_REPEATS, once, (cache, tokens.astype(jnp.int32)))
  return toks, cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def clear_null_page(cache: Cache) -> Cache:
  return [{k: v.at[0].set(0) for k, v in layer.items()} for layer in cache]


def time_interleaved(probes: list[tuple[Hashable, str, Callable]], caches: dict[str, Any],
                     rounds: int) -> dict[Hashable, float]:
  """probes: (key, which cache, fn(cache) -> (out, cache)); caches are donated through (and
  updated in `caches`). Returns each key's fastest time in seconds over `rounds` (after one
  round that compiles)."""
  best = {key: float("inf") for key, _, _ in probes}
  for r in range(rounds + 1):
    for key, which, fn in probes:
      t0 = time.perf_counter()
      out, caches[which] = fn(caches[which])
      jax.block_until_ready(out)
      if r:
        best[key] = min(best[key], time.perf_counter() - t0)
  return best


def forward_probes(params: Params, cfg: ModelConfig, b: int, ks, page_table: np.ndarray,
                   impl: KernelChoice, rng: np.random.Generator, *, padded: bool = True,
                   mtp: bool = False, draft: tuple[ModelConfig, Params] | None = None
                   ) -> list[tuple[Hashable, str, Callable]]:
  """`time_interleaved` probes for b rows: the verify forward over k + 1 tokens for every k in
  `ks`, every position real (key ("verify", b, k, k + 1)) and, with `padded`, only the first
  (("verify", b, k, 1)); one MTP-layer step (("mtp", b), target cache) and one draft-model
  step (("draft", b), cache "draft"). Distinct random tokens: routing spreads over the experts
  as text does."""
  out = []
  for k in ks:
    toks = rng.integers(0, cfg.vocab_size, (b, k + 1), dtype=np.int32)
    for real in ((k + 1, 1) if k and padded else (k + 1,)):
      out.append((("verify", b, k, real), "target", functools.partial(
          probe, params, tokens=toks, n_new=np.full((b,), real, np.int32),
          page_table=page_table, cfg=cfg, impl=impl, what="verify")))
  one = rng.integers(0, cfg.vocab_size, (b, 1), dtype=np.int32)
  ones = np.ones((b,), np.int32)
  if mtp:
    out.append((("mtp", b), "target", functools.partial(
        probe, params, tokens=one, n_new=ones, page_table=page_table, cfg=cfg, impl=impl,
        what="mtp")))
  if draft is not None:
    out.append((("draft", b), "draft", functools.partial(
        probe, draft[1], tokens=one, n_new=ones, page_table=page_table, cfg=draft[0],
        impl=impl, what="decode")))
  return out


# Tokens per row in one loop-probe call: enough iterations that a call's dispatch is small.
LOOP_PROBE_TOKENS = 64
# Least cost of a verified column relative to the narrowest choice's iteration (as the
# engine's MIN_BASE, `serving_costs`).
MIN_COLUMN_COST = 0.03
# (cfg, B, K, method, page table shape, max_steps, page_size, dtype, draft cfg, impl) ->
# ([len(choices)] the fixed-batch loop's time per iteration at each choice, relative to the
# first; a plain-phase iteration's in the same unit).
_LOOP_COSTS: dict[tuple, tuple[np.ndarray, float]] = {}


def loop_costs(key: Hashable, run: Callable[[int, int], Any], choices: tuple[int, ...],
               tokens: int, rounds: int = 5, plain: bool = True
               ) -> tuple[np.ndarray, float | None]:
  """The step costs of the fixed-batch loop's goodput model (`loop.speculative_decode`'s
  `step_costs` and `plain_cost`), measured on the loop itself once per process and `key`:
  run(i, n) is one call of the compiled loop forced to choice i (i = len(choices): its plain
  phase only, timed with `plain`, else None) on scratch state with a budget of n tokens per
  row, returning its iterations (per choice, then the plain phase's). A choice's time per
  iteration is the difference between calls with budgets `tokens` and tokens // 2 over the
  difference in iterations (what a call costs once, dispatch and transfers, cancels): the
  median over `rounds` interleaved rounds (after one that compiles) of each round's
  back-to-back difference, at least half the long call's median time per iteration; over the
  first choice's, made
  non-decreasing in k (a wider block does all a narrower one does, so a lower figure is noise)
  and at least MIN_COLUMN_COST more per verified column (timings within noise of each other
  must not make drafting free: a drafter that is never right would then never back off).
  Timing the loop, not just its verify forward, prices what an iteration does besides the
  forward (lookups, acceptance, bookkeeping): on the CPU demo a K = 4 iteration costs ~1.4x
  what its forward alone predicts. The plain phase's figure is left as
  measured: it may well lie below the k = 0 choice's (whose drafter upkeep it skips)."""
  if key in _LOOP_COSTS:
    return _LOOP_COSTS[key]
  budgets = (tokens, max(tokens // 2, 1))
  n_choices = len(choices) + plain
  seconds = np.zeros((n_choices, 2, rounds))
  iters = np.zeros((n_choices, 2))
  for r in range(rounds + 1):
    for i in range(n_choices):
      for j, n in enumerate(budgets):
        t0 = time.perf_counter()
        iters[i, j] = int(np.sum(jax.device_get(run(i, n))))
        if r:
          seconds[i, j, r - 1] = time.perf_counter() - t0
  # Per round the two budgets' difference (timed back to back, so load that comes and goes
  # slows both alike), then the median over rounds. The fastest call of each budget,
  # differenced, put T(1) anywhere from 1.03 to 1.47 T(0) between processes on the CPU demo;
  # at 1.03 fresh text drafted at k = 1 and lost 10%.
  long_per_iter = np.median(seconds[:, 0], axis=-1) / np.maximum(iters[:, 0], 1)
  per_iter = np.where(iters[:, 0] > iters[:, 1],
                      np.median(seconds[:, 0] - seconds[:, 1], axis=-1)
                      / np.maximum(iters[:, 0] - iters[:, 1], 1),
                      long_per_iter)
  # A difference lost in noise (budgets a few iterations apart on a tiny model: a figure near
  # zero once made the plain phase 257109x the k = 0 iteration) is floored at half the long
  # call's time per iteration (its fixed cost included), which every choice shares.
  per_iter = np.maximum(per_iter, 0.5 * long_per_iter)
  cost = np.maximum.accumulate(per_iter[:len(choices)]) / per_iter[0]
  ks = np.asarray(choices, np.float64)
  _LOOP_COSTS[key] = (np.maximum(cost, 1.0 + MIN_COLUMN_COST * (ks - ks[0])),
                      float(per_iter[-1] / per_iter[0]) if plain else None)
  return _LOOP_COSTS[key]
