"""Request bytes -> messages, where bytes that are not a valid message are a client error.

grpc's generated registration parses each request with `Message.FromString` before the handler
runs; a `DecodeError` there (invalid UTF-8 in a proto3 string, garbage, a truncated message)
reaches the client as UNKNOWN "Unexpected <class 'DecodeError'>" and the server log as a
traceback. Here the deserializer never raises: it returns a `BadRequest` naming the field where
it can, and the handler answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import grpc
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message as pb_message

_STRING = pb_descriptor.FieldDescriptor.TYPE_STRING
_MESSAGE = pb_descriptor.FieldDescriptor.TYPE_MESSAGE
_MAX_DEPTH = 32


@dataclasses.dataclass(frozen=True)
class BadRequest:
  """What a request's bytes decoded to when they are not a valid message."""
  message: str


def _varint(data: bytes, pos: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if pos >= len(data) or shift > 63:
      raise ValueError("truncated varint")
    byte = data[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return value, pos


def bad_utf8_field(descriptor: Any, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
  """The path ("sampling.stop[1]") of the first string field of `descriptor` in the wire
  bytes `data` that is not valid UTF-8; None if there is none or the bytes do not parse."""
  counts: dict[int, int] = {}
  pos = 0
  try:
    while pos < len(data):
      key, pos = _varint(data, pos)
      number, wire_type = key >> 3, key & 7
      if wire_type == 0:
        _, pos = _varint(data, pos)
        continue
      if wire_type in (1, 5):
        pos += 8 if wire_type == 1 else 4
        continue
      if wire_type != 2:
        return None
      size, pos = _varint(data, pos)
      chunk, pos = data[pos:pos + size], pos + size
      if pos > len(data):
        return None
      field = descriptor.fields_by_number.get(number)
      if field is None:
        continue
      index = counts.get(number, 0)
      counts[number] = index + 1
      path = prefix + field.name + (f"[{index}]" if _is_repeated(field) else "")
      if field.type == _STRING:
        try:
          chunk.decode("utf-8")
        except UnicodeDecodeError:
          return path
      elif field.type == _MESSAGE and depth < _MAX_DEPTH:
        inner = bad_utf8_field(field.message_type, chunk, path + ".", depth + 1)
        if inner is not None:
          return inner
  except ValueError:
    return None
  return None


def _is_repeated(field: Any) -> bool:
  is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.28
  if is_repeated is not None:
    return bool(is_repeated)
  return field.label == pb_descriptor.FieldDescriptor.LABEL_REPEATED


def deserializer(cls: type[pb_message.Message]) -> Callable[[bytes], Any]:
  """bytes -> `cls` message, or a BadRequest saying what is wrong with them."""
  def parse(data: bytes) -> Any:
    try:
      return cls.FromString(data)
    except pb_message.DecodeError:
      field = bad_utf8_field(cls.DESCRIPTOR, data)
      if field is not None:
        return BadRequest(f"{field}: not valid UTF-8")
      return BadRequest(f"request is not a valid {cls.DESCRIPTOR.full_name} message")
  return parse


def generic_handler(service: Any, servicer: Any, module: Any,
                    reject: Callable[[Any, BadRequest], Any]) -> grpc.GenericRpcHandler:
  """The handler `add_<Service>Servicer_to_server` would build for `servicer` (methods named
  as in the service descriptor, messages from the generated `module`), with requests parsed
  by `deserializer`; a BadRequest goes to `await reject(context, bad)`, which must abort."""
  handlers = {}
  for method in service.methods:
    request_cls = getattr(module, method.input_type.name)
    response_cls = getattr(module, method.output_type.name)
    impl = getattr(servicer, method.name)
    if method.client_streaming:
      raise NotImplementedError(f"{method.full_name}: client streaming")
    if method.server_streaming:
      make = grpc.unary_stream_rpc_method_handler
      handler = _streaming(impl, reject)
    else:
      make = grpc.unary_unary_rpc_method_handler
      handler = _unary(impl, reject)
    handlers[method.name] = make(handler, request_deserializer=deserializer(request_cls),
                                 response_serializer=response_cls.SerializeToString)
  return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _unary(impl: Callable[..., Any], reject: Callable[..., Any]) -> Callable[..., Any]:
  async def handle(request: Any, context: Any) -> Any:
    if isinstance(request, BadRequest):
      await reject(context, request)
    return await impl(request, context)
  return handle


def _streaming(impl: Callable[..., Any], reject: Callable[..., Any]) -> Callable[..., Any]:
  async def handle(request: Any, context: Any) -> Any:
    if isinstance(request, BadRequest):
      await reject(context, request)
    async for response in impl(request, context):
      yield response
  return handle
