"""The lockstep channel of a multi-process job: process 0 (the leader) tells the followers, in
order, everything they run; they answer only heartbeats.

Transport: one TCP connection from each follower to the leader, frames of a 21-byte header
(magic, kind, sequence number, length) and a payload. `bench/lockstep_channel.py` measured it
against jax's coordination key-value store, a broadcast collective and gRPC (BENCHMARKS.md,
"Issue 56: lockstep channel"): it is the cheapest by 10-50x for step-sized messages, and a dead
peer shows as a closed connection at once instead of after a missed-heartbeat timeout.

Messages (`Kind`):
* HELLO (follower -> leader): its process index, the token, and the settings that decide which
  programs it compiles (`fingerprint`); the leader answers WELCOME, or REJECT naming every
  setting that differs from its own (a job whose processes would compile different programs
  would hang in their collectives).
* STEP (leader -> followers): one serialised step description (`StepDescription.to_bytes`),
  sent before the leader runs the step's program; a follower runs the same program on the same
  inputs, then answers DONE with the step's number. WARMUP (leader -> followers): warm-up
  begins; a follower compiles the same programs ahead (warm-up's own steps follow as STEPs).
* DONE (follower -> leader): step number n ran. The step watchdog: a STEP not DONE by every
  follower within `step_timeout_s` of its sending declares that follower lost (a hung
  program, a wedged device), also while its reader thread still answers heartbeats.
* HEARTBEAT (both ways): the leader sends one every `heartbeat_s`; each follower's reader thread
  answers at once, also while its main thread runs a long program. Either side that hears
  nothing for `timeout_s` declares the other lost.
* SHUTDOWN (leader -> followers): after the leader drained; the processes then leave
  `jax.distributed` together (its shutdown barrier needs all of them) and exit 0.

Rendezvous: the leader listens on `port` (0: any free port) and broadcasts host, port and a
random token to the followers with one collective (`sharding.broadcast_from_leader`); the token
keeps anything else that can reach the port from reading the job's step descriptions.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hmac
import json
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable

MAGIC = b"MJLS"
HEADER = struct.Struct("<4sBQQ")  # magic, kind, sequence number, payload bytes
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing this long is not a follower


class Kind(enum.IntEnum):
  HELLO = 1
  WELCOME = 2
  REJECT = 3
  STEP = 4
  WARMUP = 5
  HEARTBEAT = 6
  SHUTDOWN = 7
  DONE = 8


class LockstepError(RuntimeError):
  """The other side is gone, silent, or refused this one."""


@dataclasses.dataclass(frozen=True)
class Message:
  kind: Kind
  seq: int
  payload: bytes = b""


def _read_exact(conn: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = conn.recv_into(view[got:])
    if not k:
      raise LockstepError("connection closed")
    got += k
  return bytes(buf)


def read_message(conn: socket.socket) -> Message:
  magic, kind, seq, size = HEADER.unpack(_read_exact(conn, HEADER.size))
  if magic != MAGIC:
    raise LockstepError(f"not a lockstep frame (magic {magic!r})")
  return Message(Kind(kind), seq, _read_exact(conn, size) if size else b"")


def frame(kind: Kind, seq: int, payload: bytes = b"") -> bytes:
  return HEADER.pack(MAGIC, int(kind), seq, len(payload)) + payload


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
  """The settings two fingerprints disagree on, as 'name: leader ... , follower ...'."""
  return [f"{k}: leader {mine.get(k)!r}, this process {theirs.get(k)!r}"
          for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


class Leader:
  """Process 0's side: accepts the followers, sends to all of them in order, watches them.

  `on_lost(process_index, reason)` is called once, from a channel thread, when a follower's
  connection closes, it misses heartbeats for `timeout_s`, or it has not finished a STEP
  `step_timeout_s` after its sending (None: no step watchdog; the attribute may be changed)."""

  def __init__(self, num_followers: int, fingerprint: dict[str, Any], token: str,
               port: int = 0, heartbeat_s: float = 5.0, timeout_s: float = 20.0,
               on_lost: Callable[[int, str], None] | None = None,
               step_timeout_s: float | None = None):
    self.num_followers, self.fingerprint, self.token = num_followers, fingerprint, token
    self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
    self.step_timeout_s = step_timeout_s
    self._steps: collections.deque[tuple[int, float]] = collections.deque()  # not all DONE
    self._done: dict[int, int] = {}  # each follower's last DONE step number
    self.sent = dict(steps=0, bytes=0, seconds=0.0)  # STEPs: how many, their bytes, send time
    self.on_lost = on_lost
    if socket.has_dualstack_ipv6():
      self._server = socket.create_server(("", port), family=socket.AF_INET6,
                                          dualstack_ipv6=True)
    else:
      self._server = socket.create_server(("", port))
    self.port = self._server.getsockname()[1]
    self._conns: dict[int, socket.socket] = {}
    self._last_seen: dict[int, float] = {}
    self._send_lock = threading.Lock()
    self._seq = 0
    self._closed = threading.Event()
    self._lost = False
    self._lose_lock = threading.Lock()

  def accept(self, timeout_s: float) -> None:
    """Waits for every follower's HELLO; raises LockstepError on a timeout or a mismatch."""
    deadline = time.monotonic() + timeout_s
    while len(self._conns) < self.num_followers:
      self._server.settimeout(max(0.1, deadline - time.monotonic()))
      try:
        conn, _ = self._server.accept()
      except socket.timeout:
        missing = self.num_followers - len(self._conns)
        raise LockstepError(f"{missing} follower(s) did not connect within {timeout_s:.0f}s")
      conn.settimeout(min(HELLO_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
      try:
        hello = read_message(conn)
        info = json.loads(hello.payload)
      except (LockstepError, OSError, ValueError):
        conn.close()  # not a follower (a port scan, a health probe): keep waiting
        continue
      if hello.kind != Kind.HELLO or not hmac.compare_digest(str(info.get("token", "")),
                                                             self.token):
        conn.close()
        continue
      pid, diff = int(info["process"]), differences(self.fingerprint, info["fingerprint"])
      if diff:
        conn.sendall(frame(Kind.REJECT, 0, "\n".join(diff).encode()))
        conn.close()
        raise LockstepError(f"process {pid} was started with other settings:\n  "
                            + "\n  ".join(diff))
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      conn.settimeout(None)
      conn.sendall(frame(Kind.WELCOME, 0))
      self._conns[pid] = conn
      self._last_seen[pid] = time.monotonic()
      self._done[pid] = 0
    self._server.close()
    for pid, conn in self._conns.items():
      threading.Thread(target=self._read, args=(pid, conn), name=f"lockstep-read-{pid}",
                       daemon=True).start()
    threading.Thread(target=self._heartbeat, name="lockstep-heartbeat", daemon=True).start()

  def send(self, kind: Kind, payload: bytes = b"") -> int:
    """Sends one message to every follower (in the order of calls); returns its number."""
    with self._send_lock:
      if self._lost:
        raise LockstepError("a follower is lost")
      t0 = time.perf_counter()
      self._seq += 1
      data = frame(kind, self._seq, payload)
      if kind == Kind.STEP:
        self._steps.append((self._seq, time.monotonic()))
      for pid, conn in self._conns.items():
        try:
          conn.sendall(data)
        except OSError as e:
          self._lose(pid, f"send failed: {e}")
          raise LockstepError(f"process {pid}: {e}") from None
      if kind == Kind.STEP:
        self.sent["steps"] += 1
        self.sent["bytes"] += len(payload)
        self.sent["seconds"] += time.perf_counter() - t0
      return self._seq

  def shutdown(self) -> None:
    """SHUTDOWN to every follower, then closes (the followers then leave the job)."""
    try:
      self.send(Kind.SHUTDOWN)
    finally:
      self.close()

  def close(self) -> None:
    self._closed.set()
    for conn in self._conns.values():
      try:
        conn.close()
      except OSError:
        pass

  def _lose(self, pid: int, reason: str) -> None:
    with self._lose_lock:  # the reader and heartbeat threads may both find the loss
      if self._lost or self._closed.is_set():
        return
      self._lost = True
    if self.on_lost is not None:
      self.on_lost(pid, reason)

  def _read(self, pid: int, conn: socket.socket) -> None:
    try:
      while True:
        msg = read_message(conn)
        if msg.kind in (Kind.HEARTBEAT, Kind.DONE):
          self._last_seen[pid] = time.monotonic()
        if msg.kind == Kind.DONE:
          self._done[pid] = msg.seq
    except (LockstepError, OSError, ValueError) as e:
      self._lose(pid, f"connection lost ({e})")

  def _heartbeat(self) -> None:
    while not self._closed.wait(self.heartbeat_s):
      try:
        self.send(Kind.HEARTBEAT)
      except LockstepError:
        return
      now = time.monotonic()
      for pid, seen in self._last_seen.items():
        if now - seen > self.timeout_s:
          self._lose(pid, f"no heartbeat for {now - seen:.0f}s")
          return
      late = self.late_step(now)
      if late is not None:
        self._lose(*late)
        return

  def late_step(self, now: float) -> tuple[int, str] | None:
    """(follower, reason) for the first follower whose oldest unfinished STEP is older than
    `step_timeout_s`; forgets the steps every follower finished."""
    with self._send_lock:
      all_done = min(self._done.values(), default=0)
      while self._steps and self._steps[0][0] <= all_done:
        self._steps.popleft()
      if self.step_timeout_s is None:
        return None
      for pid, done in self._done.items():
        for seq, sent in self._steps:
          if seq > done:
            if now - sent > self.step_timeout_s:
              return pid, (f"step {seq} not done {now - sent:.0f}s after it was sent (step "
                           f"timeout {self.step_timeout_s:.0f}s)")
            break
    return None


class Follower:
  """A follower's side: connects, says HELLO, then hands the leader's messages to `recv` in
  order; heartbeats are answered on the reader thread."""

  def __init__(self, host: str, port: int, process_index: int, fingerprint: dict[str, Any],
               token: str, timeout_s: float = 20.0, connect_timeout_s: float = 60.0):
    self.timeout_s = timeout_s
    self.address = f"{host}:{port}"
    deadline = time.monotonic() + connect_timeout_s
    while True:
      try:
        self.conn = socket.create_connection((host, port), timeout=connect_timeout_s)
        break
      except OSError as e:
        if time.monotonic() >= deadline:
          raise LockstepError(f"cannot reach the leader at {self.address}: {e}") from None
        time.sleep(0.2)
    self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    self.conn.sendall(frame(Kind.HELLO, 0, json.dumps(
        dict(process=process_index, token=token, fingerprint=fingerprint)).encode()))
    reply = read_message(self.conn)
    if reply.kind == Kind.REJECT:
      raise LockstepError("the leader refused this process, started with other settings:\n  "
                          + reply.payload.decode().replace("\n", "\n  "))
    if reply.kind != Kind.WELCOME:
      raise LockstepError(f"unexpected {reply.kind.name} from the leader")
    self.conn.settimeout(timeout_s)  # silence this long = the leader is lost
    self._inbox: queue.Queue[Message | LockstepError] = queue.Queue()
    self._send_lock = threading.Lock()
    self.lost: str | None = None
    threading.Thread(target=self._read, name="lockstep-read", daemon=True).start()

  def recv(self, timeout_s: float | None = None) -> Message | None:
    """The leader's next message (None after `timeout_s`); LockstepError once it is lost."""
    try:
      item = self._inbox.get(timeout=timeout_s)
    except queue.Empty:
      return None
    if isinstance(item, LockstepError):
      self._inbox.put(item)  # every later call fails too
      raise item
    return item

  def done(self, seq: int) -> None:
    """Tells the leader that its message `seq` (a STEP) ran here."""
    try:
      with self._send_lock:
        self.conn.sendall(frame(Kind.DONE, seq))
    except OSError as e:
      raise LockstepError(f"lost the leader at {self.address} ({e})") from None

  def close(self) -> None:
    try:
      self.conn.close()
    except OSError:
      pass

  def _read(self) -> None:
    try:
      while True:
        msg = read_message(self.conn)
        if msg.kind == Kind.HEARTBEAT:
          with self._send_lock:
            self.conn.sendall(frame(Kind.HEARTBEAT, msg.seq))
        else:
          self._inbox.put(msg)
          if msg.kind == Kind.SHUTDOWN:
            return
    except socket.timeout:
      self.lost = f"no message from the leader at {self.address} for {self.timeout_s:.0f}s"
    except (LockstepError, OSError) as e:
      self.lost = f"lost the leader at {self.address} ({e})"
    self._inbox.put(LockstepError(self.lost))
