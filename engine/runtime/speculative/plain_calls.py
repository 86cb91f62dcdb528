"""The serving engine's plain decode calls where speculation is enabled (`SpecRuntime.
plain_decode`): they teach the learned table their tokens, and with `adaptive_k` some are
replayed through the deterministic drafters (`counterfactual.plain_call_evidence`).

The table update runs inside the decode loop's program (`decode_loop_learning`): as a program
of its own it cost a dispatch and its host-side arrays per call (~0.5 ms on the CPU demo, 2-3%
of a call). A call that is replayed keeps them apart (`steps.decode_loop`, the replay, then
`learn_tokens`), because the replay must see the table as it was before the call: one that
already knew the call's continuations would credit the learned drafter with predicting them.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache
from engine.runtime import steps
from engine.runtime.sampling import SamplingArrays
from engine.runtime.speculative import counterfactual, learned
from engine.runtime.speculative.serving import DETERMINISTIC, drafter_id

CONTEXT = max(learned.ORDERS)  # tokens before a call that its first learned n-gram needs

_learn = jax.jit(learned.update, donate_argnames=("table",))


@functools.partial(jax.jit, static_argnames=("max_steps", "cfg", "impl"),
                   donate_argnames=("cache", "table"))
def decode_loop_learning(params: Params, cache: Cache, tokens: jax.Array, n_cached: jax.Array,
                         page_table: jax.Array, sampling: SamplingArrays, stop_ids: jax.Array,
                         remaining: jax.Array, min_before_stop: jax.Array,
                         num_steps: jax.Array, want_logprobs: jax.Array,
                         table: learned.NgramTable, context: jax.Array, learn_rows: jax.Array,
                         *, max_steps: int, cfg: ModelConfig, impl: KernelChoice = REFERENCE):
  """`steps.decode_loop`, then the table taught every new token of the rows `learn_rows`
  [B] bool after their `context` [B, CONTEXT] (each row's last tokens before the call, its
  newest last). Returns `steps.decode_loop`'s results and the table."""
  out, count, stopped, lps, cache = steps.decode_loop(
      params, cache, tokens, n_cached, page_table, sampling, stop_ids, remaining,
      min_before_stop, num_steps, want_logprobs, max_steps=max_steps, cfg=cfg, impl=impl)
  cols = jnp.arange(max_steps, dtype=jnp.int32)
  positions = jnp.broadcast_to(context.shape[1] + cols, out.shape)
  valid = (cols[None, :] < count[:, None]) & learn_rows[:, None]
  table = learned.update(table, jnp.concatenate([context, out], axis=1), positions, valid)
  return out, count, stopped, lps, cache, table


def last_tokens(reqs: Sequence[Any], b: int, width: int, columns: int | None = None, *,
                right_align: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """([b, columns or width] int32 each request's last `width` tokens, oldest first, zeros
  elsewhere: from column 0, or ending at column width - 1 (`right_align`); [b] int32 how
  many). The loop's n-gram `history` (`SpecRuntime.histories`), the table's `contexts`."""
  out = np.zeros((b, columns or width), np.int32)
  lens = np.zeros((b,), np.int32)
  for i, req in enumerate(reqs):
    last = req.all_ids[-width:]
    start = width - len(last) if right_align else 0
    out[i, start:start + len(last)] = last
    lens[i] = len(last)
  return out, lens


def contexts(reqs: Sequence[Any], b: int) -> tuple[np.ndarray, np.ndarray]:
  """([b, CONTEXT] each request's last tokens, zeros before a short one's; [b] bool rows that
  are requests)."""
  context, _ = last_tokens(reqs, b, CONTEXT, right_align=True)
  return context, np.arange(b) < len(reqs)


def learn_tokens(table: learned.NgramTable, reqs: Sequence[Any], out: np.ndarray,
                 counts: np.ndarray) -> learned.NgramTable:
  """The table taught a plain call's tokens out [B, S] (the first counts[b] new in row b,
  not yet appended to `reqs`) as its own program (a replayed call's)."""
  b, n_steps = out.shape
  context, rows = contexts(reqs, b)
  valid = (np.arange(n_steps)[None, :] < counts[:b, None]) & rows[:, None]
  positions = np.broadcast_to(np.arange(CONTEXT, CONTEXT + n_steps, dtype=np.int32),
                              (b, n_steps))
  return _learn(table, np.concatenate([context, np.where(valid, out, 0)], axis=1), positions,
                valid)


def replay(spec: Any, reqs: Sequence[Any], out: np.ndarray, counts: np.ndarray) -> None:
  """Folds a plain call's counterfactual evidence into `spec`'s (a `SpecRuntime`) engine-wide
  and the requests' acceptance counts: each deterministic drafter replayed over the call's
  tokens with the table as it was before them (`counterfactual.plain_call_evidence`)."""
  replayed = tuple((d, drafter_id(d)) for d in DETERMINISTIC if d in spec.enabled)
  if not replayed:
    return
  b = out.shape[0]
  history, history_len = spec.histories(reqs, b)  # the tokens before the call, then its own
  row_accept = np.zeros((b,) + spec.accept_seen.shape, np.float32)
  rows = np.zeros((b,), bool)
  for i, req in enumerate(reqs):
    history[i, history_len[i]:history_len[i] + counts[i]] = out[i, :counts[i]]
    rows[i] = req.drafter is not None
    if req.spec_accept is not None:
      row_accept[i] = req.spec_accept
  newest = np.maximum(history_len - 1, 0).astype(np.int32)
  row_accept, spec.accept = counterfactual.plain_call_evidence(
      history, newest, (newest + counts[:b]).astype(np.int32), rows, spec.table, row_accept,
      spec.accept, k=spec.k, replayed=replayed, steps=spec.config.max_decode_steps)
  row_accept, spec.accept_seen = jax.device_get((row_accept, spec.accept))
  for i, req in enumerate(reqs):
    if rows[i]:
      req.spec_accept = row_accept[i]
