"""Structured outputs at the service edge: a request's constraint fields -> a compiled,
validated `StructuredOutputsParams` on its `SamplingParams`, or a `FieldError` naming the field.

Where a constraint comes from:
  OpenAI `response_format`  {"type": "text"} (none), {"type": "json_object"} (any JSON object),
                            {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  vLLM `structured_outputs` {"json": schema} | {"json_object": true} | {"regex": ...} |
                            {"choice": [...]} | {"grammar": lark}   (completions and chat)
  gRPC `StructuredOutputs`  oneof json_schema / json_object / regex / choice / grammar, + strict
  tool_choice               "required" / a named function: `tool_constraints.py` (chat only)

`strict` (json_schema): the schema is always enforced (vLLM does the same; OpenAI's non-strict
mode is best effort). strict: true adds OpenAI's strict meaning, exactly the declared keys: every
object schema that says nothing about extra keys (`additionalProperties`, `patternProperties`,
`unevaluatedProperties`) gets `additionalProperties: false` (`strict_schema`); JSON Schema's own
default (extra keys allowed) holds otherwise. Keywords llguidance does not implement are refused
(400) in both modes rather than silently not enforced.

Every constraint is compiled here, on the tokenizer thread that parses the request (llguidance
drops the GIL while it builds; `compile_grammar` caches per tokenizer and spec, and the engine's
own compile of the same spec hits that cache), so a schema or grammar the engine would reject is
a 400 / INVALID_ARGUMENT before admission and the engine never sees a bad grammar.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from engine.runtime.grammar import (GrammarError, StructuredOutputsParams, compile_grammar,
                                    ll_tokenizer)
from engine.service import validation
from engine.service.validation import FieldError, ParsedRequest, RequestLimits

# vLLM's StructuredOutputsParams: the constraint kinds; options honoured (whitespace is never
# free here, there is no fallback backend, `disable_additional_properties` is strict); the
# rest refused.
_VLLM_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_VLLM_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                 "backend")
_VLLM_REFUSED = ("structural_tag", "whitespace_pattern")
_BACKENDS = ("auto", "guidance", "llguidance")
# vLLM's removed per-kind fields: a client still sending them would get unconstrained output.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "guided_decoding_backend")
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_ENGINE_PREFIX = re.compile(r"^structured_outputs\.\w+(\[\d+\])?: ")


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A request's output constraint and the request field each error names."""
  spec: StructuredOutputsParams
  field: str  # e.g. "response_format.json_schema.schema", "structured_outputs.regex"


# ---- strict: exactly the declared keys --------------------------------------------------------

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any) -> Any:
  """A copy of `schema` in which every object schema silent about extra keys forbids them.
  `allOf` branches are left alone: closing each branch would forbid the others' keys."""
  if isinstance(schema, list):
    return [strict_schema(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = dict(schema)
  for key in _SUBSCHEMA_MAPS:
    if isinstance(out.get(key), dict):
      out[key] = {k: strict_schema(v) for k, v in out[key].items()}
  for key in _SUBSCHEMA_LISTS:
    if isinstance(out.get(key), list):
      out[key] = [strict_schema(s) for s in out[key]]
  for key in _SUBSCHEMA_ONE:
    if isinstance(out.get(key), (dict, list)):
      out[key] = strict_schema(out[key])
  types = out.get("type")
  is_object = types == "object" or (isinstance(types, list) and "object" in types) or (
      types is None and "properties" in out)
  if is_object and not any(k in out for k in _OPEN_KEYS):
    out["additionalProperties"] = False
  return out


def schema_text(schema: Any, field: str, strict: bool) -> str:
  """A JSON schema (object or boolean) as the JSON text StructuredOutputsParams takes."""
  if not isinstance(schema, (dict, bool)):
    raise FieldError(field, f"must be a JSON schema (an object or a boolean), got "
                     f"{type(schema).__name__}")
  return json.dumps(strict_schema(schema) if strict else schema, ensure_ascii=False)


# ---- OpenAI / vLLM bodies ---------------------------------------------------------------------

def _get(obj: dict, name: str, types: Any, field: str, default: Any = None) -> Any:
  value = obj.get(name)
  if value is None:
    return default
  bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple)
                                                      else (types,))
  if bad_bool or not isinstance(value, types):
    names = {str: "a string", bool: "a boolean", dict: "an object", list: "an array"}
    want = " or ".join(names.get(t, t.__name__) for t in (types if isinstance(types, tuple)
                                                           else (types,)))
    raise FieldError(field, f"must be {want}, got {type(value).__name__}")
  return value


