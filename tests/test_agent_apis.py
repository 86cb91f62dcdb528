"""The protocols agents speak, live: OpenAI's Responses API and Anthropic's Messages API with
their official clients, the thinking controls, tool loops, truncation, foreign tool-call ids,
request ids and the HTTP tokenizer, on one server per module.

The server runs the tiny kimi_k25 fixture (`tests/golden/fixtures/kimi_k25_vision`: Kimi's
tokenizer and special tokens, `</think>` and the tool markers single tokens) with Kimi K2.5's
own chat template, so prompts open a think block unless thinking is off, tools are declared in
K2.5's TypeScript, and tool_choice required / a named tool constrains the output to K2.5's
call syntax. The model is random: greedy outputs are compared with the engine's own greedy
output, computed before the server starts, and tool calls come from the constraint.
"""

import http.client
import json
import logging as py_logging
import os

import anthropic
import openai

from engine.chat.template import ChatTemplate
from engine.runtime.request import RequestOutput, Timings, Usage
from engine.service import chat
from engine.service.client import build_chat_request
from engine.service.validation import RequestLimits
from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)

FIXTURE = os.path.join(REPO, "tests", "golden", "fixtures", "kimi_k25_vision")
K25 = os.path.join(REPO, "tests", "golden", "fixtures", "chat", "templates",
                   "moonshotai-Kimi-K2.5.jinja")
KEY = "agent-key"
CONFIG = EngineConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=64, row_widths=(16,),
                      max_model_len=448, max_decode_steps=4)
USER = "Weather in Paris?"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
FN_TOOL = {"type": "function", "name": "get_weather", "parameters": CITY}
ANT_TOOL = {"name": "get_weather", "input_schema": CITY}


@pytest.fixture(scope="module")
def k25_eng():
  model = moejax.load(FIXTURE)   # room for tool declarations and turns (random weights)
  model = dataclasses.replace(model, config=dataclasses.replace(
      model.config, max_position_embeddings=CONFIG.max_model_len))
  e = Engine.from_model(model, CONFIG)
  with open(K25, encoding="utf-8") as fh:
    e.chat_template = ChatTemplate(fh.read())
  return e


def limits_of(e):
  return RequestLimits(vocab_size=e.cfg.vocab_size, max_model_len=CONFIG.max_model_len,
                       num_eos_ids=len(e.eos_token_ids), eos_token_ids=tuple(e.eos_token_ids))


@pytest.fixture(scope="module")
def ref(k25_eng):
  """The engine's own greedy 8 tokens of USER (thinking on), parsed as the server parses."""
  inputs = chat.prepare(k25_eng.chat_template, k25_eng.tokenizer, limits_of(k25_eng),
                        chat.ChatRequest(messages=[{"role": "user", "content": USER}]),
                        family=None)
  out = k25_eng.generate([inputs.prompt_ids], SamplingParams(),
                         StopParams(max_tokens=8, skip_special_tokens=False))[0]
  stream = chat.stream_for(inputs)
  stream.feed(RequestOutput("r", out.output_ids, out.text, True, out.finish_reason, None,
                            Usage(len(inputs.prompt_ids), 0, 8), Timings(0.0)))
  return dict(prompt_tokens=len(inputs.prompt_ids), ids=list(out.output_ids),
              reasoning="".join(stream.reasoning),
              content="".join(stream.content), reasoning_tokens=stream.reasoning_tokens,
              finish=out.finish_reason, thinking=inputs.starts_in_reasoning)


@pytest.fixture(scope="module")
def server(k25_eng, ref):
  bg = BackgroundServer(k25_eng, dataclasses.replace(
      BASE, http_port=0, model_name="k25", api_keys=frozenset({KEY}), request_log=True,
      responses_store_size=8))
  yield bg
  bg.close()
  assert_idle(k25_eng)


def oai(bg):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{bg.server.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=300)


def ant(bg):
  return anthropic.Anthropic(base_url=f"http://127.0.0.1:{bg.server.http_port}", api_key=KEY,
                             max_retries=0, timeout=300)


