"""Sampling: masks of top-k / top-p / min-p, greedy, and seeded reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime.sampling import SamplingArrays, SamplingParams, transformed_logits
from engine.runtime import sampling

# Jitted, as the engine calls it. Called eagerly, its lax.cond closes over the call's arrays,
# so every call traced and compiled both branches again (21 compiles for 21 draws).
sample = jax.jit(sampling.sample)


def _arrays(**kw):
  return SamplingArrays.from_params([SamplingParams(**kw)])


def _kept(logits, **kw):
  masked, order = transformed_logits(jnp.asarray([logits], jnp.float32), _arrays(**kw))
  masked, order = np.asarray(masked[0]), np.asarray(order[0])
  return set(order[np.isfinite(masked)].tolist())


PROBS = np.array([0.05, 0.4, 0.1, 0.25, 0.2])  # ranked: 1, 3, 4, 2, 0
LOGITS = np.log(PROBS)


def test_top_k_keeps_k_most_likely():
  assert _kept(LOGITS, temperature=1.0, top_k=2) == {1, 3}
  assert _kept(LOGITS, temperature=1.0, top_k=0) == {0, 1, 2, 3, 4}


def test_top_p_keeps_smallest_nucleus():
  assert _kept(LOGITS, temperature=1.0, top_p=0.5) == {1, 3}  # 0.4 < 0.5, then 0.65
  assert _kept(LOGITS, temperature=1.0, top_p=0.35) == {1}
  assert _kept(LOGITS, temperature=1.0, top_p=0.66) == {1, 3, 4}
  assert _kept(LOGITS, temperature=1.0, top_p=0.01) == {1}  # never empty


def test_top_p_applies_to_renormalised_top_k():
  # After top_k=3 the mass is 0.4/0.85, 0.25/0.85, 0.2/0.85: top_p=0.7 needs two tokens.
  assert _kept(LOGITS, temperature=1.0, top_k=3, top_p=0.7) == {1, 3}


def test_min_p_relative_to_best():
  assert _kept(LOGITS, temperature=1.0, min_p=0.5) == {1, 3, 4}  # >= 0.2
  assert _kept(LOGITS, temperature=1.0, min_p=0.6) == {1, 3}


def test_temperature_changes_min_p_threshold():
  # Sharpening with temperature 0.5 squares the probability ratios: 0.2/0.4 -> 0.25.
  assert _kept(LOGITS, temperature=0.5, min_p=0.3) == {1, 3}


def test_greedy_is_argmax_and_ignores_seed():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
  s = SamplingArrays.from_params([SamplingParams(seed=i) for i in range(4)])
  got = sample(logits, s, jnp.arange(4, dtype=jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))


def test_seeded_sampling_reproduces_and_depends_on_seed_and_position():
  logits = jnp.zeros((1, 1000), jnp.float32)
  draw = lambda seed, pos: int(sample(logits, _arrays(temperature=1.0, seed=seed),
                                      jnp.asarray([pos], jnp.int32))[0])
  assert draw(7, 3) == draw(7, 3)
  assert len({draw(7, p) for p in range(10)}) > 5
  assert len({draw(s, 3) for s in range(10)}) > 5


def test_samples_follow_the_distribution_and_respect_masks():
  n = 4000
  logits = jnp.asarray(np.tile(LOGITS, (n, 1)), jnp.float32)
  s = SamplingArrays.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(n)])
  got = np.asarray(sample(logits, s, jnp.zeros(n, jnp.int32)))
  freq = np.bincount(got, minlength=5) / n
  np.testing.assert_allclose(freq, PROBS, atol=0.03)
  s = SamplingArrays.from_params([SamplingParams(temperature=1.0, top_k=2, seed=i)
                                  for i in range(n)])
  got = np.asarray(sample(logits, s, jnp.zeros(n, jnp.int32)))
  assert set(got.tolist()) == {1, 3}
  assert abs((got == 1).mean() - 0.4 / 0.65) < 0.03


def test_rows_mix_greedy_and_sampling():
  logits = jnp.asarray(np.tile(LOGITS, (2, 1)), jnp.float32)
  s = SamplingArrays.from_params([SamplingParams(), SamplingParams(temperature=1.0, top_k=1)])
  got = np.asarray(sample(logits, s, jnp.zeros(2, jnp.int32)))
  assert got.tolist() == [1, 1]


@pytest.mark.parametrize("kw,field", [(dict(temperature=-1.0), "temperature"),
                                      (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
                                      (dict(min_p=1.5), "min_p"), (dict(seed=-1), "seed")])
def test_invalid_params_are_named(kw, field):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kw).validate()


def test_argmax_is_jnp_argmax_with_ties_and_infs():
  from engine.runtime.sampling import argmax
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 50)).astype(np.float32)
  x[1, [3, 7, 40]] = 9.0  # ties: the first index wins
  x[2] = -np.inf
  x[3, 10] = np.inf
  x[4, :] = 0.0
  got = np.asarray(argmax(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert got.dtype == np.int32 and got[1] == 3


# ---- the candidate prefilter (vocabularies larger than PREFILTER_CANDIDATES) ----

from engine.runtime.sampling import PREFILTER_CANDIDATES, candidate_logits  # noqa: E402


def _peaked_logits(rng, rows, vocab, scale):
  return jnp.asarray(rng.standard_normal((rows, vocab)) * scale, jnp.float32)


@pytest.mark.parametrize("kw", [dict(top_k=50), dict(top_k=PREFILTER_CANDIDATES),
                                dict(top_p=0.9), dict(top_p=0.5, top_k=5000),
                                dict(min_p=0.05), dict(top_k=2000, min_p=0.3),
                                dict(top_k=500, top_p=0.9, temperature=0.5)])
def test_candidates_keep_exactly_what_the_full_sort_keeps(kw):
  rng = np.random.default_rng(3)
  vocab = 5000
  logits = _peaked_logits(rng, 6, vocab, 4.0)
  s = SamplingArrays.from_params([SamplingParams(**{"temperature": 1.0, **kw}, seed=i)
                                  for i in range(6)])
  full_masked, order = transformed_logits(logits, s)
  masked, ids, exact = candidate_logits(logits, s)
  assert np.asarray(exact).all(), kw
  for r in range(6):
    want = set(np.asarray(order[r])[np.isfinite(np.asarray(full_masked[r]))].tolist())
    got = set(np.asarray(ids[r])[np.isfinite(np.asarray(masked[r]))].tolist())
    assert got == want and 0 < len(got) <= PREFILTER_CANDIDATES


def test_candidates_not_exact_when_kept_tokens_may_lie_outside():
  flat = jnp.zeros((4, 5000), jnp.float32)  # every token equally likely: nothing is cut early
  s = SamplingArrays.from_params([SamplingParams(temperature=1.0),
                                  SamplingParams(temperature=1.0, top_p=0.5),
                                  SamplingParams(temperature=1.0, top_k=3000, top_p=0.9),
                                  SamplingParams(temperature=1.0, top_k=10)])
  assert np.asarray(candidate_logits(flat, s)[2]).tolist() == [False, False, False, True]


def test_sampled_token_independent_of_batch_company_forcing_the_full_sort():
  rng = np.random.default_rng(5)
  logits = _peaked_logits(rng, 3, 5000, 4.0)
  rows = [SamplingParams(temperature=0.8, top_p=0.9, seed=11),
          SamplingParams(temperature=1.0, top_k=40, seed=12),
          SamplingParams(temperature=1.0, seed=13)]  # no truncation: needs the full sort
  pos = jnp.asarray([7, 8, 9], jnp.int32)
  together = np.asarray(sample(logits, SamplingArrays.from_params(rows), pos))
  assert not bool(candidate_logits(logits, SamplingArrays.from_params(rows))[2][2])
  for i in range(2):  # alone, rows 0 and 1 take the candidate path
    alone = sample(logits[i:i + 1], SamplingArrays.from_params(rows[i:i + 1]), pos[i:i + 1])
    assert int(alone[0]) == together[i]


def test_prefiltered_samples_follow_the_nucleus_distribution():
  rng = np.random.default_rng(9)
  vocab, n = 3000, 3000
  base = np.asarray(_peaked_logits(rng, 1, vocab, 3.0))[0]
  s_one = SamplingArrays.from_params([SamplingParams(temperature=1.0, top_p=0.8)])
  masked, ids, exact = candidate_logits(jnp.asarray(base[None]), s_one)
  assert bool(exact[0])
  kept = np.asarray(ids[0])[np.isfinite(np.asarray(masked[0]))]
  want = np.exp(base[kept] - base[kept].max())
  want /= want.sum()
  s = SamplingArrays.from_params([SamplingParams(temperature=1.0, top_p=0.8, seed=i)
                                  for i in range(n)])
  got = np.asarray(sample(jnp.asarray(np.tile(base, (n, 1))), s, jnp.zeros(n, jnp.int32)))
  assert set(got.tolist()) <= set(kept.tolist())
  freq = np.array([(got == t).sum() for t in kept]) / n
  assert 0.5 * np.abs(freq - want).sum() < 0.06  # total variation
