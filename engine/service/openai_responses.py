"""`/v1/responses`: OpenAI's Responses API (Codex-style agents, the OpenAI Agents SDK) over the
engine's chat request.

A body becomes one `chat.ChatRequest`: `input` as text or items (messages with input_text /
input_image / output_text parts, `function_call`, `function_call_output`, `reasoning`, whose
text is the next assistant turn's `reasoning_content`), `instructions` first as a system
message, function `tools` and `tool_choice`, `text.format` (a JSON schema, through structured
outputs), `reasoning.effort` (and Moonshot's `thinking`, vLLM's `thinking_token_budget`),
`parallel_tool_calls`, `max_output_tokens`, `temperature` / `top_p` (and vLLM's `top_k`, `seed`).
`previous_response_id` prepends a stored response's conversation (its input and output; not
its instructions, as OpenAI documents); an unknown id is a 404. `store` (default true) keeps
the response in a bounded in-memory store (`ServerConfig.responses_store_size`, oldest out
first), which `GET /v1/responses/{id}` reads.

The output is a `response` object: a `reasoning` item (the thought, as `reasoning_text`), a
`message` with `output_text`, then `function_call` items (call_id: the model's call id);
status "completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens" when
the token limit cut it (a call it cut in half is left out); usage with cached and reasoning
tokens. Streaming sends OpenAI's event sequence (each event with its `sequence_number`):
response.created, response.in_progress, then per item output_item.added, content_part.added,
the deltas (response.reasoning_text.delta, response.output_text.delta,
response.function_call_arguments.delta), their .done events, content_part.done,
output_item.done; last response.completed or response.incomplete.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets
import threading
from typing import Any

from engine.runtime.request import FINISH_LENGTH, RequestOutput
from engine.service import chat, openai_chat, structured
from engine.service import openai_protocol as protocol
from engine.service.openai_protocol import get
from engine.service.validation import FieldError, ParsedRequest, RequestLimits

_ROLES = ("user", "system", "developer", "assistant")
_SAMPLING_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
                    "ignore_eos", "max_output_tokens")
_REFUSED = ("background", "conversation", "prompt")
# `prepare`'s paths in this API's terms (tools are flat here: tools[i].name).
_RENAMES = ((r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
            (r"^tool_choice\.function\.", "tool_choice."),
            (r"^response_format\.json_schema\.", "text.format."), (r"^response_format", "text.format"),
            (r"^chat_template_kwargs", "chat_template_kwargs"))


class NotFound(FieldError):
  """An id that names nothing stored: 404."""
  status, code = 404, "previous_response_not_found"


class ResponseStore:
  """Stored responses by id, the oldest dropped past `size` (thread-safe: read on tokenizer
  threads, written on the event loop)."""

  def __init__(self, size: int):
    self.size = size
    self._items: collections.OrderedDict[str, tuple[dict, list]] = collections.OrderedDict()
    self._lock = threading.Lock()

  def put(self, response: dict, conversation: list) -> None:
    if self.size <= 0:
      return
    with self._lock:
      self._items[response["id"]] = (response, conversation)
      while len(self._items) > self.size:
        self._items.popitem(last=False)

  def get(self, rid: str) -> tuple[dict, list] | None:
    with self._lock:
      return self._items.get(rid)

  def delete(self, rid: str) -> bool:
    with self._lock:
      return self._items.pop(rid, None) is not None


@dataclasses.dataclass(frozen=True)
class ResponsesPlan:
  id: str
  common: protocol.Common
  requests: list[ParsedRequest]
  inputs: chat.ChatInputs
  echo: dict          # the request's settings as the response object repeats them
  conversation: list  # the chat messages so far (without instructions), for the store
  store: bool


# ---- input ----------------------------------------------------------------------------------

def _text_of(value: Any, field: str, kinds: tuple[str, ...]) -> str:
  """Text of a string or a list of text parts (types `kinds`)."""
  if isinstance(value, str):
    return value
  if not isinstance(value, list):
    raise FieldError(field, "must be a string or an array of content parts")
  out = []
  for k, part in enumerate(value):
    if not isinstance(part, dict) or part.get("type") not in kinds \
        or not isinstance(part.get("text"), str):
      raise FieldError(f"{field}[{k}]", f"must be a text part ({', '.join(kinds)})")
    out.append(part["text"])
  return "".join(out)


def _content(content: Any, where: str) -> Any:
  """Message content: a string, or parts as chat content parts."""
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise FieldError(where, "must be a string or an array of content parts")
  parts = []
  for k, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
      if not isinstance(part.get("text"), str):
        raise FieldError(f"{where}[{k}].text", "must be a string")
      parts.append({"type": "text", "text": part["text"]})
    elif kind == "input_image":
      url = part.get("image_url")
      if not isinstance(url, str):
        raise FieldError(f"{where}[{k}].image_url", "must be a data: or http(s) URL (file_id "
                         "is not supported by this server)")
      parts.append({"type": "image_url", "image_url": {"url": url}})
    elif kind == "refusal":
      continue
    else:
      raise FieldError(f"{where}[{k}].type", f"must be input_text, input_image or output_text, "
                       f"got {kind!r}")
  return parts


def input_messages(value: Any, field: str = "input") -> tuple[list[dict], list[str]]:
  """Responses input (text or items) -> chat messages, and where each came from."""
  if isinstance(value, str):
    return [{"role": "user", "content": value}], [field]
  if not isinstance(value, list) or not value:
    raise FieldError(field, "must be a string or a non-empty array of input items")
  messages: list[dict] = []
  origins: list[str] = []
  reasoning: list[str] = []   # a reasoning item's text, for the next assistant turn
  last_assistant = False      # the previous item was an assistant turn (calls join it)
  for j, item in enumerate(value):
    where = f"{field}[{j}]"
    if not isinstance(item, dict):
      raise FieldError(where, "must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
      role = item.get("role")
      if role not in _ROLES:
        raise FieldError(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
      msg: dict[str, Any] = {"role": role, "content": _content(item.get("content"),
                                                               f"{where}.content")}
      if role == "assistant" and reasoning:
        msg["reasoning_content"], reasoning = "".join(reasoning), []
      messages.append(msg)
      origins.append(where)
      last_assistant = role == "assistant"
    elif kind == "function_call":
      for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
          raise FieldError(f"{where}.{key}", "must be a non-empty string")
      args = item.get("arguments", "{}")
      if not isinstance(args, str):
        raise FieldError(f"{where}.arguments", "must be a string (JSON)")
      call = {"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": args}}
      if last_assistant:
        messages[-1].setdefault("tool_calls", []).append(call)
      else:
        msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        if reasoning:
          msg["reasoning_content"], reasoning = "".join(reasoning), []
        messages.append(msg)
        origins.append(where)
      last_assistant = True
    elif kind == "function_call_output":
      if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise FieldError(f"{where}.call_id", "must be a non-empty string")
      output = _text_of(item.get("output"), f"{where}.output", ("input_text", "output_text"))
      messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
      origins.append(where)
      last_assistant = False
    elif kind == "reasoning":
      parts = item.get("content") or item.get("summary") or []
      reasoning.append(_text_of(parts, f"{where}.content",
                                ("reasoning_text", "summary_text")))
    else:
      raise FieldError(f"{where}.type", f"{kind!r} items are not supported by this server "
                       "(message, function_call, function_call_output, reasoning)")
  return messages, origins


def chat_tools(tools: Any) -> list[dict] | None:
  """Function tools ({type, name, description, parameters, strict}) as chat tools."""
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise FieldError("tools", "must be an array")
  out = []
  for i, tool in enumerate(tools):
    if not isinstance(tool, dict) or tool.get("type") != "function":
      raise FieldError(f"tools[{i}].type", "only function tools are supported by this server")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    out.append({"type": "function", "function": fn})
  return out or None


def chat_tool_choice(choice: Any) -> Any:
  if isinstance(choice, dict):
    if choice.get("type") != "function":
      raise FieldError("tool_choice.type", "must be 'function' (or tool_choice 'none', 'auto', "
                       "'required')")
    return {"type": "function", "function": {"name": choice.get("name")}}
  return choice


def text_format(text: Any) -> structured.Constraint | None:
  """`text.format`: text (none), json_object, or json_schema {name, schema, strict}."""
  if text is None:
    return None
  if not isinstance(text, dict):
    raise FieldError("text", "must be an object")
  fmt = text.get("format")
  if fmt is None:
    return None
  if not isinstance(fmt, dict):
    raise FieldError("text.format", "must be an object")
  if fmt.get("type") == "json_schema":   # flat here, nested under json_schema in chat's
    fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
  try:
    c = structured.from_response_format(fmt, "text.format")
  except FieldError as e:
    raise chat.renamed(e, [], ((r"\.json_schema\.", "."),)) from None
  if c is not None and c.field.endswith(".json_schema.schema"):
    c = dataclasses.replace(c, field="text.format.schema")
  return c


def parse_responses(raw: bytes, template: Any, tokenizer: Any, limits: RequestLimits,
                    served: str, family: str | None, vision: chat.Vision | None,
                    store: ResponseStore, base_id: str | None = None) -> ResponsesPlan:
  """A /v1/responses body -> the engine request (runs on a tokenizer thread)."""
  body = protocol.load_body(raw)
  for name in _REFUSED:
    if body.get(name) not in (None, False):
      raise FieldError(name, "is not supported by this server")
  if "input" not in body:
    raise FieldError("input", "is required")
  sub = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
  c = protocol.common(sub, limits, served, logprobs=None, max_tokens_names=("max_output_tokens",))
  instructions = get(body, "instructions", str, None)
  previous = get(body, "previous_response_id", str, None)
  history: list = []
  if previous is not None:
    record = store.get(previous)
    if record is None:
      raise NotFound("previous_response_id", f"Previous response with id '{previous}' not found")
    history = record[1]
  new, origins = input_messages(body["input"])
  conversation = history + new
  messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
  origins = (["instructions"] if instructions else []) + ["previous_response_id"] * len(history) \
      + origins
  reasoning = get(body, "reasoning", dict, {})
  effort = get(reasoning, "effort", str, None, "reasoning.effort")
  request = chat.ChatRequest(
      messages=messages, tools=chat_tools(body.get("tools")),
      tool_choice=chat_tool_choice(body.get("tool_choice")),
      template_kwargs=get(body, "chat_template_kwargs", dict, None),
      response=text_format(body.get("text")),
      parallel_tool_calls=get(body, "parallel_tool_calls", bool, True),
      thinking=openai_chat.thinking_of(body, "reasoning.effort", effort))
  try:
    inputs = chat.prepare(template, tokenizer, limits, request, family=family, vision=vision)
  except FieldError as e:
    raise chat.renamed(e, origins, _RENAMES) from None
  plan_id = f"resp_{base_id or secrets.token_hex(16)}"
  requests = protocol.choice_requests(plan_id, [inputs.prompt_ids], c, skip_special_tokens=False,
                                      prompt_field="input", images=inputs.images)
  echo = {
      "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
      "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": previous,
      "reasoning": {"effort": effort, "summary": None},
      "temperature": c.sampling.temperature, "top_p": c.sampling.top_p,
      "text": body.get("text") or {"format": {"type": "text"}},
      "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
      "truncation": get(body, "truncation", str, "disabled"), "user": body.get("user"),
      "metadata": get(body, "metadata", dict, {}), "store": get(body, "store", bool, True)}
  return ResponsesPlan(plan_id, c, chat.constrain(requests, inputs), inputs, echo,
                       conversation, echo["store"])


# ---- output ---------------------------------------------------------------------------------

def _hex() -> str:
  return secrets.token_hex(12)


class ResponseOutput:
  """One response's output items as they grow: the stream's events and the final object."""

  def __init__(self, plan: ResponsesPlan):
    self.plan = plan
    self.stream = chat.stream_for(plan.inputs)
    self.created = protocol.now()
    self.items: list[dict] = []
    self.dropped: set[int] = set()   # items of a call the token limit cut in half
    self.open: int | None = None     # index of the item being written
    self.pending_space = ""          # whitespace before any message text (no item for it)
    self.seq = 0
    self.last: RequestOutput | None = None

  # ---- events -------------------------------------------------------------------------------

  def event(self, kind: str, **fields: Any) -> dict:
    event = {"type": kind, "sequence_number": self.seq, **fields}
    self.seq += 1
    return event

  def start_events(self) -> list[dict]:
    snapshot = self.response("in_progress")
    return [self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot)]

  def _add(self, item: dict, part: dict | None) -> list[dict]:
    self.items.append(item)
    self.open = len(self.items) - 1
    shown = {**item, "content": []} if part is not None else dict(item)
    events = [self.event("response.output_item.added", output_index=self.open, item=shown)]
    if part is not None:
      events.append(self.event("response.content_part.added", output_index=self.open,
                                item_id=item["id"], content_index=0, part=dict(part)))
    return events

  def _close(self, status: str = "completed") -> list[dict]:
    if self.open is None:
      return []
    i, item = self.open, self.items[self.open]
    self.open = None
    item["status"] = status
    ids = dict(output_index=i, item_id=item["id"])
    events = []
    if item["type"] == "reasoning":
      text = item["content"][0]["text"]
      events += [self.event("response.reasoning_text.done", content_index=0, text=text, **ids),
                 self.event("response.content_part.done", content_index=0,
                             part=dict(item["content"][0]), **ids)]
    elif item["type"] == "message":
      part = item["content"][0]
      events += [self.event("response.output_text.done", content_index=0, text=part["text"],
                             logprobs=[], **ids),
                 self.event("response.content_part.done", content_index=0, part=dict(part),
                             **ids)]
    elif status == "completed":
      events.append(self.event("response.function_call_arguments.done",
                                arguments=item["arguments"], **ids))
    events.append(self.event("response.output_item.done", output_index=i, item=dict(item)))
    return events

  def _kind(self) -> str | None:
    return None if self.open is None else self.items[self.open]["type"]

  def feed(self, out: RequestOutput) -> list[dict]:
    """The events of one engine delta."""
    self.last = out
    delta = self.stream.feed(out)
    events: list[dict] = []
    if delta.reasoning:
      if self._kind() != "reasoning":
        events += self._close()
        part = {"type": "reasoning_text", "text": ""}
        events += self._add({"type": "reasoning", "id": f"rs_{_hex()}", "summary": [],
                             "content": [part], "status": "in_progress"}, part)
      item = self.items[self.open]
      item["content"][0]["text"] += delta.reasoning
      events.append(self.event("response.reasoning_text.delta", output_index=self.open,
                                item_id=item["id"], content_index=0, delta=delta.reasoning))
    if delta.content:
      text = delta.content
      if self._kind() != "message":
        if not (self.pending_space + text).strip():
          self.pending_space += text
          text = ""
        else:
          text, self.pending_space = self.pending_space + text, ""
          events += self._close()
          part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
          events += self._add({"type": "message", "id": f"msg_{_hex()}", "role": "assistant",
                               "status": "in_progress", "content": [part]}, part)
      if text:
        item = self.items[self.open]
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", output_index=self.open,
                                  item_id=item["id"], content_index=0, delta=text, logprobs=[]))
    for call in delta.tool_calls:
      item = self.items[self.open] if self._kind() == "function_call" else None
      if item is None or item["_index"] != call.index:
        events += self._close()
        events += self._add({"type": "function_call", "id": f"fc_{_hex()}", "call_id": call.id,
                             "name": call.name, "arguments": "", "status": "in_progress",
                             "_index": call.index}, None)
        item = self.items[self.open]
        events[-1]["item"].pop("_index", None)
      if call.arguments:
        item["arguments"] += call.arguments
        events.append(self.event("response.function_call_arguments.delta",
                                  output_index=self.open, item_id=item["id"],
                                  delta=call.arguments))
    if out.finished:
      complete = {c["id"] for c in self.stream.tool_calls}
      if self._kind() == "function_call" and self.items[self.open]["call_id"] not in complete:
        self.dropped.add(self.open)   # the token limit cut this call: no half call
        events += self._close("incomplete")
      else:
        events += self._close()
      events.append(self.event(f"response.{self.status()}", response=self.response()))
    for e in events:
      if isinstance(e.get("item"), dict):
        e["item"].pop("_index", None)
    return events

  # ---- the object ---------------------------------------------------------------------------

  def status(self) -> str:
    return "incomplete" if self.last is not None and self.last.finish_reason == FINISH_LENGTH \
        else "completed"

  def usage(self) -> dict | None:
    if self.last is None or not self.last.finished:
      return None
    u = self.last.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.stream.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}

  def response(self, status: str | None = None) -> dict:
    status = status or self.status()
    output = [{k: v for k, v in item.items() if k != "_index"}
              for i, item in enumerate(self.items) if i not in self.dropped]
    return {"id": self.plan.id, "object": "response", "created_at": self.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "model": self.plan.common.model, "output": output, "usage": self.usage(),
            **self.plan.echo}

  def conversation(self) -> list[dict]:
    """The stored conversation: the input's, then this output as an assistant turn."""
    text = "".join(self.stream.content)
    reasoning = "".join(self.stream.reasoning)
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
      turn["reasoning_content"] = reasoning
    if self.stream.tool_calls:
      turn["tool_calls"] = self.stream.tool_calls
    elif not text:
      turn["content"] = ""
    return self.plan.conversation + [turn]


def sse(event: dict) -> bytes:
  return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
