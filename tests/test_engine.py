"""The serving engine end to end on a tiny random MoE model (DeepSeek-V3 layout, MLA cache)."""

import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.model.transformer import forward_logits
from engine.model.cache import init_cache
from engine.runtime.buckets import CompileCounter
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.step_description import DECODE
from generation import generate_ids, loaded
from model_configs import CONFIGS
from service_harness import ENGINE_CONFIG

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def model():
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], max_position_embeddings=256))
  return cfg, init_params(cfg, seed=11, scale=2.0)


@pytest.fixture(scope="module")
def eng(model):
  cfg, params = model
  # 8 sequences: decode batches 1-8 and step shapes up to [16 x 16] (9 programs; 16 sequences
  # added a [16] decode loop and a [32 x 16] step, the two largest). Tests with more prompts
  # than that queue them: batches still form and change as requests finish and join.
  e = Engine(cfg, params, EngineConfig(page_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                                       row_widths=(16,), max_model_len=128, max_decode_steps=8,
                                       cache_dtype=jnp.float32))
  e.warmup_programs = e.warmup(progress=lambda done, total, what: WARMUP_PROGRESS.append(
      (done, total, what)))
  return e


WARMUP_PROGRESS = []


def test_warmup_reports_progress_program_by_program(eng, capsys):
  """`warmup`'s progress: each program n of N in order (the default prints it)."""
  n = eng.warmup_programs
  assert [(d, t) for d, t, _ in WARMUP_PROGRESS] == [(i, n) for i in range(1, n + 1)]
  assert {w.split()[0] for _, _, w in WARMUP_PROGRESS} >= {"step", "decode"}
  eng.warmup()  # compiled already: quick
  lines = capsys.readouterr().err.splitlines()
  assert lines[-1].startswith(f"[moejax] warm-up {n}/{n} programs, ")


def prompts(n, seed=0, lo=2, hi=40):
  rng = random.Random(seed)
  return [[1] + [rng.randrange(3, 320) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_pool_full(e):
  e.pool.check_invariants()
  assert e.pool.num_free == e.pool.num_pages - 1
  assert not e.scheduler.running and not e.scheduler.waiting


def test_engine_matches_the_batch_generator(eng, model):
  """A serving engine (chunked prefill in [16 x 16] blocks, requests joining as others
  finish) gives `engine.generate`'s tokens (a closed batch, one row per prompt)."""
  ps = prompts(4)
  got = eng.generate(ps, stop=StopParams(max_tokens=10))
  ref = generate_ids(loaded(*model), ps, max_new_tokens=10)
  assert [r.output_ids for r in got] == [c.token_ids for c in ref]
  assert all(r.finish_reason == "length" for r in got)
  # Once the batch is stable the device loop runs several decode steps per host step.
  steps = eng.counters["steps"]
  eng.generate(ps[:1], stop=StopParams(max_tokens=40))
  assert eng.counters["steps"] - steps < 12
  assert_pool_full(eng)


def test_batch_invariance_greedy_and_seeded(eng):
  ps = prompts(16, seed=1)
  samp = [SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_k=50, seed=i)
          for i in range(16)]
  together = eng.generate(ps, samp, StopParams(max_tokens=12))
  for p, s, r in zip(ps, samp, together):
    alone = eng.generate([p], s, StopParams(max_tokens=12))[0]
    assert alone.output_ids == r.output_ids
  assert len({tuple(r.output_ids) for r in together}) == 16
  assert eng.counters["decode_loops"] > 0
  assert_pool_full(eng)


def test_decode_loop_length_restarts_when_requests_join_not_when_they_leave(eng, model):
  """The loop length ramps 1, 2, 4, 8 after the batch forms; a request that finishes does
  not restart the ramp (nothing waits), so the one left runs full calls, not 1, 2, 4 again;
  a request that joins does restart it."""
  calls = []  # (token budget, rows) of every decode-loop call
  real = eng.runner.execute

  def spy(desc):
    if desc.kind == DECODE:
      calls.append((desc.scalars["num_steps"], int((desc.arrays["remaining"] > 0).sum())))
    return real(desc)
  eng.runner.execute = spy
  try:
    ps = prompts(2, seed=71)
    got = eng.generate(ps, stop=[StopParams(max_tokens=16), StopParams(max_tokens=40)])
  finally:
    eng.runner.execute = real
  assert [r.output_ids for r in got] == [c.token_ids[:n] for c, n in zip(
      generate_ids(loaded(*model), ps, max_new_tokens=40), (16, 40))]
  two = [n for n, rows in calls if rows == 2]
  one = [n for n, rows in calls if rows == 1]
  assert two == [1, 2, 4, 8], calls  # 15 tokens after the prefill's first
  assert one and one[0] == 8 and all(n == 8 for n in one[:-1]), calls
  # A request that joins a running one restarts the ramp.
  a = eng.add_request(ps[0], stop=StopParams(max_tokens=40))
  for _ in range(4):
    eng.step()
  calls.clear()
  eng.runner.execute = spy
  try:
    b = eng.add_request(ps[1], stop=StopParams(max_tokens=20))
    while eng.has_unfinished():
      eng.step()
  finally:
    eng.runner.execute = real
  assert [n for n, rows in calls if rows == 2][:2] == [1, 2], calls
  # A closed batch (`generate(closed=True)`: nothing else joins) takes full calls at once.
  calls.clear()
  eng.runner.execute = spy
  try:
    again = eng.generate(ps, stop=[StopParams(max_tokens=16), StopParams(max_tokens=40)],
                         closed=True)
  finally:
    eng.runner.execute = real
  assert [r.output_ids for r in again] == [r.output_ids for r in got]
  assert [n for n, rows in calls] == [8, 8, 8, 8, 7], calls  # 15 and 39 tokens to go
  for i in (a, b):
    eng.release(i)
  assert_pool_full(eng)


def test_no_compilation_after_warmup(eng):
  rng = random.Random(3)
  with CompileCounter() as counter:
    for wave in range(3):
      ps = prompts(rng.randrange(1, 17), seed=10 + wave, lo=1, hi=100)
      stops = [StopParams(max_tokens=rng.randrange(1, 20)) for _ in ps]
      samp = [SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i) for i in range(len(ps))]
      eng.generate(ps, samp, stops)
  assert counter.count == 0
  with CompileCounter() as sanity:  # the counter does see compilations
    jax.jit(lambda x: x * 3 + 1)(np.arange(5))
  assert sanity.count == 1
  assert_pool_full(eng)


