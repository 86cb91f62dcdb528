"""Chat requests for every API edge (gRPC `Chat`, OpenAI `/v1/chat/completions`).

A conversation in OpenAI's shapes (message dicts, tools, tool_choice, template kwargs) becomes
prompt token ids through the checkpoint's chat template (`ChatTemplate.render_ids`: the
template's markup as control tokens, control-token text the request carries as plain text), on
a tokenizer thread; its requests keep special-token text in their output
(`StopParams.skip_special_tokens=False`), which `ChatStream` feeds to the family's streaming
parser (`chat_parsers`) to split content, reasoning and tool calls. Bad input raises
`FieldError` naming the field (`messages[1].tool_calls[0].function.name`, `tool_choice`).

`tool_choice`: "none" renders no tools and parses none (tool markup the model writes anyway
stays content); "auto" (the default with tools) renders and parses them; "required" and a named
function (the only tool rendered) constrain decoding to the family's tool-call syntax with each
tool's parameter schema (`tool_constraints.py`): required is one or more calls of any listed
tool, a named function exactly one call of it, so the parsed calls always follow the schemas.
A `response_format` / `structured_outputs` constraint (`structured.py`) applies otherwise; both
are compiled here, on the tokenizer thread, and a bad one is a FieldError naming its field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from google.protobuf import json_format

from engine.model import chat_template as templates
from engine.runtime.grammar import StructuredOutputsParams
from engine.runtime.request import FINISH_STOP, RequestOutput
from engine.service import chat_parsers, images, structured, tool_constraints
from engine.service.chat_parsers import ChatDelta
from engine.service import validation
from engine.service.validation import FieldError, ParsedRequest, RequestLimits

FINISH_TOOL_CALLS = "tool_calls"
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


@dataclasses.dataclass(frozen=True)
class ChatInputs:
  """A validated conversation, rendered and tokenised."""
  prompt_ids: list[int]
  family: str  # the output parser family
  starts_in_reasoning: bool
  tools_enabled: bool
  images: tuple[Any, ...] = ()  # `multimodal.ImageInput`s, on media_pad runs of prompt_ids
  # The compiled output constraint (tool_choice required/named, or a response format).
  constraint: StructuredOutputsParams | None = None


@dataclasses.dataclass(frozen=True)
class Vision:
  """What the edge needs of a model's vision tower: its placeholder id and preprocessing."""
  pad_id: int
  processor: Any  # image_processing.ImageProcessorConfig


def field_error(e: ValueError, default: str = "messages") -> FieldError:
  """A template/validation ValueError ("messages[2].role: ...") as a FieldError."""
  if isinstance(e, FieldError):
    return e
  text = str(e)
  m = _FIELD.match(text)
  return FieldError(m.group(1), text[m.end():]) if m else FieldError(default, text)


