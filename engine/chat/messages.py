"""OpenAI-shaped conversations as chat templates read them: validation (a ValueError naming the
field, `messages[2].role`, `tools[0].function.name`), the shaping OpenAI servers do before
rendering (vLLM's chat_utils), and the history fix-ups a family's markup asks for.

  * `developer` messages become `system` unless the template knows the role;
  * list content: text parts joined with "\\n" for templates that read a string, kept as parts
    for templates that loop over them; `{"type": "image"}` parts (images the serving edge took
    out, `engine/service/images.py`) are kept for templates that loop over parts and refused by
    the others; other part types are refused; a tool-call-only assistant turn gets empty
    content;
  * a tool call's `arguments` JSON string is parsed for the template (`ToolArguments`, a dict
    that still renders as the original text where a template concatenates it);
  * reasoning under any of its names (`reasoning_content`, `reasoning`, `thinking`) is given to
    the template as `reasoning_content` and `thinking` (K2.5's template renders an earlier
    turn's `reasoning_content` inside `<think>` where its history keeps it);
  * `kimi_call_ids`: tool-call ids from other clients (`call_abc123`, `toolu_01...`) become the
    `functions.NAME:IDX` ids Kimi's templates echo into history and tool results, each result
    renamed with its call, so the model sees (and keeps writing) its own id format.
"""

from __future__ import annotations

import json
from typing import Any

from engine.chat.markup import kimi_call_name

ROLES = ("system", "developer", "user", "assistant", "tool")


def kimi_call_ids(messages: Any, id_format: str) -> Any:
  """The messages with every tool-call id not already `functions.NAME:IDX` renamed to that
  form (IDX: the call's position among the conversation's calls, the next free one when
  taken), and each tool message's `tool_call_id` renamed with its call. Messages that are not
  well-formed are left for `prepare_messages` to refuse."""
  if not isinstance(messages, list):
    return messages
  calls = [c for m in messages if isinstance(m, dict) and isinstance(m.get("tool_calls"), list)
           for c in m["tool_calls"] if isinstance(c, dict)]
  if not calls:
    return messages
  taken = {c.get("id") for c in calls if isinstance(c.get("id"), str)
           and kimi_call_name(c["id"]) is not None}
  renamed: dict[str, str] = {}
  out, ordinal = [], 0
  for m in messages:
    if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
      new_calls = []
      for c in m["tool_calls"]:
        if not isinstance(c, dict):
          new_calls.append(c)
          continue
        cid, fn = c.get("id"), c.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name and not (isinstance(cid, str)
                                                   and kimi_call_name(cid) is not None):
          index = ordinal
          while id_format.format(name=name, index=index) in taken:
            index += 1
          new = id_format.format(name=name, index=index)
          taken.add(new)
          if isinstance(cid, str):
            renamed[cid] = new
          c = {**c, "id": new}
        ordinal += 1
        new_calls.append(c)
      m = {**m, "tool_calls": new_calls}
    elif isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") in renamed:
      m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
    out.append(m)
  return out


class ToolArguments(dict):
  """A tool call's parsed `arguments`: a dict for templates that read or `tojson` it, and the
  original JSON text where a template concatenates or prints it (DeepSeek V3.1 does)."""

  def __init__(self, parsed: dict, text: str):
    super().__init__(parsed)
    self.text = text

  def __str__(self) -> str:
    return self.text

  def __add__(self, other):
    return self.text + other if isinstance(other, str) else NotImplemented

  def __radd__(self, other):
    return other + self.text if isinstance(other, str) else NotImplemented


# ---- validation and shaping -------------------------------------------------------------------

