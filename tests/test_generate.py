"""The jitted generation loop: batching, stopping rules, sampling reproducibility."""

import jax
import jax.numpy as jnp
import pytest

from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.runtime import generate as gen
from engine.runtime.generate import generate_tokens
from engine.runtime.sampling import SamplingParams
from model_configs import CONFIGS


@pytest.fixture(scope="module")
def model():
  cfg = config_from_dict(CONFIGS["deepseek_v3"])
  return cfg, init_params(cfg, seed=11, scale=2.0)


PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16], [1, 40]]


@pytest.mark.slow
def test_batch_of_mixed_lengths_equals_single_runs(model):
  cfg, params = model
  batch = generate_tokens(params, cfg, PROMPTS, max_new_tokens=[6, 12, 9])
  for p, n, got in zip(PROMPTS, [6, 12, 9], batch):
    alone = generate_tokens(params, cfg, [p], max_new_tokens=n)[0]
    assert got.token_ids == alone.token_ids
    assert len(got.token_ids) == n and got.finish_reason == "length"
  assert len({tuple(c.token_ids) for c in batch}) == 3  # not degenerate


def test_eos_and_stop_ids_stop_only_their_row(model):
  cfg, params = model
  free = generate_tokens(params, cfg, PROMPTS[:2], max_new_tokens=10)
  eos = free[0].token_ids[3]
  first = free[0].token_ids.index(eos)
  out = generate_tokens(params, cfg, PROMPTS[:2], max_new_tokens=10, eos_ids=[eos])
  assert out[0].token_ids == free[0].token_ids[:first + 1]  # EOS included, nothing after
  assert out[0].finish_reason == "stop"
  other = free[1].token_ids
  expect = other[:other.index(eos) + 1] if eos in other else other
  assert out[1].token_ids == expect
  # Per-row stop ids, ignore_eos and min_new_tokens.
  stop = free[1].token_ids[2]
  out = generate_tokens(params, cfg, PROMPTS[:2], max_new_tokens=10, eos_ids=[eos],
                        stop_token_ids=[[], [stop]], ignore_eos=True)
  assert out[0].token_ids == free[0].token_ids and out[0].finish_reason == "length"
  assert out[1].token_ids == other[:other.index(stop) + 1] and out[1].finish_reason == "stop"
  out = generate_tokens(params, cfg, PROMPTS[:1], max_new_tokens=10, eos_ids=[eos],
                        min_new_tokens=first + 2)
  assert len(out[0].token_ids) > first + 1


def test_one_new_token_skips_decode_and_matches_longer_runs(model):
  """max_new_tokens == 1 (time to first token) samples from the prefill logits without the
  decode program: same token, stop reasons and sampling as the first token of a longer run."""
  cfg, params = model
  s = [SamplingParams(), SamplingParams(temperature=0.9, seed=7), SamplingParams()]
  longer = generate_tokens(params, cfg, PROMPTS, max_new_tokens=4, sampling=s)
  one = generate_tokens(params, cfg, PROMPTS, max_new_tokens=1, sampling=s)
  assert [c.token_ids for c in one] == [c.token_ids[:1] for c in longer]
  assert [c.finish_reason for c in one] == ["length"] * 3
  eos = longer[0].token_ids[0]
  one = generate_tokens(params, cfg, PROMPTS, max_new_tokens=1, sampling=s, eos_ids=[eos])
  assert one[0].finish_reason == "stop" and one[0].token_ids == [eos]
  one = generate_tokens(params, cfg, PROMPTS[:1], max_new_tokens=1, eos_ids=[eos],
                        min_new_tokens=2)
  assert one[0].finish_reason == "length"
  before = gen.decode._cache_size()
  generate_tokens(params, cfg, [[3] * 40], max_new_tokens=1)
  assert gen.decode._cache_size() == before  # no decode program for one token


def test_seeded_sampling_reproduces_and_ignores_batch_company(model):
  cfg, params = model
  s = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
  a = generate_tokens(params, cfg, [PROMPTS[1]], max_new_tokens=12, sampling=s)[0]
  b = generate_tokens(params, cfg, [PROMPTS[0], PROMPTS[1]], max_new_tokens=12,
                      sampling=[SamplingParams(temperature=1.0, seed=9), s])[1]
  assert a.token_ids == b.token_ids
  c = generate_tokens(params, cfg, [PROMPTS[1]], max_new_tokens=12,
                      sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=99))[0]
  assert c.token_ids != a.token_ids
  k1 = generate_tokens(params, cfg, [PROMPTS[1]], max_new_tokens=12,
                       sampling=SamplingParams(temperature=1.0, top_k=1, seed=5))[0]
  greedy = generate_tokens(params, cfg, [PROMPTS[1]], max_new_tokens=12)[0]
  assert k1.token_ids == greedy.token_ids


def test_compiles_once_per_bucket(model):
  cfg, params = model
  generate_tokens(params, cfg, [[1, 2, 3]], max_new_tokens=5)
  n_pre, n_dec = gen.prefill._cache_size(), gen.decode._cache_size()
  generate_tokens(params, cfg, [[1, 4, 5, 6, 7]], max_new_tokens=7)  # same buckets
  assert (gen.prefill._cache_size(), gen.decode._cache_size()) == (n_pre, n_dec)


def test_decode_is_one_while_loop(model):
  cfg, params = model
  from engine.model.cache import contiguous_page_table, init_cache
  from engine.runtime.sampling import SamplingArrays
  pt = jnp.asarray(contiguous_page_table(1, 32, 16))
  cache = init_cache(cfg, pt.size, 16, jnp.float32)
  stops = gen.StopCriteria(jnp.asarray([4]), jnp.asarray([[-1]]), jnp.asarray([0]))
  args = (params, cache, jnp.zeros((1, cfg.vocab_size)), jnp.asarray([3]), pt,
          SamplingArrays.from_params([SamplingParams()]), stops)
  jaxpr = jax.make_jaxpr(lambda *a: gen.decode(*a, max_steps=8, cfg=cfg))(*args).jaxpr
  inner = jaxpr.eqns[0].params["jaxpr"].jaxpr  # the jit of decode
  loops = [e for e in inner.eqns if e.primitive.name == "while"]
  assert len(loops) == 1
  # The model's forward runs inside the loop body, and nothing calls back to the host.
  body = str(loops[0].params["body_jaxpr"])
  assert "dot_general" in body and "scatter" in body
  assert "callback" not in str(jaxpr)


def test_rejects_bad_requests(model):
  cfg, params = model
  with pytest.raises(ValueError, match="at least one token"):
    generate_tokens(params, cfg, [[]], max_new_tokens=3)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    generate_tokens(params, cfg, [[1] * 10], max_new_tokens=cfg.max_position_embeddings)
  with pytest.raises(ValueError, match="top_p"):
    generate_tokens(params, cfg, [[1]], sampling=SamplingParams(top_p=2.0))
