"""Speculative decoding in the serving engine: adaptive draft length with a measured cost model,
drafters chosen per request, MTP and draft-model drafting over the paged cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.cache import init_cache
from engine.model.transformer import forward, forward_mtp
from engine.runtime.buckets import CompileCounter
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import catch_up
from engine.runtime.speculative.serving import DRAFTER_IDS, drafter_id
from engine_spec_helpers import SMALL, assert_pool_full, fresh_prompts, plain, spec_model
from model_configs import perturbed


@pytest.fixture(scope="module")
def model():
  return spec_model()


def test_adaptive_k_backs_off_on_fresh_prompts_and_drafts_what_it_learned(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="learned", num_draft_tokens=4,
                                         adaptive_k=True, learned_table_slots=4096))
  eng.warmup()
  stats = eng.stats()
  fit = eng.spec.cost_fit  # measured at warm-up: every compiled k at two batch sizes
  assert set(fit["table"]) == {min(eng.buckets.decode), max(eng.buckets.decode)}
  assert all(set(row) == {0, 1, 2, 4} and all(t > 0 for t in row.values())
             for row in fit["table"].values())
  assert stats["spec_cost_base"] >= 0 and stats["spec_cost_pad_row"] >= 0
  assert stats["spec_cost_per_token"] >= 0 and set(fit["table_padded"]) == set(fit["table"])
  # The loops themselves were timed: the plain one (the unit) and the speculative one per k.
  assert set(fit["plain_loop"]) == set(fit["table_loop"]) == set(fit["table"])
  assert all(set(row) == {0, 1, 2, 4} for row in fit["table_loop"].values())
  assert stats["spec_cost_overhead"] >= 0
  # And a call's fixed cost beyond a plain call's (the loops timed over one token too).
  assert stats["spec_cost_call"] == eng.spec.call_cost >= 0
  ps = fresh_prompts(4, seed=5)
  want = plain(model, ps, 24)
  # Fresh prompts, empty table: nothing to draft, so plain decoding (k = 0) wins.
  with CompileCounter() as counter:  # warm-up compiled every program
    got = eng.generate(ps, stop=StopParams(max_tokens=24))
    eng.generate(ps[:1], SamplingParams(drafter="off", logprobs=1), StopParams(max_tokens=3))
  assert counter.count == 0
  assert [r.output_ids for r in got] == want
  k0 = eng.spec.k_steps.copy()
  assert 2 * k0[1:].sum() <= k0[0], k0  # (on this CPU: no speculative call at all)
  # Nothing paid, so most calls ran the plain loop (by the replayed evidence: no rest, no
  # probe); the table still learned their tokens.
  assert eng.stats()["spec_gated_calls"] > 0 and "spec_rest_calls" not in eng.stats()
  from engine.runtime.speculative import learned
  ctx, nxt = [], []
  for p, r in zip(ps, got):
    seq = p + r.output_ids
    for j in range(len(p) + 1, len(seq)):
      ctx.append(seq[j - 3:j])
      nxt.append(seq[j])
  tok, found = learned.lookup(eng.spec.table, jnp.asarray(ctx, jnp.int32), 0.5)
  assert np.mean(np.asarray(found) & (np.asarray(tok) == np.asarray(nxt))) > 0.9
  # The same prompts again: the table knows the continuations, the loop drafts again once
  # the old evidence has faded, and most tokens come from accepted drafts. (Costs of a
  # memory-bound device, where a verify block costs little more than a decode step: on these
  # CPU cores a tiny model's speculative iteration costs ~1.5x a plain one before it verifies
  # anything, and the measured model rightly drafts only on near-certain estimates.)
  eng.spec.costs[-4:] = 0.05, 0.03, 0.01, 0.0  # overhead, base, pad_row, per_token
  # And every plain call replayed (as on a GPU, where the replay costs ~nothing against a
  # call; here 2% of this tiny model's calls would replay one in ~20), so that the evidence
  # that the table now knows the answers arrives within the first calls.
  eng.spec.call_cost, eng.spec.replay_budget = 0.5, 1.0
  got = eng.generate(ps, stop=StopParams(max_tokens=24))
  assert [r.output_ids for r in got] == want
  k1 = eng.spec.k_steps - k0
  assert k1[1:].sum() > 0, k1
  # The cost model's calibration on live traffic: speculative calls priced (at least 1 plus
  # the overhead per iteration, plus the call's fixed cost) and timed against the plain
  # iteration.
  stats = eng.stats()
  assert stats["spec_model_predicted_cost"] >= 1.5 + stats["spec_cost_overhead"] > 0
  assert stats["spec_model_measured_cost"] > 0
  # (How many calls speculate depends on timings: the live correction of the measured costs.
  # CI once saw exactly 24 accepted of the 96 tokens.)
  assert eng.counters["spec_accepted"] >= 0.2 * 4 * 24
  assert eng.stats()["spec_k4_loops"] == eng.spec.k_steps[3]
  assert_pool_full(eng)


def test_drafter_per_request(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, drafters=("ngram", "learned"),
                                         num_draft_tokens=3, learned_table_slots=1024))
  ps = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 10, 11, 12, 13, 14, 15, 16], [1, 40],
        [1, 5, 6, 7, 5, 6, 7, 5, 6]]
  samp = [SamplingParams(drafter="ngram"),
          SamplingParams(temperature=0.8, top_p=0.9, seed=5, drafter="learned"),
          SamplingParams(drafter="off"), SamplingParams()]  # None: the default (off here)
  want = plain(model, ps, 20, samp)
  per_drafter = {"ngram": 0, "learned": 0}
  for _ in range(2):
    got = eng.generate(ps, samp, StopParams(max_tokens=20))
    assert [r.output_ids for r in got] == want
    per_drafter["ngram"] += got[0].usage().spec_accepted_tokens
    per_drafter["learned"] += got[1].usage().spec_draft_tokens
  use = [r.usage() for r in got]
  assert use[0].spec_accepted_tokens > 0 and use[1].spec_draft_tokens > 0
  stats = eng.stats()  # per drafter, both rounds
  assert stats["spec_accepted_ngram"] == per_drafter["ngram"]
  assert stats["spec_drafted_learned"] == per_drafter["learned"]
  assert stats["spec_mean_accepted_length_ngram"] > 1
  # Per draft slot: drafted and accepted tokens add up to the totals; slot 0 is drafted most.
  slots = range(3)
  assert sum(stats[f"spec_pos{j}_drafted"] for j in slots) == eng.counters["spec_drafted"]
  assert sum(stats[f"spec_pos{j}_accepted"] for j in slots) == eng.counters["spec_accepted"]
  assert stats["spec_pos0_drafted"] >= stats["spec_pos2_drafted"] > 0
  assert all(0 < stats[f"spec_pos{j}_estimate_{d}"] < 1 for j in slots for d in per_drafter)
  # The goodput model's calibration: iterations that drafted emitted at least one token per
  # live row, and the model expected at least that many.
  assert stats["spec_model_emitted_tokens"] >= eng.counters["spec_accepted"] > 0
  assert stats["spec_model_expected_tokens"] > 0
  assert use[2].spec_draft_tokens == 0 and use[3].spec_draft_tokens == 0
  for bad in ("mtp", "draft"):
    with pytest.raises(ValueError, match="drafter"):
      eng.add_request([1, 2], SamplingParams(drafter=bad))
  with pytest.raises(ValueError, match="drafter"):
    eng.add_request([1, 2], SamplingParams(drafter="eagle"))
  # Logprobs of drafting rows come from the verify logits: equal to plain decoding's.
  ref = eng.generate(ps[:1], SamplingParams(logprobs=3), StopParams(max_tokens=20))[0]
  got = eng.generate(ps[:2], [SamplingParams(logprobs=3, drafter="ngram"),
                              SamplingParams(logprobs=2, drafter="off")],
                     StopParams(max_tokens=20))
  assert got[0].output_ids == ref.output_ids == want[0]
  assert got[0].usage().spec_accepted_tokens > 0
  assert len(got[0].output_logprobs) == 20 and len(got[1].output_logprobs) == 20
  for a, r in zip(got[0].output_logprobs, ref.output_logprobs):
    assert a.logprob == pytest.approx(r.logprob, abs=1e-4)
    assert [t for t, _ in a.top] == [t for t, _ in r.top] and len(a.top) == 3
  assert_pool_full(eng)


def check_mtp_state(eng, req, model):
  """The engine's MTP cache entries (positions < num_computed) and the request's MTP hidden
  state equal a one-shot target + MTP forward over the request's tokens."""
  cfg, params = model
  ids, n = req.all_ids, req.num_computed
  assert n == len(ids) - 1
  pt = jnp.asarray([req.pages + [0] * (eng.max_pages_per_seq - len(req.pages))])
  cache = init_cache(cfg, eng.pool.num_pages, 8, jnp.float32)
  start, n_new = jnp.asarray([0]), jnp.asarray([n])
  hidden, cache = forward(params, cache, jnp.asarray([ids[:n]]), start, n_new, pt, cfg=cfg)
  out, cache = forward_mtp(params, cache, hidden, jnp.asarray([ids[1:]]), start, n_new, pt,
                           cfg=cfg)
  pos = np.arange(n)
  idx = (np.asarray(pt)[0, pos // 8], pos % 8)
  mtp = cfg.num_layers
  np.testing.assert_allclose(np.asarray(eng.cache[mtp]["latent"])[idx],
                             np.asarray(cache[mtp]["latent"])[idx], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(req.mtp_hidden, np.asarray(out[0, n - 1]), rtol=1e-4, atol=1e-4)


def test_mtp_drafting_in_the_engine(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="mtp", num_draft_tokens=2))
  long = fresh_prompts(1, seed=9, lo=45, hi=46)[0]  # longer than one 32-token step
  rid = eng.add_request(long, SamplingParams(), StopParams(max_tokens=30))
  req = eng.requests[rid]
  while not req.output_ids:  # prefilled in chunks
    eng.step()
  check_mtp_state(eng, req, model)
  while len(req.output_ids) < 20:  # decode loops: verified blocks observed
    eng.step()
  check_mtp_state(eng, req, model)
  assert req.spec[1] > 0  # drafted
  for _ in eng.run():
    pass
  ps = [long] + fresh_prompts(3, seed=10)
  want = plain(model, ps, 30)
  assert req.output_ids == want[0]
  got = eng.generate(ps, stop=StopParams(max_tokens=30))
  assert [r.output_ids for r in got] == want
  assert eng.counters["spec_drafted"] > 0  # (a random MTP layer is rarely right)
  # Preempted and recomputed (a tight pool): the same output.
  tight = Engine(cfg, params, EngineConfig(**dict(SMALL, max_model_len=64), num_pages=13,
                                           speculative="mtp", num_draft_tokens=2))
  ps = fresh_prompts(6, seed=21, lo=20, hi=30)
  got = tight.generate(ps, stop=StopParams(max_tokens=24))
  assert tight.scheduler.num_preemptions > 0
  assert [r.output_ids for r in got] == plain(model, ps, 24)
  assert_pool_full(tight)


def test_draft_model_drafting_in_the_engine(model):
  cfg, params = model
  draft = (cfg, perturbed(params, 0.05))
  ps = fresh_prompts(3, seed=12, lo=35, hi=45) + [[1, 5, 6, 7, 5, 6, 7, 5, 6]]
  samp = [SamplingParams(), SamplingParams(drafter="ngram"), SamplingParams(drafter="off"),
          SamplingParams(temperature=1.0, top_k=1, seed=3)]  # top_k 1: greedy via sampling
  want = plain(model, ps, 24)
  # The target as its own draft model: its cache is right (caught up over each prompt before
  # the row's first loop call, fed after fully accepted blocks), so every greedy draft is
  # accepted.
  same = Engine(cfg, params, EngineConfig(**SMALL, speculative="draft", drafters=("ngram",),
                                          num_draft_tokens=3), draft=(cfg, params))
  got = same.generate(ps, samp, StopParams(max_tokens=24))
  assert [r.output_ids for r in got] == want
  use = [r.usage() for r in got]
  assert use[0].spec_accepted_tokens == use[0].spec_draft_tokens > 10
  assert use[3].spec_accepted_tokens > 0 and use[2].spec_draft_tokens == 0
  # A draft model that is often right, not always; preempted and recomputed requests.
  tight = Engine(cfg, params, EngineConfig(**dict(SMALL, max_model_len=64), num_pages=13,
                                           speculative="draft", num_draft_tokens=3),
                 draft=draft)
  ps = fresh_prompts(6, seed=21, lo=20, hi=30)
  got = tight.generate(ps, stop=StopParams(max_tokens=24))
  assert tight.scheduler.num_preemptions > 0
  assert [r.output_ids for r in got] == plain(model, ps, 24)
  use = [r.usage() for r in got]
  assert 0 < sum(u.spec_accepted_tokens for u in use) < sum(u.spec_draft_tokens for u in use)
  assert_pool_full(tight)


def test_auto_drafter_picks_what_pays_per_request_and_keeps_greedy_output(model):
  cfg, params = model
  # The target as its own draft model (always right, but it costs forwards) and the learned
  # table (free; right where it has seen the continuation).
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="auto",
                                         drafters=("learned", "draft"), num_draft_tokens=3,
                                         learned_table_slots=4096), draft=(cfg, params))
  a, b = fresh_prompts(2, seed=3)
  want = plain(model, [a, b], 20)
  eng.generate([b], SamplingParams(drafter="learned"), StopParams(max_tokens=20))
  got = eng.generate([a, b], stop=StopParams(max_tokens=20))
  assert [r.output_ids for r in got] == want
  steps = [r.drafter_steps for r in got]
  # Each row chose, per iteration, from its own evidence (every drafter's proposal checked
  # against what the row emitted): the draft model for the fresh request, the table for the
  # one it knows, which costs nothing.
  assert steps[0].get("draft", 0) > steps[0].get("learned", 0), steps
  assert steps[1].get("learned", 0) > steps[1].get("draft", 0), steps
  use = [r.usage() for r in got]
  assert use[0].spec_accepted_tokens > 10 and use[1].spec_accepted_tokens > 10, use
  stats = eng.stats()
  assert (stats.get("spec_auto_choice_draft", 0) + stats.get("spec_auto_choice_learned", 0)
          == sum(sum(x.values()) for x in steps))
  # The draft model is kept current only in calls where a row may use it.
  fed = stats["spec_fed_calls_draft"]
  assert fed >= 1
  eng.generate([a], SamplingParams(drafter="learned"), StopParams(max_tokens=20))
  assert eng.stats()["spec_fed_calls_draft"] == fed
  assert_pool_full(eng)
  with pytest.raises(ValueError, match="drafters"):
    Engine(cfg, params, EngineConfig(**SMALL, speculative="auto"))


