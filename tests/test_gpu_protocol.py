"""The GPU protocol (`bench/gpu_check.sh`, `bench/protocol/`) on the CPU: a subset of its dry
run end to end (every stage's first case at toy shapes, the Mosaic GPU kernels interpreted,
their first GPU program lowered for CUDA), the stage machinery (a stage cut at its limit keeps
its rows and the next one runs; a spent budget writes skip rows), the rows' fractions, the
summary's size, the SASS counts, and the benches' random weights."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import summarize
from bench.decode_profile import random_params_on_device
from bench.expert_bytes import INT4
from bench.protocol import k25_slice, rows, sass
from engine.model.config import config_from_dict
from engine.model.params import layer_params
from model_configs import CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOUR_FILES = {"run.log", "results.jsonl", "raw.tgz", "summary.md"}


def _gpu_check(out, **env):
  env = {**os.environ, "OUT": str(out), "PY": sys.executable, "TORCH_PY": sys.executable,
         "PYTHONPATH": ROOT, **env}
  return subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)


def _rows(out):
  return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dry_run_subset_runs_every_stage_and_writes_the_four_files(tmp_path):
  r = _gpu_check(tmp_path, DRY_RUN="1", QUICK="1", COMMIT="abc1234")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert set(os.listdir(tmp_path)) == FOUR_FILES
  got = _rows(tmp_path)
  stages = ["ceilings", "int4", "k25_slice", "mla", "experts", "peers"]
  assert [x["stage"] for x in got if x["impl"] == "stage_end"] == stages
  assert all(x["commit"] == "abc1234" and x["dry_run"] is True for x in got)
  labelled = [x for x in got if x["impl"] != "stage_end" and x["stage"] != "peers"]
  assert all(x["jax"] == jax.__version__ and x["device"] for x in labelled)
  by = {(x["stage"], x["impl"]): x for x in got}
  ceil = {k: by[("ceilings", k)] for k in ("xla_copy", "xla_read", "xla_matmul_bf16")}
  assert all(c["us"] > 0 for c in ceil.values()) and ceil["xla_matmul_bf16"]["tflops"] > 0
  # The W4A16 register plan's bitwise check comes first in its stage.
  int4_rows = [x for x in got if x["stage"] == "int4"]
  assert int4_rows[0]["impl"] == "plan registers" and int4_rows[0]["mismatches"] == 0
  # The kernels ran (interpreted) and match their references; fractions of this run's ceilings.
  for stage in ("int4", "experts", "mla"):
    k = by[(stage, "mosaic_gpu")]
    assert k["rel_err_vs_reference"] < 2e-2, k
    ceiling = max(ceil["xla_copy"]["gbps"], ceil["xla_read"]["gbps"])
    assert k["frac_ceiling"] == pytest.approx(k["bytes"] / k["us"] / 1e3 / ceiling)
  # The MLA stage starts with the split-KV decode kernel's correctness cases.
  assert by[("mla", "mosaic_gpu")]["group"] == "check" and by[("mla", "mosaic_gpu")]["ok"]
  slice_rows = [x for x in got if x["stage"] == "k25_slice" and "kind" in x]
  assert {x["kind"] for x in slice_rows} == {"decode", "prefill"}
  assert all(x["us"] > 0 and x["compile_s"] > 0 and x["flops"] > 0 for x in slice_rows)
  # Each stage's first real-shape GPU program lowers for CUDA with its Mosaic GPU kernels.
  exports = [x for x in got if x["impl"] == "cuda_export"]
  assert {x["stage"] for x in exports} == {"int4", "k25_slice", "mla", "experts"}
  assert all(x.get("mosaic_calls", 0) >= 1 for x in exports), exports
  peers = [x for x in got if x["stage"] == "peers" and x["impl"] != "stage_end"]
  assert peers and all(x.get("skipped") or x.get("us") or x.get("error") for x in peers)
  summary = (tmp_path / "summary.md").read_text()
  assert len(summary) < 10_000 and "## int4" in summary and "## k25_slice" in summary
  assert summary.strip() in r.stdout and r.stdout.rstrip().endswith("every stage wrote a row")
  assert "kernels: attention=reference moe=reference" in (tmp_path / "run.log").read_text()


FAKE_PY = """#!/usr/bin/env bash
# A stage that writes one row, then hangs past its limit; every other command runs as is.
if [[ "$*" == *bench.protocol.ceilings* ]]; then
  exec {py} -c 'import sys, time; from bench.protocol.rows import Recorder
