"""Kimi K2.5's tool declarations: OpenAI function tools as a TypeScript namespace.

Kimi K2.5 was trained with tools declared like

    # Tools

    ## functions
    namespace functions {
    // Get the weather
    type get_weather = (_: {
      city: string,
      // Units
      unit?: "c" | "f"
    }) => any;
    }

which its checkpoint's tokenizer (`tool_declaration_ts.py`, run by `apply_chat_template`) hands
the template as `tools_ts_str`. This is our own implementation of that encoding; the golden
fixtures check it byte for byte against the checkpoint's script. The rules it follows:

* required properties first, each group sorted by name; `?` marks optional ones;
* a property's description, then its constraints (`// maxLength: 5, minLength: 1`, sorted by
  key: string length/pattern, number minimum/maximum, array minItems/maxItems), then
  `// Default: ...` sit as `//` comment lines above it;
* integer is written `number`; enums as `"a" | "b" | 3`; `anyOf` and type lists as unions;
  `additionalProperties` as `[k: string]: T` (`any` for true, `never` for false);
* `$defs` become `interface NAME {...}` before the function's type, `$ref: "#/$defs/NAME"`
  is written `NAME`, and `$ref: "#"` (recursion) makes the parameters `interface parameters`.

Schemas it cannot express raise ValueError (the template then declares the tools as JSON, as
the checkpoint's tokenizer does when its script fails).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

_INDENT = "  "
_CONSTRAINT_KEYS = {"string": ("maxLength", "minLength", "pattern"),
                    "number": ("maximum", "minimum"), "integer": ("maximum", "minimum")}
_UNION_NAMES = {"string": "string", "number": "number", "integer": "number",
                "boolean": "boolean", "null": "null", "object": "{}", "array": "Array<any>"}


@dataclasses.dataclass
class _Type:
  """A parsed schema: what to write for it (`render`) and the comment lines above it."""
  kind: str                   # scalar, object, array, enum, union, ref
  description: str = ""
  constraints: dict = dataclasses.field(default_factory=dict)
  name: str = ""              # scalar type name / ref name
  fields: list = dataclasses.field(default_factory=list)      # object: [_Field]
  extra: Any = None           # object: additionalProperties (None, bool or _Type)
  item: "_Type | None" = None  # array
  members: list = dataclasses.field(default_factory=list)     # union / enum values

  def comments(self, indent: str) -> str:
    lines = []
    if self.description:
      lines.append(_comment(self.description, indent))
    if self.constraints:
      lines.append(indent + "// " + ", ".join(
          f"{k}: {v}" for k, v in sorted(self.constraints.items())))
    return "".join(line + "\n" for line in lines)

  def render(self, indent: str = "") -> str:
    if self.kind == "scalar":
      return "number" if self.name == "integer" else self.name
    if self.kind == "ref":
      return self.name
    if self.kind == "union":
      return " | ".join(m if isinstance(m, str) else m.render(indent) for m in self.members)
    if self.kind == "enum":
      return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.members)
    if self.kind == "array":
      inner = self.item.comments(indent + _INDENT)
      if not inner:
        return f"Array<{self.item.render(indent)}>"
      return (f"Array<\n{inner}{indent}{_INDENT}{self.item.render(indent + _INDENT)}\n"
              f"{indent}>")
    return self._render_object(indent)

  def _render_object(self, indent: str) -> str:
    ordered = (sorted((f for f in self.fields if not f.optional), key=lambda f: f.name)
               + sorted((f for f in self.fields if f.optional), key=lambda f: f.name))
    lines = [f.render(indent + _INDENT) for f in ordered]
    if self.extra is not None:
      if self.extra is True:
        value = "any"
      elif self.extra is False:
        value = "never"
      elif isinstance(self.extra, _Type):
        value = self.extra.render(indent + _INDENT)
      else:
        raise ValueError(f"additionalProperties: cannot declare {self.extra!r}")
      lines.append(f"{indent}{_INDENT}[k: string]: {value}")
    if not lines:
      return "{}"
    return "{\n" + ",\n".join(lines) + "\n" + indent + "}"


@dataclasses.dataclass
class _Field:
  name: str
  type: _Type
  optional: bool
  default: Any = None

  def render(self, indent: str) -> str:
    text = self.type.comments(indent)
    if self.default is not None:
      shown = (repr(self.default) if isinstance(self.default, (int, float, bool))
               else json.dumps(self.default, ensure_ascii=False))
      text += f"{indent}// Default: {shown}\n"
    return f"{text}{indent}{self.name}{'?' if self.optional else ''}: {self.type.render(indent)}"


class _Definitions:
  """One function's `$defs` (in the order met) and whether it refers to itself."""

  def __init__(self):
    self.schemas: dict[str, Any] = {}
    self.recursive = False

  def lookup(self, ref: str) -> str:
    if ref == "#":
      self.recursive = True
      return "parameters"
    if ref.startswith("#/$defs/"):
      name = ref.split("/")[-1]
      if name not in self.schemas:
        raise ValueError(f"$ref {ref!r}: no such definition")
      return name
    raise ValueError(f"$ref {ref!r}: only '#' and '#/$defs/NAME' are supported")