def validate_tools(tools: Any) -> list[dict] | None:
  """OpenAI `tools`: [{"type": "function", "function": {"name", "description"?,
  "parameters"?}}]; returned as given (None stays None)."""
  if tools is None:
    return None
  if not isinstance(tools, list):
    raise ValueError("tools: must be a list")
  for i, tool in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
      raise ValueError(f"{where}: must be an object")
    if tool.get("type", "function") != "function":
      raise ValueError(f"{where}.type: only 'function' tools are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict):
      raise ValueError(f"{where}.function: must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
      raise ValueError(f"{where}.function.name: must be a non-empty string")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
      raise ValueError(f"{where}.function.description: must be a string")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
      raise ValueError(f"{where}.function.parameters: must be an object (a JSON schema)")
  return tools


def prepare_messages(messages: Any, *, reads_parts: bool = False,
                     knows_developer: bool = False) -> list[dict]:
  """Validated copies of the messages in the shape templates read (module docstring)."""
  if not isinstance(messages, list) or not messages:
    raise ValueError("messages: must be a non-empty list")
  out = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict):
      raise ValueError(f"{where}: must be an object")
    msg = {k: v for k, v in message.items() if v is not None}  # as transformers does
    role = msg.get("role")
    if role not in ROLES:
      raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)} (got {role!r})")
    if role == "developer" and not knows_developer:
      msg["role"] = "system"
    if "content" in msg:
      msg["content"] = _content(msg["content"], f"{where}.content", reads_parts)
    elif role != "assistant":
      raise ValueError(f"{where}.content: required for a {role} message")
    for key in ("name", "tool_call_id", "reasoning_content", "thinking", "reasoning"):
      if key in msg and not isinstance(msg[key], str):
        raise ValueError(f"{where}.{key}: must be a string")
    if role == "tool" and "tool_call_id" in msg and not msg["tool_call_id"]:
      raise ValueError(f"{where}.tool_call_id: must not be empty")
    if "tool_calls" in msg:
      if role != "assistant":
        raise ValueError(f"{where}.tool_calls: only assistant messages make tool calls")
      msg["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
    elif role == "assistant" and "content" not in msg:
      raise ValueError(f"{where}.content: required unless the message has tool_calls")
    if "content" not in msg:
      # A tool-call-only turn (OpenAI sends content null): empty, as vLLM gives it, since
      # templates such as Qwen3's call string methods on it.
      msg["content"] = [] if reads_parts else ""
    # transformers 5.x: reasoning under any of its names is given as reasoning_content and
    # thinking (gpt-oss templates read the latter).
    reasoning = next((msg[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if k in msg), None)
    if reasoning is not None:
      msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    out.append(msg)
  return out


def _content(content: Any, where: str, reads_parts: bool) -> str | list[dict]:
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise ValueError(f"{where}: must be a string or a list of content parts")
  parts = []
  for j, part in enumerate(content):
    if not isinstance(part, dict):
      raise ValueError(f"{where}[{j}]: must be an object")
    if part.get("type") == "image":  # an image the edge took out (engine/service/images.py)
      if not reads_parts:
        raise ValueError(f"{where}[{j}]: this model's chat template renders no images")
      parts.append({"type": "image"})
      continue
    if part.get("type") != "text":
      raise ValueError(f"{where}[{j}].type: only 'text' parts (and images, given to the "
                       f"serving API) are supported "
                       f"(got {part.get('type')!r})")
    if not isinstance(part.get("text"), str):
      raise ValueError(f"{where}[{j}].text: must be a string")
    parts.append({"type": "text", "text": part["text"]})
  if reads_parts:
    return parts
  return "\n".join(p["text"] for p in parts)


def _tool_calls(calls: Any, where: str) -> list[dict]:
  if not isinstance(calls, list):
    raise ValueError(f"{where}: must be a list")
  out = []
  for k, call in enumerate(calls):
    w = f"{where}[{k}]"
    if not isinstance(call, dict):
      raise ValueError(f"{w}: must be an object")
    call = {key: v for key, v in call.items() if v is not None}
    if call.get("type", "function") != "function":
      raise ValueError(f"{w}.type: only 'function' calls are supported")
    if "id" in call and not isinstance(call["id"], str):
      raise ValueError(f"{w}.id: must be a string")
    fn = call.get("function")
    if not isinstance(fn, dict):
      raise ValueError(f"{w}.function: must be an object")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
      raise ValueError(f"{w}.function.name: must be a non-empty string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
      try:
        parsed = json.loads(args)
      except ValueError:
        parsed = None   # not JSON: templates get the text as it is
      if isinstance(parsed, dict):
        args = ToolArguments(parsed, args)
    elif not isinstance(args, dict):
      raise ValueError(f"{w}.function.arguments: must be a JSON string or an object")
    out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
  return out


