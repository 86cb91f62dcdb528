"""One replica over several processes (issue 56, phase 1): the launcher's environment parsed
into the job, the lockstep channel, the leader's reaction to a lost follower, and two
`engine.serve` processes with two CPU devices each (mesh expert:4): they start, warm up, report
ready and, on the leader's SIGTERM, both exit 0; a follower without a leader exits non-zero
naming the coordinator's address."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine.service import launch_env, lockstep, multihost

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# ---- the launcher's environment --------------------------------------------------------------

LWS = {"LWS_LEADER_ADDRESS": "kimi-0.kimi.default", "LWS_GROUP_SIZE": "2",
       "LWS_WORKER_INDEX": "1", "LWS_NAME": "kimi"}


def test_leaderworkerset_environment():
  job = launch_env.job_from(None, None, None, 8476, LWS)
  assert job == launch_env.Job("kimi-0.kimi.default:8476", 2, 1, "LeaderWorkerSet")
  assert launch_env.job_from(None, None, None, 9000, dict(LWS, LWS_WORKER_INDEX="0")
                             ).coordinator_address == "kimi-0.kimi.default:9000"
  # A group of one is a single process; flags win over the environment.
  assert launch_env.job_from(None, None, None, 8476, dict(LWS, LWS_GROUP_SIZE="1")) is None
  assert launch_env.job_from("10.0.0.1:1234", 4, 3, 8476, LWS) == launch_env.Job(
      "10.0.0.1:1234", 4, 3, "flags")
  for env, field in ((dict(LWS, LWS_LEADER_ADDRESS=""), "LWS_LEADER_ADDRESS"),
                     ({k: v for k, v in LWS.items() if k != "LWS_WORKER_INDEX"},
                      "LWS_WORKER_INDEX"),
                     (dict(LWS, LWS_WORKER_INDEX="2"), "LWS_WORKER_INDEX"),
                     (dict(LWS, LWS_GROUP_SIZE="two"), "LWS_GROUP_SIZE")):
    with pytest.raises(ValueError, match=field):
      launch_env.job_from(None, None, None, 8476, env)


def test_slurm_and_open_mpi_environments():
  slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
           "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "gpu[01-02]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
  job = launch_env.job_from(None, None, None, 8476, slurm)
  # jax.distributed finds the address and index; one task per node keeps all its GPUs.
  assert (job.source, job.detect, job.all_local_devices) == ("SLURM", True, True)
  assert job.coordinator_address is job.num_processes is job.process_id is None
  assert not launch_env.job_from(None, None, None, 8476, dict(
      slurm, SLURM_STEP_TASKS_PER_NODE="8(x2)")).all_local_devices
  assert launch_env.job_from(None, None, None, 8476, dict(slurm, SLURM_NTASKS="1")) is None
  # The batch script itself (no `srun` step): one process.
  assert launch_env.job_from(None, None, None, 8476, {
      k: v for k, v in slurm.items() if not k.startswith("SLURM_STEP")}) is None
  ompi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
  job = launch_env.job_from(None, None, None, 8476, ompi)
  assert (job.source, job.detect, job.all_local_devices) == ("Open MPI", True, True)
  assert launch_env.job_from(None, None, None, 8476, dict(ompi, OMPI_COMM_WORLD_SIZE="1")
                             ) is None
  assert launch_env.job_from(None, None, None, 8476, {}) is None


def test_flags_validation():
  assert launch_env.job_from(None, 1, None, 8476, LWS) is None  # --num_processes=1 wins
  with pytest.raises(ValueError, match="coordinator_address"):
    launch_env.job_from(None, 2, 1, 8476, {})
  with pytest.raises(ValueError, match="process_id"):
    launch_env.job_from("h:1", 2, 2, 8476, {})


def test_serve_flags_read_the_environment(monkeypatch):
  """engine.serve's flags: absent, the job comes from LWS's variables and --coordinator_port."""
  from absl import flags
  from engine.service import mesh_flags
  for name, value in LWS.items():
    monkeypatch.setenv(name, value)
  fv = flags.FlagValues()
  for name in ("coordinator_address", "num_processes", "process_id", "coordinator_port"):
    fv[name] = flags.FLAGS[name]
  monkeypatch.setattr(mesh_flags, "FLAGS", fv)
  try:
    fv(["serve"])
    assert mesh_flags.job() == launch_env.Job(
        f"kimi-0.kimi.default:{launch_env.DEFAULT_COORDINATOR_PORT}", 2, 1, "LeaderWorkerSet")
    fv.unparse_flags()
    fv(["serve", "--coordinator_port=7000"])
    assert mesh_flags.job().coordinator_address == "kimi-0.kimi.default:7000"
    fv.unparse_flags()
    fv(["serve", "--coordinator_address=10.1.1.1:99", "--num_processes=2", "--process_id=0"])
    assert mesh_flags.job() == launch_env.Job("10.1.1.1:99", 2, 0, "flags")
  finally:
    fv.unparse_flags()


# ---- the lockstep channel ---------------------------------------------------------------------

def _pair(fp_follower=None, timeout_s=5.0, heartbeat_s=0.2, on_lost=None):
  fp = {"engine.max_num_seqs": "4", "mesh": "{'expert': 4}"}
  leader = lockstep.Leader(1, fp, "secret", heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                           on_lost=on_lost)
  box = {}

  def follow():
    try:
      box["f"] = lockstep.Follower("127.0.0.1", leader.port, 1, fp_follower or fp, "secret",
                                   timeout_s=timeout_s, connect_timeout_s=5)
    except lockstep.LockstepError as e:
      box["error"] = e
  t = threading.Thread(target=follow)
  t.start()
  return leader, box, t


def test_channel_delivers_in_order_and_shuts_down():
  leader, box, t = _pair()
  # Something else connecting first (a probe, a scan) is ignored, not taken for a follower.
  with socket.create_connection(("127.0.0.1", leader.port)) as stray:
    stray.sendall(b"GET /health HTTP/1.1\r\n\r\n")
    leader.accept(10)
  t.join()
  f = box["f"]
  sent = [leader.send(lockstep.Kind.STEP, bytes([i]) * (1 + 70_000 * i)) for i in range(3)]
  time.sleep(0.5)  # heartbeats flow meanwhile (answered on the follower's reader thread)
  got = [f.recv(5) for _ in range(3)]
  assert [m.seq for m in got] == sent and sent == sorted(sent)
  assert [m.payload[:1] * len(m.payload) for m in got] == [m.payload for m in got]
  assert [len(m.payload) for m in got] == [1, 70_001, 140_001]
  leader.shutdown()
  assert f.recv(5).kind == lockstep.Kind.SHUTDOWN


def test_channel_refuses_other_settings_naming_them():
  leader, box, t = _pair(fp_follower={"engine.max_num_seqs": "8", "mesh": "{'expert': 4}"})
  with pytest.raises(lockstep.LockstepError, match="engine.max_num_seqs: leader '4'"):
    leader.accept(10)
  t.join()
  assert "engine.max_num_seqs" in str(box["error"]) and "mesh" not in str(box["error"])


def test_channel_notices_a_lost_peer():
  lost = []
  leader, box, t = _pair(on_lost=lambda pid, why: lost.append((pid, why)))
  leader.accept(10)
  t.join()
  box["f"].close()  # the follower's process dies: its connection closes
  deadline = time.monotonic() + 5
  while not lost and time.monotonic() < deadline:
    time.sleep(0.01)
  assert lost and lost[0][0] == 1
  with pytest.raises(lockstep.LockstepError):
    leader.send(lockstep.Kind.STEP, b"x")
  # A silent leader (no heartbeats) is lost to its follower after the timeout.
  leader, box, t = _pair(timeout_s=0.5, heartbeat_s=60)
  leader.accept(10)
  t.join()
  with pytest.raises(lockstep.LockstepError, match="no message from the leader"):
    while True:
      box["f"].recv(2)
  leader.close()


def test_leader_stops_serving_and_exits_when_a_follower_is_lost(monkeypatch):
  exits = []
  monkeypatch.setattr(os, "_exit", exits.append)

  class Server:
    refused = False

    async def refuse_new(self):
      self.refused = True

  loop = asyncio.new_event_loop()
  threading.Thread(target=loop.run_forever, daemon=True).start()
  leader, box, t = _pair()
  leader.accept(10)
  t.join()
  server = Server()
  multihost.watch(multihost.Group(multihost.Settings(None), leader=leader), server, loop)
  box["f"].close()
  deadline = time.monotonic() + 5
  while not exits and time.monotonic() < deadline:
    time.sleep(0.01)
  loop.call_soon_threadsafe(loop.stop)
  assert exits == [1] and server.refused


# ---- two engine.serve processes -------------------------------------------------------------

SERVE = [sys.executable, "-m", "engine.serve", "--host=127.0.0.1", "--mesh=expert:4",
         "--max_num_seqs=1", "--max_num_batched_tokens=16", "--max_model_len=64",
         "--max_decode_steps=2", "--decode_batch_sizes=1", "--nostructured_warmup",
         "--drain_timeout_s=5", "--coordinator_timeout_s=240"]


def _env(**extra):
  xla = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  return dict(os.environ, XLA_FLAGS=xla.strip(), PYTHONPATH=REPO, **extra)


def _read_until(proc, pattern, lines, timeout=300):
  deadline = time.monotonic() + timeout
  for line in proc.stderr:
    lines.append(line)
    if re.search(pattern, line):
      return line
    assert time.monotonic() < deadline, "".join(lines[-30:])
  raise AssertionError(f"exited ({proc.wait()}) before {pattern!r}:\n" + "".join(lines[-30:]))


@pytest.mark.slow
def test_two_processes_serve_start_and_leave_together_on_sigterm():
  """Launched as LeaderWorkerSet launches them: the job from LWS_* and --coordinator_port."""
  coord, ports = _free_port(), [_free_port() for _ in range(3)]
  procs, logs = [], [[], []]
  for i in range(2):
    lws = dict(LWS_LEADER_ADDRESS="127.0.0.1", LWS_GROUP_SIZE="2", LWS_WORKER_INDEX=str(i))
    args = [f"--coordinator_port={coord}", "--port=0",
            f"--http_port={ports[0] if i == 0 else ports[1]}"]
    procs.append(subprocess.Popen(SERVE + args, cwd=REPO, env=_env(**lws),
                                  stderr=subprocess.PIPE, text=True))
  try:
    ready = _read_until(procs[0], r"\[moejax\] ready:", logs[0])
    _read_until(procs[1], r"follower 1 ready", logs[1])
    assert any("from LeaderWorkerSet" in l for l in logs[0])
    assert not any("MemoryStats" in l for log in logs for l in log)
    grpc_port = int(ready.split("127.0.0.1:")[1].split()[0])
    # The leader's readiness and the follower's liveness.
    for port in ports[:2]:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        assert r.status == 200
    # A request fails at once with the reason (a step needs the followers: phase 2), no hang.
    req = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v1/completions", json.dumps(
        {"model": "target", "prompt": "def f(", "max_tokens": 2}).encode(),
        {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(req, timeout=60)
    assert "lockstep" in e.value.read().decode()
    from engine.service.client import InferenceClient
    with InferenceClient(f"127.0.0.1:{grpc_port}") as client:
      assert client.health() == "SERVING"
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)
    rest = [p.stderr.read() for p in procs]
    assert [p.wait(timeout=60) for p in procs] == [0, 0], rest
    assert "stopped" in rest[0] and "follower 1 stopped" in rest[1]
    assert time.monotonic() - t0 < 60
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


@pytest.mark.slow
def test_follower_without_its_leader_exits_naming_the_address():
  address = f"127.0.0.1:{_free_port()}"
  proc = subprocess.Popen(SERVE[:3] + [f"--coordinator_address={address}", "--num_processes=2",
                                       "--process_id=1", "--coordinator_timeout_s=3"],
                          cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True)
  lines = []
  _read_until(proc, "joining a multi-process job", lines, timeout=120)
  t0 = time.monotonic()
  rest = proc.stderr.read()
  assert proc.wait(timeout=60) != 0
  assert time.monotonic() - t0 < 3 + 20  # the bound, and the machine's slack
  assert f"no coordinator at {address} after 3s" in rest
