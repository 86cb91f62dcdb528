"""The serving engine's programs lower for NVIDIA GPUs, checked on this CPU machine.

A GPU session has minutes: a program that fails to lower there (a CPU-only construct, a Mosaic
kernel that does not compose with the speculative loop's `while_loop` / `switch` / `run_if`
nesting, a block width a kernel cannot tile) would spend them. So the engine serves a few
requests on the CPU with every drafter enabled, the arguments of each program it runs are
captured, and each program is exported for "cuda" (`jax.export`, under an abstract H200 mesh):
with the plain-JAX kernels (what the GPU benchmarks run on the demo model, whose head dims the
Mosaic kernels do not take) and with the Mosaic GPU attention and MoE kernels on a
configuration they take (hidden and expert width multiples of 64; MLA latent 128 + rope 64 with
32-token pages, which every program's query block up to 512 rows sends to the split-KV decode
kernel and its combine inside the loops; bf16). The flash kernel (prefill chunks, latent 32 +
rope 32) is lowered per layer below.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from cuda_export import H200, MOSAIC_CALL, export_cuda_calls
from engine.model.config import config_from_dict
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.kernels import REFERENCE, KernelChoice
from engine.model.params import abstract_params, init_params
from engine.model.transformer import forward
from engine.runtime import steps
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import loop
from engine.runtime.speculative.drafters import drafter_id
from engine.runtime.speculative.drafters.draft_model import draft_forward
from engine.runtime.step_description import DECODE
from model_configs import CONFIGS

MOSAIC = KernelChoice(attention="mosaic_gpu", moe="mosaic_gpu")

# The programs the engine's runner runs, by name. The engine serves requests on the CPU to
# reach each with real arguments (the runner's `program` of each step description), up to
# the speculative loop's call. (Its plain calls run decode_loop inside decode_loop_learning.)
PROGRAMS = {
    "speculative_decode_loop": loop.speculative_decode_loop,
    "decode_loop": steps.decode_loop,
    "decode_loop_learning": loop.decode_loop_learning,
    "model_step_observing": steps.model_step,  # (with the MTP layer observing prefill)
    "draft_forward": draft_forward,
}
NAMES = {fn: name for name, fn in PROGRAMS.items()}


class _Captured(Exception):
  """Raised by the speculative loop's recorder, so the CPU never compiles that program."""


