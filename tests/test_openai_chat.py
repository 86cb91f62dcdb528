"""Chat over both APIs: `/v1/chat/completions` with the official `openai` client and gRPC `Chat`,
live on the demo model (real generation through a real jinja chat template), plus the OpenAI
and proto shaping of parsed tool calls from given output text.

What the live tests prove: rendering (tools, tool round trips, template kwargs), prompt
tokens and the prefix cache across turns, content / reasoning_content split (the template's
`thinking` generation prompt opens `<think>`, so the output is reasoning), logprobs, usage,
errors, cancellation. The demo model never writes tool-call markup, so the parsing of real
tool calls is shown here from given text (`ChatChoices`, `chat_response`) and, marker by
marker, in `test_chat_parsers.py`.
"""

import http.client
import socket

import openai

from engine.chat.template import ChatTemplate
from engine.runtime.request import RequestOutput, Timings, Usage
from engine.service import chat, openai_chat
from engine.service.proto import inference_pb2 as pb
from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)

KEY = "chat-key"
TEMPLATE = CHATML_TOOLS_TEMPLATE  # (service_harness)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read.file-v2", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
USER = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def read_config(path):"}]


@pytest.fixture(scope="module")
def eng(demo):
  """The harness's engine with room for conversations with tools (256 tokens)."""
  e = Engine.from_model(demo, dataclasses.replace(ENGINE_CONFIG, max_model_len=256))
  e.warmup()
  return e


@pytest.fixture
def chat_server(serve, eng, monkeypatch):
  monkeypatch.setattr(eng, "chat_template", ChatTemplate(TEMPLATE))

  def start(**overrides):
    return serve(http_port=0, model_name="demo", api_keys=frozenset({KEY}), **overrides)
  return start


def client_for(bg, key=KEY):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{bg.server.http_port}/v1", api_key=key,
                       max_retries=0, timeout=120)


def reference(eng, messages, max_tokens, tools=None, **kwargs):
  """The engine's own greedy continuation of the rendered conversation."""
  inputs = chat.prepare(eng.chat_template, eng.tokenizer, server_limits(eng),
                        chat.ChatRequest(messages=messages, tools=tools, template_kwargs=kwargs),
                        family=None)
  out = eng.generate([inputs.prompt_ids], SamplingParams(),
                     StopParams(max_tokens=max_tokens, ignore_eos=True,
                                skip_special_tokens=False))[0]
  return inputs, out


def server_limits(eng):
  from engine.service.validation import RequestLimits
  return RequestLimits(vocab_size=eng.cfg.vocab_size,
                       max_model_len=eng.sched_config.max_model_len,
                       num_eos_ids=len(eng.eos_token_ids))


@pytest.mark.slow
def test_chat_completions_stream_and_not(chat_server, eng):
  inputs, want = reference(eng, USER, 12)
  _, thought = reference(eng, USER, 10, thinking=True)
  assert "<tool_call>" not in want.text and "<think>" not in want.text
  bg = chat_server()
  assert bg.server.chat_family == "qwen3"
  client = client_for(bg)
  got = client.chat.completions.create(model="demo", messages=USER, max_completion_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
  choice = got.choices[0]
  assert choice.message.role == "assistant" and choice.message.content == want.text
  assert choice.finish_reason == "length" and not choice.message.tool_calls
  assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
  assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(inputs.prompt_ids), 12)
  # Streaming: the role first, the same text, the finish reason, usage, [DONE].
  chunks = list(client.chat.completions.create(
      model="demo", messages=USER, max_tokens=12, temperature=0, stream=True,
      stream_options={"include_usage": True}, logprobs=True, top_logprobs=2,
      extra_body={"ignore_eos": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
  assert all(c.usage is None for c in chunks[:-1])
  lps = [e for c in chunks if c.choices and c.choices[0].logprobs
         for e in c.choices[0].logprobs.content]
  assert len(lps) == 12 and all(len(e.top_logprobs) == 2 for e in lps)
  assert "".join(e.token for e in lps) == want.text  # greedy: each token is its top one
  assert all(e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in lps)
  # Reasoning: the generation prompt opened <think>, so the output is reasoning_content.
  got = client.chat.completions.create(
      model="demo", messages=USER, max_tokens=10, temperature=0,
      extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}})
  message = got.choices[0].message
  assert message.reasoning_content == thought.text and not message.content
  chunks = list(client.chat.completions.create(
      model="demo", messages=USER, max_tokens=10, temperature=0, stream=True,
      extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}))
  deltas = [c.choices[0].delta for c in chunks if c.choices]
  assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought.text
  assert not "".join(d.content or "" for d in deltas)
  # n choices, seeded: they differ and repeat.
  a = client.chat.completions.create(model="demo", messages=USER, max_tokens=8, n=2, seed=4)
  b = client.chat.completions.create(model="demo", messages=USER, max_tokens=8, n=2, seed=4)
  assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
  assert len({c.message.content for c in a.choices}) == 2


