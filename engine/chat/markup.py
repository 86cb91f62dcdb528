"""Each model family's chat markup, defined once: the think markers, the tool-call markers and
how a call is written. Rendering (family detection, Kimi's call ids in history, the thinking
flag), parsing (`parsers.py`) and constraining (`grammars.py`) all read these definitions.

  kimi_k2      <think>..</think>, then <|tool_calls_section_begin|><|tool_call_begin|>
               functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>...
               <|tool_calls_section_end|>; the thought also ends at the section begin marker
               (K2.5 writes no `</think>` before calls). The call id is the header as written
               (Kimi's templates echo ids into history and results: `## Return of ID`).
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
               {json}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (V3), or V3.1's
               <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>.
  qwen3        <tool_call>\\n{"name": NAME, "arguments": {json}}\\n</tool_call>, "\\n" between.
  llama3_json  a reply that is {"name": NAME, "parameters": {json}} (after an optional
               <|python_tag|>), several separated by ';' or newlines.
  think        only <think>..</think> (DeepSeek-R1 style models without tools).
  none         plain text.
"""

from __future__ import annotations

import dataclasses
import re

THINK_START, THINK_END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Markup:
  family: str
  think: bool = True                    # <think>..</think> reasoning
  tools_begin: str | None = None        # what opens tool-call text in the answer
  tools_begin_variants: tuple[str, ...] = ()   # other spellings a model writes for it
  tools_end: str | None = None          # closes a section of calls (Kimi, DeepSeek)
  tools_end_variants: tuple[str, ...] = ()
  call_begin: str | None = None         # opens one call (Kimi, DeepSeek)
  call_sep: str | None = None           # between a call's header and its arguments
  call_end: str | None = None           # closes one call
  reasoning_ends_at_tools: bool = False  # the tool section also closes the thought (Kimi)
  call_separator: str = ""              # between content and calls, and between calls (Qwen)
  # The call id as the template echoes it into history (None: ids are not rendered).
  call_id_format: str | None = None
  # The template variable that turns thinking on and off, where the family has one.
  thinking_variable: str | None = None

  @property
  def think_markers(self) -> tuple[str, str] | None:
    return (THINK_START, THINK_END) if self.think else None

  @property
  def tool_begins(self) -> tuple[str, ...]:
    return ((self.tools_begin,) + self.tools_begin_variants) if self.tools_begin else ()

  @property
  def tool_ends(self) -> tuple[str, ...]:
    return ((self.tools_end,) + self.tools_end_variants) if self.tools_end else ()

  @property
  def markers(self) -> tuple[str, ...]:
    """Every marker of the family's tool markup (stripped from malformed leftovers)."""
    return tuple(m for m in (*self.tool_begins, *self.tool_ends, self.call_begin, self.call_sep,
                             self.call_end) if m)

  @property
  def reasoning_ends(self) -> tuple[str, ...]:
    """Text that ends a thought besides `</think>` (and then starts the answer)."""
    return self.tool_begins if self.reasoning_ends_at_tools else ()


KIMI_K2 = Markup(
    "kimi_k2", tools_begin="<|tool_calls_section_begin|>",
    # Kimi models also write the singular spellings (vLLM's Kimi parser accepts them too).
    tools_begin_variants=("<|tool_call_section_begin|>",),
    tools_end="<|tool_calls_section_end|>", tools_end_variants=("<|tool_call_section_end|>",),
    call_begin="<|tool_call_begin|>", call_sep="<|tool_call_argument_begin|>",
    call_end="<|tool_call_end|>", reasoning_ends_at_tools=True,
    call_id_format="functions.{name}:{index}", thinking_variable="thinking")
DEEPSEEK_V3 = Markup(
    "deepseek_v3", tools_begin="<｜tool▁calls▁begin｜>", tools_end="<｜tool▁calls▁end｜>",
    call_begin="<｜tool▁call▁begin｜>", call_sep="<｜tool▁sep｜>", call_end="<｜tool▁call▁end｜>",
    thinking_variable="thinking")
QWEN3 = Markup("qwen3", tools_begin="<tool_call>", call_end="</tool_call>", call_separator="\n",
               thinking_variable="enable_thinking")
LLAMA3_JSON = Markup("llama3_json", think=False, tools_begin="<|python_tag|>")
THINK = Markup("think")
NONE = Markup("none", think=False)

FAMILIES = {m.family: m for m in (KIMI_K2, DEEPSEEK_V3, QWEN3, LLAMA3_JSON, THINK, NONE)}
FAMILY_NAMES = tuple(FAMILIES)
TOOL_FAMILIES = ("kimi_k2", "deepseek_v3", "qwen3", "llama3_json")   # with a tool-call syntax
DEEPSEEK_V3_FENCE = "```json"   # V3's call body (V3.1 writes the JSON bare)

# config.json model_type -> default family (the server's --chat_parser flag overrides it).
_BY_MODEL_TYPE = {
    "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2",
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "think",
    "qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3_json",
}


def markup(family: str) -> Markup:
  if family not in FAMILIES:
    raise ValueError(f"tool_parser: unknown family {family!r} (known: {', '.join(FAMILIES)})")
  return FAMILIES[family]


def family_for(model_type: str) -> str:
  """The default family of a config.json `model_type` ("none" when unknown)."""
  return _BY_MODEL_TYPE.get(model_type, "none")


def family_of_template(source: str) -> str | None:
  """The family whose tool markup a chat template writes, or None."""
  for m in (KIMI_K2, DEEPSEEK_V3, QWEN3):
    if m.tools_begin in source:
      return m.family
  return None


def starts_in_reasoning(prompt_tail: str) -> bool:
  """Whether a rendered prompt leaves the model inside a think block (K2.5's generation
  prompt ends in `<think>`; one ending `<think></think>` does not)."""
  return prompt_tail.rstrip().endswith(THINK_START)


_KIMI_ID = re.compile(r"(?:functions\.)?(\S+):(\d+)")


def kimi_call_name(header: str) -> str | None:
  """The function name of a Kimi call header `functions.NAME:IDX` (the prefix may be missing;
  NAME may hold '.', '-', ':'), or None."""
  m = _KIMI_ID.fullmatch(header)
  return m.group(1) if m else None