def post(bg, path, body, headers=None, stream=False):
  """(status, headers, JSON body or the SSE events as (name, data) pairs) of one request."""
  conn = http.client.HTTPConnection("127.0.0.1", bg.server.http_port, timeout=300)
  conn.request("POST", path, json.dumps(body).encode(), {
      "content-type": "application/json", "x-api-key": KEY, **(headers or {})})
  resp = conn.getresponse()
  text = resp.read().decode()
  conn.close()
  if not stream or resp.status != 200:
    return resp.status, resp.headers, json.loads(text)
  events = []
  for block in text.strip().split("\n\n"):
    lines = dict(line.split(": ", 1) for line in block.split("\n"))
    events.append((lines.get("event"), json.loads(lines["data"])))
  return resp.status, resp.headers, events


# ---- Responses ------------------------------------------------------------------------------

def test_responses_plain_streamed_stored_and_a_second_turn(server, ref):
  # K2.5's prompt opened <think>: the output starts as the thought (8 tokens cut it).
  assert ref["thinking"] and ref["reasoning"] and ref["finish"] == "length"
  client = oai(server)
  r = client.responses.create(model="k25", input=USER, max_output_tokens=8, temperature=0)
  kinds = [item.type for item in r.output]
  assert kinds == (["reasoning"] if ref["reasoning"] else []) + (
      ["message"] if ref["content"].strip() else [])
  if ref["reasoning"]:
    assert r.output[0].content[0].text == ref["reasoning"]
  assert r.output_text == ref["content"]
  assert r.status == ("incomplete" if ref["finish"] == "length" else "completed")
  if r.status == "incomplete":
    assert r.incomplete_details.reason == "max_output_tokens"
  assert (r.usage.input_tokens, r.usage.output_tokens) == (ref["prompt_tokens"], 8)
  assert r.usage.output_tokens_details.reasoning_tokens == ref["reasoning_tokens"]
  assert r.id.startswith("resp_") and r.model == "k25"
  # Streamed: OpenAI's event order, numbered, the same text.
  events = list(client.responses.create(model="k25", input=USER, max_output_tokens=8,
                                        temperature=0, stream=True))
  names = [e.type for e in events]
  assert [e.sequence_number for e in events] == list(range(len(events)))
  assert names[:2] == ["response.created", "response.in_progress"]
  assert names[-1] == f"response.{r.status}"
  if ref["reasoning"]:
    assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        ref["reasoning"]
    done = names.index("response.reasoning_text.done")
    assert names[done:done + 3] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done"]
  final = events[-1].response
  assert [o.type for o in final.output] == kinds and final.usage.output_tokens == 8
  # Stored: readable by id, and the next turn continues it (the prefix cache serves it).
  assert client.responses.retrieve(r.id).id == r.id
  r2 = client.responses.create(model="k25", input="And Oslo?", previous_response_id=r.id,
                               max_output_tokens=4, temperature=0)
  assert r2.previous_response_id == r.id
  assert r2.usage.input_tokens > r.usage.input_tokens + 5
  assert r2.usage.input_tokens_details.cached_tokens >= (r.usage.input_tokens - 8) // 4 * 4
  # Chat completions count the same reasoning tokens.
  c = client.chat.completions.create(model="k25", max_tokens=8, temperature=0,
                                     messages=[{"role": "user", "content": USER}])
  assert c.usage.completion_tokens_details.reasoning_tokens == ref["reasoning_tokens"]
  assert c.choices[0].message.model_extra["reasoning_content"] == ref["reasoning"]
  unstored = client.responses.create(model="k25", input=USER, max_output_tokens=2, store=False)
  with pytest.raises(openai.NotFoundError):
    client.responses.retrieve(unstored.id)
  with pytest.raises(openai.NotFoundError) as e:
    client.responses.create(model="k25", input="x", previous_response_id="resp_missing")
  assert e.value.body["param"] == "previous_response_id"


