"""Device meshes and where every parameter and cache page lives on them.

The mesh has three named axes (any may be 1):
* `data`: independent batch shards (rows of a step are split over it);
* `expert`, `tensor`: together they form the expert-parallel group: routed experts are split
  over `expert x tensor` devices (each holds E / (expert * tensor) whole experts), while
  attention heads, the shared/dense MLPs' inner dimension and the vocabulary are split over
  `tensor` only (Megatron-style tensor parallelism; XLA inserts the all-reduces). MLA's low-rank
  down-projections (`q_a` [H, q_lora], `kv_a` [H, kv_lora + rope]) are split over `tensor` by
  their output dimension: each device computes whole output columns, and the forward gathers
  the small [T, rank] activation (`replicated_features`) before the norm: bit-identical
  columns, one all-gather of T x (q_lora + kv_lora + rope) values per layer.

JAX's SPMD partitioner does the distributed work: parameters carry `NamedSharding`s, the jitted
forward runs under `jax.set_mesh(mesh)`, and only the MoE layer is written explicitly with
`shard_map` (`engine.model.expert_parallel`).

The MLA latent cache has no head axis (one 576-wide latent per token serves all heads), so it is
replicated over `tensor` and `expert`: each device of an EP group holds the whole latent cache
(for Kimi K2.5, 61 layers x 576 x 2 bytes = 70 KB per token: 9.2 GB per device for 128k tokens).
GQA K/V pages are split over `tensor` by KV head when the head count divides.

An EAGLE-3 head (`engine.model.eagle3`) is placed as a target layer of its attention kind
(`shard_head`): its heads, its MLP's inner dimension and its vocabulary split over `tensor` by
the rules below (a head that shares the target's `embed` / `lm_head` shares their arrays), `fc`
and the norms replicated; its cache entry as that kind's pool (`cache_sharding` of the head's
layer): the MLA head's latent replicated, the MHA head's K/V split by KV head.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from engine.model.config import ModelConfig
from engine.model.params import Params, is_shape, path_str

MESH_AXES = ("data", "expert", "tensor")
EP_AXES = ("expert", "tensor")  # the expert-parallel group


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
  """'data:1,expert:8,tensor:1' (missing axes are 1) -> {'data': 1, 'expert': 8, 'tensor': 1}."""
  if isinstance(spec, Mapping):
    items = dict(spec)
  else:
    items = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
      name, _, size = part.partition(":")
      if not size.isdigit() or int(size) < 1:
        raise ValueError(f"mesh: {part!r} is not axis:size with size >= 1")
      items[name.strip()] = int(size)
  unknown = set(items) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"mesh: unknown axes {sorted(unknown)}; known {list(MESH_AXES)}")
  return {a: int(items.get(a, 1)) for a in MESH_AXES}


def make_mesh(spec: str | Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """A mesh over `devices` (default: all), checked against their number."""
  sizes = parse_mesh(spec)
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(f"mesh: {sizes} needs {math.prod(sizes.values())} devices, have "
                     f"{len(devices)}")
  # Auto axes: XLA's partitioner propagates shardings from the parameters (no per-op specs).
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def axis_size(mesh: Any, name: str) -> int:
  return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1) if mesh is not None else 1


def ep_size(mesh: Any) -> int:
  return axis_size(mesh, "expert") * axis_size(mesh, "tensor")


def check_divisible(cfg: ModelConfig, mesh: Mesh) -> None:
  """Raises ValueError when the model cannot be split as the mesh asks."""
  tp, ep = axis_size(mesh, "tensor"), ep_size(mesh)
  if cfg.num_heads % tp:
    raise ValueError(f"mesh: tensor={tp} does not divide num_attention_heads={cfg.num_heads}")
  if cfg.num_experts and cfg.num_experts % ep:
    raise ValueError(f"mesh: expert x tensor = {ep} does not divide n_routed_experts="
                     f"{cfg.num_experts}")


def _spec_for(path: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int) -> P:
  """The sharding rule of one parameter, from its path in the pytree (see params.py)."""
  parts = path.split(".")
  name, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")

  def t_if(dim: int) -> str | None:  # split over tensor only when it divides evenly
    return "tensor" if shape[dim] % tp == 0 else None

  if parts[0] == "vision":  # the vision tower (~0.4 B parameters in K2.5): on every device
    return P()
  if parts[0] == "stacks":  # a stack of layers: a leading layer axis (never split), then a layer
    return P(None, *_spec_for(".".join(["layers"] + parts[1:]), shape[1:], cfg, tp))
  if path == "embed":
    return P(t_if(0), None)
  if path == "lm_head":
    return P(None, t_if(1))
  if name in ("w", "scale_inv") and not (len(parts) > 2 and parts[-3] == "experts"):
    # An FP8 linear kept quantized: the values split as the float weight would be; the block
    # scales (1/16384 of the bytes) replicated, so no split needs to fall on a block boundary.
    return _spec_for(".".join(parts[:-1]), shape, cfg, tp) if name == "w" else P()
  if parent == "experts" or (len(parts) > 2 and parts[-3] == "experts"):
    # [E, H, I] / [E, I, H], or an INT4 weight's packed [E, N, K/2] and scale [E, K/g, N]:
    # whole experts per device of the EP group (a packed byte is never split).
    return P(EP_AXES, None, None)
  if parent in ("shared", "mlp"):
    return P(None, t_if(1)) if name in ("gate", "up") else P(t_if(0), None)
  if parent == "attn":
    if name in ("q", "q_b", "kv_b", "k", "v"):  # [in, heads, d]
      return P(None, t_if(1), None)
    if name == "o":  # [heads, d, H]
      return P(t_if(0), None, None)
    if name in ("q_bias", "k_bias", "v_bias"):
      return P(t_if(0), None)
    if name in ("q_a", "kv_a"):  # [H, rank]: output dim; the forward gathers the activation
      return P(None, t_if(1))
  return P()  # norms, routers, eh_proj, an EAGLE-3 head's fc: replicated


def param_specs(cfg: ModelConfig, params: Params, mesh: Mesh) -> Params:
  """A PartitionSpec per leaf of `params` (arrays or shape tuples)."""
  tp = axis_size(mesh, "tensor")

  def one(path, leaf):
    shape = tuple(leaf) if is_shape(leaf) else tuple(leaf.shape)
    return _spec_for(path_str(path), shape, cfg, tp)

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_shape)


def param_shardings(cfg: ModelConfig, params: Params, mesh: Mesh, *, check: bool = True
                    ) -> Params:
  """A NamedSharding per leaf; `check`: refuse a mesh the model's dimensions do not divide
  (`check_divisible`; off for an EAGLE-3 head, whose undivided dimensions stay whole)."""
  if check:
    check_divisible(cfg, mesh)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, params, mesh),
                      is_leaf=lambda x: isinstance(x, P))


def shard_params(cfg: ModelConfig, params: Params, mesh: Mesh) -> Params:
  """Places an existing parameter pytree on the mesh by the rules above."""
  return jax.device_put(params, param_shardings(cfg, params, mesh))


def shard_head(layer: ModelConfig, params: Params, mesh: Mesh) -> Params:
  """An EAGLE-3 head's params (`eagle3_loader`; `layer`: its decoder layer's config) placed by
  the target's rules for the same leaf names: the attention's heads, the MLP's inner dimension
  and the vocabulary over `tensor` (a dimension it does not divide stays whole), the rest
  replicated."""
  return jax.device_put(params, param_shardings(layer, params, mesh, check=False))


def cache_sharding(cfg: ModelConfig, mesh: Mesh) -> dict[str, NamedSharding]:
  """Sharding of one layer's page arrays (see the module docstring for MLA)."""
  if cfg.is_mla:
    return {"latent": NamedSharding(mesh, P())}
  tp = axis_size(mesh, "tensor")
  spec = P(None, None, "tensor" if cfg.num_kv_heads % tp == 0 else None, None)
  return {"k": NamedSharding(mesh, spec), "v": NamedSharding(mesh, spec)}


