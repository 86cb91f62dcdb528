"""Batch generation (`engine.generate`: a batch's prompts as requests of the model's engine):
batching, stopping rules, sampling reproducibility, compiled shapes, the decode loop."""

import jax
import jax.numpy as jnp
import pytest

import engine
from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.runtime import steps
from engine.runtime.buckets import CompileCounter
from engine.runtime.sampling import SamplingArrays, SamplingParams
from generation import generate_ids, loaded
from model_configs import CONFIGS


@pytest.fixture(scope="module")
def model():
  cfg = config_from_dict(CONFIGS["deepseek_v3"])
  return loaded(cfg, init_params(cfg, seed=11, scale=2.0))


PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16], [1, 40]]


@pytest.mark.slow
def test_batch_of_mixed_lengths_equals_single_runs(model):
  batch = generate_ids(model, PROMPTS, max_new_tokens=[6, 12, 9])
  for p, n, got in zip(PROMPTS, [6, 12, 9], batch):
    alone = generate_ids(model, [p], max_new_tokens=n)[0]
    assert got.token_ids == alone.token_ids
    assert len(got.token_ids) == n and got.finish_reason == "length"
  assert len({tuple(c.token_ids) for c in batch}) == 3  # not degenerate


def test_eos_and_stop_ids_stop_only_their_row(model):
  free = generate_ids(model, PROMPTS[:2], max_new_tokens=10)
  eos = free[0].token_ids[3]
  first = free[0].token_ids.index(eos)
  out = generate_ids(model, PROMPTS[:2], max_new_tokens=10, eos_ids=[eos])
  assert out[0].token_ids == free[0].token_ids[:first + 1]  # EOS included, nothing after
  assert out[0].finish_reason == "stop"
  other = free[1].token_ids
  expect = other[:other.index(eos) + 1] if eos in other else other
  assert out[1].token_ids == expect
  # Per-row stop ids, ignore_eos and min_new_tokens.
  stop = free[1].token_ids[2]
  out = generate_ids(model, PROMPTS[:2], max_new_tokens=10, eos_ids=[eos],
                     stop_token_ids=[[], [stop]], ignore_eos=True)
  assert out[0].token_ids == free[0].token_ids and out[0].finish_reason == "length"
  assert out[1].token_ids == other[:other.index(stop) + 1] and out[1].finish_reason == "stop"
  out = generate_ids(model, PROMPTS[:1], max_new_tokens=10, eos_ids=[eos],
                     min_new_tokens=first + 2)
  assert len(out[0].token_ids) > first + 1


def test_one_new_token_skips_decode_and_matches_longer_runs(model):
  """max_new_tokens == 1 (time to first token) samples in the prefill's step without a decode
  loop: same token, stop reasons and sampling as the first token of a longer run."""
  s = [SamplingParams(), SamplingParams(temperature=0.9, seed=7), SamplingParams()]
  longer = generate_ids(model, PROMPTS, max_new_tokens=4, sampling=s)
  one = generate_ids(model, PROMPTS, max_new_tokens=1, sampling=s)
  assert [c.token_ids for c in one] == [c.token_ids[:1] for c in longer]
  assert [c.finish_reason for c in one] == ["length"] * 3
  eos = longer[0].token_ids[0]
  one = generate_ids(model, PROMPTS, max_new_tokens=1, sampling=s, eos_ids=[eos])
  assert one[0].finish_reason == "stop" and one[0].token_ids == [eos]
  one = generate_ids(model, PROMPTS[:1], max_new_tokens=1, eos_ids=[eos], min_new_tokens=2)
  assert one[0].finish_reason == "length"
  before = steps.decode_loop._cache_size()
  generate_ids(model, [[3] * 40], max_new_tokens=1)
  assert steps.decode_loop._cache_size() == before  # no decode program for one token
  (eng,) = [e for e in model.llm.engines if e.config.max_num_seqs == 1
            and 64 in e.config.row_widths]
  assert eng.counters["decode_loops"] == 0