def test_catch_up_plan_cuts_spans_like_the_scheduler():
  spans = [(0, 0, 40), (2, 16, 5), (3, 7, 30)]
  groups = catch_up.plan(spans, budget=32, max_spans=3)  # cut where the budget runs out
  assert groups == [[(0, 0, 32)], [(0, 32, 8), (2, 16, 5), (3, 7, 19)], [(3, 26, 11)]]
  assert catch_up.plan(spans, budget=32, max_spans=2) == [  # or the spans per step
      [(0, 0, 32)], [(0, 32, 8), (2, 16, 5)], [(3, 7, 30)]]
  assert catch_up.plan([], 32, 2) == []
  ids = [list(range(100, 150)), [], list(range(200, 240)), list(range(300, 340))]
  table = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
  tokens, start, n_new, rows = catch_up.pack(groups[1][:2], ids, table, lambda n: (5, 4))
  assert n_new.tolist() == [4, 4, 4, 1, 0] and start.tolist() == [32, 36, 16, 20, 0]
  assert tokens[0].tolist() == list(range(132, 136)) and tokens[3, 0] == 220
  assert rows.tolist() == [table[0].tolist()] * 2 + [table[2].tolist()] * 2 + [[0] * 3]


def test_draft_model_is_fed_lazily_and_caught_up_over_shared_prefixes(model):
  cfg, params = model
  # The target as its own draft model: a greedy draft is rejected only where the draft cache
  # is wrong, so "every draft accepted" checks that a catch-up filled every position.
  eng = Engine(cfg, params, EngineConfig(**SMALL, drafters=("ngram", "draft"),
                                         num_draft_tokens=3), draft=(cfg, params))
  eng.warmup()
  a = fresh_prompts(1, seed=31, lo=26, hi=27)[0]
  b, c = a + [7, 8, 9, 10, 11, 12], a + [7, 8, 9, 10, 11, 12, 40, 41]
  before = [np.array(x) for x in jax.tree.leaves(eng.spec.draft_cache)]
  eng.generate([a], SamplingParams(drafter="ngram"), StopParams(max_tokens=12))
  # Prefill and decoding of a request that does not draft with it never ran the draft model.
  after = jax.tree.leaves(eng.spec.draft_cache)
  assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(before, after, strict=True))
  assert eng.stats()["spec_draft_catch_up_tokens"] == 0
  with CompileCounter() as compiles:
    got_b = eng.generate([b], SamplingParams(drafter="draft"), StopParams(max_tokens=16))[0]
  assert compiles.compiled == 0
  use = got_b.usage()
  assert use.cached_tokens >= 24  # a's pages, computed without the draft model, shared
  # b is caught up over its whole prompt (the shared pages hold no draft entries) at its first
  # loop call, then fed as it decodes: every draft accepted.
  assert eng.stats()["spec_draft_catch_up_tokens"] == len(b)
  assert use.spec_accepted_tokens == use.spec_draft_tokens > 8
  # c shares b's pages, which now hold draft entries: only its own tokens are caught up.
  got_c = eng.generate([c], SamplingParams(drafter="draft"), StopParams(max_tokens=16))[0]
  use = got_c.usage()
  assert use.cached_tokens >= 24
  assert eng.stats()["spec_draft_catch_up_tokens"] == len(b) + len(c) - use.cached_tokens
  assert use.spec_accepted_tokens == use.spec_draft_tokens > 8
  assert [got_b.output_ids, got_c.output_ids] == plain(model, [b, c], 16)
  assert_pool_full(eng)


