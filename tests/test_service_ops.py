"""The gRPC service end to end, operations: warm-up/drain/health/reflection, API keys, TLS,
per-request INTERNAL, metrics, reasoning split, the command lines (eagle3 too; harness:
`service_harness.py`)."""

from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as pb_reflection  # v1's messages on the wire

from engine.service.engine_loop import EngineLoop
from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)


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
    # The same over reflection v1 (what current grpcurl asks first), describing itself too.
    v1 = reflection_v1(client.channel, [
        pb_reflection.ServerReflectionRequest(list_services=""),
        pb_reflection.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection")])
    names = {s.name for s in v1[0].list_services_response.service}
    assert {"moejax.v1.Inference", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection"} <= names
    (raw,) = v1[1].file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(raw).package == "grpc.reflection.v1"
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


def reflection_v1(channel, requests):
  """The responses of grpc.reflection.v1's ServerReflectionInfo to `requests`."""
  call = channel.stream_stream(
      "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
      request_serializer=pb_reflection.ServerReflectionRequest.SerializeToString,
      response_deserializer=pb_reflection.ServerReflectionResponse.FromString)
  return list(call(iter(requests), timeout=30))


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
  convert = servicer_module.response_from_output

  def flaky(out, *args):
    if out.request_id == "boom" and out.new_token_ids:
      raise RuntimeError("injected")
    return convert(out, *args)

  monkeypatch.setattr(servicer_module, "response_from_output", flaky)

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
  armed_step_failures(monkeypatch, eng, bg.server.engine_loop).append(1)
  with InferenceClient(target(bg)) as client:
    code, details = status_of(lambda: client.generate(PROMPT, max_tokens=4))
    assert code == grpc.StatusCode.INTERNAL and "device lost" in details
    assert client.generate(PROMPT, max_tokens=4).completion_tokens == 4
    assert client.health() == "SERVING"
    # A replica that stops serving (a lost host of a multi-host replica) fails its streams
    # retryable: UNAVAILABLE, which a gateway may retry elsewhere.
    stream = client.stream(PROMPT, max_tokens=100, ignore_eos=True)
    next(stream)
    bg.server.engine_loop.fail_all("the replica stopped serving", retryable=True)
    code, details = status_of(lambda: list(stream))
    assert code == grpc.StatusCode.UNAVAILABLE and "stopped serving" in details


def test_engine_loop_stop_leaves_the_engine_idle(eng, monkeypatch):
  """An abort that lands while the loop's last step holds the engine (as `fail_all` from
  another thread can) is carried out by stop(), and a request still subscribed is aborted."""
  loop = EngineLoop(eng)
  stop = StopParams(max_tokens=60, ignore_eos=True)
  late, left = eng.add_request(PROMPT, stop=stop), eng.add_request(PROMPT, stop=stop)
  got = collections.defaultdict(list)
  for rid in (late, left):
    loop.subscribe(rid, got[rid].append)
  step = eng.step

  def last_step():
    outputs = step()
    with eng._lock:  # as if the step still ran: the abort waits in the inbox
      aborter = threading.Thread(target=eng.abort, args=(late,))
      aborter.start()
      aborter.join()
      assert late in eng._aborts
    loop._stop.set()
    return outputs

  monkeypatch.setattr(eng, "step", last_step)
  loop.start()
  loop._thread.join()
  assert eng.has_unfinished()  # the queued abort and the running request
  loop.stop()
  for rid in (late, left):
    assert got[rid][-1].finished and got[rid][-1].finish_reason == "abort"
  assert_idle(eng)


# ---- metrics and reasoning ---------------------------------------------------------------------


def test_metrics_endpoint(serve, eng):
  bg = serve(metrics_port=0, model_name="demo")
  hits = eng.pool.prefix_hits
  with InferenceClient(target(bg)) as client:
    for _ in range(2):  # the second run finds the first's full page (16 tokens) cached
      client.generate(list(range(100, 120)), max_tokens=8, ignore_eos=True)
  # The listener follows the server's host (127.0.0.1 here), not every interface.
  assert bg.server.metrics_address == "127.0.0.1"
  with pytest.raises(OSError):
    urllib.request.urlopen(f"http://127.0.0.2:{bg.server.metrics_port}/metrics", timeout=10)
  url = f"http://127.0.0.1:{bg.server.metrics_port}/metrics"
  text = urllib.request.urlopen(url, timeout=10).read().decode()
  for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
               "prefix_cache_queries_total", "prefix_cache_hits_total",
               "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
               "e2e_request_latency_seconds_sum", "request_queue_time_seconds_count",
               "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total",
               "request_prefill_time_seconds_count", "request_decode_time_seconds_sum",
               "request_prompt_tokens_bucket", "request_generation_tokens_sum"):
    assert f"moejax:{name}" in text, name
  # Every sample carries the model's name (vLLM's label).
  samples = [line for line in text.splitlines() if line and not line.startswith("#")]
  assert samples and all('model_name="demo"' in line for line in samples)
  assert ('moejax:request_success_total{finished_reason="length",model_name="demo"} 2.0'
          in text)
  assert 'moejax:e2e_request_latency_seconds_count{model_name="demo"} 2.0' in text
  assert 'moejax:request_prompt_tokens_sum{model_name="demo"} 40.0' in text
  assert 'moejax:request_generation_tokens_sum{model_name="demo"} 16.0' in text
  assert ('moejax:request_generation_tokens_bucket{le="10.0",model_name="demo"} 2.0' in text)
  assert 'moejax:request_decode_time_seconds_count{model_name="demo"} 2.0' in text
  assert "running=0 waiting=0" in bg.server.stats_line()
  assert eng.pool.prefix_hits - hits == 1
  assert (f'moejax:prefix_cache_hits_total{{model_name="demo"}} {16.0 * eng.pool.prefix_hits}'
          in text)  # tokens


def test_speculative_metrics_by_drafter_and_k():
  from engine.service.metrics import ServingMetrics
  stats = dict(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0.0,
               prompt_tokens=0, generation_tokens=0, num_preemptions=0,
               prefix_cache_queries=0, prefix_cache_hits=0, images_encoded=0,
               prefix_cache_hits_lacking_drafter_entries=2,
               encoder_cache_queries=0, encoder_cache_hits=0, image_encode_seconds=0.0,
               spec_steps=10, spec_drafted=30, spec_accepted=20,
               spec_steps_ngram=6, spec_drafted_ngram=18, spec_accepted_ngram=15,
               spec_steps_mtp=4, spec_drafted_mtp=12, spec_accepted_mtp=5,
               spec_k0_loops=3, spec_k4_loops=7, spec_mean_accepted_length_ngram=3.5,
               spec_pos0_drafted=10, spec_pos0_accepted=8, spec_pos1_drafted=9,
               spec_pos1_accepted=5, spec_pos0_estimate_ngram=0.8,
               spec_pos1_estimate_ngram=0.55, spec_model_expected_tokens=40.5,
               spec_model_emitted_tokens=38.0, spec_cost_break_even=8,
               spec_cost_table={"measured": True, "b1": {0: 1.0}})
  text = ServingMetrics(lambda: stats, page_size=16, model_name="m").text()
  samples = [line for line in text.splitlines() if line and not line.startswith("#")]
  assert samples and all('model_name="m"' in line for line in samples)
  # Label names print sorted: drop model_name wherever it stands.
  for label in ('{model_name="m"}', 'model_name="m",', ',model_name="m"'):
    text = text.replace(label, "")
  for line in ('moejax:prefix_cache_hits_lacking_drafter_entries_total 32.0',  # (pages: tokens)
               'moejax:spec_decode_num_drafts_total 10.0',
               'moejax:spec_decode_num_accepted_tokens_by_drafter_total{drafter="ngram"} 15.0',
               'moejax:spec_decode_num_draft_tokens_by_drafter_total{drafter="mtp"} 12.0',
               'moejax:spec_decode_loop_iterations_total{k="4"} 7.0',
               'moejax:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 5.0',
               'moejax:spec_decode_num_draft_tokens_per_pos_total{position="0"} 10.0',
               'moejax:spec_decode_acceptance_estimate{drafter="ngram",position="1"} 0.55',
               'moejax:spec_decode_model_total{quantity="expected_tokens"} 40.5',
               'moejax:spec_decode_model_total{quantity="emitted_tokens"} 38.0',
               'moejax:spec_decode_break_even_batch 8.0'):
    assert line in text, line
  # Per-position keys are not mistaken for drafters.
  assert 'drafter="pos' not in text


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
  # The end marker is a completion token, not a reasoning one.
  assert sum(c.num_reasoning_tokens for c in chunks) == end
  assert chunks[-1].final.usage.reasoning_tokens == end
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
  # --stop's backslash escapes are decoded (a shell passes "\n" as two characters).
  cut = want.text.index("\n") + 1
  stopped = _run_module("engine.client", f"--target={target(bg)}", f"--prompt={PROMPT}",
                        "--max_tokens=12", "--ignore_eos", "--json", "--stop=\\n")
  out = json.loads(stopped.stdout.strip().splitlines()[-1])
  assert out["finish_reason"] == "stop" and out["stop"] == "\n"
  assert out["text"] == want.text[:cut - 1]
  info = _run_module("engine.client", f"--target={target(bg)}", "--info")
  _, end = json.JSONDecoder().raw_decode(info.stdout)
  load = json.loads(info.stdout[end:])
  assert load["numRequestsRunning"] == 0 and int(load["numPreemptions"]) == 0  # zeros printed
  listed = _run_module("engine.client", f"--target={target(bg)}", "--list")
  assert "moejax.v1.Inference\n  moejax.v1.Inference.Generate\n" in listed.stdout
  assert "  grpc.health.v1.Health.Check" in listed.stdout
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


@pytest.mark.slow
def test_serve_command_line_serves_every_drafter_and_drains_on_sigterm():
  """`python -m engine.serve` on the demo target, float32: `--speculative=eagle3` takes the
  demo's default head (checkpoints/demo/eagle3: no --eagle3_checkpoint), `--drafters` adds the
  draft model (--draft_checkpoint) and n-gram lookup. It starts without library noise, serves
  gRPC and the OpenAI HTTP API; greedy completions with eagle3 (the default), the draft model
  and n-gram lookup (each request's choice) are the same server's with drafter "off" (the
  plain decode loop, compiled at warm-up); usage and /metrics count eagle3's drafts; SIGTERM
  drains both APIs and exits 0. (One server for all of it: a server's start, load and warm-up
  are most of such a test's time.)"""
  proc = subprocess.Popen(
      [sys.executable, "-m", "engine.serve", "--port=0", "--host=127.0.0.1", "--http_port=0",
       "--dtype=float32", "--speculative=eagle3", "--drafters=draft,ngram",
       "--draft_checkpoint=" + os.path.join(REPO, "checkpoints", "demo", "draft"),
       "--num_draft_tokens=3", "--max_num_seqs=1", "--max_num_batched_tokens=16",
       "--max_model_len=64", "--max_decode_steps=4", "--decode_batch_sizes=1",
       "--drain_timeout_s=5", "--nomeasure_spec_costs", "--nostructured_warmup",
       "--stats_log_interval_s=0"],
      cwd=REPO, stderr=subprocess.PIPE, text=True)
  try:
    lines, port, http_url = read_until_ready(proc)
    # No library INFO lines (orbax's, JAX's backend probing: "Failed to open libtpu.so").
    assert not any("libtpu" in l or "orbax" in l.lower() for l in lines), "".join(lines)
    assert any("binding" in l for l in lines)
    with InferenceClient(f"127.0.0.1:{port}") as client:
      assert client.health() == "SERVING"
      assert client.model_info().model_name == "target"
      assert client.generate(PROMPT, max_tokens=4).completion_tokens == 4
      prompts = [client.tokenize(t) for t in (PROMPT, "import os\nimport sys\n")]
      want = [client.generate(p, max_tokens=24, ignore_eos=True, drafter="off")
              for p in prompts]
      assert all(w.spec_draft_tokens == 0 for w in want)
      want = [list(w.token_ids) for w in want]
      got = client.generate(prompts[0], max_tokens=24, ignore_eos=True)  # eagle3, the default
      # Requests may choose the draft model or n-gram lookup (a fixed draft length: rows
      # draft whatever the cost table says; whether drafting pays is not this test's question).
      by_draft = client.generate(prompts[0], max_tokens=24, ignore_eos=True, drafter="draft")
      by_ngram = client.generate(prompts[0], max_tokens=24, ignore_eos=True, drafter="ngram")
    assert got.token_ids == want[0] and by_draft.token_ids == want[0]
    assert by_ngram.token_ids == want[0]
    assert got.spec_draft_tokens > 0 and got.spec_accepted_tokens <= got.spec_draft_tokens
    assert by_draft.spec_draft_tokens > 0
    # The OpenAI HTTP API of the same process (SIGTERM below must still drain it).
    req = urllib.request.Request(http_url + "/completions", json.dumps(
        {"model": "target", "prompt": prompts[1], "max_tokens": 24, "ignore_eos": True,
         "temperature": 0, "return_token_ids": True}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
      body = json.load(resp)
    assert body["choices"][0]["token_ids"] == want[1]
    assert body["usage"]["completion_tokens"] == 24
    metrics = urllib.request.urlopen(http_url.rsplit("/v1", 1)[0] + "/metrics",
                                     timeout=30).read().decode()
    drafted = [line for line in metrics.splitlines() if line.startswith(
        "moejax:spec_decode_num_draft_tokens_by_drafter_total") and 'drafter="eagle3"' in line]
    assert drafted and float(drafted[0].split()[-1]) >= got.spec_draft_tokens, metrics
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "stopped" in rest
  finally:
    if proc.poll() is None:
      proc.kill()


def read_until_ready(proc):
  """A served subprocess' stderr up to its "ready:" line -> (lines, gRPC port, HTTP API URL)."""
  lines = []
  for line in proc.stderr:
    lines.append(line)
    if "ready:" in line:
      break
  ready = [l for l in lines if "ready:" in l]
  assert ready, "".join(lines)
  port = int(ready[0].split("127.0.0.1:")[1].split()[0])
  return lines, port, ready[0].split("OpenAI HTTP API on ")[1].split()[0].rstrip(",)")
