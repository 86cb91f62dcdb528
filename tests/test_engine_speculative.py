"""Speculative decoding in the serving engine, by what it does: every drafter and "auto" keep
plain decoding's output in any batch company; the rule that decides when a call speculates
(the cost table's break-even, the estimates); MTP and draft-model state over the paged cache
(chunked prefill, preemption, lazy catch-up over shared prefixes); warm-up runs every branch.

Most engines here have one configuration (`EVERY`), so the module compiles its programs once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.runtime.buckets import CompileCounter
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import goodput
from engine.runtime.speculative.drafters import drafter_id, ids
from engine.runtime.speculative.drafters import draft_model as catch_up
from engine.runtime.step_description import DECODE, SPEC_DECODE
from engine_spec_helpers import (SMALL, assert_pool_full, check_mtp_state, every_drafter_engine,
                                 fresh_prompts, model_drafter_prices, plain, spec_model)
from model_configs import perturbed

REPEATS = [1, 5, 6, 7, 5, 6, 7, 5, 6]  # prompt lookup finds its continuation


@pytest.fixture(scope="module")
def model():
  return spec_model()


@pytest.fixture(scope="module")
def close(model):
  """A draft model that agrees with the target often, not always."""
  return perturbed(model[1], 0.05)


# ---- output: every drafter, any company ---------------------------------------------------------

@pytest.mark.slow
def test_every_drafter_and_auto_keep_plain_output_in_any_batch_company(model, close):
  eng = every_drafter_engine(model, draft=close)
  eng.spec.costs.drafter[:] = 0.0  # (with the roofline's T = 1: every iteration drafts)
  a, b, c, d, e = fresh_prompts(5, seed=12, lo=8, hi=40)
  hot = dict(temperature=0.8, top_p=0.9, seed=5)
  batches = [  # (prompt, drafter, sampling, max_tokens)
      [(REPEATS, "ngram", None, 20), (a, "learned", None, 24), (b, "mtp", None, 16),
       (c, "draft", None, 28)],
      [(a, "auto", None, 24), (REPEATS, "ngram", dict(temperature=1.0, top_k=20, min_p=0.05,
                                                      seed=6), 20),
       (d, "learned", hot, 18), (e, "off", None, 12)],
      [(b, "draft", dict(temperature=1.0, top_k=1, seed=3), 16), (c, "auto", None, 28)],
  ]
  for rows in batches + batches[:1]:  # (the first batch again: the table now knows it)
    ps = [p for p, *_ in rows]
    samp = [SamplingParams(drafter=dr, **(s or {})) for _, dr, s, _ in rows]
    stops = [StopParams(max_tokens=n) for *_, n in rows]
    got = eng.generate(ps, samp, stops)
    assert [r.output_ids for r in got] == plain(model, ps, stops, samp)
  use = {r.sampling.drafter: r.usage() for r in got}  # the first batch, second time
  assert use["ngram"].spec_accepted_tokens > 0 and use["learned"].spec_accepted_tokens > 0
  assert use["mtp"].spec_draft_tokens > 0  # (a random MTP layer is rarely right)
  assert 0 < use["draft"].spec_accepted_tokens < use["draft"].spec_draft_tokens
  stats = eng.stats()
  for dr in ("ngram", "learned", "mtp", "draft"):
    assert stats[f"spec_drafted_{dr}"] >= use[dr].spec_draft_tokens > 0
    assert all(0 < stats[f"spec_pos{j}_estimate_{dr}"] < 1 for j in range(3))
  assert stats["spec_auto_choice_draft"] + stats["spec_auto_choice_ngram"] + stats[
      "spec_auto_choice_learned"] + stats["spec_auto_choice_mtp"] > 0
  # Per draft slot: drafted and accepted tokens add up to the totals; slot 0 is drafted most.
  slots = range(3)
  assert sum(stats[f"spec_pos{j}_drafted"] for j in slots) == eng.counters["spec_drafted"]
  assert sum(stats[f"spec_pos{j}_accepted"] for j in slots) == eng.counters["spec_accepted"]
  assert stats["spec_pos0_drafted"] >= stats["spec_pos2_drafted"] > 0
  # The estimates' calibration: iterations that drafted emitted at least one token per live
  # row, the accepted drafts among them.
  assert stats["spec_model_emitted_tokens"] >= eng.counters["spec_accepted"] > 0
  assert stats["spec_model_expected_tokens"] > 0
  # Stop ids inside an accepted block end the row exactly where plain decoding does.
  stop = StopParams(max_tokens=20, min_tokens=2, stop_token_ids=(
      plain(model, [REPEATS], 20)[0][4],))
  got = eng.generate([REPEATS, a], SamplingParams(drafter="learned"), stop)  # (known text)
  want = every_drafter_engine(model).generate([REPEATS, a], SamplingParams(drafter="off"), stop)
  assert [(r.output_ids, r.finish_reason) for r in got] == [
      (r.output_ids, r.finish_reason) for r in want]
  assert got[0].finish_reason == "stop" and got[0].usage().spec_accepted_tokens > 0
  # Logprobs of drafting rows come from the verify logits: equal to plain decoding's.
  ref = eng.generate([REPEATS], SamplingParams(logprobs=3, drafter="off"),
                     StopParams(max_tokens=20))[0]
  got = eng.generate([REPEATS, a], [SamplingParams(logprobs=3, drafter="ngram"),
                                    SamplingParams(logprobs=2, drafter="off")],
                     StopParams(max_tokens=20))
  assert got[0].output_ids == ref.output_ids and got[0].usage().spec_accepted_tokens > 0
  assert len(got[0].output_logprobs) == 20 and len(got[1].output_logprobs) == 20
  for x, r in zip(got[0].output_logprobs, ref.output_logprobs):
    assert x.logprob == pytest.approx(r.logprob, abs=1e-4)
    assert [t for t, _ in x.top] == [t for t, _ in r.top] and len(x.top) == 3
  with pytest.raises(ValueError, match="drafter"):
    eng.add_request([1, 2], SamplingParams(drafter="eagle"))
  assert_pool_full(eng)


# ---- the rule, by what it does -----------------------------------------------------------------

@pytest.mark.slow
def test_fresh_text_with_dear_costs_drafts_nothing_and_keeps_its_output(model):
  # Drafting would pay at full acceptance (k + 1 > 1 + 0.6 k) but not at the prior's 0.5.
  eng = every_drafter_engine(model, step=lambda b, k: 1.0 + 0.6 * k, speculative="auto")
  ps = fresh_prompts(4, seed=5)
  samp = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]  # no greedy loops
  got = eng.generate(ps, samp, StopParams(max_tokens=60))
  assert [r.output_ids for r in got] == plain(model, ps, 60, samp)
  stats = eng.stats()
  assert eng.counters["spec_drafted"] == 0 and stats["spec_plain_calls"] > 0
  assert_pool_full(eng)


@pytest.mark.slow
def test_repetitive_text_with_cheap_costs_accepts_long_blocks_and_learns(model):
  eng = every_drafter_engine(model, step=lambda b, k: 1.0 + 0.05 * k, speculative="learned")
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
  assert eng.stats()["spec_k3_loops"] > 0
  assert_pool_full(eng)


@pytest.mark.slow
def test_at_and_above_the_break_even_batch_the_plain_program_runs(model):
  # Batch 2 (one or two rows): a block costs what a decode step does; batch 4 (three or
  # four): k + 1 tokens' worth.
  eng = every_drafter_engine(model, step=lambda b, k: 1.0 if b <= 2 else k + 1.0,
                             speculative="ngram")
  assert eng.spec.costs.batch_sizes == (2, 4) and eng.spec.costs.break_even == 4
  for _ in range(4):
    eng.add_request(REPEATS, stop=StopParams(max_tokens=12 + 8 * len(eng.requests)))
  seen = []
  while eng.has_unfinished():
    rows, before = len(eng.scheduler.running), eng.stats()["spec_loop_calls"]
    eng.step()
    seen.append((rows, eng.stats()["spec_loop_calls"] - before))
  assert all(n == 0 for rows, n in seen if rows >= 3), seen
  assert any(n > 0 for rows, n in seen if rows <= 2), seen
  # A row drafting with MTP beside three n-gram rows speculates in every call, there too
  # (its layer must see every verified block; the block never pays at batch 4, so the loop
  # runs width 0): its MTP cache entries and row state equal a one-shot pass mid-request.
  ps = [REPEATS] * 3 + fresh_prompts(1, seed=4)
  rids = [eng.add_request(p, SamplingParams(drafter=d), StopParams(max_tokens=40))
          for p, d in zip(ps, ["ngram"] * 3 + ["mtp"])]
  row, plain_calls = eng.requests[rids[-1]], eng.stats()["spec_plain_calls"]
  while len(row.output_ids) < 16:
    eng.step()
  check_mtp_state(eng, row, model)
  for _ in eng.run():
    pass
  assert row.output_ids == plain(model, ps[-1:], 40)[0]
  assert eng.stats()["spec_plain_calls"] == plain_calls and eng.stats()["spec_k0_loops"] > 0
  assert_pool_full(eng)


def test_the_rule_for_one_call(model):
  """`SpecPolicy.speculates` on requests of given estimates and tables (no device work)."""
  eng = every_drafter_engine(model, step=lambda b, k: 1.0 + 0.2 * k, speculative="ngram")
  spec = eng.spec
  reqs = [eng.requests[eng.add_request([1, 2, 3])] for _ in range(2)]
  assert all(r.spec.drafter == "ngram" for r in reqs)
  assert spec.speculates(reqs, 8)  # the prior (0.5 per position) pays at these costs
  for r in reqs:  # every chain ended at once
    r.spec.accept[drafter_id("ngram"), :, :] = [0.0, 20.0]
  assert not spec.speculates(reqs, 8)
  for r in reqs:  # always accepted
    r.spec.accept[drafter_id("ngram"), :, :] = [30.0, 0.0]
  assert spec.speculates(reqs, 8)
  spec.costs.call = 3.0  # a fixed cost of 3 plain iterations: short calls stay plain
  assert not spec.speculates(reqs, 2) and spec.speculates(reqs, 4)
  off = [eng.requests[eng.add_request([1, 2], SamplingParams(drafter="off"))]]
  assert off[0].spec is None and not spec.speculates(off, 8)


def test_a_fixed_draft_length_drafts_whatever_the_cost_table_says(model):
  """Without adaptive_k every decode-only call with a drafting row speculates: a measured
  table that says the block never pays (a loaded CPU's timing) or that a call's fixed cost
  needs long calls decides only adaptive engines (it kept a bench's MTP row at batch 16 from
  drafting at all). A row drafting with MTP (whose layer must see every verified block)
  speculates in every call, adaptive too: a plain call would leave its cache entries and row
  state behind (the loop's plan takes width 0 where the block does not pay)."""
  dear = lambda b, k: k + 2.0  # the block never pays, even at full acceptance
  for adaptive in (False, True):
    eng = every_drafter_engine(model, step=dear, speculative="ngram", adaptive_k=adaptive)
    assert eng.spec.widths == ((3,) if not adaptive else (0, 3))
    assert eng.spec.costs.break_even == 2
    reqs = [eng.requests[eng.add_request([1, 2, 3])] for _ in range(2)]
    mtp = [eng.requests[eng.add_request([1, 2, 3], SamplingParams(drafter=d))]
           for d in ("mtp", "auto")]
    assert [r.spec.drafter for r in reqs + mtp] == ["ngram", "ngram", "mtp", "auto"]
    assert eng.spec.speculates(reqs, 8) == (not adaptive)
    assert eng.spec.speculates(mtp[:1], 8) and eng.spec.speculates([reqs[0], mtp[0]], 8)
    assert eng.spec.speculates(mtp[1:], 8) == (not adaptive)  # ("auto": its estimates)
    eng.spec.costs.step[:] = 1.0  # now the block pays; a call's fixed cost is 3 iterations
    eng.spec.costs.call = 3.0
    assert eng.spec.speculates(reqs, 2) == (not adaptive) and eng.spec.speculates(reqs, 4)
    assert eng.spec.speculates(mtp[:1], 1) and eng.spec.speculates([reqs[1], mtp[0]], 2)


@pytest.mark.slow
def test_auto_drafter_picks_what_pays_per_request(model):
  # The target as its own draft model (always right) and the learned table (free; right where
  # it has seen the continuation).
  eng = every_drafter_engine(model, speculative="auto")
  a, b = fresh_prompts(2, seed=3)
  want = plain(model, [a, b], 20)
  eng.generate([b], SamplingParams(drafter="learned"), StopParams(max_tokens=20))
  got = eng.generate([a, b], stop=StopParams(max_tokens=20))
  assert [r.output_ids for r in got] == want
  steps = [r.spec.drafter_steps for r in got]
  # Each row chose, per iteration, from its own evidence (every drafter's proposal checked
  # against what the row emitted): the draft model over the table for the fresh request; the
  # one the table knows moves to the table, which costs nothing.
  assert steps[0].get("draft", 0) > steps[0].get("learned", 0), steps
  assert steps[1].get("learned", 0) > 0, steps
  c = goodput.conditional_acceptance(got[1].spec.accept, 0.5, 1.0, xp=np)
  assert c[drafter_id("learned"), 0] > 0.7, c
  use = [r.usage() for r in got]
  assert use[0].spec_accepted_tokens > 10 and use[1].spec_accepted_tokens > 10, use
  stats = eng.stats()
  assert sum(stats[f"spec_auto_choice_{d}"] for d in eng.spec.enabled) == sum(
      sum(x.values()) for x in steps)
  # The draft model is kept current only in calls where a row may use it.
  before = [np.array(x) for x in jax.tree.leaves(eng.runner.state["draft"])]
  eng.generate([a], SamplingParams(drafter="learned"), StopParams(max_tokens=20))
  after = jax.tree.leaves(eng.runner.state["draft"])
  assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(before, after, strict=True))
  assert_pool_full(eng)
  with pytest.raises(ValueError, match="drafters"):
    Engine(*model, EngineConfig(**SMALL, speculative="auto"))


# ---- model drafters' state ------------------------------------------------------------------------

@pytest.mark.slow
def test_model_drafters_in_a_tight_pool(model, close):
  """MTP and the draft model, fixed K, in a pool that one long request fits and a batch does
  not: MTP's cache entries and hidden state after chunked prefill, decode loops, a
  prefix-cache hit and a hit on pages a draft-model row decoded (no MTP entries); both drafters' rows preempted and recomputed keep plain decoding's
  output. Two rows at most
  (one decode batch size, 2: one loop program to compile) and 10 usable pages: the long
  request takes all 10, two of the batch's rows (6-7 pages each) do not fit."""
  cfg, params = model
  config = dict(SMALL, max_num_seqs=2, decode_batch_sizes=(2,), num_pages=11,
                speculative="mtp", drafters=("draft",), num_draft_tokens=3)
  eng = Engine(cfg, params, EngineConfig(**config), draft=(cfg, close))
  model_drafter_prices(eng)
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
  assert req.output_ids == plain(model, [long], 30)[0]
  # A prefix hit whose next token differs: the MTP entry at the hit's last position (and the
  # row state) depend on it, so the hit's last page is computed again.
  hits = eng.stats()["prefix_cache_hits"]
  other = long[:24] + [3 + (long[24] - 2) % 300, 5, 6]
  hit = eng.requests[eng.add_request(other, SamplingParams(), StopParams(max_tokens=2))]
  while not hit.output_ids:
    eng.step()
  assert eng.stats()["prefix_cache_hits"] > hits
  check_mtp_state(eng, hit, model)
  for _ in eng.run():
    pass
  # A row drafting with the draft model alone is not fed to the MTP layer: the pages past its
  # prompt lack MTP entries. An MTP row over its tokens hits them all the same (counted), and
  # the entries it computes itself are the one-shot pass's.
  page = eng.config.page_size
  p = fresh_prompts(1, seed=5, lo=17, hi=18)[0]  # 18 tokens: page 2 is part prompt, part not
  (d,) = eng.generate([p], SamplingParams(drafter="draft"), StopParams(max_tokens=20))
  assert d.spec.drafted > 0
  lacking = eng.stats()["prefix_cache_hits_lacking_drafter_entries"]
  hit = eng.requests[eng.add_request(p + d.output_ids[:15], SamplingParams(),
                                     StopParams(max_tokens=2))]
  while not hit.output_ids:
    eng.step()
  assert hit.cached_tokens == 3 * page  # pages 0-3, less the last
  assert eng.stats()["prefix_cache_hits_lacking_drafter_entries"] - lacking == 1  # page 2
  check_mtp_state(eng, hit, model, since=3 * page)
  for _ in eng.run():
    pass
  ps = fresh_prompts(6, seed=21, lo=20, hi=30)
  got = eng.generate(ps, [SamplingParams(drafter=["mtp", "draft"][i % 2]) for i in range(6)],
                     StopParams(max_tokens=24))
  assert [r.output_ids for r in got] == plain(model, ps, 24)
  # (While the pool is short the steps decode one token each; rows that run alone draft.)
  for d in ("mtp", "draft"):
    assert sum(r.usage().spec_draft_tokens for r in got
               if r.sampling.drafter == d and r.num_preemptions > 0) > 0, d
  use = [r.usage() for r in got]
  assert 0 < sum(u.spec_accepted_tokens for u in use) < sum(u.spec_draft_tokens for u in use)
  with pytest.raises(ValueError, match="drafter"):  # one the engine lacks
    eng.add_request([1, 2], SamplingParams(drafter="ngram"))
  assert_pool_full(eng)


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


# ---- warm-up ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_warmup_runs_every_branch_of_the_decode_loops_and_learns_nothing(model):
  """A branch's first run is slow (~40 ms on the CPU demo): warm-up runs the speculative
  loop at every batch size and block width with rows live, with and without logprobs and
  with rows drafting with each model drafter, and the plain loop with logprobs; on the null
  page (the caches keep their values), and the table, the acceptance counts and the
  statistics stay as they were. (What ran is read off the step descriptions warm-up hands
  the runner.)"""
  eng = every_drafter_engine(model)
  rng = np.random.default_rng(0)  # caches full of values: a stray write would show
  eng.cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                           eng.cache)
  state = eng.runner.state
  before = jax.tree.map(np.asarray, (eng.cache, state["learned"], state["draft"]))
  stats = eng.stats()
  real, runs, plain_runs = eng.runner.execute, set(), set()

  def spy(desc):
    a = desc.arrays
    if desc.kind in (DECODE, SPEC_DECODE) and (a["remaining"] > 0).all():
      b, logprobs = len(a["remaining"]), desc.scalars["want_logprobs"]
      if desc.kind == DECODE:
        plain_runs.add((b, logprobs))
      else:
        drafters = {ids()[int(i)] for i in a["row_drafter"]}
        runs.add((b, desc.scalars["force_width"], logprobs, frozenset(drafters)))
    return real(desc)
  eng.runner.execute = spy
  eng.warmup(progress=False)
  for b in eng.buckets.decode:
    assert {(b, False), (b, True)} <= plain_runs
    for i in range(len(eng.spec.widths)):
      assert (b, i, False, frozenset({"off"})) in runs
      for d in ("mtp", "draft"):
        assert (b, i, True, frozenset({d})) in runs
  state = eng.runner.state
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, (eng.cache, state["learned"], state["draft"])))
  assert not eng.spec.accept_seen.any()
  assert not eng.spec.k_steps.any() and eng.stats() == stats


@pytest.mark.slow
def test_draft_model_is_fed_lazily_and_caught_up_over_shared_prefixes(model):
  # The target as its own draft model: a greedy draft is rejected only where the draft cache
  # is wrong, so "every draft accepted" checks that a catch-up filled every position.
  eng = every_drafter_engine(model)
  eng.warmup(progress=False)
  a = fresh_prompts(1, seed=31, lo=26, hi=27)[0]
  b, c = a + [7, 8, 9, 10, 11, 12], a + [7, 8, 9, 10, 11, 12, 40, 41]
  before = [np.array(x) for x in jax.tree.leaves(eng.runner.state["draft"])]
  eng.generate([a], SamplingParams(drafter="ngram"), StopParams(max_tokens=12))
  # Prefill and decoding of a request that does not draft with it never ran the draft model.
  after = jax.tree.leaves(eng.runner.state["draft"])
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
