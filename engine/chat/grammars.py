"""Tool-call grammars: `tool_choice` "required" / a named function constrains the output to the
model family's tool-call syntax, each call's arguments to its tool's `parameters` JSON schema.

One llguidance Lark grammar per request (`tool_call_grammar`), in the format the family's parser
(`parsers.py`) reads and its chat template writes, both from its `markup.Markup`:

  kimi_k2      <|tool_calls_section_begin|> (<|tool_call_begin|> "functions.NAME:" IDX
               <|tool_call_argument_begin|> ARGS <|tool_call_end|>)+ <|tool_calls_section_end|>
  deepseek_v3  <｜tool▁calls▁begin｜> calls <｜tool▁calls▁end｜>, a call being V3.1's
               <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>, or V3's
               <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
               (newline-separated) when the chat template writes the ```json fence
  qwen3        <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>, "\\n" between calls
  llama3_json  {"name": NAME, "parameters": ARGS}, "; " between calls

ARGS is `%json{the tool's parameters}` (the caller resolves a tool without parameters to `{}`
and `function.strict: true` to only the declared keys), compiled with the engine's JSON options
(no free whitespace, ", " and ": "). "required": one or more calls of any listed tool (one with
`parallel_tool_calls: false`); a named function: exactly one call of it. No content comes before
or after the calls: after the last call only EOS may follow.

A marker that is a single token of the tokenizer (Kimi's and DeepSeek's are special tokens) is
written as that token id (`<[id]>`), so the model must emit the control token itself, never its
spelling as text; one the tokenizer lacks (the demo model's) is a text literal.

Reasoning: when the generation prompt leaves the model inside a think block (K2.5's ends in
`<think>`), free reasoning text comes first, up to the think-end marker, then the calls. A
special-token `</think>` ends a free text lexeme (special tokens are never text); a text one
ends a lazy lexeme at its first occurrence. Kimi's parser also ends reasoning at the section
marker, so there `</think>` is optional when both are special tokens. The thinking budget
(the decode loop writes `</think>` at it) bounds the reasoning; without one a token limit spent
thinking ends with finish_reason "length" and no call.

The grammars are text here; `engine/service/tool_constraints.py` compiles them at the edge.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from engine.chat.markup import (DEEPSEEK_V3, DEEPSEEK_V3_FENCE, KIMI_K2, QWEN3, THINK_END,
                                TOOL_FAMILIES)
from engine.chat.reasoning import token_id
from engine.runtime.grammar import JSON_OPTIONS, StructuredOutputsParams

FAMILIES = TOOL_FAMILIES
THINKING_FAMILIES = ("kimi_k2", "deepseek_v3", "qwen3", "think")  # parsers that split <think>
NL = "\n"


def _with_json_options(schema: Any) -> Any:
  """The engine's JSON options for an inline `%json` (the schema's own x-guidance wins)."""
  if isinstance(schema, bool):  # JSON Schema's boolean forms: anything / nothing
    schema = {} if schema else {"not": {}}
  return {**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


class _Lark:
  """Lark text of one grammar: markers as token ids or literals, a rule per tool."""

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self.rules: list[str] = []

  def token_id(self, marker: str) -> int | None:
    """The id of `marker` when the tokenizer has it as one token, else None."""
    return token_id(self.tokenizer, marker)

  def marker(self, text: str) -> str:
    tid = self.token_id(text)
    return f"<[{tid}]>" if tid is not None else self.literal(text)

  @staticmethod
  def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON escapes are Lark literal escapes here

  def add(self, rule: str) -> None:
    self.rules.append(rule)

  def text(self) -> str:
    return "\n".join(self.rules) + "\n"


def _calls_rule(call_rules: Sequence[str], parallel: bool, sep: str | None) -> str:
  one = "(" + " | ".join(call_rules) + ")"
  if not parallel:
    return f"calls: {one}"
  if sep is None:
    return f"calls: {one}+"
  return f"calls: {one} ({sep} {one})*"


def tool_call_grammar(family: str, tools: Sequence[tuple[str, Any]], *, parallel: bool = True,
                      starts_in_reasoning: bool = False, tokenizer: Any,
                      fenced: bool = False) -> str:
  """The Lark grammar of one or more calls (one unless `parallel`) of `tools`, (name,
  arguments schema) pairs, in `family`'s syntax; `fenced`: DeepSeek V3's ```json form instead
  of V3.1's."""
  if family not in FAMILIES:
    raise ValueError(f"no tool-call grammar for family {family!r}")
  lark = _Lark(tokenizer)
  names: list[str] = []
  for i, (name, params) in enumerate(tools):
    rule, args = f"call_{i}", f"args_{i}"
    schema = json.dumps(_with_json_options(params), ensure_ascii=False)
    lark.add(f"{args}: %json {schema}")
    if family == "kimi_k2":
      p = KIMI_K2
      head = p.call_id_format.format(name=name, index="")
      body = (f"{lark.marker(p.call_begin)} {lark.literal(head)} CALL_INDEX "
              f"{lark.marker(p.call_sep)} {args} {lark.marker(p.call_end)}")
    elif family == "deepseek_v3":
      p = DEEPSEEK_V3
      if fenced:
        body = (f"{lark.marker(p.call_begin)} {lark.literal('function')} "
                f"{lark.marker(p.call_sep)} {lark.literal(name + NL + DEEPSEEK_V3_FENCE + NL)} "
                f"{args} {lark.literal(NL + '```')} {lark.marker(p.call_end)}")
      else:
        body = (f"{lark.marker(p.call_begin)} {lark.literal(name)} {lark.marker(p.call_sep)} "
                f"{args} {lark.marker(p.call_end)}")
    elif family == "qwen3":
      p = QWEN3
      head = NL + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
      body = (f"{lark.marker(p.tools_begin)} {lark.literal(head)} {args} "
              f"{lark.literal('}' + NL)} {lark.marker(p.call_end)}")
    else:  # llama3_json
      head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '
      body = f"{lark.literal(head)} {args} {lark.literal('}')}"
    lark.add(f"{rule}: {body}")
    names.append(rule)

  if family == "kimi_k2":
    lark.add(_calls_rule(names, parallel, None))
    lark.add("CALL_INDEX: /[0-9]{1,3}/")
    tools_rule = f"{lark.marker(KIMI_K2.tools_begin)} calls {lark.marker(KIMI_K2.tools_end)}"
  elif family == "deepseek_v3":
    lark.add(_calls_rule(names, parallel, lark.literal(NL) if fenced else None))
    tools_rule = (f"{lark.marker(DEEPSEEK_V3.tools_begin)} calls "
                  f"{lark.marker(DEEPSEEK_V3.tools_end)}")
  elif family == "qwen3":
    lark.add(_calls_rule(names, parallel, lark.literal(NL)))
    tools_rule = "calls"
  else:
    lark.add(_calls_rule(names, parallel, lark.literal("; ")))
    tools_rule = "calls"

  # Kimi's parser also ends reasoning at the tool section (when that is a control token).
  optional_end = family == "kimi_k2" and lark.token_id(KIMI_K2.tools_begin) is not None
  lark.add(_start_rule(lark, family, tools_rule, starts_in_reasoning, optional_end))
  return lark.text()


