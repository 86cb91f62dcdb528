"""One chat choice's output, delta by delta: the family's parser (reasoning splitter, then tool
calls) over the text, the reasoning tokens counted by id, the finish reason every API reports.

An output the token limit cut inside a tool call ends "length" with no half call among
`tool_calls` and no markup in the content (the parser's `finish(truncated=True)`); one that
stopped by itself having called tools ends "tool_calls".
"""

from __future__ import annotations

from engine.chat.parser_base import ChatDelta
from engine.chat.parsers import make_parser
from engine.chat.reasoning import ReasoningSplitter, ThinkIds
from engine.chat import markup as markups
from engine.runtime.request import FINISH_LENGTH, FINISH_STOP, RequestOutput

FINISH_TOOL_CALLS = "tool_calls"


class ChatStream:
  """Deltas, content, reasoning, tool calls and the finish reason of one engine request."""

  def __init__(self, family: str, *, starts_in_reasoning: bool, tools_enabled: bool,
               think_ids: ThinkIds | None = None):
    splitter = ReasoningSplitter.for_markup(markups.markup(family),
                                            starts_in_reasoning=starts_in_reasoning,
                                            ids=think_ids)
    self.parser = make_parser(family, tools_enabled=tools_enabled, splitter=splitter)
    self.splitter = splitter
    self.content: list[str] = []
    self.reasoning: list[str] = []
    self._counted = think_ids is not None

  def feed(self, out: RequestOutput) -> ChatDelta:
    if self._counted:
      self.splitter.count(out.new_token_ids)
    elif self.splitter.in_reasoning:   # markers are not single tokens: the text's state decides
      self.splitter.reasoning_tokens += len(out.new_token_ids)
    delta = self.parser.feed(out.text_delta) if out.text_delta else ChatDelta()
    if out.finished:
      delta = _merge(delta, self.parser.finish(truncated=out.finish_reason == FINISH_LENGTH))
    self.content.append(delta.content)
    self.reasoning.append(delta.reasoning)
    return delta

  @property
  def tool_calls(self) -> list[dict]:
    return self.parser.tool_calls

  @property
  def reasoning_tokens(self) -> int:
    return self.splitter.reasoning_tokens

  def finish_reason(self, out: RequestOutput) -> str | None:
    """OpenAI's: "tool_calls" when a request that stopped by itself called tools."""
    if not out.finished:
      return None
    if out.finish_reason == FINISH_STOP and self.tool_calls:
      return FINISH_TOOL_CALLS
    return out.finish_reason


def _merge(a: ChatDelta, b: ChatDelta) -> ChatDelta:
  return ChatDelta(content=a.content + b.content, reasoning=a.reasoning + b.reasoning,
                   tool_calls=list(a.tool_calls) + list(b.tool_calls))
