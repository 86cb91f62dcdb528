"""Token-dispatch expert parallelism, checked inside sharding_child.py (8 forced CPU devices).

* the model with `expert_parallel="dispatch"` (and "auto") against one device;
* the GPU formulation (`ragged_all_to_all`) run on CPU through an emulation written from the
  documented semantics of `jax.lax.ragged_all_to_all`, so the offsets and sizes the engine
  passes are checked, not only the CPU twin;
* the dispatch function exported for CPU (`all_to_all`, no ragged one); `export_dispatch` also
  serves test_sharding's CUDA export over an abstract mesh of H200s (`ragged_all_to_all`);
* q_a / kv_a split by column over `tensor` (bytes, logits, no weight gathered).
"""

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.model import expert_parallel, sharding
from engine.model.kernels import KernelChoice
from pallas_kernels.moe import reference as moe_ref

DISPATCH = KernelChoice(expert_parallel="dispatch")
MOSAIC_CALL = "mosaic_gpu_v2"
CALLS = []  # shapes the emulation was traced with


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
  """`jax.lax.ragged_all_to_all` as its docstring specifies it, from all_gathers and masks."""
  del axis_index_groups
  CALLS.append(operand.shape)
  size = jax.lax.psum(1, axis_name)
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)
  ios, sss, oos = (jax.lax.all_gather(a, axis_name)
                   for a in (input_offsets, send_sizes, output_offsets))
  # The receiver's recv_sizes must equal what each sender sends it.
  sent_here = jax.lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True)
  rows = jnp.arange(output.shape[0])
  spp = input_offsets.shape[0] // size
  result = output
  for s in range(size):
    for j in range(spp):
      i = me * spp + j
      io, sz, oo = ios[s, i], sss[s, i], oos[s, i]
      take = (rows >= oo) & (rows < oo + sz)
      vals = ops[s][jnp.clip(io + rows - oo, 0, operand.shape[0] - 1)]
      result = jnp.where(take.reshape(-1, *(1,) * (output.ndim - 1)), vals, result)
  bad = jnp.any(sent_here != recv_sizes)
  return jnp.where(bad, jnp.nan, result.astype(jnp.float32)).astype(output.dtype) \
      if jnp.issubdtype(output.dtype, jnp.floating) else jnp.where(bad, -7, result)


def _gpu_branch(*args, cuda, rocm=None, default=None, **_):
  return cuda(*args)


def _diff(got, ref):
  return dict(max_abs_diff=float(np.max(np.abs(got - ref))),
              max_abs_ref=float(np.max(np.abs(ref))))


def dispatch_results(model, logits, batch):
  """`logits(cfg, params, mesh=None, impl=...)`: the forward's logits on `batch` (tokens,
  n_new, page table), which `low_rank_split` compiles itself to read the program."""
  out = {}
  refs = {}  # one device's logits: computed once (the clear_caches below would recompile them)
  for name in ("deepseek_v3", "qwen3_moe"):
    cfg, params = model(name)
    ref = refs[name] = logits(cfg, params)
    short_ref = short_block(cfg, params)
    # The CUDA branch (emulated) and a block that does not divide the devices on one mesh per
    # model (an expert-only and a tensor-split one); the CPU branch on all three.
    variants_on = {"deepseek_v3": "expert:8", "qwen3_moe": "tensor:4,expert:2"}[name]
    for spec in ("expert:8", "data:2,expert:4", "tensor:4,expert:2"):
      mesh = sharding.make_mesh(spec)
      placed = sharding.shard_params(cfg, params, mesh)
      r = _diff(logits(cfg, placed, mesh, DISPATCH), ref)
      jaxpr = jaxpr_of(cfg, placed, mesh)
      r["all_to_all_not_psum"] = "all_to_all" in jaxpr and "psum" not in jaxpr
      out[f"{name}/{spec}"] = r
      if spec != variants_on:
        continue
      CALLS.clear()
      jax.clear_caches()  # retrace forward_logits with the patched functions
      with mock.patch.object(jax.lax, "platform_dependent", _gpu_branch), \
          mock.patch.object(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all):
        r["ragged_emulated"] = _diff(logits(cfg, placed, mesh, DISPATCH), ref)
      r["ragged_calls"] = len(CALLS)
      jax.clear_caches()
      # A block whose token count (6) does not divide the devices: padded, then cut.
      r["padded_block"] = _diff(short_block(cfg, placed, mesh), short_ref)
  # "auto" picks dispatch at prefill sizes (16 tokens >= 2 per device with the threshold
  # lowered) and the psum formulation below it.
  cfg, params = model("deepseek_v3")
  mesh = sharding.make_mesh("expert:8")
  placed = sharding.shard_params(cfg, params, mesh)
  jax.clear_caches()
  with mock.patch.object(expert_parallel, "DISPATCH_MIN_TOKENS", 2):
    out["auto"] = _diff(logits(cfg, placed, mesh, KernelChoice(expert_parallel="auto")),
                        refs["deepseek_v3"])
  out["engine_greedy_equal"] = engine_greedy(model)
  out["low_rank"] = low_rank_split(model, refs["deepseek_v3"], batch)
  out["bf16_direct"] = bf16_direct()
  out["export"] = export_checks()
  return out