@pytest.mark.slow
def test_tool_round_trip_tool_choice_and_the_prefix_cache(chat_server, eng):
  bg = chat_server()
  client = client_for(bg)
  turn1 = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS,
                                         max_tokens=8, temperature=0)
  assert turn1.choices[0].finish_reason in ("stop", "length")
  plain = client.chat.completions.create(model="demo", messages=USER, max_tokens=1)
  assert turn1.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # tools were declared
  # The agent's next turn: its call and the tool's result go back through the template.
  call = {"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
  messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
  turn2 = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS,
                                         max_tokens=8, temperature=0)
  assert turn2.usage.prompt_tokens > turn1.usage.prompt_tokens + 10
  # The turns share the tools and the first messages: served from the prefix cache.
  assert turn2.usage.prompt_tokens_details.cached_tokens >= 32
  # tool_choice: "none" declares no tools; a named function is the only one declared.
  none = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS,
                                        tool_choice="none", max_tokens=1)
  named = client.chat.completions.create(
      model="demo", messages=USER, tools=TOOLS, max_tokens=1,
      tool_choice={"type": "function", "function": {"name": "get_weather"}})
  assert none.usage.prompt_tokens == plain.usage.prompt_tokens
  assert plain.usage.prompt_tokens < named.usage.prompt_tokens < turn1.usage.prompt_tokens
  required = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS,
                                            tool_choice="required", max_tokens=1)
  assert required.usage.prompt_tokens == turn1.usage.prompt_tokens


