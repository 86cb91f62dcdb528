"""Flags shared by the launch scripts: devices, processes and kernel implementations.

    --mesh=data:1,expert:8,tensor:1      (default: one device)
    --coordinator_address=host:port --num_processes=2 --process_id=0   (multi-host; or from
      LeaderWorkerSet's, SLURM's or Open MPI's environment: `launch_env`)
    --attention=mosaic_gpu --moe=mosaic_gpu --expert_parallel=dispatch   (default: auto, i.e. the
      Mosaic GPU kernels on a Hopper GPU where the model's shapes fit them, the plain-JAX
      references otherwise, resolved at load and named on stderr; psum)

Import this module from a script to define the flags; call `setup()` first thing in `main`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from absl import flags
import jax

from engine.model import sharding
from engine.model.kernels import KernelChoice
from engine.service import launch_env

flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'expert:8' or 'tensor:4,expert:2' "
                    "(axes data, expert, tensor; their product must equal the device count). "
                    "Default: one device.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process; "
                    "default: from LeaderWorkerSet's, SLURM's or Open MPI's environment when it "
                    "names more than one process).")
flags.DEFINE_integer("num_processes", None, "Processes in the job (default: 1, or the "
                     "launcher's).", lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index in the job (0: the leader).",
                     lower_bound=0)
flags.DEFINE_integer("coordinator_port", launch_env.DEFAULT_COORDINATOR_PORT,
                     "Coordinator port on the leader under LeaderWorkerSet (LWS_LEADER_ADDRESS "
                     "names the host); under SLURM it replaces the port jax derives from the job "
                     "id when given.", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("coordinator_timeout_s", 120, "How long a process waits for the whole job "
                     "to join (a follower for its leader) before it exits non-zero.",
                     lower_bound=1)
flags.DEFINE_integer("heartbeat_timeout_s", 20, "A process silent this long is declared dead "
                     "and the job's other processes exit non-zero; also how long a leaving "
                     "process waits for the others at the shutdown barrier.", lower_bound=1)
flags.DEFINE_integer("step_timeout_s", 120, "Step watchdog of a multi-process job: a step a "
                     "follower has not finished this long after the leader sent it (a hung "
                     "program or device) stops the job as a lost process would. Warm-up steps, "
                     "which compile at their first run, get at least --coordinator_timeout_s.",
                     lower_bound=1)

flags.DEFINE_enum("attention", "auto", ["auto", "reference", "mosaic_gpu", "mosaic_gpu_flash"],
                  "Attention implementation (auto: Mosaic GPU on Hopper where the model fits; "
                  "mosaic_gpu_flash: the flash-decoding kernel for every MLA block).")
flags.DEFINE_enum("moe", "auto", ["auto", "reference", "mosaic_gpu"],
                  "Routed-expert implementation (auto: Mosaic GPU on Hopper where it fits).")
flags.DEFINE_enum("expert_parallel", "psum", ["psum", "dispatch", "auto"],
                  "How an expert-parallel mesh combines experts: psum (tokens replicated, one "
                  "all-reduce), dispatch (tokens exchanged with the experts' owners), auto.")

FLAGS = flags.FLAGS


def kernel_choice() -> KernelChoice:
  """The kernels the flags name ("auto" resolves at `engine.load`); a Mosaic GPU kernel named
  on a machine without a GPU is refused."""
  for name in ("attention", "moe"):
    if FLAGS[name].value == "mosaic_gpu" and jax.default_backend() != "gpu":
      raise ValueError(f"--{name}=mosaic_gpu needs an NVIDIA GPU (the JAX backend here is "
                       f"{jax.default_backend()!r})")
  return KernelChoice(attention=FLAGS.attention, moe=FLAGS.moe,
                      expert_parallel=FLAGS.expert_parallel)


def job() -> launch_env.Job | None:
  """The multi-process job the flags or the launcher's environment describe (None: one)."""
  try:
    return launch_env.job_from(FLAGS.coordinator_address, FLAGS.num_processes,
                               FLAGS.process_id, FLAGS.coordinator_port, os.environ)
  except ValueError as e:
    raise ValueError(f"multi-process launch: {e}") from None


def join(j: launch_env.Job) -> None:
  """Joins the job, with the flags' timeouts. A follower first waits up to
  --coordinator_timeout_s for the coordinator's port (jax's own failure is an abort that does
  not name it) and exits non-zero naming the address if it never opens."""
  print(f"[moejax] joining a multi-process job: {j.describe()}; waiting up to "
        f"{FLAGS.coordinator_timeout_s}s for every process", file=sys.stderr, flush=True)
  if j.detect and FLAGS["coordinator_port"].present:
    os.environ["JAX_COORDINATOR_PORT"] = str(FLAGS.coordinator_port)
  if j.process_id and j.coordinator_address:
    if not launch_env.wait_for_port(j.coordinator_address, FLAGS.coordinator_timeout_s):
      raise SystemExit(f"error: no coordinator at {j.coordinator_address} after "
                       f"{FLAGS.coordinator_timeout_s}s (process 0 of the job runs it: is it "
                       "running, and is the address reachable from here?)")
  sharding.initialize_distributed(
      j.coordinator_address, j.num_processes, j.process_id,
      initialization_timeout_s=FLAGS.coordinator_timeout_s,
      heartbeat_timeout_s=FLAGS.heartbeat_timeout_s,
      shutdown_timeout_s=FLAGS.heartbeat_timeout_s,
      detect=j.detect, all_local_devices=j.all_local_devices)


def mesh() -> Any:
  """The --mesh over every device of the job (None: no --mesh)."""
  return sharding.make_mesh(FLAGS.mesh) if FLAGS.mesh else None


def setup() -> Any:
  """Joins the multi-process job if there is one, then returns the mesh (or None)."""
  j = job()
  if j is not None:
    join(j)
  return mesh()
