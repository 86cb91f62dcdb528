"""The machinery under the chat output parsers (engine/service/chat_parsers.py): the deltas
they return and the base parser, a state machine over the text not yet settled.

Text comes in as decoded deltas; each state consumes the buffer up to the earliest of its
terminators, or all of it but a tail that could still begin one, so what is emitted never
depends on where the deltas were cut. Families (chat_parser_families.py) add tool-call states.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Callable

THINK_START, THINK_END = "<think>", "</think>"


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
  """Base: content and <think> reasoning; families add their tool-call states.

  `feed(text)` returns what the new text settles; `finish()` flushes the held-back tail.
  `tool_calls` lists the calls closed so far in the OpenAI shape (after `finish()` also one
  the output cut off).
  """

  family = "none"
  parses_think = False
  tool_begin: str | None = None      # the marker that opens tool-call text in the content
  tool_begin_variants: tuple[str, ...] = ()   # spellings a model also writes for it
  reasoning_ends_at_tools = False    # Kimi: the tool section also closes the thought
  tool_separator = ""                # written between content and the tool calls (Qwen: "\n")
  markers: tuple[str, ...] = ()      # stripped from malformed leftovers

  def __init__(self, *, starts_in_reasoning: bool = False, tools_enabled: bool = False,
               make_id: Callable[[], str] = random_call_id):
    self._buf = ""
    self._state = "reasoning" if (starts_in_reasoning and self.parses_think) else "content"
    self._tools = tools_enabled and self.tool_begin is not None
    self._begins = ((self.tool_begin,) + self.tool_begin_variants) if self.tool_begin else ()
    self._make_id = make_id
    self._calls: list[_Call] = []
    self._open: _Call | None = None   # the call whose arguments are streaming
    self._raw = ""                    # the current tool block's text, for malformed leftovers
    self._next_index = 0
    self._skip_space = False          # after tool-call text: its trailing whitespace is dropped
    self._out = ChatDelta()
    self._final = False

  # ---- public -------------------------------------------------------------------------------

  def feed(self, text: str) -> ChatDelta:
    if self._final:
      raise ValueError("feed after finish")
    self._buf += text
    return self._run()

  def finish(self) -> ChatDelta:
    self._final = True
    while self._step():
      pass
    self._abandon_block(at_end=True)
    leftover, self._buf = self._buf, ""
    if leftover and not (self._skip_space and not leftover.strip()):
      self._emit_text(leftover)
    return self._take_out()

  @property
  def tool_calls(self) -> list[dict]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in self._calls]

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
    keep = 0 if self._final else _partial_tail(self._buf, terminators)
    cut = len(self._buf) - keep
    text, self._buf = self._buf[:cut], self._buf[cut:]
    return text, None

  def _emit_text(self, text: str) -> None:
    if not text:
      return
    if self._state == "reasoning":
      self._out.reasoning += text
    else:
      self._out.content += text

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
    if self._state == "reasoning":
      return self._reasoning_step()
    return self._tool_step()

  def _content_step(self) -> bool:
    if self._skip_space:
      stripped = self._buf.lstrip()
      if not stripped and not self._final:
        return False
      self._buf, self._skip_space = stripped, False
    terms = ((THINK_START,) if self.parses_think else ()) + (
        self._begins if self._tools else ())
    text, term = self._take_until(terms)
    sep = self.tool_separator if self._tools else ""
    if sep and text.endswith(sep):
      if term is None and not self._final:   # it may turn out to be the separator
        self._buf = sep + self._buf
        text = text[:-len(sep)]
      elif term in self._begins:
        text = text[:-len(sep)]
    self._out.content += text
    if term == THINK_START:
      self._state = "reasoning"
    elif term is not None:
      self._begin_tools()
    return term is not None

  def _reasoning_step(self) -> bool:
    terms = (THINK_END, THINK_START) + (
        self._begins if self.reasoning_ends_at_tools else ())
    text, term = self._take_until(terms)
    self._out.reasoning += text
    if term == THINK_END:
      self._state = "content"
    elif term is not None and term != THINK_START:   # a repeated <think> is swallowed
      self._state = "content"
      if self._tools:
        self._begin_tools()
      else:
        self._out.content += term
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
    if self._state in ("content", "reasoning"):
      return
    raw = self._raw
    if self._open is not None:
      self._close_call()
      raw = ""
      if at_end:
        self._buf = ""    # only held-back trailing space (and Qwen's brace) is left
    elif at_end:
      raw, self._buf = raw + self._buf, ""
    self._raw, self._open = "", None
    self._state, self._skip_space = "content", False
    raw = self._without_markers(raw)
    if raw.strip():   # (space alone between or after tool calls is no answer)
      self._out.content += raw

  def _without_markers(self, text: str) -> str:
    for m in self.markers:
      text = text.replace(m, "")
    return text

  def _end_tools(self) -> None:
    self._state, self._raw, self._skip_space = "content", "", True


def _partial_tail(buf: str, terminators: tuple[str, ...]) -> int:
  """Length of the longest suffix of `buf` that is a proper prefix of a terminator."""
  best = 0
  for t in terminators:
    for n in range(min(len(t) - 1, len(buf)), best, -1):
      if buf.endswith(t[:n]):
        best = n
        break
  return best


