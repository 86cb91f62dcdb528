"""Meshes and sharding rules; sharded = single-device results on 8 forced CPU devices (in a
child process, since the device count is fixed when JAX starts), EAGLE-3 heads included; two
`jax.distributed` processes on localhost."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from engine.model import sharding
from engine.model.config import config_from_dict
from engine.model.params import param_shapes
from model_configs import CONFIGS

CHILD = os.path.join(os.path.dirname(__file__), "sharding_child.py")
KIMI_LIKE = dict(CONFIGS["deepseek_v3"], n_routed_experts=384, num_attention_heads=64,
                 vocab_size=163840, first_k_dense_replace=1, n_group=1, topk_group=1)


def test_mesh_spec_parsing_and_validation():
  assert sharding.parse_mesh("expert:8") == {"data": 1, "expert": 8, "tensor": 1}
  assert sharding.parse_mesh("data:2, tensor:4") == {"data": 2, "expert": 1, "tensor": 4}
  for bad in ("expert", "expert:0", "pipeline:2", "tensor:x"):
    with pytest.raises(ValueError, match="mesh"):
      sharding.parse_mesh(bad)
  with pytest.raises(ValueError, match="needs 8 devices"):
    sharding.make_mesh("expert:8", devices=jax.devices()[:1])


def test_every_parameter_follows_its_rule():
  cfg = config_from_dict(KIMI_LIKE)
  mesh = jax.sharding.AbstractMesh((1, 2, 4), sharding.MESH_AXES)
  specs = sharding.param_specs(cfg, param_shapes(cfg), mesh)
  # The stacked layout: a leading layer axis, never split, then each layer's rule.
  assert cfg.layer_stacks == ((0, 1), (1, cfg.num_layers))
  moe_layer = specs["stacks"][1]
  assert moe_layer["moe"]["experts"]["gate"] == P(None, ("expert", "tensor"), None, None)
  assert moe_layer["moe"]["experts"]["down"] == P(None, ("expert", "tensor"), None, None)
  assert moe_layer["moe"]["shared"]["gate"] == P(None, None, "tensor")
  assert moe_layer["moe"]["shared"]["down"] == P(None, "tensor", None)
  assert moe_layer["moe"]["router"] == P(None)
  attn = moe_layer["attn"]
  assert attn["q_b"] == P(None, None, "tensor", None)
  assert attn["kv_b"] == P(None, None, "tensor", None)
  assert attn["o"] == P(None, "tensor", None, None)
  assert attn["q_a"] == P(None, None, "tensor") and attn["kv_a"] == P(None, None, "tensor")
  assert attn["kv_a_norm"] == P(None) and attn["q_a_norm"] == P(None)
  assert specs["stacks"][0]["mlp"]["up"] == P(None, None, "tensor")
  # A stack's cache entry (its layers' pools end to end) splits as one layer's pool: GQA K/V
  # by KV head over tensor.
  gqa = config_from_dict(CONFIGS["qwen3_moe"])  # 2 KV heads
  tp2 = jax.sharding.AbstractMesh((1, 4, 2), sharding.MESH_AXES)
  assert sharding.cache_sharding(gqa, tp2)["k"].spec == P(None, None, "tensor", None)
  assert specs["embed"] == P("tensor", None) and specs["lm_head"] == P(None, "tensor")
  with pytest.raises(ValueError, match="does not divide"):
    sharding.check_divisible(cfg, jax.sharding.AbstractMesh((1, 1, 128), sharding.MESH_AXES))


def test_an_eagle3_head_is_split_as_a_target_layer_of_its_kind():
  """The rules `sharding.shard_head` applies: attention heads, the MLP's inner dimension and
  the vocabulary over tensor; fc and the norms whole; the MHA head's K/V pages by KV head."""
  from engine.model.eagle3_config import load_eagle3_config
  from engine.model.eagle3_loader import abstract_head_params
  fixtures = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "eagle3")
  target = config_from_dict(json.load(open(os.path.join(fixtures, "target", "config.json"))))
  tp2 = jax.sharding.AbstractMesh((1, 1, 2), sharding.MESH_AXES)
  for variant in ("mla", "mha_full"):
    head = load_eagle3_config(os.path.join(fixtures, variant), target)
    specs = sharding.param_specs(head.layer, abstract_head_params(head), tp2)
    assert specs["fc"] == specs["final_norm"] == P()
    assert specs["mlp"]["gate"] == P(None, "tensor") and specs["mlp"]["down"] == P("tensor", None)
    assert specs["lm_head"] == P(None, "tensor") and specs["embed"] == P("tensor", None)
    assert specs["attn"]["o"] == P("tensor", None, None)
    q = "q_b" if head.is_mla else "q"
    assert specs["attn"][q] == P(None, "tensor", None)
  assert sharding.cache_sharding(head.layer, tp2)["k"].spec == P(None, None, "tensor", None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_dispatch_packing_is_exact(dtype):
  """Routing weights and expert ids travel bit-cast inside the token rows, as unsigned integers
  (small ids are subnormals as bf16 bits, which a float op may flush)."""
  from engine.model.expert_parallel import _pack, _unpack
  x = jax.random.normal(jax.random.key(0), (5, 8)).astype(dtype)
  w = jax.random.uniform(jax.random.key(1), (5, 3))
  ids = jnp.asarray([[0, 7, -1], [383, 2, 1], [5, 5, 5], [-1, -1, -1], [9, 10, 11]], jnp.int32)
  packed = _pack(x, w, ids)
  assert jnp.issubdtype(packed.dtype, jnp.unsignedinteger)
  assert packed.dtype.itemsize == x.dtype.itemsize
  gx, gw, gids = _unpack(packed[None], 8, 3, x.dtype)
  assert gx.dtype == x.dtype
  assert (gx[0] == x).all() and (gw[0] == w).all() and (gids[0] == ids).all()


def _run(*args, timeout=600):
  out = subprocess.run([sys.executable, CHILD, *args], capture_output=True, text=True,
                       timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sharded_equals_single_device_on_eight_devices():
  results = _run("meshes")
  demo = results.pop("demo_load")
  assert demo["all_named_on_mesh"] and demo["same_text"] and demo["expert_fraction"] == 0.125
  check_eagle3_on_a_mesh(results.pop("eagle3"))
  assert len(results) == 6
  for name, r in results.items():
    assert r["shard_map_in_forward"], name
    assert r["max_abs_diff"] <= 1e-5 * r["max_abs_ref"] + 1e-6, (name, r)
    assert r.get("greedy_equal", True), name
    assert r["experts_spec"] == "P(None, ('expert', 'tensor'), None, None)", name
    ep = 4 if name.endswith("data:2,expert:4") else 8
    assert r["expert_bytes_per_device"] == [r["expert_bytes_total"] // ep], name
  # The engine generated on one mesh per model, as on one device.
  assert sorted(n for n, r in results.items() if "greedy_equal" in r) == [
      "deepseek_v3/data:2,expert:4", "qwen3_moe/tensor:4,expert:2"]


def check_eagle3_on_a_mesh(r):
  """EAGLE-3 on a tensor:2 mesh (`sharding_child.eagle3_sharded`): the float32 demo with its MLA
  head generates plain greedy's output (the engine's own, drafter off: nothing drafted) and
  its drafts are accepted; the head's weights and KV entry are split as a target layer of its
  kind (MLA latent replicated, as the target's; MHA K/V by KV head) and stay so after the
  loop; both heads' draft chains match one device."""
  assert r["same_as_plain"] and r["plain_drafted"] == 0 and r["accepted"] > 0, r
  assert r["mla_entry"] == r["target_entry"] == {"latent": "P()"}, r
  split_heads = "P(None, 'tensor', None)"
  assert r["mla_params"] == dict(q_a="P(None, 'tensor')", kv_a="P(None, 'tensor')",
                                 q_a_norm="P()", kv_a_norm="P()", q_b=split_heads,
                                 kv_b=split_heads, o="P('tensor', None, None)",
                                 lm_head="P(None, 'tensor')"), r
  assert r["embed_shared"], r  # the head reuses the target's placed embedding, no copy
  kv_split = "P(None, None, 'tensor', None)"
  assert r["mha_entry"] == {"k": kv_split, "v": kv_split}, r
  assert r["mha_params"] == dict(q=split_heads, k=split_heads, v=split_heads,
                                 o="P('tensor', None, None)"), r
  for head in ("mla", "mha"):
    assert r[f"{head}_same_drafts"] and r[f"{head}_pool_kept"], (head, r)
    assert r[f"{head}_chain_max_abs_diff"] <= 1e-5 * r[f"{head}_chain_max_abs_ref"] + 1e-6, r


@pytest.mark.slow
def test_two_processes_match_one():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, CHILD, "multiprocess", str(port), str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  ref = _run("reference")
  for pid, o in enumerate(outs):
    assert o["devices"] == 8 and o["local"] == 4
    # KV cache sizing: own devices only (CPU: no statistics), the job's smallest choice.
    assert o["cpu_free"] is None
    assert o["free"] == (1 + pid) * 800 and o["local_pages"] == (1 + pid) * 40
    assert o["agreed_pages"] == 40 and o["same_explicit"] == 12
    assert "process 0: 30, process 1: 31" in o["mismatch"]
    assert o["logits"] == pytest.approx(ref["logits"], rel=1e-5, abs=1e-5)
    assert o["checksum"] == pytest.approx(ref["checksum"], rel=1e-5)


@pytest.mark.slow
def test_token_dispatch_equals_single_device():
  """expert_parallel="dispatch": tokens split over the EP group and exchanged with the experts'
  owners (padded all_to_all on CPU; the CUDA branch, ragged_all_to_all, run through an emulation
  of its documented semantics), "auto", bf16 rows, and the q_a/kv_a column split."""
  results = _run("dispatch")
  export = results.pop("export")
  auto = results.pop("auto")
  assert results.pop("engine_greedy_equal")
  low_rank = results.pop("low_rank")  # q_a / kv_a split by output column over tensor:4
  assert low_rank["max_abs_diff"] <= 1e-5 * low_rank["max_abs_ref"] + 1e-6, low_rank
  assert low_rank["fraction"] == {"q_a": [0.25], "kv_a": [0.25]}, low_rank
  assert low_rank["gathered_shapes"] and not low_rank["weights_gathered"], low_rank
  bf16 = results.pop("bf16_direct")
  assert bf16["max_abs_diff"] <= 1e-2 * bf16["max_abs_ref"], bf16
  assert auto["max_abs_diff"] <= 1e-5 * auto["max_abs_ref"] + 1e-6
  assert len(results) == 6
  for name, r in results.items():
    for got in (r, r.get("ragged_emulated", r), r.get("padded_block", r)):
      assert got["max_abs_diff"] <= 1e-5 * got["max_abs_ref"] + 1e-6, (name, r)
    # (tokens out, results back) once: the 2 MoE layers run as one scanned body
    assert r.get("ragged_calls", 2) == 2, name
    assert r["all_to_all_not_psum"], name
  # The CUDA branch (emulated) and the padded block ran on one mesh per model.
  assert sorted(n for n, r in results.items() if "ragged_emulated" in r) == [
      "deepseek_v3/expert:8", "qwen3_moe/tensor:4,expert:2"]
  assert export["reference/cpu"]["ragged_all_to_all"] == 0
  assert export["reference/cpu"]["all_to_all"] == 3  # sizes, tokens out, results back
  assert export["reference/cpu"]["nr_devices"] == 8


@pytest.mark.parametrize("kernel", ["reference", "mosaic_gpu"])
def test_dispatch_lowers_to_ragged_all_to_all_for_cuda(kernel):
  """On this CPU-only host: the dispatch function exported for CUDA over an abstract mesh of 8
  H200s (no devices needed) exchanges with ragged_all_to_all (counts by all_to_all), also around
  the Mosaic GPU MoE kernel."""
  from dispatch_checks import H200, export_dispatch
  from pallas_kernels.moe import moe_mgpu, reference
  mesh = jax.sharding.AbstractMesh((1, 8, 1), sharding.MESH_AXES,
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3,
                                   abstract_device=H200)
  fn, dtype = ((reference.moe_experts, jnp.float32) if kernel == "reference"
               else (moe_mgpu.moe_experts, jnp.bfloat16))
  got = export_dispatch(mesh, "cuda", fn, dtype)
  assert got["ragged_all_to_all"] == 2 and got["all_to_all"] == 1, got  # out, back; sizes
  assert got["nr_devices"] == 8
  assert got["mosaic"] == (2 if kernel == "mosaic_gpu" else 0), got
