"""Stage `ceilings`: this run's denominators, and the run's labels.

    python -m bench.protocol.ceilings OUT

Rows: `env` (nvidia-smi's name, memory, driver and clocks, jax/jaxlib, XLA_FLAGS); `xla_copy`
(x + 1 over 4 GiB of bf16, bytes counted read + write); `xla_read` (a float32 sum of the same
4 GiB: read only); `xla_matmul_bf16` (8192^3 on random data). Each timed by CUPTI (the kernels'
own time) and wall clock; GB/s from the kernels' time where there is one. Every later stage
reports its kernels' fractions of max(xla_read, xla_copy) and of the matmul rate.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from bench.protocol import timing
from bench.protocol.rows import Recorder, dry_run


def _nvidia_smi() -> dict[str, str]:
  query = "name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem"
  try:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return {"nvidia_smi": f"unavailable: {e}"}
  return dict(zip(query.split(","), (v.strip() for v in out.split("\n")[0].split(","))))


def _timed(t: dict) -> dict:
  """`us`: the kernels' own time where CUPTI measured it, else the wall time; both kept."""
  return dict(t, us=t.get("kernel_us") or t["us"], wall_us=t["us"],
              timed_by="cupti" if "kernel_us" in t else "wall")


def run(out_dir: str) -> None:
  rec = Recorder(out_dir, "ceilings", **timing.labels())
  rec.row("env", **_nvidia_smi(), xla_flags=os.environ.get("XLA_FLAGS", ""),
          devices=len(jax.devices()), python=sys.version.split()[0])
  iters, reps = (3, 2) if dry_run() else (10, 5)
  n = timing.scaled(1 << 31, 1 << 22)  # bf16 elements: 4 GiB on the GPU
  x = timing.random_array(jax.random.key(0), (n,), jnp.bfloat16)
  shape = f"{n * 2 / 2**30:.3g} GiB bf16"
  copy = jax.jit(lambda v: v + 1)
  t = timing.time_call(lambda i: copy(x), iterations=iters, reps=reps)
  rec.row("xla_copy", shape, bytes=2 * x.nbytes, **_timed(t))
  read = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
  t = timing.time_call(lambda i: read(x), iterations=iters, reps=reps)
  rec.row("xla_read", shape, bytes=x.nbytes, **_timed(t))
  x = None  # the buffer freed (`del` would leave the lambdas above a deleted name)
  m = timing.scaled(8192, 256)
  a, b = (timing.random_array(k, (m, m), jnp.bfloat16) for k in timing.keys(1, 2))
  mm = jax.jit(jnp.matmul)
  t = timing.time_call(lambda i: mm(a, b), iterations=iters, reps=reps)
  rec.row("xla_matmul_bf16", f"{m}^3", flops=2 * m ** 3, **_timed(t))


if __name__ == "__main__":
  run(sys.argv[1])
