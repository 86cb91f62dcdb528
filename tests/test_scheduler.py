"""Page pool, prefix cache and scheduler bookkeeping (host only, no model)."""

import dataclasses
import random

import pytest

from engine.runtime.buckets import TrafficStats, derive_buckets, quarter_bucket
from engine.runtime.page_pool import NULL_PAGE, OutOfPages, PagePool, page_keys
from engine.runtime.request import Request, Status, StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.scheduler import Scheduler, SchedulerConfig


def make_request(rid, prompt, max_tokens=8, order=0):
  return Request(request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(),
                 stop=StopParams(max_tokens=max_tokens), stop_ids=(), arrival_order=order)


def test_pool_refcounts_and_lru_eviction():
  pool = PagePool(6, page_size=4)
  a = pool.allocate(3)
  assert NULL_PAGE not in a and len(set(a)) == 3 and pool.num_free == 2
  with pytest.raises(OutOfPages):
    pool.allocate(3)
  assert pool.num_free == 2  # all or nothing
  keys = page_keys(list(range(12)), 4)
  for p, k in zip(a, keys):
    pool.cache_page(p, k)
  pool.release(a)
  assert pool.num_free == 5 and pool.stats().cached == 3
  # A second sequence with the same first 8 tokens shares two pages.
  hit = pool.match_prefix(page_keys(list(range(8)) + [99, 98, 97, 96], 4))
  assert hit == a[:2] and all(pool.ref_count(p) == 1 for p in hit)
  # Under pressure the uncached pages go first, then the least recently freed cached page.
  got = pool.allocate(3)
  assert a[2] in got and pool.stats().cached == 2
  pool.check_invariants()
  pool.release(got + hit)
  pool.check_invariants()
  assert pool.num_free == 5
  with pytest.raises(RuntimeError):
    pool.release([got[0]])


def test_draft_entries_follow_pages_through_prefix_sharing_and_reallocation():
  """Which pages hold draft-model entries (`draft_model.DraftEntries`, keyed by the pool's page
  epochs): a shared prefix keeps them, a page handed out again loses them."""
  from engine.runtime.speculative.drafters.draft_model import DraftEntries
  pool = PagePool(6, page_size=4)
  entries = DraftEntries(pool.epoch, pool.page_size)
  sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32),
                    pool)
  a = make_request("a", range(1, 14))  # 13 tokens: 3 full pages and one more
  sched.add(a)
  sched.schedule()
  sched.record_computed(a, 13)
  assert entries.computed(a.pages) == 0
  entries.written(a.pages, 10)  # the draft model saw the first 10 tokens only
  assert entries.computed(a.pages) == 10
  sched.finish(a, "stop")
  # A request on the same prefix shares 3 pages: its first 2 and a half hold draft entries.
  b = make_request("b", list(range(1, 14)) + [50, 51], order=1)
  sched.add(b)
  sched.schedule()
  assert b.num_computed == 12 and entries.computed(b.pages) == 10
  sched.finish(b, "stop")
  # Pages handed out again lose them.
  got = pool.allocate(5)
  assert entries.computed(got) == 0 and pool.stats().cached == 0
  entries.written(got, 20)
  assert entries.computed(got) == 20
  pool.release(got)
  assert entries.computed(pool.allocate(5)) == 0


