"""`/v1/chat/completions`: the request body -> engine requests, outputs -> OpenAI objects.

The conversation goes through `chat.prepare` (template, tools, tool_choice, template kwargs,
thinking: Moonshot's `thinking` object, `reasoning_effort`, vLLM's `thinking_token_budget`,
and the output constraint: tool_choice required/named or `response_format`);
sampling, stop and stream fields through `openai_protocol.common`, as for completions, with
`max_completion_tokens` preferred over `max_tokens`. Each choice's output is parsed by its own
`chat.ChatStream`: `content`, `reasoning_content` and `tool_calls` in deltas and messages, and
finish_reason "tool_calls" when a request that stopped by itself called tools; usage counts
the reasoning tokens (`completion_tokens_details.reasoning_tokens`).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from engine.chat import thinking as thinking_controls
from engine.chat.parser_base import ChatDelta, ToolCallDelta
from engine.runtime.request import RequestOutput
from engine.runtime.sampling import MAX_TOP_LOGPROBS
from engine.service import chat
from engine.service import openai_protocol as protocol
from engine.service.openai_protocol import get
from engine.service.validation import FieldError, ParsedRequest, RequestLimits


@dataclasses.dataclass(frozen=True)
class ChatPlan:
  id: str
  common: protocol.Common
  requests: list[ParsedRequest]
  inputs: chat.ChatInputs
  logprobs: bool


def parse_chat(raw: bytes, template: Any, tokenizer: Any, limits: RequestLimits, served: str,
               family: str | None, vision: chat.Vision | None = None,
               base_id: str | None = None) -> ChatPlan:
  """A /v1/chat/completions body -> engine requests (runs on a tokenizer thread)."""
  body = protocol.load_body(raw)
  if "messages" not in body:
    raise FieldError("messages", "is required")
  logprobs = get(body, "logprobs", bool, False)
  top = get(body, "top_logprobs", int, None)
  if top is not None:
    if not logprobs:
      raise FieldError("top_logprobs", "requires logprobs = true")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
      raise FieldError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
  c = protocol.common(body, limits, served, logprobs=(top or 0) if logprobs else None,
                      max_tokens_names=("max_completion_tokens", "max_tokens"))
  parallel = get(body, "parallel_tool_calls", bool, True)
  request = chat.ChatRequest(
      messages=body["messages"], tools=body.get("tools"), tool_choice=body.get("tool_choice"),
      template_kwargs=get(body, "chat_template_kwargs", dict, None), response=c.constraint,
      parallel_tool_calls=parallel, thinking=thinking_of(body))
  inputs = chat.prepare(template, tokenizer, limits, request, family=family, vision=vision)
  plan_id = f"chatcmpl-{base_id or secrets.token_hex(12)}"
  requests = protocol.choice_requests(plan_id, [inputs.prompt_ids], c, skip_special_tokens=False,
                                      prompt_field="messages", images=inputs.images)
  return ChatPlan(plan_id, c, chat.constrain(requests, inputs), inputs, logprobs)


def thinking_of(body: dict, effort_field: str = "reasoning_effort",
                effort: str | None = None) -> thinking_controls.Thinking:
  """Moonshot's `thinking`, the effort and vLLM's `thinking_token_budget` as one setting."""
  effort = get(body, effort_field, str, None) if effort is None else effort
  try:
    by_effort = (thinking_controls.from_effort(effort, effort_field)
                 if effort is not None else None)
    return thinking_controls.combine(
        chat.thinking_object(body.get("thinking"), "thinking"),
        thinking_controls.Thinking(None, chat.check_budget(body.get("thinking_token_budget"),
                                                           "thinking_token_budget"),
                                   "thinking_token_budget"),
        by_effort)
  except ValueError as e:
    raise chat.field_error(e, "thinking") from None


def tool_call_json(call: ToolCallDelta) -> dict:
  fn: dict[str, Any] = {"arguments": call.arguments}
  out: dict[str, Any] = {"index": call.index}
  if call.id is not None:
    out.update(id=call.id, type="function")
  if call.name is not None:
    fn["name"] = call.name
  out["function"] = fn
  return out


def delta_json(delta: ChatDelta) -> dict:
  out: dict[str, Any] = {}
  if delta.reasoning:
    out["reasoning_content"] = delta.reasoning
  if delta.content:
    out["content"] = delta.content
  if delta.tool_calls:
    out["tool_calls"] = [tool_call_json(c) for c in delta.tool_calls]
  return out


class ChatChoices:
  """The choices of one call: a parser per choice, their chunks and their messages."""

  def __init__(self, plan: ChatPlan, tokenizer: Any):
    self.plan, self.tokenizer = plan, tokenizer
    self.streams = [chat.stream_for(plan.inputs) for _ in plan.requests]
    self.logprobs: list[list[dict]] = [[] for _ in plan.requests]
    self.last: list[RequestOutput | None] = [None] * len(plan.requests)
    self.usage = protocol.UsageTally(plan.common.n)
    self.created = protocol.now()

  def object(self, kind: str, choices: list, **extra: Any) -> dict:
    usage = ({"usage": None} if kind == "chat.completion.chunk" and
             self.plan.common.include_usage else {})
    return {"id": self.plan.id, "object": kind, "created": self.created,
            "model": self.plan.common.model, "choices": choices, **usage, **extra}

  def first_chunks(self) -> list[dict]:
    return [self.object("chat.completion.chunk", [{
        "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None}]) for i in range(len(self.plan.requests))]

  def feed(self, index: int, out: RequestOutput) -> dict | None:
    """The chunk for one engine delta (None when it settles nothing new)."""
    self.usage.add(index, out)
    self.last[index] = out
    stream = self.streams[index]
    delta = stream.feed(out)
    lp = None
    if self.plan.logprobs and out.new_token_ids:
      lp = protocol.chat_logprobs(self.tokenizer, out.new_token_ids, out.new_logprobs or [])
      self.logprobs[index].extend(lp)
    reason = stream.finish_reason(out)
    if not delta and reason is None and lp is None:
      return None
    choice = {"index": index, "delta": delta_json(delta),
              "logprobs": None if lp is None else {"content": lp}, "finish_reason": reason}
    if reason is not None:
      choice["stop_reason"] = out.stop_reason
    return self.object("chat.completion.chunk", [choice])

  def usage_json(self) -> dict:
    return self.usage.json(sum(s.reasoning_tokens for s in self.streams))

  def usage_chunk(self) -> dict:
    return self.object("chat.completion.chunk", [], usage=self.usage_json())

  def completion(self) -> dict:
    choices = []
    for i, (stream, out) in enumerate(zip(self.streams, self.last)):
      if out is None:
        continue
      content, reasoning = "".join(stream.content), "".join(stream.reasoning)
      message = {"role": "assistant", "content": None if stream.tool_calls and not content
                 else content,
                 "reasoning_content": reasoning or None, "tool_calls": stream.tool_calls}
      choices.append({"index": i, "message": message,
                      "logprobs": {"content": self.logprobs[i]} if self.plan.logprobs else None,
                      "finish_reason": stream.finish_reason(out),
                      "stop_reason": out.stop_reason})
    return self.object("chat.completion", choices, usage=self.usage_json())
