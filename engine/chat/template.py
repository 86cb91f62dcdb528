"""A checkpoint's chat template: OpenAI-shaped messages -> the prompt text the model was trained on.

Rendering matches transformers' `apply_chat_template` (5.x, `utils/chat_template_utils.py`): the
same jinja2 sandbox and options, the same `tojson` / `raise_exception` / `strftime_now` /
`namespace` / `dict`, keys whose value is None dropped, reasoning aliased under
`reasoning_content` and `thinking`, the tokenizer's named special tokens as variables, and extra
keyword arguments (Kimi's `thinking`, Qwen's `enable_thinking`) passed through.

What this adds, as OpenAI servers do before rendering: the validation and shaping of
`messages.py` (errors name the field, `messages[2].role`); for templates that write Kimi's tool
markup, other clients' tool-call ids renamed to Kimi's `functions.NAME:IDX`
(`messages.kimi_call_ids`); and Kimi K2.5-style templates (they read `tools_ts_str`) get
their tools declared in its TypeScript style (`tool_declaration_ts.py`), with the tool dicts
key-sorted, and `thinking=True` unless given, as that checkpoint's tokenizer does.
"""

from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.chat import tool_declaration_ts
from engine.chat.markup import family_of_template, markup
from engine.chat.messages import kimi_call_ids, prepare_messages, validate_tools

TEMPLATE_FILE = "chat_template.jinja"
LEGACY_TEMPLATE_FILE = "chat_template.json"
EXTRA_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


_REQUEST_FIELD = re.compile(r"(messages|tools|tool_choice|documents)(\[\d+\])*(\.\w+)*: ")


class ChatTemplateError(ValueError):
  """The template itself refused the conversation (its `raise_exception`) or failed on it."""


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (training-mask blocks): rendered as their body."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' filter: no HTML escaping (jinja's own tojson escapes <, >, &, ').
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.now().strftime(fmt)