@pytest.mark.slow
def test_bad_chat_requests_are_400_naming_the_field(chat_server, eng, monkeypatch):
  bg = chat_server()
  client = client_for(bg)
  cases = [
      (dict(messages=[]), "messages"),
      (dict(messages=[{"role": "bogus", "content": "x"}]), "messages[0].role"),
      (dict(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
      (dict(messages=[{"role": "user"}]), "messages[0].content"),
      (dict(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
       "messages[0].content[0].type"),
      (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
       "messages[0].content[0].image_url"),
      (dict(messages=USER + [{"role": "assistant", "tool_calls": [{"function": {}}]}]),
       "messages[2].tool_calls[0].function.name"),
      (dict(messages=USER, tools=[{"type": "function", "function": {"name": ""}}]),
       "tools[0].function.name"),
      (dict(messages=USER, tools="get_weather"), "tools"),
      (dict(messages=USER, tools=TOOLS, tool_choice="always"), "tool_choice"),
      (dict(messages=USER, tool_choice="required"), "tool_choice"),
      (dict(messages=USER, tools=TOOLS, tool_choice={"type": "function",
                                                     "function": {"name": "nope"}}),
       "tool_choice.function.name"),
      (dict(messages=USER, top_logprobs=2), "top_logprobs"),
      (dict(messages=USER, max_completion_tokens="8"), "max_completion_tokens"),
      (dict(messages=USER, model="other"), "model"),
  ]
  for kwargs, field in cases:
    body = {"model": "demo", "max_tokens": 2, **kwargs}
    model = body.pop("model")
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model=model, **body)
    assert e.value.param == field, (kwargs, e.value.message)
  for raw_body, field in ((b'{"model": "demo", "messages": [', "body"),
                          (b'{"model": "demo"}', "messages")):
    conn = http.client.HTTPConnection("127.0.0.1", bg.server.http_port, timeout=60)
    conn.request("POST", "/v1/chat/completions", raw_body, {"authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert resp.status == 400 and err["param"] == field, err
    conn.close()
  bad_kwargs = {"chat_template_kwargs": [1]}
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="demo", messages=USER, extra_body=bad_kwargs)
  assert e.value.param == "chat_template_kwargs"
  with pytest.raises(openai.AuthenticationError):
    client_for(bg, key="nope").chat.completions.create(model="demo", messages=USER)
  monkeypatch.setattr(eng, "chat_template", None)  # a model without a template: completions
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="demo", messages=USER, max_tokens=2)
  assert "no chat template" in e.value.message
  assert client.completions.create(model="demo", prompt=PROMPT, max_tokens=2).usage


@pytest.mark.slow
def test_cancelled_chat_stream_frees_pages(chat_server, eng, monkeypatch):
  bg = chat_server()
  step = eng.step
  monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.02), step())[1])
  conn = http.client.HTTPConnection("127.0.0.1", bg.server.http_port, timeout=60)
  conn.request("POST", "/v1/chat/completions", json.dumps(
      {"model": "demo", "messages": USER, "max_tokens": 100, "ignore_eos": True,
       "stream": True}).encode(), {"authorization": f"Bearer {KEY}"})
  resp = conn.getresponse()
  assert resp.status == 200 and resp.readline().startswith(b"data: {")
  wait_until(lambda: len(bg.server.engine_loop.subscribed()) == 1, what="running")
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  wait_until(lambda: bg.server.metrics.client_aborts._value.get() == 1, what="abort")
  assert_idle(eng)
  assert not bg.server.engine_loop.subscribed()


# ---- tool calls in the OpenAI and proto shapes, from given output text ------------------------

def outputs(pieces, finish_reason="stop"):
  """RequestOutputs whose text deltas are `pieces` (the last one finished)."""
  usage = Usage(prompt_tokens=5, cached_tokens=0, completion_tokens=len(pieces))
  return [RequestOutput(request_id="r-0", new_token_ids=[7], text_delta=p,
                        finished=i == len(pieces) - 1,
                        finish_reason=finish_reason if i == len(pieces) - 1 else None,
                        usage=usage, timings=Timings(0.0)) for i, p in enumerate(pieces)]


CALL_TEXT = ['Checking.<tool', '_call>\n{"name": "read.file-v2", "argu', 'ments": {"path": ',
             '"a.py"}}\n</tool_call>']


