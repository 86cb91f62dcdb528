"""Streaming parsers for chat output text: answer, reasoning and tool calls.

The server detokenizes a chat request's output with special tokens kept and feeds the text
deltas here. Each family's parser (its markup in `markup.py`) is the reasoning splitter, then a
small state machine over the answer text: it emits what can no longer change and holds back a
tail that could still be the start of a marker, so the result does not depend on how the text
was cut into deltas (one character, one token, or a speculative bundle of several markers).
Markers never reach content or reasoning; tool-call text that does not follow the family's
grammar ends as content, never an exception; a call cut off (by the end of the output or
another marker) after its id and name were sent stays a call, with the arguments that came,
since the client has already seen it, unless the token limit cut it (`finish(truncated=True)`).

With `tools_enabled=False` tool-call markup is not parsed: it stays in the content as written
(the request asked for no tools), as an OpenAI server without a tool parser returns it.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from engine.chat import markup as markups
from engine.chat.markup import (DEEPSEEK_V3, DEEPSEEK_V3_FENCE, KIMI_K2, LLAMA3_JSON, NONE, QWEN3,
                                THINK, kimi_call_name)
from engine.chat.parser_base import ChatDelta, ChatOutputParser, ToolCallDelta, random_call_id
from engine.chat.reasoning import ReasoningSplitter

__all__ = ["ChatDelta", "ChatOutputParser", "PARSER_FAMILIES", "ToolCallDelta", "make_parser",
           "random_call_id"]

PARSER_FAMILIES = markups.FAMILY_NAMES


class PlainParser(ChatOutputParser):
  markup = NONE


class ThinkParser(ChatOutputParser):
  markup = THINK


class SectionParser(ChatOutputParser):
  """Kimi and DeepSeek: a section of calls between begin/end markers; each call is its own
  begin marker, a header naming the function, a separator marker, arguments, an end marker."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    m = self.markup
    self._ends = m.tool_ends
    self.call_begin, self.header_end, self.call_end = m.call_begin, m.call_sep, m.call_end

  def _begin_tools(self) -> None:
    self._state, self._raw = "section", ""

  def _tool_step(self) -> bool:
    return getattr(self, "_st_" + self._state)()

  def _st_section(self) -> bool:
    text, term = self._take_until((self.call_begin, *self._ends))
    self._raw += text   # text between calls is not part of the grammar: kept as content
    if term is None:
      return False
    if self._raw.strip():
      self._out.content += self._without_markers(self._raw)
    self._raw = ""
    if term in self._ends:
      self._end_tools()
    elif term == self.call_begin:
      self._state, self._raw = "header", ""
    return True

  def _st_header(self) -> bool:
    text, term = self._take_until((self.header_end, self.call_end, self.call_begin,
                                   *self._ends))
    self._raw += text
    if term is None:
      return False
    name = self._name_from_header(self._raw.strip()) if term == self.header_end else None
    if name is None:
      self._after_broken_call(term, skip_args=term == self.header_end)
    else:
      self._raw += " "   # header and arguments stay apart if the call ends as content
      self._start_args(name)
    return True

  def _st_skip(self) -> bool:
    """The arguments of a call whose header could not be read: kept as content."""
    text, term = self._take_until((self.call_end, self.call_begin, *self._ends))
    self._raw += text
    if term is None:
      return False
    self._after_broken_call(term)
    return True

  def _st_args(self) -> bool:
    text, term = self._take_until(self.args_end + (self.call_end, self.call_begin, *self._ends))
    self._stream_args(text, done=term is not None, trailing=self.args_trailing)
    if term is None:
      return False
    if term in self.args_end or term == self.call_end:
      self._close_call()
      self._state = "section"
    else:
      self._after_broken_call(term)
    return True

  args_end: tuple[str, ...] = ()    # per call: what else ends its arguments (V3's fence)
  args_trailing = ""                 # per call: held back at the arguments' end (V3's fence)

  def _after_broken_call(self, term: str, skip_args: bool = False) -> None:
    """A call cut off by another marker (or with an unreadable header) becomes content; the
    marker that cut it is then taken as it stands."""
    if skip_args:
      self._state = "skip"
      return
    self._state = "header"
    self._abandon_block()
    if term == self.call_begin:
      self._state, self._raw = "header", ""
    elif term in self._ends:
      self._end_tools()
    else:
      self._begin_tools()

  def _start_args(self, name: str) -> None:
    raise NotImplementedError

  def _name_from_header(self, header: str) -> str | None:
    raise NotImplementedError


class KimiK2Parser(SectionParser):
  markup = KIMI_K2

  def _name_from_header(self, header: str) -> str | None:
    return kimi_call_name(header)   # functions.NAME:IDX; NAME may hold '.', '-', ':'

  def _start_args(self, name: str) -> None:
    self._open_call(name, id=self._raw.strip())
    self._state = "args"


