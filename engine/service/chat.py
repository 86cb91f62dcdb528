"""The engine's chat request, shared by every API edge (gRPC `Chat`, OpenAI
`/v1/chat/completions` and `/v1/responses`, Anthropic `/v1/messages`).

Each edge turns its body into one `ChatRequest` (OpenAI-shaped messages, tools, tool_choice,
template kwargs, thinking, the answer's constraint); `prepare` validates it, renders it with
the checkpoint's chat template (`engine/chat`: the template's markup as control tokens,
control-token text the request carries as plain text), compiles its output constraint and
resolves its thinking budget, on a tokenizer thread. Bad input raises `FieldError` naming the
field (`messages[1].tool_calls[0].function.name`, `tool_choice`); each edge renames the paths
into its own (Anthropic's `messages[0].content[1]`). Outputs go through `engine.chat.stream`.

`tool_choice`: "none" renders no tools and parses none (tool markup the model writes anyway
stays content); "auto" (the default with tools) renders and parses them; "required" and a named
function (the only tool rendered) constrain decoding to the family's tool-call syntax with each
tool's parameter schema (`tool_constraints.py`): required is one or more calls of any listed
tool, a named function exactly one call of it, so the parsed calls always follow the schemas.
A `response_format` / `structured_outputs` / `text.format` constraint (`structured.py`) applies
otherwise; both are compiled here and a bad one is a FieldError naming its field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from google.protobuf import json_format

from engine.chat import markup as markups
from engine.chat import messages as chat_messages
from engine.chat import thinking as thinking_controls
from engine.chat.reasoning import ThinkIds, think_ids
from engine.chat.stream import FINISH_TOOL_CALLS, ChatStream  # noqa: F401 (re-export)
from engine.chat.thinking import Thinking
from engine.runtime.grammar import StructuredOutputsParams
from engine.service import images, structured, tool_constraints, validation
from engine.service.validation import FieldError, ParsedRequest, RequestLimits

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  """A conversation as every API hands it over (OpenAI's shapes, so errors name its paths)."""
  messages: Any
  tools: Any = None
  tool_choice: Any = None
  template_kwargs: Any = None
  kwargs_field: str = "chat_template_kwargs"
  response: structured.Constraint | None = None   # the answer's constraint
  parallel_tool_calls: bool = True
  thinking: Thinking = Thinking()


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
  think_ids: ThinkIds | None = None   # the family's think markers as ids (None: not tokens)
  thinking_budget: int | None = None  # reasoning tokens at most (None: unbounded)


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


_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\]")


def renamed(e: FieldError, origins: list[str], renames: tuple[tuple[str, str], ...] = ()
            ) -> FieldError:
  """A FieldError from `prepare` with its path in the edge's own terms: `messages[i]` as where
  message i came from (`origins[i]`, e.g. "input[3]"), then each (regex, replacement)."""
  field = e.field
  m = _MESSAGE_PATH.match(field)
  if m and int(m.group(1)) < len(origins):
    field = origins[int(m.group(1))] + field[m.end():]
  for pattern, repl in renames:
    field = re.sub(pattern, repl, field)
  if field == e.field:
    return e
  return FieldError(field, str(e)[len(e.field) + 2:])


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