def bytes_per_device(tree: Any) -> dict[Any, int]:
  """Bytes each device holds of a pytree of arrays (for memory checks)."""
  out: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def param_kind(path: str, dtype: Any) -> str:
  """The memory-log kind of a parameter leaf: "int4 experts" (packed nibbles and their scales),
  "fp8", or the dtype's name."""
  parts = path.split(".")
  if len(parts) > 2 and parts[-3] == "experts" and parts[-1] in ("packed", "scale"):
    return "int4 experts"
  if len(parts) > 2 and parts[-3] == "experts" and parts[-1] in ("w", "scale_inv"):
    return "fp8 experts"
  if parts[-1] in ("w", "scale_inv"):
    return "fp8"
  name = str(jax.numpy.dtype(dtype))
  return "fp8" if name.startswith("float8") else name


def param_bytes_by_kind(params: Params) -> dict[Any, dict[str, int]]:
  """{device: {kind: bytes}} of a parameter pytree's addressable shards (`param_kind`)."""
  out: dict[Any, dict[str, int]] = {}
  for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    kind = param_kind(path_str(p), leaf.dtype)
    for shard in leaf.addressable_shards:
      d = out.setdefault(shard.device, {})
      d[kind] = d.get(kind, 0) + shard.data.nbytes
  return out


