#!/usr/bin/env python3
"""Generate the chat-template golden fixtures under ``tests/golden/fixtures/chat/``.

``engine/chat/template.py`` renders a checkpoint's chat template itself (jinja2, no
transformers); these fixtures hold what transformers' ``apply_chat_template`` renders for the
same template, conversation, tools and keyword arguments, and what the Kimi K2.5 checkpoint's
``tool_declaration_ts.py`` writes for a set of tool schemas. ``tests/test_chat_template.py``
compares our output with them byte for byte.

Run in the reference environment (``bash tests/golden/make_ref_env.sh``; transformers 5.24.0 +
jinja2)::

    .venv-ref/bin/python tests/golden/make_chat_golden.py \\
        --kimi-ts-script /path/to/tool_declaration_ts.py

``--kimi-ts-script`` is the Kimi K2.5 checkpoint's ``tool_declaration_ts.py`` (public copies:
thinking-machines-lab/tinker-cookbook ``tinker_cookbook/renderers/kimi_k2_5_tool_declaration_ts.py``
and the ports in vLLM / SGLang); it is not committed here. Besides the named cases, 200
seeded random tool lists cover the schema features; where the script raises, the fixture
records that (the tokenizer then declares the tools as JSON). The Kimi K2.5 render cases go
through ``KimiK25Tokenizer``, whose ``apply_chat_template`` does what the checkpoint's
``TikTokenTokenizer`` (``tokenization_kimi.py``) does before transformers renders: the tools
key-sorted (``deep_sort_dict``), declared by the script as ``tools_ts_str`` (left out where it
raises), ``thinking`` True unless given. The templates are read from
``fixtures/chat/templates/`` (their origins are in ``fixtures/chat/README.md``). Output:
``fixtures/chat/render_cases.json`` and ``fixtures/chat/tools_ts_cases.json``, rewritten
deterministically (no time-dependent template function is used by these cases).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import random

import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT = os.path.join(HERE, "fixtures", "chat")
TEMPLATES = os.path.join(CHAT, "templates")

# Named special tokens as the checkpoints' tokenizer_config.json files declare them.
SPECIAL = {
    "kimi": {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"},
    "deepseek": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                 "pad_token": "<｜end▁of▁sentence｜>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "web-search.v2", "description": "Search the web.\nReturns the top hits.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "minLength": 1},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5}},
        "required": ["query"]}}}


def tool_round_trip(call_id, args, reasoning=True):
  """user -> assistant tool call -> tool result -> assistant answer -> user."""
  call = {"role": "assistant", "content": "",
          "tool_calls": [{"id": call_id, "type": "function",
                          "function": {"name": "get_weather", "arguments": args}}]}
  if reasoning:
    call["reasoning_content"] = "The user wants the weather; call the tool."
  return [
      {"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What's the weather in Paris?"},
      call,
      {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 18, "sky": "clear"}'},
      {"role": "assistant", "content": "It is 18 °C and clear in Paris.",
       "reasoning_content": "Report the tool result."},
      {"role": "user", "content": "And in Oslo?"},
  ]


K25 = "moonshotai-Kimi-K2.5.jinja"
# A schema the TypeScript encoding refuses (a property without a type): declared as JSON.
UNTYPED = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"x": {"description": "no type"}}}}}


def kimi_k25_cases(args, hello, multi, parallel):
  """Kimi K2.5: thinking on (the default) and off, tools in TypeScript, tool round trips."""
  in_flight = tool_round_trip("functions.get_weather:0", args)[:4]   # ends at the tool result
  image = [{"role": "user", "content": [{"type": "image"},
                                        {"type": "text", "text": "What is in this picture?"}]}]
  yield "kimi_k25_hello", K25, "kimi", hello, None, {}
  yield "kimi_k25_hello_no_thinking", K25, "kimi", hello, None, {"thinking": False}
  yield "kimi_k25_multi_turn", K25, "kimi", multi, None, {}
  yield "kimi_k25_multi_turn_no_thinking", K25, "kimi", multi, None, {"thinking": False}
  yield "kimi_k25_tools", K25, "kimi", hello, [WEATHER, SEARCH], {}
  yield ("kimi_k25_tool_round_trip", K25, "kimi", tool_round_trip(
      "functions.get_weather:0", args), [WEATHER, SEARCH], {})
  yield "kimi_k25_tool_call_in_flight", K25, "kimi", in_flight, [WEATHER, SEARCH], {}
  yield ("kimi_k25_tool_call_in_flight_no_thinking", K25, "kimi", in_flight,
         [WEATHER, SEARCH], {"thinking": False})
  yield "kimi_k25_parallel_calls", K25, "kimi", parallel, [WEATHER, SEARCH], {}
  yield "kimi_k25_untyped_tool_as_json", K25, "kimi", hello, [UNTYPED, WEATHER], {}
  yield "kimi_k25_image_part", K25, "kimi", image, None, {}
  yield "kimi_k25_no_generation_prompt", K25, "kimi", multi[:3], None, {
      "add_generation_prompt": False}


def cases():
  k2 = "moonshotai-Kimi-K2-Thinking.jinja"
  v31 = "deepseek-ai-DeepSeek-V3.1.jinja"
  v3 = "vllm-tool_chat_template_deepseekv3.jinja"
  qwen = "Qwen-Qwen3-0.6B.jinja"
  llama = "meta-llama-Llama-3.3-70B-Instruct.jinja"
  args = {"city": "Paris", "unit": "celsius"}
  hello = [{"role": "user", "content": "Hello!"}]
  multi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
           {"role": "user", "content": "Times 3?"}]
  parallel = [
      {"role": "user", "content": "Weather in Paris and news?"},
      {"role": "assistant", "content": "Let me look.", "tool_calls": [
          {"id": "functions.get_weather:0", "type": "function",
           "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
          {"id": "functions.web-search.v2:1", "type": "function",
           "function": {"name": "web-search.v2", "arguments": {"query": "news"}}}]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"},
      {"role": "tool", "tool_call_id": "functions.web-search.v2:1", "content": "No news."},
  ]
  yield "kimi_k2_thinking_hello", k2, "kimi", hello, None, {}
  yield "kimi_k2_thinking_multi_turn", k2, "kimi", multi, None, {}
  yield "kimi_k2_thinking_content_parts", k2, "kimi", [
      {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                   {"type": "text", "text": "Part two."}]}], None, {}
  yield "kimi_k2_thinking_tool_round_trip", k2, "kimi", tool_round_trip(
      "functions.get_weather:0", args), [WEATHER, SEARCH], {}
  yield "kimi_k2_thinking_parallel_calls", k2, "kimi", parallel, [WEATHER, SEARCH], {}
  yield "kimi_k2_thinking_no_generation_prompt", k2, "kimi", multi[:3], None, {
      "add_generation_prompt": False}
  yield from kimi_k25_cases(args, hello, multi, parallel)
  yield "deepseek_v31_hello", v31, "deepseek", hello, None, {}
  yield "deepseek_v31_thinking", v31, "deepseek", multi, None, {"thinking": True}
  yield "deepseek_v31_tool_round_trip", v31, "deepseek", tool_round_trip(
      "call_1", json.dumps(args), reasoning=False), [WEATHER], {}
  yield "deepseek_v3_tool_template_round_trip", v3, "deepseek", tool_round_trip(
      "call_1", args, reasoning=False), [WEATHER, SEARCH], {}
  yield "qwen3_hello", qwen, "qwen3", hello, None, {}
  yield "qwen3_no_thinking", qwen, "qwen3", multi, None, {"enable_thinking": False}
  yield ("qwen3_tool_round_trip", qwen, "qwen3", tool_round_trip("call_1", args),
         [WEATHER, SEARCH], {})
  yield "qwen3_parallel_calls", qwen, "qwen3", parallel, [WEATHER, SEARCH], {}
  yield "llama3_system_hello", llama, "llama3", [
      {"role": "system", "content": "You are terse."}] + hello, None, {}
  yield "llama3_tool_round_trip", llama, "llama3", [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
          "name": "get_weather", "arguments": args}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], [WEATHER], {
          "date_string": "03 Dec 2026"}


def deep_sort_dict(obj):
  if isinstance(obj, dict):
    return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
  if isinstance(obj, list):
    return [deep_sort_dict(item) for item in obj]
  return obj


class KimiK25Tokenizer(PreTrainedTokenizerFast):
  """What the K2.5 checkpoint's tokenizer (`TikTokenTokenizer.apply_chat_template`) adds on
  top of transformers': key-sorted tools, `tools_ts_str` from the checkpoint's script (left
  out where it raises), `thinking` True by default. `ts` is that script's module."""
  ts = None

  def apply_chat_template(self, conversation, tools=None, tokenize=False,
                          add_generation_prompt=True, thinking=True, **kwargs):
    tools = deep_sort_dict(tools)
    if tools:
      try:
        kwargs["tools_ts_str"] = self.ts.encode_tools_to_typescript_style(tools)
      except Exception:   # noqa: BLE001 - as the checkpoint's tokenizer: any, then JSON
        pass
    return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                       add_generation_prompt=add_generation_prompt,
                                       thinking=thinking, **kwargs)


