"""`run_if`: a conditional whose large state (a KV cache) XLA updates in place; `place`, a
per-row scatter into a loop buffer.

XLA copies a buffer that a conditional branch updates whenever that conditional sits inside
another one (the loop's plain / block branches), but updates a while loop's state in place at
any depth: so `run_if` is a while loop of zero or one trips. What it closes over (weights, the
verify's hidden states) goes through the loop state and a barrier with the trip counter, or
XLA would hoist work on it out of the loop (to run with zero trips too). Checked on the
compiled HLO by `tests/test_inplace.py`.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
import jax.numpy as jnp

State = TypeVar("State")


def run_if(pred: jax.Array, fn: Callable[[State], State], state: State) -> State:
  """`fn(state)` if the scalar bool `pred` holds, else `state`; fn keeps the pytree structure,
  shapes and dtypes of `state`."""
  closed, consts = jax.closure_convert(fn, state)
  trips = jnp.asarray(pred).astype(jnp.int32)

  def body(c):
    i, st, cs = c
    i, cs = jax.lax.optimization_barrier((i, cs))
    return i + 1, closed(st, *cs), cs

  _, out, _ = jax.lax.while_loop(lambda c: c[0] < trips, body, (jnp.int32(0), state, consts))
  return out


def place(buffer: jax.Array, start: jax.Array, values: jax.Array, count: jax.Array
          ) -> jax.Array:
  """buffer[b, start[b] + i] = values[b, i] for i < count[b]. buffer [B, N], values [B, T]."""
  t = values.shape[1]
  cols = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  cols = jnp.where(jnp.arange(t)[None, :] < count[:, None], cols, buffer.shape[1])
  rows = jnp.arange(buffer.shape[0])[:, None]
  return buffer.at[rows, cols].set(values, mode="drop")