def test_warmup_runs_every_program_without_touching_the_cache(eng):
  """Every warm-up program runs on the null page: a cache full of values comes back equal.
  (On the module's engine, already compiled: what is checked is what the programs write.)"""
  kept = eng.cache  # the engine's own cache (and its prefix pages), put back afterwards
  rng = np.random.default_rng(0)  # a cache full of values: a stray write would show
  eng.cache = jax.tree_util.tree_map(  # (placed as the engine's: its compiled programs run)
      lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding), kept)
  try:
    before = jax.tree_util.tree_map(np.asarray, eng.cache)
    with CompileCounter() as counter:
      assert eng.warmup(progress=False) == eng.warmup_programs > 0
    after = jax.tree_util.tree_map(np.asarray, eng.cache)
  finally:
    eng.cache = kept
  assert counter.count == 0  # the same programs as the fixture's warm-up ran, none new
  jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)


def test_prefix_cache_follow_up_turn_computes_only_new_tokens(eng):
  first = prompts(1, seed=5, lo=50, hi=51)[0]
  turn1 = eng.generate([first], stop=StopParams(max_tokens=8))[0]
  follow = turn1.all_ids + [7, 8, 9]
  hits_before = eng.pool.prefix_hits
  turn2 = eng.generate([follow], stop=StopParams(max_tokens=8))[0]
  usage = turn2.usage()
  assert usage.cached_tokens == (len(follow) - 1) // 8 * 8 and usage.cached_tokens >= 48
  assert eng.pool.prefix_hits > hits_before
  eng.pool.reset_prefix_cache()
  cold = eng.generate([follow], stop=StopParams(max_tokens=8))[0]
  assert cold.usage().cached_tokens == 0 and cold.output_ids == turn2.output_ids
  assert_pool_full(eng)


def test_abort_frees_pages_at_once(eng):
  ps = prompts(3, seed=8, lo=30, hi=40)
  ids = [eng.add_request(p, stop=StopParams(max_tokens=50)) for p in ps]
  queued = eng.queue_load()
  assert (queued.requests, queued.tokens) == (3, sum(map(len, ps)))
  eng.step()
  eng.step()
  held = eng.pool.num_pages - 1 - eng.pool.num_free
  assert held > 0
  assert eng.abort(ids[1]) and not eng.abort(ids[1]) and not eng.abort("nope")
  assert eng.pool.num_pages - 1 - eng.pool.num_free < held
  outs = [o for o in eng.run()]
  aborted = [o for o in outs if o.request_id == ids[1]]
  assert aborted and aborted[0].finish_reason == "abort" and aborted[0].finished
  assert eng.requests[ids[0]].finish_reason == "length"
  assert_pool_full(eng)