def test_responses_tool_loop_with_tool_choice_required(server):
  client = oai(server)
  first = client.responses.create(
      model="k25", input=USER, tools=[FN_TOOL], tool_choice="required",
      parallel_tool_calls=False, reasoning={"effort": "none"}, max_output_tokens=96,
      temperature=0)
  assert first.status == "completed"
  (call,) = first.output   # thinking off: no reasoning item; the constraint gives one call
  assert call.type == "function_call" and call.name == "get_weather"
  assert call.call_id.startswith("functions.get_weather:")
  assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
  # The agent runs the tool and sends the result back with the call (items in, items out).
  second = client.responses.create(
      model="k25", tools=[FN_TOOL], max_output_tokens=4, temperature=0,
      input=[{"role": "user", "content": USER}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
  assert second.usage.input_tokens > first.usage.input_tokens
  # Streamed: the call's events in order.
  events = list(client.responses.create(
      model="k25", input=USER, tools=[FN_TOOL], tool_choice={"type": "function",
                                                              "name": "get_weather"},
      reasoning={"effort": "minimal"}, max_output_tokens=96, temperature=0, stream=True))
  names = [e.type for e in events]
  body = [n for n in names if n != "response.function_call_arguments.delta"]
  assert body == ["response.created", "response.in_progress", "response.output_item.added",
                  "response.function_call_arguments.done", "response.output_item.done",
                  "response.completed"]
  args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
  assert json.loads(args) == json.loads(events[-1].response.output[0].arguments)


# ---- Anthropic Messages ---------------------------------------------------------------------

def test_messages_plain_streamed_and_a_second_turn(server, ref):
  client = ant(server)
  greedy = {"extra_body": {"temperature": 0}}   # (this client's signature has no temperature)
  m = client.messages.create(model="k25", max_tokens=8, messages=[{"role": "user",
                                                                   "content": USER}], **greedy)
  kinds = [b.type for b in m.content]
  assert kinds == (["thinking"] if ref["reasoning"] else []) + (
      ["text"] if ref["content"].strip() else [])
  if ref["reasoning"]:
    assert m.content[0].thinking == ref["reasoning"] and m.content[0].signature
  assert m.stop_reason == ("max_tokens" if ref["finish"] == "length" else "end_turn")
  assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref["prompt_tokens"]
  assert m.usage.output_tokens == 8 and m.id.startswith("msg_")
  # Anthropic's event order, read raw (the client hides ping).
  status, _, events = post(server, "/v1/messages", {
      "model": "k25", "max_tokens": 8, "temperature": 0, "stream": True,
      "messages": [{"role": "user", "content": USER}]}, stream=True)
  names = [n for n, _ in events]
  assert status == 200 and all(n == d["type"] for n, d in events)
  assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
  if ref["reasoning"]:
    assert names[2] == "content_block_start" and events[2][1]["content_block"]["type"] == \
        "thinking"
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == ref["reasoning"]
    stop = names.index("content_block_stop")
    assert deltas[-1]["type"] == "signature_delta" or names[stop - 1] == "content_block_delta"
  assert events[-2][1]["delta"]["stop_reason"] == m.stop_reason
  assert events[-2][1]["usage"]["output_tokens"] == 8
  # The next turn sends the reply back, thinking block included.
  again = client.messages.create(model="k25", max_tokens=4, messages=[
      {"role": "user", "content": USER},
      {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]
       or "ok"},
      {"role": "user", "content": "And Oslo?"}])
  assert again.usage.cache_read_input_tokens >= 16
  # count_tokens is the prompt the request renders.
  assert client.messages.count_tokens(model="k25", messages=[
      {"role": "user", "content": USER}]).input_tokens == ref["prompt_tokens"]


def test_messages_tool_loop_with_tool_choice_any(server):
  client = ant(server)
  kw = dict(model="k25", max_tokens=96, extra_body={"temperature": 0}, tools=[ANT_TOOL],
            thinking={"type": "disabled"},
            tool_choice={"type": "any", "disable_parallel_tool_use": True})
  m = client.messages.create(messages=[{"role": "user", "content": USER}], **kw)
  assert m.stop_reason == "tool_use"
  (use,) = m.content
  assert use.type == "tool_use" and use.name == "get_weather"
  assert use.input["city"] in ("Paris", "Oslo") and use.id.startswith("functions.get_weather:")
  reply = client.messages.create(model="k25", max_tokens=4, tools=[ANT_TOOL], messages=[
      {"role": "user", "content": USER},
      {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                    "content": "sunny, 21 C"}]}])
  assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > \
      m.usage.input_tokens + 10
  with client.messages.stream(messages=[{"role": "user", "content": USER}], **kw) as s:
    names = [e.type for e in s]
    final = s.get_final_message()
  assert names[0] == "message_start" and names[-1] == "message_stop"
  assert final.content[0].input == use.input and final.stop_reason == "tool_use"