class DeepSeekV3Parser(SectionParser):
  markup = DEEPSEEK_V3
  _FENCE = DEEPSEEK_V3_FENCE

  def _name_from_header(self, header: str) -> str | None:
    return header if header and not any(c.isspace() for c in header) else None

  def _start_args(self, name: str) -> None:
    self._header = name
    self._state = "body"

  def _st_body(self) -> bool:
    """After the separator: V3 writes `function<sep>NAME\\n```json\\n{..}\\n```` and V3.1
    writes `NAME<sep>{..}`; a header of "function" followed by anything but JSON is V3."""
    head = self._buf.lstrip()
    if not head and not self._final:
      return False
    if self._header != "function" or head.startswith(("{", "[")) or not head:
      self.args_end, self.args_trailing = (), ""
      self._open_call(self._header)
      self._state = "args"
      return True
    self._state, self._header = "v3_name", ""
    return True

  def _st_v3_name(self) -> bool:
    text, term = self._take_until(("\n", self.call_end, self.call_begin, *self._ends))
    self._raw += text
    self._header += text
    if term is None:
      return False
    if term != "\n" or self._name_from_header(self._header.strip()) is None:
      if term == "\n":
        self._raw += term
        self._state = "skip"
      else:
        self._after_broken_call(term)
      return True
    self._raw += term
    self._header = self._header.strip()
    self._state = "v3_fence"
    return True

  def _st_v3_fence(self) -> bool:
    head = self._buf.lstrip()
    if self._FENCE.startswith(head) and not self._final and len(head) < len(self._FENCE):
      return False     # could still be the fence
    if head.startswith(self._FENCE):
      cut = len(self._buf) - len(head) + len(self._FENCE)
      self._raw += self._buf[:cut]
      self._buf = self._buf[cut:]
    self.args_end, self.args_trailing = ("```" + self.call_end,), "```"
    self._open_call(self._header)
    self._state = "args"
    return True


class Qwen3Parser(ChatOutputParser):
  markup = QWEN3
  tool_begin, call_end = QWEN3.tools_begin, QWEN3.call_end
  # The object's head up to its arguments value (settled once a non-space char follows).
  _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')

  def _begin_tools(self) -> None:
    self._state, self._raw = "head", ""

  def _tool_step(self) -> bool:
    if self._state == "head":
      return self._st_head()
    return self._st_args()

  def _st_head(self) -> bool:
    m = self._HEAD.match(self._buf)
    end = self._buf.find(self.call_end)
    if m and (end < 0 or m.end() <= end):
      name = json.loads(m.group(1))
      if isinstance(name, str) and name:
        self._raw, self._buf = self._buf[:m.end()], self._buf[m.end():]
        self._open_call(name)
        self._state = "args"
        return True
    if end < 0:
      return False
    # Not the usual key order: read the whole object.
    block, self._buf = self._buf[:end], self._buf[end + len(self.call_end):]
    call = _json_call(block)
    if call is None:
      self._raw = block
      self._abandon_block()
      self._skip_space = True
      return True
    self._open_call(call[0])
    self._emit_call_delta(self._open.index, arguments=call[1])
    self._open.arguments = call[1]
    self._close_call()
    self._end_tools()
    return True

  def _st_args(self) -> bool:
    text, term = self._take_until((self.call_end, self.tool_begin))
    self._stream_args(text, done=term is not None, trailing="}")
    if term is None:
      return False
    if term == self.call_end:
      self._close_call()
      self._end_tools()
    else:           # a new call before this one closed: this one is cut off
      self._abandon_block()
      self._begin_tools()
    return True


def _json_call(block: str, args_required: bool = False) -> tuple[str, str] | None:
  """(name, arguments JSON) of a call written as one object, or None."""
  try:
    obj = json.loads(block)
  except ValueError:
    return None
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
    return None
  if args_required and "arguments" not in obj and "parameters" not in obj:
    return None
  args = obj.get("arguments", obj.get("parameters", {}))
  return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)




