"""The serving benchmark's clients: gRPC (`Generate`, `Chat`) and the OpenAI HTTP API
(`/v1/completions`, `/v1/chat/completions`, through the official `openai` client), both
streaming, timed per chunk on the client side.

A `Sample` is one request as the benchmark saw it: ok or the error, usage (prompt, cached,
output tokens), client-side TTFT / E2E / inter-chunk gaps, the output (token ids where the API
returns them, text) and the tool calls the server parsed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Sequence

import grpc
import numpy as np

from engine.service.client import (AsyncInferenceClient, Completion, build_chat_request,
                                   build_request)


@dataclasses.dataclass
class Sample:
  ok: bool
  error: str = ""
  prompt_tokens: int = 0
  cached_tokens: int = 0
  output_tokens: int = 0
  ttft_s: float = 0.0
  e2el_s: float = 0.0
  itl_s: list[float] = dataclasses.field(default_factory=list)
  token_ids: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  tool_calls: list[dict] = dataclasses.field(default_factory=list)
  encode_s: float | None = None  # the server's image encoding time (gRPC reports it)


def _timed(sent_at: float, times: Sequence[float], **fields: Any) -> Sample:
  """A Sample from the arrival times of the chunks that carried output."""
  end = time.perf_counter()
  first = times[0] if times else end
  return Sample(ok=True, ttft_s=first - sent_at, e2el_s=end - sent_at,
                itl_s=list(np.diff(times)) if len(times) > 1 else [], **fields)


def valid_call(call: dict, tool_names: Sequence[str]) -> bool:
  """A parsed call names a declared tool and its arguments are a JSON object."""
  fn = call.get("function") or {}
  try:
    args = json.loads(fn.get("arguments") or "")
  except ValueError:
    return False
  return fn.get("name") in tool_names and isinstance(args, dict)


class GrpcBackend:
  def __init__(self, target: str, api_key: str | None = None):
    self.client = AsyncInferenceClient(target, api_key=api_key)

  async def __aenter__(self) -> "GrpcBackend":
    await self.client.__aenter__()
    return self

  async def __aexit__(self, *exc: Any) -> None:
    await self.client.__aexit__(*exc)

  async def complete(self, prompt: list[int], max_tokens: int) -> Sample:
    done = Completion(sent_at=time.perf_counter())
    try:
      async for chunk in self.client.stream(build_request(prompt, max_tokens=max_tokens,
                                                          ignore_eos=True)):
        done.add(chunk)
    except grpc.aio.AioRpcError as e:
      return Sample(ok=False, error=e.code().name)
    times = [t for t, n in zip(done.chunk_times, done.chunk_tokens) if n]
    s = _timed(done.sent_at, times, prompt_tokens=done.prompt_tokens,
               cached_tokens=done.cached_tokens, output_tokens=len(done.token_ids),
               token_ids=done.token_ids, text=done.text)
    s.e2el_s = done.chunk_times[-1] - done.sent_at
    return s

  async def chat(self, messages: list[dict], tools: list[dict] | None,
                 max_tokens: int) -> Sample:
    req = build_chat_request(messages, tools=tools, max_tokens=max_tokens)
    sent_at, times, text, final = time.perf_counter(), [], [], None
    calls: list[dict] = []
    try:
      async for r in self.client.chat_stream(req):
        if r.token_ids:
          times.append(time.perf_counter())
        text.append(r.content)
        if r.HasField("final"):
          final = r
    except grpc.aio.AioRpcError as e:
      return Sample(ok=False, error=e.code().name)
    calls = [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": c.function.arguments}}
        for c in final.complete_tool_calls]
    u = final.final.usage
    return _timed(sent_at, times, prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                  output_tokens=u.completion_tokens, text="".join(text), tool_calls=calls,
                  encode_s=final.final.timings.encode_s)


class OpenAIBackend:
  """The OpenAI HTTP API through the official client (`pip install openai`)."""

  def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None):
    try:
      import openai
    except ImportError:
      raise SystemExit("error: --backend=openai needs the openai package (pip install openai)")
    self.openai = openai
    for name in ("openai", "httpx", "httpx2"):  # a log line per request otherwise
      logging.getLogger(name).setLevel(logging.WARNING)
    self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none",
                                     max_retries=0, timeout=600)
    self.model = model

  async def __aenter__(self) -> "OpenAIBackend":
    if self.model is None:
      self.model = (await self.client.models.list()).data[0].id
    return self

  async def __aexit__(self, *exc: Any) -> None:
    await self.client.close()

  def _error(self, e: Exception) -> Sample:
    status = getattr(e, "status_code", None)
    return Sample(ok=False, error=f"HTTP {status}" if status else type(e).__name__)

  @staticmethod
  def _usage(u: Any) -> dict:
    details = getattr(u, "prompt_tokens_details", None)
    return dict(prompt_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                cached_tokens=getattr(details, "cached_tokens", 0) or 0)

  async def complete(self, prompt: list[int], max_tokens: int) -> Sample:
    sent_at, times, ids, text, usage = time.perf_counter(), [], [], [], None
    try:
      stream = await self.client.completions.create(
          model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
          stream_options={"include_usage": True},
          extra_body={"ignore_eos": True, "return_token_ids": True})
      async for chunk in stream:
        if chunk.usage is not None:
          usage = chunk.usage
        for c in chunk.choices:
          new = (c.model_extra or {}).get("token_ids") or []
          if new:
            times.append(time.perf_counter())
          ids.extend(new)
          text.append(c.text)
    except self.openai.APIError as e:
      return self._error(e)
    return _timed(sent_at, times, **self._usage(usage), token_ids=ids, text="".join(text))

  async def chat(self, messages: list[dict], tools: list[dict] | None,
                 max_tokens: int) -> Sample:
    sent_at, times, text, usage = time.perf_counter(), [], [], None
    calls: dict[int, dict] = {}
    try:
      stream = await self.client.chat.completions.create(
          model=self.model, messages=messages, tools=tools or self.openai.omit,
          max_completion_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
      async for chunk in stream:
        if chunk.usage is not None:
          usage = chunk.usage
        for c in chunk.choices:
          d = c.delta
          if d.content or d.tool_calls or (d.model_extra or {}).get("reasoning_content"):
            times.append(time.perf_counter())
          text.append(d.content or "")
          for t in d.tool_calls or ():
            call = calls.setdefault(t.index, {"id": "", "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            call["id"] = t.id or call["id"]
            if t.function is not None:
              call["function"]["name"] += t.function.name or ""
              call["function"]["arguments"] += t.function.arguments or ""
    except self.openai.APIError as e:
      return self._error(e)
    return _timed(sent_at, times, **self._usage(usage), text="".join(text),
                  tool_calls=[calls[i] for i in sorted(calls)])
