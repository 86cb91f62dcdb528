"""What a serving engine's speculative call costs and may spend: its budget (time, like a plain
call's), its fixed cost (`call_policy`), and the live correction of the cost model."""

import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import call_policy, runtime
from engine.runtime.speculative.live_correction import LiveCorrection
from engine.runtime.speculative.serving import drafter_id
from engine_spec_helpers import SMALL, assert_pool_full, fresh_prompts, plain, spec_model


@pytest.fixture(scope="module")
def model():
  return spec_model()


def known_table_engine(model, ps, n, costs, **config):
  """A learned-drafter engine whose table knows the greedy answers to `ps` (n tokens) and whose
  estimates say its drafts are accepted; `costs`: overhead, base, pad_row, per_token."""
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**dict(SMALL, max_model_len=128, **config),
                                         speculative="learned", num_draft_tokens=3,
                                         adaptive_k=True))
  eng.spec.costs[-4:] = costs
  eng.generate(ps, SamplingParams(drafter="off"), StopParams(max_tokens=n))
  eng.spec.accept_seen[drafter_id("learned")] = (20.0, 0.0)
  eng.spec.accept = eng.spec._place_state(jnp.asarray(eng.spec.accept_seen))
  return eng


def test_a_speculative_call_gets_a_plain_calls_time(model, monkeypatch):
  """A speculative call's budget is the engine's budget of plain iterations (`budget`), spent
  as time: its loop starts no iteration once those run cost that much by the cost model, and
  its tokens (the scheduler's pages) allow k + 1 per iteration. At T(3) = 2 plain iterations
  and every draft accepted, a call of 8 plain iterations runs 4 and emits 16 tokens per row,
  twice a plain call's 8. The output is plain greedy decoding's; every page comes back."""
  ps = fresh_prompts(2, seed=56, lo=8, hi=12)
  want = plain(model, ps, 60)
  eng = known_table_engine(model, ps, 60, (0.0, 1 / 3, 0.0, 0.0))  # T(3) = 1 + 3 / 3
  calls = []  # (tokens, time budget, tokens emitted per row, predicted time, iterations)
  real = runtime.speculative_decode_loop

  def loop(*args, **kwargs):
    res, cache = real(*args, **kwargs)
    calls.append((int(args[9]), float(args[10]), np.asarray(res.counts).tolist(),
                  float(res.calibration[2]), int(np.asarray(res.k_steps).sum())))
    return res, cache
  monkeypatch.setattr(runtime, "speculative_decode_loop", loop)
  rows = [eng.requests[eng.add_request(q, stop=StopParams(max_tokens=60))] for q in ps]
  while eng.has_unfinished():
    eng.step()
  assert [r.output_ids for r in rows] == want
  # The ramp's budgets 1, 2, 4, 8 plain iterations: 4, 8, 16, 32 tokens each.
  assert [(n, t) for n, t, *_ in calls[:4]] == [(4, 1.0), (8, 2.0), (16, 4.0), (32, 8.0)]
  for n, t, counts, predicted, iterations in calls:
    assert max(counts) <= n
    assert predicted - 2.0 < t  # no iteration started once the budget was spent
    if max(counts) < min(n, 60):  # a call the time ended: it spent its budget
      assert predicted >= t
  assert calls[3][2:] == ([16, 16], 8.0, 4)  # 4 iterations of T = 2, 4 tokens each
  assert eng.stats()["spec_accepted"] > 0
  for r in rows:
    eng.release(r.request_id)
  assert_pool_full(eng)


def test_a_call_whose_rows_must_finish_is_as_fast_as_its_slowest_row():
  """Rows ride every iteration: one that drafts nothing goes at 1 / T. Where every row keeps
  going for the call's time, the batch's tokens per unit time decide; where rows have to
  finish (a request's last tokens) the call lasts until its slowest row has, and the rows
  done before it idle: the same rows then lose against plain decoding."""
  t = 1.3  # an iteration's time; rows 1 and 2 accept nothing
  rates = [2.1 / t, 1 / t, 1 / t, 1.8 / t]
  assert call_policy.call_saving(rates, [64] * 4, 0.5, time=16) > 1.0  # time-bound: pays
  assert call_policy.call_saving(rates, [16] * 4, 0.5, time=16) < -1.0  # 12.3 of 16 tokens
  assert call_policy.call_saving(rates, [16] * 4, 0.5) < -1.0  # 20.8 iterations for 16
  # (the batch's mean rate over every row would have said it pays)
  assert call_policy.call_saving([np.mean(rates)] * 4, [16] * 4, 0.5, time=16) > 0
  # Rows that finish early anyway cost nothing: only the slow row's own limit binds.
  assert call_policy.call_saving([3.0, 1 / t], [64, 4], 0.5, time=16) > 4.0