def test_draft_model_rows_rest_in_the_plain_loop_and_catch_up(model):
  cfg, params = model
  # The target as its own draft model, so drafts are all accepted exactly when the draft cache
  # is right. While drafting costs too much to pay, the rows rest in the plain loop; once it
  # pays they draft again from a draft cache caught up over the tokens decoded meanwhile.
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="draft", num_draft_tokens=3,
                                         adaptive_k=True), draft=(cfg, params))
  ps = fresh_prompts(2, seed=41)
  slot = drafter_id("draft")
  eng.spec.costs[slot] = 100.0  # a drafted column costs 100 plain iterations
  rids = [eng.add_request(p, stop=StopParams(max_tokens=40)) for p in ps]
  while eng.stats().get("spec_rest_calls", 0) < 2:
    assert eng.has_unfinished()
    eng.step()
  caught_up = eng.stats()["spec_draft_catch_up_tokens"]
  # Each prompt (and the token a row may have decoded in a mixed step while the other one was
  # still prefilling), at the first loop call.
  assert sum(map(len, ps)) <= caught_up <= sum(map(len, ps)) + len(ps)
  drafted = eng.counters["spec_drafted"]
  eng.spec.costs[slot] = 0.0
  eng.spec.costs[-4:] = 0.0, 0.03, 0.0, 0.0  # overhead, base, pad_row, per_token
  while eng.has_unfinished():
    eng.step()
  reqs = [eng.requests[rid] for rid in rids]
  assert [r.output_ids for r in reqs] == plain(model, ps, 40)
  assert eng.stats()["spec_draft_catch_up_tokens"] > caught_up  # the rested tokens
  assert eng.counters["spec_drafted"] - drafted > 10
  assert eng.counters["spec_accepted"] == eng.counters["spec_drafted"]
  for r in reqs:
    eng.release(r.request_id)
  assert_pool_full(eng)