# ---- truncation, ids, thinking ----------------------------------------------------------------

def test_the_token_limit_inside_a_call_leaves_no_half_call(server):
  """K2.5's call header takes ~26 tokens: 30 cuts the arguments."""
  client = oai(server)
  r = client.responses.create(model="k25", input=USER, tools=[FN_TOOL], tool_choice="required",
                              reasoning={"effort": "none"}, max_output_tokens=30, temperature=0)
  assert r.status == "incomplete" and r.output == [] and r.usage.output_tokens == 30
  events = list(client.responses.create(
      model="k25", input=USER, tools=[FN_TOOL], tool_choice="required",
      reasoning={"effort": "none"}, max_output_tokens=30, temperature=0, stream=True))
  done = [e for e in events if e.type == "response.output_item.done"]
  assert [e.item.status for e in done] == ["incomplete"]   # announced, then cut
  assert events[-1].type == "response.incomplete" and events[-1].response.output == []
  m = ant(server).messages.create(model="k25", max_tokens=30, tools=[ANT_TOOL],
                                  thinking={"type": "disabled"}, tool_choice={"type": "any"},
                                  messages=[{"role": "user", "content": USER}])
  assert m.stop_reason == "max_tokens" and m.content == []
  c = oai(server).chat.completions.create(
      model="k25", max_tokens=30, temperature=0, tool_choice="required",
      tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
      messages=[{"role": "user", "content": USER}], extra_body={"thinking": {"type": "disabled"}})
  choice = c.choices[0]
  assert choice.finish_reason == "length" and not choice.message.tool_calls
  assert not choice.message.content


def tokens_of(bg, messages, tools=None):
  status, _, body = post(bg, "/tokenize", {"messages": messages, "tools": tools})
  assert status == 200, body
  return body["tokens"]


def text_of(bg, tokens):
  status, _, body = post(bg, "/detokenize", {"tokens": tokens})
  assert status == 200
  return body["prompt"]


