"""Shared set-up of the serving engine's speculative decoding tests: a small engine
configuration, the model, prompts, and the plain reference; the model drafters' state checked
against a one-shot forward."""

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import first_extra_entry, init_cache, mtp_entry
from engine.model.config import config_from_dict
from engine.model.kernels import REFERENCE
from engine.model.params import init_params
from engine.model.transformer import forward, forward_hidden_states, forward_mtp
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative.drafters import drafter_id
from engine.runtime.speculative.drafters.eagle3 import eagle3_observe
from model_configs import CONFIGS

SMALL = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=32, row_widths=(16,),
             max_model_len=96, max_decode_steps=8, cache_dtype=jnp.float32)
# Every drafter, adaptive: most tests' engines have this configuration, so their programs are
# compiled once per test module (an engine with the same configuration compiles nothing), at
# two decode batch sizes (a row alone runs padded to 2).
EVERY = dict(SMALL, drafters=("ngram", "learned", "mtp", "draft"), num_draft_tokens=3,
             adaptive_k=True, learned_table_slots=4096, measure_spec_costs=False,
             decode_batch_sizes=(2, 4))


def spec_model():
  """A small DeepSeek-V3 configuration with an MTP layer, and its parameters."""
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
  return cfg, init_params(cfg, seed=11, scale=2.0)


def every_drafter_engine(model, draft=None, step=None, **config):
  """An engine of the `EVERY` configuration; `draft`: the draft model's parameters (default:
  the target's own, so every greedy draft is right); `step(b, k)`: the cost table's T(B, k)
  (default: the roofline, where drafting is nearly free); `config`: more EngineConfig fields
  that change no program (`speculative`; or one that does, `adaptive_k`, for a test that
  runs none). The model drafters are priced per drafted column
  as in a deep model (`model_drafter_prices`)."""
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**{**EVERY, **config}),
               draft=(cfg, params if draft is None else draft))
  if step is not None:
    t = eng.spec.costs
    t.step = np.asarray([[step(b, k) for k in t.widths] for b in t.batch_sizes], np.float32)
  model_drafter_prices(eng)
  return eng


def model_drafter_prices(eng):
  """The draft model priced as one a tenth of the target's size, the MTP layer as one of 20
  decoder layers: the roofline prices them by this 2-layer target (a draft model as large,
  an MTP layer half of it), at which drafting with them never pays."""
  eng.spec.costs.drafter[:, drafter_id("draft")] = 0.1
  eng.spec.costs.drafter[:, drafter_id("mtp")] = 0.05


def fresh_prompts(n, seed=0, lo=6, hi=30):
  rng = random.Random(seed)
  return [[1] + [rng.randrange(3, 320) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def plain(model, ps, stop, sampling=SamplingParams()):
  """Each prompt's output (ids) by plain decoding (drafter "off") on a fresh engine of the
  `EVERY` configuration: greedy, or the seeded samples. `stop`, `sampling`: one or per
  prompt."""
  samp = [sampling] * len(ps) if isinstance(sampling, SamplingParams) else sampling
  if isinstance(stop, int):
    stop = StopParams(max_tokens=stop)
  eng = every_drafter_engine(model)
  got = eng.generate(ps, [dataclasses.replace(s, drafter="off") for s in samp], stop)
  assert all(r.spec is None for r in got)
  return [r.output_ids for r in got]


def assert_pool_full(e):
  e.pool.check_invariants()
  assert e.pool.num_free == e.pool.num_pages - 1
  assert not e.scheduler.running and not e.scheduler.waiting


@functools.partial(jax.jit, static_argnames="cfg")
def _target_and_mtp(params, cache, ids, next_ids, start, n_new, page_table, *, cfg):
  hidden, cache = forward(params, cache, ids, start, n_new, page_table, cfg=cfg)
  return forward_mtp(params, cache, hidden, next_ids, start, n_new, page_table, cfg=cfg)


def check_mtp_state(eng, req, model):
  """The engine's MTP cache entries (positions < num_computed) and the request's MTP hidden
  state equal a one-shot target + MTP forward over the request's tokens (`model`: (config,
  parameters); float32 caches)."""
  cfg, params = model
  page = eng.config.page_size
  ids, n = req.all_ids, req.num_computed
  assert n == len(ids) - 1
  pt = jnp.asarray([req.pages + [0] * (eng.max_pages_per_seq - len(req.pages))])
  cache = init_cache(cfg, eng.pool.num_pages, page, jnp.float32)
  width = eng.max_pages_per_seq * page  # (tokens padded past n: one compiled forward per test)
  out, cache = _target_and_mtp(params, cache, jnp.asarray([(ids[:n] + [0] * width)[:width]]),
                               jnp.asarray([(ids[1:] + [0] * width)[:width]]), jnp.asarray([0]),
                               jnp.asarray([n]), pt, cfg=cfg)
  pos = np.arange(n)
  idx = (np.asarray(pt)[0, pos // page], pos % page)
  mtp = mtp_entry(cfg, 0)  # (after the decoder stacks)
  np.testing.assert_allclose(np.asarray(eng.cache[mtp]["latent"])[idx],
                             np.asarray(cache[mtp]["latent"])[idx], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(req.spec.rows["mtp"], np.asarray(out[0, n - 1]), rtol=1e-4,
                             atol=1e-4)


def check_head_state(eng, req, target, hcfg, hparams):
  """The EAGLE-3 head's cache entries at positions < num_computed and the request's row state
  equal a one-shot target forward (aux states) and head first pass over the request's tokens
  (`target`: (config, parameters); float32 caches)."""
  tcfg, tparams = target
  page = eng.config.page_size
  ids, n = req.all_ids, req.num_computed
  assert n == len(ids) - 1
  width = eng.max_pages_per_seq * page
  pt = jnp.asarray([req.pages + [0] * (eng.max_pages_per_seq - len(req.pages))])
  entry = first_extra_entry(tcfg)
  cache = init_cache(tcfg, eng.pool.num_pages, page, jnp.float32,
                     extra=eng.runner.extra_entries)
  carry, pool = _one_shot(tparams, hparams, cache, jnp.asarray([(ids[:n] + [0] * width)[:width]]),
                          jnp.asarray([(ids[1:] + [0] * width)[:width]]), jnp.asarray([n]), pt,
                          tcfg=tcfg, hcfg=hcfg, entry=entry)
  pos = np.arange(n)
  idx = (np.asarray(pt)[0, pos // page], pos % page)
  for k, v in pool.items():
    np.testing.assert_allclose(np.asarray(eng.cache[entry][k])[idx], np.asarray(v)[idx],
                               rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(req.spec.rows["eagle3"], np.asarray(carry[0]), rtol=1e-4,
                             atol=1e-4)


@functools.partial(jax.jit, static_argnames=("tcfg", "hcfg", "entry"))
def _one_shot(tparams, hparams, cache, tokens, nxt, n, pt, *, tcfg, hcfg, entry):
  _, cache, states = forward_hidden_states(tparams, cache, tokens, jnp.zeros(1, jnp.int32), n,
                                           pt, layers=hcfg.aux_layers, cfg=tcfg)
  aux = jnp.concatenate(list(states), axis=-1)
  return eagle3_observe(hparams, cache[entry], aux, nxt, jnp.zeros(1, jnp.int32), n, pt,
                        cfg=hcfg, impl=REFERENCE)