def jaxpr_of(cfg, params, mesh):
  from engine.model.cache import init_cache
  from engine.model.transformer import forward_logits
  tokens = np.ones((2, 8), np.int32)
  with jax.set_mesh(mesh):
    return str(jax.make_jaxpr(lambda p, c: forward_logits(
        p, c, tokens, np.zeros(2, np.int32), np.full(2, 8, np.int32),
        np.arange(4, dtype=np.int32).reshape(2, 2) + 1, cfg=cfg, impl=DISPATCH))(
            params, init_cache(cfg, 5, 8, jnp.float32)))


def short_block(cfg, params, mesh=None):
  from engine.model.cache import init_cache
  from engine.model.transformer import forward_logits
  tokens = np.asarray([[1, 5, 6], [1, 40, 0]], np.int32)
  args = (params, init_cache(cfg, 5, 8, jnp.float32), tokens, np.zeros(2, np.int32),
          np.asarray([3, 2], np.int32), np.arange(4, dtype=np.int32).reshape(2, 2) + 1)
  if mesh is None:
    return np.asarray(forward_logits(*args, cfg=cfg)[0])
  with jax.set_mesh(mesh):
    return np.asarray(forward_logits(*args, cfg=cfg, impl=DISPATCH)[0])


def engine_greedy(model):
  """The serving engine (prefill rows, decode loop) with dispatch on data:2,expert:4 produces the
  one-device greedy tokens."""
  from engine.runtime.engine import Engine, EngineConfig
  from engine.runtime.request import StopParams
  cfg, params = model("deepseek_v3")
  mesh = sharding.make_mesh("data:2,expert:4")

  def run(p, mesh=None, kernels=KernelChoice()):
    eng = Engine(cfg, p, EngineConfig(page_size=8, max_num_seqs=2, max_num_batched_tokens=16,
                                      row_widths=(16,), max_model_len=64,
                                      cache_dtype=jnp.float32, kernels=kernels), mesh=mesh)
    return [r.output_ids for r in eng.generate([[1, 5, 6, 7, 8], [1, 40, 41]],
                                               stop=StopParams(max_tokens=8))]

  return run(params) == run(sharding.shard_params(cfg, params, mesh), mesh, DISPATCH)


def low_rank_split(model, ref, batch):
  """q_a / kv_a split by output column over tensor:4: a quarter of the bytes per device, the
  same logits (`ref`: one device's), and the compiled program gathers only activations, never
  these weights."""
  from engine.model.cache import init_cache
  from engine.model.transformer import forward_logits
  cfg, params = model("deepseek_v3")
  mesh = sharding.make_mesh("tensor:4,expert:2")
  placed = sharding.shard_params(cfg, params, mesh)
  stacks = [stack["attn"] for stack in placed["stacks"]]  # the dense layer, the MoE layers
  fraction = {n: sorted({b / a[n].nbytes for a in stacks for b in
                         sharding.bytes_per_device(a[n]).values()}) for n in ("q_a", "kv_a")}
  cache = init_cache(cfg, 5, 8, jnp.float32)
  cache = jax.device_put(cache, [sharding.cache_sharding(cfg, mesh)] * len(cache))
  tokens, n_new, table = batch
  args = (placed, cache, tokens, np.zeros(len(tokens), np.int32), n_new, table)
  with jax.set_mesh(mesh):
    compiled = forward_logits.lower(*args, cfg=cfg).compile()  # the logits come from it too
    got = np.asarray(jax.device_get(compiled(*args)[0]))
  r = _diff(got, ref)
  r["fraction"] = fraction
  hlo = compiled.as_text()
  gathered = re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)
  # Neither a stack nor one layer of it, [layers, H, rank] or [H, rank], is ever gathered.
  weights = {",".join(map(str, shape)) for a in stacks for n in ("q_a", "kv_a")
             for shape in (a[n].shape, a[n].shape[1:])}
  r["gathered_shapes"] = sorted(set(gathered))
  r["weights_gathered"] = bool(weights & set(gathered))
  return r


