"""`kernels="auto"`: the hot paths' implementations chosen once at load from the device kind and
the model (`engine.model.kernels.resolve`), per path, with the reason when a path stays on the
plain-JAX reference. On this CPU machine everything resolves to the reference; an abstract
Hopper device (a device-kind string: `resolve` is a pure function and compiles nothing) gets
the Mosaic GPU kernels where the model's shapes fit them."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import engine
from bench.expert_bytes import INT4, KIMI_K25_TEXT
from cuda_export import MOSAIC_CALL, export_cuda_calls
from engine.api import DEMO_CHECKPOINT
from engine.model import kernels
from engine.model.config import config_from_dict, load_config
from engine.model.kernels import AUTO, REFERENCE, KernelChoice
from engine.model.params import init_params
from engine.runtime.engine import Engine, EngineConfig
from model_configs import CONFIGS

H200 = dict(device_kind="NVIDIA H200", platform="gpu")
H100 = dict(device_kind="NVIDIA H100 80GB HBM3", platform="gpu")
K25 = config_from_dict(KIMI_K25_TEXT)


def _resolve(cfg, device, dtype=jnp.bfloat16, page_size=16, choice=AUTO):
  return kernels.resolve(choice, cfg, dtype=dtype, page_size=page_size, **device)


@pytest.mark.parametrize("experts", ["int4", "fp8", "bf16"])
def test_kimi_k25_on_hopper_gets_the_mosaic_kernels(experts):
  cfg = {"int4": dataclasses.replace(K25, int4=INT4),
         "fp8": dataclasses.replace(K25, fp8_experts=(128, 128)), "bf16": K25}[experts]
  for device in (H200, H100):
    res = _resolve(cfg, device)
    assert res.choice == KernelChoice(attention="mosaic_gpu", moe="mosaic_gpu"), res.line()
    assert res.reasons == () and res.line() == "kernels: attention=mosaic_gpu moe=mosaic_gpu"
  # (the MLA kernel takes K2.5's 512 + 64 at pages of 16, 32 and 64 tokens)
  for page_size in (32, 64):
    assert _resolve(cfg, H200, page_size=page_size).choice.attention == "mosaic_gpu"


def test_auto_resolves_int4_experts_through_the_w4a16_kernels_own_checks():
  # INT4 experts resolve by tracing `moe_mgpu.moe_experts`, which hands them to the W4A16 kernel
  # (`int4_mlp_mgpu` on `w4a16_mgpu`): its limits, not another kernel's, decide. K2.5's group
  # 32 and group 128 fit; a group of 8 (not a multiple of 16) is refused with its reason.
  for group in (32, 128):
    cfg = dataclasses.replace(K25, int4=dataclasses.replace(INT4, group_size=group))
    for device in (H200, H100):
      assert _resolve(cfg, device).choice.moe == "mosaic_gpu", (group, device)
  cfg = dataclasses.replace(K25, int4=dataclasses.replace(INT4, group_size=8))
  res = _resolve(cfg, H100)
  assert res.choice == KernelChoice(attention="mosaic_gpu", moe="reference")
  reason = dict(res.reasons)["moe"]
  assert "W4A16" in reason and "group 8" in reason, reason


def test_demo_model_experts_stay_on_the_reference_with_the_reason():
  demo = load_config(DEMO_CHECKPOINT)  # expert width 160: not whole 64-wide tiles
  res = _resolve(demo, H200)
  assert res.choice == KernelChoice(attention="mosaic_gpu", moe="reference")
  (path, reason), = res.reasons
  assert path == "moe" and "160" in reason and "64" in reason
  assert res.line() == f"kernels: attention=mosaic_gpu moe=reference (moe: {reason})"
  # Its MLA head dims (64 + 16) fit 16-token KV blocks but not 32-token ones.
  res = _resolve(demo, H200, page_size=32)
  assert res.choice == REFERENCE
  assert [p for p, _ in res.reasons] == ["attention", "moe"] and "Dk=80" in res.reasons[0][1]


def test_what_auto_keeps_on_the_reference_on_a_hopper_device():
  k25 = dataclasses.replace(K25, int4=INT4)
  f32 = _resolve(k25, H200, dtype=jnp.float32)  # WGMMA takes 16-bit operands
  assert f32.choice == REFERENCE and {p for p, _ in f32.reasons} == {"attention", "moe"}
  assert "float32" in dict(f32.reasons)["attention"]
  odd_page = _resolve(k25, H200, page_size=24)
  assert odd_page.choice.attention == "reference" and "24" in dict(odd_page.reasons)["attention"]
  gqa = config_from_dict(dict(CONFIGS["qwen3_moe"], head_dim=128, moe_intermediate_size=128))
  assert _resolve(gqa, H200).choice == KernelChoice(attention="mosaic_gpu", moe="mosaic_gpu")
  dense = config_from_dict(dict(CONFIGS["llama"], head_dim=128))
  res = _resolve(dense, H200)
  assert res.choice == KernelChoice(attention="mosaic_gpu", moe="reference")
  assert "no routed experts" in dict(res.reasons)["moe"]


def test_named_paths_are_kept_and_auto_never_reaches_the_model():
  k25 = dataclasses.replace(K25, int4=INT4)
  res = _resolve(k25, H200, choice=KernelChoice(attention="reference", moe="auto"))
  assert res.choice == KernelChoice(attention="reference", moe="mosaic_gpu")
  explicit = KernelChoice(attention="mosaic_gpu", moe="reference", expert_parallel="dispatch")
  assert _resolve(k25, dict(device_kind="cpu", platform="cpu"), choice=explicit).choice == explicit
  with pytest.raises(ValueError, match="auto.*resolved"):
    kernels.mla_attention(AUTO)


def test_not_hopper_means_the_reference_everywhere():
  k25 = dataclasses.replace(K25, int4=INT4)
  for device in (dict(device_kind="cpu", platform="cpu"),
                 dict(device_kind="NVIDIA B200", platform="gpu"),
                 dict(device_kind="NVIDIA A100-SXM4-80GB", platform="gpu")):
    res = _resolve(k25, device)
    assert res.choice == REFERENCE and device["device_kind"] in res.line()


def test_on_this_cpu_load_and_engine_resolve_to_the_reference_and_say_so(monkeypatch, capsys):
  monkeypatch.setattr(kernels, "_ANNOUNCED", set())
  model = engine.load(DEMO_CHECKPOINT, progress=False)
  assert model.kernels == AUTO and model.resolved_kernels() == REFERENCE
  line = f"kernels: attention=reference moe=reference (no Hopper GPU: {jax.devices()[0].device_kind})"
  assert capsys.readouterr().err.count(line) == 1  # said once, at load
  eng = Engine.from_model(model, EngineConfig(page_size=32, max_num_seqs=2,
                                              max_num_batched_tokens=32, max_model_len=128))
  assert eng.config.kernels == REFERENCE
  assert line not in capsys.readouterr().err  # the same result is not repeated
  cfg = config_from_dict(CONFIGS["deepseek_v3"])
  eng = Engine(cfg, init_params(cfg, dtype=jnp.bfloat16),
               EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                            kernels=KernelChoice(attention="auto", moe="reference")))
  assert eng.config.kernels == REFERENCE


def test_what_auto_picks_lowers_for_cuda():
  # resolve() traces the kernels' wrappers; the kernels it picks must also lower (Mosaic GPU
  # lowering runs here for an abstract H200): K2.5's MLA at 16-token pages (the serving
  # default: the split-KV decode kernel and its combine) and the demo model's at 16 (what auto
  # picks for it: its 64 + 16 head dims take the flash kernel).
  s = jax.ShapeDtypeStruct
  fn = kernels.mla_attention(KernelChoice(attention="mosaic_gpu"))
  for heads, dc, dr, launches in [(8, 512, 64, 2), (4, 64, 16, 1)]:
    calls = export_cuda_calls(
        lambda *a: fn(*a, softmax_scale=0.1), s((2, 1, heads, dc), jnp.bfloat16),
        s((2, 1, heads, dr), jnp.bfloat16), s((9, 16, dc + dr), jnp.bfloat16),
        s((2, 4), jnp.int32), s((2, 1), jnp.int32), s((2,), jnp.int32))
    assert calls.count(MOSAIC_CALL) == launches, calls