Recorder(sys.argv[1], "ceilings").row("xla_copy", us=10.0, bytes=10_000_000)
time.sleep(60)' "$OUT"
fi
exec {py} "$@"
"""


@pytest.mark.slow
def test_a_stage_cut_at_its_limit_keeps_its_rows_and_the_next_stage_runs(tmp_path):
  fake = tmp_path / "py"
  fake.write_text(FAKE_PY.format(py=sys.executable))
  fake.chmod(0o755)
  out = tmp_path / "out"
  r = _gpu_check(out, STAGES="ceilings,peers", LIMITS="ceilings:3", PY=str(fake),
                 TORCH_PY=str(fake))
  assert r.returncode == 0, r.stdout[-2000:]
  assert set(os.listdir(out)) == FOUR_FILES
  got = _rows(out)
  assert got[0]["impl"] == "xla_copy" and got[0]["gbps"] == pytest.approx(1000.0)
  end = [x for x in got if x["impl"] == "stage_end"]
  assert [(x["stage"], x["rc"], x["rows"]) for x in end] == [("ceilings", 124, 1),
                                                              ("peers", 0, 1)]
  assert any(x["stage"] == "peers" and x.get("skipped") for x in got)
  # A budget already spent: every stage writes its skip row, and that counts as its row.
  out2 = tmp_path / "out2"
  r = _gpu_check(out2, STAGES="ceilings,mla", BUDGET_S="20")
  assert r.returncode == 0, r.stdout[-2000:]
  assert [x["stage"] for x in _rows(out2) if "budget" in x.get("skipped", "")] == ["ceilings",
                                                                                   "mla"]


def test_a_stage_without_rows_fails_the_run(tmp_path):
  (tmp_path / rows.RESULTS).write_text(json.dumps(
      {"stage": "mla", "impl": "mosaic_gpu", "error": "OOM"}) + "\n{torn")
  assert rows.missing(str(tmp_path), ["mla", "peers"]) == ["mla", "peers"]
  assert rows.main(["check", str(tmp_path), "mla,peers"]) == 1
  rows.Recorder(str(tmp_path), "peers").skip("torch not importable")
  assert rows.missing(str(tmp_path), ["mla", "peers"]) == ["mla"]


def test_rows_carry_fractions_of_the_same_runs_ceilings(tmp_path):
  rec = rows.Recorder(str(tmp_path), "ceilings")
  rec.row("xla_copy", us=1000.0, bytes=3_000_000_000)  # 3,000 GB/s read + write
  rec.row("xla_read", us=1000.0, bytes=4_000_000_000)  # 4,000 GB/s
  rec.row("xla_matmul_bf16", us=1000.0, flops=800_000_000_000)  # 800 TFLOP/s
  k = rows.Recorder(str(tmp_path), "int4").row("mosaic_gpu", us=100.0, bytes=200_000_000,
                                               flops=40_000_000_000)
  assert k["gbps"] == pytest.approx(2000.0)
  assert k["frac_ceiling"] == pytest.approx(0.5) and k["frac_copy"] == pytest.approx(2 / 3)
  assert k["tflops"] == pytest.approx(400.0) and k["frac_matmul"] == pytest.approx(0.5)
  assert len(rows.read_rows(str(tmp_path))) == 4


def test_int4_stage_starts_a_sweep_variant_only_while_the_cases_after_it_fit(tmp_path):
  from bench.protocol import int4
  now = [0.0]
  rec = rows.Recorder(str(tmp_path), "int4")
  clock = int4.Deadline(100.0, now=lambda: now[0])

  def program(seconds):
    now[0] += seconds
    return seconds
  assert clock.run(rec, "c", {}, 4, False, program, 20.0) == 20.0  # 80 s left
  # A 20 s program (the slowest so far) fits, but not before 4 required 20 s programs.
  assert clock.run(rec, "c", {"splits": 1}, 4, True, program, 1.0) is None
  assert clock.run(rec, "c", {"splits": 2}, 3, True, program, seconds=1.0) == 1.0
  now[0] = 85.0  # 15 s left: a required program no longer starts either
  assert clock.run(rec, "c", {}, 0, False, program, 1.0) is None
  skipped = [r for r in rows.read_rows(str(tmp_path)) if r.get("skipped")]
  assert [r["impl"] for r in skipped] == ["mosaic_gpu splits=1", "mosaic_gpu"]
  assert all(r["skipped"].startswith("deadline") for r in skipped)


def test_summary_stays_under_the_output_limit(tmp_path):
  rec = rows.Recorder(str(tmp_path), "mla")
  for i in range(400):
    rec.row("mosaic_gpu", f"B={i} ctx=4096 h=8 T=1 page=64", us=10.0 + i, bytes=10 ** 7)
  text = summarize.summary(str(tmp_path))
  assert len(text) <= summarize.LIMIT + 1 and "## mla" in text


SASS = """ptxas info    : Compiling entry function 'body_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Used 168 registers, 40 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
//--------------------- .text.body_mosaic_gpu_kernel --------------------------
	.section	.text.body_mosaic_gpu_kernel,"ax",@progbits
	.sectioninfo	@"SHI_REGISTERS=168"
