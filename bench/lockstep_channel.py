"""What one lockstep message costs, process 0 -> process 1, per channel (issue 56).

    python -m bench.lockstep_channel --out=lockstep_channel.json
    python -m bench.lockstep_channel --sizes=1024,65536 --iters=100

Starts two `jax.distributed` processes on this machine with two CPU devices each (the layout
of the multi-process serving tests) and sends step-description-sized payloads from process 0
(the leader) to process 1 (the follower) through:

* `kv`: the coordination service's key-value store (`key_value_set_bytes` on the leader,
  `blocking_key_value_get_bytes` on the follower; the service runs inside the leader);
* `broadcast`: `multihost_utils.broadcast_one_to_all` of a uint8 array (a jitted psum over
  every device of the job: host -> device, the collective, device -> host);
* `grpc`: a unary gRPC call from the leader to a server in the follower (grpcio);
* `socket`: a raw TCP connection in the engine's lockstep frames (`engine/service/lockstep.py`),
  TCP_NODELAY.

(ZeroMQ is not installed in this environment; over TCP it would cost what `socket` does plus
its framing.) For each payload the leader times a round trip: the payload out, a 1-byte
acknowledgement back through the same channel (`broadcast` needs none: the call returns when
every process has contributed). `one_way_us` = round trip - half the 1-byte round trip, the
delay a follower's step would start after the leader's. `send_us`: what the send call blocks
the leader. The follower checks every payload's bytes. Prints a table, one JSON
line, and writes JSON with `--out`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["1", "1024", "20480", "65536", "1048576", "1310720", "6553600"],
                  "Payload bytes. 20480: one row's grammar bitmask for Kimi K2.5's 163,840-token "
                  "vocabulary; 1310720: 64 rows; 6553600: 64 rows x 5 positions (K = 4 drafts).")
flags.DEFINE_list("channels", ["kv", "broadcast", "grpc", "socket"], "Channels to measure.")
flags.DEFINE_integer("iters", 200, "Round trips per payload up to 64 KB (fewer above).",
                     lower_bound=5)
flags.DEFINE_string("out", "", "Write the results as JSON here.")
flags.DEFINE_string("role", "", "(internal) 'child' in the processes the bench starts.")
flags.DEFINE_integer("process_id", 0, "(internal)")
flags.DEFINE_integer("coordinator_port", 0, "(internal)")
flags.DEFINE_integer("socket_port", 0, "(internal)")
flags.DEFINE_integer("grpc_port", 0, "(internal)")

MAX_MESSAGE = 64 << 20


def _iters(size: int) -> int:
  return FLAGS.iters if size <= 65536 else max(5, FLAGS.iters // (4 if size <= 2 << 20 else 10))


def _payloads(size: int) -> list[bytes]:
  """Two random payloads, alternated (the coordination service compresses; a pattern would
  flatter it). Made before the timing, on both sides."""
  return [random.Random(size * 10 + k).randbytes(size) for k in range(2)]


# ---- channels: (leader_send, follower_recv, follower_ack, leader_wait_ack) --------------------


class KV:
  """The coordination service's key-value store (what `jax.distributed` already runs)."""

  def __init__(self, pid: int):
    from jax._src import distributed
    self.client, self.pid, self.n = distributed.global_state.client, pid, 0

  def send(self, data: bytes, i: int) -> None:
    self.client.key_value_set_bytes(f"bench/step/{i}", data)

  def recv(self, i: int) -> bytes:
    return self.client.blocking_key_value_get_bytes(f"bench/step/{i}", 60_000)

  def ack(self, i: int) -> None:
    self.client.key_value_set_bytes(f"bench/ack/{i}", b"\1")

  def wait_ack(self, i: int) -> None:
    self.client.blocking_key_value_get_bytes(f"bench/ack/{i}", 60_000)
    # The leader drops both keys once the follower has the step (as a server would).
    self.client.key_value_delete(f"bench/step/{i}")
    self.client.key_value_delete(f"bench/ack/{i}")

  def close(self) -> None:
    pass


class Broadcast:
  """`broadcast_one_to_all` of a uint8 array; every size is compiled before it is timed."""

  def __init__(self, pid: int):
    import numpy as np
    from jax.experimental import multihost_utils
    self.np, self.bcast, self.pid, self.size = np, multihost_utils.broadcast_one_to_all, pid, 0

  def send(self, data: bytes, i: int) -> None:
    self.bcast(self.np.frombuffer(data, self.np.uint8))

  def recv(self, i: int) -> bytes:
    return self.bcast(self.np.zeros(self.size, self.np.uint8)).tobytes()

  def ack(self, i: int) -> None:
    pass

  def wait_ack(self, i: int) -> None:
    pass

  def close(self) -> None:
    pass


class Socket:
  """One TCP connection, follower -> leader, TCP_NODELAY, in the engine's lockstep frames
  (`engine.service.lockstep.frame` / `read_message`: a 21-byte header + the payload)."""

  def __init__(self, pid: int):
    from engine.service import lockstep
    self.lockstep = lockstep
    if pid == 0:
      srv = socket.create_server(("127.0.0.1", FLAGS.socket_port))
      self.conn, _ = srv.accept()
      srv.close()
    else:
      deadline = time.monotonic() + 60
      while True:
        try:
          self.conn = socket.create_connection(("127.0.0.1", FLAGS.socket_port))
          break
        except ConnectionRefusedError:
          if time.monotonic() > deadline:
            raise
          time.sleep(0.05)
    self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

  def send(self, data: bytes, i: int) -> None:
    self.conn.sendall(self.lockstep.frame(self.lockstep.Kind.STEP, i, data))

  def recv(self, i: int) -> bytes:
    return self.lockstep.read_message(self.conn).payload

  def ack(self, i: int) -> None:
    self.conn.sendall(self.lockstep.frame(self.lockstep.Kind.HEARTBEAT, i))

  def wait_ack(self, i: int) -> None:
    self.lockstep.read_message(self.conn)

  def close(self) -> None:
    self.conn.close()


