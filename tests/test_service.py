"""The gRPC service end to end: a real server on an ephemeral localhost port, real clients.

One warm Engine over the bundled demo model (it has a tokenizer) is shared by the module; each
test starts its own server around it (cheap: no warm-up) so configurations can differ. Only one
server runs at a time, and direct `eng.generate` references are computed before it starts: the
server's engine thread must be the only caller of `step()`.
"""

import asyncio
import collections
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

import engine as moejax
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.service import bench
from engine.service import server as server_module
from engine.service.client import AsyncInferenceClient, InferenceClient, build_request
from engine.service.reasoning import ReasoningConfig
from engine.service.background import BackgroundServer
from engine.service.server import ServerConfig, read_api_keys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "checkpoints", "demo", "target")
PROMPT = "def read_config(path):"
# Small limits keep the compiled shape set (and warm-up) small.
ENGINE_CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, row_widths=(32,),
                             max_model_len=128, max_decode_steps=4)
BASE = ServerConfig(port=0, warmup=False, stats_log_interval_s=0)


@pytest.fixture(scope="module")
def demo():
  return moejax.load(DEMO)


@pytest.fixture(scope="module")
def eng(demo):
  e = Engine.from_model(demo, ENGINE_CONFIG)
  e.warmup()
  return e


@pytest.fixture
def serve(eng):
  """serve(**ServerConfig fields) -> a running BackgroundServer, closed after the test."""
  servers = []

  def start(metrics_port=None, wait_ready=True, **overrides):
    bg = BackgroundServer(eng, ServerConfig(**{**BASE.__dict__, **overrides}), metrics_port,
                          wait_ready)
    servers.append(bg)
    return bg

  yield start
  for bg in servers:
    bg.close()
  assert_idle(eng)


def target(bg):
  return f"127.0.0.1:{bg.port}"


def wait_until(pred, timeout=30.0, what="condition"):
  deadline = time.monotonic() + timeout
  while not pred():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


def assert_idle(e):
  """Every request finished and every page back in the pool."""
  wait_until(lambda: not e.has_unfinished() and all(r.finished for r in e.requests.values()),
             what="engine idle")
  e.pool.check_invariants()
  assert e.pool.num_free == e.pool.num_pages - 1


def status_of(fn):
  try:
    fn()
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


@contextlib.contextmanager
def gated_engine(monkeypatch, e):
  """Holds the engine thread before each step until the gate opens: requests stay queued."""
  gate = threading.Event()
  step = e.step
  monkeypatch.setattr(e, "step", lambda: (gate.wait(), step())[1])
  try:
    yield gate
  finally:
    gate.set()


def random_ids(rng, lo=1, hi=60):
  return [rng.randrange(3, 8000) for _ in range(rng.randrange(lo, hi))]


# ---- outputs -------------------------------------------------------------------------------


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
    (dict(drafter="mtp"), "speculative.drafter"),
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


# ---- cancellation, abort, overload -----------------------------------------------------------


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
        req = build_request(random_ids(random.Random(i)), request_id=f"c{i}", max_tokens=48,
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


def test_warmup_drain_health_and_reflection(serve, eng, monkeypatch):
  warm_gate = threading.Event()
  monkeypatch.setattr(eng, "warmup", lambda: warm_gate.wait() and 0)
  bg = serve(warmup=True, wait_ready=False, drain_timeout_s=30)
  wait_until(lambda: bg.port, what="bind")
  with InferenceClient(target(bg)) as client:
    wait_until(lambda: status_of(client.health)[0] == grpc.StatusCode.OK, what="health")
    assert client.health() == "NOT_SERVING"
    code, details = status_of(lambda: client.generate(PROMPT))
    assert code == grpc.StatusCode.UNAVAILABLE and "warming up" in details
    warm_gate.set()
    bg.starting.result(30)
    assert client.health() == "SERVING"
    services = ProtoReflectionDescriptorDatabase(client.channel).get_services()
    assert "moejax.v1.Inference" in services and "grpc.health.v1.Health" in services
    with gated_engine(monkeypatch, eng) as step_gate:
      in_flight = client.stream(PROMPT, max_tokens=12, ignore_eos=True)
      wait_until(lambda: eng.queue_load().requests == 1, what="admission")
      drained = asyncio.run_coroutine_threadsafe(bg.server.drain(), bg.loop)
      wait_until(lambda: client.health() == "NOT_SERVING", what="NOT_SERVING")
      code, details = status_of(lambda: client.generate(PROMPT))
      assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
      step_gate.set()
      chunks = list(in_flight)  # the in-flight request finishes normally
      assert chunks[-1].final.finish_reason == 2
      drained.result(30)
    assert bg.server.state == "stopped"


def test_drain_timeout_ends_late_streams_unavailable(serve, eng, monkeypatch):
  bg = serve(drain_timeout_s=0.3)
  step = eng.step
  monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.05), step())[1])
  with InferenceClient(target(bg)) as client:
    stream = client.stream(PROMPT, max_tokens=100, ignore_eos=True)
    next(stream)
    t0 = time.monotonic()
    bg.call(bg.server.drain())
    assert time.monotonic() - t0 < 5
    code, details = status_of(lambda: list(stream))
    assert code == grpc.StatusCode.UNAVAILABLE and "shut down" in details


