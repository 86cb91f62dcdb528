"""The machinery under the chat output parsers (`parsers.py`): the deltas they return and the
base parser, the reasoning splitter (`reasoning.py`) then a state machine over the answer text
not yet settled.

Text comes in as decoded deltas; each state consumes the buffer up to the earliest of its
terminators, or all of it but a tail that could still begin one, so what is emitted never
depends on where the deltas were cut. Families (`parsers.py`) add tool-call states, their
markers read from their `markup.Markup`.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Callable

from engine.chat.markup import NONE, Markup
from engine.chat.reasoning import ReasoningSplitter, partial_tail



@dataclasses.dataclass
class ToolCallDelta:
  index: int
  id: str | None = None
  name: str | None = None
  arguments: str = ""


@dataclasses.dataclass
class ChatDelta:
  content: str = ""
  reasoning: str = ""
  tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

  def __bool__(self) -> bool:
    return bool(self.content or self.reasoning or self.tool_calls)


def random_call_id() -> str:
  return "call_" + secrets.token_hex(12)


@dataclasses.dataclass
class _Call:
  index: int
  id: str
  name: str
  arguments: str = ""


class ChatOutputParser:
  """Base: reasoning (the splitter) and content; families add their tool-call states.

  `feed(text)` returns what the new text settles; `finish(truncated)` flushes the held-back
  tail. `tool_calls` lists the calls closed so far in the OpenAI shape (after `finish()` also
  one the end of the output cut off, unless `truncated`: an output cut by its token limit
  inside a call has no half call, and its unfinished tool markup is no content).
  """

  markup: Markup = NONE

  def __init__(self, *, starts_in_reasoning: bool = False, tools_enabled: bool = False,
               make_id: Callable[[], str] = random_call_id,
               splitter: ReasoningSplitter | None = None):
    m = self.markup
    self.splitter = splitter or ReasoningSplitter.for_markup(
        m, starts_in_reasoning=starts_in_reasoning)
    self._buf = ""
    self._state = "content"
    self._tools = tools_enabled and m.tools_begin is not None
    self._begins = m.tool_begins
    self._make_id = make_id
    self._calls: list[_Call] = []
    self._open: _Call | None = None   # the call whose arguments are streaming
    self._raw = ""                    # the current tool block's text, for malformed leftovers
    self._next_index = 0
    self._skip_space = False          # after tool-call text: its trailing whitespace is dropped
    self._out = ChatDelta()
    self._final = False
    self._truncated = False

  # ---- public -------------------------------------------------------------------------------

  def feed(self, text: str) -> ChatDelta:
    if self._final:
      raise ValueError("feed after finish")
    reasoning, answer = self.splitter.feed(text)
    self._out.reasoning += reasoning
    self._buf += answer
    return self._run()

  def finish(self, truncated: bool = False) -> ChatDelta:
    reasoning, answer = self.splitter.finish()
    self._out.reasoning += reasoning
    self._buf += answer
    self._final, self._truncated = True, truncated
    while self._step():
      pass
    self._abandon_block(at_end=True)
    leftover, self._buf = self._buf, ""
    if truncated and self._tools and partial_tail(leftover, self._begins) == len(leftover):
      leftover = ""   # a tool marker the limit cut in half
    if leftover and not (self._skip_space and not leftover.strip()):
      self._out.content += leftover
    return self._take_out()

  @property
  def tool_calls(self) -> list[dict]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in self._calls]

  @property
  def in_tool_call(self) -> bool:
    """Whether the text so far ends inside tool-call markup."""
    return self._state != "content"

  # ---- machinery ----------------------------------------------------------------------------

  def _run(self) -> ChatDelta:
    while self._step():
      pass
    return self._take_out()

  def _take_out(self) -> ChatDelta:
    out, self._out = self._out, ChatDelta()
    return out

  def _take_until(self, terminators: tuple[str, ...]) -> tuple[str, str | None]:
    """Consumes the buffer up to the earliest terminator (returned, consumed too) or, if none
    is there, all of it but a tail that could begin one (all of it once finished)."""
    best = None
    for t in terminators:
      i = self._buf.find(t)
      if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(t) > len(best[1]))):
        best = (i, t)
    if best is not None:
      i, t = best
      text, self._buf = self._buf[:i], self._buf[i + len(t):]
      return text, t
    keep = 0 if self._final else partial_tail(self._buf, terminators)
    cut = len(self._buf) - keep
    text, self._buf = self._buf[:cut], self._buf[cut:]
    return text, None

  def _emit_call_delta(self, index: int, *, id: str | None = None, name: str | None = None,
                       arguments: str = "") -> None:
    if not (id or name or arguments):
      return
    last = self._out.tool_calls[-1] if self._out.tool_calls else None
    if last is not None and last.index == index:
      last.id = last.id or id
      last.name = last.name or name
      last.arguments += arguments
    else:
      self._out.tool_calls.append(ToolCallDelta(index, id, name, arguments))

  def _step(self) -> bool:
    if self._state == "content":
      return self._content_step()
    return self._tool_step()

  def _content_step(self) -> bool:
    if self._skip_space:
      stripped = self._buf.lstrip()
      if not stripped and not self._final:
        return False
      self._buf, self._skip_space = stripped, False
    text, term = self._take_until(self._begins if self._tools else ())
    sep = self.markup.call_separator if self._tools else ""
    if sep and text.endswith(sep):
      if term is None and not self._final:   # it may turn out to be the separator
        self._buf = sep + self._buf
        text = text[:-len(sep)]
      elif term in self._begins:
        text = text[:-len(sep)]
    self._out.content += text
    if term is not None:
      self._begin_tools()
    return term is not None

  # ---- tool calls (families override _begin_tools / _tool_step) -----------------------------

  def _begin_tools(self) -> None:
    raise NotImplementedError

  def _tool_step(self) -> bool:
    raise NotImplementedError

  def _open_call(self, name: str, id: str | None = None) -> None:
    call = _Call(self._next_index, id or self._make_id(), name)
    self._next_index += 1
    self._open = call
    self._emit_call_delta(call.index, id=call.id, name=call.name)

  def _stream_args(self, text: str, *, done: bool, trailing: str = "") -> None:
    """Appends argument text taken from the buffer, stripped of leading whitespace and,
    until more text shows it belongs to the arguments, of trailing whitespace (and
    `trailing`, Qwen's closing brace), which goes back to the buffer."""
    if not done:
      body = text.rstrip()
      if trailing and body.endswith(trailing):
        body = body[:-len(trailing)].rstrip()
      if len(body) < len(text):
        self._buf = text[len(body):] + self._buf
        text = body
    self._raw += text
    call = self._open
    if not call.arguments:
      text = text.lstrip()
    if done:
      text = text.rstrip()
      if trailing and text.endswith(trailing):
        text = text[:-len(trailing)].rstrip()
    if text:
      call.arguments += text
      self._emit_call_delta(call.index, arguments=text)

  def _close_call(self) -> None:
    self._calls.append(self._open)
    self._open = None
    self._raw = ""

  def _abandon_block(self, at_end: bool = False) -> None:
    """Tool-call text cut off (by another marker, or at the end by the end of the output).
    A call already announced (its id and name were sent) stays a call, its arguments as far
    as they came, as the client has seen them; text never announced becomes content (at the
    end with the unconsumed rest), markers removed."""
    if self._state == "content":
      return
    raw = self._raw
    if self._open is not None:
      if at_end and self._truncated:
        self._open = None   # cut by the token limit: no half call
      else:
        self._close_call()
      raw = ""
      if at_end:
        self._buf = ""    # only held-back trailing space (and Qwen's brace) is left
    elif at_end:
      raw, self._buf = raw + self._buf, ""
      if self._truncated:
        raw = ""          # a call the limit cut before its name: neither call nor content
    self._raw, self._open = "", None
    self._state, self._skip_space = "content", False
    raw = self._without_markers(raw)
    if raw.strip():   # (space alone between or after tool calls is no answer)
      self._out.content += raw

  def _without_markers(self, text: str) -> str:
    for m in self.markup.markers:
      text = text.replace(m, "")
    return text

  def _end_tools(self) -> None:
    self._state, self._raw, self._skip_space = "content", "", True
