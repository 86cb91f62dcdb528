"""The reasoning splitter: a model's output as its thought (between the think markers) and its
answer, for every API (chat's three edges and gRPC Generate), and the count of reasoning tokens
that usage reports and the thinking budget bounds.

The rule, the same on text and on token ids (on ids it is the engine's own,
`engine.runtime.thought`, which forces the end marker at the thinking budget):
  * a thought starts where the prompt left the model inside a think block (K2.5's generation
    prompt ends in `<think>`), or where the output's first token is `<think>` (Qwen3 writes
    it). Once answer text has come, `<think>` is answer text: no family re-opens
    a thought mid-answer, and a tool call's arguments may well contain the string;
  * it ends at `</think>`, or at a marker that also ends it (Kimi's tool section begin, which
    then starts the answer); a repeated `<think>` inside it is dropped;
  * the markers are no reasoning tokens: `</think>` counts as a completion token (also when
    the engine writes it at the thinking budget), so the reasoning count never exceeds the
    budget.

Text (`feed` / `finish`) is split on the marker text, held back while a tail could still
begin a marker, so any cut of the deltas splits the same; chat output keeps special-token text
for this (`skip_special_tokens=False`). Tokens (`count`) follow the marker ids. `split_ids` is
gRPC Generate's form: its text has no special tokens, so the ids decide and the answer's text
is found by decoding the answer ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from engine.chat.markup import THINK_END, THINK_START, Markup
from engine.runtime.thought import ANSWER, START, THOUGHT, ThoughtState


@dataclasses.dataclass(frozen=True)
class ThinkIds:
  """The think markers as token ids (each marker a single token of the tokenizer)."""
  start: int | None
  end: int
  also_end: tuple[int, ...] = ()   # ids that also end a thought (Kimi's section begin)


def token_id(tokenizer: Any, text: str) -> int | None:
  """The id of `text` when the tokenizer has it as one token that decodes back to it."""
  if tokenizer is None:
    return None
  tid = tokenizer.token_to_id(text)
  if tid is None or tokenizer.decode([tid], skip_special_tokens=False) != text:
    return None
  return int(tid)


def think_ids(tokenizer: Any, markup: Markup) -> ThinkIds | None:
  """The family's think markers as ids, or None when `</think>` is not a single token."""
  if not markup.think:
    return None
  end = token_id(tokenizer, THINK_END)
  if end is None:
    return None
  also = tuple(t for t in (token_id(tokenizer, m) for m in markup.reasoning_ends)
               if t is not None)
  return ThinkIds(token_id(tokenizer, THINK_START), end, also)


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
  """gRPC Generate's think markers, as ids (`serve --think_start_token_id ...`)."""
  think_start_token_id: int
  think_end_token_id: int
  starts_in_reasoning: bool = False


@dataclasses.dataclass
class ReasoningSplit:
  num_reasoning_tokens: int
  reasoning_text: str
  answer_text: str