def test_rest_after_fruitless_probes_doubles_and_probes_are_short(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**dict(SMALL, max_model_len=256), speculative="learned",
                                         num_draft_tokens=3, adaptive_k=True))
  eng.spec.costs[-4:] = 0.5, 5.0, 0.0, 0.0  # a drafted column costs 5 plain iterations
  eng.spec.replay_budget = 0.0  # (with the replay, `pays` decides instead: no rests)
  calls = []  # per decode-only step: (speculative?, token budget)
  real_speculates, real_decode = eng.spec.speculates, eng.spec.decode

  def speculates(reqs, num_steps, time=None, left=None):
    calls.append([real_speculates(reqs, num_steps, time, left), None])
    return calls[-1][0]

  def decode(*args, **kwargs):
    calls[-1][1] = args[10]  # num_steps
    return real_decode(*args, **kwargs)

  eng.spec.speculates, eng.spec.decode = speculates, decode
  p = fresh_prompts(1, seed=51, lo=8, hi=10)[0]
  got = eng.generate([p], stop=StopParams(max_tokens=230))[0]
  assert got.output_ids == plain(model, [p], 230)[0]
  pattern = [True] + [False] * 3 + [True] + [False] * 6 + [True] + [False] * 12 + [True]
  assert [s for s, _ in calls[:len(pattern)]] == pattern, calls
  # Every probe after a rest is one block's worth of tokens: k + 1.
  probes = [n for i, (s, n) in enumerate(calls) if s and i > 0]
  assert probes and set(probes) == {4}, calls
  assert eng.stats()["spec_rest_calls"] == sum(not s for s, _ in calls)


