"""One replica over several processes (hosts): the leader serves, the followers follow.

Process 0, the leader, runs the APIs, the scheduler and all request state; the followers serve
no API (only a liveness `/health` on --http_port, 200 while in lockstep) and run what the
leader sends over the lockstep channel (`lockstep.py`, WORKSPACE "More than one device").

    group = multihost.connect(eng, settings, fingerprint)   # every process, after the Engine
    if group.follower:  exit(multihost.follow(eng, group, ...))
    multihost.lead(eng, group)                  # the leader: its steps go to the followers
    ... multihost.watch(group, server, loop); server.start(); multihost.serving(group) ...
    multihost.leave(group)

The processes size the KV cache alike, check that they were started with the same settings and
connect. Then the leader's model runner sends every step description it is about to run
(`ModelRunner.on_step`: warm-up programs, the cost table's timing calls, prefill and decode
calls, speculative calls, constrained steps with their masks, the vision tower) as a STEP, and
WARMUP when warm-up begins (`on_warmup`); a follower compiles the warm-up programs ahead on
WARMUP and runs each STEP through its own runner on its own shards, then answers DONE. Every
input of a program is in its description, so followers never time or decide anything, and the
JAX programs of all processes run in the same order on the same inputs. The sends happen on
the host between programs, never inside the on-device decode loop.

Leaving: SIGTERM on the leader drains, then SHUTDOWN takes every process out of
`jax.distributed` with exit status 0. Failing: a lost follower (closed connection, missed
heartbeats, or a STEP not DONE within the step timeout) turns the leader NOT_SERVING, fails its
in-flight requests and exits it non-zero; a lost leader exits the followers non-zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Any

import jax

from engine.model import sharding
from engine.runtime import warmup
from engine.runtime.step_description import StepDescription
from engine.service import lockstep

RENDEZVOUS_BYTES = 1024
FAIL_GRACE_S = 1.0  # a lost follower: the in-flight requests' errors reach clients, then exit


@dataclasses.dataclass(frozen=True)
class Settings:
  coordinator_host: str | None  # followers connect to the leader there (None: as broadcast)
  lockstep_port: int = 0  # the leader's channel port (0: any free port)
  connect_timeout_s: float = 120.0
  heartbeat_timeout_s: float = 20.0
  drain_timeout_s: float = 30.0  # a follower told SIGTERM waits this (+ margin) for SHUTDOWN
  step_timeout_s: float = 120.0  # the step watchdog once serving (warm-up: >= connect timeout)


@dataclasses.dataclass
class Group:
  settings: Settings
  leader: lockstep.Leader | None = None
  follower: lockstep.Follower | None = None


def fingerprint(eng: Any, **extra: Any) -> dict[str, str]:
  """The settings that decide which programs a process compiles and runs, as strings; two
  processes of a job must agree on all of them (`lockstep.differences` names the others)."""
  out = {f"engine.{f.name}": repr(getattr(eng.config, f.name))
         for f in dataclasses.fields(eng.config) if f.name != "compilation_cache_dir"}
  out.update({"model": repr(eng.cfg), "params_dtype": str(eng.params["embed"].dtype),
              "mesh": repr(None if eng.mesh is None else dict(eng.mesh.shape)),
              "num_pages": str(eng.pool.num_pages), "buckets": repr(eng.buckets),
              "processes": str(jax.process_count()), "jax": jax.__version__})
  out.update({k: repr(v) for k, v in extra.items()})
  return out


def connect(eng: Any, settings: Settings, extra: dict[str, Any] | None = None) -> Group:
  """Every process of the job, after building its Engine: the leader listens and broadcasts
  where (one collective), the followers connect; raises LockstepError (naming what differs,
  or who did not come) within `connect_timeout_s`."""
  group = Group(settings)
  fp = fingerprint(eng, **(extra or {}))
  if jax.process_index() == 0:
    token = secrets.token_hex(16)
    group.leader = lockstep.Leader(
        jax.process_count() - 1, fp, token, port=settings.lockstep_port,
        heartbeat_s=max(0.5, settings.heartbeat_timeout_s / 4),
        timeout_s=settings.heartbeat_timeout_s,
        step_timeout_s=max(settings.step_timeout_s, settings.connect_timeout_s))
    host = settings.coordinator_host or socket.getfqdn()
    sharding.broadcast_from_leader(json.dumps(
        dict(host=host, port=group.leader.port, token=token)).encode(), RENDEZVOUS_BYTES)
    group.leader.accept(settings.connect_timeout_s)
    print(f"[moejax] lockstep: {jax.process_count() - 1} follower(s) connected on port "
          f"{group.leader.port}", file=sys.stderr, flush=True)
  else:
    where = json.loads(sharding.broadcast_from_leader(b"", RENDEZVOUS_BYTES))
    group.follower = lockstep.Follower(
        settings.coordinator_host or where["host"], where["port"], jax.process_index(), fp,
        where["token"], timeout_s=settings.heartbeat_timeout_s,
        connect_timeout_s=settings.connect_timeout_s)
  return group


def lead(eng: Any, group: Group) -> None:
  """The leader's model runner sends each step description to the followers before running
  it, and WARMUP as warm-up begins (both from the engine's thread, in program order)."""
  chan = group.leader
  eng.runner.on_step = lambda desc: chan.send(lockstep.Kind.STEP, desc.to_bytes())
  eng.runner.on_warmup = lambda: chan.send(lockstep.Kind.WARMUP)


def serving(group: Group) -> None:
  """Warm-up is over (its first runs compiled): the step watchdog's own timeout from now."""
  if group.leader is not None:
    group.leader.step_timeout_s = group.settings.step_timeout_s


def watch(group: Group, server: Any, loop: asyncio.AbstractEventLoop) -> None:
  """A lost follower: the leader's health turns NOT_SERVING, new requests are refused, the
  in-flight ones end with an error naming the lost process, and the process exits with status
  1 (not through jax's shutdown barrier, which would wait for the lost process), so
  LeaderWorkerSet or SLURM restarts the group. The engine's thread may be stuck in a program
  the lost process never joins: nothing here waits for it."""
  def lost(pid: int, reason: str) -> None:
    message = f"lost process {pid} of the job: {reason}"
    print(f"[moejax] error: {message}; not serving, exiting", file=sys.stderr, flush=True)
    try:
      asyncio.run_coroutine_threadsafe(server.refuse_new(), loop).result(5)
      server.engine_loop.fail_all(f"the replica stopped serving: {message}", retryable=True)
      time.sleep(FAIL_GRACE_S)
    except Exception:  # the loop may be gone; exiting matters more
      pass
    os._exit(1)
  group.leader.on_lost = lost


def leave(group: Group) -> None:
  """The leader after draining: SHUTDOWN to the followers, then out of `jax.distributed`
  together (its barrier waits up to the heartbeat timeout for each process)."""
  if group.leader is not None:
    group.leader.on_lost = None  # the followers now close their connections on purpose
    sent = group.leader.sent
    print(f"[moejax] lockstep: sent {sent['steps']} steps, {sent['bytes']} bytes, "
          f"{sent['seconds'] * 1e3:.1f} ms in send", file=sys.stderr, flush=True)
    try:
      group.leader.shutdown()
    except lockstep.LockstepError as e:
      print(f"[moejax] error: shutting the followers down: {e}", file=sys.stderr, flush=True)
      os._exit(1)
  jax.distributed.shutdown()


class _Liveness(http.server.BaseHTTPRequestHandler):
  """`/health` of a follower: 200 while in lockstep (its server's `healthy()`), else 503."""

  def do_GET(self) -> None:  # noqa: N802 (http.server's name)
    if self.path.split("?")[0] != "/health":
      code, status = 404, "not found (a follower serves only /health)"
    elif self.server.healthy():
      code, status = 200, "ok"
    else:
      code, status = 503, "not in lockstep"
    body = json.dumps({"status": status}).encode()
    self.send_response(code)
    self.send_header("content-type", "application/json")
    self.send_header("content-length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args: Any) -> None:
    pass


def follow(eng: Any, group: Group, http_host: str | None = None,
           http_port: int | None = None) -> int:
  """A follower's life: run the leader's messages (WARMUP: compile warm-up's programs ahead;
  STEP: run the description, answer DONE) until SHUTDOWN (exit status 0) or until the leader
  is lost or a step fails here (1). SIGTERM: leave if SHUTDOWN has not come within the drain
  timeout plus a margin (the leader, told the same, drains first)."""
  chan = group.follower
  state = {"healthy": True, "deadline": None}
  liveness = None
  if http_port is not None:
    liveness = http.server.ThreadingHTTPServer((http_host or "", http_port), _Liveness)
    liveness.healthy = lambda: state["healthy"] and chan.lost is None
    threading.Thread(target=liveness.serve_forever, name="moejax-liveness", daemon=True).start()
    print(f"[moejax] follower {jax.process_index()}: liveness on "
          f"http://{http_host}:{liveness.server_port}/health", file=sys.stderr, flush=True)

  def on_term(signum: int, frame: Any) -> None:
    state["deadline"] = time.monotonic() + group.settings.drain_timeout_s + 15
    print("[moejax] follower: SIGTERM; leaving with the leader's SHUTDOWN", file=sys.stderr,
          flush=True)
  signal.signal(signal.SIGTERM, on_term)
  signal.signal(signal.SIGINT, on_term)

  print(f"[moejax] follower {jax.process_index()} ready: in lockstep with the leader at "
        f"{chan.address}", file=sys.stderr, flush=True)
  steps = 0
  try:
    while True:
      if state["deadline"] is not None and time.monotonic() > state["deadline"]:
        print("[moejax] error: no SHUTDOWN from the leader after SIGTERM", file=sys.stderr,
              flush=True)
        os._exit(1)
      msg = chan.recv(timeout_s=0.5)
      if msg is None:
        continue
      if msg.kind == lockstep.Kind.SHUTDOWN:
        break
      if msg.kind == lockstep.Kind.STEP:
        eng.runner.execute(StepDescription.from_bytes(msg.payload))
        chan.done(msg.seq)
        steps += 1
      elif msg.kind == lockstep.Kind.WARMUP:
        t0 = time.perf_counter()
        shapes = warmup.warmup_shapes(eng)
        n = len(warmup.compile_ahead(eng, shapes, warmup.compile_workers(), None,
                                     [f"{k} [{b}x{w}]" for k, b, w in shapes]))
        print(f"[moejax] follower {jax.process_index()}: compiled {n} warm-up shapes ahead in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
      else:
        raise lockstep.LockstepError(f"unexpected {msg.kind.name} from the leader")
  except Exception as e:  # the leader lost, or a step failed here: the job cannot go on
    state["healthy"] = False
    print(f"[moejax] error: follower {jax.process_index()}: {e}; exiting", file=sys.stderr,
          flush=True)
    os._exit(1)  # not through jax's shutdown barrier: the leader will not come to it
  chan.close()
  if liveness is not None:
    liveness.shutdown()
  jax.distributed.shutdown()
  print(f"[moejax] follower {jax.process_index()} stopped after {steps} steps", file=sys.stderr,
        flush=True)
  return 0
