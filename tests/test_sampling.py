"""Sampling: masks of top-k / top-p / min-p, greedy, and seeded reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime.sampling import SamplingArrays, SamplingParams, sample, transformed_logits


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
