"""`tool_choice` "required" / a named function at the edge: the chosen tools' schemas checked,
then the family's tool-call grammar (`engine/chat/grammars.py`) compiled for the request, on the
tokenizer thread that parses it (a bad schema is a FieldError naming
`tools[i].function.parameters`)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from engine.chat import grammars
from engine.chat.grammars import (FAMILIES, _with_json_options,  # noqa: F401 (re-export)
                                  response_after_reasoning)
from engine.runtime.grammar import StructuredOutputsParams
from engine.service.structured import compile_checked, strict_schema
from engine.service.validation import FieldError, RequestLimits

_EMPTY_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(tool: dict) -> dict:
  """The schema a call's arguments must follow (a tool without parameters takes `{}`)."""
  fn = tool["function"]
  schema = fn.get("parameters")
  if schema is None:
    return dict(_EMPTY_ARGS)
  return strict_schema(schema) if fn.get("strict") is True else schema


def tool_call_grammar(family: str, tools: Sequence[dict], **kwargs: Any) -> str:
  """`grammars.tool_call_grammar` of OpenAI tool dicts (each with its `parameters_schema`)."""
  return grammars.tool_call_grammar(
      family, [(t["function"]["name"], parameters_schema(t)) for t in tools], **kwargs)


def check_tool_names(family: str, tools: Sequence[dict], indices: Sequence[int]) -> None:
  """Names the family's header cannot carry (Kimi's and DeepSeek's end at whitespace)."""
  if family not in ("kimi_k2", "deepseek_v3"):
    return
  for i, tool in zip(indices, tools):
    if any(c.isspace() for c in tool["function"]["name"]):
      raise FieldError(f"tools[{i}].function.name", f"a {family} tool call cannot name a "
                       "function with whitespace in its name")


def constraint_for(mode: str, name: str | None, tools: Sequence[dict], *, family: str,
                   parallel: bool, starts_in_reasoning: bool, fenced: bool, tokenizer: Any,
                   limits: RequestLimits) -> StructuredOutputsParams:
  """The compiled constraint of tool_choice `mode` ("required" or "named"): each chosen tool's
  schema is compiled alone first, so a bad one names `tools[i].function.parameters`."""
  if family not in FAMILIES:
    raise FieldError("tool_choice", f"{'required' if mode == 'required' else 'a named function'}"
                     f" is enforced by a tool-call grammar, and this server's output format "
                     f"{family!r} has none (serve --chat_parser={'|'.join(FAMILIES)})")
  chosen = [(i, t) for i, t in enumerate(tools)
            if mode == "required" or t["function"]["name"] == name]
  indices, chosen_tools = [i for i, _ in chosen], [t for _, t in chosen]
  check_tool_names(family, chosen_tools, indices)
  for i, tool in chosen:
    schema = parameters_schema(tool)
    field = f"tools[{i}].function.parameters"
    compile_checked(StructuredOutputsParams(json=json.dumps(schema, ensure_ascii=False)), field,
                    tokenizer, limits)
  lark = tool_call_grammar(family, chosen_tools, parallel=parallel and mode == "required",
                           starts_in_reasoning=starts_in_reasoning, tokenizer=tokenizer,
                           fenced=fenced)
  return compile_checked(StructuredOutputsParams(grammar=lark), "tool_choice", tokenizer, limits)