def _comment(text: str, indent: str = "") -> str:
  return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _parse(schema: Any, defs: _Definitions) -> _Type:
  if isinstance(schema, bool):
    return _Type("scalar", name="any" if schema else "null")
  if not isinstance(schema, dict):
    raise ValueError(f"not a JSON schema: {schema!r}")
  description = schema.get("description", "")
  if "$ref" in schema:
    return _Type("ref", description, name=defs.lookup(schema["$ref"]))
  if "anyOf" in schema:
    return _Type("union", description, members=[_parse(s, defs) for s in schema["anyOf"]])
  if "enum" in schema:
    return _Type("enum", description, members=_enum_values(schema))
  if "type" in schema:
    kind = schema["type"]
    if isinstance(kind, list):
      if any(k not in _UNION_NAMES for k in kind):
        raise ValueError(f"type {kind!r}: unknown type in the list")
      return _Type("union", description, members=[_UNION_NAMES[k] for k in kind])
    if kind == "object":
      return _parse_object(schema, defs)
    if kind == "array":
      item = _parse(schema["items"], defs) if schema.get("items") else _Type("scalar", name="any")
      return _Type("array", description, _constraints(schema, ("minItems", "maxItems")),
                   item=item)
    return _Type("scalar", description, _constraints(schema, _CONSTRAINT_KEYS.get(kind, ())),
                 name=kind)
  if not schema:
    return _Type("scalar", name="any")
  raise ValueError(f"not a JSON schema: {schema!r}")


def _parse_object(schema: dict, defs: _Definitions) -> _Type:
  obj = _Type("object", schema.get("description", "") if schema else "")
  if not schema:
    return obj
  defs.schemas.update(schema.get("$defs") or {})
  extra = schema.get("additionalProperties")
  obj.extra = _parse(extra, defs) if isinstance(extra, dict) else extra
  if "properties" not in schema:
    return obj
  required = set(schema.get("required", []))
  for name, prop in schema["properties"].items():
    obj.fields.append(_Field(name, _parse(prop, defs), optional=name not in required,
                             default=prop.get("default") if isinstance(prop, dict) else None))
  return obj


def _constraints(schema: dict, keys: tuple[str, ...]) -> dict:
  return {k: v for k, v in schema.items() if k in keys}


def _enum_values(schema: dict) -> list:
  values = schema["enum"]
  kind = schema.get("type")
  if isinstance(kind, list):
    rest = [k for k in kind if k != "null"]
    if len(kind) == 1:
      kind = kind[0]
    elif len(kind) == 2 and len(rest) < 2:
      kind = rest[0] if rest else "null"
    else:
      raise ValueError(f"enum type {kind!r}: not supported")
  checks = {"string": lambda v: isinstance(v, str),
            "number": lambda v: isinstance(v, (int, float)),
            "integer": lambda v: isinstance(v, int),
            "boolean": lambda v: isinstance(v, bool)}
  if kind in checks:
    for v in values:
      if v is not None and not checks[kind](v):
        raise ValueError(f"enum value {v!r}: not a {kind}")
  return values


def _function(function: dict) -> str:
  defs = _Definitions()
  params = _parse_object(function.get("parameters") or {}, defs)
  parts = []
  if defs.recursive:
    body = ",\n".join(f.render(_INDENT) for f in params.fields)   # as declared, not sorted
    parts.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
  recursive = defs.recursive
  for name, schema in list(defs.schemas.items()):
    if not isinstance(schema, dict):
      raise ValueError(f"$defs.{name}: must be a schema object")
    declared = _parse(schema, defs).render()
    described = schema.get("description", "")
    parts.append((_comment(described) + "\n" if described else "") + f"interface {name} {declared}")
  interfaces = "\n".join(parts)
  name = function.get("name", "function")
  signature = "parameters" if recursive else params.render()
  description = function.get("description")
  pieces = [interfaces, _comment(description) if description else "",
            f"type {name} = (_: {signature}) => any;"]
  return "\n".join(p for p in pieces if p)


def encode_tools(tools: list[dict] | None) -> str:
  """The `tools_ts_str` for OpenAI function tools ("" when there are none)."""
  if not tools:
    return ""
  functions = [_function(t["function"]) for t in tools
               if t.get("type") == "function" and t.get("function")]
  if not functions:
    return ""
  return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