def test_with_the_replay_calls_speculate_where_replayed_evidence_says_they_pay(model):
  """With the replay on, a batch of replayable drafters (ngram, learned, auto) is not put to
  rest: each decode call speculates when its predicted saving covers the speculative call's
  fixed cost (`SpecRuntime.pays`). Plain calls' tokens are replayed through the drafters
  (`counterfactual.plain_call_evidence`), so estimates that said drafting loses move with what
  the drafter would have achieved, and the batch goes back to speculating without a probe."""
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**dict(SMALL, max_model_len=128),
                                         speculative="learned", num_draft_tokens=3,
                                         adaptive_k=True))
  eng.spec.costs[-4:] = 0.2, 0.1, 0.0, 0.0
  assert eng.spec.replay_budget > 0  # (`runtime.REPLAY_BUDGET`)
  p = fresh_prompts(1, seed=54, lo=8, hi=10)[0]
  want = plain(model, [p], 40)[0]
  # A request that does not draft teaches the table its answer (plain calls learn too) and
  # leaves no evidence (it has no drafter).
  eng.generate([p], SamplingParams(drafter="off"), StopParams(max_tokens=40))
  assert not eng.spec.accept_seen.any()
  # The learned drafter's first drafts rejected: estimates by which drafting loses.
  eng.spec.accept_seen[drafter_id("learned"), 0] = 0.0, 5.0
  eng.spec.accept = eng.spec._place_state(jnp.asarray(eng.spec.accept_seen))
  req = eng.add_request(p, stop=StopParams(max_tokens=40))
  assert not eng.spec.pays([eng.requests[req]], 8)
  got = eng.generate([p], stop=StopParams(max_tokens=40))[0]
  assert got.output_ids == want
  stats = eng.stats()
  assert stats["spec_gated_calls"] >= 1 and stats["spec_replayed_calls"] >= 1
  assert "spec_rest_calls" not in stats  # no rest, no probe: the evidence decided
  assert eng.spec.accept_seen[drafter_id("learned"), :, 0].min() > 0
  assert got.usage().spec_accepted_tokens > 10  # drafting resumed and paid


