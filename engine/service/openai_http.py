"""The OpenAI-compatible HTTP API (Starlette on uvicorn) in the gRPC server's process.

`OpenAIHTTP` serves `/v1/completions`, `/v1/chat/completions`, `/v1/models` and `/health` over
the `InferenceServer`'s engine: the same engine thread and scheduler, admission (queue caps ->
429), API keys (`Authorization: Bearer <key>` -> 401), metrics and drain (503 while warming up
or draining) as gRPC. A request's JSON is parsed, validated and tokenised on a tokenizer
thread (`openai_protocol`, `openai_chat`; a bad field -> 400 naming it as OpenAI's `param`),
admitted as a `RequestGroup` (one engine request per choice), then answered as one JSON body
or as server-sent events (`data: {chunk}`, ..., `data: [DONE]`). A client that disconnects
ends its group, which aborts the unfinished requests and frees their pages at once; errors
after the stream started arrive as a `data: {"error": ...}` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import uvicorn
from absl import logging
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.service import openai_chat
from engine.service import openai_protocol as protocol
from engine.service.streams import Rejected, RequestGroup
from engine.service.validation import FieldError

# gRPC status of a refusal -> (HTTP status, OpenAI error type, code).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", None),
    grpc.StatusCode.INTERNAL: (500, "internal_error", None),
}


class HTTPError(Exception):
  def __init__(self, status: int, message: str, type_: str, param: str | None = None,
               code: str | None = None, grpc_code: str = "INVALID_ARGUMENT"):
    super().__init__(message)
    self.status, self.type, self.param, self.code = status, type_, param, code
    self.grpc_code = grpc_code  # the request_rejected metric's label, as for gRPC

  @classmethod
  def of(cls, e: Exception) -> "HTTPError":
    if isinstance(e, HTTPError):
      return e
    if isinstance(e, FieldError):
      return cls(400, str(e), "invalid_request_error", e.field,
                 "model_not_found" if e.field == "model" else None)
    if isinstance(e, Rejected):
      status, type_, code = HTTP_STATUS.get(e.code, (500, "internal_error", None))
      return cls(status, str(e), type_, None, code, e.code.name)
    raise TypeError(e)

  def body(self) -> dict:
    return protocol.error_body(str(self), self.type, self.param, self.code)

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status)


def sse(obj: Any) -> bytes:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def watch_disconnect(receive: Callable[[], Awaitable[dict]], group: RequestGroup) -> None:
  """Ends the group's iteration when the client disconnects (its requests are then aborted)."""
  while True:
    message = await receive()
    if message["type"] == "http.disconnect":
      group.disconnect()
      return


