"""Run by test_sharding.py in a fresh process with 8 (forced) CPU devices, or as one of two
`jax.distributed` processes with 4 each. Prints one JSON line of results."""

import json
import os
import sys

MODE = sys.argv[1]  # "meshes", "dispatch", "eagle3", "reference" or "multiprocess"
DEVICES = 8 if MODE in ("meshes", "dispatch", "eagle3") else 4
# (Kept: the flags the test process was started with, e.g. conftest's optimization level.)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine.model import sharding  # noqa: E402
from engine.model.cache import init_cache  # noqa: E402
from engine.model.config import config_from_dict  # noqa: E402
from engine.model.kernels import REFERENCE  # noqa: E402
from engine.model.params import init_params  # noqa: E402
from engine.model.transformer import forward_logits  # noqa: E402
from model_configs import CONFIGS  # noqa: E402

TOKENS = np.asarray([[1, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41, 42, 43, 0, 0, 0]], np.int32)
N_NEW = np.asarray([8, 5], np.int32)
TABLE = np.arange(4, dtype=np.int32).reshape(2, 2) + 1


def model(name):
  cfg = config_from_dict(dict(CONFIGS[name], n_routed_experts=8, num_experts=8))
  return cfg, init_params(cfg, seed=1, scale=2.0)


def logits(cfg, params, mesh=None, impl=REFERENCE):
  cache = init_cache(cfg, 5, 8, jnp.float32)
  if mesh is not None:
    cache = jax.device_put(cache, [sharding.cache_sharding(cfg, mesh)] * len(cache))
    with jax.set_mesh(mesh):
      out, _ = forward_logits(params, cache, TOKENS, np.zeros(2, np.int32), N_NEW, TABLE,
                              cfg=cfg, impl=impl)
  else:
    out, _ = forward_logits(params, cache, TOKENS, np.zeros(2, np.int32), N_NEW, TABLE, cfg=cfg)
  return np.asarray(jax.device_get(out))


def run_meshes():
  from engine.runtime.engine import Engine, EngineConfig
  from engine.runtime.request import StopParams
  results = {}
  for name in ("deepseek_v3", "qwen3_moe"):
    cfg, params = model(name)
    ref = logits(cfg, params)
    one = Engine(cfg, params, EngineConfig(page_size=8, max_num_seqs=2,
                                           max_num_batched_tokens=16, row_widths=(16,),
                                           max_model_len=64, cache_dtype=jnp.float32))
    prompts = [[1, 5, 6, 7, 8], [1, 40, 41]]
    want = [r.output_ids for r in one.generate(prompts, stop=StopParams(max_tokens=8))]
    # The engine's generation on a mesh once per model (a mesh with a tensor or a data axis):
    # the other meshes run the same forward, whose logits are compared on every mesh.
    engine_mesh = {"deepseek_v3": "data:2,expert:4", "qwen3_moe": "tensor:4,expert:2"}[name]
    for spec in ("expert:8", "tensor:4,expert:2", "data:2,expert:4"):
      mesh = sharding.make_mesh(spec)
      placed = sharding.shard_params(cfg, params, mesh)
      got = logits(cfg, placed, mesh)
      moe = next(l["moe"] for l in placed["stacks"] if "moe" in l)
      experts = moe["experts"]["gate"]
      per_device = sharding.bytes_per_device(moe["experts"])
      if spec == engine_mesh:
        eng = Engine(cfg, placed, EngineConfig(page_size=8, max_num_seqs=2,
                                               max_num_batched_tokens=16, row_widths=(16,),
                                               max_model_len=64, cache_dtype=jnp.float32),
                     mesh=mesh)
        greedy = [r.output_ids for r in eng.generate(prompts, stop=StopParams(max_tokens=8))]
      attn_q = placed["stacks"][0]["attn"]["q" if "q" in placed["stacks"][0]["attn"] else "q_b"]
      with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda p, c: forward_logits(
            p, c, TOKENS, np.zeros(2, np.int32), N_NEW, TABLE, cfg=cfg))(
                placed, init_cache(cfg, 5, 8, jnp.float32)))
      results[f"{name}/{spec}"] = dict(
          shard_map_in_forward="shard_map" in jaxpr,
          max_abs_diff=float(np.max(np.abs(got - ref))), max_abs_ref=float(np.max(np.abs(ref))),
          experts_spec=str(experts.sharding.spec),
          attn_q_spec=str(attn_q.sharding.spec),
          expert_bytes_per_device=sorted(set(per_device.values())),
          expert_bytes_total=int(sum(x.nbytes for x in jax.tree.leaves(moe["experts"]))))
      if spec == engine_mesh:
        results[f"{name}/{spec}"]["greedy_equal"] = greedy == want
  results["demo_load"] = load_demo_sharded()
  results["eagle3"] = eagle3_sharded()
  return results