def test_auto_never_offers_a_model_drafter_that_cannot_pay(model, monkeypatch):
  """Nor does the per-call policy count on one; predicting the offer changes nothing."""
  from engine.runtime.speculative import call_policy, goodput
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="auto",
                                         drafters=("ngram", "mtp", "draft"), num_draft_tokens=3,
                                         adaptive_k=True), draft=(cfg, params))
  # Measured-like costs: the MTP layer costs more per column than a perfect chain returns.
  eng.spec.costs[drafter_id("mtp")], eng.spec.costs[drafter_id("draft")] = 0.8, 0.05
  eng.spec.costs[-4:] = 0.3, 0.2, 0.0, 0.0
  assert eng.spec.hopeless() == {"mtp"}
  got = eng.generate(fresh_prompts(2, seed=52), stop=StopParams(max_tokens=12))
  stats = eng.stats()
  assert "spec_fed_calls_mtp" not in stats and stats["spec_fed_calls_draft"] >= 1
  assert all("mtp" not in r.drafter_steps for r in got)
  # The per-call policy (`pays`) predicts the loop with the drafters it would be offered.
  offered = []
  real_row_drafters = goodput.row_drafters

  def row_drafters(gains, costs, allowed, *args, **kwargs):
    offered.append({d for d, a in zip(DRAFTER_IDS, allowed[0]) if a})
    return real_row_drafters(gains, costs, allowed, *args, **kwargs)
  monkeypatch.setattr(goodput, "row_drafters", row_drafters)
  row = eng.requests[eng.add_request([5, 6, 7], stop=StopParams(max_tokens=8))]
  call_policy.first_iteration_speedup(eng.spec, [row], 4)
  assert offered[-1] == {"ngram"} | eng.spec.model_drafters_for_auto([row], commit=False)
  assert "mtp" not in offered[-1]
  # The draft model, seen to be wrong and explored a moment ago, is not offered: nor counted.
  seen = np.array(eng.spec.accept_seen)
  seen[drafter_id("draft")] = (0.0, 20.0)
  eng.spec.accept_seen = seen
  eng.spec._offered["draft"] = eng.spec._auto_calls
  call_policy.first_iteration_speedup(eng.spec, [row], 4)
  assert offered[-1] == {"ngram"}
  eng.spec.costs[drafter_id("mtp")] = 0.1  # now it could pay: offered (explored) again
  state = (eng.spec._auto_calls, dict(eng.spec._offered))
  predicted = eng.spec.model_drafters_for_auto([], commit=False)
  assert (eng.spec._auto_calls, eng.spec._offered) == state  # a prediction changes nothing
  assert "mtp" in predicted and eng.spec.model_drafters_for_auto([]) == predicted
  assert eng.spec._auto_calls == state[0] + 1 and eng.spec._offered["mtp"] == state[0] + 1