def bf16_direct():
  """dispatch_experts on bfloat16 tokens (ids and weights travel bit-cast inside the rows)
  against moe_experts on one device; 45 tokens (padded to 48), some routed nowhere."""
  keys = jax.random.split(jax.random.key(3), 5)
  t, h, i, e, k = 45, 64, 32, 16, 3
  x = jax.random.normal(keys[0], (t, h), jnp.bfloat16)
  w = jax.random.uniform(keys[1], (t, k), jnp.float32)
  ids = jax.random.randint(keys[2], (t, k), 0, e).at[::7, 1].set(-1)
  gate, up = (jax.random.normal(kk, (e, h, i), jnp.bfloat16) * 0.2 for kk in keys[3:5])
  down = jnp.swapaxes(gate, 1, 2)
  ref = np.asarray(moe_ref.moe_experts(x, w, ids, gate, up, down), np.float32)
  mesh = sharding.make_mesh("data:2,expert:2,tensor:2")
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, P(("expert", "tensor"))))
              for a in (gate, up, down)]
    got = np.asarray(jax.jit(_dispatch_fn(moe_ref.moe_experts))(x, w, ids, *placed),
                     np.float32)
  return _diff(got, ref)


def _dispatch_fn(fn):
  def f(x, w, ids, gate, up, down):
    return expert_parallel.dispatch_experts(fn, x, w, ids,
                                            dict(gate=gate, up=up, down=down))
  return f


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def export_dispatch(mesh, platform: str, fn=moe_ref.moe_experts, dtype=jnp.float32) -> dict:
  """Exports the dispatch function over `mesh` (expert:8) for `platform`; counts collectives."""
  t, h, i, e, k = 64, 256, 128, 32, 4
  tok = NamedSharding(mesh, P(("data", "expert", "tensor")))
  exp = NamedSharding(mesh, P(("expert", "tensor")))
  args = (jax.ShapeDtypeStruct((t, h), dtype, sharding=tok),
          jax.ShapeDtypeStruct((t, k), jnp.float32, sharding=tok),
          jax.ShapeDtypeStruct((t, k), jnp.int32, sharding=tok),
          jax.ShapeDtypeStruct((e, h, i), dtype, sharding=exp),
          jax.ShapeDtypeStruct((e, h, i), dtype, sharding=exp),
          jax.ShapeDtypeStruct((e, i, h), dtype, sharding=exp))
  ctx = (jax.sharding.use_abstract_mesh(mesh) if isinstance(mesh, jax.sharding.AbstractMesh)
         else jax.set_mesh(mesh))
  with ctx:
    exported = jax.export.export(
        jax.jit(_dispatch_fn(fn)), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c)
                         for c in (MOSAIC_CALL, "ragged_all_to_all")])(*args)
  text = exported.mlir_module()
  return dict(ragged_all_to_all=len(re.findall(r"custom_call @ragged_all_to_all", text)),
              all_to_all=len(re.findall(r"stablehlo\.all_to_all", text)),
              mosaic=len(re.findall(rf"custom_call @{MOSAIC_CALL}", text)),
              nr_devices=exported.nr_devices)


def export_checks():
  """The CPU lowering over the 8 (CPU) devices: padded all_to_all, no ragged one."""
  return {"reference/cpu": export_dispatch(sharding.make_mesh("expert:8"), "cpu")}
