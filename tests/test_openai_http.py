"""The OpenAI-compatible HTTP API end to end: the official `openai` client and raw HTTP against
a live server (gRPC and HTTP in one process, one engine) on the demo model. Harness:
`service_harness.py` (each test starts its own server around the module's warm engine)."""

import http.client
import socket

import openai

from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)

KEY = "test-key"


def http_server(serve, **overrides):
  return serve(http_port=0, model_name="demo", api_keys=frozenset({KEY}), **overrides)


def client_for(bg, key=KEY):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{bg.server.http_port}/v1", api_key=key,
                       max_retries=0, timeout=120)


def raw(bg, method, path, body=None, key=KEY, headers=None):
  """(status, parsed JSON or text) of one plain HTTP request."""
  conn = http.client.HTTPConnection("127.0.0.1", bg.server.http_port, timeout=120)
  hdrs = {"content-type": "application/json", **(headers or {})}
  if key:
    hdrs["authorization"] = f"Bearer {key}"
  data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
  conn.request(method, path, data, hdrs)
  resp = conn.getresponse()
  text = resp.read().decode()
  conn.close()
  try:
    return resp.status, json.loads(text)
  except ValueError:
    return resp.status, text


def sse_events(text):
  """The JSON objects of an SSE body, and whether it ended with [DONE]."""
  lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
  done = bool(lines) and lines[-1] == "[DONE]"
  return [json.loads(line) for line in lines if line != "[DONE]"], done


def test_completions_equal_the_engines_output(serve, eng, demo):
  greedy = eng.generate([PROMPT], SamplingParams(), StopParams(max_tokens=12, ignore_eos=True))[0]
  ids_prompt = [1, 70, 80, 90, 100]
  sampled = eng.generate([ids_prompt], SamplingParams(temperature=0.8, top_p=0.9, seed=3),
                         StopParams(max_tokens=10))[0]
  with_lp = eng.generate([PROMPT], SamplingParams(logprobs=2),
                         StopParams(max_tokens=6, ignore_eos=True))[0]
  bg = http_server(serve)
  client = client_for(bg)
  assert [m.id for m in client.models.list().data] == ["demo"]
  got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
  assert got.choices[0].text == greedy.text and got.choices[0].finish_reason == "length"
  assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(greedy.prompt_ids), 12)
  assert got.usage.total_tokens == len(greedy.prompt_ids) + 12 and got.id.startswith("cmpl-")
  # Token-id prompts, top_p and a seed: the engine's own sampled continuation.
  got = client.completions.create(model="demo", prompt=ids_prompt, max_tokens=10,
                                  temperature=0.8, top_p=0.9, seed=3)
  assert got.choices[0].text == sampled.text
  assert got.choices[0].finish_reason == sampled.finish_reason
  # Streaming gives the same text, then a usage chunk, then [DONE].
  stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                     stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})
  chunks = list(stream)
  assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy.text
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  # Logprobs: per token, top alternatives, as the engine computes them.
  got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
  lp = got.choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == 6 == len(lp.top_logprobs)
  assert "".join(lp.tokens) == got.choices[0].text
  for value, ref in zip(lp.token_logprobs, with_lp.output_logprobs):
    assert value == pytest.approx(ref.logprob, abs=1e-5)
  assert all(len(top) == 2 for top in lp.top_logprobs)
  assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
  # n choices sample with seed + j: seeded requests repeat, the choices differ.
  a = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, n=3, seed=5,
                                temperature=1.0)
  b = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, n=3, seed=5,
                                temperature=1.0)
  assert sorted(c.index for c in a.choices) == [0, 1, 2]
  assert [c.text for c in a.choices] == [c.text for c in b.choices]
  assert len({c.text for c in a.choices}) > 1
  assert a.usage.prompt_tokens == len(greedy.prompt_ids)  # the prompt counts once
  # A batch of prompts: choice index = prompt * n + j.
  got = client.completions.create(model="demo", prompt=[PROMPT, "import os\n"], max_tokens=4,
                                  temperature=0, n=2)
  assert [c.index for c in got.choices] == [0, 1, 2, 3]
  assert got.choices[0].text == got.choices[1].text == greedy.text[:len(got.choices[0].text)]
  # Stop strings cut the text.
  stop = greedy.text[5:8]
  got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
  assert got.choices[0].text == greedy.text[:5] and got.choices[0].finish_reason == "stop"
  # The gRPC API of the same process serves the same engine.
  with InferenceClient(target(bg), api_key=KEY) as grpc_client:
    assert grpc_client.generate(PROMPT, max_tokens=12, ignore_eos=True).text == greedy.text


