"""The moejax Orbax checkpoint format: bit-exact round trips, shardings, layout checks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.config import config_from_dict
from engine.model.hf_loader import CheckpointError
from engine.model.orbax_io import (MANIFEST, is_hf_checkpoint, is_orbax_checkpoint,
                                   restore_orbax, save_orbax)
from engine.model.params import init_params, layer_params, path_str, unstack_layers
from tests import hf_fixtures as fx


def _flat(tree):
  return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_bit_exact(got, want):
  g, w = _flat(got), _flat(want)
  assert g.keys() == w.keys()
  for k in w:
    assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, k
    assert g[k].tobytes() == w[k].tobytes(), k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_bit_exact(tmp_path, dtype):
  cfg_dict = fx.DEEPSEEK_V3
  cfg = config_from_dict(cfg_dict)
  params = init_params(cfg, seed=1, dtype=dtype)
  out = str(tmp_path / "ckpt")
  save_orbax(out, cfg_dict, params)
  assert is_orbax_checkpoint(out) and not is_hf_checkpoint(out)
  manifest = json.load(open(os.path.join(out, MANIFEST)))
  assert manifest == {"format": "moejax-orbax", "version": 2,
                      "dtype": np.dtype(dtype).name}
  assert json.load(open(os.path.join(out, "config.json"))) == cfg_dict
  got = restore_orbax(out, cfg)
  _assert_bit_exact(got, params)
  assert len(got["stacks"]) == len(cfg.layer_stacks)  # stored stacked, as the model runs
  assert layer_params(cfg, got, 1)["moe"]["router"].dtype == jnp.float32
  # cfg defaults to the checkpoint's own config.json.
  _assert_bit_exact(restore_orbax(out), params)


def test_restore_with_shardings_and_dtype(tmp_path):
  cfg = config_from_dict(fx.QWEN3_MOE)
  params = init_params(cfg, seed=2)
  out = str(tmp_path / "ckpt")
  save_orbax(out, fx.QWEN3_MOE, params)
  dev = jax.devices()[-1]
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), params)
  got = restore_orbax(out, cfg, shardings=shardings)
  _assert_bit_exact(got, params)
  assert all(x.sharding == jax.sharding.SingleDeviceSharding(dev) for x in jax.tree.leaves(got))
  cast = restore_orbax(out, cfg, dtype=jnp.bfloat16)
  assert cast["embed"].dtype == jnp.bfloat16
  assert layer_params(cfg, cast, 1)["moe"]["router"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(cast["embed"]),
                                np.asarray(params["embed"].astype(jnp.bfloat16)))


def test_tokenizer_files_copied_from_src_dir(tmp_path):
  src = tmp_path / "hf"
  cfg = config_from_dict(fx.QWEN3)
  fx.export_hf(fx.QWEN3, init_params(cfg), str(src))
  (src / "tokenizer.json").write_text('{"model": {}}')
  (src / "generation_config.json").write_text('{"eos_token_id": 2}')
  (src / "modeling_evil.py").write_text("raise SystemExit")
  assert is_hf_checkpoint(str(src)) and not is_orbax_checkpoint(str(src))
  out = tmp_path / "out"
  save_orbax(str(out), str(src), init_params(cfg))
  assert (out / "tokenizer.json").read_text() == '{"model": {}}'
  assert (out / "generation_config.json").exists()
  assert not (out / "modeling_evil.py").exists()
  assert not (out / "tokenizer_config.json").exists()


def test_refuses_non_empty_out_unless_overwrite(tmp_path):
  cfg = config_from_dict(fx.LLAMA)
  params = init_params(cfg)
  out = tmp_path / "out"
  out.mkdir()  # an empty directory is fine
  save_orbax(str(out), fx.LLAMA, params)
  with pytest.raises(FileExistsError, match="not empty"):
    save_orbax(str(out), fx.LLAMA, params)
  params2 = init_params(cfg, seed=5)
  save_orbax(str(out), fx.LLAMA, params2, overwrite=True)
  _assert_bit_exact(restore_orbax(str(out)), params2)


def test_save_rejects_params_not_matching_config(tmp_path):
  cfg = config_from_dict(fx.LLAMA)
  params = init_params(cfg)
  del params["stacks"][0]["attn"]["o_bias"]
  with pytest.raises(CheckpointError, match=r"stacks\.0\.attn\.o_bias"):
    save_orbax(str(tmp_path / "out"), fx.LLAMA, params)


def test_restore_mismatched_config_is_clear_error(tmp_path):
  cfg = config_from_dict(fx.LLAMA)
  out = str(tmp_path / "ckpt")
  save_orbax(out, fx.LLAMA, init_params(cfg))
  wider = config_from_dict(dict(fx.LLAMA, intermediate_size=128))
  with pytest.raises(CheckpointError,
                     match=r"parameter 'stacks\.0\.mlp\.gate' has shape \(2, 64, 96\), "
                           r"expected \(2, 64, 128\)"):
    restore_orbax(out, wider)
  deeper = config_from_dict(dict(fx.LLAMA, num_hidden_layers=3))
  with pytest.raises(CheckpointError,
                     match=r"parameter 'stacks\.0\.attn\.k' has shape \(2, 64, 2, 16\), "
                           r"expected \(3, 64, 2, 16\)"):
    restore_orbax(out, deeper)
  no_bias = config_from_dict(dict(fx.LLAMA, attention_bias=False))
  with pytest.raises(CheckpointError, match=r"unexpected parameter 'stacks\.0\.attn\.k_bias'"):
    restore_orbax(out, no_bias)


def test_version_1_per_layer_checkpoint_restores_stacked(tmp_path):
  """Checkpoints written before the layers were stacked (the committed demo models) store
  layer by layer: restored, bit-exact, into the stacked layout, placed as asked."""
  import orbax.checkpoint as ocp
  cfg = config_from_dict(fx.DEEPSEEK_V3)  # a dense layer, then a run of MoE layers
  params = init_params(cfg, seed=4)
  out = tmp_path / "v1"
  save_orbax(str(out), fx.DEEPSEEK_V3, params)
  (out / "params").rename(tmp_path / "v2params")
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(str(out / "params"), unstack_layers(params))
    ckptr.wait_until_finished()
  (out / MANIFEST).write_text(json.dumps({"format": "moejax-orbax", "version": 1,
                                          "dtype": "float32"}))
  dev = jax.devices()[-1]
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), params)
  got = restore_orbax(str(out), cfg, shardings=shardings)
  _assert_bit_exact(got, params)
  assert all(x.sharding == jax.sharding.SingleDeviceSharding(dev) for x in jax.tree.leaves(got))
  from engine.model import hf_loader  # large stacks: built in place on the device
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(hf_loader, "HOST_STACK_MAX_BYTES", 0)
    _assert_bit_exact(restore_orbax(str(out), cfg), params)
  deeper = config_from_dict(dict(fx.DEEPSEEK_V3, num_hidden_layers=4))
  with pytest.raises(CheckpointError, match=r"missing parameter 'layers\.3\.attn\.kv_a'"):
    restore_orbax(str(out), deeper)


def test_detection_and_bad_manifest(tmp_path):
  assert not is_orbax_checkpoint(str(tmp_path)) and not is_hf_checkpoint(str(tmp_path))
  pt = tmp_path / "pt"
  pt.mkdir()
  (pt / "config.json").write_text(json.dumps(fx.LLAMA))
  assert not is_hf_checkpoint(str(pt))  # a config alone is not a checkpoint
  (pt / "pytorch_model.bin").write_bytes(b"")  # loadable: no, but load_hf_params says why
  assert is_hf_checkpoint(str(pt))
  cfg = config_from_dict(fx.LLAMA)
  out = tmp_path / "ckpt"
  save_orbax(str(out), fx.LLAMA, init_params(cfg))
  (out / MANIFEST).write_text(json.dumps({"format": "moejax-orbax", "version": 99}))
  assert not is_orbax_checkpoint(str(out))
  with pytest.raises(CheckpointError, match="version 99.*versions 1, 2"):
    restore_orbax(str(out), cfg)
  (out / MANIFEST).unlink()  # an interrupted save is not a checkpoint
  assert not is_orbax_checkpoint(str(out))
  with pytest.raises(CheckpointError, match="not a moejax checkpoint"):
    restore_orbax(str(out), cfg)
