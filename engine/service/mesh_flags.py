"""Flags shared by the launch scripts for running over several devices and processes.

    --mesh=data:1,expert:8,tensor:1      (default: one device)
    --coordinator_address=host:port --num_processes=2 --process_id=0   (multi-host)

Import this module from a script to define the flags; call `setup()` first thing in `main`.
"""

from __future__ import annotations

from typing import Any

from absl import flags

from engine.model import sharding

flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'expert:8' or 'tensor:4,expert:2' "
                    "(axes data, expert, tensor; their product must equal the device count). "
                    "Default: one device.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("num_processes", 1, "Processes in the job.", lower_bound=1)
flags.DEFINE_integer("process_id", 0, "This process's index in the job.", lower_bound=0)

FLAGS = flags.FLAGS


def setup() -> Any:
  """Joins the multi-process job if asked, then returns the mesh (or None)."""
  sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                  FLAGS.process_id)
  return sharding.make_mesh(FLAGS.mesh) if FLAGS.mesh else None