def test_bad_requests_are_400_naming_the_field(serve, eng):
  bg = http_server(serve)
  good = {"model": "demo", "prompt": PROMPT, "max_tokens": 4}
  cases = [
      (b"{not json", "body"), (b"[1, 2]", "body"),
      ({**good, "model": "gpt-9"}, "model"), ({**good, "temperature": "hot"}, "temperature"),
      ({**good, "max_tokens": "5"}, "max_tokens"), ({**good, "max_tokens": 0}, "max_tokens"),
      ({**good, "max_tokens": 1000}, "max_tokens"), ({**good, "prompt": 5}, "prompt"),
      ({**good, "prompt": ""}, "prompt"), ({**good, "prompt": [1, 99999]}, "prompt"),
      ({**good, "top_p": 0}, "top_p"), ({**good, "n": 0}, "n"), ({**good, "stream": "yes"}, "stream"),
      ({**good, "stop": [1]}, "stop"), ({**good, "logprobs": 50}, "logprobs"),
      ({**good, "stream_options": {"include_usage": True}}, "stream_options"),
      ({**good, "echo": True}, "echo"), ({**good, "presence_penalty": 0.5}, "presence_penalty"),
      ({**good, "seed": -1}, "seed"), ({k: v for k, v in good.items() if k != "prompt"}, "prompt"),
  ]
  for body, field in cases:
    status, err = raw(bg, "POST", "/v1/completions", body)
    assert status == 400, (body, err)
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == field and err["error"]["message"].startswith(field), err
    assert err["error"]["type"] == "invalid_request_error"
  client = client_for(bg)
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
  assert e.value.param == "model" and e.value.code == "model_not_found"
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=-1)
  assert e.value.param == "temperature"
  # The demo model's own chat template has no tool calling: it refuses tools.
  status, err = raw(bg, "POST", "/v1/chat/completions", {
      "model": "demo", "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]})
  assert status == 400 and err["error"]["param"] == "tools"
  assert "the demo model has no tool calling" in err["error"]["message"]
  status, _ = raw(bg, "POST", "/v1/completions", b"x" * (bg.server.config.max_message_bytes + 1))
  assert status == 413
  status, err = raw(bg, "GET", "/v1/nothing")
  assert status == 404 and err["error"]["type"] == "invalid_request_error"
  assert raw(bg, "GET", "/v1/completions")[0] == 405
  # The server is unharmed.
  assert client.completions.create(model="demo", prompt=PROMPT, max_tokens=2).usage
  assert bg.server.metrics.request_rejected.labels(code="INVALID_ARGUMENT")._value.get() >= 20


def test_api_keys_health_and_models(serve, eng):
  bg = http_server(serve)
  assert raw(bg, "GET", "/health", key=None) == (200, {"status": "ok"})  # probes need no key
  for key in (None, "wrong", KEY + "x"):
    status, err = raw(bg, "GET", "/v1/models", key=key)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    status, _ = raw(bg, "POST", "/v1/completions", {"model": "demo", "prompt": "x"}, key=key)
    assert status == 401
  with pytest.raises(openai.AuthenticationError):
    client_for(bg, key="wrong").models.list()
  status, models = raw(bg, "GET", "/v1/models")
  assert status == 200 and models["data"][0]["id"] == "demo"
  assert models["data"][0]["max_model_len"] == 128
  assert client_for(bg).models.retrieve("demo").id == "demo"
  with pytest.raises(openai.NotFoundError):
    client_for(bg).models.retrieve("other")
  # Prometheus metrics on the API's port too, counting the refusals above.
  status, text = raw(bg, "GET", "/metrics", key=None)
  assert status == 200 and 'moejax:request_rejected_total{code="UNAUTHENTICATED"' in text


def test_full_queue_is_429_and_admitted_requests_complete(serve, eng, monkeypatch):
  bg = http_server(serve)
  bg.server.config = dataclasses.replace(bg.server.config, max_queue_requests=1)
  client = client_for(bg)
  with gated_engine(monkeypatch, eng) as gate:
    first = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, stream=True)
    wait_until(lambda: eng.queue_load().requests == 1, what="admission")
    with pytest.raises(openai.RateLimitError) as e:
      client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
    assert "queue full" in e.value.message
    # n choices are admitted all or none: 2 more requests do not fit either.
    status, err = raw(bg, "POST", "/v1/completions", {"model": "demo", "prompt": "x", "n": 2})
    assert status == 429 and err["error"]["type"] == "rate_limit_error"
    gate.set()
    assert sum(len(c.choices[0].text) > 0 for c in first if c.choices) >= 1
  assert bg.server.metrics.request_rejected.labels(code="RESOURCE_EXHAUSTED")._value.get() == 2


def open_stream(bg, body):
  """A streaming request on its own connection; returns it after the first event."""
  conn = http.client.HTTPConnection("127.0.0.1", bg.server.http_port, timeout=60)
  conn.request("POST", "/v1/completions", json.dumps(body).encode(),
               {"content-type": "application/json", "authorization": f"Bearer {KEY}"})
  resp = conn.getresponse()
  assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
  assert resp.readline().startswith(b"data: {")
  return conn


def test_client_disconnect_aborts_and_frees_pages(serve, eng, monkeypatch):
  bg = http_server(serve)
  aborted = []
  abort = eng.abort
  monkeypatch.setattr(eng, "abort", lambda rid: (aborted.append(rid), abort(rid))[1])
  step = eng.step
  monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.02), step())[1])
  body = {"model": "demo", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True,
          "stream": True, "n": 2}
  conns = [open_stream(bg, body) for _ in range(2)]
  wait_until(lambda: len(bg.server.engine_loop.subscribed()) == 4, what="4 requests running")
  for conn in conns:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
  wait_until(lambda: len(aborted) == 4, what="aborts")
  assert_idle(eng)
  assert not bg.server.engine_loop.subscribed()
  assert bg.server.metrics.client_aborts._value.get() == 4
  # A non-streaming request whose client goes away is aborted too.
  sock = socket.create_connection(("127.0.0.1", bg.server.http_port))
  payload = json.dumps({**body, "stream": False, "n": 1}).encode()
  sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: "
               + str(len(payload)).encode() + b"\r\n\r\n" + payload)
  wait_until(lambda: len(bg.server.engine_loop.subscribed()) == 1, what="admission")
  sock.close()
  wait_until(lambda: len(aborted) == 5, what="abort")
  assert_idle(eng)
  assert bg.server.metrics.client_aborts._value.get() == 5