def test_a_speculative_call_must_save_more_than_its_fixed_cost(model):
  """`pays`: a call of n tokens per row at a predicted speedup s saves n (1 - 1 / s) plain
  iterations (with a time budget t, n = min(n, t s)); it speculates only when that exceeds the
  call's fixed cost (`call_cost`), so short calls (the engine's first calls after its batch
  changes) decode plainly where the fixed cost is large, and no call speculates where it
  exceeds what any call could save."""
  assert call_policy.call_saving([1.0], [16], 2.0) == -2.0
  assert call_policy.call_saving([2.0, 2.0], [16, 16], 2.0) == pytest.approx(6.0)
  assert call_policy.call_saving([2.0], [64], 2.0, time=16) == pytest.approx(14.0)  # 32 tokens
  assert call_policy.call_saving([2.0], [16], 2.0, time=16) == pytest.approx(6.0)
  ps = fresh_prompts(2, seed=56, lo=8, hi=12)
  want = plain(model, ps, 48)
  budgets = {}
  for call_cost in (0.0, 3.0, 1e3):
    eng = known_table_engine(model, ps, 48, (0.05, 0.05, 0.0, 0.0))
    eng.spec.call_cost = call_cost
    rows = [eng.requests[eng.add_request(q, stop=StopParams(max_tokens=48))] for q in ps]
    assert call_policy.first_iteration_speedup(eng.spec, rows, 4) > 2.5
    real_decode, steps = eng.spec.decode, []

    def decode(*args, real_decode=real_decode, steps=steps, **kwargs):
      steps.append(args[10])  # num_steps
      return real_decode(*args, **kwargs)
    eng.spec.decode = decode
    while eng.has_unfinished():
      eng.step()
    assert [r.output_ids for r in rows] == want
    budgets[call_cost] = steps
  # Free calls speculate from the first (the ramp's budgets of 1, 2, 4 plain iterations
  # become 4, 8, 16 tokens); a fixed cost of 3 plain iterations leaves the one-iteration
  # calls plain (at most s - 1 < 3 saved) and keeps the longer ones; an absurd one leaves
  # every call plain.
  assert budgets[0.0][:3] == [4, 8, 16], budgets
  assert budgets[3.0] and min(budgets[3.0]) >= 8, budgets
  assert budgets[1e3] == [], budgets


def test_cost_model_is_corrected_by_what_speculative_calls_measure(model, monkeypatch):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**dict(SMALL, max_model_len=128), speculative="ngram",
                                         num_draft_tokens=3, adaptive_k=True))
  eng.spec.costs[-4:] = 0.25, 0.1, 0.01, 0.02  # overhead, base, pad_row, per_token
  eng.spec.replay_budget = 0.0  # every call runs the speculative loop (no `pays` per call)
  np.testing.assert_allclose(eng.spec.live_costs(), eng.spec.costs)
  eng.spec.correction.scale[0] = 2.0  # every speculative T(k) doubles; plain stays 1
  live = eng.spec.live_costs()
  for k in (1, 3):
    t = 1 + eng.spec.costs[-4] + k * (eng.spec.costs[-3] + 4 * eng.spec.costs[-2])
    t_live = 1 + live[-4] + k * (live[-3] + 4 * live[-2])
    assert t_live == pytest.approx(2 * t)
  assert live[-1] == pytest.approx(0.04)
  # Calls that keep a model drafter current (draft model, MTP) are corrected apart: their
  # catch-up made them ~3x dearer than predicted on the CPU demo, and with one correction for
  # all calls that priced ngram's calls out for good (none ran again to bring it back).
  eng.spec.correction.scale[0] = 1.0
  for _ in range(20):
    eng.spec.correction.learn(10.0, 30.0, models=True)
  assert eng.spec.model_cost_scale == 2.0 and eng.spec.cost_scale == 1.0
  np.testing.assert_allclose(eng.spec.live_costs(), eng.spec.costs)
  assert eng.spec.live_costs(models=True)[-3] == pytest.approx(2 * eng.spec.costs[-3])
  assert eng.spec.stats()["spec_cost_scale_model_drafters"] == 2.0
  eng.spec.correction = LiveCorrection()
  # Live traffic, with drafting priced free so that every call drafts (no rest). The unit, a
  # plain iteration, made absurdly slow: the calls look far cheaper than predicted, and the
  # correction hits its floor; absurdly fast: its ceiling.
  eng.spec.costs[-4:] = 0.0
  ps = [[1] + [5, 6, 7, 8, 9] * 5, [1] + [9, 3, 4] * 8]
  want = plain(model, ps, 60)
  for unit, scale in ((1e3, 0.5), (1e-9, 2.0)):
    eng.spec.correction = LiveCorrection()
    eng.spec.plain_iter_s = {b: unit for b in eng.buckets.decode}
    before = eng.stats()["spec_model_predicted_cost"]
    got = eng.generate(ps, stop=StopParams(max_tokens=60))
    assert [r.output_ids for r in got] == want
    assert eng.stats()["spec_model_predicted_cost"] - before > 32
    assert eng.spec.cost_scale == scale
    assert eng.stats()["spec_cost_scale"] == scale
    assert eng.spec.model_cost_scale == 1.0  # (ngram calls feed no model drafter)
  # A call that compiled (here: every call, as patched) is timed for neither the calibration
  # nor the correction: its seconds would be a compile's.
  class Compiling:  # a CompileCounter that saw a compile in every call
    count = 1
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      pass
  monkeypatch.setattr(runtime, "CompileCounter", Compiling)
  before = eng.stats()
  got = eng.generate(ps, stop=StopParams(max_tokens=60))
  assert [r.output_ids for r in got] == want
  after = eng.stats()
  loops = lambda st: sum(v for k, v in st.items() if k.startswith("spec_k"))
  assert loops(after) > loops(before)  # it ran the speculative loop
  for key in ("spec_model_predicted_cost", "spec_model_measured_cost", "spec_cost_scale"):
    assert after[key] == before[key], key
