"""gRPC server reflection under both names: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection (1.85) implements only v1alpha, while current tools (grpcurl, Postman,
grpc_cli) ask v1 first and some speak only v1. The two protocols are the same messages under
another package name, so one servicer answers both: the v1 method is served by the v1alpha
servicer with the v1alpha message classes (identical on the wire), and a v1 copy of the
reflection file is added to the descriptor pool so that v1 itself can be described.
"""

from __future__ import annotations

from typing import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA = reflection_v1alpha.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
  """Adds grpc/reflection/v1/reflection.proto to `pool`: v1alpha's file, renamed."""
  try:
    pool.FindFileByName(_V1_FILE)
    return
  except KeyError:
    pass
  proto = descriptor_pb2.FileDescriptorProto()
  v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
  old, new = proto.package, "grpc.reflection.v1"
  proto.name, proto.package = _V1_FILE, new
  proto.ClearField("options")  # v1alpha's language options (java_package, ...)
  for message in proto.message_type:
    for field in message.field:
      if field.type_name.startswith(f".{old}."):
        field.type_name = f".{new}." + field.type_name[len(old) + 2:]
  for service in proto.service:
    for method in service.method:
      method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
      method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
  pool.Add(proto)


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
  """Serves reflection (v1 and v1alpha) for `service_names` and for reflection itself."""
  pool = descriptor_pool.Default()
  _add_v1_descriptor(pool)
  servicer = reflection_aio.ReflectionServicer(list(service_names) + [V1, V1ALPHA], pool=pool)
  method = grpc.stream_stream_rpc_method_handler(
      servicer.ServerReflectionInfo,
      request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
      response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)
  server.add_generic_rpc_handlers([
      grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method})
      for name in (V1, V1ALPHA)])