def check_tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
  """OpenAI `tool_choice` -> (mode, function name): "none" | "auto" | "required" | "named"."""
  if choice is None:
    return ("auto" if tools else "none"), None
  if isinstance(choice, str):
    if choice not in ("none", "auto", "required"):
      raise FieldError("tool_choice", f"must be 'none', 'auto', 'required' or "
                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
    if choice == "required" and not tools:
      raise FieldError("tool_choice", "'required' needs tools")
    return choice, None
  if not isinstance(choice, dict) or choice.get("type", "function") != "function" or \
      not isinstance(choice.get("function"), dict):
    raise FieldError("tool_choice", "must be a string or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}")
  name = choice["function"].get("name")
  if not isinstance(name, str) or not name:
    raise FieldError("tool_choice.function.name", "must be a non-empty string")
  known = [t["function"]["name"] for t in tools or ()]
  if name not in known:
    raise FieldError("tool_choice.function.name", f"{name!r} is not one of the request's "
                     f"tools ({', '.join(known) or 'none given'})")
  return "named", name


def _text_size(obj: Any) -> int:
  """Characters of the strings in a JSON-like value (bounds the template's work)."""
  if isinstance(obj, str):
    return len(obj)
  if isinstance(obj, dict):
    return sum(_text_size(k) + _text_size(v) for k, v in obj.items())
  if isinstance(obj, (list, tuple)):
    return sum(_text_size(v) for v in obj)
  return 0


def prepare(template: Any, tokenizer: Any, limits: RequestLimits, *, messages: Any,
            tools: Any, tool_choice: Any, template_kwargs: Any, family: str | None,
            kwargs_field: str = "chat_template_kwargs", vision: Vision | None = None,
            parallel_tool_calls: bool = True,
            response: structured.Constraint | None = None) -> ChatInputs:
  """Validates, renders and tokenises a conversation and compiles its output constraint
  (`response`: a response format's, refused with tool_choice required/named; runs on a
  tokenizer thread). Image parts are decoded and checked (`images.extract`), refused
  where `vision` is None."""
  if template is None or tokenizer is None:
    raise FieldError("messages", "this model has no chat template; use completions")
  if not isinstance(messages, list) or not messages:
    raise FieldError("messages", "must be a non-empty array of messages")
  messages, found = images.extract(messages, limits)
  if found and vision is None:
    raise FieldError(found[0].field, "this model has no vision tower: image inputs are not "
                     "accepted")
  try:
    tools = templates.validate_tools(tools) or None
  except ValueError as e:
    raise field_error(e, "tools") from None
  mode, name = check_tool_choice(tool_choice, tools)
  if response is not None and mode in ("required", "named"):
    raise FieldError(response.field.split(".")[0], f"cannot be combined with tool_choice "
                     f"{'required' if mode == 'required' else 'naming a function'} (the output "
                     "is then the tool calls)")
  if template_kwargs is None:
    template_kwargs = {}
  if not isinstance(template_kwargs, dict):
    raise FieldError(kwargs_field, "must be an object")
  reserved = {"messages", "tools", "add_generation_prompt", "documents"} & set(template_kwargs)
  if reserved:
    raise FieldError(kwargs_field, f"may not set {', '.join(sorted(reserved))}")
  shown = None if mode == "none" else (
      [t for t in tools if t["function"]["name"] == name] if mode == "named" else tools)
  size = _text_size(messages) + _text_size(shown) + _text_size(template_kwargs)
  if size > limits.max_prompt_chars:
    raise FieldError("messages", f"{size} characters of text, at most "
                     f"{limits.max_prompt_chars} allowed (the server's --max_prompt_chars)")
  try:
    # Control-token text inside the request (a user typing "<|im_end|>") stays plain text.
    ids = template.render_ids(tokenizer, messages, tools=shown, add_generation_prompt=True,
                              **template_kwargs)
  except ValueError as e:
    raise field_error(e) from None
  if not ids:
    raise FieldError("messages", "the rendered conversation encodes to no tokens")
  image_inputs: tuple[Any, ...] = ()
  if vision is not None:  # one <|media_pad|> per image -> its tokens (none without images)
    ids, image_inputs = images.to_inputs(ids, found, vision.pad_id, vision.processor)
  # Whether the generation prompt opened a think block (K2.5's ends in `<think>`).
  tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
  family = family or template.family or "none"
  thinking = chat_parsers.starts_in_reasoning(tail)
  constraint = None
  if mode in ("required", "named"):
    fenced = "```json" in "\n".join(template.templates.values())  # DeepSeek V3's call form
    constraint = tool_constraints.constraint_for(
        mode, name, tools, family=family, parallel=parallel_tool_calls,
        starts_in_reasoning=thinking, fenced=fenced, tokenizer=tokenizer, limits=limits)
  elif response is not None:
    constraint = structured.compile_checked(response.spec, response.field, tokenizer, limits)
    if thinking:  # reasoning first, then the constrained answer
      constraint = structured.compile_checked(
          tool_constraints.response_after_reasoning(constraint, family, tokenizer),
          response.field, tokenizer, limits)
  return ChatInputs(prompt_ids=ids, family=family, starts_in_reasoning=thinking,
                    tools_enabled=mode != "none", constraint=constraint,
                    images=image_inputs)


# ---- gRPC `ChatRequest` ----------------------------------------------------------------------

def proto_conversation(request: Any) -> dict[str, Any]:
  """A ChatRequest's messages, tools, tool_choice, template kwargs and output constraint in
  OpenAI's shapes (the same field names, so errors name the same paths)."""
  messages = []
  for m in request.messages:
    d: dict[str, Any] = {"role": m.role}
    d["content"] = m.content if m.HasField("content") else None
    if m.content_parts:
      if m.HasField("content"):
        raise FieldError(f"messages[{len(messages)}].content_parts", "give content or "
                         "content_parts, not both")
      d["content"] = [{"type": "text", "text": p.text} if p.WhichOneof("part") == "text"
                      else {"type": "image_bytes", "image_bytes": p.image.data}
                      for p in m.content_parts]
    if m.reasoning_content:
      d["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
      d["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                          "function": {"name": c.function.name,
                                       "arguments": c.function.arguments}}
                         for c in m.tool_calls]
    if m.tool_call_id:
      d["tool_call_id"] = m.tool_call_id
    if m.name:
      d["name"] = m.name
    messages.append(d)
  tools = []
  for i, t in enumerate(request.tools):
    fn: dict[str, Any] = {"name": t.function.name}
    if t.function.description:
      fn["description"] = t.function.description
    which = t.function.WhichOneof("parameters")
    if which == "parameters_json":
      try:
        fn["parameters"] = json.loads(t.function.parameters_json)
      except ValueError as e:
        raise FieldError(f"tools[{i}].function.parameters_json", f"not valid JSON: {e}") from None
    elif which == "parameters_struct":
      fn["parameters"] = json_format.MessageToDict(t.function.parameters_struct)
    tools.append({"type": t.type or "function", "function": fn})
  choice: Any = None
  which = request.tool_choice.WhichOneof("choice")
  if which == "mode":
    choice = request.tool_choice.mode
  elif which == "function_name":
    choice = {"type": "function", "function": {"name": request.tool_choice.function_name}}
  kwargs = (json_format.MessageToDict(request.template_kwargs)
            if request.HasField("template_kwargs") else None)
  response = (structured.from_proto(request.structured_outputs)
              if request.HasField("structured_outputs") else None)
  parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
  return dict(messages=messages, tools=tools or None, tool_choice=choice,
              template_kwargs=kwargs, response=response, parallel_tool_calls=parallel)


