"""`InferenceServicer`: the `moejax.v1.Inference` RPCs over an `InferenceServer` (`server.py`).

Each RPC authorises, validates (INVALID_ARGUMENT naming the field), and for `Generate` admits
the request and streams the engine's deltas (`response_from_output`) until it finishes; a
stream that ends first (client cancel, deadline, error) aborts its request once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable

import grpc
from absl import logging

from engine.runtime.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RequestOutput
from engine.service import validation, wire
from engine.service.engine_loop import EngineFailure
from engine.service.proto import inference_pb2 as pb
from engine.service.proto import inference_pb2_grpc as pb_grpc
from engine.service.reasoning import ReasoningState

FINISH_REASONS = {FINISH_STOP: pb.FINISH_REASON_STOP, FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
                  FINISH_ABORT: pb.FINISH_REASON_ABORT}


class Rejected(Exception):
  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


def response_from_output(out: RequestOutput, reasoning: ReasoningState | None,
                         answer_started_s: float | None) -> pb.GenerateResponse:
  """One stream message for one engine delta; the final one carries FinalInfo."""
  resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids)
  for lp in out.new_logprobs or ():
    entry = resp.logprobs.add(logprob=lp.logprob)
    for token_id, value in lp.top:
      entry.top.add(token_id=token_id, logprob=value)
  if reasoning is None:
    resp.text = out.text_delta
  else:
    split = reasoning.split(out.new_token_ids, out.text_delta)
    resp.text, resp.reasoning_text = split.answer_text, split.reasoning_text
    resp.num_reasoning_tokens = split.num_reasoning_tokens
  if out.finished:
    final = resp.final
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
    if answer_started_s is not None:
      final.timings.time_to_first_answer_token_s = answer_started_s
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

  async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
    srv, engine = self.srv, self.engine
    named, parsed = request.request_id, None
    srv.tokenizing[named] += 1
    try:
      srv.check_api_key(context)
      parsed = await srv.tokenize(validation.parse_generate, request, engine.tokenizer,
                                  srv.limits)
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
    rid = parsed.request_id or f"req-{uuid.uuid4().hex}"
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def deliver(item: Any) -> None:  # called on the engine thread
      try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
      except RuntimeError:  # the event loop has closed (server stopped): nobody is listening
        pass

    try:
      await srv.call_engine(srv.admit, parsed, rid, deliver)
    except Rejected as e:
      await self._reject(context, e)
    except asyncio.CancelledError:  # cancelled while admitted: the abort queues after the add
      srv.submit_engine_call(srv.end_stream, rid, deliver, True)
      raise
    async for response in self._stream(rid, queue, deliver, context):
      yield response

  async def _stream(self, rid: str, queue: asyncio.Queue, deliver: Callable[[Any], None],
                    context: grpc.aio.ServicerContext):
    srv, engine, metrics = self.srv, self.engine, self.srv.metrics
    reasoning = (ReasoningState(srv.config.reasoning, engine.tokenizer)
                 if srv.config.reasoning is not None else None)
    finished = failed = False
    last_chunk: float | None = None
    answer_started_s: float | None = None
    try:
      while not finished:
        item = await queue.get()
        if isinstance(item, EngineFailure):
          failed = True
          await context.abort(grpc.StatusCode.INTERNAL, f"request {rid}: {item.message}")
        if item.finish_reason == FINISH_ABORT and rid in srv.drain_aborted:
          failed = True
          await context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"request {rid}: server shut down before it finished")
        now = time.monotonic()
        if item.new_token_ids:
          if last_chunk is not None:
            for _ in item.new_token_ids:
              metrics.itl.observe((now - last_chunk) / len(item.new_token_ids))
          last_chunk = now
        try:
          was_answering = reasoning is not None and reasoning.answer_started
          response = response_from_output(item, reasoning, answer_started_s)
          if reasoning is not None and reasoning.answer_started and not was_answering:
            answer_started_s = now - item.timings.arrival
            if item.finished:
              response.final.timings.time_to_first_answer_token_s = answer_started_s
        except Exception:
          failed = True
          logging.exception("request %s: internal error while streaming", rid)
          await context.abort(grpc.StatusCode.INTERNAL, f"request {rid}: internal error")
        if item.finished:
          finished = True
          srv.engine_loop.unsubscribe(rid)  # the id is free once the client has the final
          metrics.observe_finished(item.finish_reason, item.timings, item.usage)
        yield response
    finally:
      srv.drain_aborted.discard(rid)
      if not finished:  # cancelled, deadline passed, or failed: end the request once
        srv.submit_engine_call(srv.end_stream, rid, deliver, not failed)

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

