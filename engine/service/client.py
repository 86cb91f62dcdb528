"""Python clients for `moejax.v1.Inference` (sync and asyncio).

    client = InferenceClient("127.0.0.1:50051", api_key=None)
    for chunk in client.stream("def fib(n):", max_tokens=32, temperature=0.7):
      print(chunk.text, end="")
    done = client.generate([1, 5, 6], max_tokens=8)     # Completion: ids, text, reason, usage

    async with AsyncInferenceClient("127.0.0.1:50051") as client:
      done = await client.generate("def fib(n):", max_tokens=32)

    for r in client.chat_stream([{"role": "user", "content": "hi"}], max_tokens=16):
      print(r.reasoning_content, r.content, list(r.tool_calls), end="")

Errors arrive as `grpc.RpcError` (`.code()`, `.details()`), never inside the stream.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.service.proto import inference_pb2 as pb
from engine.service.proto import inference_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens",
                   "top_logprobs")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000)]


def build_request(prompt: str | Sequence[int], *, request_id: str = "",
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, include_stop_str_in_output: bool = False,
                  logprobs: bool = False, drafter: str = "",
                  max_draft_tokens: int | None = None,
                  structured_outputs: pb.StructuredOutputs | None = None,
                  **sampling: Any) -> pb.GenerateRequest:
  """A GenerateRequest; `sampling` takes SAMPLING_FIELDS (unset ones keep server defaults);
  `structured_outputs` constrains the output (pb.StructuredOutputs(json_schema=...))."""
  unknown = set(sampling) - set(SAMPLING_FIELDS)
  if unknown:
    raise TypeError(f"unknown sampling fields {sorted(unknown)}")
  req = pb.GenerateRequest(request_id=request_id)
  if isinstance(prompt, str):
    req.text = prompt
  else:
    req.token_ids.ids.extend(int(t) for t in prompt)
  s = req.sampling
  for name, value in sampling.items():
    if value is not None:
      setattr(s, name, value)
  s.stop.extend(stop)
  s.stop_token_ids.extend(stop_token_ids)
  s.ignore_eos, s.include_stop_str_in_output, s.logprobs = (ignore_eos,
                                                            include_stop_str_in_output, logprobs)
  req.speculative.drafter = drafter
  if max_draft_tokens is not None:
    req.speculative.max_draft_tokens = max_draft_tokens
  if structured_outputs is not None:
    req.structured_outputs.CopyFrom(structured_outputs)
  return req


def build_chat_request(messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                       tool_choice: str | dict | None = None,
                       template_kwargs: dict | None = None, request_id: str = "",
                       stop: Sequence[str] = (), ignore_eos: bool = False,
                       structured_outputs: pb.StructuredOutputs | None = None,
                       thinking: bool | None = None, thinking_token_budget: int | None = None,
                       **sampling: Any) -> pb.ChatRequest:
  """A ChatRequest from OpenAI-shaped messages, tools and tool_choice ("auto", "none",
  "required" or {"type": "function", "function": {"name": ...}}; required and a named function
  constrain the output to tool calls), an optional answer constraint and the thinking
  controls (on/off; a budget of reasoning tokens)."""
  base = build_request([], stop=stop, ignore_eos=ignore_eos, **sampling)
  req = pb.ChatRequest(request_id=request_id, sampling=base.sampling,
                       structured_outputs=structured_outputs, thinking=thinking,
                       thinking_token_budget=thinking_token_budget)
  for m in messages:
    msg = req.messages.add(role=m["role"], reasoning_content=m.get("reasoning_content") or "",
                           tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: text, image_url (data: URLs), image
      for part in content:
        if part.get("type") == "text":
          msg.content_parts.add(text=part["text"])
        else:
          msg.content_parts.add(image=pb.ImageData(data=_image_bytes(part)))
    elif content is not None:
      msg.content = content
    for c in m.get("tool_calls") or ():
      msg.tool_calls.add(id=c.get("id", ""), type=c.get("type", "function"),
                         function=pb.FunctionCall(name=c["function"]["name"],
                                                  arguments=c["function"].get("arguments", "")))
  for t in tools or ():
    fn = t["function"]
    req.tools.add(type=t.get("type", "function"), function=pb.FunctionDefinition(
        name=fn["name"], description=fn.get("description") or "",
        parameters_json=json.dumps(fn.get("parameters") or {})))
  if isinstance(tool_choice, str):
    req.tool_choice.mode = tool_choice
  elif tool_choice is not None:
    req.tool_choice.function_name = tool_choice["function"]["name"]
  if template_kwargs:
    req.template_kwargs.update(template_kwargs)
  return req


def _image_bytes(part: dict) -> bytes:
  """An image part's file bytes: {"type": "image", "image": bytes} or an OpenAI image_url
  part with a data: URL (the server does not fetch for gRPC clients)."""
  if part.get("type") == "image":
    return bytes(part["image"])
  url = part.get("image_url")
  url = url.get("url") if isinstance(url, dict) else url
  if not (isinstance(url, str) and url.startswith("data:") and ";base64," in url):
    raise ValueError("image parts over gRPC: bytes or a base64 data: URL")
  return base64.b64decode(url.split(",", 1)[1])


@dataclasses.dataclass
class Completion:
  """A whole stream, accumulated; `chunk_times` are client-side arrival times (perf_counter)."""
  request_id: str = ""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  reasoning_text: str = ""
  finish_reason: str | None = None
  stop: str | int | None = None
  prompt_tokens: int = 0
  cached_tokens: int = 0
  completion_tokens: int = 0
  spec_draft_tokens: int = 0  # speculative decoding: drafted and accepted tokens
  spec_accepted_tokens: int = 0
  server_timings: dict[str, float] = dataclasses.field(default_factory=dict)
  sent_at: float = 0.0
  chunk_times: list[float] = dataclasses.field(default_factory=list)
  chunk_tokens: list[int] = dataclasses.field(default_factory=list)
  # With logprobs: per token (logprob, [(token_id, logprob), ...] best alternatives first).
  logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(
      default_factory=list)

  def add(self, chunk: pb.GenerateResponse) -> None:
    self.chunk_times.append(time.perf_counter())
    self.chunk_tokens.append(len(chunk.token_ids))
    self.request_id = chunk.request_id
    self.token_ids.extend(chunk.token_ids)
    self.logprobs.extend((lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                         for lp in chunk.logprobs)
    self.text += chunk.text
    self.reasoning_text += chunk.reasoning_text
    if chunk.HasField("final"):
      f = chunk.final
      self.finish_reason = FINISH_NAMES.get(f.finish_reason)
      which = f.WhichOneof("matched_stop")
      self.stop = getattr(f, which) if which else None
      self.prompt_tokens, self.cached_tokens, self.completion_tokens = (
          f.usage.prompt_tokens, f.usage.cached_tokens, f.usage.completion_tokens)
      self.spec_draft_tokens = f.speculative.num_draft_tokens
      self.spec_accepted_tokens = f.speculative.num_accepted_tokens
      self.server_timings = dict(queue_s=f.timings.queue_s, ttft_s=f.timings.ttft_s,
                                 e2e_s=f.timings.e2e_s)
      if f.timings.HasField("time_to_first_answer_token_s"):
        self.server_timings["time_to_first_answer_token_s"] = (
            f.timings.time_to_first_answer_token_s)

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    for k in ("sent_at", "chunk_times", "chunk_tokens"):
      d.pop(k)
    return d


def _credentials(root_certificates: bytes | None) -> Any:
  return grpc.ssl_channel_credentials(root_certificates=root_certificates)


class _Base:
  def __init__(self, api_key: str | None, timeout: float | None):
    self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    self.timeout = timeout


class InferenceClient(_Base):
  """Blocking client. `tls=True` (or root_certificates) uses a secure channel."""

  def __init__(self, target: str, api_key: str | None = None, tls: bool = False,
               root_certificates: bytes | None = None, timeout: float | None = None):
    super().__init__(api_key, timeout)
    self.channel = (grpc.secure_channel(target, _credentials(root_certificates),
                                        CHANNEL_OPTIONS)
                    if tls or root_certificates else
                    grpc.insecure_channel(target, CHANNEL_OPTIONS))
    self.stub = pb_grpc.InferenceStub(self.channel)

  def stream(self, prompt: str | Sequence[int] | pb.GenerateRequest,
             **params: Any) -> Iterator[pb.GenerateResponse]:
    req = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
    return self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata)

  def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest,
               **params: Any) -> Completion:
    done = Completion(sent_at=time.perf_counter())
    for chunk in self.stream(prompt, **params):
      done.add(chunk)
    return done

  def chat_stream(self, messages: Sequence[dict] | pb.ChatRequest,
                  **params: Any) -> Iterator[pb.ChatResponse]:
    """Streams a Chat call (`build_chat_request`'s arguments)."""
    req = (messages if isinstance(messages, pb.ChatRequest)
           else build_chat_request(messages, **params))
    return self.stub.Chat(req, timeout=self.timeout, metadata=self.metadata)

  def abort(self, request_id: str) -> bool:
    return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                           metadata=self.metadata).aborted

  def model_info(self) -> pb.ModelInfo:
    return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                  metadata=self.metadata)

  def server_load(self) -> pb.ServerLoad:
    return self.stub.GetServerLoad(pb.GetServerLoadRequest(), timeout=self.timeout,
                                   metadata=self.metadata)

  def tokenize(self, text: str) -> list[int]:
    return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout,
                                   metadata=self.metadata).token_ids)

  def detokenize(self, ids: Sequence[int]) -> str:
    return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=self.timeout,
                                metadata=self.metadata).text

  def health(self, service: str = "") -> str:
    """"SERVING", "NOT_SERVING", ... of the standard health service."""
    status = health_pb2_grpc.HealthStub(self.channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=self.timeout).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

  def close(self) -> None:
    self.channel.close()

  def __enter__(self) -> "InferenceClient":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


