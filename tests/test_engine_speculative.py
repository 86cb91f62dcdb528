"""Speculative decoding in the serving engine: drafters chosen per request, MTP and draft-model
drafting over the paged cache, and the one rule that decides when a call speculates (the cost
table's break-even, the estimates, exploration), tested by what it does."""

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
from engine.runtime.speculative import catch_up, costs, goodput, runtime
from engine_spec_helpers import SMALL, assert_pool_full, fresh_prompts, plain, spec_model
from model_configs import perturbed


@pytest.fixture(scope="module")
def model():
  return spec_model()


def roofline_of(eng):
  return costs.roofline(eng.spec.costs.batch_sizes, eng.spec.widths,
                        eng.spec._roofline_drafter_costs())


def table_of(eng, step):
  """A cost table whose T(B, k) is step(B, k) at every bucket."""
  t = roofline_of(eng)
  t.step = np.asarray([[step(b, k) for k in t.widths] for b in t.batch_sizes], np.float32)
  return t


# ---- the rule, by what it does -----------------------------------------------------------------

def test_fresh_text_with_dear_costs_drafts_nothing_and_keeps_its_output(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="auto", drafters=(
      "ngram", "learned"), num_draft_tokens=4, adaptive_k=True, learned_table_slots=4096))
  # Drafting would pay at full acceptance (k + 1 > 1 + 0.6 k) but not at the prior's 0.5.
  eng.spec.costs = table_of(eng, lambda b, k: 1.0 + 0.6 * k)
  ps = fresh_prompts(4, seed=5)
  samp = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]  # no greedy loops
  want = plain(model, ps, 60, samp)
  got = eng.generate(ps, samp, StopParams(max_tokens=60))
  assert [r.output_ids for r in got] == want
  stats = eng.stats()
  assert eng.counters["spec_drafted"] == 0
  # Plain calls, and now and then (EXPLORE_EVERY) one that looks ahead at k = 0.
  assert stats["spec_plain_calls"] >= runtime.EXPLORE_EVERY - 1
  assert stats["spec_explore_calls"] >= 1 and stats["spec_k0_loops"] > 0
  assert_pool_full(eng)


def test_a_known_continuation_with_cheap_costs_drafts_wide_blocks(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="learned", num_draft_tokens=4,
                                         adaptive_k=True, learned_table_slots=4096))
  eng.spec.costs = table_of(eng, lambda b, k: 1.0 + 0.05 * k)
  ps = fresh_prompts(2, seed=8)
  want = plain(model, ps, 32)
  first = eng.generate(ps, stop=StopParams(max_tokens=32))
  before = eng.counters["spec_accepted"]
  second = eng.generate(ps, stop=StopParams(max_tokens=32))
  assert [r.output_ids for r in first] == [r.output_ids for r in second] == want
  # The table learned the first pass: the second emits over 2.5 tokens per target forward.
  accepted = eng.counters["spec_accepted"] - before
  steps = sum(len(r.output_ids) - 1 for r in second) - accepted
  assert accepted > before and (accepted + steps) / steps > 2.5, (accepted, steps)
  assert eng.stats()["spec_k4_loops"] > 0
  assert_pool_full(eng)


def test_at_and_above_the_break_even_batch_the_plain_program_runs(model):
  cfg, params = model
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="ngram", num_draft_tokens=3))
  # One row: a block costs what a decode step does; two or more: k + 1 tokens' worth.
  eng.spec.costs = table_of(eng, lambda b, k: 1.0 if b == 1 else k + 1.0)
  assert eng.spec.costs.break_even == 2
  ps = [[1, 5, 6, 7, 5, 6, 7, 5, 6]] * 3
  for p in ps:
    eng.add_request(p, stop=StopParams(max_tokens=12 + 8 * len(eng.requests)))
  seen = []
  while eng.has_unfinished():
    rows, before = len(eng.scheduler.running), eng.stats()["spec_loop_calls"]
    eng.step()
    seen.append((rows, eng.stats()["spec_loop_calls"] - before))
  assert all(n == 0 for rows, n in seen if rows >= 2), seen
  assert any(n > 0 for rows, n in seen if rows == 1), seen


