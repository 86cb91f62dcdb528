"""`/v1/messages`: Anthropic's Messages API (Claude Code and the agents built on it) over the
engine's chat request, and `/v1/messages/count_tokens`.

A body becomes one `chat.ChatRequest`: `system` (a string or text blocks) first, `messages` of
content blocks (text, image with a base64 or url source, `tool_use` -> the assistant turn's
tool calls, `tool_result` -> tool messages before the user's other blocks, `thinking` -> the
turn's `reasoning_content`; `redacted_thinking` dropped), `tools` with `input_schema`,
`tool_choice` (auto, any -> required, tool -> a named function, none;
`disable_parallel_tool_use`), `stop_sequences`, `temperature` / `top_p` / `top_k`,
`max_tokens` (required), `thinking` ({type: enabled, budget_tokens} below max_tokens: on with
that budget; {type: disabled}; {type: adaptive}: on), `metadata` (accepted). Keys come as
`x-api-key` or Bearer; `anthropic-version` is accepted. Without `thinking` the template's
default holds (K2.5 thinks).

The reply is a `message`: a `thinking` block (the thought; its `signature` a digest of it, not
checked on the way back), a `text` block, `tool_use` blocks (input: the arguments as an object);
`stop_reason` end_turn / max_tokens / stop_sequence (with `stop_sequence`) / tool_use; usage as
Anthropic counts it (`input_tokens` the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were). Streaming sends Anthropic's events: message_start,
ping, then per block content_block_start, content_block_delta (thinking_delta then a
signature_delta, text_delta, input_json_delta), content_block_stop; message_delta with the
stop reason and usage; message_stop. Errors: `{"type": "error", "error": {"type", "message"}}`
(in a stream: an `error` event).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from typing import Any

from engine.runtime.request import FINISH_LENGTH, FINISH_STOP, RequestOutput
from engine.service import chat
from engine.service import openai_protocol as protocol
from engine.service.openai_protocol import get
from engine.service.validation import FieldError, ParsedRequest, RequestLimits

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
_RENAMES = ((r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
            (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
            (r"^tool_choice\.function\.name", "tool_choice.name"),
            (r"^stop$", "stop_sequences"), (r"^max_tokens$", "max_tokens"))


def error_body(message: str, status: int) -> dict:
  return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                     "message": message}}


@dataclasses.dataclass(frozen=True)
class MessagesPlan:
  id: str
  common: protocol.Common
  requests: list[ParsedRequest]
  inputs: chat.ChatInputs


# ---- input ----------------------------------------------------------------------------------

def _image_url(source: Any, where: str) -> str:
  if not isinstance(source, dict):
    raise FieldError(f"{where}.source", "must be an object (type base64 or url)")
  if source.get("type") == "base64":
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
      raise FieldError(f"{where}.source", "base64 sources need media_type and data strings")
    return f"data:{media};base64,{data}"
  if source.get("type") == "url" and isinstance(source.get("url"), str):
    return source["url"]
  raise FieldError(f"{where}.source.type", "must be 'base64' or 'url'")


def _tool_result_text(content: Any, where: str) -> tuple[str, list[dict]]:
  """A tool_result's text, and its image blocks as chat image parts."""
  if content is None or isinstance(content, str):
    return content or "", []
  if not isinstance(content, list):
    raise FieldError(f"{where}.content", "must be a string or an array of blocks")
  texts, images = [], []
  for k, block in enumerate(content):
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
      texts.append(block["text"])
    elif kind == "image":
      images.append({"type": "image_url", "image_url": {
          "url": _image_url(block.get("source"), f"{where}.content[{k}]")}})
    else:
      raise FieldError(f"{where}.content[{k}].type", "must be text or image")
  return "\n".join(texts), images


