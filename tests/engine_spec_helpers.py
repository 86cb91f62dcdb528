"""Shared set-up of the serving engine's speculative decoding tests: a small engine
configuration, the model, prompts, and the plain greedy reference."""

import random

import jax.numpy as jnp

from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.runtime.generate import generate_tokens
from engine.runtime.sampling import SamplingParams
from model_configs import CONFIGS

SMALL = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=32, row_widths=(16,),
             max_model_len=96, max_decode_steps=8, cache_dtype=jnp.float32)


def spec_model():
  """A small DeepSeek-V3 configuration with an MTP layer, and its parameters."""
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
  return cfg, init_params(cfg, seed=11, scale=2.0)


def fresh_prompts(n, seed=0, lo=6, hi=30):
  rng = random.Random(seed)
  return [[1] + [rng.randrange(3, 320) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def plain(model, ps, n, sampling=SamplingParams()):
  """Non-speculative greedy (or seeded sampled) output of `ps`, n tokens each."""
  cfg, params = model
  return [c.token_ids for c in generate_tokens(params, cfg, ps, max_new_tokens=n,
                                               sampling=sampling)]


def assert_pool_full(e):
  e.pool.check_invariants()
  assert e.pool.num_free == e.pool.num_pages - 1
  assert not e.scheduler.running and not e.scheduler.waiting
