"""The committed gRPC stubs match proto/*.proto (regenerate with `python proto/generate.py`)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(REPO, "engine", "service", "proto")


def test_committed_stubs_are_up_to_date(tmp_path):
  subprocess.run([sys.executable, os.path.join(REPO, "proto", "generate.py"),
                  f"--out={tmp_path}"], check=True, capture_output=True)
  fresh = sorted(f for f in os.listdir(tmp_path) if f.startswith("inference_pb2"))
  assert fresh == ["inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"]
  stale = []
  for name in fresh:
    with open(tmp_path / name) as a, open(os.path.join(COMMITTED, name)) as b:
      if a.read() != b.read():
        stale.append(name)
  assert not stale, f"stale stubs {stale}: run `python proto/generate.py` and commit"


def test_stubs_import_as_a_package():
  from engine.service.proto import inference_pb2, inference_pb2_grpc
  assert inference_pb2.DESCRIPTOR.package == "moejax.v1"
  assert "Inference" in inference_pb2.DESCRIPTOR.services_by_name
  assert hasattr(inference_pb2_grpc, "InferenceStub")
