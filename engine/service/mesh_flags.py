"""Flags shared by the launch scripts: devices, processes and kernel implementations.

    --mesh=data:1,expert:8,tensor:1      (default: one device)
    --coordinator_address=host:port --num_processes=2 --process_id=0   (multi-host)
    --attention=mosaic_gpu --moe=mosaic_gpu --expert_parallel=dispatch   (default: auto, i.e. the
      Mosaic GPU kernels on a Hopper GPU where the model's shapes fit them, the plain-JAX
      references otherwise, resolved at load and named on stderr; psum)

Import this module from a script to define the flags; call `setup()` first thing in `main`.
"""

from __future__ import annotations

from typing import Any

from absl import flags
import jax

from engine.model import sharding
from engine.model.kernels import KernelChoice

flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'expert:8' or 'tensor:4,expert:2' "
                    "(axes data, expert, tensor; their product must equal the device count). "
                    "Default: one device.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("num_processes", 1, "Processes in the job.", lower_bound=1)
flags.DEFINE_integer("process_id", 0, "This process's index in the job.", lower_bound=0)

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


def setup() -> Any:
  """Joins the multi-process job if asked, then returns the mesh (or None)."""
  sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                  FLAGS.process_id)
  return sharding.make_mesh(FLAGS.mesh) if FLAGS.mesh else None
