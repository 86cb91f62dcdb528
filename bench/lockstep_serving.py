"""What lockstep serving costs: a 2-process replica against one process, same mesh (issue 56).

    python -m bench.lockstep_serving --out=lockstep_serving.json
    python -m bench.lockstep_serving --max_decode_steps=1,8 --requests=12 --max_tokens=64

For each `--max_decode_steps` value, starts side by side (both idle between requests):

* `one`: one `engine.serve` process with 4 CPU devices, `--mesh=expert:4`;
* `lockstep`: two `engine.serve` processes of one `jax.distributed` job, 2 CPU devices each,
  `--mesh=expert:4` (the leader sends each step description to the follower, which runs it).

then sends the same greedy gRPC requests to each in turn (A/B interleaved, the order flipped
every request, so a shared host's load falls on both alike) and reports, per server, the median
TTFT and the median time per output token after the first (with `--max_decode_steps=1` every
token is one program call: the per-step cost). Ratios lockstep/one are what to read: on the
CPU the lockstep side pays its collectives across processes (gloo over loopback) as well as the
channel (`bench/lockstep_channel.py`: ~15 us a step-sized message), whose own share the
leader reports at exit (STEPs sent, bytes and time in `send` per step, warm-up included).
Prints a table, one JSON line, and writes JSON with `--out`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("max_decode_steps", ["1", "8"], "Decode iterations per program call.")
flags.DEFINE_integer("requests", 10, "Timed requests per server and setting.", lower_bound=1)
flags.DEFINE_integer("max_tokens", 48, "Output tokens per request.", lower_bound=2)
flags.DEFINE_string("out", "", "Write the results as JSON here.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "import os\nimport sys\nimport re\nimport json\nimport time\nimport"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _serve(mds: int) -> list[str]:
  return [sys.executable, "-m", "engine.serve", "--host=127.0.0.1", "--port=0", "--mesh=expert:4",
          "--max_num_seqs=1", "--max_num_batched_tokens=16", "--max_model_len=256",
          f"--max_decode_steps={mds}", "--decode_batch_sizes=1", "--nostructured_warmup",
          "--drain_timeout_s=5", "--coordinator_timeout_s=600"]


def _env(devices: int) -> dict[str, str]:
  xla = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
  return dict(os.environ, XLA_FLAGS=xla.strip(), PYTHONPATH=REPO)


class Server:
  """A server's processes; `ready()` waits for the leader's ready line (the gRPC port)."""

  def __init__(self, commands: list[tuple[list[str], dict[str, str]]]):
    self.procs = [subprocess.Popen(c, cwd=REPO, env=e, stderr=subprocess.PIPE, text=True)
                  for c, e in commands]
    self.lines: list[list[str]] = [[] for _ in self.procs]
    for p, lines in zip(self.procs, self.lines):
      threading.Thread(target=lambda p=p, lines=lines: lines.extend(p.stderr),
                       daemon=True).start()

  def ready(self, timeout: float = 1200) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      for line in list(self.lines[0]):
        m = re.search(r"\[moejax\] ready: \S+ on 127\.0\.0\.1:(\d+)", line)
        if m:
          return f"127.0.0.1:{m.group(1)}"
      if any(p.poll() is not None for p in self.procs):
        break
      time.sleep(0.2)
    raise SystemExit("server did not start:\n" + "".join(self.lines[0][-30:]))

  def stop(self) -> list[int]:
    self.procs[0].send_signal(signal.SIGTERM)
    codes = []
    for p in self.procs:
      try:
        codes.append(p.wait(60))
      except subprocess.TimeoutExpired:
        p.kill()
        codes.append(p.wait())
    return codes


def _one(mds: int) -> Server:
  return Server([(_serve(mds), _env(4))])


def _lockstep(mds: int) -> Server:
  coord = _free_port()
  return Server([(_serve(mds) + [f"--coordinator_address=127.0.0.1:{coord}",
                                 "--num_processes=2", f"--process_id={i}"], _env(2))
                 for i in range(2)])


def _request(client) -> tuple[float, float]:
  """(TTFT s, seconds per output token after the first)."""
  got = client.generate(PROMPT, max_tokens=FLAGS.max_tokens, temperature=0, ignore_eos=True)
  times = [t for t, n in zip(got.chunk_times, got.chunk_tokens) if n]
  ttft = times[0] - got.sent_at
  per_token = (times[-1] - times[0]) / max(1, len(got.token_ids) - got.chunk_tokens[0])
  return ttft, per_token


def run_setting(mds: int) -> dict:
  from engine.service.client import InferenceClient
  servers = {"one": _one(mds), "lockstep": _lockstep(mds)}
  try:
    targets = {name: s.ready() for name, s in servers.items()}
    clients = {name: InferenceClient(t, timeout=600) for name, t in targets.items()}
    for c in clients.values():  # a first request of each (first-run costs, caches)
      _request(c)
    samples = {name: [] for name in servers}
    order = list(servers)
    for i in range(FLAGS.requests):
      for name in (order if i % 2 == 0 else order[::-1]):
        samples[name].append(_request(clients[name]))
    for c in clients.values():
      c.close()
  finally:
    codes = {name: s.stop() for name, s in servers.items()}
  out = {"max_decode_steps": mds, "exit_codes": codes}
  time.sleep(0.5)  # (the reader threads take the last lines)
  for line in servers["lockstep"].lines[0]:
    m = re.search(r"lockstep: sent (\d+) steps, (\d+) bytes, ([\d.]+) ms in send", line)
    if m:  # (warm-up's steps included)
      n = int(m.group(1))
      out["channel"] = {"steps": n, "bytes_per_step": int(m.group(2)) / n,
                        "send_us_per_step": float(m.group(3)) * 1e3 / n}
  for name, rows in samples.items():
    ttft = statistics.median(r[0] for r in rows)
    tpot = statistics.median(r[1] for r in rows)
    out[name] = {"ttft_ms": ttft * 1e3, "ms_per_token": tpot * 1e3, "tok_s": 1 / tpot}
  out["ratio_ttft"] = out["lockstep"]["ttft_ms"] / out["one"]["ttft_ms"]
  out["ratio_ms_per_token"] = out["lockstep"]["ms_per_token"] / out["one"]["ms_per_token"]
  return out


def main(argv: list[str]) -> None:
  del argv
  results = [run_setting(int(m)) for m in FLAGS.max_decode_steps]
  print(f"{'decode steps/call':>17} | {'server':>8} | {'TTFT ms':>8} | {'ms/token':>8} | "
        f"{'tok/s':>7}")
  for r in results:
    for name in ("one", "lockstep"):
      x = r[name]
      print(f"{r['max_decode_steps']:>17} | {name:>8} | {x['ttft_ms']:>8.1f} | "
            f"{x['ms_per_token']:>8.2f} | {x['tok_s']:>7.1f}")
    print(f"{'':>17} | {'ratio':>8} | {r['ratio_ttft']:>8.2f} | "
          f"{r['ratio_ms_per_token']:>8.2f} |")
    if "channel" in r:
      c = r["channel"]
      print(f"{'':>17} | channel: {c['steps']} STEPs, {c['bytes_per_step']:.0f} B and "
            f"{c['send_us_per_step']:.0f} us of send per step")
  summary = {"requests": FLAGS.requests, "max_tokens": FLAGS.max_tokens, "results": results}
  print(json.dumps(summary))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(summary, f, indent=1)


if __name__ == "__main__":
  app.run(main)