class AsyncInferenceClient(_Base):
  """asyncio client (grpc.aio); create it inside the running event loop."""

  def __init__(self, target: str, api_key: str | None = None, tls: bool = False,
               root_certificates: bytes | None = None, timeout: float | None = None):
    super().__init__(api_key, timeout)
    self.channel = (grpc.aio.secure_channel(target, _credentials(root_certificates),
                                            CHANNEL_OPTIONS)
                    if tls or root_certificates else
                    grpc.aio.insecure_channel(target, CHANNEL_OPTIONS))
    self.stub = pb_grpc.InferenceStub(self.channel)

  def stream(self, prompt: str | Sequence[int] | pb.GenerateRequest,
             **params: Any) -> AsyncIterator[pb.GenerateResponse]:
    req = prompt if isinstance(prompt, pb.GenerateRequest) else build_request(prompt, **params)
    return self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata)

  async def generate(self, prompt: str | Sequence[int] | pb.GenerateRequest,
                     **params: Any) -> Completion:
    done = Completion(sent_at=time.perf_counter())
    async for chunk in self.stream(prompt, **params):
      done.add(chunk)
    return done

  def chat_stream(self, messages: Sequence[dict] | pb.ChatRequest,
                  **params: Any) -> AsyncIterator[pb.ChatResponse]:
    req = (messages if isinstance(messages, pb.ChatRequest)
           else build_chat_request(messages, **params))
    return self.stub.Chat(req, timeout=self.timeout, metadata=self.metadata)

  async def abort(self, request_id: str) -> bool:
    return (await self.stub.Abort(pb.AbortRequest(request_id=request_id),
                                  timeout=self.timeout, metadata=self.metadata)).aborted

  async def model_info(self) -> pb.ModelInfo:
    return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                        metadata=self.metadata)

  async def server_load(self) -> pb.ServerLoad:
    return await self.stub.GetServerLoad(pb.GetServerLoadRequest(), timeout=self.timeout,
                                         metadata=self.metadata)

  async def close(self) -> None:
    await self.channel.close()

  async def __aenter__(self) -> "AsyncInferenceClient":
    return self

  async def __aexit__(self, *exc: Any) -> None:
    await self.close()