def test_mtp_rows_give_mtp_up_where_it_cannot_pay(model):
  """Explicit MTP rows run the speculative loop (the MTP layer observes every verified block)
  unless MTP is hopeless: then they decode plainly for good, with the same output, and
  prefill stops feeding the MTP layer (its plain programs compiled at warm-up)."""
  from engine.runtime.buckets import CompileCounter
  cfg, params = model
  ps = fresh_prompts(3, seed=53)
  want = plain(model, ps, 20)
  for cost, hopeless in ((0.8, True), (0.05, False)):
    eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="mtp", num_draft_tokens=3,
                                           adaptive_k=True))

    def measured(*args, cost=cost, **kwargs):  # as if warm-up had measured these costs
      eng.spec.costs[drafter_id("mtp")] = cost
      eng.spec.costs[-4:] = 0.3, 0.2, 0.0, 0.0
      return eng.cache
    eng.spec.measure_costs = measured
    assert eng.spec.observes
    eng.warmup()
    assert (eng.spec.hopeless() == {"mtp"}) == hopeless and eng.spec.observes != hopeless
    with CompileCounter() as counter:
      got = eng.generate(ps, stop=StopParams(max_tokens=20))
    assert counter.count == 0
    assert [r.output_ids for r in got] == want
    stats = eng.stats()
    if hopeless:  # no speculative loop at all: every decode step is plain
      assert stats["spec_mtp_given_up"] == 3 and "spec_fed_calls_mtp" not in stats
      assert all(r.drafter is None and not r.drafter_steps for r in got)
    else:
      assert "spec_mtp_given_up" not in stats and stats["spec_fed_calls_mtp"] >= 1
      assert all(r.drafter_steps.get("mtp", 0) > 0 for r in got)
