"""Run by test_engine.py in a fresh process: build an engine with a persistent compilation cache,
warm it up, serve one request, and print how many XLA compilations that took."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp  # noqa: E402

from engine.model.config import config_from_dict  # noqa: E402
from engine.model.params import init_params  # noqa: E402
from engine.runtime.buckets import CompileCounter  # noqa: E402
from engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from engine.runtime.request import StopParams  # noqa: E402
from model_configs import CONFIGS  # noqa: E402

cfg = config_from_dict(CONFIGS["llama"])
params = init_params(cfg, seed=3)
with CompileCounter() as counter:
  eng = Engine(cfg, params, EngineConfig(page_size=8, max_num_seqs=1, max_num_batched_tokens=16,
                                         row_widths=(16,), max_model_len=64,
                                         max_decode_steps=4, cache_dtype=jnp.float32,
                                         compilation_cache_dir=sys.argv[1]))
  programs = eng.warmup()
  out = eng.generate([[1, 5, 9, 12]], stop=StopParams(max_tokens=6))[0].output_ids
print(json.dumps(dict(programs=programs, obtained=counter.count, compiled=counter.compiled,
                      output=out)))