class ReasoningSplitter:
  """One output's split into thought and answer (module docstring); `reasoning_tokens` is the
  count so far (from `count` / `split_ids`)."""

  def __init__(self, markers: tuple[str, str] | None = (THINK_START, THINK_END), *,
               ends: Sequence[str] = (), starts_in_reasoning: bool = False,
               ids: ThinkIds | None = None):
    self.markers, self.ends, self.ids = markers, tuple(ends), ids
    first = "reasoning" if starts_in_reasoning else "start"
    self._text_state = first if markers else "answer"
    # The id rule is the engine's (`engine.runtime.thought`: the programs force the end
    # marker at the budget with it); the state counts here.
    self._ids = ThoughtState(ids.start if ids is not None else None,
                             (ids.end, *ids.also_end) if ids is not None else (),
                             {"start": START, "reasoning": THOUGHT}.get(first, ANSWER)
                             if (markers or ids) else ANSWER)
    self._buf = ""
    self._final = False
    self.reasoning_tokens = 0
    self.answer_started = False   # an answer token has come (`split_ids`)

  @classmethod
  def for_markup(cls, markup: Markup, *, starts_in_reasoning: bool,
                 ids: ThinkIds | None = None) -> "ReasoningSplitter":
    return cls(markup.think_markers, ends=markup.reasoning_ends,
               starts_in_reasoning=starts_in_reasoning and markup.think, ids=ids)

  @classmethod
  def for_ids(cls, config: ReasoningConfig) -> "ReasoningSplitter":
    """gRPC Generate's splitter: markers known by id only."""
    return cls(None, starts_in_reasoning=config.starts_in_reasoning,
               ids=ThinkIds(config.think_start_token_id, config.think_end_token_id))

  @property
  def in_reasoning(self) -> bool:
    return self._text_state == "reasoning"

  # ---- text ---------------------------------------------------------------------------------

  def feed(self, text: str) -> tuple[str, str]:
    """(reasoning, answer) text that the new text settles."""
    self._buf += text
    return self._run()

  def finish(self) -> tuple[str, str]:
    self._final = True
    return self._run()

  def _run(self) -> tuple[str, str]:
    reasoning, answer = [], []
    while True:
      if self._text_state == "answer":
        answer.append(self._buf)
        self._buf = ""
        break
      if self._text_state == "start":
        start = self.markers[0]
        if self._buf.startswith(start):
          self._buf, self._text_state = self._buf[len(start):], "reasoning"
          continue
        if not self._final and start.startswith(self._buf):
          break   # may still become `<think>`
        self._text_state = "answer"
        continue
      start, end = self.markers
      text, term = _take_until(self, (end, start) + self.ends)
      reasoning.append(text)
      if term is None:
        break
      if term == end:
        self._text_state = "answer"
      elif term != start:   # (a repeated <think> is dropped) a marker that starts the answer
        self._text_state = "answer"
        answer.append(term)
    return "".join(reasoning), "".join(answer)

  # ---- token ids ----------------------------------------------------------------------------

  def _step_id(self, tok: int) -> str:
    """Advances the id state by one token: "reasoning", "marker" or "answer"."""
    return self._ids.step(tok)

  def count(self, token_ids: Sequence[int]) -> int:
    """Reasoning tokens among the new ids (added to `reasoning_tokens`)."""
    n = sum(self._step_id(t) == "reasoning" for t in token_ids)
    self.reasoning_tokens += n
    return n

  def split_ids(self, token_ids: Sequence[int], text: str, tokenizer: Any) -> ReasoningSplit:
    """A delta split by ids (gRPC Generate: its text has no special-token text). Markers
    belong to the thought's text; the answer's text is that of the answer ids."""
    kinds = [self._step_id(t) for t in token_ids]
    n = kinds.count("reasoning")
    self.reasoning_tokens += n
    answer_ids = [t for t, k in zip(token_ids, kinds) if k == "answer"]
    self.answer_started |= bool(answer_ids)
    if not answer_ids:
      return ReasoningSplit(n, text, "")
    if len(answer_ids) == len(token_ids):
      return ReasoningSplit(n, "", text)
    answer_text = (tokenizer.decode(answer_ids, skip_special_tokens=True)
                   if tokenizer is not None else "")
    cut = len(text) - len(answer_text) if answer_text and text.endswith(answer_text) else 0
    return ReasoningSplit(n, text[:cut], text[cut:])


def _take_until(owner: Any, terminators: tuple[str, ...]) -> tuple[str, str | None]:
  """Consumes `owner._buf` up to the earliest terminator (returned, consumed too; the longer
  one at a tie) or, when none is there, all of it but a tail that could begin one (all of it
  once `owner._final`)."""
  buf, best = owner._buf, None
  for t in terminators:
    i = buf.find(t)
    if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(t) > len(best[1]))):
      best = (i, t)
  if best is not None:
    i, t = best
    owner._buf = buf[i + len(t):]
    return buf[:i], t
  keep = 0 if owner._final else partial_tail(buf, terminators)
  cut = len(buf) - keep
  owner._buf = buf[cut:]
  return buf[:cut], None


def partial_tail(buf: str, terminators: tuple[str, ...]) -> int:
  """Length of the longest suffix of `buf` that is a proper prefix of a terminator."""
  best = 0
  for t in terminators:
    for n in range(min(len(t) - 1, len(buf)), best, -1):
      if buf.endswith(t[:n]):
        best = n
        break
  return best
