"""What every HTTP API on `--http_port` shares: errors in each API's shape, server-sent events
from an admitted `RequestGroup`, the client-disconnect watcher, uvicorn without its signal
handlers.

Errors: a refusal is an `HTTPError` (status, message, OpenAI type / param / code); each route
answers it in its API's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`, or
Anthropic's `{"type": "error", "error": {"type", "message"}}` (`anthropic_messages.error_body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import uvicorn
from starlette.responses import JSONResponse, StreamingResponse

from engine.service import anthropic_messages
from engine.service import openai_protocol as protocol
from engine.service.streams import Rejected, RequestGroup
from engine.service.validation import FieldError

# gRPC status of a refusal -> (HTTP status, OpenAI error type, code). A request id already in
# use (a duplicate X-Request-Id in flight) is the client's error: 400.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error", "duplicate_request_id"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", None),
    grpc.StatusCode.INTERNAL: (500, "internal_error", None),
}
OPENAI, ANTHROPIC = "openai", "anthropic"


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
      status = getattr(e, "status", 400)
      code = getattr(e, "code", "model_not_found" if e.field == "model" else None)
      return cls(status, str(e), "invalid_request_error", e.field, code,
                 "NOT_FOUND" if status == 404 else "INVALID_ARGUMENT")
    if isinstance(e, Rejected):
      status, type_, code = HTTP_STATUS.get(e.code, (500, "internal_error", None))
      param = "X-Request-Id" if e.code == grpc.StatusCode.ALREADY_EXISTS else None
      return cls(status, str(e), type_, param, code, e.code.name)
    raise TypeError(e)

  def body(self, api: str = OPENAI) -> dict:
    if api == ANTHROPIC:
      return anthropic_messages.error_body(str(self), self.status)
    return protocol.error_body(str(self), self.type, self.param, self.code)

  def response(self, api: str = OPENAI, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(self.body(api), status_code=self.status, headers=headers)


def sse(obj: Any) -> bytes:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def named_sse(event: dict) -> bytes:
  """An event with its type as the SSE event name (Responses and Messages streams)."""
  return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


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

  def __init__(self, group: RequestGroup, events: AsyncIterator[bytes],
               headers: dict | None = None):
    super().__init__(events, media_type="text/event-stream",
                     headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                              **(headers or {})})
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


class Uvicorn(uvicorn.Server):
  """uvicorn without its signal handlers: the process's own (drain on SIGTERM) stay."""

  @contextlib.contextmanager
  def capture_signals(self):
    yield