@pytest.fixture(scope="module")
def captured():
  """program name -> (args, kwargs) of its first call while the engine served requests, as
  shapes and dtypes."""
  # Two layers, dense then MoE (the CPU compiles what it runs). The draft model has two as
  # well: `draft_forward` returns only the cache, so a last layer's attention is dead code.
  base = dict(CONFIGS["deepseek_v3"], moe_intermediate_size=64, kv_lora_rank=128,
              qk_rope_head_dim=64, num_hidden_layers=2)
  cfg = config_from_dict(dict(base, num_nextn_predict_layers=1))
  draft_cfg = config_from_dict(base)
  params = init_params(cfg, seed=3, dtype=jnp.bfloat16)
  calls = {}

  def shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                        if hasattr(x, "dtype") else x, tree)

  eng = Engine(cfg, params, EngineConfig(
      page_size=32, max_num_seqs=2, max_num_batched_tokens=32, row_widths=(16,),
      max_model_len=128, max_decode_steps=8, speculative="auto",
      drafters=("ngram", "learned", "mtp", "draft"), num_draft_tokens=2, adaptive_k=True),
      draft=(draft_cfg, init_params(draft_cfg, seed=4, dtype=jnp.bfloat16)))
  # (priced as a draft model a tenth of the target's size: one as large never pays)
  eng.spec.costs.drafter[:, drafter_id("draft")] = 0.1
  real = eng.runner.execute

  def recorder(desc):
    p = eng.runner.program(desc)
    name = NAMES[p.fn]
    calls.setdefault(name, shapes((p.args, p.kwargs)))
    if desc.kind == DECODE:  # (the plain loop inside it)
      kwargs = {k: v for k, v in p.kwargs.items() if k != "learners"}
      calls.setdefault("decode_loop", shapes((p.args[:3], kwargs)))
    if name == "speculative_decode_loop":  # the last program needed: not compiled here
      raise _Captured
    return real(desc)
  eng.runner.execute = recorder
  prompts = [[1] + list(range(5, 30)), [1] + list(range(7, 19))]
  eng.generate(prompts, SamplingParams(drafter="off"), StopParams(max_tokens=6, ignore_eos=True))
  with pytest.raises(_Captured):  # (catch-up first: draft_forward)
    eng.generate(prompts, SamplingParams(drafter="draft"),
                 StopParams(max_tokens=6, ignore_eos=True))
  assert set(calls) == set(PROGRAMS), f"programs not run: {set(PROGRAMS) - set(calls)}"
  return calls


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["reference", "mosaic_gpu"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_engine_program_lowers_for_cuda(captured, name, kernels):
  args, kwargs = captured[name]
  impl = REFERENCE if kernels == "reference" else MOSAIC
  if name == "speculative_decode_loop":  # (the kernels are part of the loop's configuration)
    kwargs = dict(kwargs, config=dataclasses.replace(kwargs["config"], impl=impl))
  else:
    kwargs = dict(kwargs, impl=impl)
  calls = export_cuda_calls(PROGRAMS[name], *args, **kwargs)
  targets, mosaic = set(calls), calls.count(MOSAIC_CALL)
  if kernels == "reference":
    assert mosaic == 0
  else:
    assert mosaic >= 1, "no Mosaic GPU kernel in the lowered program"
    if name == "speculative_decode_loop":  # a verify forward per compiled width, and drafters
      widths = kwargs["config"].widths
      assert len(widths) > 1 and mosaic > 2 * len(widths), mosaic
  # Nothing that exists only on the host (callbacks, LAPACK) in a program the GPU runs.
  assert not {t for t in targets if "callback" in t or t.startswith("lapack")}, targets


def _forward_for_cuda(layers: int, latent: int = 32, rope: int = 32,
                      scan_layers: bool = True) -> tuple[str, int]:
  """(the exported module's text, its Mosaic GPU calls) of a decode forward with the Mosaic
  kernels: a dense layer, then MoE layers of 8 experts [8, 64, 64]; 2 x 2 pages of 32 tokens."""
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], moe_intermediate_size=64,
                              kv_lora_rank=latent, qk_rope_head_dim=rope,
                              num_hidden_layers=layers))
  b, page = 2, 32
  table = contiguous_page_table(b, 64, page)
  cache = jax.eval_shape(lambda: init_cache(cfg, table.size, page, jnp.bfloat16))

  def step(params, cache, tokens, start, n_new, table):
    return forward(params, cache, tokens, start, n_new, table, cfg=cfg, impl=MOSAIC,
                   scan_layers=scan_layers)

  row = jax.ShapeDtypeStruct((b,), jnp.int32)
  with jax.sharding.use_abstract_mesh(H200):
    exported = jax.export.export(
        jax.jit(step), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(MOSAIC_CALL)])(
            abstract_params(cfg, jnp.bfloat16), cache, jax.ShapeDtypeStruct((b, 1), jnp.int32),
            row, row, jax.ShapeDtypeStruct(table.shape, jnp.int32))
  text = exported.mlir_module()
  return text, len(re.findall(rf"stablehlo.custom_call @{MOSAIC_CALL}\b", text))


@pytest.mark.parametrize("latent,rope", [(32, 32), pytest.param(128, 64, marks=pytest.mark.slow)])  # flash; decode + combine
def test_mosaic_kernels_lower_once_per_shape_not_per_layer(latent, rope):
  """Layers whose kernel calls are identical share one lowered kernel (`kernels.py`): each
  layer lowering (and compiling) its own took a 27-layer decode step ~95 s to compile on an
  H200. Dense layer then MoE layers: the MLA kernel(s) over each stack's pool (the dense
  layer's, the MoE layers'), and the MoE experts' kernels; unrolled or scanned, however many
  layers. Scanned, the kernels read the stacked experts and pages in place: no layer's experts
  or pages are sliced out of a stack for them ([8, 64, 64] / [1, 8, 64, 64], [4, 32, D])."""
  text, three = _forward_for_cuda(3, latent, rope)
  assert three >= 3 and _forward_for_cuda(5, latent, rope)[1] == three, three
  assert _forward_for_cuda(5, latent, rope, False)[1] == three
  d = latent + rope
  sliced = re.findall(r"stablehlo.dynamic_slice .*-> tensor<([\dx]+)xbf16>", text)
  assert not {"8x64x64", "1x8x64x64", f"4x32x{d}", f"1x4x32x{d}"} & set(sliced), sliced