def test_api_keys(serve, eng, tmp_path):
  keys_file = tmp_path / "keys"
  keys_file.write_text("# serving keys\nsecret-1\n\nsecret-2\n")
  keys = read_api_keys(str(keys_file))
  assert keys == {"secret-1", "secret-2"}
  bg = serve(api_keys=keys)
  for key in (None, "wrong", "secret-1x", "secret"):
    with InferenceClient(target(bg), api_key=key) as client:
      code, _ = status_of(lambda: client.generate(PROMPT, max_tokens=2))
      assert code == grpc.StatusCode.UNAUTHENTICATED
      assert status_of(client.model_info)[0] == grpc.StatusCode.UNAUTHENTICATED
      assert client.health() == "SERVING"  # probes need no key
  with InferenceClient(target(bg), api_key="secret-2") as client:
    assert client.generate(PROMPT, max_tokens=2).completion_tokens == 2
  empty = tmp_path / "empty"
  empty.write_text("# nothing\n")
  with pytest.raises(ValueError, match="api_keys_file"):
    read_api_keys(str(empty))


def test_internal_errors_fail_only_their_request(serve, eng, monkeypatch):
  bg = serve()
  convert = server_module.response_from_output

  def flaky(out, *args):
    if out.request_id == "boom" and out.new_token_ids:
      raise RuntimeError("injected")
    return convert(out, *args)

  monkeypatch.setattr(server_module, "response_from_output", flaky)

  async def run():
    async with AsyncInferenceClient(target(bg)) as client:
      async def boom():
        try:
          await client.generate(PROMPT, request_id="boom", max_tokens=30)
        except grpc.aio.AioRpcError as e:
          return e.code(), e.details()
      return await asyncio.gather(boom(), client.generate(PROMPT, max_tokens=30,
                                                          ignore_eos=True))

  (code, details), ok = asyncio.run(run())
  assert code == grpc.StatusCode.INTERNAL and "boom" in details
  assert ok.completion_tokens == 30
  # A failing engine step fails the requests in flight, and the server carries on.
  step, failed = eng.step, []

  def failing_step():
    if not failed:
      failed.append(1)
      raise RuntimeError("device lost")
    return step()

  monkeypatch.setattr(eng, "step", failing_step)
  with InferenceClient(target(bg)) as client:
    code, details = status_of(lambda: client.generate(PROMPT, max_tokens=4))
    assert code == grpc.StatusCode.INTERNAL and "device lost" in details
    assert client.generate(PROMPT, max_tokens=4).completion_tokens == 4
    assert client.health() == "SERVING"


# ---- metrics and reasoning ---------------------------------------------------------------------


def test_metrics_endpoint(serve, eng):
  bg = serve(metrics_port=0)
  hits = eng.pool.prefix_hits
  with InferenceClient(target(bg)) as client:
    for _ in range(2):  # the second run finds the first's full page (16 tokens) cached
      client.generate(list(range(100, 120)), max_tokens=8, ignore_eos=True)
  url = f"http://127.0.0.1:{bg.server.metrics_port}/metrics"
  text = urllib.request.urlopen(url, timeout=10).read().decode()
  for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
               "prefix_cache_queries_total", "prefix_cache_hits_total",
               "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
               "e2e_request_latency_seconds_sum", "request_queue_time_seconds_count",
               "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total"):
    assert f"moejax:{name}" in text, name
  assert 'moejax:request_success_total{finished_reason="length"} 2.0' in text
  assert "moejax:e2e_request_latency_seconds_count 2.0" in text
  assert "running=0 waiting=0" in bg.server.stats_line()
  assert eng.pool.prefix_hits - hits == 1
  assert f"moejax:prefix_cache_hits_total {16.0 * eng.pool.prefix_hits}" in text  # tokens


