"""Kimi K2.5's own chat template (tests/golden/fixtures/chat/templates/moonshotai-Kimi-K2.5.jinja)
on the serving path, without a model: a kimi_k25 checkpoint directory made of the tiny vision
fixture's config, tiktoken tokenizer and K2.5 special tokens plus that `chat_template.jinja`,
loaded as the server loads it (`api.load_tokenizer`, `ChatTemplate.from_dir`). Each golden K2.5
conversation, sent as an OpenAI /v1/chat/completions body and as a gRPC ChatRequest, becomes the
token ids of what transformers rendered (`render_cases.json`), opens reasoning exactly when the
prompt ends in `<think>`, and its output parses into reasoning, content and tool calls."""

import base64
import copy
import dataclasses
import io
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from engine import api
from engine.chat import markup, parsers
from engine.chat.template import ChatTemplate, encode_prompt
from engine.model.image_processing import ImageProcessorConfig
from engine.service import chat, openai_chat
from engine.service.proto import inference_pb2 as pb
from engine.service.validation import RequestLimits

TESTS = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(TESTS, "golden", "fixtures", "kimi_k25_vision")
CHAT = os.path.join(TESTS, "golden", "fixtures", "chat")
K25 = "moonshotai-Kimi-K2.5.jinja"
CASES = [c for c in json.load(open(os.path.join(CHAT, "render_cases.json"),
                                   encoding="utf-8"))["cases"] if c["template"] == K25]
# Conversations as a chat request sends them: a generation prompt, text parts only.
SERVED = [c for c in CASES if c["kwargs"].get("add_generation_prompt", True)
          and c["name"] != "kimi_k25_image_part"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  path = tmp_path_factory.mktemp("kimi_k25_ckpt")
  for name in ("config.json", "tokenizer_config.json", "tiktoken.model",
               "preprocessor_config.json"):
    shutil.copy(os.path.join(FIXTURE, name), path / name)
  shutil.copy(os.path.join(CHAT, "templates", K25), path / "chat_template.jinja")
  tokenizer = api.load_tokenizer(str(path))
  template = ChatTemplate.from_dir(str(path))
  limits = RequestLimits(vocab_size=tokenizer.get_vocab_size(), max_model_len=4096,
                         num_eos_ids=1)
  return str(path), tokenizer, template, limits


def openai_body(case):
  messages = copy.deepcopy(case["messages"])
  for m in messages:   # arguments as the openai client sends them: JSON text
    for call in m.get("tool_calls", []):
      call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
  body = {"model": "k25", "messages": messages, "max_tokens": 8}
  if case["tools"]:
    body["tools"] = case["tools"]
  if case["kwargs"]:
    body["chat_template_kwargs"] = case["kwargs"]
  return json.dumps(body).encode()


def grpc_request(case):
  req = pb.ChatRequest()
  for m in case["messages"]:
    msg = req.messages.add(role=m["role"])
    if m.get("content") is not None:
      msg.content = m["content"]
    msg.reasoning_content = m.get("reasoning_content", "")
    msg.tool_call_id = m.get("tool_call_id", "")
    for call in m.get("tool_calls", []):
      msg.tool_calls.add(id=call["id"], type="function", function=pb.FunctionCall(
          name=call["function"]["name"], arguments=json.dumps(call["function"]["arguments"])))
  for t in case["tools"] or ():
    fn = t["function"]
    req.tools.add(type="function", function=pb.FunctionDefinition(
        name=fn["name"], description=fn.get("description", ""),
        parameters_json=json.dumps(fn.get("parameters", {}))))
  if case["kwargs"]:
    req.template_kwargs.update(case["kwargs"])
  return req


def test_the_checkpoint_directory_serves_k25s_own_template(ckpt):
  path, tokenizer, template, _ = ckpt
  with open(os.path.join(CHAT, "templates", K25), encoding="utf-8") as fh:
    assert template.templates["default"] == fh.read()
  assert template.family == markup.family_for("kimi_k25") == "kimi_k2"
  assert len(SERVED) >= 8 and {"kimi_k25_hello_no_thinking", "kimi_k25_tool_call_in_flight",
                               "kimi_k25_tool_round_trip"} <= {c["name"] for c in SERVED}


@pytest.mark.parametrize("case", SERVED, ids=[c["name"] for c in SERVED])
def test_openai_and_grpc_chat_render_k25_as_transformers_does(ckpt, case):
  _, tokenizer, template, limits = ckpt
  want = encode_prompt(tokenizer, case["rendered"])
  thinking = case["rendered"].endswith("<think>")
  plan = openai_chat.parse_chat(openai_body(case), template, tokenizer, limits, "k25", None)
  assert plan.requests[0].prompt_ids == plan.inputs.prompt_ids == want
  assert plan.inputs.family == "kimi_k2" and plan.inputs.starts_in_reasoning == thinking
  assert plan.inputs.tools_enabled == bool(case["tools"])
  parsed, inputs = chat.parse_chat_request(grpc_request(case), template, tokenizer, limits, None)
  assert parsed.prompt_ids == inputs.prompt_ids == want
  assert inputs.starts_in_reasoning == thinking


def test_an_image_part_renders_as_k25s_placeholder_then_expands(ckpt):
  path, tokenizer, template, limits = ckpt
  case = next(c for c in CASES if c["name"] == "kimi_k25_image_part")
  buf = io.BytesIO()
  Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), np.uint8)).save(
      buf, format="PNG")
  url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
  messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": "What is in this picture?"}]}]
  pad = tokenizer.token_to_id("<|media_pad|>")
  vision = chat.Vision(pad, ImageProcessorConfig.from_dir(path))
  inputs = chat.prepare(template, tokenizer, limits, chat.ChatRequest(messages=messages),
                        family=None, vision=vision)
  ids = inputs.prompt_ids
  (image,) = inputs.images
  start, n = image.offset, image.num_tokens
  assert n > 1 and ids[start:start + n] == [pad] * n
  assert ids[:start + 1] + ids[start + n:] == encode_prompt(tokenizer, case["rendered"])


