"""`InferenceServicer`: the `moejax.v1.Inference` RPCs over an `InferenceServer` (`server.py`).

Each RPC authorises, validates (INVALID_ARGUMENT naming the field), and for `Generate` admits
the request and streams the engine's deltas (`response_from_output`) until it finishes; a
stream that ends first (client cancel, deadline, error) aborts its request once.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

import grpc
from absl import logging

from engine.chat.reasoning import ReasoningSplitter
from engine.chat.stream import ChatStream
from engine.runtime.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RequestOutput
from engine.service import chat, structured, validation, wire
from engine.service.proto import inference_pb2 as pb
from engine.service.proto import inference_pb2_grpc as pb_grpc
from engine.service.streams import Rejected, RequestGroup

if TYPE_CHECKING:  # server.py imports this module
  from engine.service.server import InferenceServer

FINISH_REASONS = {FINISH_STOP: pb.FINISH_REASON_STOP, FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
                  FINISH_ABORT: pb.FINISH_REASON_ABORT}


def response_from_output(out: RequestOutput, reasoning: ReasoningSplitter | None,
                         answer_started_s: float | None,
                         tokenizer: Any = None) -> pb.GenerateResponse:
  """One stream message for one engine delta; the final one carries FinalInfo."""
  resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids)
  for lp in out.new_logprobs or ():
    entry = resp.logprobs.add(logprob=lp.logprob)
    for token_id, value in lp.top:
      entry.top.add(token_id=token_id, logprob=value)
  if reasoning is None:
    resp.text = out.text_delta
  else:
    split = reasoning.split_ids(out.new_token_ids, out.text_delta, tokenizer)
    resp.text, resp.reasoning_text = split.answer_text, split.reasoning_text
    resp.num_reasoning_tokens = split.num_reasoning_tokens
  if out.finished:
    fill_final(resp.final, out)
    if reasoning is not None:
      resp.final.usage.reasoning_tokens = reasoning.reasoning_tokens
    if answer_started_s is not None:
      resp.final.timings.time_to_first_answer_token_s = answer_started_s
  return resp


def fill_final(final: pb.FinalInfo, out: RequestOutput) -> None:
  """A finished request's FinalInfo: finish reason, matched stop, usage, timings."""
  final.finish_reason = FINISH_REASONS[out.finish_reason]
  if isinstance(out.stop_reason, str):
    final.stop_str = out.stop_reason
  elif out.stop_reason is not None:
    final.stop_token_id = out.stop_reason
  final.usage.prompt_tokens = out.usage.prompt_tokens
  final.usage.cached_tokens = out.usage.cached_tokens
  final.usage.completion_tokens = out.usage.completion_tokens
  final.speculative.num_drafts = out.usage.spec_drafts
  final.speculative.num_draft_tokens = out.usage.spec_draft_tokens
  final.speculative.num_accepted_tokens = out.usage.spec_accepted_tokens
  t = out.timings
  final.timings.queue_s = t.queue_s or 0.0
  final.timings.ttft_s = t.ttft_s or 0.0
  final.timings.e2e_s = t.e2e_s or 0.0
  final.timings.encode_s = t.encode_s


def chat_response(out: RequestOutput, stream: ChatStream) -> pb.ChatResponse:
  """One Chat stream message for one engine delta, through the request's output parser."""
  delta = stream.feed(out)
  resp = pb.ChatResponse(request_id=out.request_id, content=delta.content,
                         reasoning_content=delta.reasoning, token_ids=out.new_token_ids)
  for call in delta.tool_calls:
    resp.tool_calls.add(index=call.index, id=call.id or "", name=call.name or "",
                        arguments=call.arguments)
  for lp in out.new_logprobs or ():
    entry = resp.logprobs.add(logprob=lp.logprob)
    for token_id, value in lp.top:
      entry.top.add(token_id=token_id, logprob=value)
  if out.finished:
    fill_final(resp.final, out)
    resp.final.usage.reasoning_tokens = stream.reasoning_tokens
    if stream.finish_reason(out) == chat.FINISH_TOOL_CALLS:
      resp.final.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    for call in stream.tool_calls:
      resp.complete_tool_calls.add(id=call["id"], type="function", function=pb.FunctionCall(
          name=call["function"]["name"], arguments=call["function"]["arguments"]))
  return resp