class EventStream(StreamingResponse):
  """Server-sent events from an admitted group; the group ends with the response, however
  it ends (finished, client gone, error)."""

  def __init__(self, group: RequestGroup, events: AsyncIterator[bytes]):
    super().__init__(events, media_type="text/event-stream",
                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    self.group, self.events = group, events

  async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
    watcher = asyncio.create_task(watch_disconnect(receive, self.group))
    exc_type = None
    try:
      await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
      async for event in self.events:
        await send({"type": "http.response.body", "body": event, "more_body": True})
      await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:  # the client went away mid-send
      exc_type = asyncio.CancelledError
    except BaseException as e:
      exc_type = type(e)
      raise
    finally:
      watcher.cancel()
      await self.events.aclose()
      self.group.close(exc_type)


class _Uvicorn(uvicorn.Server):
  """uvicorn without its signal handlers: the process's own (drain on SIGTERM) stay."""

  @contextlib.contextmanager
  def capture_signals(self):
    yield


class OpenAIHTTP:
  """The HTTP edge of an `InferenceServer`; `start` binds (before warm-up), `stop` ends it."""

  def __init__(self, server: Any):
    self.srv = server
    self.port: int | None = None
    self._uvicorn: _Uvicorn | None = None
    self._task: asyncio.Task | None = None
    self.app = Starlette(routes=[
        Route("/health", self.health, methods=["GET"]),
        Route("/metrics", self.metrics, methods=["GET"]),
        Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
        Route("/v1/models/{model:path}", self._endpoint(self.model), methods=["GET"]),
        Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
        Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
    ], exception_handlers={StarletteHTTPException: self._http_exception})

  async def _http_exception(self, request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths (404) and methods (405) in OpenAI's error shape too."""
    return HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     "invalid_request_error").response()

  # ---- lifecycle ---------------------------------------------------------------------------

  async def start(self, host: str, port: int) -> int:
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    self.port = sock.getsockname()[1]
    config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                            timeout_graceful_shutdown=2, timeout_keep_alive=30)
    self._uvicorn = _Uvicorn(config)
    self._task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
    while not self._uvicorn.started:
      if self._task.done():
        self._task.result()  # raises why it failed
        raise RuntimeError("the HTTP server stopped while starting")
      await asyncio.sleep(0.01)
    return self.port

  async def stop(self) -> None:
    if self._uvicorn is not None and self._task is not None:
      self._uvicorn.should_exit = True
      with contextlib.suppress(Exception):
        await self._task

  # ---- plumbing ----------------------------------------------------------------------------

  def _endpoint(self, handler: Callable[[Request], Awaitable[Response]]):
    """Key check, then the handler; refusals become OpenAI error bodies, counted as gRPC's."""
    async def run(request: Request) -> Response:
      try:
        if not self.srv.key_ok(request.headers.get("authorization", "")):
          raise HTTPError(401, "missing or invalid API key (header Authorization: Bearer "
                          "<key>)", "invalid_request_error", None, "invalid_api_key",
                          "UNAUTHENTICATED")
        return await handler(request)
      except (HTTPError, FieldError, Rejected) as e:
        err = HTTPError.of(e)
        self.srv.metrics.request_rejected.labels(code=err.grpc_code).inc()
        return err.response()
      except Exception:
        logging.exception("HTTP %s: internal error", request.url.path)
        return HTTPError(500, "internal error", "internal_error").response()
    return run

  async def _body(self, request: Request) -> bytes:
    limit = self.srv.config.max_message_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
      raise HTTPError(413, f"request body of {length} bytes, at most {limit} allowed",
                      "invalid_request_error", "body", grpc_code="RESOURCE_EXHAUSTED")
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise HTTPError(413, f"request body over {limit} bytes", "invalid_request_error",
                        "body", grpc_code="RESOURCE_EXHAUSTED")
      chunks.append(chunk)
    return b"".join(chunks)

  async def _admit(self, request: Request, requests: list, stream: bool,
                   events: Callable[[RequestGroup], AsyncIterator[bytes]],
                   collect: Callable[[RequestGroup], Awaitable[dict]]) -> Response:
    """Admits the group (refusals before any byte is sent), then streams or collects."""
    group = RequestGroup(self.srv, [(parsed, parsed.request_id) for parsed in requests])
    await group.__aenter__()
    if stream:
      return EventStream(group, events(group))
    watcher = asyncio.create_task(watch_disconnect(request.receive, group))
    exc_type = None
    try:
      body = await collect(group)
    except Rejected as e:
      exc_type = type(e)
      if group.failed:  # ended by the server (engine failure, drain): not a refusal
        return HTTPError.of(e).response()
      raise
    except BaseException as e:
      exc_type = type(e)
      raise
    finally:
      watcher.cancel()
      group.close(exc_type)
    if group.disconnected:
      return Response(status_code=499)  # nobody reads it
    return JSONResponse(body)

  async def _error_events(self, events: AsyncIterator[bytes],
                          group: RequestGroup) -> AsyncIterator[bytes]:
    """`events`, ending in an error event instead of an exception (the status is sent)."""
    try:
      async for event in events:
        yield event
    except Rejected as e:
      yield sse(HTTPError.of(e).body())
      yield DONE
    except Exception:
      group.fail()
      logging.exception("HTTP stream: internal error")
      yield sse(HTTPError(500, "internal error", "internal_error").body())
      yield DONE

  # ---- routes ------------------------------------------------------------------------------

  async def health(self, request: Request) -> Response:
    if self.srv.state == "serving":
      return JSONResponse({"status": "ok"})
    state = "warming up" if self.srv.state in ("created", "starting") else self.srv.state
    return HTTPError(503, f"server is {state}", "service_unavailable").response()

  async def metrics(self, request: Request) -> Response:
    """The same Prometheus registry as --metrics_port, on the API's port (as vLLM has it)."""
    return Response(self.srv.metrics.text(), media_type="text/plain; version=0.0.4")

  def _model_card(self) -> dict:
    srv = self.srv
    return {"id": srv.config.model_name, "object": "model", "created": protocol.now(),
            "owned_by": "moejax", "root": srv.config.model_name,
            "max_model_len": srv.engine.sched_config.max_model_len,
            "vocab_size": srv.engine.cfg.vocab_size}

  async def models(self, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [self._model_card()]})

  async def model(self, request: Request) -> Response:
    name = request.path_params["model"]
    if name != self.srv.config.model_name:
      raise HTTPError(404, f"the model `{name}` does not exist", "invalid_request_error",
                      "model", "model_not_found")
    return JSONResponse(self._model_card())

  async def completions(self, request: Request) -> Response:
    srv = self.srv
    raw = await self._body(request)
    plan = await srv.tokenize(protocol.parse_completion, raw, srv.engine.tokenizer,
                              srv.limits, srv.config.model_name)
    c, tokenizer, created = plan.common, srv.engine.tokenizer, protocol.now()

    def chunk(choices: list, **extra: Any) -> dict:
      usage = {"usage": None} if c.include_usage else {}  # OpenAI: null until the last
      return {"id": plan.id, "object": "text_completion", "created": created,
              "model": c.model, "choices": choices, **usage, **extra}

    def choice(index: int, out: Any, text: str, logprobs: Any,
               token_ids: list[int] | None = None) -> dict:
      extra = {"token_ids": token_ids} if plan.return_token_ids else {}
      return {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": out.finish_reason if out.finished else None,
              "stop_reason": out.stop_reason if out.finished else None, **extra}

    offsets = [0] * len(plan.requests)

    def logprobs_of(index: int, out: Any) -> dict | None:
      if plan.logprobs is None:
        return None
      lp, offsets[index] = protocol.completion_logprobs(
          tokenizer, out.new_token_ids, out.new_logprobs or [], offsets[index])
      return lp

    async def events(group: RequestGroup) -> AsyncIterator[bytes]:
      tally = protocol.UsageTally(c.n)
      async for index, out in group:
        tally.add(index, out)
        if out.text_delta or out.finished or (out.new_token_ids and (
            plan.logprobs is not None or plan.return_token_ids)):
          yield sse(chunk([choice(index, out, out.text_delta, logprobs_of(index, out),
                                  out.new_token_ids)]))
      if c.include_usage:
        yield sse(chunk([], usage=tally.json()))
      yield DONE

    async def collect(group: RequestGroup) -> dict:
      tally = protocol.UsageTally(c.n)
      texts: list[list[str]] = [[] for _ in plan.requests]
      ids: list[list[int]] = [[] for _ in plan.requests]
      lps: list[list[dict]] = [[] for _ in plan.requests]
      last: list[Any] = [None] * len(plan.requests)
      async for index, out in group:
        tally.add(index, out)
        texts[index].append(out.text_delta)
        ids[index].extend(out.new_token_ids)
        if plan.logprobs is not None:
          lps[index].append(logprobs_of(index, out))
        last[index] = out
      choices = []
      for i, out in enumerate(last):
        if out is None:
          continue
        merged = None
        if plan.logprobs is not None:
          merged = {k: [v for part in lps[i] for v in part[k]] for k in
                    ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        choices.append(choice(i, out, "".join(texts[i]), merged, ids[i]))
      return chunk(choices, usage=tally.json())

    return await self._admit(request, plan.requests, c.stream,
                             lambda g: self._error_events(events(g), g), collect)

  async def chat_completions(self, request: Request) -> Response:
    srv = self.srv
    raw = await self._body(request)
    plan = await srv.tokenize(openai_chat.parse_chat, raw, srv.engine.chat_template,
                              srv.engine.tokenizer, srv.limits, srv.config.model_name,
                              srv.chat_family, srv.vision)
    choices = openai_chat.ChatChoices(plan, srv.engine.tokenizer)

    async def events(group: RequestGroup) -> AsyncIterator[bytes]:
      for first in choices.first_chunks():
        yield sse(first)
      async for index, out in group:
        chunk = choices.feed(index, out)
        if chunk is not None:
          yield sse(chunk)
      if plan.common.include_usage:
        yield sse(choices.usage_chunk())
      yield DONE

    async def collect(group: RequestGroup) -> dict:
      async for index, out in group:
        choices.feed(index, out)
      return choices.completion()

    return await self._admit(request, plan.requests, plan.common.stream,
                             lambda g: self._error_events(events(g), g), collect)
