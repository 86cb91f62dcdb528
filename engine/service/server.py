"""The gRPC server (`moejax.v1.Inference`, grpc.aio) over one `Engine`.

Data flow: a `Generate` call is authorised, validated (`validation.parse_generate`: INVALID
_ARGUMENT naming the field), admitted against the queue caps (RESOURCE_EXHAUSTED), subscribed
to the engine thread and added to the engine. The engine thread (`EngineLoop`) steps while
there is work and sleeps on an event otherwise; each step's `RequestOutput`s are handed to the
owning stream's asyncio queue with `loop.call_soon_threadsafe`, and the stream turns them into
`GenerateResponse`s. A stream that ends before its request (client cancel, deadline, error)
aborts the request once, which frees its pages at once.

With `ServerConfig.http_port`, the OpenAI-compatible HTTP API (`openai_http.OpenAIHTTP`) runs
in the same event loop over the same engine thread, admission, keys (`key_ok`), metrics and
drain; `Chat` and `/v1/chat/completions` share `chat.py`, every edge shares
`streams.RequestGroup` (admission, delivery, abort on exit).

Lifecycle: health is NOT_SERVING until warm-up ends; `drain()` flips it back, refuses new
requests with UNAVAILABLE, lets in-flight ones finish for `drain_timeout_s`, ends the rest with
UNAVAILABLE, then stops.

Request bytes are parsed by `wire` (undecodable bytes: INVALID_ARGUMENT naming the field, not
a traceback). Tokenising (seconds for a multi-megabyte prompt, bounded by `max_prompt_chars`)
runs on the `tokenize_calls` threads, through the tokenizer's GIL-releasing batch calls.
`Engine.add_request` and `abort` never wait for a device step (they land in the engine's inbox,
applied at the next step); the event loop hands them, in order, to one `engine_calls` thread:
being one FIFO thread keeps the queue-cap check + add atomic, and an abort after its add.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hmac
import time
from typing import Any, Callable

import grpc
from absl import logging
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.runtime.engine import Engine
from engine.chat import markup as chat_markup
from engine.chat.reasoning import ReasoningConfig
from engine.service import chat, reflection, structured, validation, wire
from engine.service.engine_loop import EngineLoop
from engine.service.metrics import ServingMetrics
from engine.service.openai_http import OpenAIHTTP
from engine.service.proto import inference_pb2 as pb
from engine.service.servicer import InferenceServicer
from engine.service.streams import Rejected

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  host: str = "127.0.0.1"
  port: int = 50051  # 0: any free port (start() returns it)
  http_port: int | None = None  # the OpenAI-compatible HTTP API (None: off; 0: any free port)
  metrics_host: str | None = None  # the /metrics listener's address (None: `host`)
  model_name: str = ""
  architecture: str = ""
  max_queue_requests: int = 256  # waiting (not yet running) requests
  max_queue_tokens: int = 1 << 18  # their prompt tokens not yet prefilled
  drain_timeout_s: float = 30.0
  api_keys: frozenset[str] = frozenset()  # empty: no authentication
  tls_cert: str | None = None  # PEM paths; both or neither
  tls_key: str | None = None
  max_message_bytes: int = 4 << 20  # larger requests fail with RESOURCE_EXHAUSTED (gRPC core)
  max_stop_strings: int = 8
  max_prompt_chars: int = 1 << 20  # longer text prompts are refused before tokenising
  keepalive_time_ms: int = 30_000
  keepalive_timeout_ms: int = 10_000
  min_ping_interval_ms: int = 10_000  # clients pinging more often collect strikes
  max_ping_strikes: int = 2
  stats_log_interval_s: float = 10.0  # one-line stats log (0: off)
  reasoning: ReasoningConfig | None = None
  # Chat output parser family (engine.chat.markup.FAMILY_NAMES; None: the chat template's tool
  # markup decides, else the model type).
  chat_parser: str | None = None
  warmup: bool = True  # compile every bucket before reporting SERVING
  # Image inputs of chat requests (`images.py`): per request, per image file, per image.
  max_images_per_request: int = 8
  max_image_bytes: int = 8 << 20
  max_image_pixels: int = 4096 * 4096
  allow_image_urls: bool = False  # fetch http(s) image URLs (off: refused with 400)
  image_url_timeout_s: float = 10.0
  responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (0: none)
  request_log: bool = False  # one log line per request (id, API, tokens, TTFT, time, finish)

  def grpc_options(self) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            ("grpc.so_reuseport", 0)]  # a second server on a busy port must fail, not share


def read_api_keys(path: str) -> frozenset[str]:
  """One key per line; blank lines and `#` comments are ignored."""
  with open(path) as fh:
    keys = frozenset(line.strip() for line in fh
                     if line.strip() and not line.lstrip().startswith("#"))
  if not keys:
    raise ValueError(f"api_keys_file: {path} holds no keys")
  return keys


class InferenceServer:
  """Owns the grpc.aio server, the engine thread, health, metrics and the lifecycle."""

  def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()):
    self.engine, self.config = engine, config
    self.metrics = ServingMetrics(engine.stats, engine.config.page_size, config.model_name,
                                  engine.sched_config.max_model_len)
    self.health = grpc_health.aio.HealthServicer()
    self.engine_loop = EngineLoop(engine)
    self.limits = validation.RequestLimits(
        vocab_size=engine.cfg.vocab_size, max_model_len=engine.sched_config.max_model_len,
        num_eos_ids=len(engine.eos_token_ids), max_stop_strings=config.max_stop_strings,
        max_prompt_chars=config.max_prompt_chars, drafters=engine.drafters,
        max_images_per_request=config.max_images_per_request,
        max_image_bytes=config.max_image_bytes, max_image_pixels=config.max_image_pixels,
        allow_image_urls=config.allow_image_urls,
        image_url_timeout_s=config.image_url_timeout_s,
        eos_token_ids=tuple(engine.eos_token_ids))
    pad_id = engine.images.pad_id  # None: no vision tower (image parts refused)
    self.vision = (chat.Vision(pad_id, engine.image_processor)
                   if pad_id is not None and engine.image_processor is not None else None)
    if pad_id is not None and self.vision is None:
      logging.warning("the model has a vision tower but the engine no image_processor "
                      "(Engine.from_model reads preprocessor_config.json): images refused")
    template = engine.chat_template
    self.chat_family = config.chat_parser or (template.family if template is not None else None
                                              ) or chat_markup.family_for(engine.cfg.model_type)
    self.state = "created"  # -> starting -> serving -> draining -> stopped
    self.port: int | None = None
    self._server: grpc.aio.Server | None = None
    self.drain_aborted: set[str] = set()  # streams to end UNAVAILABLE, not ABORT
    self._tasks: list[asyncio.Task] = []
    self._throughput: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=11)
    self._metrics_http: Any = None
    self.http: OpenAIHTTP | None = None
    self.engine_calls = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="moejax-engine-calls")
    # Tokenising a multi-megabyte prompt takes seconds: never on the event loop, and not on
    # the engine-calls thread either, where it would hold up every other admission.
    self.tokenize_calls = concurrent.futures.ThreadPoolExecutor(
        max_workers=2, thread_name_prefix="moejax-tokenize")
    # Request ids being tokenised (not in the engine yet) and those of them an Abort named:
    # aborted right after their add, as when tokenising held the loop and the Abort waited.
    self.tokenizing: collections.Counter[str] = collections.Counter()
    self.early_aborts: set[str] = set()

  # ---- lifecycle -----------------------------------------------------------------------------

  async def start(self, metrics_port: int | None = None) -> int:
    """Binds, starts, warms up the engine, then reports SERVING. Returns the bound port."""
    self.state = "starting"
    server = grpc.aio.server(options=self.config.grpc_options())
    servicer = InferenceServicer(self)
    server.add_generic_rpc_handlers([wire.generic_handler(
        pb.DESCRIPTOR.services_by_name["Inference"], servicer, pb, servicer.reject_bad_bytes)])
    health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
    reflection.enable(server, [SERVICE_NAME,
                               health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
    address = f"{self.config.host}:{self.config.port}"
    if self.config.tls_cert or self.config.tls_key:
      with open(self.config.tls_key, "rb") as k, open(self.config.tls_cert, "rb") as c:
        creds = grpc.ssl_server_credentials([(k.read(), c.read())])
      self.port = server.add_secure_port(address, creds)
    else:
      self.port = server.add_insecure_port(address)
    await self._set_health(NOT_SERVING)
    await server.start()
    self._server = server
    self.engine_loop.start()
    if self.config.http_port is not None:  # bound before warm-up: /health answers 503
      self.http = OpenAIHTTP(self)
      await self.http.start(self.config.host, self.config.http_port)
    if metrics_port is not None:
      host = self.config.metrics_host or self.config.host
      self._metrics_http = self.metrics.serve_http(metrics_port, host.strip("[]"))
    if self.config.warmup:
      t0 = time.perf_counter()
      n = await asyncio.to_thread(self.engine.warmup)
      logging.info("warm-up compiled %d programs in %.1fs", n, time.perf_counter() - t0)
      if self.engine.tokenizer is not None:  # structured outputs' tokenizer, built once
        t0 = time.perf_counter()
        why = await asyncio.to_thread(structured.prepare_tokenizer, self.engine.tokenizer,
                                      self.limits)
        if why is None:
          logging.info("structured outputs: grammar tokenizer built in %.2fs",
                       time.perf_counter() - t0)
        else:
          logging.warning("structured outputs unavailable: %s", why)
    self.state = "serving"
    await self._set_health(SERVING)
    self._tasks.append(asyncio.create_task(self._stats_loop()))
    return self.port

  @property
  def http_port(self) -> int | None:
    """The bound port of the OpenAI HTTP API (None: off)."""
    return None if self.http is None else self.http.port

  @property
  def metrics_port(self) -> int | None:
    return None if self._metrics_http is None else self._metrics_http.server_port

  @property
  def metrics_address(self) -> str | None:
    """The address the /metrics listener is bound to."""
    return None if self._metrics_http is None else self._metrics_http.server_address[0]

  async def _set_health(self, status: int) -> None:
    for service in ("", SERVICE_NAME):
      await self.health.set(service, status)

  async def refuse_new(self) -> None:
    """NOT_SERVING, and new requests get UNAVAILABLE (the first half of `drain`)."""
    if self.state not in ("draining", "stopped"):
      self.state = "draining"
      await self._set_health(NOT_SERVING)

  async def drain(self) -> None:
    """NOT_SERVING and UNAVAILABLE for new requests; in-flight ones get drain_timeout_s."""
    if self.state in ("draining", "stopped"):
      return
    await self.refuse_new()
    deadline = time.monotonic() + self.config.drain_timeout_s
    while self.engine_loop.subscribed() and time.monotonic() < deadline:
      await asyncio.sleep(0.02)
    late = self.engine_loop.subscribed()
    if late:
      logging.warning("drain timeout: ending %d requests with UNAVAILABLE", len(late))
    for rid in late:
      self.drain_aborted.add(rid)
    await self.call_engine(lambda: [self.engine.abort(rid) for rid in late])
    self.engine_loop.wake()
    for _ in range(250):  # the aborted streams end at the engine thread's next step
      if not self.engine_loop.subscribed():
        break
      await asyncio.sleep(0.02)
    await self.stop()

  async def stop(self, grace_s: float = 1.0) -> None:
    if self.state == "stopped":
      return
    self.state = "stopped"
    for task in self._tasks:
      task.cancel()
    if self._server is not None:
      await self._server.stop(grace_s)
    if self.http is not None:
      await self.http.stop()
    await asyncio.to_thread(self.engine_calls.shutdown, True)  # pending aborts run first
    self.tokenize_calls.shutdown(wait=False, cancel_futures=True)
    self.engine_loop.stop()
    if self._metrics_http is not None:
      self._metrics_http.shutdown()

  async def wait(self) -> None:
    if self._server is not None:
      await self._server.wait_for_termination()

  # ---- calls into the engine (off the event loop) ----------------------------------------------

  async def tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs fn(*args) (tokenising, detokenising) on a tokenizer thread."""
    return await asyncio.get_running_loop().run_in_executor(self.tokenize_calls, fn, *args)

  async def call_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs fn(*args) on the engine-calls thread, after every call submitted before it."""
    return await asyncio.get_running_loop().run_in_executor(self.engine_calls, fn, *args)

  def submit_engine_call(self, fn: Callable[..., Any], *args: Any) -> None:
    """Fire and forget (for `finally` blocks of cancelled streams, which must not wait)."""
    try:
      self.engine_calls.submit(fn, *args)
    except RuntimeError:  # shut down: the server is stopping, run it here
      fn(*args)

  def admit_all(self, items: list[tuple[validation.ParsedRequest, str, Callable[[Any], None]]]
                ) -> None:
    """Queue caps for all of them, then subscription and `Engine.add_request` for each (on
    the engine-calls thread); all or none are added."""
    self.check_capacity(sum(len(parsed.prompt_ids) for parsed, _, _ in items), len(items))
    added: list[tuple[str, Callable[[Any], None]]] = []
    try:
      for parsed, rid, deliver in items:
        self._admit_one(parsed, rid, deliver)
        added.append((rid, deliver))
    except Rejected:
      for rid, deliver in added:
        self.end_stream(rid, deliver, client_abort=False)
      raise
    self.engine_loop.wake()

  def _admit_one(self, parsed: validation.ParsedRequest, rid: str,
                 deliver: Callable[[Any], None]) -> None:
    early = rid in self.early_aborts  # an Abort came while it was being tokenised
    self.early_aborts.discard(rid)
    if not self.engine_loop.subscribe(rid, deliver):
      raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already in use")
    try:
      self.engine.add_request(parsed.prompt_ids, parsed.sampling, parsed.stop, rid,
                              images=parsed.images)
    except ValueError as e:
      self.engine_loop.unsubscribe(rid)
      raise Rejected(grpc.StatusCode.ALREADY_EXISTS if str(e).startswith("request_id")
                      else grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if early:
      self.engine.abort(rid)

  def end_stream(self, rid: str, deliver: Callable[[Any], None], client_abort: bool) -> None:
    """A stream ended before its request: abort it once (frees its pages). Only the stream
    that owns the subscription may abort, so a rejected duplicate id cannot end the original."""
    if self.engine_loop.unsubscribe(rid, deliver):
      if self.engine.abort(rid) and client_abort:
        self.metrics.client_aborts.inc()
      self.engine_loop.wake()

  # ---- load and stats ------------------------------------------------------------------------

  def _sample_throughput(self) -> None:
    s = self.engine.stats()
    self._throughput.append((time.monotonic(), s["prompt_tokens"], s["generation_tokens"]))

  def throughput(self) -> tuple[float, float]:
    """(prompt, generation) tokens per second over the last ~10 s."""
    if len(self._throughput) < 2:
      return 0.0, 0.0
    (t0, p0, g0), (t1, p1, g1) = self._throughput[0], self._throughput[-1]
    dt = max(t1 - t0, 1e-9)
    return (p1 - p0) / dt, (g1 - g0) / dt

  def stats_line(self) -> str:
    s = self.engine.stats()
    prompt_tps, gen_tps = self.throughput()
    return (f"running={s['num_requests_running']} waiting={s['num_requests_waiting']} "
            f"kv={100 * s['kv_cache_usage_perc']:.1f}% prompt={prompt_tps:.1f} tok/s "
            f"gen={gen_tps:.1f} tok/s preempted={s['num_preemptions']} "
            f"prefix_hits={s['prefix_cache_hits']}/{s['prefix_cache_queries']}")

  async def _stats_loop(self) -> None:
    last_log, last_line = time.monotonic(), ""
    while True:
      await self.call_engine(self._sample_throughput)
      interval = self.config.stats_log_interval_s
      if interval and time.monotonic() - last_log >= interval:
        last_log, line = time.monotonic(), await self.call_engine(self.stats_line)
        if line != last_line:  # an idle server stays quiet
          logging.info("[moejax] %s", line)
        last_line = line
      await asyncio.sleep(1.0)

  # ---- admission -----------------------------------------------------------------------------

  def key_ok(self, authorization: str) -> bool:
    """Whether an `authorization` header value (`Bearer <key>`) passes (gRPC and HTTP)."""
    if not self.config.api_keys:
      return True
    token = authorization[len("Bearer "):] if authorization.startswith("Bearer ") else ""
    # Compare against every key (no early exit) so timing does not reveal a key's prefix.
    ok = False
    for key in self.config.api_keys:
      ok |= hmac.compare_digest(token.encode(), key.encode())
    return ok

  def check_api_key(self, context: grpc.aio.ServicerContext) -> None:
    if not self.config.api_keys:
      return
    if not self.key_ok(dict(context.invocation_metadata() or ()).get("authorization", "")):
      raise Rejected(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or invalid API key (metadata authorization: Bearer <key>)")

  def check_capacity(self, num_prompt_tokens: int, num_requests: int = 1) -> None:
    if self.state != "serving":
      raise Rejected(grpc.StatusCode.UNAVAILABLE, "server is draining" if self.state in (
          "draining", "stopped") else "server is warming up")
    queued = self.engine.queue_load()
    if queued.requests + num_requests - 1 >= self.config.max_queue_requests:
      raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {queued.requests} "
                      f"requests waiting (max_queue_requests {self.config.max_queue_requests})")
    # A lone prompt longer than the token cap is still admitted (it fits the context length).
    if queued.requests and queued.tokens + num_prompt_tokens > self.config.max_queue_tokens:
      raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {queued.tokens} prompt "
                      f"tokens waiting + {num_prompt_tokens} exceeds max_queue_tokens "
                      f"{self.config.max_queue_tokens}")