def prepare(template: Any, tokenizer: Any, limits: RequestLimits, request: ChatRequest, *,
            family: str | None, vision: Vision | None = None) -> ChatInputs:
  """Validates, renders and tokenises a conversation, compiles its output constraint and
  resolves its thinking (runs on a tokenizer thread). Image parts are decoded and checked
  (`images.extract`), refused where `vision` is None."""
  if template is None or tokenizer is None:
    raise FieldError("messages", "this model has no chat template; use completions")
  if not isinstance(request.messages, list) or not request.messages:
    raise FieldError("messages", "must be a non-empty array of messages")
  messages, found = images.extract(request.messages, limits)
  if found and vision is None:
    raise FieldError(found[0].field, "this model has no vision tower: image inputs are not "
                     "accepted")
  try:
    tools = chat_messages.validate_tools(request.tools) or None
  except ValueError as e:
    raise field_error(e, "tools") from None
  mode, name = check_tool_choice(request.tool_choice, tools)
  response = request.response
  if response is not None and mode in ("required", "named"):
    raise FieldError(response.field.split(".")[0], f"cannot be combined with tool_choice "
                     f"{'required' if mode == 'required' else 'naming a function'} (the output "
                     "is then the tool calls)")
  kwargs, kwargs_field = request.template_kwargs, request.kwargs_field
  if kwargs is None:
    kwargs = {}
  if not isinstance(kwargs, dict):
    raise FieldError(kwargs_field, "must be an object")
  reserved = {"messages", "tools", "add_generation_prompt", "documents"} & set(kwargs)
  if reserved:
    raise FieldError(kwargs_field, f"may not set {', '.join(sorted(reserved))}")
  shown = None if mode == "none" else (
      [t for t in tools if t["function"]["name"] == name] if mode == "named" else tools)
  thinking = request.thinking
  try:
    kwargs = thinking_controls.template_kwargs(template.variables(shown), thinking, kwargs)
  except ValueError as e:
    raise field_error(e, thinking.field) from None
  size = _text_size(messages) + _text_size(shown) + _text_size(kwargs)
  if size > limits.max_prompt_chars:
    raise FieldError("messages", f"{size} characters of text, at most "
                     f"{limits.max_prompt_chars} allowed (the server's --max_prompt_chars)")
  try:
    # Control-token text inside the request (a user typing "<|im_end|>") stays plain text.
    ids = template.render_ids(tokenizer, messages, tools=shown, add_generation_prompt=True,
                              **kwargs)
  except ValueError as e:
    raise field_error(e) from None
  if not ids:
    raise FieldError("messages", "the rendered conversation encodes to no tokens")
  image_inputs: tuple[Any, ...] = ()
  if vision is not None:  # one <|media_pad|> per image -> its tokens (none without images)
    ids, image_inputs = images.to_inputs(ids, found, vision.pad_id, vision.processor)
  family = family or template.family or "none"
  markup = markups.markup(family)
  # Whether the generation prompt opened a think block (K2.5's ends in `<think>`).
  tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
  in_thought = markup.think and markups.starts_in_reasoning(tail)
  constraint = None
  if mode in ("required", "named"):
    fenced = markups.DEEPSEEK_V3_FENCE in "\n".join(template.templates.values())
    constraint = tool_constraints.constraint_for(
        mode, name, tools, family=family, parallel=request.parallel_tool_calls,
        starts_in_reasoning=in_thought, fenced=fenced, tokenizer=tokenizer, limits=limits)
  elif response is not None:
    constraint = structured.compile_checked(response.spec, response.field, tokenizer, limits)
    if in_thought:  # reasoning first, then the constrained answer
      constraint = structured.compile_checked(
          tool_constraints.response_after_reasoning(constraint, family, tokenizer),
          response.field, tokenizer, limits)
  ids_of_markers = think_ids(tokenizer, markup)
  budget = _budget(thinking, in_thought, template, shown, markup, ids_of_markers)
  return ChatInputs(prompt_ids=ids, family=family, starts_in_reasoning=in_thought,
                    tools_enabled=mode != "none", constraint=constraint, images=image_inputs,
                    think_ids=ids_of_markers, thinking_budget=budget)


def _budget(thinking: Thinking, in_thought: bool, template: Any, tools: Any,
            markup: markups.Markup, ids: ThinkIds | None) -> int | None:
  """The request's reasoning budget: its own, or 0 for thinking off on a template that has no
  flag but opened a think block; None where nothing bounds the thought."""
  budget = thinking.budget
  if thinking.enabled is False:
    if not in_thought or thinking_controls.reads_flag(template.variables(tools)):
      return None   # the template turned thinking off: no thought to bound
    budget = 0
  if budget is None:
    return None
  if not markup.think:
    raise FieldError(thinking.field, f"this model's output format ({markup.family}) has no "
                     "think block to bound")
  if ids is None:
    raise FieldError(thinking.field, "a thinking budget needs the think-end marker as one "
                     "token of this model's tokenizer, and it is not")
  if not in_thought and ids.start is None:
    raise FieldError(thinking.field, "a thinking budget needs the think-start marker as one "
                     "token of this model's tokenizer, and it is not")
  return budget