def load_demo_sharded():
  """engine.load(mesh=...) places every leaf as it reads; generation matches one device."""
  import engine as moejax
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "checkpoints", "demo", "target")
  one = moejax.load(path)  # bfloat16: also covers the float32 EP all-reduce
  placed = moejax.load(path, mesh="tensor:4,expert:2")
  leaves = jax.tree.leaves(placed.params)
  named = all(isinstance(x.sharding, jax.sharding.NamedSharding)
              and x.sharding.mesh.shape == placed.mesh.shape for x in leaves)
  gate = placed.params["stacks"][-1]["moe"]["experts"]["gate"]
  frac = gate.addressable_shards[0].data.nbytes / gate.nbytes
  a = moejax.generate(one, "def read_config(path):", max_new_tokens=12)
  b = moejax.generate(placed, "def read_config(path):", max_new_tokens=12)
  return dict(all_named_on_mesh=named, expert_fraction=frac, same_text=a.token_ids == b.token_ids)


def eagle3_sharded():
  """EAGLE-3 on a 2-device tensor mesh. The float32 demo with its MLA head: greedy output equal
  to plain greedy (the same engine's, drafter off: its plain decode loop), drafts accepted. The
  MHA fixture head beside the tiny INT4 target, its K/V entry split by KV head. Both: the draft
  chain as on one device (the heads' own placed weights and a placed pool), the head's weights
  and cache entry placed as a target layer of its kind. (One engine compiled, on the mesh: a
  one-device engine's eagle3 output is plain greedy's in test_eagle3_drafter.py, and a sharded
  engine's plain output one device's in `run_meshes`.)"""
  from engine.model.cache import first_extra_entry
  from engine.model.config import load_config
  from engine.model.eagle3_loader import load_eagle3
  from engine.model.hf_loader import load_hf_params
  from engine.runtime.engine import Engine, EngineConfig
  from engine.runtime.request import StopParams
  from engine.runtime.sampling import SamplingParams
  here = os.path.dirname(os.path.abspath(__file__))
  demo = os.path.join(os.path.dirname(here), "checkpoints", "demo")
  mesh = sharding.make_mesh("tensor:2", jax.devices()[:2])
  conf = dict(page_size=8, max_num_seqs=2, max_num_batched_tokens=32, row_widths=(32,),
              max_model_len=96, max_decode_steps=8, cache_dtype=jnp.float32,
              num_draft_tokens=3, measure_spec_costs=False, decode_batch_sizes=(2,),
              compilation_cache_dir=None)

  def specs(tree):
    return {k: str(v.sharding.spec) for k, v in tree.items()}

  import engine as moejax
  model = moejax.load(os.path.join(demo, "target"), dtype="float32")
  cfg, params = model.config, model.params
  placed = place(cfg, params, mesh)
  prompts = [[1, 300, 301, 302, 303, 304, 305], [1, 40, 41, 42]]
  stop = StopParams(max_tokens=16, ignore_eos=True)
  # (the head loaded as `engine.load`'s model loads it: sharing the target's embedding)
  hcfg, hparams = load_eagle3(os.path.join(demo, "eagle3"), cfg, params, jnp.float32)
  head = load_eagle3(os.path.join(demo, "eagle3"), cfg, placed, jnp.float32)
  eng = Engine(cfg, placed, EngineConfig(**conf, speculative="eagle3"), head=head, mesh=mesh)
  plain = [r.output_ids for r in eng.generate(prompts, SamplingParams(drafter="off"), stop)]
  plain_drafted = eng.counters["spec_drafted"]
  got = [r.output_ids for r in eng.generate(prompts, stop=stop)]
  own = eng.runner.own_params["eagle3"]
  results = dict(same_as_plain=got == plain, plain_drafted=plain_drafted,
                 accepted=eng.counters["spec_accepted"],
                 # after generating: still placed as the target's MLA layers
                 mla_entry=specs(eng.runner.cache[first_extra_entry(cfg)]),
                 target_entry=specs(eng.runner.cache[0]),
                 mla_params=dict(specs(own["attn"]), lm_head=str(own["lm_head"].sharding.spec)),
                 embed_shared=own["embed"] is eng.params["embed"])
  results.update({f"mla_{k}": v for k, v in chain_on_mesh(cfg, hcfg, hparams, own, mesh).items()})

  fixtures = os.path.join(here, "golden", "fixtures", "eagle3")
  cfg = load_config(os.path.join(fixtures, "target"))
  params = load_hf_params(os.path.join(fixtures, "target"), cfg, jnp.float32, progress=False)
  hcfg, hparams = load_eagle3(os.path.join(fixtures, "mha_full"), cfg, params, jnp.float32)
  eng = Engine(cfg, place(cfg, params, mesh),
               EngineConfig(**conf, speculative="eagle3"), head=(hcfg, hparams), mesh=mesh)
  results["mha_entry"] = specs(eng.runner.cache[first_extra_entry(cfg)])
  results["mha_params"] = specs(eng.runner.own_params["eagle3"]["attn"])
  results.update({f"mha_{k}": v for k, v in chain_on_mesh(
      cfg, hcfg, hparams, eng.runner.own_params["eagle3"], mesh).items()})
  return results


