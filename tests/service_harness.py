"""Shared harness of the gRPC service tests (`test_service.py`, `test_service_ops.py`):
the module-scoped demo model and warm Engine, a `serve` fixture that starts a server around
it, and small helpers. Test modules import everything from here (pytest finds the fixtures).

One warm Engine over the bundled demo model (it has a tokenizer) is shared by a test module;
each test starts its own server around it (cheap: no warm-up) so configurations can differ.
Only one server runs at a time, and direct `eng.generate` references are computed before it
starts: the server's engine thread must be the only caller of `step()`.
"""

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

import engine as moejax
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.service import bench
from engine.service import server as server_module
from engine.service import servicer as servicer_module
from engine.service.client import AsyncInferenceClient, InferenceClient, build_request
from engine.chat.reasoning import ReasoningConfig
from engine.service.background import BackgroundServer
from engine.service.server import ServerConfig, read_api_keys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "checkpoints", "demo", "target")
PROMPT = "def read_config(path):"
# Small limits keep the compiled shape set (and warm-up) small.
ENGINE_CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, row_widths=(32,),
                             max_model_len=128, max_decode_steps=4)
BASE = ServerConfig(port=0, warmup=False, stats_log_interval_s=0)
# ChatML-like, Qwen3-style tool markup (a server with it parses with the qwen3 family): tools
# first, so a conversation's turns share their prefix; `thinking` opens a think block.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}</tools>\n"
    "{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>\n"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% if thinking %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="module")
def demo():
  return moejax.load(DEMO)


@pytest.fixture(scope="module")
def eng(demo):
  e = Engine.from_model(demo, ENGINE_CONFIG)
  e.warmup()
  return e


@pytest.fixture
def serve(eng):
  """serve(**ServerConfig fields) -> a running BackgroundServer, closed after the test."""
  servers = []

  def start(metrics_port=None, wait_ready=True, **overrides):
    bg = BackgroundServer(eng, ServerConfig(**{**BASE.__dict__, **overrides}), metrics_port,
                          wait_ready)
    servers.append(bg)
    return bg

  yield start
  for bg in servers:
    bg.close()
  assert_idle(eng)


def target(bg):
  return f"127.0.0.1:{bg.port}"


def wait_until(pred, timeout=30.0, what="condition"):
  deadline = time.monotonic() + timeout
  while not pred():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


def assert_idle(e):
  """Every request finished and every page back in the pool."""
  wait_until(lambda: not e.has_unfinished() and all(r.finished for r in e.requests.values()),
             what="engine idle")
  e.pool.check_invariants()
  assert e.pool.num_free == e.pool.num_pages - 1


def status_of(fn):
  try:
    fn()
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


@contextlib.contextmanager
def gated_engine(monkeypatch, e):
  """Holds the engine thread before each step until the gate opens: requests stay queued."""
  gate = threading.Event()
  step = e.step
  monkeypatch.setattr(e, "step", lambda: (gate.wait(), step())[1])
  try:
    yield gate
  finally:
    gate.set()


def armed_step_failures(monkeypatch, e, engine_loop) -> list:
  """Each item appended to the returned list arms one step failure ("device lost"): it fires
  on the next step that runs a subscribed, unfinished request. Not on a step that only
  settles an earlier abort, nor one between a request's subscription and its admission:
  those fail no live request, and a test's next request would then succeed."""
  step, armed = e.step, []

  def failing_step():
    live = [rid for rid in engine_loop.subscribed()
            if (req := e.requests.get(rid)) is not None and not req.finished]
    if armed and live:
      armed.pop()
      raise RuntimeError("device lost")
    return step()

  monkeypatch.setattr(e, "step", failing_step)
  return armed


def random_ids(rng, lo=1, hi=60):
  return [rng.randrange(3, 8000) for _ in range(rng.randrange(lo, hi))]


# ---- outputs -------------------------------------------------------------------------------