def test_abort_from_another_thread(eng):
  rid = eng.add_request(prompts(1, seed=9)[0], stop=StopParams(max_tokens=100))
  eng.step()
  t = threading.Thread(target=eng.abort, args=(rid,))
  t.start()
  t.join()
  list(eng.run())
  assert eng.requests[rid].finish_reason == "abort"
  assert_pool_full(eng)


def test_stop_ids_min_tokens_and_streamed_deltas(eng):
  p = prompts(1, seed=12)[0]
  free = eng.generate([p], stop=StopParams(max_tokens=16))[0].output_ids
  stop_tok = free[5]
  first = free.index(stop_tok)
  r = eng.generate([p], stop=StopParams(max_tokens=16, stop_token_ids=(stop_tok,)))[0]
  assert r.output_ids == free[:first + 1] and r.finish_reason == "stop"
  assert r.stop_reason == stop_tok
  r = eng.generate([p], stop=StopParams(max_tokens=16, stop_token_ids=(stop_tok,),
                                        min_tokens=first + 2))[0]
  assert len(r.output_ids) > first + 1
  rid = eng.add_request(p, stop=StopParams(max_tokens=16))
  streamed = [t for o in eng.run() if o.request_id == rid for t in o.new_token_ids]
  assert streamed == free
  assert_pool_full(eng)


def test_validation_names_the_field(eng):
  for kwargs, field in [(dict(prompt=[]), "prompt"), (dict(prompt=[1, 999]), "prompt"),
                        (dict(prompt="text"), "prompt"),
                        (dict(prompt=[1] * 128), "prompt"),
                        (dict(prompt=[1], stop=StopParams(max_tokens=0)), "max_tokens"),
                        (dict(prompt=[1], sampling=SamplingParams(top_p=0)), "top_p"),
                        (dict(prompt=[1], stop=StopParams(stop_token_ids=(5000,))),
                         "stop_token_ids")]:
    with pytest.raises(ValueError, match=field):
      eng.add_request(**kwargs)
  eng.add_request([1, 2], request_id="dup", stop=StopParams(max_tokens=1))
  with pytest.raises(ValueError, match="request_id"):
    eng.add_request([1, 2], request_id="dup")
  list(eng.run())
  assert_pool_full(eng)


def test_chunked_prefill_equals_one_shot_logits(model):
  """Rows of one request inside one step, and chunks across steps, give one-shot logits."""
  cfg, params = model
  ids = prompts(1, seed=4, lo=37, hi=38)[0]
  n = len(ids)
  page_table = jnp.arange(8, dtype=jnp.int32)[None, :] + 1

  def fresh():
    return init_cache(cfg, 9, 8, jnp.float32)

  one, _ = forward_logits(params, fresh(), jnp.asarray([ids]), jnp.asarray([0]),
                          jnp.asarray([n]), page_table, cfg=cfg)
  # The same prompt packed as three rows of width 16 in one step, then in two steps.
  rows = np.zeros((3, 16), np.int32)
  for r in range(3):
    chunk = ids[16 * r:16 * (r + 1)]
    rows[r, :len(chunk)] = chunk
  start = jnp.asarray([0, 16, 32])
  n_new = jnp.asarray([16, 16, n - 32])
  table3 = jnp.repeat(page_table, 3, axis=0)
  packed, _ = forward_logits(params, fresh(), jnp.asarray(rows), start, n_new, table3, cfg=cfg)
  packed = jnp.concatenate([packed[r, :int(n_new[r])] for r in range(3)])
  np.testing.assert_allclose(packed, one[0], rtol=1e-4, atol=1e-4)
  # Two steps, each chunk at the start of an n-wide block (the rest padding, as the engine's
  # rows pad): the one-shot forward's compiled program runs them.
  cache = fresh()
  first, second = np.zeros((1, n), np.int32), np.zeros((1, n), np.int32)
  first[0, :20], second[0, :n - 20] = ids[:20], ids[20:]
  a, cache = forward_logits(params, cache, jnp.asarray(first), jnp.asarray([0]),
                            jnp.asarray([20]), page_table, cfg=cfg)
  b, _ = forward_logits(params, cache, jnp.asarray(second), jnp.asarray([20]),
                        jnp.asarray([n - 20]), page_table, cfg=cfg)
  np.testing.assert_allclose(jnp.concatenate([a[0, :20], b[0, :n - 20]]), one[0], rtol=1e-4,
                             atol=1e-4)