class _TemplateDict:
  """`dict(...)` in templates, without handing them the type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
  """`namespace(...)` that refuses underscore names (no reaching CPython internals)."""

  def __init__(*args, **kwargs):
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")


def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                     dict=_TemplateDict(), namespace=_TemplateNamespace)
  return env


_ENV = _environment()


def _loops_over_content(source: str) -> bool:
  """Whether the template iterates a message's content (then it takes OpenAI content parts):
  `for p in message['content']`, or over a name set from an expression that reads 'content'."""
  ast = _ENV.parse(source)
  content_names = set()
  for node in ast.find_all(jinja2.nodes.Assign):
    if isinstance(node.target, jinja2.nodes.Name) and _mentions_content(node.node):
      content_names.add(node.target.name)
  for loop in ast.find_all(jinja2.nodes.For):
    it = loop.iter
    if _mentions_content(it) and not isinstance(it, jinja2.nodes.Name):
      return True
    if isinstance(it, jinja2.nodes.Name) and it.name in content_names:
      return True
  return False


def _mentions_content(node) -> bool:
  for sub in [node, *node.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem,
                                    jinja2.nodes.Const))]:
    if isinstance(sub, jinja2.nodes.Getattr) and sub.attr == "content":
      return True
    if isinstance(sub, jinja2.nodes.Getitem) and isinstance(sub.arg, jinja2.nodes.Const) \
        and sub.arg.value == "content":
      return True
    if isinstance(sub, jinja2.nodes.Const) and sub.value == "content":
      return True   # msg.get('content')
  return False


class ChatTemplate:
  """One checkpoint's chat template(s) and special tokens."""

  def __init__(self, templates: dict[str, str] | str, special_tokens: dict[str, str] | None = None,
               source: str = ""):
    if isinstance(templates, str):
      templates = {"default": templates}
    if not templates or "default" not in templates:
      raise ValueError(f"chat_template: no template named 'default' in {source or 'the input'} "
                       f"(names: {sorted(templates)})")
    self.templates = dict(templates)
    self.special_tokens = dict(special_tokens or {})
    self.source = source
    self._compiled: dict[str, tuple[jinja2.Template, bool]] = {}
    self._variables: dict[str, frozenset[str]] = {}

  # ---- loading ------------------------------------------------------------------------------

  @classmethod
  def from_dir(cls, path: str) -> "ChatTemplate | None":
    """The template of a checkpoint directory (`chat_template.jinja`, named extras in
    `additional_chat_templates/`, else `chat_template.json`, else `tokenizer_config.json`'s
    `chat_template`, a string or a list of {name, template}); None when it has none."""
    config_path = os.path.join(path, TOKENIZER_CONFIG)
    config = {}
    if os.path.exists(config_path):
      with open(config_path, encoding="utf-8") as fh:
        try:
          config = json.load(fh)
        except ValueError as e:
          raise ValueError(f"{config_path}: not JSON ({e})") from None
    templates = _templates_from_config(config.get("chat_template"), config_path)
    json_path = os.path.join(path, LEGACY_TEMPLATE_FILE)  # processors' older form
    if os.path.exists(json_path):
      with open(json_path, encoding="utf-8") as fh:
        legacy = json.load(fh)
      if isinstance(legacy, dict) and isinstance(legacy.get("chat_template"), str):
        templates["default"] = legacy["chat_template"]
    jinja_path = os.path.join(path, TEMPLATE_FILE)
    if os.path.exists(jinja_path):
      templates["default"] = _read(jinja_path)
    extra_dir = os.path.join(path, EXTRA_TEMPLATES_DIR)
    if os.path.isdir(extra_dir):
      for name in sorted(os.listdir(extra_dir)):
        if name.endswith(".jinja"):
          templates[name[:-len(".jinja")]] = _read(os.path.join(extra_dir, name))
    if not templates:
      return None
    special = _special_tokens(config)
    map_path = os.path.join(path, "special_tokens_map.json")
    if os.path.exists(map_path):  # legacy file: fills the names tokenizer_config lacks
      with open(map_path, encoding="utf-8") as fh:
        for key, value in _special_tokens(json.load(fh)).items():
          special.setdefault(key, value)
    return cls(templates, special, source=path)

  # ---- what the servers ask -----------------------------------------------------------------

  def template_for(self, tools: list | None) -> str:
    """transformers' choice: "tool_use" when tools are given and it exists, else "default"."""
    if tools and "tool_use" in self.templates:
      return self.templates["tool_use"]
    return self.templates["default"]

  @property
  def family(self) -> str | None:
    """The output parser family the templates' tool markup implies, or None."""
    return family_of_template("\n".join(self.templates.values()))

  def variables(self, tools: list | None = None) -> frozenset[str]:
    """The variables the template (for these tools) reads from its context."""
    source = self.template_for(tools)
    if source not in self._variables:
      self._variables[source] = frozenset(jinja2.meta.find_undeclared_variables(
          _ENV.parse(source)))
    return self._variables[source]

  @property
  def kimi_k25_style(self) -> bool:
    """Templates that read `tools_ts_str` (Kimi K2.5): TypeScript tool declarations, thinking
    on unless told otherwise, as that checkpoint's tokenizer renders them."""
    return "tools_ts_str" in self.template_for(None)

  def render(self, messages: list[dict], *, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, documents: list[dict] | None = None,
             **template_kwargs) -> str:
    """The prompt text for an OpenAI-shaped conversation (see the module docstring)."""
    source = self.template_for(tools)
    template, reads_parts = self._compile(source)
    tools = validate_tools(tools)
    if documents is not None and not (isinstance(documents, list)
                                      and all(isinstance(d, dict) for d in documents)):
      raise ValueError("documents: must be a list of objects")
    family = family_of_template(source)
    id_format = markup(family).call_id_format if family else None
    if id_format:   # the ids the template echoes are the model's own form
      messages = kimi_call_ids(messages, id_format)
    chat = prepare_messages(messages, reads_parts=reads_parts,
                            knows_developer="developer" in source)
    kwargs = {**self.special_tokens, **template_kwargs}
    if "tools_ts_str" in source:
      # Kimi K2.5's tokenizer: thinking on by default; tools key-sorted, declared in TypeScript.
      kwargs.setdefault("thinking", True)
      if tools:
        tools = _deep_sorted(tools)
        try:
          kwargs.setdefault("tools_ts_str", tool_declaration_ts.encode_tools(tools))
        except ValueError:
          pass   # a schema the encoding cannot express: the template declares them as JSON
    try:
      return template.render(messages=chat, tools=tools, documents=documents,
                             add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.exceptions.TemplateError as e:
      # A refusal that names a request field ("tools: ...") is that field's error.
      m = _REQUEST_FIELD.match(str(e))
      field, text = (m.group(0), str(e)[m.end():]) if m else ("", str(e))
      raise ChatTemplateError(f"{field}the chat template refused the request: {text}") from None
    except (TypeError, AttributeError, KeyError, IndexError) as e:
      raise ChatTemplateError(f"messages: the chat template failed on them: {e}") from None

  def render_ids(self, tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None,
                 add_generation_prompt: bool = True, documents: list[dict] | None = None,
                 **template_kwargs) -> list[int]:
    """The prompt's token ids: the template's markup as control tokens, but control-token
    text the request itself carries (a user typing "<|im_end|>") as plain text, as
    transformers' `sanitize_control_tokens=True` encodes it. Without such text it equals
    `encode_prompt(tokenizer, render(...))`."""
    pattern = _control_pattern(_control_tokens(tokenizer))
    mark = functools.partial(_mark, pattern=pattern)
    text = self.render(mark(messages), tools=mark(tools), documents=mark(documents),
                       add_generation_prompt=add_generation_prompt, **mark(template_kwargs))
    pieces = re.compile(f"{_MARK_START}({pattern.pattern}){_MARK_END}"
                        f"|[{_MARK_START}{_MARK_END}]").split(text)
    ids: list[int] = []
    for i, piece in enumerate(pieces):   # text, marked token (None: a stray mark), text, ...
      if piece:
        ids += _plain_ids(tokenizer, piece) if i % 2 else encode_prompt(tokenizer, piece)
    return ids

  def _compile(self, source: str) -> tuple[jinja2.Template, bool]:
    if source not in self._compiled:
      try:
        self._compiled[source] = (_ENV.from_string(source), _loops_over_content(source))
      except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat_template ({self.source or 'given'}): line {e.lineno}: "
                         f"{e.message}") from None
    return self._compiled[source]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
  """A rendered prompt's ids as `apply_chat_template(tokenize=True)` makes them: special-token
  text is its token (the template's markup; also any a user typed, as in transformers by
  default) and the tokenizer adds nothing (templates write BOS themselves)."""
  from engine.model.tiktoken_tokenizer import TiktokenTokenizer
  if isinstance(tokenizer, TiktokenTokenizer):
    return list(tokenizer.encode(prompt, allow_special_tokens=True).ids)
  return list(tokenizer.encode(prompt, add_special_tokens=False).ids)