def render(template: str, special: dict, messages, tools, kwargs, cls=PreTrainedTokenizerFast
           ) -> str:
  tok = cls(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, "[UNK]")),
            chat_template=template, **special)
  kwargs = dict(kwargs)
  agp = kwargs.pop("add_generation_prompt", True)
  return tok.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                 tokenize=False, add_generation_prompt=agp, **kwargs)


TS_CASES = {
    "weather_and_search": [WEATHER, SEARCH],
    "no_parameters": [{"type": "function", "function": {"name": "now"}},
                      {"type": "function", "function": {"name": "ping", "description": "Ping.",
                                                        "parameters": {}}}],
    "nested_and_arrays": [{"type": "function", "function": {
        "name": "create_event", "description": "Create a calendar event.",
        "parameters": {"type": "object", "required": ["title", "attendees"], "properties": {
            "title": {"type": "string", "maxLength": 80, "description": "Title"},
            "attendees": {"type": "array", "minItems": 1, "items": {
                "type": "object", "description": "A person", "properties": {
                    "email": {"type": "string", "pattern": "^.+@.+$"},
                    "optional": {"type": "boolean", "default": False}},
                "required": ["email"]}},
            "tags": {"type": "array", "items": {"type": "string"}},
            "any_list": {"type": "array"},
            "when": {"anyOf": [{"type": "string", "description": "ISO date"},
                               {"type": "integer", "description": "epoch"}]},
            "priority": {"type": ["integer", "null"], "default": 1.5},
            "color": {"enum": ["red", "green", 3, None], "description": "Colour\n\nor code"},
            "meta": {"type": "object", "additionalProperties": {"type": "number"}},
            "strict": {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
            "loose": {"type": "object", "additionalProperties": True},
            "label": {"type": "string", "default": "n/a \u00e9"}}}}}],
    "defs_and_refs": [{"type": "function", "function": {
        "name": "tree.insert", "description": "Insert a node.",
        "parameters": {"type": "object", "$defs": {
            "Node": {"type": "object", "description": "A node",
                     "properties": {"value": {"type": "number"},
                                    "children": {"type": "array",
                                                 "items": {"$ref": "#/$defs/Node"}}},
                     "required": ["value"]},
            "Mode": {"enum": ["fast", "safe"], "type": "string"}},
            "properties": {"root": {"$ref": "#/$defs/Node", "description": "Tree root"},
                           "mode": {"$ref": "#/$defs/Mode"}},
            "required": ["root"]}}}],
    "self_reference": [{"type": "function", "function": {
        "name": "walk", "parameters": {"type": "object", "properties": {
            "next": {"$ref": "#"}, "name": {"type": "string"}}, "required": ["name"]}}}],
    "skips_non_functions": [{"type": "_plugin", "function": {"name": "x"}}, WEATHER],
}


def random_tools(rng: random.Random) -> list[dict]:
  """Random OpenAI tools over the JSON-schema features the TypeScript encoding reads (and some
  it refuses: dangling $refs, enum values of the wrong type, boolean false schemas)."""
  def schema(depth, defs):
    kinds = ["string", "integer", "number", "boolean", "null", "object", "array", "enum",
             "anyOf", "union", "ref", "empty", "bool"] if depth < 3 else ["string", "enum", "empty"]
    kind = rng.choice(kinds)
    s: dict = {}
    if kind in ("string", "integer", "number", "boolean", "null"):
      s["type"] = kind
      if kind == "string" and rng.random() < .5:
        s.update(rng.choice([{"maxLength": 5}, {"minLength": 1, "pattern": "^a$"}]))
      if kind in ("integer", "number") and rng.random() < .5:
        s.update({"minimum": 0, "maximum": rng.choice([1, 2.5])})
    elif kind == "object":
      s["type"] = "object"
      if rng.random() < .8:
        props = {f"p{i}{rng.choice(['', '_x', 'B'])}": schema(depth + 1, defs)
                 for i in range(rng.randint(0, 4))}
        s["properties"] = props
        s["required"] = [p for p in props if rng.random() < .5]
      if rng.random() < .3:
        s["additionalProperties"] = rng.choice([True, False, {"type": "string"}])
    elif kind == "array":
      s["type"] = "array"
      if rng.random() < .7:
        s["items"] = schema(depth + 1, defs)
      if rng.random() < .3:
        s["minItems"] = 1
    elif kind == "enum":
      s["enum"] = rng.sample(["a", "b", 1, 2.5, None, True], rng.randint(1, 3))
      if rng.random() < .3:
        s["type"] = rng.choice(["string", ["string", "null"], "integer"])
    elif kind == "anyOf":
      s["anyOf"] = [schema(depth + 1, defs) for _ in range(rng.randint(1, 3))]
    elif kind == "union":
      s["type"] = rng.sample(["string", "number", "integer", "boolean", "null", "object",
                              "array"], rng.randint(1, 3))
    elif kind == "ref":
      s["$ref"] = rng.choice(["#", "#/$defs/Missing"] + [f"#/$defs/{d}" for d in defs] * 4)
    elif kind == "bool":
      return rng.choice([True, False])
    else:
      return {}
    if rng.random() < .4:
      s["description"] = rng.choice(["", "d", "multi\nline", "a\n\nb", "ünï"])
    if rng.random() < .2:
      s["default"] = rng.choice([1, 1.5, "x", [1], {"a": 1}, False])
    return s

  tools = []
  for _ in range(rng.randint(1, 3)):
    defs = tuple(f"D{i}" for i in range(rng.randint(0, 2)))
    params = {"type": "object",
              "properties": {f"a{i}": schema(1, defs) for i in range(rng.randint(0, 4))}}
    params["required"] = [p for p in params["properties"] if rng.random() < .5]
    if defs:
      params["$defs"] = {d: schema(2, ()) for d in defs}
    fn = {"name": rng.choice(["f", "a.b", "x-y"]),
          "parameters": rng.choice([params, params, params, None, {}])}
    if rng.random() < .7:
      fn["description"] = rng.choice(["", "Does it.", "two\nlines"])
    tools.append({"type": rng.choice(["function"] * 9 + ["_plugin"]), "function": fn})
  return tools


def load_ts_script(path: str):
  spec = importlib.util.spec_from_file_location("kimi_tool_declaration_ts", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--kimi-ts-script", required=True,
                  help="the Kimi K2.5 checkpoint's tool_declaration_ts.py")
  args = ap.parse_args()
  ts = KimiK25Tokenizer.ts = load_ts_script(args.kimi_ts_script)
  out = {"transformers": transformers.__version__, "cases": []}
  for name, template_file, special, messages, tools, kwargs in cases():
    with open(os.path.join(TEMPLATES, template_file), encoding="utf-8") as fh:
      template = fh.read()
    cls = KimiK25Tokenizer if template_file == K25 else PreTrainedTokenizerFast
    out["cases"].append({
        "name": name, "template": template_file, "special_tokens": SPECIAL[special],
        "messages": messages, "tools": tools, "kwargs": kwargs,
        "rendered": render(template, SPECIAL[special], messages, tools, kwargs, cls)})
  with open(os.path.join(CHAT, "render_cases.json"), "w", encoding="utf-8") as fh:
    json.dump(out, fh, ensure_ascii=False, indent=1)
    fh.write("\n")
  print(f"render_cases.json: {len(out['cases'])} cases")
  ts_cases = list(TS_CASES.items())
  rng = random.Random(20261203)
  ts_cases += [(f"random_{i}", random_tools(rng)) for i in range(200)]
  ts_out = {"script": "Kimi K2.5 tool_declaration_ts.py", "cases": []}
  for name, tools in ts_cases:
    try:
      encoded = ts.encode_tools_to_typescript_style(copy.deepcopy(tools))
    except Exception as e:   # noqa: BLE001 - the checkpoint's tokenizer catches any, too
      encoded, refused = None, type(e).__name__
    else:
      refused = None
    ts_out["cases"].append({"name": name, "tools": tools, "tools_ts_str": encoded,
                            **({"refused": refused} if refused else {})})
  with open(os.path.join(CHAT, "tools_ts_cases.json"), "w", encoding="utf-8") as fh:
    json.dump(ts_out, fh, ensure_ascii=False, indent=1)
    fh.write("\n")
  print(f"tools_ts_cases.json: {len(ts_out['cases'])} cases")


if __name__ == "__main__":
  main()