@pytest.mark.slow
def test_preemption_recomputes_without_changing_outputs(model, eng):
  cfg, params = model
  ps = prompts(6, seed=21, lo=20, hi=30)
  samp = [SEEDED if i % 2 else SamplingParams() for i in range(6)]
  stop = StopParams(max_tokens=24)
  tight = Engine(cfg, params, EngineConfig(page_size=8, num_pages=13, max_num_seqs=4,
                                           max_num_batched_tokens=32, row_widths=(16,),
                                           max_model_len=64, cache_dtype=jnp.float32))
  want = [r.output_ids for r in eng.generate(ps, samp, stop)]  # a pool with room for all
  got = tight.generate(ps, samp, stop)
  assert tight.scheduler.num_preemptions > 0
  assert [r.output_ids for r in got] == want
  # The tight pool evicted prefix pages to make room; reruns are still right.
  assert [r.output_ids for r in tight.generate(ps[:2], samp[:2], stop)] == want[:2]
  assert_pool_full(tight)


@pytest.mark.slow
def test_text_deltas_and_stop_strings_with_the_demo_tokenizer():
  import engine as moejax
  demo = moejax.load("checkpoints/demo/target")
  # The serving tests' configuration (service_harness.ENGINE_CONFIG): the same demo programs,
  # which a test run's shared compilation cache then compiles once for all these modules.
  e = Engine.from_model(demo, ENGINE_CONFIG)
  e.warmup()
  counter = CompileCounter().__enter__()  # loaded weights are committed arrays: still none
  prompt = "def read_config(path):"
  free = e.generate([prompt], stop=StopParams(max_tokens=24, ignore_eos=True))[0]
  assert free.text == demo.decode(free.output_ids) and len(free.text) > 10
  rid = e.add_request(prompt, stop=StopParams(max_tokens=24, ignore_eos=True))
  deltas = "".join(o.text_delta for o in e.run() if o.request_id == rid)
  assert deltas == free.text
  stop_str = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
  cut = free.text.index(stop_str)
  rid = e.add_request(prompt, stop=StopParams(max_tokens=24, stop=(stop_str,), ignore_eos=True))
  outs = [o for o in e.run() if o.request_id == rid]
  assert "".join(o.text_delta for o in outs) == free.text[:cut]
  assert outs[-1].finish_reason == "stop" and e.requests[rid].text == free.text[:cut]
  assert outs[-1].stop_reason == stop_str
  assert_pool_full(e)
  counter.__exit__()
  assert counter.count == 0


@pytest.mark.slow
def test_persistent_compilation_cache_survives_a_restart(tmp_path):
  import json
  import os
  import subprocess
  import sys
  child = os.path.join(os.path.dirname(__file__), "compile_cache_child.py")

  def run():
    out = subprocess.run([sys.executable, child, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])

  first, second = run(), run()
  assert first["compiled"] >= first["programs"] > 0
  assert second["obtained"] >= second["programs"] and second["compiled"] == 0
  assert second["output"] == first["output"]


def test_logprobs_equal_the_models_distribution(eng, model):
  cfg, params = model
  prompt = prompts(1, seed=31)[0]
  r = eng.generate([prompt], SamplingParams(temperature=0.7, seed=3, logprobs=4),
                   StopParams(max_tokens=10))[0]
  assert len(r.output_logprobs) == len(r.output_ids) == 10
  seq = r.all_ids
  n = len(seq) - 1
  table = jnp.arange(1, 1 + -(-n // 8), dtype=jnp.int32)[None, :]
  logits, _ = forward_logits(params, init_cache(cfg, table.shape[1] + 1, 8, jnp.float32),
                             jnp.asarray([seq[:n]]), jnp.asarray([0]), jnp.asarray([n]), table,
                             cfg=cfg)
  ref = jax.nn.log_softmax(logits[0], axis=-1)
  for i, (tok, lp) in enumerate(zip(r.output_ids, r.output_logprobs)):
    row = np.asarray(ref[len(prompt) - 1 + i])
    assert lp.logprob == pytest.approx(row[tok], abs=1e-4)
    assert [t for t, _ in lp.top] == list(np.argsort(-row)[:4])
    assert [v for _, v in lp.top] == pytest.approx(np.sort(row)[::-1][:4], abs=1e-4)
  plain = eng.generate([prompt], SamplingParams(temperature=0.7, seed=3),
                       StopParams(max_tokens=10))[0]
  assert plain.output_ids == r.output_ids and plain.output_logprobs == []
  with pytest.raises(ValueError, match="logprobs"):
    eng.add_request([1, 2], SamplingParams(logprobs=21))
  assert_pool_full(eng)
