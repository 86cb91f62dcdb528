"""The adaptive draft length (`speculative.goodput`: acceptance estimates per draft position,
the block width and drafter they choose) and the cost table (`speculative.costs`)."""


import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime.speculative import costs, goodput


def test_plan_drafts_where_the_block_pays():
  geometric = lambda a: goodput.gains(jnp.full((4,), a, jnp.float32))
  one = jnp.ones((1,), bool)

  def block(gain, t0, tk, room=4, column=0.0):
    drafts, k_rows = goodput.plan(gain[None], one, one, jnp.asarray([room]), 4,
                                     jnp.asarray([t0, tk], jnp.float32), jnp.float32(column))
    return bool(drafts), int(k_rows[0])

  assert block(geometric(0.9), 1.0, 1.2) == (True, 4)  # cheap, accurate: the block
  assert block(geometric(0.05), 1.0, 1.8) == (False, 0)  # costly, useless: plain
  # E[tau](4) at 0.5 is 1.9375: the block pays below that cost and not above it.
  np.testing.assert_allclose(goodput.expected_tokens(geometric(0.5), 4), 1.9375, rtol=1e-6)
  assert block(geometric(0.5), 1.0, 1.9)[0] and not block(geometric(0.5), 1.0, 2.0)[0]
  assert block(geometric(0.5), 1.1, 2.0)[0]  # plain iterations of this loop cost more too
  assert block(geometric(0.9), 1.0, 1.2, room=2) == (True, 2)  # a row near its end
  assert not block(geometric(0.9), 1.0, 1.2, room=0)[0]  # nothing left to draft
  assert not block(geometric(0.9), 1.0, 1.2, column=1.0)[0]  # a dear model drafter


def test_acceptance_is_estimated_per_draft_position():
  """Decayed (accepted, ended) counts per position give c_j = P(draft j accepted | drafts < j
  were); positions without evidence follow the one above (the geometric model); counts decay
  only where evidence arrives; a row's estimate starts at its drafter's and follows its own."""
  from engine.runtime.speculative import goodput
  j = 4
  ev = goodput.position_evidence(jnp.asarray([0, 2, 4, 1]), jnp.asarray([True, True, False, False]),
                                 j, jnp.asarray([1.0, 1.0, 1.0, 0.0]))
  np.testing.assert_array_equal(ev[..., 0], [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1],
                                             [0, 0, 0, 0]])
  np.testing.assert_array_equal(ev[..., 1], [[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0],
                                             [0, 0, 0, 0]])  # censored: no "ended"
  # Chains that always accept the first draft and reject the second.
  counts = jnp.zeros((j, 2))
  for _ in range(30):
    counts = goodput.decay_add(counts, goodput.position_evidence(
        jnp.asarray([1]), jnp.asarray([True]), j)[0])
  c = np.asarray(goodput.conditional_acceptance(counts, goodput.PRIOR_ACCEPT,
                                                goodput.PRIOR_WEIGHT))
  # Decayed counts saturate at 1 / (1 - DECAY) = 5 observations; each prior is worth one, and
  # is the shallower position's estimate (so positions 3 and 4, never reached, follow 2).
  c1 = 5.5 / 6
  np.testing.assert_allclose(c, [c1, c1 / 6, c1 / 6, c1 / 6], rtol=1e-3)
  g = np.asarray(goodput.gains(jnp.asarray(c)))
  np.testing.assert_allclose(g, np.cumprod(c), rtol=1e-5)
  # Evidence at the first position only (k = 0 lookahead, horizon 1): deep positions keep what
  # they learned (their counts do not decay), and with no deep evidence at all they follow c_1.
  later = counts
  for _ in range(30):
    later = goodput.decay_add(later, goodput.position_evidence(
        jnp.asarray([1]), jnp.asarray([False]), j)[0])
  np.testing.assert_array_equal(later[1:], counts[1:])
  fresh = jnp.zeros((j, 2)).at[0].set([8.0, 2.0])
  c = np.asarray(goodput.conditional_acceptance(fresh, goodput.PRIOR_ACCEPT,
                                                goodput.PRIOR_WEIGHT))
  np.testing.assert_allclose(c, (8 + 0.5) / 11, rtol=1e-6)
  # Rows: without evidence of its own a row has its drafter's gains; a row accepting more at
  # position 1 than the drafter does keeps the drafter's drop at depth 2.
  d_counts = jnp.stack([jnp.zeros((j, 2)), counts])  # drafter 0: nothing known, 1: as above
  rows = jnp.zeros((2, 2, j, 2)).at[1, 1, 0].set([20.0, 0.0])
  g_rows = np.asarray(goodput.row_gains(rows, d_counts))
  np.testing.assert_allclose(g_rows[0], goodput.gains(goodput.conditional_acceptance(
      d_counts, goodput.PRIOR_ACCEPT, goodput.PRIOR_WEIGHT)), rtol=1e-5)
  row_c1 = (20 + goodput.ROW_PRIOR_WEIGHT * c1) / (20 + goodput.ROW_PRIOR_WEIGHT)
  np.testing.assert_allclose(g_rows[1, 1, :2], [row_c1, row_c1 * row_c1 / 6], rtol=3e-3)