def parse_chat_request(request: Any, template: Any, tokenizer: Any, limits: RequestLimits,
                       family: str | None, vision: Vision | None = None
                       ) -> tuple[ParsedRequest, ChatInputs]:
  """Validates a ChatRequest (sampling as Generate's); FieldError names the first bad field."""
  rid = validation.check_request_id(request.request_id, limits)
  inputs = prepare(template, tokenizer, limits, family=family, kwargs_field="template_kwargs",
                   vision=vision, **proto_conversation(request))
  sampling = validation.sampling_params(request.sampling)
  stop = dataclasses.replace(validation.stop_params(request.sampling, len(inputs.prompt_ids),
                                                    limits, "messages"),
                             skip_special_tokens=False)
  spec = validation.check_speculative(request.speculative, limits)
  sampling = dataclasses.replace(sampling, **spec, structured_outputs=inputs.constraint)
  return ParsedRequest(rid, inputs.prompt_ids, sampling, stop, inputs.images), inputs


class ChatStream:
  """One choice's output through its parser: deltas, the finish reason, the complete calls."""

  def __init__(self, inputs: ChatInputs):
    self.parser = chat_parsers.make_parser(inputs.family,
                                           starts_in_reasoning=inputs.starts_in_reasoning,
                                           tools_enabled=inputs.tools_enabled)
    self.content: list[str] = []
    self.reasoning: list[str] = []

  def feed(self, out: RequestOutput) -> ChatDelta:
    delta = self.parser.feed(out.text_delta) if out.text_delta else ChatDelta()
    if out.finished:
      delta = _merge(delta, self.parser.finish())
    self.content.append(delta.content)
    self.reasoning.append(delta.reasoning)
    return delta

  @property
  def tool_calls(self) -> list[dict]:
    return self.parser.tool_calls

  def finish_reason(self, out: RequestOutput) -> str | None:
    """OpenAI's: "tool_calls" when a request that stopped by itself called tools."""
    if not out.finished:
      return None
    if out.finish_reason == FINISH_STOP and self.tool_calls:
      return FINISH_TOOL_CALLS
    return out.finish_reason


def _merge(a: ChatDelta, b: ChatDelta) -> ChatDelta:
  return ChatDelta(content=a.content + b.content, reasoning=a.reasoning + b.reasoning,
                   tool_calls=list(a.tool_calls) + list(b.tool_calls))