def test_the_rule_for_one_call():
  """`SpecRuntime.speculates` on requests of given estimates and tables (no device work)."""
  cfg, params = spec_model()
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="ngram", num_draft_tokens=4,
                                         adaptive_k=True))
  spec = eng.spec
  reqs = [eng.requests[eng.add_request([1, 2, 3])] for _ in range(2)]
  assert all(r.spec.drafter == "ngram" for r in reqs)
  spec.costs = table_of(eng, lambda b, k: 1.0 + 0.2 * k)
  assert spec.speculates(reqs, 8)  # the prior (0.5 per position) pays at these costs
  sure = np.zeros_like(reqs[0].spec.accept)
  sure[runtime.drafter_id("ngram"), :, 1] = 20.0  # every chain ended at once
  for r in reqs:
    r.spec.accept = sure.copy()
  assert not spec.speculates(reqs, 8)
  spec._plain_calls = runtime.EXPLORE_EVERY - 1  # ... until it is time to look again
  assert spec.speculates(reqs, 8)
  spec._plain_calls = 0
  for r in reqs:
    r.spec.accept[runtime.drafter_id("ngram"), :, :] = [30.0, 0.0]  # always accepted
  assert spec.speculates(reqs, 8)
  spec.costs.call = 3.0  # a fixed cost of 3 plain iterations: short calls stay plain
  assert spec.costs.min_call_tokens == 4
  assert not spec.speculates(reqs, 2) and spec.speculates(reqs, 4)
  off = [eng.requests[eng.add_request([1, 2], SamplingParams(drafter="off"))]]
  assert off[0].spec is None and not spec.speculates(off, 8)


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
  # The estimates' calibration: iterations that drafted emitted at least one token per live
  # row, and the estimates expected at least that many.
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
  np.testing.assert_allclose(req.spec.mtp_hidden, np.asarray(out[0, n - 1]), rtol=1e-4,
                             atol=1e-4)


def test_mtp_drafting_in_the_engine(model):
  cfg, params = model
  # A tight pool (12 pages: one long request fits, a batch does not), so the same engine also
  # preempts and recomputes (one engine, one set of compiled programs).
  eng = Engine(cfg, params, EngineConfig(**SMALL, num_pages=13, speculative="mtp",
                                         num_draft_tokens=2))
  long = fresh_prompts(1, seed=9, lo=45, hi=46)[0]  # longer than one 32-token step
  rid = eng.add_request(long, SamplingParams(), StopParams(max_tokens=30))
  req = eng.requests[rid]
  while not req.output_ids:  # prefilled in chunks
    eng.step()
  check_mtp_state(eng, req, model)
  while len(req.output_ids) < 20:  # decode loops: verified blocks observed
    eng.step()
  check_mtp_state(eng, req, model)
  assert req.spec.drafted > 0
  for _ in eng.run():
    pass
  ps = [long] + fresh_prompts(3, seed=10)
  want = plain(model, ps, 30)
  assert req.output_ids == want[0]
  drafted = eng.counters["spec_drafted"]
  got = eng.generate(ps, stop=StopParams(max_tokens=30))
  assert [r.output_ids for r in got] == want
  assert eng.counters["spec_drafted"] > drafted  # (a random MTP layer is rarely right)
  # Preempted and recomputed (six requests in the tight pool): the same output.
  preempted = eng.scheduler.num_preemptions
  ps = fresh_prompts(6, seed=21, lo=20, hi=30)
  got = eng.generate(ps, stop=StopParams(max_tokens=24))
  assert eng.scheduler.num_preemptions > preempted
  assert [r.output_ids for r in got] == plain(model, ps, 24)
  assert_pool_full(eng)


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
  # The target as its own draft model (always right; priced as a model a tenth of its size:
  # one as large could never pay) and the learned table (free; right where it has seen the
  # continuation).
  eng = Engine(cfg, params, EngineConfig(**SMALL, speculative="auto",
                                         drafters=("learned", "draft"), num_draft_tokens=3,
                                         learned_table_slots=4096), draft=(cfg, params))
  eng.spec.costs.drafter[:, runtime.drafter_id("draft")] = 0.1
  a, b = fresh_prompts(2, seed=3)
  want = plain(model, [a, b], 20)
  eng.generate([b], SamplingParams(drafter="learned"), StopParams(max_tokens=20))
  got = eng.generate([a, b], stop=StopParams(max_tokens=20))
  assert [r.output_ids for r in got] == want
  steps = [r.spec.drafter_steps for r in got]
  # Each row chose, per iteration, from its own evidence (every deterministic drafter's
  # proposal checked against what the row emitted): the draft model for the fresh request;
  # the one the table knows starts from the drafter's engine-wide estimates (poor: the table
  # knew nothing on the first pass) and moves to the table, which costs nothing.
  assert steps[0].get("draft", 0) > steps[0].get("learned", 0), steps
  assert steps[1].get("learned", 0) > 0, steps
  c = goodput.conditional_acceptance(got[1].spec.accept, 0.5, 1.0, xp=np)
  assert c[runtime.drafter_id("learned"), 0] > 0.7, c
  use = [r.usage() for r in got]
  assert use[0].spec_accepted_tokens > 10 and use[1].spec_accepted_tokens > 10, use
  stats = eng.stats()
  assert (stats.get("spec_auto_choice_draft", 0) + stats.get("spec_auto_choice_learned", 0)
          == sum(sum(x.values()) for x in steps))
  # The draft model is kept current only in calls where a row may use it.
  before = [np.array(x) for x in jax.tree.leaves(eng.spec.draft_cache)]
  eng.generate([a], SamplingParams(drafter="learned"), StopParams(max_tokens=20))
  after = jax.tree.leaves(eng.spec.draft_cache)
  assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(before, after, strict=True))
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
  eng.spec.costs = roofline_of(eng)  # (drafting nearly free, as on a memory-bound device)
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
  # loop call, then fed as it decodes: every draft accepted (`DraftEntries`).
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


