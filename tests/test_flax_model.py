"""The model as Flax NNX modules: their state is the parameter pytree, for every family and
expert format; a module built from an initialiser runs the same as the jitted forward on its
state; that state round-trips through Orbax and export_hf + the HF loader; jitted programs see
the modules only at trace time."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.model import modules, transformer
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import config_from_dict, load_config
from engine.model.hf_loader import load_hf_params
from engine.model.orbax_io import restore_orbax, save_orbax
from engine.model.params import abstract_params, check_params, path_str
from engine.model.transformer import Transformer, bind, forward, init_model, to_params
from pallas_kernels.quant import Fp8Weight, Int4Weight
from tests import hf_fixtures as fx
from engine.model.hf_export import export_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "golden", "fixtures")


def _configs():
  cfgs = {name: config_from_dict(d) for name, d in fx.CONFIGS.items()}
  cfgs["kimi_k25_int4"] = load_config(os.path.join(FIXTURES, "kimi_k25_int4"))
  cfgs["kimi_k25_vision"] = load_config(os.path.join(FIXTURES, "kimi_k25_vision"))
  # FP8 kept as stored (the loader's choice for an all-F8 checkpoint): experts and linears.
  cfgs["deepseek_v3_fp8"] = dataclasses.replace(cfgs["deepseek_v3"], fp8_experts=(128, 128),
                                                fp8_dense=True)
  cfgs["deepseek_v3_mtp"] = config_from_dict(dict(fx.DEEPSEEK_V3, num_nextn_predict_layers=1))
  return cfgs


CONFIGS = _configs()


def _flat(tree):
  return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_module_state_is_the_parameter_layout(name):
  """Every leaf the modules declare, by name, shape and dtype, is the layout's (params.py):
  stacks with their layer axis, kept INT4 / FP8 experts as their packed children, MTP, the
  vision tower."""
  cfg = CONFIGS[name]
  model = nnx.eval_shape(lambda: init_model(cfg))
  state = to_params(nnx.state(model))
  check_params(cfg, state)
  want = _flat(abstract_params(cfg, jnp.float32))
  got = _flat(state)
  assert got.keys() == want.keys()
  for k, w in want.items():
    assert (got[k].shape, got[k].dtype) == (w.shape, w.dtype), k
  experts = state["stacks"][-1].get("moe", {}).get("experts", {})
  if cfg.int4 is not None:
    assert isinstance(experts["gate"], Int4Weight)
  if name == "deepseek_v3_fp8":
    assert isinstance(experts["gate"], Fp8Weight)
    assert isinstance(state["stacks"][-1]["attn"]["kv_b"], Fp8Weight)
  assert isinstance(bind(cfg, state), Transformer)


_FORWARD = jax.jit(forward, static_argnames="cfg")


@nnx.jit(static_argnames="cfg")
def _call_module(model, cache, tokens, start, n_new, table, cfg):
  del cfg
  return model(cache, tokens, start, n_new, table, impl=transformer.REFERENCE,
               router_counts=False)[0]


def _step(cfg, params, model=None, t=5):
  page = 8
  cache = init_cache(cfg, num_pages=4, page_size=page, dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  args = (cache, tokens, jnp.zeros(2, jnp.int32), jnp.asarray([t, t - 2], jnp.int32),
          jnp.asarray(contiguous_page_table(2, 2 * page, page)))
  if model is None:
    return _FORWARD(params, *args, cfg=cfg)[0]
  return _call_module(model, *args, cfg=cfg)


@pytest.mark.parametrize("name", ["kimi_k25_int4"])  # MLA, dense + MoE stacks, INT4
def test_initialised_module_runs_as_the_jitted_forward(name):
  """A module built by its initialiser, called under `nnx.jit`, equals the functional forward
  on its state (the modules' own values: norms 1, N(0, 1/fan_in) matrices, random INT4
  codes)."""
  cfg = CONFIGS[name]
  model = init_model(cfg, seed=3)
  params = to_params(nnx.state(model))
  want = _step(cfg, params, model=model)
  got = _step(cfg, params)
  assert jnp.all(jnp.isfinite(want)) and float(jnp.std(want)) > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  # Another draw gives other outputs: the values come from the module's initialiser.
  other = _step(cfg, to_params(nnx.state(init_model(cfg, seed=4))))
  assert float(jnp.max(jnp.abs(other - got))) > 1e-2


def test_bind_holds_the_callers_arrays():
  """`bind` copies nothing: the merged module's leaves are the pytree's own arrays."""
  cfg = CONFIGS["deepseek_v3"]
  params = to_params(nnx.state(nnx.eval_shape(lambda: init_model(cfg))))
  again = to_params(nnx.state(bind(cfg, params)))
  a, b = _flat(again), _flat(params)
  assert a.keys() == b.keys() and all(a[k] is b[k] for k in b)


def test_module_state_round_trips_through_orbax_and_export_hf(tmp_path):
  """The module's state saved with Orbax and written as a Hugging Face checkpoint loads back
  bit for bit (the loaders fill the same tree the modules declare)."""
  cfg_dict = fx.DEEPSEEK_V3
  cfg = config_from_dict(cfg_dict)
  params = jax.tree.map(np.asarray, to_params(nnx.state(init_model(cfg, seed=5))))
  save_orbax(str(tmp_path / "orbax"), cfg_dict, params)
  export_hf(cfg_dict, params, str(tmp_path / "hf"), dtype=np.float32)
  for got in (restore_orbax(str(tmp_path / "orbax"), cfg),
              load_hf_params(str(tmp_path / "hf"), cfg, dtype=jnp.float32, progress=False)):
    g, w = _flat(got), _flat(params)
    assert g.keys() == w.keys()
    for k in w:
      assert np.asarray(g[k]).tobytes() == np.asarray(w[k]).tobytes(), k


def test_layer_modules_take_one_layers_parameters():
  """The per-layer entry points (tests and tools) merge the same modules the forward runs."""
  cfg = CONFIGS["deepseek_v3"]
  params = to_params(nnx.state(nnx.eval_shape(lambda: init_model(cfg))))
  first = functools.partial(jax.eval_shape, lambda s: jax.tree.map(lambda w: w[0], s))
  layer = modules.layer_module(cfg, 1, first(params["stacks"][1]))
  assert isinstance(layer.moe, modules.MoE) and isinstance(layer.attn, modules.MLAAttention)
  dense = modules.layer_module(cfg, 0, first(params["stacks"][0]))
  assert isinstance(dense.mlp, modules.MLP) and not hasattr(dense, "moe")