def test_parsed_tool_calls_in_the_openai_shapes():
  inputs = chat.ChatInputs(prompt_ids=[1], family="qwen3", starts_in_reasoning=False,
                           tools_enabled=True)
  common = openai_protocol_common(stream=True)
  plan = openai_chat.ChatPlan("chatcmpl-x", common, [], inputs, logprobs=False)
  plan.requests.append(None)
  choices = openai_chat.ChatChoices(plan, None)
  chunks = [c for c in (choices.feed(0, out) for out in outputs(CALL_TEXT)) if c]
  deltas = [c["choices"][0]["delta"] for c in chunks]
  assert "".join(d.get("content", "") for d in deltas) == "Checking."
  calls = [t for d in deltas for t in d.get("tool_calls", [])]
  assert calls[0]["id"] and calls[0]["type"] == "function"
  assert calls[0]["function"]["name"] == "read.file-v2" and calls[0]["index"] == 0
  assert json.loads("".join(t["function"]["arguments"] for t in calls)) == {"path": "a.py"}
  assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
  message = choices.completion()["choices"][0]["message"]
  assert message["content"] == "Checking."
  assert message["tool_calls"] == [{"id": calls[0]["id"], "type": "function", "function": {
      "name": "read.file-v2", "arguments": '{"path": "a.py"}'}}]
  # With tool_choice "none" the markup is not parsed: it stays content.
  off = dataclasses.replace(inputs, tools_enabled=False)
  choices = openai_chat.ChatChoices(dataclasses.replace(plan, inputs=off), None)
  for out in outputs(CALL_TEXT):
    choices.feed(0, out)
  done = choices.completion()["choices"][0]
  assert done["message"]["content"] == "".join(CALL_TEXT) and done["finish_reason"] == "stop"
  # gRPC: fragments, then the whole calls and TOOL_CALLS on the final message.
  stream = chat.stream_for(inputs)
  responses = [servicer_module.chat_response(out, stream) for out in outputs(CALL_TEXT)]
  frags = [t for r in responses for t in r.tool_calls]
  assert frags[0].name == "read.file-v2" and frags[0].id
  assert "".join(t.arguments for t in frags) == '{"path": "a.py"}'
  final = responses[-1]
  assert final.final.finish_reason == pb.FINISH_REASON_TOOL_CALLS
  assert [(c.function.name, c.function.arguments) for c in final.complete_tool_calls] == [
      ("read.file-v2", '{"path": "a.py"}')]
  # Cut off by max_tokens mid-call: the finish reason stays "length", the text is content.
  stream = chat.stream_for(inputs)
  last = [servicer_module.chat_response(out, stream)
          for out in outputs(CALL_TEXT[:2], "length")][-1]
  assert last.final.finish_reason == pb.FINISH_REASON_LENGTH and not last.complete_tool_calls


def openai_protocol_common(stream):
  from engine.service.openai_protocol import Common
  return Common(model="demo", n=1, stream=stream, include_usage=False,
                sampling=SamplingParams(), stop_fields={})


# ---- gRPC Chat -----------------------------------------------------------------------------

def chat_request(messages, **kwargs):
  req = pb.ChatRequest(**kwargs)
  for m in messages:
    msg = req.messages.add(role=m["role"])
    if m.get("content") is not None:
      msg.content = m["content"]
    for c in m.get("tool_calls") or ():
      msg.tool_calls.add(id=c["id"], function=pb.FunctionCall(**c["function"]))
    if m.get("tool_call_id"):
      msg.tool_call_id = m["tool_call_id"]
  return req


def grpc_tools():
  tools = []
  for t in TOOLS:
    fn = t["function"]
    tools.append(pb.Tool(function=pb.FunctionDefinition(
        name=fn["name"], description=fn.get("description", ""),
        parameters_json=json.dumps(fn["parameters"]))))
  return tools