def sampling_fields(inputs: ChatInputs) -> dict[str, Any]:
  """The `SamplingParams` fields a chat request sets: its constraint and thinking budget."""
  fields: dict[str, Any] = {"structured_outputs": inputs.constraint}
  if inputs.thinking_budget is not None:
    ids = inputs.think_ids
    fields.update(thinking_token_budget=inputs.thinking_budget,
                  think_start_token_id=ids.start, think_in_prompt=inputs.starts_in_reasoning,
                  think_end_token_ids=(ids.end, *ids.also_end))
  return fields


def stream_for(inputs: ChatInputs) -> ChatStream:
  """A fresh output stream for one choice of a prepared request."""
  return ChatStream(inputs.family, starts_in_reasoning=inputs.starts_in_reasoning,
                    tools_enabled=inputs.tools_enabled, think_ids=inputs.think_ids)


def constrain(requests: list[ParsedRequest], inputs: ChatInputs) -> list[ParsedRequest]:
  """The requests with the chat's sampling fields (`sampling_fields`) set."""
  fields = sampling_fields(inputs)
  return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, **fields))
          for r in requests]


def thinking_object(value: Any, field: str, *, budget_key: str | None = None,
                    max_tokens: int | None = None) -> Thinking | None:
  """Moonshot's `thinking: {"type": "enabled" | "disabled"}` (and Anthropic's, with
  `budget_tokens`: `budget_key`, below `max_tokens` as Anthropic requires)."""
  if value is None:
    return None
  if not isinstance(value, dict):
    raise FieldError(field, f"must be an object {{\"type\": \"enabled\" | \"disabled\"}}, got "
                     f"{type(value).__name__}")
  kind = value.get("type")
  if kind not in ("enabled", "disabled"):
    raise FieldError(f"{field}.type", f"must be 'enabled' or 'disabled', got {kind!r}")
  budget = None
  if budget_key is not None and kind == "enabled":
    budget = check_budget(value.get(budget_key), f"{field}.{budget_key}")
    if budget is None:
      raise FieldError(f"{field}.{budget_key}", "is required with type 'enabled'")
    if max_tokens is not None and budget >= max_tokens:
      raise FieldError(f"{field}.{budget_key}", f"must be less than max_tokens ({max_tokens}), "
                       f"got {budget}")
  return Thinking(kind == "enabled", budget, field)


def check_budget(value: Any, field: str) -> int | None:
  """A thinking budget field: an integer >= 0, or None."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise FieldError(field, f"must be an integer >= 0, got {json.dumps(value)[:40]}")
  return value


# ---- gRPC `ChatRequest` ----------------------------------------------------------------------

def proto_conversation(request: Any) -> ChatRequest:
  """A proto ChatRequest as the engine's chat request (the same field names, so errors name
  the same paths)."""
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
  budget = (check_budget(request.thinking_token_budget, "thinking_token_budget")
            if request.HasField("thinking_token_budget") else None)
  thinking = thinking_controls.combine(
      Thinking(request.thinking, None, "thinking") if request.HasField("thinking") else None,
      Thinking(None, budget, "thinking_token_budget"))
  return ChatRequest(messages=messages, tools=tools or None, tool_choice=choice,
                     template_kwargs=kwargs, kwargs_field="template_kwargs", response=response,
                     parallel_tool_calls=parallel, thinking=thinking)


def parse_chat_request(request: Any, template: Any, tokenizer: Any, limits: RequestLimits,
                       family: str | None, vision: Vision | None = None
                       ) -> tuple[ParsedRequest, ChatInputs]:
  """Validates a ChatRequest (sampling as Generate's); FieldError names the first bad field."""
  rid = validation.check_request_id(request.request_id, limits)
  inputs = prepare(template, tokenizer, limits, proto_conversation(request), family=family,
                   vision=vision)
  sampling = validation.sampling_params(request.sampling)
  stop = dataclasses.replace(validation.stop_params(request.sampling, len(inputs.prompt_ids),
                                                    limits, "messages"),
                             skip_special_tokens=False)
  spec = validation.check_speculative(request.speculative, limits)
  sampling = dataclasses.replace(sampling, **spec, **sampling_fields(inputs))
  return ParsedRequest(rid, inputs.prompt_ids, sampling, stop, inputs.images), inputs