def test_pages_record_the_drafters_entries_they_hold():
  """Pages remember which drafters' own cache entries (an MTP layer's, an EAGLE-3 head's KV)
  they hold in full: a step that wrote none (the plain loop) leaves the pages it computed
  lacking them. Every row hits every cached page (less the last for a row drafting with such a
  drafter), and the pool counts the hit pages lacking the entries the row drafts from; a page
  holding more entries takes over the key of one holding fewer; preemption forgets the gap
  (the recompute writes every entry)."""
  from engine.runtime.speculative.policy import RequestSpec
  pool = PagePool(16, page_size=4)
  sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                    pool, observers=("mtp", "eagle3"))

  def admit(rid, ids, drafter=None, order=0):
    r = make_request(rid, ids, max_tokens=30, order=order)
    r.spec = None if drafter is None else RequestSpec(drafter, None)
    sched.add(r)
    sched.schedule()
    return r

  a = admit("a", range(1, 10))  # 9 tokens: prefilled (every entry), then 11 decoded
  sched.record_computed(a, 9)
  a.output_ids += list(range(100, 112))
  assert sched.grow(a, 20)
  sched.record_computed(a, 17, observed={"eagle3"})  # a speculative call fed eagle3 only
  sched.record_computed(a, 20, observed=set())  # a plain call
  assert a.pages_lacking == {2: {"mtp"}, 3: {"mtp"}, 4: {"mtp", "eagle3"}}
  both = {"mtp", "eagle3"}
  assert [pool.observed(p) for p in a.pages] == [both, both, {"eagle3"}, {"eagle3"}, set()]
  a_pages = list(a.pages)
  sched.finish(a, "stop")
  ids = a.all_ids[:20] + [7, 7]
  for rid, drafter, hit, lacking in (("off", None, 20, 0), ("auto", "auto", 16, 2),
                                     ("mtp", "mtp", 16, 2), ("eagle3", "eagle3", 16, 0)):
    before = pool.prefix_hits_lacking
    r = admit(rid, ids, drafter)
    assert r.num_computed == hit and pool.prefix_hits_lacking - before == lacking, rid
    if rid == "eagle3":
      e = r
    else:
      sched.finish(r, "stop")
  assert e.pages_lacking == {2: {"mtp"}, 3: {"mtp"}}  # (its hit pages')
  # e recomputes page 4 with every entry, which a's lacks: it takes over that key.
  sched.record_computed(e, len(ids))
  assert [pool.observed(p) for p in e.pages[:5]] == [both, both, {"eagle3"}, {"eagle3"}, both]
  assert e.pages[:4] == a_pages[:4] and e.pages[4] != a_pages[4]
  run = pool.match_prefix(page_keys(ids[:20], 4))
  assert run == e.pages[:5]
  pool.release(run)
  sched._preempt(e)
  assert e.pages_lacking == {} and e.num_computed == 0
  pool.check_invariants()


def test_page_keys_chain_over_the_prefix():
  a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
  b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
  assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same page tokens, different prefix
  assert page_keys([1, 2, 3, 4, 5], 4) == a[:1]
  assert page_keys([1, 2, 3, 4], 4, salt="other") != a[:1]


def test_scheduler_chunks_prefill_within_the_budget():
  pool = PagePool(64, page_size=4)
  s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64),
                pool)
  long, short = make_request("long", range(23)), make_request("short", range(3))
  s.add(long)
  s.add(short)
  plan = s.schedule()
  assert [(g.request.request_id, g.start, g.num_tokens) for g in plan.segments] == [
      ("long", 0, 10)]
  s.record_computed(long, 10)
  plan = s.schedule()
  assert [(g.request.request_id, g.start, g.num_tokens) for g in plan.segments] == [
      ("long", 10, 10)]
  s.record_computed(long, 20)
  plan = s.schedule()  # the rest of the long prompt shares the step with the short one
  assert [(g.request.request_id, g.num_tokens, g.samples) for g in plan.segments] == [
      ("long", 3, True), ("short", 3, True)]


def test_decode_loop_budget_halves_to_what_the_pages_hold():
  """A decode loop takes pages for its whole token budget up front; a budget (a speculative
  call's: several plain calls' tokens) that the free pages cannot hold is halved until they
  can, still one device loop, rather than falling to a one-token step."""
  pool = PagePool(8, page_size=4)  # 7 usable pages
  s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64),
                pool)
  a, b = make_request("a", range(1, 7), max_tokens=40), make_request("b", range(1, 7), 40, 1)
  for r in (a, b):
    s.add(r)
  s.schedule()
  for r in (a, b):
    s.record_computed(r, 6)
    r.output_ids.append(7)  # both decoding: 7 tokens, 6 cached, 2 pages each
  plan = s.schedule(20)  # 3 pages free; 20 or 10 more tokens each need too many, 5 fit
  assert plan.decode_only and plan.num_steps == 5
  assert [len(r.pages) for r in (a, b)] == [3, 3] and pool.num_free == 1
  plan = s.schedule(6)  # 6 tokens (to 12) fit the pages each holds
  assert plan.num_steps == 6 and pool.num_free == 1
  assert s.schedule(30).num_steps == 3  # 30, 15, 7: too many pages; 3 (to 9) fit