class Grpc:
  """A unary call leader -> follower (`/lockstep/Step`, raw bytes): the reply is the ack."""

  def __init__(self, pid: int):
    import queue
    import grpc
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE)]
    self.pid = pid
    if pid == 1:
      from concurrent import futures
      self.inbox: queue.Queue = queue.Queue()

      def step(request: bytes, context) -> bytes:
        self.inbox.put(request)
        return b"\1"

      self.server = grpc.server(futures.ThreadPoolExecutor(2), options=opts)
      self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
          "lockstep", {"Step": grpc.unary_unary_rpc_method_handler(step)})])
      self.server.add_insecure_port(f"127.0.0.1:{FLAGS.grpc_port}")
      self.server.start()
    else:
      self.channel = grpc.insecure_channel(f"127.0.0.1:{FLAGS.grpc_port}", options=opts)
      grpc.channel_ready_future(self.channel).result(timeout=60)
      self.call = self.channel.unary_unary("/lockstep/Step")

  def send(self, data: bytes, i: int) -> None:
    self.call(data, timeout=60)  # returns with the ack

  def recv(self, i: int) -> bytes:
    return self.inbox.get(timeout=60)

  def ack(self, i: int) -> None:
    pass

  def wait_ack(self, i: int) -> None:
    pass

  def close(self) -> None:
    if self.pid == 0:
      self.channel.close()
    else:
      self.server.stop(1)


CHANNELS = {"kv": KV, "broadcast": Broadcast, "grpc": Grpc, "socket": Socket}


def run_child() -> None:
  pid = FLAGS.process_id
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from engine.model import sharding
  from jax.experimental import multihost_utils
  sharding.initialize_distributed(f"127.0.0.1:{FLAGS.coordinator_port}", 2, pid)
  sizes = [int(s) for s in FLAGS.sizes]
  results = []
  for name in FLAGS.channels:
    multihost_utils.sync_global_devices(f"bench-{name}")
    ch = CHANNELS[name](pid)
    for size in sizes:
      if isinstance(ch, Broadcast):
        ch.size = size
      n = _iters(size)
      rtts, sends = [], []
      payloads = _payloads(size)
      for i in range(n + 3):  # 3 untimed: connections, compiles
        key = i + size * 1000
        if pid == 0:
          t0 = time.perf_counter()
          ch.send(payloads[i % 2], key)
          t1 = time.perf_counter()
          ch.wait_ack(key)
          t2 = time.perf_counter()
          if i >= 3:
            sends.append(t1 - t0)
            rtts.append(t2 - t0)
        else:
          got = ch.recv(key)
          ch.ack(key)
          # Compared after the ack, and fast (the follower must be waiting in `recv` when the
          # next payload leaves, as it would be for the next step).
          if got != payloads[i % 2]:
            raise AssertionError(f"payload {i} of {size} bytes arrived corrupted")
      if pid == 0:
        rtts.sort()
        results.append(dict(channel=name, bytes=size, iters=n,
                            rtt_us_median=round(1e6 * rtts[n // 2], 1),
                            rtt_us_p90=round(1e6 * rtts[int(n * 0.9)], 1),
                            send_us_median=round(1e6 * sorted(sends)[n // 2], 1)))
    multihost_utils.sync_global_devices(f"bench-{name}-done")
    ch.close()
  if pid == 0:
    print(json.dumps(results), flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv: list[str]) -> None:
  if FLAGS.role == "child":
    run_child()
    return
  ports = [_free_port() for _ in range(3)]
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                    + " --xla_force_host_platform_device_count=2").strip())
  cmd = [sys.executable, "-m", "bench.lockstep_channel", "--role=child",
         f"--coordinator_port={ports[0]}", f"--socket_port={ports[1]}",
         f"--grpc_port={ports[2]}", f"--sizes={','.join(FLAGS.sizes)}",
         f"--channels={','.join(FLAGS.channels)}", f"--iters={FLAGS.iters}"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=1800) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      raise SystemExit(f"a bench process failed ({p.returncode}):\n{err[-3000:]}")
  rows = json.loads(outs[0][0].strip().splitlines()[-1])
  small = {r["channel"]: r["rtt_us_median"] for r in rows if r["bytes"] == min(
      int(s) for s in FLAGS.sizes)}
  for r in rows:
    r["one_way_us"] = round(r["rtt_us_median"] - (0 if r["channel"] == "broadcast"
                                                   else small[r["channel"]] / 2), 1)
  print(f"{'channel':<10} {'bytes':>9} {'round trip us (median / p90)':>30} "
        f"{'one way us':>11} {'send us':>9}")
  for r in rows:
    print(f"{r['channel']:<10} {r['bytes']:>9} "
          f"{r['rtt_us_median']:>19.1f} / {r['rtt_us_p90']:>8.1f} "
          f"{r['one_way_us']:>11.1f} {r['send_us_median']:>9.1f}")
  record = dict(bench="lockstep_channel", processes=2, devices_per_process=2,
                load_avg=os.getloadavg()[0], rows=rows)
  print(json.dumps(record))
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(record, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