def from_response_format(fmt: Any, field: str = "response_format") -> Constraint | None:
  """OpenAI's `response_format` (None and {"type": "text"}: no constraint)."""
  if fmt is None:
    return None
  if not isinstance(fmt, dict):
    raise FieldError(field, f"must be an object, got {type(fmt).__name__}")
  kind = _get(fmt, "type", str, f"{field}.type")
  if kind is None:
    raise FieldError(f"{field}.type", "is required ('text', 'json_object' or 'json_schema')")
  if kind == "text":
    return None
  if kind == "json_object":
    return Constraint(StructuredOutputsParams(json_object=True), field)
  if kind != "json_schema":
    raise FieldError(f"{field}.type", f"must be 'text', 'json_object' or 'json_schema', got "
                     f"{kind!r}")
  js = fmt.get("json_schema")
  if not isinstance(js, dict):
    raise FieldError(f"{field}.json_schema", "is required with type 'json_schema': an object "
                     "with name, schema and strict")
  name = _get(js, "name", str, f"{field}.json_schema.name")
  if name is None or not _SCHEMA_NAME.match(name):
    raise FieldError(f"{field}.json_schema.name", "is required: 1-64 characters of a-z, A-Z, "
                     "0-9, '_' and '-'")
  _get(js, "description", str, f"{field}.json_schema.description")
  strict = _get(js, "strict", bool, f"{field}.json_schema.strict", False)
  schema = js.get("schema")
  schema_field = f"{field}.json_schema.schema"
  if schema is None:
    raise FieldError(schema_field, "is required: the JSON schema the output must follow")
  return Constraint(StructuredOutputsParams(json=schema_text(schema, schema_field, strict)),
                    schema_field)


def from_structured_outputs(value: Any, field: str = "structured_outputs") -> Constraint | None:
  """vLLM's `structured_outputs` body field: exactly one of json / json_object / regex /
  choice / grammar."""
  if value is None:
    return None
  if not isinstance(value, dict):
    raise FieldError(field, f"must be an object, got {type(value).__name__}")
  for name in _VLLM_REFUSED:
    if value.get(name) not in (None, False):
      raise FieldError(f"{field}.{name}", "is not supported by this server")
  for name in _VLLM_OPTIONS[:3]:
    _get(value, name, bool, f"{field}.{name}")
  backend = _get(value, "backend", str, f"{field}.backend")
  if backend is not None and backend not in _BACKENDS:
    raise FieldError(f"{field}.backend", f"this server's grammar engine is llguidance; one of "
                     f"{', '.join(_BACKENDS)}, got {backend!r}")
  unknown = sorted(set(value) - set(_VLLM_KINDS) - set(_VLLM_OPTIONS) - set(_VLLM_REFUSED))
  if unknown:
    raise FieldError(f"{field}.{unknown[0]}", f"unknown field; one of {', '.join(_VLLM_KINDS)}")
  given = [k for k in _VLLM_KINDS if value.get(k) not in (None, False)]
  if len(given) != 1:
    raise FieldError(field, f"set exactly one of {', '.join(_VLLM_KINDS)}, got "
                     f"{', '.join(given) or 'none'}")
  kind = given[0]
  sub = f"{field}.{kind}"
  v = value[kind]
  if kind == "json":
    if isinstance(v, str):  # vLLM takes the schema as an object or as JSON text
      try:
        v = json.loads(v)
      except ValueError as e:
        raise FieldError(sub, f"not valid JSON: {e}") from None
    strict = value.get("disable_additional_properties") is True
    return Constraint(StructuredOutputsParams(json=schema_text(v, sub, strict)), sub)
  if kind == "json_object":
    if v is not True:
      raise FieldError(sub, "must be true")
    return Constraint(StructuredOutputsParams(json_object=True), sub)
  if kind == "choice":
    return Constraint(StructuredOutputsParams(choice=check_choices(v, sub)), sub)
  if not isinstance(v, str) or not v:
    raise FieldError(sub, "must be a non-empty string")
  return Constraint(StructuredOutputsParams(**{kind: v}), sub)