def parse(inputs, text):
  parser = parsers.make_parser(inputs.family, starts_in_reasoning=inputs.starts_in_reasoning,
                                    tools_enabled=inputs.tools_enabled)
  deltas = [parser.feed(text), parser.finish()]
  return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
          parser.tool_calls)


def test_k25_output_parses_from_inside_the_think_block(ckpt):
  _, tokenizer, template, limits = ckpt
  by_name = {c["name"]: c for c in SERVED}
  call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
          '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
          "<|tool_calls_section_end|>")
  on = openai_chat.parse_chat(openai_body(by_name["kimi_k25_tool_call_in_flight"]), template,
                              tokenizer, limits, "k25", None).inputs
  reasoning, content, calls = parse(on, "Oslo next.</think>Checking." + call)
  assert (reasoning, content) == ("Oslo next.", "Checking.")
  assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
          for c in calls] == [("functions.get_weather:1", "get_weather", {"city": "Oslo"})]
  # K2.5's reasoning also ends where its tool section begins.
  reasoning, content, calls = parse(on, "Call it." + call)
  assert (reasoning, content, len(calls)) == ("Call it.", "", 1)
  off = openai_chat.parse_chat(openai_body(by_name["kimi_k25_tool_call_in_flight_no_thinking"]),
                               template, tokenizer, limits, "k25", None).inputs
  reasoning, content, calls = parse(off, "Checking." + call)
  assert (reasoning, content, len(calls)) == ("", "Checking.", 1)


def test_tool_choice_required_lets_k25_reason_first_only_when_thinking(ckpt):
  """tool_choice required: the call grammar (issue 35) starts after free reasoning and
  `</think>` when the prompt opened a think block, at the tool section when thinking is off."""
  _, tokenizer, template, limits = ckpt
  limits = dataclasses.replace(limits, eos_token_ids=(tokenizer.token_to_id("[EOS]"),))
  case = next(c for c in SERVED if c["name"] == "kimi_k25_tools")
  section = tokenizer.token_to_id("<|tool_calls_section_begin|>")
  think_end = tokenizer.token_to_id("</think>")
  for kwargs, start in (({}, f"start: REASONING? (<[{think_end}]>)? <[{section}]> calls"),
                        ({"thinking": False}, f"start: <[{section}]> calls")):
    body = json.loads(openai_body(case))
    body.update(tool_choice="required", chat_template_kwargs=kwargs)
    plan = openai_chat.parse_chat(json.dumps(body).encode(), template, tokenizer, limits,
                                  "k25", None)
    assert plan.inputs.starts_in_reasoning == (not kwargs)
    assert any(line.startswith(start) for line in plan.inputs.constraint.grammar.splitlines())
    assert plan.requests[0].sampling.structured_outputs == plan.inputs.constraint
