"""The thinking budget: one rule for where a thought is, on the host and in every device program.

The rule (the same on token ids everywhere: the chat layer's reasoning splitter counts usage
with `ThoughtState`, the programs force the end marker with `must_end` / `advance`):
  * a row starts either inside a thought (the prompt opened it, as K2.5's generation prompt
    does) or before its first token, where `think_start` as the first token opens a thought
    and anything else starts the answer;
  * inside a thought, any of `think_end` (`</think>`, and markers that also end it, such as
    Kimi's tool section begin) ends it; a repeated `think_start` is a marker; every other token
    is a reasoning token (counted);
  * once a thought has `budget` reasoning tokens, its next token is `think_end[0]`: the engine
    writes the marker itself (a completion token, no reasoning token), and the answer follows.

Device side the rule is per-row state carried in the sampling arrays (`SamplingArrays.think_*`,
the row's state and count at the call's start) and, inside the decode loops, in the loop state,
so no program syncs with the host to apply it. Forcing happens after sampling in the plain
programs; in a verified block (`force_block`) the marker replaces the draft at the forced
position and the target's logits there admit only the marker, so verification stays lossless
relative to budgeted plain decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

START, THOUGHT, ANSWER = 0, 1, 2  # a row's state: before its first token, in a thought, after
MAX_THINK_END = 4  # end markers per row (a static shape)


@dataclasses.dataclass
class ThoughtState:
  """One output's place in the rule (host side): `state` (START / THOUGHT / ANSWER) and the
  reasoning tokens so far (`count`). `step` advances it by one token."""
  start: int | None = None
  ends: tuple[int, ...] = ()
  state: int = START
  count: int = 0
  budget: int | None = None  # None: unbounded

  @staticmethod
  def for_params(budget: int | None, start: int | None, ends: Sequence[int],
                 inside: bool = False) -> "ThoughtState":
    """A request's initial state from its sampling fields (`SamplingParams.think_*`): inside a
    thought when the prompt opened it (`inside`) or no start marker is given."""
    first = THOUGHT if inside or start is None else START
    return ThoughtState(start, tuple(ends), first, 0, budget)

  def step(self, tok: int) -> str:
    """Advances by one token; returns its kind: "reasoning", "marker" or "answer"."""
    if self.state == START:
      if self.start is not None and tok == self.start:
        self.state = THOUGHT
        return "marker"
      self.state = ANSWER
    if self.state == ANSWER:
      return "answer"
    if tok in self.ends:
      self.state = ANSWER
      return "marker"
    if self.start is not None and tok == self.start:
      return "marker"
    self.count += 1
    return "reasoning"

  @property
  def must_end(self) -> bool:
    """The next token is forced to `ends[0]` (the budget is spent inside a thought)."""
    return self.state == THOUGHT and self.budget is not None and self.count >= self.budget

  def replay(self, ids: Sequence[int]) -> "ThoughtState":
    """The state after `ids` from this one (a copy)."""
    out = dataclasses.replace(self)
    for t in ids:
      out.step(t)
    return out


# ---- device side ------------------------------------------------------------------------------
# `s` below is a `sampling.SamplingArrays` (its think_budget [B] (-1: none), think_start [B]
# (-1: none), think_end [B, MAX_THINK_END] (-1 padded), think_state [B], think_count [B]).


def must_end(s, state: jax.Array, count: jax.Array) -> jax.Array:
  """[B] bool: the row's next token is forced to its end marker."""
  return (state == THOUGHT) & (s.think_budget >= 0) & (count >= s.think_budget)


def force(s, state: jax.Array, count: jax.Array, tokens: jax.Array) -> jax.Array:
  """The sampled tokens [B] with the end marker where the budget forces it."""
  return jnp.where(must_end(s, state, count), s.think_end[:, 0], tokens)


def advance(s, state: jax.Array, count: jax.Array, tok: jax.Array, live: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """(state, count) after each live row [B] emits `tok` [B] (`ThoughtState.step`)."""
  is_start = (tok == s.think_start) & (s.think_start >= 0)
  is_end = jnp.any(tok[:, None] == s.think_end, axis=-1)
  in_thought = state == THOUGHT
  new = jnp.where(state == START, jnp.where(is_start, THOUGHT, ANSWER),
                  jnp.where(in_thought & is_end, ANSWER, state))
  counted = in_thought & ~is_end & ~is_start & live
  return jnp.where(live, new, state), count + counted.astype(count.dtype)


def force_block(s, state: jax.Array, count: jax.Array, draft: jax.Array, n_draft: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
  """A verified block's forcing: draft [B, K] (first n_draft [B] real) after a row's state ->
  (drafts with the end marker at a forced position, forced [B, K + 1]: slot i (the token after
  d_1 .. d_i) must be the marker). At most one slot per row is forced (the marker ends the
  thought)."""
  k = draft.shape[1]
  cols, forced = [], []
  for i in range(k + 1):
    f = must_end(s, state, count)
    forced.append(f)
    if i < k:
      real = i < n_draft
      d = jnp.where(f & real, s.think_end[:, 0], draft[:, i])
      cols.append(d)
      state, count = advance(s, state, count, d, real)
  new_draft = jnp.stack(cols, axis=1) if cols else draft
  return new_draft, jnp.stack(forced, axis=1)


def only_marker(logits: jax.Array, forced: jax.Array, marker: jax.Array) -> jax.Array:
  """logits [B, T, V] with every token but `marker` [B] at -inf where forced [B, T] (skipped
  when no slot is: the common case costs a reduction, not a pass over the logits)."""
  def mask(x):
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    one = jnp.where(ids[None, None, :] == marker[:, None, None], 0.0, -jnp.inf).astype(x.dtype)
    return jnp.where(forced[..., None], one, x)
  return jax.lax.cond(jnp.any(forced), mask, lambda x: x, logits)
