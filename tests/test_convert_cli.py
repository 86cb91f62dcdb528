"""`python -m checkpoints.convert` end to end, in a subprocess."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.config import config_from_dict
from engine.model.orbax_io import is_orbax_checkpoint, restore_orbax
from engine.model.params import init_params, path_str
from tests import hf_fixtures as fx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _convert(*args):
  return subprocess.run([sys.executable, "-m", "checkpoints.convert", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf") / "dsv3"
  cfg = config_from_dict(fx.DEEPSEEK_V3)
  params = init_params(cfg, seed=7)
  fx.export_hf(fx.DEEPSEEK_V3, params, str(d), shards=2, dtype=fx.BF16)
  (d / "tokenizer.json").write_text("{}")
  return d, cfg, params


@pytest.mark.slow
def test_convert_end_to_end(hf_dir, tmp_path):
  src, cfg, params = hf_dir
  out = tmp_path / "out"
  r = _convert(f"--hf_dir={src}", f"--out={out}", "--dtype=bfloat16")
  assert r.returncode == 0, r.stderr
  summary = r.stdout.strip().splitlines()[-1]
  assert summary.startswith("converted ") and " params " in summary and "GB bfloat16" in summary
  assert is_orbax_checkpoint(str(out)) and not os.path.exists(str(out) + ".partial")
  assert (out / "tokenizer.json").exists()
  got = restore_orbax(str(out))
  flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}
  for p, want in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = path_str(p)
    # The bf16 export keeps routing tensors float32 (as transformers does): they stay exact.
    if not name.endswith(("router", "router_bias")):
      want = np.asarray(want.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(flat[name]), want, err_msg=name)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  assert f"{n_params:,} params" in summary


@pytest.mark.slow
def test_refuses_non_empty_out_then_overwrites(hf_dir, tmp_path):
  src, _, _ = hf_dir
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("precious")
  r = _convert(f"--hf_dir={src}", f"--out={out}")
  assert r.returncode != 0
  assert "not empty" in r.stderr and "--overwrite" in r.stderr
  assert (out / "keep.txt").read_text() == "precious"
  r = _convert(f"--hf_dir={src}", f"--out={out}", "--overwrite", "--dtype=float32")
  assert r.returncode == 0, r.stderr
  assert "GB float32" in r.stdout
  assert not (out / "keep.txt").exists() and is_orbax_checkpoint(str(out))


def test_bad_checkpoint_is_a_one_line_error(tmp_path):
  src = tmp_path / "bad"
  cfg = config_from_dict(fx.LLAMA)
  tensors = fx.hf_tensors(fx.LLAMA, init_params(cfg))
  del tensors["model.layers.1.mlp.down_proj.weight"]
  fx.write_checkpoint(fx.LLAMA, tensors, str(src))
  r = _convert(f"--hf_dir={src}", f"--out={tmp_path / 'out'}")
  assert r.returncode == 1
  assert "missing tensor 'model.layers.1.mlp.down_proj.weight'" in r.stderr
  assert "Traceback" not in r.stderr
  assert not (tmp_path / "out").exists()