def _fmt_bytes(n: int) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def format_param_bytes(by_device: dict[Any, dict[str, int]]) -> list[str]:
  """One line per device: `cpu:0: bfloat16 1.20 GB, int4 experts 9.10 GB; total 10.30 GB`."""
  lines = []
  for dev, kinds in sorted(by_device.items(), key=lambda kv: kv[0].id):
    parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(kinds.items()))
    lines.append(f"{dev.platform}:{dev.id}: {parts}; total {_fmt_bytes(sum(kinds.values()))}")
  return lines


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None, *, initialization_timeout_s: int = 300,
                           heartbeat_timeout_s: int = 100, shutdown_timeout_s: int = 300,
                           detect: bool = False, all_local_devices: bool = True) -> None:
  """Joins a multi-process JAX job (one process per host, or several on one machine).

  Call before any JAX computation. On CPU the processes exchange data through gloo; on GPU
  through NCCL. After it, `jax.devices()` lists every process's devices and a mesh over them
  spans the job.

  `detect`: the address, count and index left None come from the cluster environment
  `jax.distributed` recognises (SLURM, Open MPI). `all_local_devices`: this process uses every
  device of its host (one process per host, the layout `engine.serve` expects) rather than the
  one device per process jax assigns under SLURM or Open MPI. The timeouts (seconds): how long
  `initialize` waits for every process to join; how long a process may miss heartbeats before
  the coordinator declares it dead (every other process then aborts); how long a process
  leaving waits for the others at the shutdown barrier. jax's defaults are 300, 100 and 300.
  """
  if not detect:
    if not num_processes or num_processes <= 1:
      return
    if not coordinator_address:
      raise ValueError("coordinator_address: required when num_processes > 1")
    if process_id is None or not 0 <= process_id < num_processes:
      raise ValueError(f"process_id: {process_id} outside [0, {num_processes})")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # The preemption service installs a SIGTERM handler that only records the signal (a process
  # stuck at start-up then ignores SIGTERM); the server handles SIGTERM itself.
  jax.config.update("jax_enable_preemption_service", False)
  kwargs: dict[str, Any] = {}
  if detect:
    # An empty list (not None) keeps jax from narrowing a SLURM / Open MPI process to the
    # device numbered by its local rank; JAX_LOCAL_DEVICE_IDS, when set, still decides.
    if all_local_devices and "JAX_LOCAL_DEVICE_IDS" not in os.environ:
      kwargs["local_device_ids"] = []
  else:
    kwargs["cluster_detection_method"] = "deactivate"  # every parameter is given
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=int(initialization_timeout_s),
                             heartbeat_timeout_seconds=int(heartbeat_timeout_s),
                             shutdown_timeout_seconds=int(shutdown_timeout_s), **kwargs)


def process_index() -> int:
  return jax.process_index()


def gather_from_processes(value: int) -> list[int]:
  """`value` of every process of the job, by process index (a collective: every process must
  call it, in the same order as its other collectives). One process: [value]."""
  if jax.process_count() == 1:
    return [int(value)]
  from jax.experimental import multihost_utils
  if not -2**31 <= value < 2**31:
    raise ValueError(f"gather_from_processes: {value} does not fit int32")
  return [int(v) for v in multihost_utils.process_allgather(np.int32(value))]


def broadcast_from_leader(data: bytes, size: int) -> bytes:
  """Process 0's `data` (at most `size` bytes) in every process (a collective, like
  `gather_from_processes`); the others' `data` is ignored. One process: `data`."""
  if len(data) > size:
    raise ValueError(f"broadcast_from_leader: {len(data)} bytes > size {size}")
  if jax.process_count() == 1:
    return data
  from jax.experimental import multihost_utils
  buf = np.zeros(size + 4, np.uint8)
  buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
  buf[4:4 + len(data)] = np.frombuffer(data, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()
  return out[4:4 + int(np.frombuffer(out[:4], np.uint32)[0])]
