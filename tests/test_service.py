"""The gRPC service end to end, streaming: outputs equal the engine's, bad requests,
cancellation, abort, overload, responsiveness. Real server on localhost, real clients
(harness: `service_harness.py`)."""

from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)


def test_stream_equals_the_engines_direct_output(serve, eng, demo):
  cases = [(PROMPT, SamplingParams(), StopParams(max_tokens=24, ignore_eos=True)),
           ([1, 70, 80, 90, 100], SamplingParams(temperature=0.8, top_p=0.9, seed=3),
            StopParams(max_tokens=20)),
           ("import os\n", SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=9),
            StopParams(max_tokens=30, min_tokens=5))]
  want = [eng.generate([p], s, t)[0] for p, s, t in cases]
  # A stop string from the middle of a known continuation must cut the stream there.
  stop_str = want[0].text[10:13]
  stopped = eng.generate([PROMPT], SamplingParams(), StopParams(max_tokens=24, stop=(stop_str,),
                                                                ignore_eos=True))[0]
  want_lp = eng.generate([PROMPT], SamplingParams(logprobs=3),
                         StopParams(max_tokens=8, ignore_eos=True))[0]
  bg = serve()  # after the direct runs: the server's thread then owns the engine's steps
  with InferenceClient(target(bg)) as client:
    for (p, s, t), ref in zip(cases, want):
      got = client.generate(p, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            min_p=s.min_p, seed=s.seed, max_tokens=t.max_tokens,
                            min_tokens=t.min_tokens, ignore_eos=t.ignore_eos)
      assert got.token_ids == ref.output_ids
      assert got.text == demo.decode(got.token_ids) == ref.text
      assert got.finish_reason == ref.finish_reason
      assert got.completion_tokens == len(ref.output_ids)
      assert got.prompt_tokens == len(ref.prompt_ids)
      assert got.request_id.startswith("req-")  # assigned by the server
      assert 0 <= got.server_timings["ttft_s"] <= got.server_timings["e2e_s"]
    got = client.generate(PROMPT, max_tokens=24, stop=[stop_str], ignore_eos=True,
                          request_id="mine")
    assert (got.request_id, got.finish_reason, got.stop) == ("mine", "stop", stop_str)
    assert got.text == stopped.text == want[0].text[:10]
    # The prefix cache reports cached prompt tokens.
    long = [1] + list(range(100, 140))
    client.generate(long, max_tokens=2)
    assert client.generate(long, max_tokens=2).cached_tokens >= 16
    info = client.model_info()
    assert (info.vocab_size, info.max_model_len, list(info.eos_token_ids)) == (8192, 128, [2])
    assert info.has_tokenizer and info.dtype == "bfloat16" and info.devices
    ids = client.tokenize(PROMPT)
    assert ids == demo.encode(PROMPT) and client.detokenize(ids) == PROMPT
    assert status_of(lambda: client.detokenize([9999]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    load = client.server_load()
    assert load.serving and load.num_requests_waiting == 0
    # Log-probabilities stream with the tokens and equal the engine's.
    got = client.generate(PROMPT, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)
    assert len(got.logprobs) == len(got.token_ids) == 8
    for tok, (lp, top), ref in zip(got.token_ids, got.logprobs, want_lp.output_logprobs):
      assert top[0][0] == tok and lp == pytest.approx(top[0][1]) and len(top) == 3
      assert lp == pytest.approx(ref.logprob, abs=1e-5)
      assert [t for t, _ in top] == [t for t, _ in ref.top]


# ---- validation ----------------------------------------------------------------------------

BAD_REQUESTS = [  # (build_request kwargs, field the error must name)
    (dict(prompt=None), "prompt"),
    (dict(prompt=""), "text"),
    (dict(prompt=[]), "token_ids"),
    (dict(prompt=[1, 8192]), "token_ids.ids"),
    (dict(prompt=[-1]), "token_ids.ids"),
    (dict(prompt=[5] * 128), "prompt"),
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(max_tokens=-5), "sampling.max_tokens"),
    (dict(prompt=[5] * 100, max_tokens=50), "sampling.max_tokens"),
    (dict(max_tokens=10**6), "sampling.max_tokens"),
    (dict(temperature=-0.5), "sampling.temperature"),
    (dict(temperature=math.nan), "sampling.temperature"),
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_p=math.nan), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(min_p=-0.1), "sampling.min_p"),
    (dict(min_p=2.0), "sampling.min_p"),
    (dict(seed=2**32), "sampling.seed"),
    (dict(min_tokens=-1), "sampling.min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
    (dict(stop=["a"] * 9), "sampling.stop"),
    (dict(stop=["ok", ""]), "sampling.stop"),
    (dict(stop=["x" * 300]), "sampling.stop"),
    (dict(stop_token_ids=list(range(3, 23))), "sampling.stop_token_ids"),
    (dict(stop_token_ids=[9000]), "sampling.stop_token_ids"),
    (dict(stop_token_ids=[-3]), "sampling.stop_token_ids"),
    (dict(top_logprobs=5), "sampling.top_logprobs"),  # without logprobs=True
    (dict(logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "sampling.top_logprobs"),
    (dict(drafter="magic"), "speculative.drafter"),
    (dict(drafter="mtp"), "speculative.drafter"),  # not enabled on this server
    (dict(drafter="ngram"), "speculative.drafter"),
    (dict(drafter="auto"), "speculative.drafter"),  # nothing to choose from
    (dict(max_draft_tokens=0), "speculative.max_draft_tokens"),
    (dict(max_draft_tokens=100), "speculative.max_draft_tokens"),
    (dict(request_id="r" * 200), "request_id"),
    (dict(request_id="bad\x00id"), "request_id"),
]


def _bad_request(kwargs):
  kwargs = dict(kwargs)
  prompt = kwargs.pop("prompt", PROMPT)
  if prompt is None:
    req = build_request("x", **kwargs)
    req.ClearField("prompt")
    return req
  return build_request(prompt, **kwargs)


def test_bad_requests_get_invalid_argument_naming_the_field(serve, eng):
  assert len(BAD_REQUESTS) >= 30
  bg = serve()

  async def run():
    async with AsyncInferenceClient(target(bg)) as client:
      async def bad(kwargs):
        try:
          await client.generate(_bad_request(kwargs))
        except grpc.aio.AioRpcError as e:
          return e.code(), e.details()
        return grpc.StatusCode.OK, ""
      good = [client.generate(random_ids(random.Random(i)), max_tokens=16, seed=i,
                              temperature=0.7) for i in range(6)]
      return await asyncio.gather(*good, *[bad(k) for k, _ in BAD_REQUESTS])

  results = asyncio.run(run())
  good, bad = results[:6], results[6:]
  assert all(g.finish_reason in ("stop", "length") and g.token_ids for g in good)
  for (kwargs, field), (code, details) in zip(BAD_REQUESTS, bad):
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (kwargs, code, details)
    assert details.startswith(field + ":"), (kwargs, details)
  # The limits are in the messages, e.g. the context length and the stop-string cap.
  assert "128" in dict(zip([f for _, f in BAD_REQUESTS], [d for _, d in bad]))[
      "sampling.max_tokens"]
  with InferenceClient(target(bg)) as client:
    client.generate(PROMPT, max_tokens=40, request_id="taken", ignore_eos=True)
    # A finished id may be reused; an id in use may not.
    stream = client.stream(PROMPT, max_tokens=100, request_id="busy", ignore_eos=True)
    next(stream)
    code, details = status_of(lambda: client.generate(PROMPT, request_id="busy"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "busy" in details
    stream.cancel()
    assert client.generate(PROMPT, max_tokens=2, request_id="taken").finish_reason == "length"


@pytest.mark.slow
def test_drafter_per_request():
  """A server whose engine enables drafters: each request picks one (or none); the output is
  the plain greedy one, with logprobs if asked; a drafter it lacks is INVALID_ARGUMENT."""
  prompt = "import os\nimport sys\nimport re\nimport json\nimport time\nimport"
  # float32: in bf16 a (k+1)-token verify may round a near-tie apart from 1-token decoding.
  spec = Engine.from_model(moejax.load(DEMO, dtype="float32"), dataclasses.replace(
      ENGINE_CONFIG, drafters=("ngram", "mtp"), num_draft_tokens=3))
  with BackgroundServer(spec, BASE) as bg, InferenceClient(target(bg)) as client:
    want = client.generate(prompt, max_tokens=24, ignore_eos=True, drafter="off")
    for drafter in ("ngram", "mtp", "auto", ""):
      got = client.generate(prompt, max_tokens=24, ignore_eos=True, drafter=drafter)
      assert got.token_ids == want.token_ids, drafter
      if drafter in ("ngram", "mtp", "auto"):
        assert got.spec_accepted_tokens > 0, drafter
      else:
        assert got.spec_draft_tokens == 0
    got = client.generate(prompt, max_tokens=8, drafter="mtp", max_draft_tokens=1)
    assert got.token_ids == want.token_ids[:8]
    got = client.generate(prompt, max_tokens=8, ignore_eos=True, drafter="ngram",
                          logprobs=True, top_logprobs=2)
    assert got.token_ids == want.token_ids[:8] and len(got.logprobs) == 8
    assert all(top[0][0] == tok for tok, (_, top) in zip(got.token_ids, got.logprobs))
    code, details = status_of(lambda: client.generate(prompt, max_tokens=4, drafter="learned"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("speculative.drafter:")
  assert_idle(spec)


# ---- cancellation, abort, overload -----------------------------------------------------------


@pytest.mark.slow
def test_cancelled_streams_abort_once_and_free_pages(serve, eng, monkeypatch):
  n = 200
  bg = serve()
  aborts = collections.Counter()
  abort = eng.abort

  def counting_abort(rid):
    done = abort(rid)
    aborts[rid, done] += 1
    return done

  monkeypatch.setattr(eng, "abort", counting_abort)
  finished_abort = eng.counters["finished_abort"]
  rng = random.Random(0)
  plans = [(rng.choice(["cancel", "deadline", "complete"]), rng.randrange(0, 6),
            rng.uniform(0.005, 0.3)) for _ in range(n)]

  async def run():
    async with AsyncInferenceClient(target(bg)) as client:
      async def one(i, kind, after_chunks, deadline_s):
        req = build_request(random_ids(random.Random(i)), request_id=f"c{i}", max_tokens=24,
                            ignore_eos=True, temperature=0.9, seed=i)
        call = client.stub.Generate(req, timeout=deadline_s if kind == "deadline" else None)
        chunks = 0
        try:
          async for chunk in call:
            chunks += 1
            if chunk.HasField("final"):
              return "finished"
            if kind == "cancel" and chunks > after_chunks:
              call.cancel()
              return "cancelled"
        except grpc.aio.AioRpcError as e:
          return e.code().name
        return "cancelled" if kind == "cancel" else "ended without final"
      return await asyncio.wait_for(asyncio.gather(
          *[one(i, *plan) for i, plan in enumerate(plans)]), timeout=120)

  outcomes = asyncio.run(run())
  bg.call(bg.server.call_engine(lambda: None))  # aborts of ended streams are queued before this
  assert set(outcomes) <= {"finished", "cancelled", "DEADLINE_EXCEEDED", "CANCELLED"}
  assert outcomes.count("finished") >= sum(kind == "complete" for kind, _, _ in plans)
  assert outcomes.count("cancelled") > 20 and outcomes.count("DEADLINE_EXCEEDED") > 10
  assert_idle(eng)
  assert not bg.server.engine_loop.subscribed()
  assert not [rid for rid in eng.requests if rid.startswith("c")]  # released after finishing
  # Each request was aborted at most once, and only requests whose stream ended early.
  assert all(count == 1 for count in aborts.values())
  aborted = {rid for (rid, done), _ in aborts.items() if done}
  assert aborted and all(outcomes[int(rid[1:])] != "finished" for rid in aborted)
  assert eng.counters["finished_abort"] - finished_abort == len(aborted)
  assert bg.server.metrics.client_aborts._value.get() == len(aborted)
  with InferenceClient(target(bg)) as client:
    assert client.health() == "SERVING" == client.health("moejax.v1.Inference")


def test_abort_rpc_ends_the_stream(serve, eng):
  bg = serve()
  with InferenceClient(target(bg)) as client:
    stream = client.stream(PROMPT, max_tokens=100, ignore_eos=True, request_id="to-abort")
    first = next(stream)
    assert first.request_id == "to-abort"
    assert client.abort("to-abort")
    chunks = list(stream)
    assert chunks[-1].final.finish_reason == 3  # FINISH_REASON_ABORT
    assert not client.abort("to-abort") and not client.abort("never-existed")  # idempotent


def test_overload_is_resource_exhausted_and_admitted_requests_complete(serve, eng, monkeypatch):
  bg = serve(max_queue_requests=3, max_queue_tokens=100, max_message_bytes=64 << 10)
  with gated_engine(monkeypatch, eng) as gate, InferenceClient(target(bg)) as client:
    admitted = []

    def send(n_tokens):
      stream = client.stream([5] * n_tokens, max_tokens=8, ignore_eos=True)
      return stream

    for n_tokens, expect in [(40, None), (40, None), (40, "max_queue_tokens"), (5, None),
                             (5, "max_queue_requests")]:
      queued = eng.queue_load().requests
      stream = send(n_tokens)
      if expect is None:
        wait_until(lambda: eng.queue_load().requests == queued + 1, what="admission")
        admitted.append(stream)
      else:
        code, details = status_of(lambda: next(stream))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and expect in details
    load = client.server_load()
    assert (load.num_requests_waiting, load.num_waiting_tokens) == (3, 85)
    # Oversize messages are refused by gRPC itself.
    code, _ = status_of(lambda: client.generate("x" * (100 << 10)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    gate.set()
    for stream in admitted:
      chunks = list(stream)
      assert chunks[-1].final.finish_reason == 2 and sum(len(c.token_ids) for c in chunks) == 8
  rejected = bg.server.metrics.request_rejected.labels(code="RESOURCE_EXHAUSTED")._value.get()
  assert rejected == 2


def test_event_loop_stays_responsive_while_a_step_holds_the_engine(serve, eng, monkeypatch):
  bg = serve()
  gate, step = threading.Event(), eng.step

  def slow_step():  # holds the engine's lock, as a long device step does
    with eng._lock:
      gate.wait()
      return step()

  monkeypatch.setattr(eng, "step", slow_step)
  with InferenceClient(target(bg), timeout=5) as client:
    try:
      first = client.stream(PROMPT, max_tokens=4)
      wait_until(lambda: not eng._lock.acquire(blocking=False) or eng._lock.release(),
                 what="step holding the lock")
      second = client.stream(PROMPT, max_tokens=4)  # its admission waits for the lock ...
      t0 = time.monotonic()
      assert client.health() == "SERVING"  # ... but the event loop does not
      assert client.model_info().vocab_size == 8192
      assert time.monotonic() - t0 < 2
    finally:
      gate.set()
    assert [c.final.usage.completion_tokens for c in (list(first)[-1], list(second)[-1])] == [4, 4]


# ---- lifecycle, auth, errors -------------------------------------------------------------------


# ---- undecodable bytes and heavy inputs ------------------------------------------------------


def _raw_call(channel, method, data, streaming=False):
  """Sends `data` as the request bytes of Inference/`method`; (code, details)."""
  path = f"/moejax.v1.Inference/{method}"
  try:
    if streaming:
      list(channel.unary_stream(path)(data, timeout=30))
    else:
      channel.unary_unary(path)(data, timeout=30)
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


def _with_bad_utf8(request, placeholder):
  """`request`'s bytes with the (ASCII) placeholder string turned into invalid UTF-8."""
  data = request.SerializeToString()
  assert data.count(placeholder.encode()) == 1
  return data.replace(placeholder.encode(), b"\xff" * len(placeholder))


def test_undecodable_requests_get_invalid_argument(serve, eng, caplog):
  from engine.service.proto import inference_pb2 as pb
  bg = serve()
  valid = build_request(PROMPT, stop=["x", "ZZSTOPZZ"]).SerializeToString()
  generate = [
      (_with_bad_utf8(build_request("ZZTEXTZZ"), "ZZTEXTZZ"), "text: not valid UTF-8"),
      (_with_bad_utf8(build_request(PROMPT, stop=["x", "ZZSTOPZZ"]), "ZZSTOPZZ"),
       "sampling.stop[1]: not valid UTF-8"),
      (_with_bad_utf8(build_request(PROMPT, request_id="ZZRIDZZ"), "ZZRIDZZ"),
       "request_id: not valid UTF-8"),
      (_with_bad_utf8(build_request(PROMPT, drafter="ZZDRAFTZZ"), "ZZDRAFTZZ"),
       "speculative.drafter: not valid UTF-8"),
      (b"\xff\xff\xff\xff\xff", "request is not a valid moejax.v1.GenerateRequest message"),
      (valid[:-4], "request is not a valid moejax.v1.GenerateRequest message"),  # truncated
  ]
  with InferenceClient(target(bg)) as client:
    for data, want in generate:
      assert _raw_call(client.channel, "Generate", data, streaming=True) == (
          grpc.StatusCode.INVALID_ARGUMENT, want)
    tokenize = _with_bad_utf8(pb.TokenizeRequest(text="ZZTEXTZZ"), "ZZTEXTZZ")
    assert _raw_call(client.channel, "Tokenize", tokenize) == (
        grpc.StatusCode.INVALID_ARGUMENT, "text: not valid UTF-8")
    for method in ("Tokenize", "Detokenize", "Abort", "GetModelInfo", "GetServerLoad"):
      code, details = _raw_call(client.channel, method, b"\x0a\x05ab")  # truncated field 1
      assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in details, method
    # The server keeps serving, and counted the rejections.
    assert client.generate(PROMPT, max_tokens=3).completion_tokens == 3
  assert 'code="INVALID_ARGUMENT"' in bg.server.metrics.text()
  assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


class _CountingTokenizer:
  def __init__(self, tokenizer):
    self.tokenizer, self.encoded = tokenizer, 0

  def __getattr__(self, name):
    attr = getattr(self.tokenizer, name)
    if name.startswith("encode"):
      def counted(*args, **kwargs):
        self.encoded += 1
        return attr(*args, **kwargs)
      return counted
    return attr


@pytest.mark.slow
def test_a_huge_prompt_is_bounded_and_tokenised_off_the_event_loop(serve, eng, monkeypatch):
  counting = _CountingTokenizer(eng.tokenizer)
  monkeypatch.setattr(eng, "tokenizer", counting)
  bg = serve(max_prompt_chars=1000)
  with InferenceClient(target(bg)) as client:
    code, details = status_of(lambda: client.generate("a " * 600))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("text:") and "1000" in details
    code, details = status_of(lambda: client.tokenize("a " * 600))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("text:")
    assert counting.encoded == 0  # refused before tokenising
  bg.close()
  # A prompt near the 4 MB message cap takes seconds to tokenise: meanwhile health answers
  # and a running stream keeps streaming.
  bg = serve(max_prompt_chars=4 << 20)
  huge = ("def read_config(path):\n    return open(path).read()\n" * 80_000)[:3_900_000]
  with InferenceClient(target(bg), timeout=60) as client:
    running = client.stream(PROMPT, max_tokens=100, ignore_eos=True)
    next(running)
    result = {}
    sender = threading.Thread(target=lambda: result.update(
        done=status_of(lambda: client.generate(huge)), at=time.monotonic()))
    sender.start()
    wait_until(lambda: counting.encoded > 0, what="tokenising")
    health_s, gaps = [], []
    last = time.monotonic()
    for _ in range(4):
      t0 = time.monotonic()
      assert client.health() == "SERVING"
      health_s.append(time.monotonic() - t0)
      next(running)
      gaps.append(time.monotonic() - last)
      last = time.monotonic()
    window_end = time.monotonic()
    sender.join(60)
    # (A tokeniser holding the GIL also ends first: this thread could not run meanwhile.)
    assert result["at"] > window_end, "tokenising did not overlap the checks"
    # Bounds for a loaded 2-core machine; a tokeniser holding the GIL stalls both for seconds.
    assert max(health_s) < 1.0, health_s
    assert max(gaps) < 1.0, gaps
    assert result["done"][0] == grpc.StatusCode.INVALID_ARGUMENT  # longer than the context
    running.cancel()


class _GatedTokenizer:
  """Holds every encode until `gate` opens."""

  def __init__(self, tokenizer):
    self.tokenizer, self.gate, self.waiting = tokenizer, threading.Event(), threading.Event()

  def __getattr__(self, name):
    attr = getattr(self.tokenizer, name)
    if not name.startswith("encode"):
      return attr

    def gated(*args, **kwargs):
      self.waiting.set()
      self.gate.wait(30)
      return attr(*args, **kwargs)
    return gated


def test_abort_of_a_request_still_being_tokenised(serve, eng, monkeypatch):
  """Tokenising happens before the engine knows the request: an Abort meanwhile still ends
  it (right after its add), as it did when tokenising held the event loop."""
  gated = _GatedTokenizer(eng.tokenizer)
  monkeypatch.setattr(eng, "tokenizer", gated)
  bg = serve()
  with InferenceClient(target(bg)) as client:
    stream = client.stream(PROMPT, max_tokens=50, ignore_eos=True, request_id="early")
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    assert gated.waiting.wait(30)
    assert client.abort("early") is True
    gated.gate.set()
    reader.join(30)
    assert chunks[-1].final.finish_reason == 3  # FINISH_REASON_ABORT
    assert sum(len(c.token_ids) for c in chunks) < 50
    assert client.generate(PROMPT, max_tokens=2, request_id="early").completion_tokens == 2
  assert not bg.server.early_aborts and not bg.server.tokenizing
