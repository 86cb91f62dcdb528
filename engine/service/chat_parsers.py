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
  llama3_json  a reply that is {"name": NAME, "parameters": {json}} (after an optional
               <|python_tag|>), several separated by ';' or newlines; decided at the reply's
               start, so JSON later in an answer stays content.
  think        only the <think>..</think> split (DeepSeek-R1 style models without tools).
  none         everything is content.

With `tools_enabled=False` tool-call markup is not parsed: it stays in the content as written
(the request asked for no tools), as an OpenAI server without a tool parser returns it.
"""

from __future__ import annotations

from typing import Callable

from engine.service.chat_parser_base import (THINK_END, THINK_START, ChatDelta, ChatOutputParser,
                                             ToolCallDelta, random_call_id)
from engine.service.chat_parser_families import (DeepSeekV3Parser, KimiK2Parser,
                                                 Llama3JsonParser, PlainParser, Qwen3Parser,
                                                 ThinkParser)

__all__ = ["ChatDelta", "ChatOutputParser", "PARSER_FAMILIES", "THINK_END", "THINK_START",
           "ToolCallDelta", "family_for", "make_parser", "random_call_id", "starts_in_reasoning"]

PARSER_FAMILIES = ("kimi_k2", "deepseek_v3", "qwen3", "llama3_json", "think", "none")

# config.json model_type -> default parser family (the server's flag overrides it).
_FAMILY_BY_MODEL_TYPE = {
    "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2",
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "think",
    "qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3_json",
}


def family_for(model_type: str) -> str:
  """The default parser family for a config.json `model_type` ("none" when unknown)."""
  return _FAMILY_BY_MODEL_TYPE.get(model_type, "none")


def starts_in_reasoning(prompt: str) -> bool:
  """Whether a rendered prompt leaves the model inside a think block (K2.5's generation
  prompt ends in `<think>`; a prompt ending `<think></think>` does not)."""
  tail = prompt.rstrip()
  return tail.endswith(THINK_START)


_PARSERS = {"kimi_k2": KimiK2Parser, "deepseek_v3": DeepSeekV3Parser, "qwen3": Qwen3Parser,
            "llama3_json": Llama3JsonParser, "think": ThinkParser, "none": PlainParser}


def make_parser(family: str, *, starts_in_reasoning: bool = False, tools_enabled: bool = False,
                make_id: Callable[[], str] = random_call_id) -> ChatOutputParser:
  """A fresh parser for one request's output. Kimi's call ids are the model's own headers;
  the others' come from `make_id`."""
  if family not in _PARSERS:
    raise ValueError(f"tool_parser: unknown family {family!r} (known: {', '.join(PARSER_FAMILIES)})")
  return _PARSERS[family](starts_in_reasoning=starts_in_reasoning, tools_enabled=tools_enabled,
                          make_id=make_id)