.text.body_mosaic_gpu_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 HGMMA.64x8x16.F32.BF16 gdesc[UR4], RZ, !UPT ;
        /*0020*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;
        /*0030*/                   LOP3.LUT R4, R3, 0xf0, RZ, 0xc0, !PT ;
        /*0040*/                   STS.128 [R5], R6 ;
        /*0050*/                   HFMA2.BF16_V2 R7, R8, R9, -RZ ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
"""


def test_sass_counts_opcode_families_and_ptxas_reports():
  second = SASS.replace("LOP3.LUT R4", "PRMT R4").split("\t.headerflags", 1)[1]
  r, r2 = sass.summarize(SASS + "\t.headerflags" + second)  # the same kernel compiled twice
  assert r["module"] == "body_mosaic_gpu_kernel#1" and r2["module"].endswith("#2")
  assert r["instructions"] == 7 and r2["top_opcodes"][0][1] == 1
  assert r["families"]["mma"] == 1 and r["families"]["bit_ops"] == 2
  assert r["families"]["smem_store"] == 1 and r["families"]["bf16x2_math"] == 1
  assert r["families"]["barrier"] == 1 and r["top_opcodes"][0] == ("LOP3", 2)
  assert r["registers"] == 168 and r["spill_store_bytes"] == 8


def test_random_weights_integer_leaves_are_random_bits_not_zeros():
  cfg = dataclasses.replace(config_from_dict(dict(
      CONFIGS["deepseek_v3"], hidden_size=128, moe_intermediate_size=128, num_hidden_layers=3)),
      int4=INT4)
  params = random_params_on_device(cfg, jnp.bfloat16, share_layers=True)
  layer = functools.partial(layer_params, cfg, params)
  packed = np.asarray(layer(1)["moe"]["experts"]["gate"].packed)
  assert packed.dtype == np.uint8 and packed.size > 10_000
  assert np.mean(packed == 0) < 0.02  # a float cast to uint8 made ~all of them 0
  nibbles = np.concatenate([packed & 0xF, packed >> 4]).ravel()
  counts = np.bincount(nibbles, minlength=16)
  assert counts.min() > 0.8 * nibbles.size / 16  # every value about equally likely
  # The same values in every layer of a kind (a stack repeats them), never across kinds.
  same = lambda a, b: np.array_equal(np.asarray(a), np.asarray(b))  # noqa: E731
  gate = lambda i: layer(i)["moe"]["experts"]["gate"].packed  # noqa: E731
  assert same(gate(2), gate(1))
  assert same(layer(2)["attn"]["kv_a"], layer(0)["attn"]["kv_a"])
  fp8_cfg = dataclasses.replace(cfg, int4=None, fp8_experts=(128, 128))
  fp8 = random_params_on_device(fp8_cfg, jnp.bfloat16)  # (not shared: each layer its own)
  fp8_layer = functools.partial(layer_params, fp8_cfg, fp8)
  assert not same(fp8_layer(2)["attn"]["kv_a"], fp8_layer(1)["attn"]["kv_a"])
  w = np.asarray(fp8_layer(1)["moe"]["experts"]["up"].w.astype(jnp.float32))
  assert np.isfinite(w).all() and np.mean(w == 0) < 0.05


def test_forward_flops_of_the_kimi_k25_slice():
  # One decode token over no context: twice the active matmul weights, from the published
  # sizes (billions): attention 6.17, dense MLP 0.40, shared experts 2.64, routers 0.17, head
  # 1.17, and 8 of 384 routed experts of 1014.69 (the embedding is a lookup, not a matmul).
  cfg = k25_slice.slice_config(61, toy=False)
  flops = k25_slice.forward_flops(cfg, 1, 1, 0, 1)
  active = (6.169 + 0.396 + 2.642 + 0.165 + 1.174 + 1014.686 * 8 / 384) * 1e9
  assert flops == pytest.approx(2 * active, rel=2e-3)
  # A prefill chunk: tokens x that, plus causal attention over the latent (576 + 512 per key).
  f = k25_slice.forward_flops(cfg, 1, 8192, 0, 1)
  attn = 2 * 8192 * 64 * (576 + 512) * (8192 + 1) / 2 * 61
  assert f == pytest.approx(8192 * (flops - 2 * 7168 * 163840) + 2 * 7168 * 163840 + attn,
                            rel=1e-3)


def test_protocol_imports_only_what_the_gpu_image_has():
  # The device image lacks the serving stack's packages; the stages must not need them.
  blocked = ["llguidance", "starlette", "uvicorn", "grpc", "prometheus_client",
             "grpc_health", "grpc_reflection", "orbax", "torch"]
  code = textwrap.dedent(f"""
      import sys
      for name in {blocked!r}:
        sys.modules[name] = None
      import bench.protocol.ceilings, bench.protocol.experts, bench.protocol.int4
      import bench.protocol.k25_slice, bench.protocol.mla, bench.protocol.peers, bench.summarize
      import bench.protocol.layers, bench.protocol.eagle3
  """)
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]


def test_k25_projection_prices_the_busiest_device_and_the_verify():
  from bench import k25_projection as proj
  # The busiest of 8 devices holds ~2.56 of a token's 8 experts; a 4-token verify's 31
  # distinct experts put ~6.7 on it (gpu-plan section 5.1's Monte Carlo, checked here).
  assert proj.busiest_device_experts(1).mean() == pytest.approx(2.56, abs=0.05)
  assert proj.busiest_device_experts(4).mean() == pytest.approx(6.71, abs=0.08)
  assert proj.busiest_device_experts(4, balanced=True).mean() == pytest.approx(31.0 / 8, abs=0.05)
  # Today's W4A16 rate model reproduces the first GPU run's 275 us for 8 experts.
  assert proj.int4_kernel_today_s(np.array([8.0])) == pytest.approx(275e-6, rel=0.02)
  assert proj.other_bytes_per_device() == pytest.approx(3.26e9, rel=0.01)
  rows = proj.project(proj.TARGETS, [1.5, 3.0], 4.3e12, 8192, tau=3.0, drafts=3, draft_gb=0.41,
                      draft_overhead_ms=0.15)
  assert rows[0]["tok_s"] > rows[1]["tok_s"]  # more overhead, fewer tokens
  for r in rows:  # a verify costs more than a step, so speculation gains less than tau
    assert r["verify_ms"] > 1.3 * r["step_ms"] and r["tok_s"] < r["spec_tok_s"] < 3 * r["tok_s"]
  # An EAGLE-3 MLA head for K2.5: its full-vocabulary lm_head is 163840 x 7168 bf16 = 2.35 GB,
  # the body ~0.67B parameters; tokens/s = tau / (verify + K head steps).
  assert proj.head_gb(163840, 1) - proj.head_gb(0, 1) == pytest.approx(2.349, abs=0.001)
  assert proj.HEAD_BODY_PARAMS == pytest.approx(0.667e9, rel=0.01)
  spec = {(r["speculator"], r["tau"]): r for r in proj.speculators(
      proj.TARGETS, 3.0, 4.3e12, 8192, drafts=3, draft_overhead_ms=0.15)}
  ngram, mla = spec[("n-gram (prompt lookup / learned)", 2.0)], next(
      r for (name, tau), r in spec.items() if name.startswith("EAGLE-3 MLA (") and tau == 2.9)
  assert ngram["spec_ms"] == ngram["verify_ms"] < mla["spec_ms"]
  assert mla["spec_tok_s"] == pytest.approx(2.9 / mla["spec_ms"] * 1e3)
  assert mla["spec_tok_s"] > ngram["spec_tok_s"]


def _tiny_layers_model(layers):
  from bench.compile_depth import tiny_deepseek_v3
  from engine.model.params import abstract_params
  cfg = config_from_dict(tiny_deepseek_v3(layers))
  params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_params(cfg, jnp.bfloat16))
  return cfg, params


def test_layers_stage_past_its_deadline_writes_a_skip_row_per_program(tmp_path):
  # The `layers` stage (issue 49) cut at its deadline: every program it did not start is a
  # skip row naming the deadline, so the stage keeps a row per question and compiles nothing.
  from bench.protocol import layers
  from engine.model.kernels import REFERENCE
  rec = rows.Recorder(str(tmp_path), "layers")
  cfg, params = _tiny_layers_model(3)
  layers.step_rows(rec, layers.Clock(0.0), cfg, params, [], REFERENCE, 1, 16, 1)
  layers.depth_rows(rec, layers.Clock(0.0), (2, 3))
  got = [(r["impl"], r["case"]) for r in _rows(tmp_path)]
  assert got == [(p, "decode B=1") for p in layers.PROGRAMS] + [
      (impl, f"compile {prog} L={n}") for impl in ("scan", "unrolled") for n in (2, 3)
      for prog in ("prefill", "decode")]
  assert all("deadline" in r["skipped"] for r in _rows(tmp_path))
  assert layers.layer_nonexpert_bytes(params) == sum(
      x.nbytes // x.shape[0] for k, x in jax.tree_util.tree_leaves_with_path(
          params["stacks"][-1]) if "experts" not in jax.tree_util.keystr(k))


def _numpy_params(cfg):
  """Random parameters drawn on the host (random_params_on_device compiles a program: ~12 s
  of CPU): integer leaves random bits, norms ones, the rest N(0, 0.02^2)."""
  from engine.model.params import abstract_params, path_str
  rng = np.random.default_rng(0)

  def leaf(path, a):
    dt = np.dtype(a.dtype)
    if np.issubdtype(dt, np.integer):
      info = np.iinfo(dt)
      return jnp.asarray(rng.integers(info.min, info.max, a.shape, dtype=dt, endpoint=True))
    if path_str(path).endswith("norm"):
      return jnp.ones(a.shape, a.dtype)
    return jnp.asarray(rng.standard_normal(a.shape, np.float32) * 0.02, a.dtype)

  return jax.tree_util.tree_map_with_path(leaf, abstract_params(cfg, jnp.bfloat16))


@pytest.mark.slow
def test_layers_stage_rows_at_toy_size(tmp_path, monkeypatch):
  # Step rows (scan and separate: `unrolled` is the same code path with another flag), the
  # scan's slice copies from its compiled program (XLA:CPU copies each layer's slice of the
  # weights its dots read: nonzero here), the ratios row, and compile rows (one layer: the
  # rows, not the depth, are under test; ~14 s of CPU in all); then the summary's tables.
  from bench.protocol import layers
  from engine.model.kernels import REFERENCE
  monkeypatch.setattr(layers, "PROGRAMS", ("scan", "separate"))
  rec = rows.Recorder(str(tmp_path), "layers")
  cfg = k25_slice.slice_config(3, toy=True)
  params = _numpy_params(cfg)
  per_layer = [layer_params(cfg, params, i) for i in range(cfg.num_layers)]
  layers.step_rows(rec, layers.Clock(600.0), cfg, params, per_layer, REFERENCE, 1, 16, 1)
  layers.depth_rows(rec, layers.Clock(600.0), (1,))
  got = {(r["impl"], r["case"]): r for r in _rows(tmp_path)}
  for p in ("scan", "separate"):
    r = got[(p, "decode B=1")]
    assert r["us"] > 0 and r["bytes"] > 0 and r["kernels"] == "reference+reference", r
  scan = got[("scan", "decode B=1")]
  assert scan["slice_copy_bytes"] > 0 and scan["slice_copies"][0]["trip_count"] == 2
  ratio = got[("vs_separate", "decode B=1")]
  assert ratio["tokens_agree"] == {"scan": True}
  assert ratio["scan"] == pytest.approx(scan["us"] / got[("separate", "decode B=1")]["us"])
  compiles = [r for r in _rows(tmp_path) if r.get("kind") == "compile"]
  assert len(compiles) == 4 and all(r["compile_s"] > 0 and r["hlo_instructions"] > 0
                                    for r in compiles)
  text = summarize.summary(str(tmp_path))
  assert "## layers: decode step" in text and "## layers: lower + compile" in text


def test_layers_stage_compiles_its_tiny_depths_with_the_mosaic_kernels_on_hopper():
  # Issue 49 asks for the depth compile times with the Mosaic GPU kernels: the stage's tiny
  # widths must be ones both kernels take (compile_depth's own 64-wide model is refused).
  from bench.compile_depth import tiny_deepseek_v3
  from bench.protocol import layers
  from engine.model import kernels
  auto = kernels.KernelChoice(attention="auto", moe="auto")
  hopper = dict(device_kind="NVIDIA H200", platform="gpu", dtype=jnp.bfloat16, page_size=16)
  cfg = config_from_dict(dict(tiny_deepseek_v3(4), **layers.MOSAIC_TINY))
  assert kernels.resolve(auto, cfg, **hopper).choice == kernels.KernelChoice(
      attention="mosaic_gpu", moe="mosaic_gpu")
  assert kernels.resolve(auto, config_from_dict(tiny_deepseek_v3(4)), **hopper).choice.moe \
      == "reference"


def _eagle3_dry(monkeypatch):
  from bench.protocol import eagle3
  monkeypatch.setenv("DRY_RUN", "1")
  monkeypatch.delenv("QUICK", raising=False)
  return eagle3


@pytest.mark.slow
def test_eagle3_stage_rows_ratios_and_summary_at_toy_size(tmp_path, monkeypatch):
  # Issue 55's GPU item at toy widths on the CPU (reference kernels): the lm_heads, the
  # target slice and its 61-layer scaling, the MLA head with the full vocabulary and the MHA
  # head with the reduced one, at B = 1 (the GPU's lowering: the last test; ~8 s of CPU).
  eagle3 = _eagle3_dry(monkeypatch)
  monkeypatch.setattr(eagle3, "BATCHES", (1,))
  monkeypatch.setattr(eagle3, "PER_BATCH", (("mla", "full"),))
  monkeypatch.setattr(eagle3, "AFTER", (("mha", "reduced"),))
  monkeypatch.setattr(eagle3, "export_rows", lambda *a: None)
  eagle3.run(str(tmp_path), layers=2, context=16, deadline_s=600.0)
  got = {(r["impl"], r["case"]): r for r in _rows(tmp_path)}
  assert not [r for r in got.values() if r.get("error") or r.get("skipped")]
  full, reduced = eagle3.TOY["vocab_size"], eagle3.TOY_REDUCED
  lm = {v: got[("lm_head", f"V={v} B=1")] for v in (full, reduced)}
  assert lm[full]["bytes"] == 4 * lm[reduced]["bytes"] == full * 256 * 2
  slice_row, target = got[("target", "decode B=1")], got[("target_61", "decode B=1")]
  assert slice_row["layers"] == 2 and slice_row["bytes"] > 0
  assert target["us"] == pytest.approx(slice_row["us"] * 61 / 2 + lm[full]["us"])
  assert target["bytes"] > 61 / 2 * (slice_row["bytes"] - lm[full]["bytes"])
  heads = [("mla full", full), ("mha reduced", reduced)]
  for name, vocab in heads:
    chained, first = got[(name, "chained B=1")], got[(name, "first B=1 T=4")]
    assert chained["vocab"] == vocab and chained["us"] > 0 and chained["compile_s"] > 0
    assert chained["vs_target"] == pytest.approx(chained["us"] / target["us"])
    # The first pass reads `fc` (3 x 256 -> 256) and 3 more positions' KV than a chained step.
    kv = eagle3.kv_bytes_per_token(eagle3.head_config(name[:3], name[4:], toy=True))
    assert first["bytes"] - chained["bytes"] == 3 * 256 * 256 * 2 + 3 * kv
    r = got[("ratio", f"{name} B=1")]
    assert r["draft_step_vs_target"] == pytest.approx(chained["us"] / target["us"])
    assert r["k_drafts_vs_target"] == pytest.approx(3 * r["draft_step_vs_target"])
    assert r["drafting_vs_target"] == pytest.approx(
        (first["us"] + 2 * chained["us"]) / target["us"])
  # The MLA head's KV is a latent layer's (kv_lora + rope), the MHA head's K and V per head.
  assert eagle3.kv_bytes_per_token(eagle3.head_config("mla", "full", True)) == 2 * (64 + 32)
  assert eagle3.kv_bytes_per_token(eagle3.head_config("mha", "full", True)) == 2 * 2 * 4 * 32
  text = summarize.summary(str(tmp_path))
  assert "## eagle3: head programs" in text and "## eagle3: draft cost in target" in text


def test_eagle3_stage_past_its_deadline_writes_a_skip_row_per_program(tmp_path, monkeypatch):
  eagle3 = _eagle3_dry(monkeypatch)
  rec = rows.Recorder(str(tmp_path), "eagle3")
  stage = eagle3.Stage(rec, eagle3.Clock(0.0), 1, 16)
  stage.lm_head(1)
  stage.target(1)
  stage.head("mla", "full", 1)
  stage.ratios()
  got = [(r["impl"], r["case"]) for r in _rows(tmp_path)][1:]  # (after the weights row)
  assert got == [("lm_head", "V=512 B=1"), ("lm_head", "V=128 B=1"), ("target", "decode B=1"),
                 ("mla full", "chained B=1"), ("mla full", "first B=1 T=4")]
  assert all("deadline" in r["skipped"] for r in _rows(tmp_path)[1:])


def test_eagle3_stage_programs_lower_for_cuda_with_mosaic_attention(tmp_path, monkeypatch):
  # The stage's dry run lowers its GPU programs at the real shapes (QUICK: the MLA head's
  # chained step, full vocabulary, B = 8; the MHA head's and the target's lower in the dry run
  # through gpu_check.sh, and draft_chain's in tests/test_eagle3.py).
  eagle3 = _eagle3_dry(monkeypatch)
  monkeypatch.setenv("QUICK", "1")
  eagle3.export_rows(rows.Recorder(str(tmp_path), "eagle3"), 3)
  (r,) = _rows(tmp_path)
  assert r["case"] == "mla full chained B=8" and r.get("mosaic_calls", 0) >= 1, r