# Private-use characters put around control-token text in the request's own strings, so the
# encoding tells it from the template's markup (a template's string methods may separate them:
# a stray mark is dropped but still splits the text there).
_MARK_START, _MARK_END = "\ue000", "\ue001"


def _control_tokens(tokenizer: Any) -> tuple[str, ...]:
  from engine.model.tiktoken_tokenizer import TiktokenTokenizer
  if isinstance(tokenizer, TiktokenTokenizer):
    return tuple(tokenizer.special_tokens)
  return tuple(t.content for t in tokenizer.get_added_tokens_decoder().values())


@functools.lru_cache(maxsize=8)
def _control_pattern(tokens: tuple[str, ...]) -> re.Pattern:
  longest_first = sorted(set(tokens), key=len, reverse=True)   # a token before its parts
  return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


def _mark(obj: Any, pattern: re.Pattern) -> Any:
  if isinstance(obj, str):   # marks already there are dropped: they cannot be forged
    obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
    return pattern.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, obj)
  if isinstance(obj, dict):
    return {k: _mark(v, pattern) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_mark(v, pattern) for v in obj]
  return obj


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
  """`text` encoded as plain text, its special-token spellings included."""
  from engine.model.tiktoken_tokenizer import TiktokenTokenizer
  if isinstance(tokenizer, TiktokenTokenizer):
    return list(tokenizer.encode(text, allow_special_tokens=False).ids)
  # tokenizers matches added tokens before its pipeline: run the pipeline without them.
  norm = tokenizer.normalizer.normalize_str(text) if tokenizer.normalizer is not None else text
  splits = ([s for s, _ in tokenizer.pre_tokenizer.pre_tokenize_str(norm)]
            if tokenizer.pre_tokenizer is not None else [norm])
  ids = [t.id for s in splits for t in tokenizer.model.tokenize(s)]
  control = tokenizer.token_to_id(text)
  if control is not None and control in ids:
    raise ValueError(f"messages: {text!r} is a control token this tokenizer cannot encode as "
                     "plain text")
  return ids


# ---- files ----------------------------------------------------------------------------------

def _read(path: str) -> str:
  with open(path, encoding="utf-8") as fh:
    return fh.read()


def _templates_from_config(value: Any, where: str) -> dict[str, str]:
  if value is None:
    return {}
  if isinstance(value, str):
    return {"default": value}
  if isinstance(value, list):
    out = {}
    for i, item in enumerate(value):
      if not (isinstance(item, dict) and isinstance(item.get("name"), str)
              and isinstance(item.get("template"), str)):
        raise ValueError(f"{where}: chat_template[{i}] must be {{name, template}} strings")
      out[item["name"]] = item["template"]
    return out
  raise ValueError(f"{where}: chat_template must be a string or a list of named templates")


def _special_tokens(config: dict) -> dict[str, str]:
  out = {}
  for name in SPECIAL_TOKEN_NAMES:
    value = config.get(name)
    if isinstance(value, dict):   # a serialized AddedToken
      value = value.get("content")
    if isinstance(value, str):
      out[name] = value
  return out


def _deep_sorted(obj: Any) -> Any:
  if isinstance(obj, dict):
    return {k: _deep_sorted(v) for k, v in sorted(obj.items())}
  if isinstance(obj, list):
    return [_deep_sorted(v) for v in obj]
  return obj

