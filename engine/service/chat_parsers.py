"""Streaming parsers for chat output text: answer, reasoning and tool calls.

The server detokenizes a chat request's output with special tokens kept and feeds the text
deltas here. Each family's parser is a small state machine over the text seen so far: it
emits what can no longer change and holds back a tail that could still be the start of a
marker, so the result does not depend on how the text was cut into deltas (one character, one
token, or a speculative bundle of several markers). Markers never reach content or reasoning;
tool-call text that does not follow the family's grammar ends as content, never an exception;
a call cut off (by the end of the output or another marker) after its id and name were sent
stays a call, with the arguments that came, since the client has already seen it.

Families (`PARSER_FAMILIES`):
  kimi_k2      <think>..</think>, then <|tool_calls_section_begin|><|tool_call_begin|>
               functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>...
               <|tool_calls_section_end|>; reasoning also ends at the section begin marker.
               The call id is the header as the model wrote it (Kimi's template echoes it).
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
               {json}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (V3), or V3.1's
               <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>; both are read.
  qwen3        <tool_call>\\n{"name": NAME, "arguments": {json}}\\n</tool_call>, any number.
  think        only the <think>..</think> split (DeepSeek-R1 style models without tools).
  none         everything is content.

With `tools_enabled=False` tool-call markup is not parsed: it stays in the content as written
(the request asked for no tools), as an OpenAI server without a tool parser returns it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Callable

THINK_START, THINK_END = "<think>", "</think>"

PARSER_FAMILIES = ("kimi_k2", "deepseek_v3", "qwen3", "think", "none")

# config.json model_type -> default parser family (the server's flag overrides it).
_FAMILY_BY_MODEL_TYPE = {
    "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2",
    "deepseek_v3": "deepseek_v3", "deepseek_v32": "deepseek_v3", "deepseek_v2": "think",
    "qwen3": "qwen3", "qwen3_moe": "qwen3",
}


def family_for(model_type: str) -> str:
  """The default parser family for a config.json `model_type` ("none" when unknown)."""
  return _FAMILY_BY_MODEL_TYPE.get(model_type, "none")


def starts_in_reasoning(prompt: str) -> bool:
  """Whether a rendered prompt leaves the model inside a think block (K2.5's generation
  prompt ends in `<think>`; a prompt ending `<think></think>` does not)."""
  tail = prompt.rstrip()
  return tail.endswith(THINK_START)


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
  reasoning_ends_at_tools = False    # Kimi: the tool section also closes the thought
  tool_separator = ""                # written between content and the tool calls (Qwen: "\n")
  markers: tuple[str, ...] = ()      # stripped from malformed leftovers

  def __init__(self, *, starts_in_reasoning: bool = False, tools_enabled: bool = False,
               make_id: Callable[[], str] = random_call_id):
    self._buf = ""
    self._state = "reasoning" if (starts_in_reasoning and self.parses_think) else "content"
    self._tools = tools_enabled and self.tool_begin is not None
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
        (self.tool_begin,) if self._tools else ())
    text, term = self._take_until(terms)
    sep = self.tool_separator if self._tools else ""
    if sep and text.endswith(sep):
      if term is None and not self._final:   # it may turn out to be the separator
        self._buf = sep + self._buf
        text = text[:-len(sep)]
      elif term == self.tool_begin:
        text = text[:-len(sep)]
    self._out.content += text
    if term == THINK_START:
      self._state = "reasoning"
    elif term is not None:
      self._begin_tools()
    return term is not None

  def _reasoning_step(self) -> bool:
    terms = (THINK_END, THINK_START) + (
        (self.tool_begin,) if self.reasoning_ends_at_tools and self.tool_begin else ())
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
    for m in self.markers:
      raw = raw.replace(m, "")
    self._out.content += raw

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


class _PlainParser(ChatOutputParser):
  family = "none"


class _ThinkParser(ChatOutputParser):
  family = "think"
  parses_think = True


class _SectionParser(ChatOutputParser):
  """Kimi and DeepSeek: a section of calls between begin/end markers; each call is its own
  begin marker, a header naming the function, a separator marker, arguments, an end marker."""

  parses_think = True
  section_end = call_begin = header_end = call_end = ""

  def _begin_tools(self) -> None:
    self._state, self._raw = "section", ""

  def _tool_step(self) -> bool:
    return getattr(self, "_st_" + self._state)()

  def _st_section(self) -> bool:
    text, term = self._take_until((self.call_begin, self.section_end))
    if text.strip():    # text between calls is not part of the grammar: kept as content
      self._out.content += text
    if term == self.section_end:
      self._end_tools()
    elif term == self.call_begin:
      self._state, self._raw = "header", ""
    return term is not None

  def _st_header(self) -> bool:
    text, term = self._take_until((self.header_end, self.call_end, self.call_begin,
                                   self.section_end))
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
    text, term = self._take_until((self.call_end, self.call_begin, self.section_end))
    self._raw += text
    if term is None:
      return False
    self._after_broken_call(term)
    return True

  def _st_args(self) -> bool:
    text, term = self._take_until(self.args_end + (self.call_end, self.call_begin,
                                                  self.section_end))
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
    elif term == self.section_end:
      self._end_tools()
    else:
      self._begin_tools()

  def _start_args(self, name: str) -> None:
    raise NotImplementedError

  def _name_from_header(self, header: str) -> str | None:
    raise NotImplementedError


class _KimiK2Parser(_SectionParser):
  family = "kimi_k2"
  tool_begin = "<|tool_calls_section_begin|>"
  section_end = "<|tool_calls_section_end|>"
  call_begin = "<|tool_call_begin|>"
  header_end = "<|tool_call_argument_begin|>"
  call_end = "<|tool_call_end|>"
  reasoning_ends_at_tools = True
  markers = (tool_begin, section_end, call_begin, header_end, call_end)
  # functions.NAME:IDX (the prefix may be missing); the name may hold '.', '-', ':'.
  _HEADER = re.compile(r"(?:functions\.)?(\S+):\d+")

  def _name_from_header(self, header: str) -> str | None:
    m = self._HEADER.fullmatch(header)
    return m.group(1) if m else None

  def _start_args(self, name: str) -> None:
    self._open_call(name, id=self._raw.strip())
    self._state = "args"


class _DeepSeekV3Parser(_SectionParser):
  family = "deepseek_v3"
  tool_begin = "<｜tool▁calls▁begin｜>"
  section_end = "<｜tool▁calls▁end｜>"
  call_begin = "<｜tool▁call▁begin｜>"
  header_end = "<｜tool▁sep｜>"
  call_end = "<｜tool▁call▁end｜>"
  markers = (tool_begin, section_end, call_begin, header_end, call_end)
  _FENCE = "```json"

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
    text, term = self._take_until(("\n", self.call_end, self.call_begin, self.section_end))
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


class _Qwen3Parser(ChatOutputParser):
  family = "qwen3"
  parses_think = True
  tool_begin = "<tool_call>"
  tool_separator = "\n"
  call_end = "</tool_call>"
  markers = (tool_begin, call_end)
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


def _json_call(block: str) -> tuple[str, str] | None:
  try:
    obj = json.loads(block)
  except ValueError:
    return None
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
    return None
  args = obj.get("arguments", obj.get("parameters", {}))
  return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


_PARSERS = {"kimi_k2": _KimiK2Parser, "deepseek_v3": _DeepSeekV3Parser, "qwen3": _Qwen3Parser,
            "think": _ThinkParser, "none": _PlainParser}


def make_parser(family: str, *, starts_in_reasoning: bool = False, tools_enabled: bool = False,
                make_id: Callable[[], str] = random_call_id) -> ChatOutputParser:
  """A fresh parser for one request's output. Kimi's call ids are the model's own headers;
  the others' come from `make_id`."""
  if family not in _PARSERS:
    raise ValueError(f"tool_parser: unknown family {family!r} (known: {', '.join(PARSER_FAMILIES)})")
  return _PARSERS[family](starts_in_reasoning=starts_in_reasoning, tools_enabled=tools_enabled,
                          make_id=make_id)