def test_seeded_sampling_reproduces_and_ignores_batch_company(model):
  s = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
  a = generate_ids(model, [PROMPTS[1]], max_new_tokens=12, sampling=s)[0]
  b = generate_ids(model, [PROMPTS[0], PROMPTS[1]], max_new_tokens=12,
                   sampling=[SamplingParams(temperature=1.0, seed=9), s])[1]
  assert a.token_ids == b.token_ids
  c = generate_ids(model, [PROMPTS[1]], max_new_tokens=12,
                   sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=99))[0]
  assert c.token_ids != a.token_ids
  k1 = generate_ids(model, [PROMPTS[1]], max_new_tokens=12,
                    sampling=SamplingParams(temperature=1.0, top_k=1, seed=5))[0]
  greedy = generate_ids(model, [PROMPTS[1]], max_new_tokens=12)[0]
  assert k1.token_ids == greedy.token_ids


@pytest.mark.slow
def test_compiles_once_per_bucket(model):
  """A call of the same buckets (batch size, prompt width, length to a quarter octave)
  compiles nothing, also when its prompt hits the prefix cache (one row per prompt either
  way)."""
  generate_ids(model, [[1, 2, 3]], max_new_tokens=5)
  with CompileCounter() as counter:
    generate_ids(model, [[1, 4, 5, 6, 7]], max_new_tokens=5)  # same buckets
  assert counter.count == 0
  short, long = list(range(1, 20)), [1] + list(range(3, 152))  # (more than a page)
  first = [generate_ids(model, [p], max_new_tokens=7)[0].token_ids for p in (short, long)]
  with CompileCounter() as counter:
    # A repeat: the prompt but its last page is cached; a long one's tail takes a page-wide
    # row (compiled with its engine), a short one's its own row.
    again = [generate_ids(model, [p], max_new_tokens=7)[0].token_ids for p in (short, long)]
  assert counter.count == 0
  assert again == first
  assert all(e.pool.prefix_hits > 0 for e in model.llm.engines)
  assert [e.config.row_widths for e in model.llm.engines] == [(32,), (16, 256)]


def test_decode_is_one_while_loop(model):
  cfg, params, _ = model
  from engine.model.cache import contiguous_page_table, init_cache
  pt = jnp.asarray(contiguous_page_table(1, 32, 16))
  cache = init_cache(cfg, pt.size, 16, jnp.float32)
  batch = steps.DecodeBatch(
      tokens=jnp.asarray([7]), n_cached=jnp.asarray([3]), page_table=pt,
      sampling=SamplingArrays.from_params([SamplingParams()]), stop_ids=jnp.asarray([[-1]]),
      remaining=jnp.asarray([4]), min_before_stop=jnp.asarray([0]), num_steps=jnp.int32(8),
      want_logprobs=jnp.bool_(False))
  jaxpr = jax.make_jaxpr(lambda p, c, b: steps.decode_loop(p, c, b, max_steps=8, cfg=cfg))(
      params, cache, batch).jaxpr
  inner = jaxpr.eqns[0].params["jaxpr"].jaxpr  # the jit of decode_loop
  loops = [e for e in inner.eqns if e.primitive.name == "while"]
  assert len(loops) == 1
  # The model's forward runs inside the loop body, and nothing calls back to the host.
  body = str(loops[0].params["body_jaxpr"])
  assert "dot_general" in body and "scatter" in body
  assert "callback" not in str(jaxpr)


def test_rejects_bad_requests(model):
  with pytest.raises(ValueError, match="at least one token"):
    engine.generate(model, [[]], max_new_tokens=3)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    engine.generate(model, [[1] * 10], max_new_tokens=model.config.max_position_embeddings)
  with pytest.raises(ValueError, match="top_p"):
    engine.generate(model, [[1]], top_p=2.0)
