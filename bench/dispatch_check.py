"""Token-dispatch expert parallelism compiled and run on the devices at hand.

    python -m bench.dispatch_check --out=dispatch.json     # exit status 1 on a mismatch

Runs `expert_parallel.dispatch_experts` over an `expert:N` mesh of every local device (N = 1
on a single GPU: the `ragged_all_to_all` exchange then runs over a group of one, which still
checks that XLA:GPU compiles the engine's exchange and that its offsets round-trip) against
`moe_experts` on one device, at prefill-like sizes, and reports whether the compiled program
holds a ragged all-to-all (CUDA/ROCm) or a plain all-to-all (elsewhere). On a CPU, run with
XLA_FLAGS=--xla_force_host_platform_device_count=8 to exercise the padded exchange.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.model import expert_parallel, kernels, sharding
from engine.model.kernels import KernelChoice

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "Write JSON here.")
flags.DEFINE_string("name", "", "MoE kernel (default: mosaic_gpu on a GPU, else reference).")
TOL = 2e-2


def check(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype, name: str):
  n = len(jax.devices())
  mesh = sharding.make_mesh(f"expert:{n}")
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (tokens, hidden), dtype)
  w = jax.random.uniform(keys[1], (tokens, top_k), jnp.float32)
  ids = jax.random.randint(keys[2], (tokens, top_k), 0, experts).at[::5, 0].set(-1)
  gate, up = (jax.random.normal(k, (experts, hidden, inter), dtype) * hidden ** -0.5
              for k in keys[3:5])
  down = jnp.swapaxes(gate, 1, 2) * (hidden / inter) ** 0.5
  fn = kernels.moe_experts(KernelChoice(moe=name))
  ref = np.asarray(kernels.moe_experts(KernelChoice())(x, w, ids, gate, up, down), np.float32)
  shard = NamedSharding(mesh, P(sharding.EP_AXES))
  with jax.set_mesh(mesh):
    placed = {k: jax.device_put(v, shard) for k, v in dict(gate=gate, up=up, down=down).items()}
    run = jax.jit(lambda x, w, ids, e: expert_parallel.dispatch_experts(fn, x, w, ids, e))
    compiled = run.lower(x, w, ids, placed).compile()
    got = np.asarray(compiled(x, w, ids, placed), np.float32)
  hlo = compiled.as_text()
  err = float(np.max(np.abs(got - ref)))
  scale = float(np.max(np.abs(ref)))
  return dict(devices=n, tokens=tokens, kernel=name, max_abs_diff=err, max_abs_ref=scale,
              ok=err <= TOL * scale, ragged_all_to_all="ragged-all-to-all" in hlo,
              all_to_all=" all-to-all(" in hlo)


def main(_):
  gpu = jax.default_backend() == "gpu"
  name = FLAGS.name or ("mosaic_gpu" if gpu else "reference")
  dtype = jnp.bfloat16
  rows = [check(t, 7168 if gpu else 256, 2048 if gpu else 128, 48 if gpu else 16, 8, dtype,
                name) for t in (64, 512)]
  for r in rows:
    print(r)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(rows, f, indent=1)
  sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
  app.run(main)
