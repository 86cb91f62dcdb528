"""Engine requests as an asyncio stream, shared by every API edge (gRPC and OpenAI HTTP).

A `RequestGroup` is the n engine requests of one call (n = 1 for gRPC `Generate`, OpenAI's
`n` choices, a batch of completion prompts): admitted together on the engine-calls thread
(queue caps counted for all of them, all or none added), their outputs delivered by the
engine thread onto one asyncio queue as (index, RequestOutput), the serving metrics recorded
as they arrive. Leaving the `async with` before every request finished (client gone, error,
cancellation) aborts the unfinished ones once, which frees their pages at once.

    async with RequestGroup(server, [(parsed, rid)]) as group:
      async for index, out in group:
        ...
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

import grpc
from absl import logging

from engine.runtime.request import FINISH_ABORT, RequestOutput
from engine.service import validation
from engine.service.engine_loop import EngineFailure


class Rejected(Exception):
  """A request refused at the edge; `code` is the gRPC status (HTTP maps it)."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


_DISCONNECTED = object()


class RequestGroup:
  """n engine requests of one call; async-iterate for (index, RequestOutput) until all finish."""

  def __init__(self, server: Any, requests: Sequence[tuple[validation.ParsedRequest, str]],
               api: str = "grpc", label: str | None = None):
    self.srv = server
    self.requests = list(requests)
    self.api, self.label = api, label   # for the request log
    self.queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def deliverer(index: int):
      def deliver(item: Any) -> None:  # called on the engine thread
        try:
          loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop has closed (server stopped): nobody listens
          pass
      return deliver

    self.delivers = [deliverer(i) for i in range(len(self.requests))]
    self.finished = [False] * len(self.requests)
    self.failed = False  # ended by the server (engine failure, drain): not a client abort
    self.disconnected = False
    self.closed = False
    self._last_chunk: list[float | None] = [None] * len(self.requests)
    self._finals: list[RequestOutput | None] = [None] * len(self.requests)

  @property
  def done(self) -> bool:
    return all(self.finished)

  def disconnect(self) -> None:
    """The client went away: the iteration ends (and the exit aborts what is unfinished)."""
    self.disconnected = True
    self.queue.put_nowait((-1, _DISCONNECTED))

  async def __aenter__(self) -> "RequestGroup":
    items = [(parsed, rid, deliver) for (parsed, rid), deliver in
             zip(self.requests, self.delivers)]
    try:
      await self.srv.call_engine(self.srv.admit_all, items)
    except asyncio.CancelledError:  # cancelled while admitted: the aborts queue after the adds
      self._end_unfinished(client_abort=True)
      raise
    return self

  async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
    self.close(exc_type)

  def close(self, exc_type: Any = None) -> None:
    """Ends the group (once): unfinished requests are aborted, as client aborts unless the
    server ended them or the consumer failed (`exc_type` not a cancellation)."""
    if self.closed:
      return
    self.closed = True
    if getattr(self.srv.config, "request_log", False):
      logging.info("%s", self.log_line())
    for _, rid in self.requests:
      self.srv.drain_aborted.discard(rid)
    if not self.done:
      client = not self.failed and (exc_type is None or issubclass(
          exc_type, (asyncio.CancelledError, GeneratorExit)))
      self._end_unfinished(client_abort=client)

  def _end_unfinished(self, client_abort: bool) -> None:
    for i, (_, rid) in enumerate(self.requests):
      if not self.finished[i]:
        self.srv.submit_engine_call(self.srv.end_stream, rid, self.delivers[i], client_abort)

  def __aiter__(self) -> "RequestGroup":
    return self

  async def __anext__(self) -> tuple[int, RequestOutput]:
    if self.done or self.disconnected:
      raise StopAsyncIteration
    index, item = await self.queue.get()
    if item is _DISCONNECTED:
      raise StopAsyncIteration
    rid = self.requests[index][1]
    if isinstance(item, EngineFailure):
      self.failed = True
      raise Rejected(grpc.StatusCode.UNAVAILABLE if item.retryable else grpc.StatusCode.INTERNAL,
                     f"request {rid}: {item.message}")
    if item.finish_reason == FINISH_ABORT and rid in self.srv.drain_aborted:
      self.failed = True
      raise Rejected(grpc.StatusCode.UNAVAILABLE,
                     f"request {rid}: server shut down before it finished")
    now = time.monotonic()
    if item.new_token_ids:
      last = self._last_chunk[index]
      if last is not None:
        for _ in item.new_token_ids:
          self.srv.metrics.itl.observe((now - last) / len(item.new_token_ids))
      self._last_chunk[index] = now
    if item.finished:
      self.finished[index] = True
      self._finals[index] = item
      self.srv.engine_loop.unsubscribe(rid)  # the id is free once the client has the final
      self.srv.metrics.observe_finished(item.finish_reason, item.timings, item.usage)
    return index, item

  def log_line(self) -> str:
    """The request log's line: id, API, tokens (prompt, completion, cached), TTFT, total time
    and finish reason (over the group's choices: tokens summed, the first TTFT, the longest
    time; a choice that did not finish reads "abort")."""
    finals = [f for f in self._finals if f is not None]
    prompt = sum(f.usage.prompt_tokens for f in finals[:1])
    ttft = next((f.timings.ttft_s for f in finals if f.timings.ttft_s is not None), None)
    total = max((f.timings.e2e_s or 0.0 for f in finals), default=None)
    reasons = ",".join(f.finish_reason if f is not None else "abort" for f in self._finals)
    return (f"request id={self.label or self.requests[0][1]} api={self.api} "
            f"prompt_tokens={prompt} completion_tokens="
            f"{sum(f.usage.completion_tokens for f in finals)} cached_tokens="
            f"{sum(f.usage.cached_tokens for f in finals[:1])} ttft_s="
            f"{'-' if ttft is None else f'{ttft:.3f}'} total_s="
            f"{'-' if total is None else f'{total:.3f}'} finish={reasons}")

  def fail(self) -> None:
    """The consumer hit an internal error: the exit's aborts are not client aborts."""
    self.failed = True