class InferenceServicer(pb_grpc.InferenceServicer):
  """The RPC handlers; state lives in the InferenceServer."""

  def __init__(self, server: InferenceServer):
    self.srv = server
    self.engine = server.engine

  async def _reject(self, context: grpc.aio.ServicerContext, e: Rejected) -> None:
    self.srv.metrics.request_rejected.labels(code=e.code.name).inc()
    await context.abort(e.code, str(e))

  async def reject_bad_bytes(self, context: grpc.aio.ServicerContext,
                             bad: wire.BadRequest) -> None:
    """A request whose bytes did not decode (`wire.deserializer`)."""
    await self._reject(context, Rejected(grpc.StatusCode.INVALID_ARGUMENT, bad.message))

  async def _parse(self, context: grpc.aio.ServicerContext, named: str,
                   fn: Callable[..., Any], *args: Any) -> Any:
    """Key check, then fn(*args) on a tokenizer thread (FieldError -> INVALID_ARGUMENT). The
    named id is marked as being tokenised meanwhile, so an Abort naming it is kept."""
    srv, parsed = self.srv, None
    srv.tokenizing[named] += 1
    try:
      srv.check_api_key(context)
      parsed = await srv.tokenize(fn, *args)
    except validation.FieldError as e:
      await self._reject(context, Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
    except Rejected as e:
      await self._reject(context, e)
    finally:
      srv.tokenizing[named] -= 1
      if not srv.tokenizing[named]:
        del srv.tokenizing[named]
        if parsed is None:  # refused or cancelled: nothing left to abort
          srv.early_aborts.discard(named)
    return parsed

  async def _stream(self, context: grpc.aio.ServicerContext, parsed: validation.ParsedRequest,
                    convert: Callable[[RequestOutput], Any], api: str = "grpc.Generate"):
    """Admits the request and yields convert(output) until it finishes (see RequestGroup)."""
    rid = parsed.request_id or f"req-{uuid.uuid4().hex}"
    group = RequestGroup(self.srv, [(parsed, rid)], api=api)
    try:
      async with group:
        async for _, item in group:
          try:
            response = convert(item)
          except Exception:
            group.fail()
            logging.exception("request %s: internal error while streaming", rid)
            raise Rejected(grpc.StatusCode.INTERNAL, f"request {rid}: internal error")
          yield response
    except Rejected as e:
      if group.failed or e.code == grpc.StatusCode.INTERNAL:
        await context.abort(e.code, str(e))  # ended by the server: not counted as refused
      await self._reject(context, e)

  async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
    srv, engine = self.srv, self.engine
    parsed = await self._parse(context, request.request_id, structured.parse_generate,
                               request, engine.tokenizer, srv.limits)
    reasoning = (ReasoningSplitter.for_ids(srv.config.reasoning)
                 if srv.config.reasoning is not None else None)
    answer_started_s: float | None = None

    def convert(item: RequestOutput) -> pb.GenerateResponse:
      nonlocal answer_started_s
      was_answering = reasoning is not None and reasoning.answer_started
      response = response_from_output(item, reasoning, answer_started_s, engine.tokenizer)
      if reasoning is not None and reasoning.answer_started and not was_answering:
        answer_started_s = time.monotonic() - item.timings.arrival
        if item.finished:
          response.final.timings.time_to_first_answer_token_s = answer_started_s
      return response

    async for response in self._stream(context, parsed, convert):
      yield response

  async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext):
    srv, engine = self.srv, self.engine
    parsed, inputs = await self._parse(
        context, request.request_id, chat.parse_chat_request, request, engine.chat_template,
        engine.tokenizer, srv.limits, srv.chat_family, srv.vision)
    stream = chat.stream_for(inputs)
    async for response in self._stream(context, parsed, lambda out: chat_response(out, stream),
                                       "grpc.Chat"):
      yield response

  async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
    try:
      self.srv.check_api_key(context)
    except Rejected as e:
      await self._reject(context, e)
    rid = request.request_id
    if rid and rid in self.srv.tokenizing:  # its add comes after this; the abort follows it
      self.srv.early_aborts.add(rid)
      return pb.AbortResponse(aborted=True)
    aborted = await self.srv.call_engine(self.engine.abort, rid)
    self.srv.engine_loop.wake()
    return pb.AbortResponse(aborted=aborted)

  async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                         context: grpc.aio.ServicerContext):
    try:
      self.srv.check_api_key(context)
    except Rejected as e:
      await self._reject(context, e)
    engine, cfg = self.engine, self.engine.cfg
    leaf = engine.params["embed"]
    info = pb.ModelInfo(
        model_name=self.srv.config.model_name, architecture=self.srv.config.architecture or
        cfg.display_name, model_type=cfg.model_type,
        max_model_len=engine.sched_config.max_model_len, vocab_size=cfg.vocab_size,
        eos_token_ids=engine.eos_token_ids, dtype=str(leaf.dtype),
        devices=sorted(str(d) for d in leaf.sharding.device_set),
        has_tokenizer=engine.tokenizer is not None, page_size=engine.config.page_size,
        max_num_seqs=engine.config.max_num_seqs)
    if self.srv.config.reasoning is not None:
      info.think_start_token_id = self.srv.config.reasoning.think_start_token_id
      info.think_end_token_id = self.srv.config.reasoning.think_end_token_id
    return info

  async def GetServerLoad(self, request: pb.GetServerLoadRequest,
                          context: grpc.aio.ServicerContext):
    try:
      self.srv.check_api_key(context)
    except Rejected as e:
      await self._reject(context, e)
    s, queued = await self.srv.call_engine(lambda: (self.engine.stats(),
                                                    self.engine.queue_load()))
    prompt_tps, gen_tps = self.srv.throughput()
    return pb.ServerLoad(
        num_requests_running=s["num_requests_running"],
        num_requests_waiting=s["num_requests_waiting"], num_waiting_tokens=queued.tokens,
        kv_cache_usage=s["kv_cache_usage_perc"], prompt_tokens_per_s=prompt_tps,
        generation_tokens_per_s=gen_tps, num_preemptions=s["num_preemptions"],
        serving=self.srv.state == "serving")

  async def _tokenizer(self, context: grpc.aio.ServicerContext) -> Any:
    try:
      self.srv.check_api_key(context)
      if self.engine.tokenizer is None:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
    except Rejected as e:
      await self._reject(context, e)
    return self.engine.tokenizer

  async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
    tokenizer = await self._tokenizer(context)
    try:
      validation.check_prompt_chars(request.text, self.srv.limits)
    except validation.FieldError as e:
      await self._reject(context, Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
    ids = await self.srv.tokenize(validation.encode, tokenizer, request.text)
    return pb.TokenizeResponse(token_ids=ids)

  async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):
    tokenizer = await self._tokenizer(context)
    try:
      ids = validation.check_token_ids("token_ids", request.token_ids,
                                       self.engine.cfg.vocab_size)
    except validation.FieldError as e:
      await self._reject(context, Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
    text = await self.srv.tokenize(validation.decode, tokenizer, ids)
    return pb.DetokenizeResponse(text=text)