def check_choices(values: Any, field: str) -> tuple[str, ...]:
  if not isinstance(values, (list, tuple)) or not values:
    raise FieldError(field, "must be a non-empty array of strings")
  for i, c in enumerate(values):
    if not isinstance(c, str) or not c:
      raise FieldError(f"{field}[{i}]", "must be a non-empty string")
  return tuple(values)


def from_body(body: dict) -> Constraint | None:
  """The constraint of an OpenAI completions or chat body (`response_format` or vLLM's
  `structured_outputs`, not both)."""
  for name in _GUIDED:
    if body.get(name) is not None:
      raise FieldError(name, "is not supported (vLLM removed it): use structured_outputs "
                       "(json, regex, choice, grammar) or response_format")
  fmt = from_response_format(body.get("response_format"))
  so = from_structured_outputs(body.get("structured_outputs"))
  if fmt is not None and so is not None:
    raise FieldError("structured_outputs", "set either response_format or structured_outputs, "
                     "not both")
  return fmt or so


# ---- gRPC `StructuredOutputs` -----------------------------------------------------------------

def from_proto(msg: Any, field: str = "structured_outputs") -> Constraint | None:
  """A proto `StructuredOutputs` (unset oneof: no constraint; `strict` set without a schema
  is refused, it would mean nothing)."""
  which = msg.WhichOneof("kind")
  if which is None:
    if msg.strict:
      raise FieldError(f"{field}.strict", "applies to json_schema, which is not set")
    return None
  sub = f"{field}.{which}"
  if which != "json_schema" and msg.strict:
    raise FieldError(f"{field}.strict", f"applies to json_schema, not {which}")
  if which == "json_schema":
    try:
      schema = json.loads(msg.json_schema)
    except ValueError as e:
      raise FieldError(sub, f"not valid JSON: {e}") from None
    return Constraint(StructuredOutputsParams(json=schema_text(schema, sub, msg.strict)), sub)
  if which == "json_object":
    if not msg.json_object:
      raise FieldError(sub, "must be true when set")
    return Constraint(StructuredOutputsParams(json_object=True), sub)
  if which == "choice":
    return Constraint(StructuredOutputsParams(choice=check_choices(list(msg.choice.values),
                                                                   f"{sub}.values")), sub)
  value = getattr(msg, which)
  if not value:
    raise FieldError(sub, "must be a non-empty string")
  return Constraint(StructuredOutputsParams(**{which: value}), sub)


# ---- compile at the edge ----------------------------------------------------------------------

def engine_reason(e: GrammarError) -> str:
  """The grammar engine's reason without its own field prefix (ours names the request's)."""
  return _ENGINE_PREFIX.sub("", str(e), count=1)


def compile_checked(spec: StructuredOutputsParams, field: str, tokenizer: Any,
                    limits: RequestLimits) -> StructuredOutputsParams:
  """Compiles `spec` for this model (cached); a GrammarError -> FieldError(field, reason)."""
  if tokenizer is None:
    raise FieldError(field, "structured outputs need the model's tokenizer; this model has none")
  try:
    compile_grammar(spec, tokenizer, vocab_size=limits.vocab_size,
                    eos_token_ids=limits.eos_token_ids)
  except GrammarError as e:
    raise FieldError(field, engine_reason(e)) from None
  return spec


def prepare_tokenizer(tokenizer: Any, limits: RequestLimits) -> str | None:
  """Builds llguidance's form of the tokenizer now (server warm-up; ~1 s for a 160k vocabulary)
  rather than on the first constrained request. Returns why it cannot be built, or None."""
  try:
    ll_tokenizer(tokenizer, limits.vocab_size, limits.eos_token_ids)
  except GrammarError as e:
    return str(e)
  return None


def constrain(requests: Sequence[ParsedRequest], spec: StructuredOutputsParams | None
              ) -> list[ParsedRequest]:
  """The requests with `spec` on their sampling parameters (unchanged when None)."""
  if spec is None:
    return list(requests)
  return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling,
                                                              structured_outputs=spec))
          for r in requests]


def parse_generate(request: Any, tokenizer: Any, limits: RequestLimits) -> ParsedRequest:
  """`validation.parse_generate` plus the request's `structured_outputs`, compiled."""
  parsed = validation.parse_generate(request, tokenizer, limits)
  if not request.HasField("structured_outputs"):
    return parsed
  c = from_proto(request.structured_outputs)
  if c is None:
    return parsed
  return constrain([parsed], compile_checked(c.spec, c.field, tokenizer, limits))[0]