def test_reasoning_parser_splits_deltas(serve, eng, demo):
  free = eng.generate([PROMPT], stop=StopParams(max_tokens=24, ignore_eos=True))[0].output_ids
  end = next(i for i in range(4, len(free)) if free[i] not in free[:i])
  bg = serve(reasoning=ReasoningConfig(think_start_token_id=8191, think_end_token_id=free[end],
                                       starts_in_reasoning=True))
  with InferenceClient(target(bg)) as client:
    chunks = list(client.stream(PROMPT, max_tokens=24, ignore_eos=True))
    info = client.model_info()
  assert info.think_end_token_id == free[end]
  assert [t for c in chunks for t in c.token_ids] == free
  assert sum(c.num_reasoning_tokens for c in chunks) == end + 1
  reasoning = "".join(c.reasoning_text for c in chunks)
  answer = "".join(c.text for c in chunks)
  assert reasoning and answer and reasoning + answer == demo.decode(free)
  timings = chunks[-1].final.timings
  assert 0 < timings.time_to_first_answer_token_s <= timings.e2e_s


# ---- command-line client and benchmark -----------------------------------------------------------


def _run_module(*args):
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


def test_client_and_bench_command_lines(serve, eng):
  want = eng.generate([PROMPT], stop=StopParams(max_tokens=12, ignore_eos=True))[0]
  bg = serve()
  done = _run_module("engine.client", f"--target={target(bg)}", f"--prompt={PROMPT}",
                     "--max_tokens=12", "--ignore_eos", "--json")
  assert done.returncode == 0, done.stderr
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["token_ids"] == want.output_ids and out["text"] == want.text
  assert out["finish_reason"] == "length"
  bad = _run_module("engine.client", f"--target={target(bg)}", "--prompt_ids=1,99999")
  assert bad.returncode == 1 and "INVALID_ARGUMENT: token_ids.ids" in bad.stderr
  bench = _run_module("engine.bench", f"--target={target(bg)}", "--num_prompts=6",
                      "--concurrency=3", "--dataset=shared_prefix", "--output_len=8",
                      "--input_len=16", "--prefix_len=32", "--num_prefixes=1")
  assert bench.returncode == 0, bench.stderr
  summary = json.loads(bench.stdout.strip().splitlines()[-1])
  assert summary["completed"] == 6 and summary["failed"] == 0
  assert summary["prefix_cache_hit_rate"] > 0 and summary["ttft_ms"]["p50"] > 0
  assert "TTFT" in bench.stdout and "requests/s" in bench.stdout


def test_bench_datasets(serve, eng):
  bg = serve()
  for name in ("random", "multi_turn"):
    convs = bench.make_dataset(name, 8, vocab_size=8192, max_model_len=128, input_len=16,
                               output_len=8, num_turns=4, seed=1)
    assert sum(len(c.turns) for c in convs) == 8
    results, duration = asyncio.run(bench.run_benchmark(target(bg), convs, concurrency=4,
                                                        request_rate=200.0, seed=1))
    summary = bench.summarize(results, duration)
    assert summary["completed"] == 8 and summary["output_tokens"] > 8
    assert summary["e2el_ms"]["max"] >= summary["ttft_ms"]["max"] > 0
    if name == "multi_turn":  # follow-up turns reuse the conversation's cached pages
      assert summary["prefix_cache_hit_rate"] > 0.2
    assert "E2EL" in bench.format_table(summary)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
def test_tls(serve, tmp_path):
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                  str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                  "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                 check=True, capture_output=True)
  bg = serve(tls_cert=str(cert), tls_key=str(key))
  with InferenceClient(f"localhost:{bg.port}", root_certificates=cert.read_bytes()) as client:
    assert client.generate(PROMPT, max_tokens=3).completion_tokens == 3
  with InferenceClient(target(bg), timeout=5) as plaintext:
    assert status_of(lambda: plaintext.generate(PROMPT))[0] == grpc.StatusCode.UNAVAILABLE


def test_serve_command_line_starts_serves_and_drains_on_sigterm():
  proc = subprocess.Popen(
      [sys.executable, "-m", "engine.serve", "--port=0", "--host=127.0.0.1",
       "--max_num_seqs=1", "--max_num_batched_tokens=16", "--max_model_len=64",
       "--max_decode_steps=2", "--drain_timeout_s=5"],
      cwd=REPO, stderr=subprocess.PIPE, text=True)
  try:
    lines = []
    for line in proc.stderr:
      lines.append(line)
      if "ready:" in line:
        break
    ready = [l for l in lines if "ready:" in l]
    assert ready, "".join(lines)
    port = int(ready[0].split("127.0.0.1:")[1].split()[0])
    assert any("binding" in l for l in lines)
    with InferenceClient(f"127.0.0.1:{port}") as client:
      assert client.health() == "SERVING"
      assert client.model_info().model_name == "target"
      assert client.generate(PROMPT, max_tokens=4).completion_tokens == 4
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 0 and "stopped" in rest
  finally:
    if proc.poll() is None:
      proc.kill()