def test_random_workload_keeps_pages_accounted():
  """Adds, aborts, finishes and preemptions in random order: every page comes back."""
  rng = random.Random(0)
  pool = PagePool(24, page_size=4)
  s = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, max_model_len=48),
                pool)
  live = []
  shared = [rng.randrange(100) for _ in range(12)]
  for step in range(400):
    if rng.random() < 0.3:
      prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(100)
                                                         for _ in range(rng.randrange(1, 20))]
      r = make_request(f"r{step}", prompt, max_tokens=rng.randrange(1, 12), order=step)
      s.add(r)
      live.append(r)
    if live and rng.random() < 0.05:
      s.finish(live.pop(rng.randrange(len(live))), "abort")
    plan = s.schedule(max_decode_steps=rng.choice([1, 4]))
    for seg in plan.segments:
      req = seg.request
      assert req.status is Status.RUNNING and len(req.pages) * 4 >= seg.start + seg.num_tokens
      # Pages a request writes are never shared (writes go past its cached prefix).
      first = seg.start // 4
      assert all(pool.ref_count(p) == 1 for p in req.pages[first:])
      steps = plan.num_steps if plan.decode_only else 1
      if seg.samples:
        for _ in range(steps):
          req.output_ids.append(rng.randrange(100))
          if len(req.output_ids) >= req.stop.max_tokens:
            break
        s.record_computed(req, req.num_tokens - 1)
        if len(req.output_ids) >= req.stop.max_tokens:
          s.finish(req, "length")
          live.remove(req)
      else:
        s.record_computed(req, seg.start + seg.num_tokens)
    pool.check_invariants()
    held = {p for r in s.running for p in r.pages}
    assert sum(len(r.pages) for r in s.waiting) == 0  # waiting requests hold nothing
    assert all(pool.ref_count(p) >= 1 for p in held)
  for r in list(live):
    s.finish(r, "abort")
  pool.check_invariants()
  assert pool.num_free == 23 and s.num_preemptions > 0 and pool.prefix_hits > 0


def test_quarter_bucket_stays_within_a_quarter_with_four_shapes_per_octave():
  assert [quarter_bucket(n) for n in (1, 9, 128, 129, 142, 161, 200, 257)] == [
      1, 10, 128, 160, 160, 192, 224, 320]
  for multiple in (1, 16):
    sizes = [quarter_bucket(n, multiple) for n in range(1, 5000)]
    for n, size in enumerate(sizes, start=1):
      assert n <= size <= max(1.25 * n, n + multiple) and size % multiple == 0
      assert quarter_bucket(size, multiple) == size
    for e in range(6, 12):  # (2^e, 2^(e+1)]: four lengths
      assert len({s for n, s in enumerate(sizes, 1) if 2 ** e < n <= 2 ** (e + 1)}) == 4


def test_buckets_cover_every_step_and_follow_traffic():
  cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
  b = derive_buckets(cfg, row_widths=(16, 64))
  assert b.decode == (1, 2, 4, 8)
  assert b.pack([1] * 8) == (8, 16) and b.pack([64]) == (1, 64)
  assert b.pack([1, 1, 1, 40]) == (8, 16)
  rng = random.Random(1)
  for _ in range(200):  # any schedule the budget allows fits a compiled shape
    lengths, left = [], 64
    while left and len(lengths) < 8:
      n = rng.randint(1, left)
      lengths.append(n)
      left -= n
    b.pack(lengths)
  # Rows wider than the budget: one row per segment, so no more rows than sequences (each
  # shape compiles at warm-up: one that no step can use is wasted time).
  narrow = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
  wide = derive_buckets(narrow, row_widths=(32,))
  assert wide.mixed == ((32, (1, 2, 4)),) and wide.pack([1, 1, 1, 29]) == (4, 32)
  one = derive_buckets(dataclasses.replace(narrow, max_num_seqs=1), row_widths=(16,))
  assert one.mixed == ((16, (1, 2)),) and one.pack([32]) == (2, 16)  # one sequence, 2 rows
  stats = TrafficStats()
  stats.record_mixed([30, 31, 29, 30, 1])
  for rows in [3, 3, 3, 5, 6, 6]:
    stats.record_decode(rows)
  tuned = derive_buckets(cfg, row_widths=(16, 64), stats=stats)
  assert 32 in [w for w, _ in tuned.mixed]  # 30-token chunks fit one row
  assert 3 in tuned.decode and 6 in tuned.decode and tuned.decode[-1] == 8
  # Decode batch sizes given (EngineConfig.decode_batch_sizes) are taken as they are, over the
  # traffic's choice; max_num_seqs is always one.
  given = derive_buckets(cfg, row_widths=(16, 64), stats=stats, decode_sizes=(3, 3, 1))
  assert given.decode == (1, 3, 8) and given.decode_rows(2) == 3 and given.decode_rows(5) == 8
  for bad in [(0, 4), (9,)]:
    with pytest.raises(ValueError, match="decode_batch_sizes"):
      derive_buckets(cfg, decode_sizes=bad)


def test_page_keys_extend_from_known_keys():
  tokens = list(range(40))
  assert page_keys(tokens, 4, "s", known=page_keys(tokens[:12], 4, "s")) == page_keys(tokens, 4,
                                                                                    "s")