def test_warming_up_and_draining_are_503(serve, eng, monkeypatch):
  warm_gate = threading.Event()
  monkeypatch.setattr(eng, "warmup", lambda: warm_gate.wait() and 0)
  bg = http_server(serve, warmup=True, wait_ready=False, drain_timeout_s=30)
  wait_until(lambda: bg.server.http_port, what="bind")
  status, err = raw(bg, "GET", "/health")
  assert status == 503 and "warming up" in err["error"]["message"]
  status, err = raw(bg, "POST", "/v1/completions", {"model": "demo", "prompt": PROMPT})
  assert status == 503 and "warming up" in err["error"]["message"]
  # Readiness: every endpoint but /metrics answers 503 until warm, /v1/models included (a
  # client polling it for readiness does not start too early), each in its API's shape.
  status, err = raw(bg, "GET", "/v1/models")
  assert status == 503 and err["error"]["type"] == "service_unavailable"
  status, err = raw(bg, "POST", "/v1/messages", {"model": "demo", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "x"}]})
  assert status == 503 and err["type"] == "error" and err["error"]["type"] == "overloaded_error"
  assert raw(bg, "POST", "/tokenize", {"prompt": "x"})[0] == 503
  assert raw(bg, "GET", "/metrics", key=None)[0] == 200
  warm_gate.set()
  bg.starting.result(30)
  assert raw(bg, "GET", "/health")[0] == 200
  assert raw(bg, "GET", "/v1/models")[0] == 200
  with gated_engine(monkeypatch, eng) as step_gate:
    conn = http.client.HTTPConnection("127.0.0.1", bg.server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "demo", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}).encode(),
        {"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    wait_until(lambda: eng.queue_load().requests == 1, what="admission")
    drained = asyncio.run_coroutine_threadsafe(bg.server.drain(), bg.loop)
    wait_until(lambda: bg.server.state == "draining", what="draining")
    status, err = raw(bg, "POST", "/v1/completions", {"model": "demo", "prompt": PROMPT})
    assert status == 503 and "draining" in err["error"]["message"]
    assert raw(bg, "GET", "/health")[0] == 503
    step_gate.set()
    resp = conn.getresponse()  # the in-flight request finishes normally
    assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 6
    drained.result(30)
  assert bg.server.state == "stopped"


def test_failures_after_the_status_arrive_as_error_events(serve, eng, monkeypatch):
  bg = http_server(serve, drain_timeout_s=0.3)
  client = client_for(bg)
  # A failing engine step fails the requests in flight (500 before the status is sent, an
  # error event after it) and the server carries on.
  step = eng.step
  failures = armed_step_failures(monkeypatch, eng, bg.server.engine_loop)
  failures.append(1)
  with pytest.raises(openai.InternalServerError) as e:
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
  assert "device lost" in e.value.message
  assert bg.server.metrics.request_rejected.labels(code="INTERNAL")._value.get() == 0
  failures.append(1)
  status, text = raw(bg, "POST", "/v1/completions", {"model": "demo", "prompt": PROMPT,
                                                     "max_tokens": 4, "stream": True})
  events, done = sse_events(text)
  assert status == 200 and done and "device lost" in events[-1]["error"]["message"]
  assert client.completions.create(model="demo", prompt=PROMPT, max_tokens=4).usage
  # Drain: a stream still running when drain_timeout_s ends gets a 503-shaped error event.
  monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.05), step())[1])
  stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=100,
                                     stream=True, extra_body={"ignore_eos": True})
  next(iter(stream))
  bg.call(bg.server.drain())
  with pytest.raises(openai.APIError) as e:
    list(stream)
  assert "shut down before it finished" in e.value.message
  assert_idle(eng)


def test_parsing_and_tokenising_run_off_the_event_loop(serve, eng, monkeypatch):
  from engine.service import openai_protocol
  bg = http_server(serve)
  gate, entered = threading.Event(), threading.Event()
  parse = openai_protocol.parse_completion

  def slow_parse(*args):  # as a multi-megabyte prompt's tokenising would be
    entered.set()
    gate.wait(30)
    return parse(*args)

  monkeypatch.setattr(openai_protocol, "parse_completion", slow_parse)
  result = []
  worker = threading.Thread(target=lambda: result.append(raw(
      bg, "POST", "/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 2})))
  worker.start()
  try:
    assert entered.wait(30)
    assert raw(bg, "GET", "/health", key=None)[0] == 200  # the loop serves meanwhile
    assert raw(bg, "GET", "/v1/models")[0] == 200
    with InferenceClient(target(bg), api_key=KEY, timeout=10) as client:
      assert client.generate(PROMPT, max_tokens=2).completion_tokens == 2
  finally:
    gate.set()
    worker.join(60)
  assert result[0][0] == 200 and result[0][1]["usage"]["completion_tokens"] == 2
