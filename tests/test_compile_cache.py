"""The persistent compilation cache is on by default for notebooks and command lines."""

import json
import os
import subprocess
import sys

import pytest

from engine.runtime import compile_cache

# A notebook's session: load the demo model (or the checkpoint given), generate, report what
# was compiled.
NOTEBOOK = """
import json, sys, engine
from engine.runtime.buckets import CompileCounter
model = engine.load(*sys.argv[1:])
with CompileCounter() as c:
  out = engine.generate(model, "def f(x):", max_new_tokens=3)
print(json.dumps(dict(obtained=c.count, compiled=c.compiled, ids=out.token_ids)))
"""
# A tiny checkpoint, where the model does not matter (compiling it is quick).
TINY = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "dsv3_qlora_yarn")


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.default_dir() == str(tmp_path / "moejax" / "jax_cache")
  monkeypatch.setenv(compile_cache.ENV, "")
  assert compile_cache.default_dir() == ""  # off
  monkeypatch.setenv(compile_cache.ENV, "/somewhere")
  assert compile_cache.default_dir() == "/somewhere"


def _notebook(env, *args):
  """Runs NOTEBOOK in a fresh process: os.environ without the test run's own cache, plus env."""
  base = {k: v for k, v in os.environ.items() if k != compile_cache.ENV}
  r = subprocess.run([sys.executable, "-c", NOTEBOOK, *args], capture_output=True, text=True,
                     timeout=300, env={**base, **env})
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_new_notebook_kernel_loads_what_the_last_one_compiled(tmp_path):
  env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}  # the default: the user cache directory
  first = _notebook(env)
  cache = tmp_path / "xdg" / "moejax" / "jax_cache"
  assert first["compiled"] > 0 and any(cache.iterdir())
  second = _notebook(env)
  assert second["obtained"] > 0 and second["compiled"] == 0
  assert second["ids"] == first["ids"]
  # Turned off: nothing written anywhere.
  off = _notebook({compile_cache.ENV: "", "XDG_CACHE_HOME": str(tmp_path / "off")}, TINY)
  assert off["compiled"] > 0 and not (tmp_path / "off").exists()
