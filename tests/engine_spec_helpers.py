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


def check_mtp_state(eng, req, model, since=0):
  """The engine's MTP cache entries (positions since .. num_computed - 1) and, since 0, the
  request's MTP hidden state equal a one-shot target + MTP forward over the request's tokens
  (`model`: (config, parameters); float32 caches)."""
  check_drafter_states(eng, req, model, mtp=True, since=since)


def check_head_state(eng, req, target, hcfg, hparams, since=0):
  """The EAGLE-3 head's cache entries at positions since .. num_computed - 1 (and, since 0,
  the request's row state) equal a one-shot target forward (aux states) and head first pass
  over the request's tokens (`target`: (config, parameters); float32 caches)."""
  check_drafter_states(eng, req, target, head=(hcfg, hparams), since=since)


def check_drafter_states(eng, req, target, mtp=False, head=None, since=0):
  """The model drafters' cache entries (positions since .. num_computed - 1) and the request's
  row states (`since` 0 only: they attend to every entry) equal one compiled one-shot pass over
  the request's tokens: the target's forward, then the MTP layer's (`mtp`) and the EAGLE-3
  head's first pass (`head`: (config, parameters)) over its hidden states (`target`: (config,
  parameters); float32 caches)."""
  tcfg, tparams = target
  hcfg, hparams = head if head is not None else (None, None)
  page = eng.config.page_size
  ids, n = req.all_ids, req.num_computed
  assert n == len(ids) - 1
  width = eng.max_pages_per_seq * page  # (tokens padded past n: one compiled pass per test)
  pt = jnp.asarray([req.pages + [0] * (eng.max_pages_per_seq - len(req.pages))])
  cache = init_cache(tcfg, eng.pool.num_pages, page, jnp.float32,
                     extra=eng.runner.extra_entries if head is not None else ())
  mtp_out, head_out, cache = _one_shot(
      tparams, hparams, cache, jnp.asarray([(ids[:n] + [0] * width)[:width]]),
      jnp.asarray([(ids[1:] + [0] * width)[:width]]), jnp.asarray([n]), pt, tcfg=tcfg,
      hcfg=hcfg, mtp=mtp)
  pos = np.arange(since, n)
  idx = (np.asarray(pt)[0, pos // page], pos % page)

  def same_entries(entry):
    for k, v in cache[entry].items():
      np.testing.assert_allclose(np.asarray(eng.cache[entry][k])[idx], np.asarray(v)[idx],
                                 rtol=1e-4, atol=1e-4)
  if mtp:
    same_entries(mtp_entry(tcfg, 0))  # (after the decoder stacks)
    if not since:
      np.testing.assert_allclose(req.spec.rows["mtp"], np.asarray(mtp_out[0, n - 1]),
                                 rtol=1e-4, atol=1e-4)
  if head is not None:
    same_entries(first_extra_entry(tcfg))
    if not since:
      np.testing.assert_allclose(req.spec.rows["eagle3"], np.asarray(head_out[0]), rtol=1e-4,
                                 atol=1e-4)


@functools.partial(jax.jit, static_argnames=("tcfg", "hcfg", "mtp"))
def _one_shot(tparams, hparams, cache, tokens, nxt, n, pt, *, tcfg, hcfg, mtp):
  """The target's forward over tokens[:, :n], then the MTP layer's pass (`mtp`) and the
  EAGLE-3 head's first pass (`hcfg`): (MTP hidden states or None, head row state or None,
  cache)."""
  zero = jnp.zeros(1, jnp.int32)
  mtp_out = head_out = None
  if hcfg is None:
    hidden, cache = forward(tparams, cache, tokens, zero, n, pt, cfg=tcfg)
  else:
    hidden, cache, states = forward_hidden_states(tparams, cache, tokens, zero, n, pt,
                                                  layers=hcfg.aux_layers, cfg=tcfg)
    entry = first_extra_entry(tcfg)
    head_out, pool = eagle3_observe(hparams, cache[entry], jnp.concatenate(list(states), -1),
                                    nxt, zero, n, pt, cfg=hcfg, impl=REFERENCE)
    cache = cache[:entry] + [pool] + cache[entry + 1:]
  if mtp:
    mtp_out, cache = forward_mtp(tparams, cache, hidden, nxt, zero, n, pt, cfg=tcfg)
  return mtp_out, head_out, cache