def history(call_id, reasoning=None):
  turn = {"role": "assistant", "content": None, "tool_calls": [{
      "id": call_id, "type": "function",
      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
  if reasoning:
    turn["reasoning_content"] = reasoning
  return [{"role": "user", "content": USER}, turn,
          {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]


def test_foreign_tool_call_ids_and_earlier_reasoning_render_as_k25_wants(server):
  tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
  kimi = tokens_of(server, history("functions.get_weather:0"), tools)
  for foreign in ("call_abc123", "toolu_01XyZ"):
    assert tokens_of(server, history(foreign), tools) == kimi
  text = text_of(server, kimi)
  assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
  assert "## Return of functions.get_weather:0\nsunny" in text and "call_abc" not in text
  # The in-flight turn's reasoning goes back inside its think block (K2.5 keeps it there).
  thought = tokens_of(server, history("call_x", "Paris first."), tools)
  assert "<think>Paris first.</think><|tool_calls_section_begin|>" in text_of(server, thought)
  # Anthropic: toolu_ ids and the thinking block, the same prompt as its OpenAI form.
  client = ant(server)
  messages = [{"role": "user", "content": USER},
              {"role": "assistant", "content": [
                  {"type": "thinking", "thinking": "Paris first.", "signature": "x"},
                  {"type": "tool_use", "id": "toolu_01XyZ", "name": "get_weather",
                   "input": {"city": "Paris"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01XyZ",
                                            "content": "sunny"}]}]
  assert client.messages.count_tokens(model="k25", tools=[ANT_TOOL], messages=messages
                                      ).input_tokens == len(thought)


def test_thinking_controls(server, k25_eng):
  on = tokens_of(server, [{"role": "user", "content": USER}])
  assert text_of(server, on).endswith("<think>")
  client = oai(server)
  plain = dict(model="k25", max_tokens=1, messages=[{"role": "user", "content": USER}])
  # Off, by any API's field: the template's flag (`<think></think>`, one token more).
  for extra in ({"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"},
                {"reasoning_effort": "minimal"}):
    got = client.chat.completions.create(**plain, extra_body=extra)
    assert got.usage.prompt_tokens == len(on) + 1, extra
  r = client.responses.create(model="k25", input=USER, max_output_tokens=1,
                              reasoning={"effort": "none"})
  assert r.usage.input_tokens == len(on) + 1 and r.reasoning.effort == "none"
  assert ant(server).messages.count_tokens(model="k25", thinking={"type": "disabled"}, messages=[
      {"role": "user", "content": USER}]).input_tokens == len(on) + 1
  # gRPC ChatRequest: thinking off sets the flag; a budget rides on SamplingParams.
  from engine.service.proto import inference_pb2 as pb
  req = build_chat_request([{"role": "user", "content": USER}], thinking=False)
  parsed, inputs = chat.parse_chat_request(req, k25_eng.chat_template, k25_eng.tokenizer,
                                           limits_of(k25_eng), None)
  assert len(parsed.prompt_ids) == len(on) + 1 and not inputs.starts_in_reasoning
  assert parsed.sampling.thinking_token_budget is None
  req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=USER)],
                       thinking_token_budget=3)
  parsed, _ = chat.parse_chat_request(req, k25_eng.chat_template, k25_eng.tokenizer,
                                      limits_of(k25_eng), None)
  assert parsed.sampling.thinking_token_budget == 3 and parsed.prompt_ids == on
  # A budget reaches the engine on SamplingParams, with the think markers' ids.
  tok = k25_eng.tokenizer
  end, section = tok.token_to_id("</think>"), tok.token_to_id("<|tool_calls_section_begin|>")
  from engine.service import anthropic_messages, openai_chat, openai_responses
  args = (k25_eng.chat_template, tok, limits_of(k25_eng), "k25", None, None)
  body = {"model": "k25", "messages": [{"role": "user", "content": USER}]}
  for extra, budget in (({"reasoning_effort": "low"}, 1024), ({"reasoning_effort": "high"}, 32768),
                        ({"thinking_token_budget": 5, "reasoning_effort": "low"}, 5),
                        ({"thinking": {"type": "enabled"}}, None)):
    s = openai_chat.parse_chat(json.dumps({**body, **extra}).encode(), *args).requests[0].sampling
    assert s.thinking_token_budget == budget, extra
    if budget is not None:
      assert s.think_end_token_ids == (end, section) and s.think_in_prompt
      assert s.think_start_token_id == tok.token_to_id("<think>")
  s = anthropic_messages.parse_messages(json.dumps({
      **body, "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 7}}).encode(),
      *args).requests[0].sampling
  assert s.thinking_token_budget == 7
  s = openai_responses.parse_responses(json.dumps({
      "model": "k25", "input": USER, "reasoning": {"effort": "medium"}}).encode(), *args,
      openai_responses.ResponseStore(1)).requests[0].sampling
  assert s.thinking_token_budget == 8192


@pytest.mark.slow
def test_the_thinking_budget_closes_the_thought_on_every_api(server, ref, k25_eng):
  """At the budget the engine writes `</think>` (id 279 here) itself: exactly `budget`
  reasoning tokens, the same thought as the unbounded greedy output's first tokens, then the
  answer (the model, random, never closes its thought by itself this early)."""
  tok = k25_eng.tokenizer
  assert tok.token_to_id("</think>") == 279 and 279 not in ref["ids"]
  thought5 = tok.decode(ref["ids"][:5], skip_special_tokens=False)
  client = oai(server)
  r = client.responses.create(model="k25", input=USER, max_output_tokens=12, temperature=0,
                              extra_body={"thinking_token_budget": 5})
  assert r.usage.output_tokens_details.reasoning_tokens == 5
  assert r.output[0].type == "reasoning" and r.output[0].content[0].text == thought5
  assert r.output[1].type == "message" and r.usage.output_tokens == 12
  m = ant(server).messages.create(model="k25", max_tokens=12, extra_body={"temperature": 0},
                                  thinking={"type": "enabled", "budget_tokens": 5},
                                  messages=[{"role": "user", "content": USER}])
  assert [b.type for b in m.content] == ["thinking", "text"]
  assert m.content[0].thinking == thought5 and m.usage.output_tokens == 12
  # Budget 0: the thought closes at once.
  c = client.chat.completions.create(model="k25", max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": USER}],
                                     extra_body={"thinking_token_budget": 0})
  assert not getattr(c.choices[0].message, "reasoning_content", None)
  assert c.usage.completion_tokens_details.reasoning_tokens == 0
  # tool_choice required: the constraint lets reasoning run free up to `</think>`; the budget
  # ends it, and the call follows.
  t = client.responses.create(model="k25", input=USER, tools=[FN_TOOL], tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=96, temperature=0,
                              extra_body={"thinking_token_budget": 3})
  assert t.status == "completed" and t.usage.output_tokens_details.reasoning_tokens == 3
  assert [o.type for o in t.output] == ["reasoning", "function_call"]
  assert json.loads(t.output[1].arguments)["city"] in ("Paris", "Oslo")


def test_bad_inputs_are_400_in_each_apis_shape_and_the_server_serves_on(server):
  openai_cases = [
      ("/v1/responses", {"input": [{"type": "web_search_call"}]}, "input[0].type"),
      ("/v1/responses", {"input": USER, "tools": [{"type": "web_search"}]}, "tools[0].type"),
      ("/v1/responses", {"input": USER, "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
      ("/v1/responses", {"input": USER, "text": {"format": {"type": "json_schema",
                                                            "name": "x"}}}, "text.format.schema"),
      ("/v1/responses", {"input": USER, "tools": [{**FN_TOOL, "name": ""}]}, "tools[0].name"),
      ("/v1/responses", {"input": USER, "tools": [FN_TOOL],
                         "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
      ("/v1/responses", {"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": USER}],
                                "reasoning_effort": "extreme"}, "reasoning_effort"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": USER}],
                                "thinking": {"type": "maybe"}}, "thinking.type"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": USER}],
                                "thinking_token_budget": -1}, "thinking_token_budget"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": USER}],
                                "thinking": {"type": "enabled"}, "reasoning_effort": "none"},
       "reasoning_effort"),
  ]
  for path, body, param in openai_cases:
    status, _, err = post(server, path, {"model": "k25", **body})
    assert status == 400 and err["error"]["param"] == param, (body, err)
    assert err["error"]["type"] == "invalid_request_error"
  msg = [{"role": "user", "content": USER}]
  status, _, err = post(server, "/v1/messages", {"model": "k25", "messages": msg})
  assert status == 400 and err == {"type": "error", "error": {
      "type": "invalid_request_error", "message": "max_tokens: is required"}}
  anthropic_cases = [
      ({"max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
      ({"max_tokens": 8, "messages": [{"role": "user", "content": [
          {"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
      ({"max_tokens": 8, "messages": msg, "thinking": {"type": "enabled",
                                                       "budget_tokens": 8}},
       "thinking.budget_tokens"),
      ({"max_tokens": 8, "messages": msg, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
      ({"max_tokens": 8, "messages": msg, "tools": [ANT_TOOL],
        "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
      ({"max_tokens": 8, "messages": msg, "stop_sequences": [""]}, "stop_sequences"),
  ]
  client = ant(server)
  for body, field in anthropic_cases:
    with pytest.raises(anthropic.BadRequestError) as e:
      client.messages.create(model="k25", **body)
    assert e.value.body["type"] == "error", body
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(field + ":"), (body, e.value.body)
  with pytest.raises(anthropic.AuthenticationError):
    anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.server.http_port}", api_key="no",
                        max_retries=0).messages.create(model="k25", max_tokens=2, messages=msg)
  # Serving on: each API answers.
  assert client.messages.create(model="k25", max_tokens=2, messages=msg).usage.output_tokens
  assert oai(server).responses.create(model="k25", input=USER, max_output_tokens=2).usage


def test_request_ids_the_request_log_and_the_http_tokenizer(server, k25_eng, monkeypatch,
                                                            caplog):
  caplog.set_level(py_logging.INFO)
  status, headers, body = post(server, "/v1/responses", {"model": "k25", "input": USER,
                                                         "max_output_tokens": 2},
                               {"x-request-id": "agent-42"})
  assert status == 200 and headers["x-request-id"] == "agent-42"
  assert body["id"] == "resp_agent-42"
  assert any("id=resp_agent-42 api=responses prompt_tokens=" in r.getMessage()
             and "completion_tokens=2" in r.getMessage() and "finish=length" in r.getMessage()
             for r in caplog.records)
  status, headers, _ = post(server, "/detokenize", {"tokens": [72, 105]})
  assert status == 200 and len(headers["x-request-id"]) == 24   # one made for it
  # The same id while its request is in flight: 400.
  with gated_engine(monkeypatch, k25_eng) as gate:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=300)
    conn.request("POST", "/v1/messages", json.dumps({
        "model": "k25", "max_tokens": 2, "messages": [{"role": "user", "content": USER}]}
    ).encode(), {"content-type": "application/json", "x-api-key": KEY, "x-request-id": "dup"})
    wait_until(lambda: k25_eng.queue_load().requests == 1, what="admission")
    status, _, err = post(server, "/v1/messages", {
        "model": "k25", "max_tokens": 2, "messages": [{"role": "user", "content": USER}]},
        {"x-request-id": "dup"})
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert "already in use" in err["error"]["message"]
    gate.set()
    assert conn.getresponse().status == 200
  # /tokenize and /detokenize as vLLM has them.
  status, _, out = post(server, "/tokenize", {"prompt": "Hi there", "return_token_strs": True})
  assert status == 200 and out["count"] == len(out["tokens"]) == len(out["token_strs"])
  assert out["max_model_len"] == CONFIG.max_model_len and "".join(out["token_strs"]) == "Hi there"
  assert text_of(server, out["tokens"]) == "Hi there"
  status, _, err = post(server, "/detokenize", {"tokens": [10 ** 6]})
  assert status == 400 and err["error"]["param"] == "tokens"


def test_failures_after_the_status_are_error_events_in_each_apis_shape(server, k25_eng,
                                                                       monkeypatch):
  failures = armed_step_failures(monkeypatch, k25_eng, server.server.engine_loop)
  failures.append(1)
  status, _, events = post(server, "/v1/responses", {
      "model": "k25", "input": USER, "max_output_tokens": 4, "stream": True}, stream=True)
  name, error = events[-1]
  assert status == 200 and name == "error" and "device lost" in error["message"]
  assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
  failures.append(1)
  status, _, events = post(server, "/v1/messages", {
      "model": "k25", "max_tokens": 4, "stream": True,
      "messages": [{"role": "user", "content": USER}]}, stream=True)
  name, error = events[-1]
  assert status == 200 and name == "error" and error["type"] == "error"
  assert error["error"]["type"] == "api_error" and "device lost" in error["error"]["message"]
  failures.append(1)
  with pytest.raises(anthropic.InternalServerError) as e:
    ant(server).messages.create(model="k25", max_tokens=4, messages=[{"role": "user",
                                                                      "content": USER}])
  assert e.value.body["error"]["type"] == "api_error"
  assert ant(server).messages.create(model="k25", max_tokens=2, messages=[
      {"role": "user", "content": USER}]).usage.output_tokens == 2