def test_plan_takes_the_better_rate_on_host_and_device_alike():
  """`goodput.plan` takes plain decoding or the block of k drafts, whichever emits more
  expected tokens per unit of time, every drafting row drafting min(k, room); host (numpy) and
  device give the same plan."""
  k = 4
  rng = np.random.default_rng(4)
  drafted = set()
  for case in range(40):
    b = 3
    c = rng.uniform(0.0, 0.98, (b, k)) if case % 2 else np.repeat(rng.uniform(0, 0.98, (b, 1)),
                                                                    k, axis=1)
    gain = np.cumprod(c, axis=1).astype(np.float32)
    live = np.asarray([True, True, case % 3 > 0])
    drafting = live & np.asarray([True, case % 2 == 0, True])
    room = rng.integers(0, 5, b).astype(np.int32)
    step = np.asarray([1.0 + [0.0, 0.2][case % 2], 1.0 + rng.uniform(0.0, 1.5)], np.float32)
    column = np.float32(rng.uniform(0.0, 0.2))
    block, k_rows = goodput.plan(jnp.asarray(gain), jnp.asarray(drafting), jnp.asarray(live),
                                 jnp.asarray(room), k, jnp.asarray(step), jnp.float32(column))
    host = goodput.plan(gain, drafting, live, room, k, step, column, xp=np)
    assert bool(host[0]) == bool(block) and list(host[1]) == list(np.asarray(k_rows))
    rows = [min(k, room[i]) if drafting[i] else 0 for i in range(b)]
    tokens = live.sum() + sum(gain[i, :rows[i]].sum() for i in range(b))
    block_rate, plain_rate = tokens / (step[1] + k * column), live.sum() / step[0]
    assert bool(block) == (block_rate > plain_rate * (1 + 1e-6)) or abs(
        block_rate - plain_rate) < 1e-5 * plain_rate, case
    assert list(np.asarray(k_rows)) == (rows if block else [0] * b)
    drafted.add(bool(block))
  assert drafted == {True, False}  # both outcomes exercised