class Llama3JsonParser(ChatOutputParser):
  """Llama 3.x: a reply that is a tool call is the call itself, as its template writes it:
  optionally <|python_tag|>, then {"name": NAME, "parameters": {json}} ("arguments" read too),
  several separated by ';' or newlines. Decided by the reply's first non-space text: any other
  reply is an answer (content); text after the calls is content too."""

  markup = LLAMA3_JSON
  tool_begin = LLAMA3_JSON.tools_begin
  _ENDS = ("<|eom_id|>", "<|eot_id|>")   # if the server keeps them in the text
  _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"'
                     r'\s*:\s*(?=\S)')

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    if self._tools:
      self._state = "start"
    self._json = _JsonScan()

  def _begin_tools(self) -> None:   # only at the start of the reply (_st_start)
    raise AssertionError("Llama calls are found at the start of the reply")

  def _content_step(self) -> bool:
    self._tools = False           # once the reply is an answer, it stays one
    return super()._content_step()

  def _tool_step(self) -> bool:
    return getattr(self, "_st_" + self._state)()

  def _st_start(self) -> bool:
    head = self._buf.lstrip()
    if not head or (self.tool_begin.startswith(head) and head != self.tool_begin):
      if not self._final:
        return False
    if head.startswith(self.tool_begin):
      self._raw, self._buf = "", head[len(self.tool_begin):]
      self._state = "head"
    elif head.startswith("{"):
      self._raw, self._state = "", "head"
    else:
      self._state = "content"
    return True

  def _st_head(self) -> bool:
    m = self._HEAD.match(self._buf)
    if m:
      name = json.loads(m.group(1))
      if isinstance(name, str) and name:
        self._raw += self._buf[:m.end()]
        self._buf = self._buf[m.end():]
        self._open_call(name)
        self._json = _JsonScan()
        self._state = "args"
        return True
    text = self._buf.lstrip()
    try:   # another key order: a whole object
      obj, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
      return False   # incomplete (or not JSON: finish() makes it content)
    call = _json_call(text[:end], args_required=True)
    if call is None:     # JSON, but not a call: the reply is an answer
      self._state = "content"
      return True
    self._open_call(call[0])
    self._emit_call_delta(self._open.index, arguments=call[1])
    self._open.arguments = call[1]
    self._buf = text[end:]
    self._close_call()
    self._state = "between"
    return True

  def _st_args(self) -> bool:
    end = self._json.copy().find_end(self._buf)
    if end is None:
      emit = self._buf.rstrip()    # trailing space waits: it may end the arguments
      self._json.find_end(emit)
      self._buf = self._buf[len(emit):]
      self._stream_args(emit, done=False)
      return False
    closer = self._buf[end]
    self._stream_args(self._buf[:end], done=True)
    self._buf = self._buf[end + 1:]
    self._close_call()
    self._state = "between" if closer == "}" else "rest"
    self._json = _JsonScan()
    return True

  def _st_rest(self) -> bool:
    """More keys after the arguments: skipped up to the object's closing brace."""
    while True:
      end = self._json.find_end(self._buf)
      if end is None:
        self._buf = ""
        return False
      closer, self._buf = self._buf[end], self._buf[end + 1:]
      if closer != ",":
        break
    self._json, self._state = _JsonScan(), "between"
    return True

  def _st_between(self) -> bool:
    head = self._buf.lstrip()
    for end in self._ENDS:
      if head.startswith(end):
        self._buf = head[len(end):]
        return True
    if not head or any(e.startswith(head) for e in self._ENDS):
      if not self._final:
        return False
    if head.startswith(";"):
      self._buf = head[1:]
      return True
    self._buf = head
    self._raw = ""
    self._state = "head" if head.startswith("{") else "content"
    return True


class _JsonScan:
  """Where a JSON value ends inside its enclosing object: at the first ',' or closing brace
  outside strings and nested brackets (the scan keeps its place between calls)."""

  def __init__(self):
    self.depth, self.in_string, self.escaped = 0, False, False

  def copy(self) -> "_JsonScan":
    other = _JsonScan()
    other.depth, other.in_string, other.escaped = self.depth, self.in_string, self.escaped
    return other

  def find_end(self, text: str) -> int | None:
    for i, c in enumerate(text):
      if self.in_string:
        if self.escaped:
          self.escaped = False
        elif c == "\\":
          self.escaped = True
        elif c == '"':
          self.in_string = False
      elif c == '"':
        self.in_string = True
      elif c in "{[":
        self.depth += 1
      elif c in "}]":
        if self.depth == 0:
          return i
        self.depth -= 1
      elif c == "," and self.depth == 0:
        return i
    return None


_PARSERS = {p.markup.family: p for p in (KimiK2Parser, DeepSeekV3Parser, Qwen3Parser,
                                         Llama3JsonParser, ThinkParser, PlainParser)}


def make_parser(family: str, *, starts_in_reasoning: bool = False, tools_enabled: bool = False,
                make_id: Callable[[], str] = random_call_id,
                splitter: ReasoningSplitter | None = None) -> ChatOutputParser:
  """A fresh parser for one request's output. Kimi's call ids are the model's own headers;
  the others' come from `make_id`. `splitter`: one made with the marker ids (it then also
  counts reasoning tokens), else one from the family's markup."""
  markups.markup(family)   # ValueError naming the unknown family
  return _PARSERS[family](starts_in_reasoning=starts_in_reasoning, tools_enabled=tools_enabled,
                          make_id=make_id, splitter=splitter)