def place(cfg, params, mesh):
  """`sharding.shard_params`'s placement, from host copies: one device's arrays are split by a
  program compiled per leaf shape (~60 here, ~3 s on CPU); host arrays are copied in parts."""
  return jax.device_put(jax.device_get(params), sharding.param_shardings(cfg, params, mesh))


def chain_on_mesh(cfg, hcfg, hparams, placed_params, mesh):
  """A head's draft chain (first pass over 8 positions, 3 chained steps) on the mesh (its placed
  weights, a placed pool) against one device: the largest difference, the same drafts, the pool
  still placed as the cache entry."""
  from engine.model.eagle3 import draft_chain, init_pool
  rng = np.random.default_rng(0)
  aux = rng.standard_normal((2, 8, hcfg.num_aux * cfg.hidden_size)).astype(np.float32)
  tokens = rng.integers(3, cfg.vocab_size, (2, 8)).astype(np.int32)
  args = (aux, tokens, np.zeros(2, np.int32), np.asarray([8, 5], np.int32), TABLE)
  ref = draft_chain(hparams, init_pool(hcfg, 5, 8, jnp.float32), *args, cfg=hcfg, num_drafts=3)
  placed_pool = jax.device_put(init_pool(hcfg, 5, 8, jnp.float32),
                               sharding.cache_sharding(hcfg.layer, mesh))
  with jax.set_mesh(mesh):
    got = draft_chain(placed_params, placed_pool, *args, cfg=hcfg, num_drafts=3)
  return dict(
      chain_max_abs_diff=max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                             for a, b in zip(jax.tree.leaves(ref[:2]), jax.tree.leaves(got[:2]))),
      chain_max_abs_ref=max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(ref[:2])),
      same_drafts=bool((np.asarray(ref[2]) == np.asarray(got[2])).all()),
      pool_kept=all(v.sharding.is_equivalent_to(sharding.cache_sharding(hcfg.layer, mesh)[k],
                                                v.ndim) for k, v in got[3].items()))


def run_multiprocess(port, pid):
  sharding.initialize_distributed(f"localhost:{port}", 2, pid)
  cfg, params = model("deepseek_v3")
  mesh = sharding.make_mesh("expert:8")
  placed = jax.device_put(params, sharding.param_shardings(cfg, params, mesh))
  out = logits(cfg, placed, mesh)
  return dict(process=pid, devices=len(jax.devices()), local=len(jax.local_devices()),
              logits=out.reshape(-1)[:64].tolist(), checksum=float(np.abs(out).sum()),
              **kv_sizing_across_processes(pid))


def kv_sizing_across_processes(pid):
  """The KV cache's page count agreed by the job: each process measures only its own devices
  (another process's `memory_stats` raises), the smallest choice wins, an explicit count must
  match everywhere."""
  from engine.runtime import kv_sizing

  class FakeGPU:  # a device with memory statistics, as on GPU (XLA:CPU reports none)
    def __init__(self, process_index, free):
      self.process_index, self.free = process_index, free

    def memory_stats(self):
      if self.process_index != jax.process_index():
        raise RuntimeError("MemoryStats is only supported for addressable PjRt devices")
      return {"bytes_limit": self.free + 1000, "bytes_in_use": 1000}

  free = kv_sizing.free_device_bytes(
      [FakeGPU(p, (1 + p) * 800 + 100 * d) for p in range(2) for d in range(2)])
  local = kv_sizing.pages_for(free, page_bytes=10, fraction=0.5, fallback=7)
  try:
    kv_sizing.agree_num_pages(30 + pid, explicit=True)
    mismatch = ""
  except ValueError as e:
    mismatch = str(e)
  return dict(cpu_free=kv_sizing.free_device_bytes(jax.devices()), free=free,
              local_pages=local, agreed_pages=kv_sizing.agree_num_pages(local, explicit=False),
              same_explicit=kv_sizing.agree_num_pages(12, explicit=True), mismatch=mismatch)


def run_dispatch():
  """Token dispatch (`expert_parallel="dispatch"`) vs one device (tests/dispatch_checks.py)."""
  from dispatch_checks import dispatch_results
  return dispatch_results(model, logits, (TOKENS, N_NEW, TABLE))


if __name__ == "__main__":
  if MODE == "meshes":
    print(json.dumps(run_meshes()))
  elif MODE == "eagle3":  # (part of "meshes"; alone for debugging)
    print(json.dumps(eagle3_sharded()))
  elif MODE == "dispatch":
    print(json.dumps(run_dispatch()))
  elif MODE == "reference":
    cfg, params = model("deepseek_v3")
    out = logits(cfg, params)
    print(json.dumps(dict(logits=out.reshape(-1)[:64].tolist(),
                          checksum=float(np.abs(out).sum()))))
  else:
    print(json.dumps(run_multiprocess(int(sys.argv[2]), int(sys.argv[3]))))
