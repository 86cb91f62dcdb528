"""Splits a stream of generated tokens into reasoning and answer (think-start/think-end ids).

Reasoning models (DeepSeek-R1, Kimi-K2-Thinking) write `<think> ... </think>` before the
answer; with R1-style chat templates `<think>` is already in the prompt, so a request may start
inside the reasoning (`starts_in_reasoning`). The split is by token id, which is exact; a text
delta that straddles the boundary is split by decoding the answer tokens on their own (special
think tokens decode to nothing, so the reasoning text is what precedes the answer's text).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
  think_start_token_id: int
  think_end_token_id: int
  starts_in_reasoning: bool = False


@dataclasses.dataclass
class ReasoningSplit:
  num_reasoning_tokens: int
  reasoning_text: str
  answer_text: str


class ReasoningState:
  """One request's position relative to the think markers."""

  def __init__(self, config: ReasoningConfig, tokenizer: Any):
    self.config = config
    self.tokenizer = tokenizer
    self.in_reasoning = config.starts_in_reasoning
    self.answer_started = False

  def split(self, token_ids: Sequence[int], text: str) -> ReasoningSplit:
    """Marks this delta's tokens (think markers count as reasoning) and splits its text."""
    n_reasoning = 0
    answer_ids: list[int] = []
    for tok in token_ids:
      if tok == self.config.think_start_token_id:
        self.in_reasoning = True
      if self.in_reasoning or tok == self.config.think_start_token_id:
        n_reasoning += 1
        if tok == self.config.think_end_token_id:
          self.in_reasoning = False
      else:
        answer_ids.append(tok)
    if answer_ids:
      self.answer_started = True
    if not answer_ids:
      return ReasoningSplit(n_reasoning, text, "")
    if n_reasoning == 0:
      return ReasoningSplit(0, "", text)
    answer_text = (self.tokenizer.decode(answer_ids, skip_special_tokens=True)
                   if self.tokenizer is not None else "")
    cut = len(text) - len(answer_text) if answer_text and text.endswith(answer_text) else 0
    return ReasoningSplit(n_reasoning, text[:cut], text[cut:])