def test_row_drafters_pick_the_best_allowed_drafter_on_host_and_device_alike():
  """An "auto" row takes the allowed drafter with the most E[tau](k) / (T + k c_d); other rows
  keep their own; the column cost counts each model drafter a live row uses, once."""
  rng = np.random.default_rng(7)
  b, d, k = 5, 4, 4
  for _ in range(20):
    gain_rows = np.cumprod(rng.uniform(0.0, 0.98, (b, d, k)), axis=-1).astype(np.float32)
    drafter_cost = np.concatenate([[0.0], rng.uniform(0.0, 0.5, d - 1)]).astype(np.float32)
    step = np.float32(1.0 + rng.uniform(0.0, 1.0))
    allowed = rng.uniform(size=(b, d)) < 0.7
    allowed[:, 1] = True  # (at least one)
    row_auto = rng.uniform(size=b) < 0.6
    row_drafter = rng.integers(0, d, b).astype(np.int32)
    live = rng.uniform(size=b) < 0.8
    host = goodput.row_drafters(gain_rows, step, drafter_cost, allowed, row_auto, row_drafter,
                                live, k, xp=np)
    dev = goodput.row_drafters(*(jnp.asarray(x) for x in (gain_rows, step, drafter_cost,
                                                          allowed, row_auto, row_drafter,
                                                          live)), k)
    np.testing.assert_array_equal(host[0], np.asarray(dev[0]))
    np.testing.assert_allclose(host[1], np.asarray(dev[1]), rtol=1e-6)
    assert float(host[2]) == pytest.approx(float(dev[2]), rel=1e-6)
    ids = host[0]
    for i in range(b):
      if row_auto[i]:
        score = [(1 + gain_rows[i, j].sum()) / (step + k * drafter_cost[j]) if allowed[i, j]
                 else -np.inf for j in range(d)]
        assert ids[i] == int(np.argmax(score))
      else:
        assert ids[i] == row_drafter[i]
      np.testing.assert_allclose(host[1][i], gain_rows[i, ids[i]])
    used = {int(ids[i]) for i in range(b) if live[i]}
    assert float(host[2]) == pytest.approx(sum(drafter_cost[j] for j in used), rel=1e-5,
                                           abs=1e-7)


def test_cost_table_roofline_break_even_and_measurement():
  widths = (0, 4)
  t = costs.roofline((1, 8, 64, 256), widths, [0.0, 0.0, 0.0, 0.1, 0.2])
  # Memory-bound until B (k + 1) reaches the ridge: a block costs a step at small batches.
  assert t.step[0].tolist() == [1.0] * 2
  assert t.step[3, 0] == 1.0 and t.step[3, 1] == pytest.approx(256 * 5 / costs.RIDGE_TOKENS / (
      256 / costs.RIDGE_TOKENS))
  assert t.break_even == 256  # (k + 1) / T(256, k) = 1 at every k: no gain left
  assert t.index(3) == 1 and t.index(1000) == 3 and np.allclose(t.costs(3)[-2:], [0.1, 0.2])
  assert t.pays_at_full_acceptance(1) and not t.pays_at_full_acceptance(1, drafter_cost=1.0)
  assert t.min_call_tokens == 1
  t.call = 2.5
  assert t.min_call_tokens == 4
  # `measure` on programs of known time: a call of n iterations costs a + n t.
  plain_t = {1: 1.0, 2: 1.5}
  spec_t = {0: 1.2, 4: 2.8}

  def plain(b, n):  # (a program returning its own duration; the timer below reads it)
    return 0.5 + n * plain_t[b]

  def speculative(b, n, w, d):
    extra = 0.4 * widths[w] * plain_t[b] if d == "mtp" else 0.0
    return 0.9 + n * (spec_t[widths[w]] * plain_t[b] + extra)

  measured = costs.measure((1, 2), widths, ["mtp"], [3], 5, 8, plain, speculative, rounds=3,
                           timed=lambda programs, rounds: {k: f() for k, f in programs.items()})
  np.testing.assert_allclose(measured.step, [[spec_t[k] for k in widths]] * 2, rtol=1e-6)
  np.testing.assert_allclose(measured.drafter[:, 3], [0.4, 0.4], rtol=1e-6)
  assert measured.call == pytest.approx(np.median([0.4 / 1.0, 0.4 / 1.5]), rel=1e-6)
  assert measured.measured and measured.break_even is None


