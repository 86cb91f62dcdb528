"""Warm-up compiles its programs ahead on threads (`warmup.compile_ahead`), then runs them: the
run finds every program it calls compiled already, and serving compiles nothing."""

import jax.numpy as jnp
import pytest

from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.runtime import warmup
from engine.runtime.buckets import CompileCounter
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from model_configs import CONFIGS

CONFIG = dict(page_size=8, max_num_seqs=1, max_num_batched_tokens=16, row_widths=(16,),
              max_model_len=64, max_decode_steps=4, cache_dtype=jnp.float32,
              constrained_warmup=True)


@pytest.mark.slow
def test_the_programs_compiled_ahead_are_the_ones_warmup_runs():
  cfg = config_from_dict(CONFIGS["llama"])
  eng = Engine(cfg, init_params(cfg, seed=5), EngineConfig(**CONFIG))
  shapes = warmup.warmup_shapes(eng)
  assert {kind for kind, _, _ in shapes} == {"step", "decode", "masked"}
  seen = []
  with CompileCounter() as ahead_count, eng._lock:
    ahead = warmup.compile_ahead(eng, shapes, 2, lambda *a: seen.append(a),
                                 [str(s) for s in shapes])
  assert ahead == set(range(len(shapes)))
  assert [done for done, _, _ in seen] == list(range(1, len(shapes) + 1))
  assert sorted(what for _, _, what in seen) == sorted(str(s) for s in shapes)
  assert ahead_count.count == len(shapes)  # one program a shape
  with CompileCounter() as run_count:  # the run: every program found compiled
    assert eng.warmup(progress=False) == len(shapes)
  assert run_count.count == 0
  # Serving from them compiles nothing either.
  with CompileCounter() as serve_count:
    eng.generate([[1, 5, 9, 12]], SamplingParams(temperature=0.8, seed=3),
                 StopParams(max_tokens=6))
  assert serve_count.count == 0


def test_one_worker_compiles_nothing_ahead(monkeypatch):
  monkeypatch.setenv("MOEJAX_COMPILE_WORKERS", "1")
  assert warmup.compile_workers() == 1
  cfg = config_from_dict(CONFIGS["llama"])
  eng = Engine(cfg, init_params(cfg, seed=5), EngineConfig(**CONFIG))
  assert warmup.compile_ahead(eng, warmup.warmup_shapes(eng), 1, None, []) == set()


@pytest.mark.slow
def test_a_vision_model_compiles_its_image_steps_ahead_too():
  """A mixed shape of a model with a vision tower is two programs, the text step and the one
  whose rows take image features, each donating the cache the run made the next one's with."""
  import os

  import engine
  path = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "kimi_k25_vision")
  eng = Engine.from_model(engine.load(path), EngineConfig(max_num_seqs=1,
                                                          max_num_batched_tokens=16,
                                                          max_model_len=64))
  shapes = warmup.warmup_shapes(eng)
  with eng._lock:
    assert sum(ahead for _, ahead in warmup.shape_steps(eng, *shapes[0])) == 2
    ahead = warmup.compile_ahead(eng, shapes, 2, None, [""] * len(shapes))
  assert ahead == set(range(len(shapes)))
  with CompileCounter() as run_count:
    eng.warmup(progress=False)
  assert run_count.count == 0
