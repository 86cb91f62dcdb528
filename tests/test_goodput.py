"""The adaptive draft length's goodput model (`speculative.goodput`) and the counterfactual
acceptance evidence of calls that did not draft (`speculative.counterfactual`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_goodput_choice():
  from engine.runtime.speculative import goodput
  choices = goodput.k_choices(4)
  assert choices == (0, 1, 2, 4) and goodput.k_choices(3, allow_zero=False) == (1, 2, 3)
  geometric = lambda a: goodput.gains(jnp.full((4,), a, jnp.float32))
  pick = lambda gain, rows, dc: choices[int(goodput.choose(
      gain[None], goodput.step_costs(choices, rows, dc, 0.02), choices, jnp.asarray([64])))]
  assert pick(geometric(0.9), 1, 0.0) == 4  # cheap, accurate drafts: draft the most
  assert pick(geometric(0.05), 1, 0.2) == 0  # costly, useless drafts: plain decoding
  assert pick(geometric(0.7), 64, 0.0) < pick(geometric(0.7), 1, 0.0)  # big batch: dear
  # The same first-position rate, but chains that end at the second draft: one draft is best.
  assert pick(goodput.gains(jnp.asarray([0.9, 0.05, 0.05, 0.05])), 1, 0.05) == 1
  np.testing.assert_allclose(goodput.expected_tokens(geometric(0.5), 2), 1.75, rtol=1e-6)
  # A fixed batch takes as long as its slowest row: drafts that only help a row that finishes
  # early do not pay; drafts for the row with the most left to emit do.
  rows = jnp.stack([geometric(0.9), geometric(0.02)])
  costs = goodput.step_costs(choices, 2, 0.0, 0.05)
  slow_rejects = goodput.choose(rows, costs, choices, jnp.asarray([10, 60]))
  slow_accepts = goodput.choose(rows, costs, choices, jnp.asarray([60, 10]))
  assert choices[int(slow_rejects)] == 0 and choices[int(slow_accepts)] == 4
  assert choices[int(goodput.choose(rows, costs, choices, jnp.asarray([60, 0])))] == 4


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
  g = np.asarray(goodput.drafter_gains(counts))
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
  np.testing.assert_allclose(g_rows[0], goodput.drafter_gains(d_counts), rtol=1e-5)
  row_c1 = (20 + goodput.ROW_PRIOR_WEIGHT * c1) / (20 + goodput.ROW_PRIOR_WEIGHT)
  np.testing.assert_allclose(g_rows[1, 1, :2], [row_c1, row_c1 * row_c1 / 6], rtol=3e-3)


def test_plain_call_evidence_replays_what_a_drafter_would_have_drafted():
  """A plain call's tokens, replayed: ngram drafting K = 4 from the call's start matches all 4
  (censored: no mismatch inside the horizon), then 1 of the one token left; the counts fold
  step by step as the loop folds its own. A row the drafter misses ends at position 1 once
  per token; a row without a drafter learns nothing."""
  from engine.runtime.speculative import counterfactual
  from engine.runtime.speculative.serving import DRAFTER_IDS, drafter_id
  hist = np.asarray([[5, 6, 7, 8] * 3, [9, 3, 4, 1, 2, 6, 7, 11, 12, 13, 14, 15]] * 2, np.int32)
  newest, end = np.full((4,), 5, np.int32), np.full((4,), 11, np.int32)
  d, n_ids = drafter_id("ngram"), len(DRAFTER_IDS)
  row_accept, accept = counterfactual.plain_call_evidence(
      hist, newest, end, np.asarray([True, True, False, False]), None,
      np.zeros((4, n_ids, 4, 2), np.float32), np.zeros((n_ids, 4, 2), np.float32), k=4,
      replayed=(("ngram", d),), steps=8)
  np.testing.assert_allclose(row_accept[0, d], [[1.8, 0], [1, 0], [1, 0], [1, 0]], rtol=1e-6)
  misses = sum(0.8 ** i for i in range(6))  # 6 steps, each ended at position 1
  np.testing.assert_allclose(row_accept[1, d], [[0, misses]] + [[0, 0]] * 3, rtol=1e-6)
  assert not np.any(row_accept[2:]) and not np.any(np.delete(np.asarray(row_accept), d, 1))
  # Engine-wide: both rows' evidence summed per step, folded step by step.
  want = np.zeros((4, 2))
  for e in ([[1, 1], [1, 0], [1, 0], [1, 0]], [[1, 1], [0, 0], [0, 0], [0, 0]]) + (
      [[0, 1], [0, 0], [0, 0], [0, 0]],) * 4:
    e = np.asarray(e, np.float64)
    want = np.where(e.sum(-1, keepdims=True) > 0, 0.8 * want, want) + e
  np.testing.assert_allclose(accept[d], want, rtol=1e-6)


def test_goodput_plan_sizes_each_row_like_an_exhaustive_search():
  """`goodput.plan` (block width K and per-row draft counts) reaches the best tokens per unit of
  step time that trying every K and every k_b <= min(K, room_b) finds."""
  import itertools
  from engine.runtime.speculative import goodput
  choices = (0, 1, 2, 4)
  rng = np.random.default_rng(4)

  def rate(gain, live, drafting, k, ks, block, token, overhead):
    tokens = live.sum() + sum(sum(gain[i, :kb]) for i, kb in enumerate(ks) if drafting[i])
    return tokens / (1 + (overhead if k else 0.0) + k * block + token * sum(ks))

  for case in range(40):
    b = 3
    # Per-position acceptance (geometric in half the cases), gains = its running product.
    c = rng.uniform(0.0, 0.98, (b, 4)) if case % 2 else np.repeat(rng.uniform(0, 0.98, (b, 1)),
                                                                    4, axis=1)
    gain = np.cumprod(c, axis=1)
    live = np.asarray([True, True, case % 3 > 0])
    drafting = live & np.asarray([True, case % 2 == 0, True])
    room = rng.integers(0, 5, b)
    block, token = rng.uniform(0.0, 0.3), [0.0, 0.05, 0.4][case % 3]
    overhead = [0.0, 0.3][case % 2]
    index, k_rows, at = goodput.plan(jnp.asarray(gain, jnp.float32), jnp.asarray(drafting),
                                     jnp.asarray(live), jnp.asarray(room, jnp.int32), choices,
                                     jnp.float32(block), jnp.float32(token),
                                     jnp.float32(overhead))
    # The host's numpy plan (the engine's per-call decision) is the same plan.
    host = goodput.plan(gain.astype(np.float32), drafting, live, room.astype(np.int32), choices,
                        np.float32(block), np.float32(token), np.float32(overhead), xp=np)
    assert int(host[0]) == int(index) and list(host[1]) == list(np.asarray(k_rows))
    assert float(host[2]) == pytest.approx(float(at), rel=1e-5)
    k, k_rows = choices[int(index)], np.asarray(k_rows)
    cap = [min(room[i], max(choices)) if drafting[i] else 0 for i in range(b)]
    assert all(k_rows <= np.minimum(cap, k)), (k, k_rows, cap)
    best = max(rate(gain, live, drafting, kc, ks, block, token, overhead) for kc in choices
               for ks in itertools.product(*[range(min(c, kc) + 1) for c in cap]))
    got = rate(gain, live, drafting, k, k_rows, block, token, overhead)
    assert got == pytest.approx(best, rel=1e-4), (case, gain, room, k, k_rows)
    assert float(at) == pytest.approx(got, rel=1e-4)  # the rate it returns is its plan's
    if token == 0.0:  # nothing to save per token: every drafting row fills the block
      assert list(k_rows) == [min(c, k) for c in cap]
  # A row that rarely accepts drafts less than one that usually does, in the same block.
  geometric = lambda a: goodput.gains(jnp.full((4,), a, jnp.float32))
  index, k_rows, _ = goodput.plan(jnp.stack([geometric(0.95), geometric(0.2)]), jnp.ones(2, bool),
                               jnp.ones(2, bool), jnp.asarray([4, 4], jnp.int32), choices,
                               jnp.float32(0.05), jnp.float32(0.3))
  assert choices[int(index)] == 4 and int(k_rows[0]) == 4 and int(k_rows[1]) < 2
  # A row that accepts its first draft as often but then stops drafts one token.
  index, k_rows, _ = goodput.plan(jnp.stack([geometric(0.95), goodput.gains(jnp.asarray(
      [0.95, 0.1, 0.1, 0.1]))]), jnp.ones(2, bool), jnp.ones(2, bool),
      jnp.asarray([4, 4], jnp.int32), choices, jnp.float32(0.05), jnp.float32(0.3))
  assert int(k_rows[0]) == choices[int(index)] >= 2 and int(k_rows[1]) == 1


def test_row_drafters_pick_the_best_allowed_drafter_on_host_and_device_alike():
  """`goodput.row_drafters` (the serving loop's per-iteration drafter choice, which the host
  repeats in numpy to price a call): an "auto" row takes the allowed drafter with the most
  E[tau](k) / (1 + k (base + c_d)), other rows keep their own; the block's cost per column
  counts the base, the live rows and each drafter a live row uses, once."""
  from engine.runtime.speculative import goodput
  rng = np.random.default_rng(7)
  b, d, k = 5, 4, 4
  for _ in range(20):
    gain_rows = np.cumprod(rng.uniform(0.0, 0.98, (b, d, k)), axis=-1).astype(np.float32)
    costs = np.concatenate([[0.0], rng.uniform(0.0, 0.5, d - 1),
                            rng.uniform(0.0, 0.3, 4)]).astype(np.float32)
    allowed = rng.uniform(size=(b, d)) < 0.7
    allowed[:, 1] = True  # (at least one)
    row_auto = rng.uniform(size=b) < 0.6
    row_drafter = rng.integers(0, d, b).astype(np.int32)
    live = rng.uniform(size=b) < 0.8
    host = goodput.row_drafters(gain_rows, costs, allowed, row_auto, row_drafter, live, k,
                                xp=np)
    dev = goodput.row_drafters(*(jnp.asarray(x) for x in (gain_rows, costs, allowed, row_auto,
                                                          row_drafter, live)), k)
    np.testing.assert_array_equal(host[0], np.asarray(dev[0]))
    np.testing.assert_allclose(host[1], np.asarray(dev[1]), rtol=1e-6)
    assert float(host[2]) == pytest.approx(float(dev[2]), rel=1e-6)
    ids = host[0]
    for i in range(b):
      if row_auto[i]:
        score = [(1 + gain_rows[i, j].sum()) / (1 + k * (costs[-3] + costs[j])) if allowed[i, j]
                 else -np.inf for j in range(d)]
        assert ids[i] == int(np.argmax(score))
      else:
        assert ids[i] == row_drafter[i]
      np.testing.assert_allclose(host[1][i], gain_rows[i, ids[i]])
    used = {int(ids[i]) for i in range(b) if live[i]}
    want = costs[-3] + costs[-2] * live.sum() + sum(costs[j] for j in used)
    assert float(host[2]) == pytest.approx(want, rel=1e-5)


def test_cost_fits_price_the_loop_times_they_predict():
  """The warm-up's per-column and per-token fits (`serving_costs`): exact on data the model can
  express; never negative; and a first column dearer than the rest at one batch size (the
  CPU's one-row forward gathers its experts, a wider block runs them all) does not set the
  price of every column, as a per-column average extrapolated along a falling line did."""
  from engine.runtime.speculative.serving_costs import column_fit, token_fit
  ks, bs = np.array([1, 2, 4, 1, 2, 4]), np.array([1, 1, 1, 4, 4, 4])
  base, pad_row = column_fit(ks, bs, ks * (0.2 + 0.05 * bs))
  assert (base, pad_row) == (pytest.approx(0.2), pytest.approx(0.05))
  # Loop times measured on the 2-core CPU (plain iterations beyond the k = 0 iteration):
  # one row pays 0.62 for its first column and ~0.1 per column after it; four rows pay ~0.27
  # per column throughout. A wide block costs ~0.94 at one row, ~1.08 at four.
  extra = np.array([0.622, 0.723, 0.937, 0.273, 0.555, 1.081])
  base, pad_row = column_fit(ks, bs, extra)
  assert base >= 0 and pad_row >= 0
  for b in (1, 4):
    predicted = 4 * (base + pad_row * b)
    assert predicted == pytest.approx(extra[(ks == 4) & (bs == b)][0], rel=0.2)  # (old: 1.77)
  # Falling with the batch size: no negative per-row cost, and the base is the fit through
  # the data rather than the line's intercept at zero rows.
  base, pad_row = column_fit(ks, bs, ks * (0.5 - 0.05 * bs))
  assert pad_row == 0 and 0.3 < base < 0.45
  # One batch size: the whole cost is the base.
  assert column_fit(ks[:3], bs[:3], ks[:3] * 0.3) == (pytest.approx(0.3), 0.0)
  assert column_fit(ks[:0], bs[:0], ks[:0] * 0.0) == (0.0, 0.0)
  # Per drafted token: the big blocks set it; a one-row block's noise does not, and a cost that
  # comes out negative (noise around zero) is zero.
  assert token_fit(ks, bs, 0.01 * ks * bs) == pytest.approx(0.01)
  noisy = 0.01 * ks * bs + np.array([0.08, 0, 0, 0, 0, 0])  # a one-row, one-column blip
  assert token_fit(ks, bs, noisy) < 0.012 < np.mean(noisy / (ks * bs))
  assert token_fit(ks, bs, -0.01 * ks * bs) == 0.0 and token_fit(ks[:0], bs[:0], ks[:0]) == 0.0


def test_live_correction_waits_for_evidence_and_keeps_kinds_of_call_apart():
  """`LiveCorrection`: measured / predicted time of speculative calls, decayed; it applies
  once COST_MIN_EVIDENCE predicted iterations stand behind it, within its range, and calls
  that keep a model drafter current never move the other calls' correction."""
  from engine.runtime.speculative.live_correction import (COST_MIN_EVIDENCE, COST_SCALE_RANGE,
                                                          LiveCorrection)
  c = LiveCorrection()
  c.learn(COST_MIN_EVIDENCE / 2, COST_MIN_EVIDENCE, models=False)  # too little evidence yet
  assert c.of(False) == 1.0
  for _ in range(30):
    c.learn(10.0, 13.0, models=False)
  assert c.of(False) == pytest.approx(1.3, rel=0.02) and c.of(True) == 1.0
  for _ in range(60):  # recent calls outweigh old ones (decay)
    c.learn(10.0, 8.0, models=False)
  assert c.of(False) == pytest.approx(0.8, rel=0.02)
  for _ in range(30):
    c.learn(10.0, 100.0, models=True)
  assert c.of(True) == COST_SCALE_RANGE[1] and c.of(False) == pytest.approx(0.8, rel=0.02)
  # Corrected costs: every speculative T(k) = 1 + overhead + k (base + ...) scales by r.
  costs = np.array([0.0, 0.0, 0.0, 0.1, 0.2, 0.0, 0.25, 0.1, 0.01, 0.02], np.float32)
  live = c.costs(costs, models=True)
  t = lambda x, k: 1 + x[-4] + k * (x[-3] + 4 * x[-2] + x[4])
  assert t(live, 3) == pytest.approx(2.0 * t(costs, 3))
  assert t(c.costs(costs, models=False), 1) == pytest.approx(0.8 * t(costs, 1), rel=0.02)
  snapshot = c.copy()
  c.learn(10.0, 5.0, models=False)
  assert snapshot.evidence[0, 1] != c.evidence[0, 1]