def chat_messages(system: Any, messages: Any) -> tuple[list[dict], list[str]]:
  """Anthropic system + messages -> chat messages, and where each came from."""
  out: list[dict] = []
  origins: list[str] = []
  if system is not None:
    if isinstance(system, list):
      texts = []
      for k, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" \
            or not isinstance(block.get("text"), str):
          raise FieldError(f"system[{k}]", "must be a text block")
        texts.append(block["text"])
      system = "\n".join(texts)
    if not isinstance(system, str):
      raise FieldError("system", "must be a string or an array of text blocks")
    if system:
      out.append({"role": "system", "content": system})
      origins.append("system")
  if not isinstance(messages, list) or not messages:
    raise FieldError("messages", "must be a non-empty array of messages")
  for i, msg in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
      raise FieldError(where, "must be an object")
    role = msg.get("role")
    if role not in ("user", "assistant"):
      raise FieldError(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
    content = msg.get("content")
    if isinstance(content, str):
      out.append({"role": role, "content": content})
      origins.append(where)
      continue
    if not isinstance(content, list):
      raise FieldError(f"{where}.content", "must be a string or an array of content blocks")
    parts: list[dict] = []
    calls: list[dict] = []
    thinking: list[str] = []
    for k, block in enumerate(content):
      at = f"{where}.content[{k}]"
      kind = block.get("type") if isinstance(block, dict) else None
      if kind == "text":
        if not isinstance(block.get("text"), str):
          raise FieldError(f"{at}.text", "must be a string")
        parts.append({"type": "text", "text": block["text"]})
      elif kind == "image":
        parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"),
                                                                            at)}})
      elif kind == "tool_use" and role == "assistant":
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
          raise FieldError(at, "tool_use blocks need id and name strings")
        args = block.get("input", {})
        if not isinstance(args, dict):
          raise FieldError(f"{at}.input", "must be an object")
        calls.append({"id": block["id"], "type": "function", "function": {
            "name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
      elif kind == "tool_result" and role == "user":
        if not isinstance(block.get("tool_use_id"), str):
          raise FieldError(f"{at}.tool_use_id", "must be a string")
        text, images = _tool_result_text(block.get("content"), at)
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        origins.append(at)
        parts.extend(images)   # images a tool returned: shown to the model as the user's
      elif kind == "thinking" and role == "assistant":
        if not isinstance(block.get("thinking"), str):
          raise FieldError(f"{at}.thinking", "must be a string")
        thinking.append(block["thinking"])
      elif kind == "redacted_thinking" and role == "assistant":
        continue
      else:
        raise FieldError(f"{at}.type", f"{kind!r} blocks are not supported in {role} messages")
    if role == "assistant":
      turn: dict[str, Any] = {"role": "assistant",
                              "content": "".join(p["text"] for p in parts) if parts else None}
      if calls:
        turn["tool_calls"] = calls
      elif not parts:
        turn["content"] = ""
      if thinking:
        turn["reasoning_content"] = "".join(thinking)
      out.append(turn)
      origins.append(where)
    elif parts:
      out.append({"role": "user", "content": parts})
      origins.append(where)
  return out, origins


def chat_tools(tools: Any) -> list[dict] | None:
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise FieldError("tools", "must be an array")
  out = []
  for i, tool in enumerate(tools):
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
      raise FieldError(f"tools[{i}].type", "only client tools (name, input_schema) are "
                       "supported by this server")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
      raise FieldError(f"tools[{i}].input_schema", "is required: a JSON schema object")
    fn = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
      fn["description"] = tool["description"]
    out.append({"type": "function", "function": fn})
  return out


def chat_tool_choice(choice: Any, tools: Any) -> tuple[Any, bool]:
  """tool_choice -> (chat tool_choice, parallel calls allowed)."""
  if choice is None:
    return None, True
  if not isinstance(choice, dict):
    raise FieldError("tool_choice", "must be an object with type auto, any, tool or none")
  kind = choice.get("type")
  parallel = not get(choice, "disable_parallel_tool_use", bool, False,
                     "tool_choice.disable_parallel_tool_use")
  if kind == "auto":
    return ("auto" if tools else None), parallel
  if kind == "any":
    return "required", parallel
  if kind == "none":
    return "none", parallel
  if kind == "tool":
    return {"type": "function", "function": {"name": choice.get("name")}}, parallel
  raise FieldError("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")


def _request(body: dict, max_tokens: int | None) -> tuple[chat.ChatRequest, list[str]]:
  tools = chat_tools(body.get("tools"))
  choice, parallel = chat_tool_choice(body.get("tool_choice"), tools)
  value = body.get("thinking")
  if isinstance(value, dict) and value.get("type") == "adaptive":
    thinking = chat.Thinking(True, None, "thinking")
  else:
    thinking = chat.thinking_object(value, "thinking", budget_key="budget_tokens",
                                    max_tokens=max_tokens) or chat.Thinking()
  messages, origins = chat_messages(body.get("system"), body.get("messages"))
  return chat.ChatRequest(messages=messages, tools=tools, tool_choice=choice,
                          template_kwargs=get(body, "chat_template_kwargs", dict, None),
                          parallel_tool_calls=parallel, thinking=thinking), origins


def _prepare(body, template, tokenizer, limits, family, vision, max_tokens=None):
  request, origins = _request(body, max_tokens)
  try:
    return chat.prepare(template, tokenizer, limits, request, family=family, vision=vision)
  except FieldError as e:
    raise chat.renamed(e, origins, _RENAMES) from None


def parse_messages(raw: bytes, template: Any, tokenizer: Any, limits: RequestLimits,
                   served: str, family: str | None, vision: chat.Vision | None,
                   base_id: str | None = None) -> MessagesPlan:
  """A /v1/messages body -> the engine request (runs on a tokenizer thread)."""
  body = protocol.load_body(raw)
  max_tokens = get(body, "max_tokens", int, None)
  if max_tokens is None:
    raise FieldError("max_tokens", "is required")
  stop = get(body, "stop_sequences", list, [])
  sub = {"model": body.get("model"), "temperature": body.get("temperature"),
         "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stream": body.get("stream"),
         "max_tokens": max_tokens, "stop": stop}
  try:
    c = protocol.common({k: v for k, v in sub.items() if v is not None}, limits, served,
                        logprobs=None, max_tokens_names=("max_tokens",))
  except FieldError as e:
    raise chat.renamed(e, [], _RENAMES) from None
  if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
    raise FieldError("metadata", "must be an object")
  inputs = _prepare(body, template, tokenizer, limits, family, vision, max_tokens)
  plan_id = f"msg_{base_id or secrets.token_hex(12)}"
  try:
    requests = protocol.choice_requests(plan_id, [inputs.prompt_ids], c,
                                        skip_special_tokens=False, prompt_field="messages",
                                        images=inputs.images)
  except FieldError as e:
    raise chat.renamed(e, [], _RENAMES) from None
  return MessagesPlan(plan_id, c, chat.constrain(requests, inputs), inputs)


def count_tokens(raw: bytes, template: Any, tokenizer: Any, limits: RequestLimits, served: str,
                 family: str | None, vision: chat.Vision | None) -> dict:
  """/v1/messages/count_tokens: the prompt's tokens as the request would render."""
  body = protocol.load_body(raw)
  protocol.check_model(body, served)
  inputs = _prepare(body, template, tokenizer, limits, family, vision)
  return {"input_tokens": len(inputs.prompt_ids)}


# ---- output ---------------------------------------------------------------------------------

def signature(thinking: str) -> str:
  return hashlib.sha256(thinking.encode()).hexdigest()


def tool_input(arguments: str) -> dict:
  """A call's arguments as the object tool_use carries (text that is no JSON object is kept
  under `_raw_arguments`, never lost)."""
  try:
    value = json.loads(arguments) if arguments.strip() else {}
  except ValueError:
    value = None
  return value if isinstance(value, dict) else {"_raw_arguments": arguments}


class MessageOutput:
  """One message's blocks as they grow: Anthropic's stream events and the final object."""

  def __init__(self, plan: MessagesPlan):
    self.plan = plan
    self.stream = chat.stream_for(plan.inputs)
    self.blocks: list[dict] = []
    self.open: int | None = None
    self.pending_space = ""
    self.last: RequestOutput | None = None
    self.dropped: set[int] = set()

  def _usage(self, out: RequestOutput | None) -> dict:
    if out is None:
      return {"input_tokens": 0, "output_tokens": 0}
    u = out.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens}

  def start_events(self, prompt_tokens: int) -> list[dict]:
    message = {"id": self.plan.id, "type": "message", "role": "assistant", "content": [],
               "model": self.plan.common.model, "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    return [{"type": "message_start", "message": message}, {"type": "ping"}]

  def _start(self, block: dict) -> list[dict]:
    self.blocks.append(block)
    self.open = len(self.blocks) - 1
    shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
    shown.pop("_index", None)
    shown.pop("_arguments", None)
    return [{"type": "content_block_start", "index": self.open, "content_block": shown}]

  def _stop(self) -> list[dict]:
    if self.open is None:
      return []
    i, block = self.open, self.blocks[self.open]
    self.open = None
    events = []
    if block["type"] == "thinking":
      block["signature"] = signature(block["thinking"])
      events.append({"type": "content_block_delta", "index": i,
                     "delta": {"type": "signature_delta", "signature": block["signature"]}})
    events.append({"type": "content_block_stop", "index": i})
    return events

  def _kind(self) -> str | None:
    return None if self.open is None else self.blocks[self.open]["type"]

  def feed(self, out: RequestOutput) -> list[dict]:
    self.last = out
    delta = self.stream.feed(out)
    events: list[dict] = []
    if delta.reasoning:
      if self._kind() != "thinking":
        events += self._stop() + self._start({"type": "thinking", "thinking": "",
                                              "signature": ""})
      self.blocks[self.open]["thinking"] += delta.reasoning
      events.append({"type": "content_block_delta", "index": self.open,
                     "delta": {"type": "thinking_delta", "thinking": delta.reasoning}})
    if delta.content:
      text = delta.content
      if self._kind() != "text":
        if not (self.pending_space + text).strip():
          self.pending_space, text = self.pending_space + text, ""
        else:
          text, self.pending_space = self.pending_space + text, ""
          events += self._stop() + self._start({"type": "text", "text": ""})
      if text:
        self.blocks[self.open]["text"] += text
        events.append({"type": "content_block_delta", "index": self.open,
                       "delta": {"type": "text_delta", "text": text}})
    for call in delta.tool_calls:
      block = self.blocks[self.open] if self._kind() == "tool_use" else None
      if block is None or block["_index"] != call.index:
        events += self._stop() + self._start({"type": "tool_use", "id": call.id,
                                              "name": call.name, "_index": call.index,
                                              "_arguments": ""})
        block = self.blocks[self.open]
      if call.arguments:
        block["_arguments"] += call.arguments
        events.append({"type": "content_block_delta", "index": self.open,
                       "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
    if out.finished:
      complete = {c["id"] for c in self.stream.tool_calls}
      if self._kind() == "tool_use" and self.blocks[self.open]["id"] not in complete:
        self.dropped.add(self.open)   # the token limit cut this call
      events += self._stop()
      reason, sequence = self.stop_reason()
      usage = self._usage(out)
      events += [{"type": "message_delta",
                  "delta": {"stop_reason": reason, "stop_sequence": sequence},
                  "usage": usage}, {"type": "message_stop"}]
    return events

  def stop_reason(self) -> tuple[str | None, str | None]:
    out = self.last
    if out is None or not out.finished:
      return None, None
    if out.finish_reason == FINISH_LENGTH:
      return "max_tokens", None
    if self.stream.finish_reason(out) == chat.FINISH_TOOL_CALLS:
      return "tool_use", None
    if out.finish_reason == FINISH_STOP and isinstance(out.stop_reason, str):
      return "stop_sequence", out.stop_reason
    return "end_turn", None

  def message(self) -> dict:
    content = []
    for i, block in enumerate(self.blocks):
      if i in self.dropped:
        continue
      if block["type"] == "tool_use":
        content.append({"type": "tool_use", "id": block["id"], "name": block["name"],
                        "input": tool_input(block["_arguments"])})
      elif block["type"] == "thinking":
        content.append({**block, "signature": signature(block["thinking"])})
      else:
        content.append(dict(block))
    reason, sequence = self.stop_reason()
    return {"id": self.plan.id, "type": "message", "role": "assistant", "content": content,
            "model": self.plan.common.model, "stop_reason": reason, "stop_sequence": sequence,
            "usage": self._usage(self.last)}


def sse(event: dict) -> bytes:
  return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
