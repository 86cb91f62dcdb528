"""Which multi-process job this process belongs to: from the flags, else from the launcher.

Precedence: `--coordinator_address/--num_processes/--process_id` when given; else
LeaderWorkerSet's environment (`LWS_LEADER_ADDRESS` + `--coordinator_port`, `LWS_GROUP_SIZE`,
`LWS_WORKER_INDEX`); else SLURM (inside an `srun` step) or Open MPI, whose coordinator address
and process index `jax.distributed` derives itself (its SLURM port comes from the job id unless
`JAX_COORDINATOR_PORT` is set). A launcher counts only when it says the job has more than one
process: a one-task SLURM allocation or an LWS group of size 1 is a single process.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import time
from typing import Mapping

DEFAULT_COORDINATOR_PORT = 8476  # the port jax uses on Cloud TPU; any free port works


@dataclasses.dataclass(frozen=True)
class Job:
  """A multi-process job. `coordinator_address`, `num_processes`, `process_id` are None when
  `jax.distributed` detects them (`detect`)."""
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  source: str  # "flags", "LeaderWorkerSet", "SLURM", "Open MPI"
  detect: bool = False
  all_local_devices: bool = True  # one process per host: it uses every local device

  def describe(self) -> str:
    where = self.coordinator_address or "detected by jax.distributed"
    who = ("process ? (detected)" if self.process_id is None
           else f"process {self.process_id} of {self.num_processes}")
    return f"{who}, coordinator {where} (from {self.source})"


def _int(environ: Mapping[str, str], name: str) -> int:
  value = environ.get(name, "")
  if not value.strip().isdigit():
    raise ValueError(f"{name}={value!r}: expected a non-negative integer")
  return int(value)


def _slurm_tasks_per_node(environ: Mapping[str, str]) -> int | None:
  """Tasks on the busiest node: SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE look like
  '1(x2)' or '2,1' (counts, each optionally repeated)."""
  for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    counts = re.findall(r"(\d+)(?:\(x\d+\))?", environ.get(name, ""))
    if counts:
      return max(int(c) for c in counts)
  return None


def job_from(coordinator_address: str | None, num_processes: int | None,
             process_id: int | None, coordinator_port: int,
             environ: Mapping[str, str]) -> Job | None:
  """The job this process is part of, or None for a single process (see the module doc).
  Raises ValueError naming the flag or variable that is wrong."""
  if coordinator_address or num_processes is not None or process_id is not None:
    n = num_processes or 1
    if n <= 1:
      if process_id not in (None, 0):
        raise ValueError(f"process_id: {process_id} given without --num_processes > 1")
      return None
    if not coordinator_address:
      raise ValueError("coordinator_address: required with --num_processes > 1 (host:port "
                       "of process 0)")
    pid = 0 if process_id is None else process_id
    if not 0 <= pid < n:
      raise ValueError(f"process_id: {pid} outside [0, {n})")
    return Job(coordinator_address, n, pid, "flags")
  if "LWS_GROUP_SIZE" in environ:
    size = _int(environ, "LWS_GROUP_SIZE")
    if size <= 1:
      return None
    leader = environ.get("LWS_LEADER_ADDRESS", "").strip()
    if not leader:
      raise ValueError("LWS_LEADER_ADDRESS: unset (LeaderWorkerSet sets it with "
                       "LWS_GROUP_SIZE)")
    index = _int(environ, "LWS_WORKER_INDEX")
    if index >= size:
      raise ValueError(f"LWS_WORKER_INDEX={index} outside [0, {size})")
    return Job(f"{leader}:{coordinator_port}", size, index, "LeaderWorkerSet")
  if "SLURM_JOB_ID" in environ and "SLURM_NTASKS" in environ and (
      "SLURM_STEP_NODELIST" in environ):  # inside an `srun` step, as jax's detection needs
    if _int(environ, "SLURM_NTASKS") <= 1:
      return None
    per_node = _slurm_tasks_per_node(environ)
    return Job(None, None, None, "SLURM", detect=True, all_local_devices=per_node in (None, 1))
  if "OMPI_COMM_WORLD_SIZE" in environ:
    if _int(environ, "OMPI_COMM_WORLD_SIZE") <= 1:
      return None
    local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    return Job(None, None, None, "Open MPI", detect=True,
               all_local_devices=local.strip() in ("", "1"))
  return None


def wait_for_port(address: str, timeout_s: float, interval_s: float = 0.5) -> bool:
  """Whether `host:port` accepts a TCP connection within `timeout_s` (retrying refusals and
  names that do not resolve yet, as a pod's DNS name before the pod has an address)."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=max(interval_s, 1.0)):
        return True
    except OSError:
      if time.monotonic() >= deadline:
        return False
      time.sleep(interval_s)
