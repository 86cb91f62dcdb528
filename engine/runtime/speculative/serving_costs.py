"""The serving engine's cost model, measured (`SpecRuntime.measure_costs`, at warm-up).

Times, at the smallest and largest decode batch, the plain decode loop, the speculative loop
at every compiled k (forced, rows not drafting; both loops also over one token, which splits a
call's time into a fixed and a per-iteration part), the verify forward with every position real
and with only the first, and each model drafter's step (`probes.forward_probes`,
`probes.time_interleaved`), then fits the goodput model's step time in plain-loop iterations:
T = 1 + [K > 0] overhead + K (base + pad_row B + drafters) + per_token sum_b k_b
(`goodput.plan`; least squares of the times it predicts, `column_fit`, `token_fit`), plus
the speculative call's fixed cost beyond a plain call's (`SpecRuntime.call_cost`,
`call_policy`). What live traffic then measures corrects it (`SpecRuntime.live_costs`).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Sequence

import jax
import numpy as np

from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache
from engine.runtime import steps
from engine.runtime.sampling import SamplingArrays, SamplingParams
from engine.runtime.speculative import plain_calls
from engine.runtime.speculative.live_correction import LiveCorrection
from engine.runtime.speculative.probes import (PROBE_REPEATS, clear_null_page,
                                               forward_probes, learning_kept,
                                               time_interleaved)
from engine.runtime.speculative.serving import drafter_id

# Floor of the fitted base cost per verified position: timings within noise of each other must
# not make verification free (a drafter that proposes nothing would then never back off).
MIN_BASE = 0.03


def measure_serving_costs(spec: Any, params: Params, cache: Cache, batch_sizes: Sequence[int],
                          max_pages: int, *, stop_width: int, impl: KernelChoice = REFERENCE,
                          rounds: int = 7) -> Cache:
  """Times the serving loop itself at every compiled k (forced, rows not drafting: a padded
  block), the verify forward with every position real and with only the first, and each
  model drafter's step, at the given batch sizes; fits T(B, k) and installs it in `spec` (a
  `SpecRuntime`; the plain-iteration unit too, and the live correction starts over). Returns the
  cache (donated through). `stop_width`: the engine's stop-id columns (its compiled shape).

  The loop probes price everything an iteration does besides the forward (drafter lookups,
  acceptance, bookkeeping): on 2 CPU cores a K = 4 iteration costs ~1.4x what its verify
  forward alone predicts. Every probe runs once per round, rounds interleaved, and keeps its
  fastest time: load from elsewhere on the machine then slows all probes alike."""

  caches = {"target": cache, "draft": spec.draft_cache}
  probes: list[tuple[tuple, str, Any]] = []  # (key, which cache, program)
  rng = np.random.default_rng(0)
  n = spec.config.max_decode_steps  # iterations per full loop probe
  for b in sorted(set(batch_sizes)):
    pt = np.zeros((b, max_pages), np.int32)  # the null page: cleared afterwards
    probes += forward_probes(
        params, spec.cfg, b, sorted(set(spec.choices) | {0}), pt, impl, rng,
        mtp="mtp" in spec.enabled,
        draft=(spec.draft_cfg, spec.draft_params) if "draft" in spec.enabled else None)
    for n_steps in (n, 1):  # a full call and a one-token call: the fixed costs
      probes.append((("plain", b, n_steps), "target", functools.partial(
          _plain_probe, spec, params, b=b, n_steps=n_steps, max_pages=max_pages,
          stop_width=stop_width, impl=impl,
          tokens=rng.integers(0, spec.cfg.vocab_size, (b,), dtype=np.int32))))
    for i, k in enumerate(spec.choices):
      for n_steps in ((n, 1) if k == 0 else (n,)):
        probes.append((("loop", b, k, n_steps), "target", functools.partial(
            _loop_probe, spec, params, caches=caches, b=b, n_steps=n_steps, force_k=i,
            max_pages=max_pages, stop_width=stop_width, impl=impl, tokens=rng.integers(
                0, spec.cfg.vocab_size, (b,), dtype=np.int32))))
  with learning_kept(spec):  # (the loop probes teach the table junk, move the counters)
    best = time_interleaved(probes, caches, rounds)
  best = {key: t if key[0] in ("loop", "plain") else t / PROBE_REPEATS
          for key, t in best.items()}  # seconds per loop call, per forward
  table = {b: {k: best[("verify", b, k, k + 1)] for k in sorted(set(spec.choices) | {0})}
           for b in sorted(set(batch_sizes))}  # every position real
  padded = {b: {k: best[("verify", b, k, 1)] for k in row} for b, row in table.items()}
  loop = {b: {k: best[("loop", b, k, n)] / n for k in spec.choices} for b in table}  # s / iter
  plain = {b: best[("plain", b, n)] / n for b in table}  # the unit of T
  spec.plain_iter_s.update(plain)
  drafter_s = {d: [best[(d, b)] / plain[b] for b in table] if d in spec.enabled else []
               for d in ("mtp", "draft")}
  # A call's time a + n b on each loop, from n and one iteration: the speculative call's fixed
  # cost beyond the plain call's (a_spec - a_plain) and the k = 0 iteration's beyond a plain
  # one (b_spec - b_plain), in plain iterations. Without k = 0 compiled (fixed k) the
  # speculative loop's extra time is all per iteration, as before the split was measured.
  call_cost, overhead = [], []
  for b in table:
    if 0 not in spec.choices:
      overhead.append(loop[b][spec.choices[0]] / plain[b] - 1.0)
      continue
    full_s, one_s = best[("loop", b, 0, n)], best[("loop", b, 0, 1)]
    full_p, one_p = best[("plain", b, n)], best[("plain", b, 1)]
    per_s, per_p = (full_s - one_s) / (n - 1), (full_p - one_p) / (n - 1)
    call_cost.append(((one_s - per_s) - (one_p - per_p)) / plain[b])
    overhead.append((per_s - per_p) / plain[b])
  spec.call_cost = max(float(np.mean(call_cost)), 0.0) if call_cost else 0.0
  overhead = max(float(np.mean(overhead)), 0.0)
  caches = {w: c if c is None else clear_null_page(c) for w, c in caches.items()}
  cache, spec.draft_cache = caches["target"], caches["draft"]
  # All relative to a plain decode-loop iteration t_plain(B). Overhead: the speculative
  # loop's k = 0 iteration beyond it. Per block column: `column_fit` of r(B, k) = (t_loop(B, k)
  # - t_loop(B, 0)) / t_plain(B) over k > 0 (a padded block). Per real drafted token:
  # `token_fit` of (t_verify,full - t_verify,padded) / t_plain(B).
  ks, bs, extra, tok = [], [], [], []
  for b, row in loop.items():
    for k, t in row.items():
      if k > 0:
        ks.append(k)
        bs.append(b)
        extra.append((t - row[0]) / plain[b])
        tok.append((table[b][k] - padded[b][k]) / plain[b])
  base, pad_row = column_fit(np.asarray(ks), np.asarray(bs), np.asarray(extra))
  base = max(base, MIN_BASE)
  per_token = token_fit(np.asarray(ks), np.asarray(bs), np.asarray(tok))
  costs = spec.costs.copy()
  for d, rs in drafter_s.items():
    if rs:
      costs[drafter_id(d)] = float(np.mean(rs))
  costs[-4:] = overhead, base, pad_row, per_token
  spec.costs = costs.astype(np.float32)
  spec.correction = LiveCorrection()  # (a new model: what live calls measured is void)
  spec.cost_fit = dict(overhead=overhead, base=base, pad_row=pad_row, per_token=per_token,
                       call=spec.call_cost,
                       **{f"draft_{d}": float(np.mean(rs)) for d, rs in drafter_s.items()
                          if rs},
                       table={b: {k: round(t * 1e3, 4) for k, t in row.items()}
                              for b, row in table.items()},  # ms
                       table_padded={b: {k: round(t * 1e3, 4) for k, t in row.items()}
                                     for b, row in padded.items()},
                       table_loop={b: {k: round(t * 1e3, 4) for k, t in row.items()}
                                   for b, row in loop.items()},
                       plain_loop={b: round(t * 1e3, 4) for b, t in plain.items()})
  return cache


def column_fit(k: np.ndarray, b: np.ndarray, r: np.ndarray) -> tuple[float, float]:
  """(base, pad_row) >= 0 minimising sum (r - k (base + pad_row b))^2: the block's cost per
  column from the loop probes' extra time r [N] (plain iterations) at block widths k [N] and
  batch sizes b [N].

  Fitted to the loop times the goodput model predicts, not to r / k: so the wide blocks, where
  most of the time goes, weigh most, and a first column dearer than the rest (at one row the
  k = 0 forward gathers its experts' weights, a wider block runs every expert) does not set
  the price of every column. Where the unconstrained optimum has a negative term, the best fit
  with that term 0 (an intercept extrapolated from a falling line would over-price every
  batch); with one batch size, pad_row is 0."""
  k, b, r = (np.asarray(x, np.float64) for x in (k, b, r))
  if not len(r):
    return 0.0, 0.0
  a = np.stack([k, k * b], axis=1)
  best, best_err = (0.0, 0.0), float(np.sum(r * r))
  for cols in ([0, 1], [0], [1]) if len(set(b.tolist())) > 1 else ([0],):
    x = np.zeros(2)
    x[cols] = np.linalg.lstsq(a[:, cols], r, rcond=None)[0]
    err = float(np.sum((a @ x - r) ** 2))
    if (x >= 0).all() and err < best_err - 1e-12:
      best, best_err = (float(x[0]), float(x[1])), err
  return best


def token_fit(k: np.ndarray, b: np.ndarray, r: np.ndarray) -> float:
  """per_token >= 0 minimising sum (r - per_token b k)^2: the cost of a real drafted token
  from the verify forward's extra time r [N] (plain iterations) with all b k drafts [N] real
  over all padded. Weighted like `column_fit` by the block's size: the mean of r / (b k) let a
  one-row block's noise, which the model then multiplies by every drafted token of a block,
  price every block (0.0 to 0.08 across warm-ups on the 2-core CPU, where the reference MoE
  runs every expert on every position, so a real token costs what a padded one does)."""
  x = np.asarray(k, np.float64) * np.asarray(b, np.float64)
  return max(float(np.dot(x, np.asarray(r, np.float64)) / np.dot(x, x)), 0.0) if len(x) else 0.0


def _probe_rows(spec, b: int, max_pages: int, stop_width: int) -> tuple:
  """The loop probes' rows after `tokens`: (n_cached, page table, sampling, stop ids,
  remaining, min_before). b greedy rows with max_decode_steps tokens to go, a quarter of the
  page table cached (attention over a typical context; every page is the null page, so
  nothing real is read or written)."""
  n = spec.config.max_decode_steps
  context = max(max_pages * spec.config.page_size // 4 - n * (max(spec.choices) + 1), 0)
  return (np.full((b,), context, np.int32), np.zeros((b, max_pages), np.int32),
          SamplingArrays.from_params([SamplingParams()] * b),
          np.full((b, stop_width), -1, np.int32), np.full((b,), n, np.int32),
          np.zeros((b,), np.int32))


def _plain_probe(spec, params, cache, *, b, n_steps, max_pages, stop_width, impl, tokens):
  """A call of the plain decode loop (`n_steps` iterations, outputs fetched as the engine
  does) for b rows on the null page: the program live plain calls run (with a learned table,
  the one that also updates it, `plain_calls`; here no row teaches it)."""
  args = (tokens, *_probe_rows(spec, b, max_pages, stop_width), np.int32(n_steps),
          np.bool_(False))
  kw = dict(max_steps=spec.config.max_decode_steps, cfg=spec.cfg, impl=impl)
  if spec.table is None:
    out, *_, cache = steps.decode_loop(params, cache, *args, **kw)
  else:
    context, rows = plain_calls.contexts([], b)
    out, *_, cache, spec.table = plain_calls.decode_loop_learning(
        params, cache, *args, spec.table, context, rows, **kw)
  return jax.device_get(out), cache


def _loop_probe(spec, params, cache, *, caches, b, n_steps, force_k, max_pages, stop_width,
                impl, tokens):
  """A call of the serving loop (`n_steps` iterations, its host work included) at choice
  `force_k` for b rows that do not draft, on the null page (the draft cache is threaded
  through `caches`)."""
  spec.draft_cache = caches["draft"]
  out, *_, cache = spec.decode(
      params, cache, [], tokens, *_probe_rows(spec, b, max_pages, stop_width),
      n_steps, collections.Counter(), impl=impl, force_k=force_k)
  caches["draft"] = spec.draft_cache
  return out, cache