def _start_rule(lark: _Lark, family: str, body: str, starts_in_reasoning: bool,
                optional_end: bool = False) -> str:
  """`start`: `body`, after free reasoning up to the think-end marker when the prompt opened
  a think block and the family's parser splits reasoning (module docstring)."""
  if not (starts_in_reasoning and family in THINKING_FAMILIES):
    return f"start: {body}"
  end_id = lark.token_id(THINK_END)
  after = f" {lark.literal(NL)}?" if family == "qwen3" else ""  # Qwen's separator
  if end_id is not None:
    lark.add("REASONING: /(.|\\n)*/")
    if optional_end:
      return f"start: REASONING? (<[{end_id}]>)? {body}"
    return f"start: REASONING? <[{end_id}]>{after} {body}"
  end = re.escape(THINK_END).replace("/", "\\/")  # a Lark regex ends at an unescaped '/'
  lark.add(f"reasoning[lazy]: /(.|\\n)*{end}/")
  return f"start: reasoning{after} {body}"


def _lark_regex(regex: str) -> str:
  """A regex as a Lark `/.../` terminal: its unescaped '/' escaped."""
  return "/" + re.sub(r"(\\.)|/", lambda m: m.group(1) or "\\/", regex) + "/"


def response_after_reasoning(spec: StructuredOutputsParams, family: str,
                             tokenizer: Any) -> StructuredOutputsParams:
  """A response constraint for a prompt that opened a think block: free reasoning up to the
  think-end marker, then the constrained answer (else the answer's JSON would be written, and
  parsed, as reasoning). A user's own grammar is taken as written: it covers the whole output."""
  if family not in THINKING_FAMILIES or spec.grammar is not None:
    return spec
  lark = _Lark(tokenizer)
  if spec.json is not None or spec.json_object:
    schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
    lark.add(f"answer: %json {json.dumps(_with_json_options(schema), ensure_ascii=False)}")
  elif spec.regex is not None:
    lark.add(f"answer: ANSWER\nANSWER: {_lark_regex(spec.regex)}")
  else:
    lark.add("answer: " + " | ".join(lark.literal(c) for c in spec.choice))
  lark.add(_start_rule(lark, family, "answer", True))
  return StructuredOutputsParams(grammar=lark.text())