@pytest.mark.slow
def test_grpc_chat(chat_server, eng, monkeypatch):
  inputs, want = reference(eng, USER, 12)
  _, thought = reference(eng, USER, 6, thinking=True)
  bg = chat_server()
  sampling = pb.SamplingParams(max_tokens=12, ignore_eos=True)
  with InferenceClient(target(bg), api_key=KEY) as client:
    responses = list(client.stub.Chat(chat_request(USER, sampling=sampling),
                                      metadata=client.metadata))
    assert "".join(r.content for r in responses) == want.text
    assert [t for r in responses for t in r.token_ids] == want.output_ids
    final = responses[-1].final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        len(inputs.prompt_ids), 12)
    # Template kwargs as a Struct: reasoning.
    req = chat_request(USER, sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
    req.template_kwargs.update({"thinking": True})
    responses = list(client.stub.Chat(req, metadata=client.metadata))
    assert "".join(r.reasoning_content for r in responses) == thought.text
    assert not "".join(r.content for r in responses)
    # A tool round trip: tools (JSON schema text or a Struct), the call and its result.
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = USER + [{"role": "assistant", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    req = chat_request(messages, tools=grpc_tools(), sampling=pb.SamplingParams(max_tokens=4))
    req.tools[1].function.parameters_struct.update({"type": "object"})
    last = list(client.stub.Chat(req, metadata=client.metadata))[-1]
    assert last.final.usage.prompt_tokens > len(inputs.prompt_ids) + 30
    named = chat_request(USER, tools=grpc_tools(), sampling=pb.SamplingParams(max_tokens=1),
                         tool_choice=pb.ToolChoice(function_name="get_weather"))
    named_tokens = list(client.stub.Chat(named, metadata=client.metadata))[-1].final.usage
    # The client's builder takes OpenAI shapes: tool_choice "none" declares no tools.
    usage = [list(client.chat_stream(USER, tools=TOOLS, tool_choice=choice, max_tokens=1))[-1]
             .final.usage.prompt_tokens for choice in ("none", "auto")]
    assert usage[0] == len(inputs.prompt_ids) < named_tokens.prompt_tokens < usage[1]
    # Bad messages and tools: INVALID_ARGUMENT naming the field.
    bad = [(chat_request([{"role": "wizard", "content": "x"}]), "messages[0].role"),
           (chat_request([]), "messages"),
           (chat_request([{"role": "user"}]), "messages[0].content"),
           (chat_request(USER, tools=[pb.Tool(function=pb.FunctionDefinition(
               name="f", parameters_json="{oops"))]), "tools[0].function.parameters_json"),
           (chat_request(USER, tools=[pb.Tool(function=pb.FunctionDefinition(name=""))]),
            "tools[0].function.name"),
           (chat_request(USER, tool_choice=pb.ToolChoice(mode="required")), "tool_choice"),
           (chat_request(USER, tools=grpc_tools(), tool_choice=pb.ToolChoice(
               function_name="nope")), "tool_choice.function.name"),
           (chat_request(USER, sampling=pb.SamplingParams(top_p=2)), "sampling.top_p")]
    for req, field in bad:
      code, details = status_of(lambda: list(client.stub.Chat(req, metadata=client.metadata)))
      assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    # Cancelling aborts the request and frees its pages.
    step = eng.step
    monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.02), step())[1])
    call = client.stub.Chat(chat_request(USER, sampling=pb.SamplingParams(
        max_tokens=100, ignore_eos=True)), metadata=client.metadata)
    next(call)
    call.cancel()
    wait_until(lambda: bg.server.metrics.client_aborts._value.get() == 1, what="abort")
    assert_idle(eng)
  with InferenceClient(target(bg)) as keyless:
    code, _ = status_of(lambda: list(keyless.stub.Chat(chat_request(USER))))
    assert code == grpc.StatusCode.UNAUTHENTICATED
  # From the shell: python -m engine.client --chat.
  r = subprocess.run([sys.executable, "-m", "engine.client", f"--target={target(bg)}",
                      f"--api_key={KEY}", "--chat", "--system=You write Python.",
                      "--prompt=def read_config(path):", "--max_tokens=12", "--temperature=0",
                      "--ignore_eos", "--json"], cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(r.stdout)
  assert got["content"] == want.text and got["finish_reason"] == "length"
  assert got["usage"]["completionTokens"] == 12


@pytest.mark.slow
def test_grpc_chat_queue_full(chat_server, eng, monkeypatch):
  bg = chat_server(max_queue_requests=1)
  with InferenceClient(target(bg), api_key=KEY) as client, \
      gated_engine(monkeypatch, eng) as gate:
    first = client.stub.Chat(chat_request(USER, sampling=pb.SamplingParams(max_tokens=3)),
                             metadata=client.metadata)
    wait_until(lambda: eng.queue_load().requests == 1, what="admission")
    code, details = status_of(lambda: list(client.stub.Chat(chat_request(USER),
                                                            metadata=client.metadata)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in details
    with pytest.raises(openai.RateLimitError):
      client_for(bg).chat.completions.create(model="demo", messages=USER, max_tokens=2)
    gate.set()
    assert list(first)[-1].final.usage.completion_tokens == 3


# ---- the serving benchmark over both APIs --------------------------------------------------

@pytest.mark.slow
def test_bench_agent_dataset_and_openai_backend(chat_server, eng):
  bg = chat_server()
  base_url = f"http://127.0.0.1:{bg.server.http_port}/v1"
  # Tools and a system prompt shared by all conversations, then two turns each (256 tokens of
  # context hold two: the declared tools alone are ~110 tokens of the demo's tokenizer).
  convs = bench.make_agent_dataset(6, 2, system_words=12, input_words=4, output_len=4, seed=2)
  assert [len(c.output_lens) for c in convs] == [2, 2, 2]
  assert len({c.system for c in convs}) == 1 and len(convs[0].tool_results) == 1
  for backend, where in (("openai", base_url), ("grpc", target(bg))):
    results, duration = asyncio.run(bench.run_benchmark(
        where, convs, concurrency=2, api_key=KEY, backend=backend))
    summary = bench.summarize(results, duration)
    assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
    # Later turns extend earlier ones: most of their prompts come from the cache.
    assert summary["prefix_cache_hit_rate"] > 0.3
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["max"] > 0
    # The demo model writes no tool calls: parse success is undefined, not 0 or 100%.
    assert summary["tool_calls"] == 0 and summary["tool_call_parse_success"] is None
  # Token-id workloads over /v1/completions (token ids come back: return_token_ids).
  convs = bench.make_dataset("multi_turn", 6, vocab_size=8192, max_model_len=256,
                             input_len=16, output_len=8, num_turns=3, seed=1)
  results, duration = asyncio.run(bench.run_benchmark(base_url, convs, 2, api_key=KEY,
                                                      backend="openai"))
  summary = bench.summarize(results, duration)
  assert summary["completed"] == 6 and summary["output_tokens"] == sum(
      sum(c.output_lens) for c in convs)
  assert summary["prefix_cache_hit_rate"] > 0.2
  # Parse success counts calls that name a declared tool with JSON-object arguments.
  good = {"function": {"name": "run_python", "arguments": '{"code": "1"}'}}
  bad = {"function": {"name": "run_python", "arguments": '{"code": '}}
  other = {"function": {"name": "rm_rf", "arguments": "{}"}}
  summary = bench.summarize([bench.Sample(ok=True, tool_calls=[good, bad, other])], 1.0)
  assert summary["tool_calls"] == 3 and summary["tool_call_parse_success"] == pytest.approx(1 / 3)
  # The command line, against the HTTP API.
  r = subprocess.run([sys.executable, "-m", "engine.bench", "--backend=openai",
                      f"--base_url={base_url}", f"--api_key={KEY}", "--dataset=agent",
                      "--num_prompts=4", "--num_turns=2", "--output_len=4", "--concurrency=2"],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary["completed"] == 4 and summary["config"]["backend"] == "openai"
  assert "tool calls (parse success)" in r.stdout and "TTFT" in r.stdout


def test_chat_requests_keep_special_token_text(demo):
  """The engine detokenises a chat request's output with special tokens kept (the parsers
  read the markers); other requests' text skips them, as before."""
  from engine.runtime import outputs
  from engine.runtime.request import Request
  bos = demo.tokenizer.token_to_id("<|bos|>")
  ids = demo.tokenizer.encode("x = 1", add_special_tokens=False).ids
  texts = []
  for skip in (True, False):
    stop = StopParams(max_tokens=16, skip_special_tokens=skip)
    req = Request("r", [5], SamplingParams(), stop, stop_ids=(), arrival_order=0)
    outputs.append_tokens(req, [bos] + ids, None, demo.tokenizer, 128)
    texts.append(outputs.request_output(req, [bos] + ids).text_delta)
  assert texts == ["x = 1", "<|bos|>x = 1"]
