"""Run by test_int4_experts.py / test_fp8_experts.py in a fresh process with 8 (forced) CPU
devices: the INT4 Kimi K2.5 fixture (argument "int4") or an FP8-kept checkpoint directory
(argument "fp8 DIR") loaded straight onto meshes (experts split whole, still quantized), its
logits against one device's. Prints one JSON line."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import engine  # noqa: E402
from engine.model import sharding  # noqa: E402
from engine.model.cache import init_cache  # noqa: E402
from engine.model.kernels import KernelChoice  # noqa: E402
from engine.model.params import param_shapes  # noqa: E402
from engine.model.transformer import forward_logits  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "fixtures",
                       "kimi_k25_int4")
TOKENS = np.asarray([[1, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41, 42, 43, 0, 0, 0]], np.int32)
N_NEW = np.asarray([8, 5], np.int32)
TABLE = np.arange(4, dtype=np.int32).reshape(2, 2) + 1


def logits(cfg, params, mesh=None, impl=KernelChoice()):
  cache = init_cache(cfg, 5, 8, jnp.float32)
  args = (TOKENS, np.zeros(2, np.int32), N_NEW, TABLE)
  if mesh is None:
    return np.asarray(forward_logits(params, cache, *args, cfg=cfg)[0])
  cache = jax.device_put(cache, [sharding.cache_sharding(cfg, mesh)] * len(cache))
  with jax.set_mesh(mesh):
    return np.asarray(jax.device_get(forward_logits(params, cache, *args, cfg=cfg,
                                                    impl=impl)[0]))


def fp8(ckpt):
  from engine.model.hf_loader import checkpoint_config, load_hf_params
  cfg = checkpoint_config(ckpt, keep_fp8=True)
  ref = logits(cfg, load_hf_params(ckpt, cfg, dtype=jnp.float32, progress=False))
  out = {}
  for spec in ("tensor:4,expert:2", "expert:8"):
    mesh = sharding.make_mesh(spec)
    shardings = sharding.param_shardings(cfg, param_shapes(cfg), mesh)
    params = load_hf_params(ckpt, cfg, dtype=jnp.float32, shardings=shardings, progress=False)
    got = logits(cfg, params, mesh)
    q_b = params["stacks"][1]["attn"]["q_b"]
    out[spec] = dict(rel_err=float(np.abs(got - ref).max() / np.abs(ref).max()),
                     q_b_dtype=str(q_b.w.dtype), q_b_spec=str(q_b.w.sharding.spec),
                     expert_spec=str(params["stacks"][1]["moe"]["experts"]["gate"].w.sharding.spec))
  print(json.dumps(out))


def main():
  if sys.argv[1:2] == ["fp8"]:
    return fp8(sys.argv[2])
  one = engine.load(FIXTURE, dtype="float32", progress=False)
  ref = logits(one.config, one.params)
  out = {}
  for spec, ep in (("expert:8", "psum"), ("tensor:2,expert:4", "dispatch")):
    m = engine.load(FIXTURE, dtype="float32", progress=False, mesh=spec)
    gate = m.params["stacks"][1]["moe"]["experts"]["gate"]
    got = logits(m.config, m.params, m.mesh, KernelChoice(expert_parallel=ep))
    out[spec] = dict(
        rel_err=float(np.abs(got - ref).max() / np.abs(ref).max()),
        packed_dtype=str(gate.packed.dtype),
        packed_shards=sorted({tuple(s.data.shape) for s in gate.packed.addressable_shards}),
        scale_shards=sorted({tuple(s.data.shape) for s in gate.scale.addressable_shards}),
        devices=len({s.device for s in gate.packed.addressable_shards}),
        spec=str(gate.packed.sharding.spec),
        int4_bytes_per_device=sorted({k["int4 experts"]
                                      for k in sharding.param_bytes_by_kind(m.params).values()}),
        log_lines=len(sharding.format_param_bytes(sharding.param_bytes_by_kind(m.params))))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
