"""The HTTP APIs (Starlette on uvicorn) in the gRPC server's process: OpenAI's and Anthropic's.

`OpenAIHTTP` serves `/v1/completions`, `/v1/chat/completions`, `/v1/responses` (and
`GET`/`DELETE /v1/responses/{id}`), Anthropic's `/v1/messages` and `/v1/messages/count_tokens`,
vLLM's `/tokenize` and `/detokenize`, `/v1/models`, `/health` and `/metrics` over the
`InferenceServer`'s engine: the same engine thread and scheduler, admission (queue caps ->
429), API keys (`Authorization: Bearer <key>` or Anthropic's `x-api-key` -> 401), metrics and
drain as gRPC. `/health` is the readiness probe (503 until warm-up ends, and while draining);
`/metrics` is always served; every other route answers 503 until then. A request's JSON is
parsed, validated and tokenised on a tokenizer thread (`openai_protocol`, `openai_chat`,
`openai_responses`, `anthropic_messages`; a bad field -> 400 naming it, in the route's API's
error shape), admitted as a `RequestGroup` (one engine request per choice), then answered as
one JSON body or as server-sent events. `X-Request-Id` (printable, at most 96 characters) is
the request's id (`chatcmpl-<id>`, `resp_<id>`, `msg_<id>`; engine requests `<that>-<choice>`)
and is echoed in the response's headers (one is made when absent); the same id while its
request is in flight is a 400. A client that disconnects ends its group, which aborts the
unfinished requests and frees their pages at once; errors after the stream started arrive as
an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from typing import Any, AsyncIterator, Awaitable, Callable

import uvicorn
from absl import logging
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.service import anthropic_messages, chat, openai_chat, openai_responses
from engine.service import openai_protocol as protocol
from engine.service import validation
from engine.service.http_common import (ANTHROPIC, DONE, OPENAI, EventStream, HTTPError,
                                        Uvicorn, named_sse, sse, watch_disconnect)
from engine.service.streams import Rejected, RequestGroup
from engine.service.validation import FieldError

MAX_REQUEST_ID_CHARS = 96
ALWAYS_SERVED = ("/health", "/metrics")


class OpenAIHTTP:
  """The HTTP edge of an `InferenceServer`; `start` binds (before warm-up), `stop` ends it."""

  def __init__(self, server: Any):
    self.srv = server
    self.port: int | None = None
    self._uvicorn: Uvicorn | None = None
    self._task: asyncio.Task | None = None
    self.store = openai_responses.ResponseStore(server.config.responses_store_size)
    ep, anthropic = self._endpoint, ANTHROPIC
    self.app = Starlette(routes=[
        Route("/health", self.health, methods=["GET"]),
        Route("/metrics", self.metrics, methods=["GET"]),
        Route("/v1/models", ep(self.models), methods=["GET"]),
        Route("/v1/models/{model:path}", ep(self.model), methods=["GET"]),
        Route("/v1/completions", ep(self.completions), methods=["POST"]),
        Route("/v1/chat/completions", ep(self.chat_completions), methods=["POST"]),
        Route("/v1/responses", ep(self.responses), methods=["POST"]),
        Route("/v1/responses/{rid}", ep(self.stored_response), methods=["GET", "DELETE"]),
        Route("/v1/messages", ep(self.messages, anthropic), methods=["POST"]),
        Route("/v1/messages/count_tokens", ep(self.count_tokens, anthropic), methods=["POST"]),
        Route("/tokenize", ep(self.tokenize), methods=["POST"]),
        Route("/detokenize", ep(self.detokenize), methods=["POST"]),
    ], exception_handlers={StarletteHTTPException: self._http_exception})

  async def _http_exception(self, request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths (404) and methods (405) in the path's API's error shape too."""
    api = ANTHROPIC if request.url.path.startswith("/v1/messages") else OPENAI
    return HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     "invalid_request_error").response(api)

  # ---- lifecycle ---------------------------------------------------------------------------

  async def start(self, host: str, port: int) -> int:
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    self.port = sock.getsockname()[1]
    config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                            timeout_graceful_shutdown=2, timeout_keep_alive=30)
    self._uvicorn = Uvicorn(config)
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

  def _endpoint(self, handler: Callable[[Request], Awaitable[Response]], api: str = OPENAI):
    """Readiness, the key and the request id, then the handler; refusals become `api`'s error
    bodies (counted as gRPC's), and every answer carries the request id."""
    async def run(request: Request) -> Response:
      rid = request.headers.get("x-request-id")
      headers = {}
      try:
        if self.srv.state != "serving":
          state = ("warming up" if self.srv.state in ("created", "starting")
                   else self.srv.state)
          raise HTTPError(503, f"server is {state}", "service_unavailable",
                          grpc_code="UNAVAILABLE")
        if not self._key_ok(request):
          raise HTTPError(401, "missing or invalid API key (header Authorization: Bearer "
                          "<key>, or x-api-key)", "invalid_request_error", None,
                          "invalid_api_key", "UNAUTHENTICATED")
        if rid is not None and not (0 < len(rid) <= MAX_REQUEST_ID_CHARS and rid.isprintable()
                                    and rid.isascii()):
          raise HTTPError(400, f"X-Request-Id: 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                          "characters", "invalid_request_error", "X-Request-Id")
        rid = rid or secrets.token_hex(12)
        headers["x-request-id"] = rid
        request.state.request_id = rid
        response = await handler(request)
        response.headers.update(headers)
        return response
      except (HTTPError, FieldError, Rejected) as e:
        err = HTTPError.of(e)
        self.srv.metrics.request_rejected.labels(code=err.grpc_code).inc()
        return err.response(api, headers)
      except Exception:
        logging.exception("HTTP %s: internal error", request.url.path)
        return HTTPError(500, "internal error", "internal_error").response(api, headers)
    return run

  def _key_ok(self, request: Request) -> bool:
    key = request.headers.get("x-api-key")
    if key is not None and not request.headers.get("authorization"):
      return self.srv.key_ok("Bearer " + key)
    return self.srv.key_ok(request.headers.get("authorization", ""))

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
                   collect: Callable[[RequestGroup], Awaitable[dict]], *, api: str,
                   label: str, errors: str = OPENAI) -> Response:
    """Admits the group (refusals before any byte is sent), then streams or collects."""
    group = RequestGroup(self.srv, [(parsed, parsed.request_id) for parsed in requests],
                         api=api, label=label)
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
        return HTTPError.of(e).response(errors)
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

  async def _error_events(self, events: AsyncIterator[bytes], group: RequestGroup,
                          api: str = "chat", numbered: Callable[..., dict] | None = None
                          ) -> AsyncIterator[bytes]:
    """`events`, ending in an error event instead of an exception (the status is sent): a
    `data:` error then [DONE] (completions, chat), an `error` event (responses, numbered after
    the stream's events; messages)."""
    try:
      async for event in events:
        yield event
    except Exception as e:
      if isinstance(e, Rejected):
        err = HTTPError.of(e)
      else:
        group.fail()
        logging.exception("HTTP stream: internal error")
        err = HTTPError(500, "internal error", "internal_error")
      if api == "messages":
        yield named_sse(err.body(ANTHROPIC))
      elif api == "responses":
        yield named_sse(numbered("error", code=err.code, message=str(err), param=err.param))
      else:
        yield sse(err.body())
        yield DONE

  # ---- routes ------------------------------------------------------------------------------

  async def health(self, request: Request) -> Response:
    if self.srv.state == "serving":
      return JSONResponse({"status": "ok"})
    state = "warming up" if self.srv.state in ("created", "starting") else self.srv.state
    return HTTPError(503, f"server is {state}", "service_unavailable").response()

  def _chat_args(self, request: Request) -> tuple:
    srv = self.srv
    return (srv.engine.chat_template, srv.engine.tokenizer, srv.limits, srv.config.model_name,
            srv.chat_family, srv.vision)

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
                              srv.limits, srv.config.model_name, request.state.request_id)
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
                             lambda g: self._error_events(events(g), g), collect,
                             api="completions", label=plan.id)

  async def chat_completions(self, request: Request) -> Response:
    srv = self.srv
    raw = await self._body(request)
    plan = await srv.tokenize(openai_chat.parse_chat, raw, *self._chat_args(request),
                              request.state.request_id)
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
                             lambda g: self._error_events(events(g), g), collect,
                             api="chat", label=plan.id)

  async def responses(self, request: Request) -> Response:
    raw = await self._body(request)
    plan = await self.srv.tokenize(openai_responses.parse_responses, raw,
                                   *self._chat_args(request), self.store,
                                   request.state.request_id)
    output = openai_responses.ResponseOutput(plan)

    def keep() -> None:
      if plan.store and output.last is not None and output.last.finished:
        self.store.put(output.response(), output.conversation())

    async def events(group: RequestGroup) -> AsyncIterator[bytes]:
      for event in output.start_events():
        yield named_sse(event)
      async for _, out in group:
        for event in output.feed(out):
          yield named_sse(event)
      keep()

    async def collect(group: RequestGroup) -> dict:
      async for _, out in group:
        output.feed(out)
      keep()
      return output.response()

    return await self._admit(request, plan.requests, plan.common.stream,
                             lambda g: self._error_events(events(g), g, "responses",
                                                          output.event), collect,
                             api="responses", label=plan.id)

  async def stored_response(self, request: Request) -> Response:
    rid = request.path_params["rid"]
    if request.method == "DELETE":
      if not self.store.delete(rid):
        raise openai_responses.NotFound("id", f"Response with id '{rid}' not found")
      return JSONResponse({"id": rid, "object": "response", "deleted": True})
    record = self.store.get(rid)
    if record is None:
      raise openai_responses.NotFound("id", f"Response with id '{rid}' not found")
    return JSONResponse(record[0])

  async def messages(self, request: Request) -> Response:
    raw = await self._body(request)
    plan = await self.srv.tokenize(anthropic_messages.parse_messages, raw,
                                   *self._chat_args(request), request.state.request_id)
    output = anthropic_messages.MessageOutput(plan)

    async def events(group: RequestGroup) -> AsyncIterator[bytes]:
      for event in output.start_events(len(plan.inputs.prompt_ids)):
        yield named_sse(event)
      async for _, out in group:
        for event in output.feed(out):
          yield named_sse(event)

    async def collect(group: RequestGroup) -> dict:
      async for _, out in group:
        output.feed(out)
      return output.message()

    return await self._admit(request, plan.requests, plan.common.stream,
                             lambda g: self._error_events(events(g), g, "messages"), collect,
                             api="messages", label=plan.id, errors=ANTHROPIC)

  async def count_tokens(self, request: Request) -> Response:
    raw = await self._body(request)
    return JSONResponse(await self.srv.tokenize(anthropic_messages.count_tokens, raw,
                                                *self._chat_args(request)))

  async def tokenize(self, request: Request) -> Response:
    """vLLM's /tokenize: {"prompt": text} or {"messages": [...], ...} -> token ids."""
    raw = await self._body(request)
    return JSONResponse(await self.srv.tokenize(self._tokenize, raw))

  def _tokenize(self, raw: bytes) -> dict:
    srv, body = self.srv, protocol.load_body(raw)
    protocol.check_model(body, srv.config.model_name)
    tokenizer = srv.engine.tokenizer
    if tokenizer is None:
      raise FieldError("prompt", "this model has no tokenizer")
    if "messages" in body:
      if not protocol.get(body, "add_generation_prompt", bool, True):
        raise FieldError("add_generation_prompt", "only true is supported by this server")
      request = chat.ChatRequest(messages=body["messages"], tools=body.get("tools"),
                                 template_kwargs=protocol.get(body, "chat_template_kwargs",
                                                              dict, None))
      ids = chat.prepare(*self._chat_args(None)[:3], request, family=srv.chat_family,
                         vision=srv.vision).prompt_ids
    else:
      prompt = protocol.get(body, "prompt", str, None)
      if prompt is None:
        raise FieldError("prompt", "is required (or messages)")
      validation.check_prompt_chars(prompt, srv.limits)
      ids = validation.encode(tokenizer, prompt)
    out = {"count": len(ids), "max_model_len": srv.limits.max_model_len, "tokens": ids,
           "token_strs": None}
    if protocol.get(body, "return_token_strs", bool, False):
      out["token_strs"] = [protocol.token_text(tokenizer, t) for t in ids]
    return out

  async def detokenize(self, request: Request) -> Response:
    """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": text} (special tokens kept)."""
    raw = await self._body(request)
    return JSONResponse(await self.srv.tokenize(self._detokenize, raw))

  def _detokenize(self, raw: bytes) -> dict:
    srv, body = self.srv, protocol.load_body(raw)
    protocol.check_model(body, srv.config.model_name)
    if srv.engine.tokenizer is None:
      raise FieldError("tokens", "this model has no tokenizer")
    tokens = protocol.get(body, "tokens", list, None)
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool)
                                 for t in tokens):
      raise FieldError("tokens", "is required: an array of token ids")
    ids = validation.check_token_ids("tokens", tokens, srv.limits.vocab_size)
    # As vLLM's: special tokens kept (a rendered prompt decodes to its markup).
    return {"prompt": srv.engine.tokenizer.decode(ids, skip_special_tokens=False)}
