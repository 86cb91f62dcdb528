"""The thinking budget, enforced on the device: at `budget` reasoning tokens every program (the
prefill's sampling, the plain decode loop, the speculative loop, the constrained rows' masked
step) writes the think-end marker itself, from per-row state that the host keeps across calls
and preemption (`engine/runtime/thought.py`).

The engine tests run the tiny kimi_k25 fixture (Kimi's tokenizer: `</think>` is token 279)
with K2.5's chat template, whose generation prompt opens the thought (`<think>`). The model is
random, so a thought never ends by itself within these lengths: the marker's position is the
budget's doing.
"""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

import engine as moejax
from engine.chat.reasoning import ReasoningSplitter, ThinkIds
from engine.chat.template import ChatTemplate
from engine.runtime import thought
from engine.runtime.engine import Engine
from engine.runtime.engine_config import EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingArrays, SamplingParams
from engine.service import chat
from engine.service.validation import RequestLimits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "golden", "fixtures", "kimi_k25_vision")
K25 = os.path.join(REPO, "tests", "golden", "fixtures", "chat", "templates",
                   "moonshotai-Kimi-K2.5.jinja")
THINK_END = 279


# ---- the rule: host and device agree ---------------------------------------------------------

def _random_rows(rng, n, length):
  """Token rows over a small vocabulary where 1 is <think>, 2 </think>, 3 another end."""
  return rng.choice(np.arange(8), size=(n, length), p=[.3, .08, .08, .04, .2, .1, .1, .1])


def _params(budgets, starts):
  return [SamplingParams(thinking_token_budget=b, think_start_token_id=s,
                         think_end_token_ids=(2, 3)) if b is not None else SamplingParams()
          for b, s in zip(budgets, starts)]


def test_device_rule_matches_the_host_rule_token_by_token():
  rng = np.random.default_rng(0)
  budgets = [0, 1, 3, 5, None, 2, 4, 7]
  starts = [None, 1, None, 1, None, 1, None, 1]
  params = _params(budgets, starts)
  params[3] = dataclasses.replace(params[3], think_in_prompt=True)
  rows = _random_rows(rng, len(params), 24)
  s = SamplingArrays.from_params(params)
  state, count = jnp.asarray(s.think_state), jnp.asarray(s.think_count)
  host = [p.thought() for p in params]
  live = jnp.ones((len(params),), bool)
  for j in range(rows.shape[1]):
    tok = thought.force(s, state, count, jnp.asarray(rows[:, j], jnp.int32))
    want = [thought_host_force(h, int(t)) for h, t in zip(host, rows[:, j])]
    np.testing.assert_array_equal(np.asarray(tok), want)
    state, count = thought.advance(s, state, count, tok, live)
    for h, t in zip(host, want):
      if h is not None:
        h.step(t)
    np.testing.assert_array_equal(np.asarray(count), [0 if h is None else h.count for h in host])
  # The budget bounds every row's reasoning count.
  for h in host:
    assert h is None or h.count <= h.budget


def thought_host_force(h, tok):
  return 2 if h is not None and h.must_end else tok


def test_force_block_replaces_the_draft_where_plain_decoding_would_force():
  rng = np.random.default_rng(1)
  params = _params([0, 2, 3, 4, None, 1], [None, None, 1, None, None, 1])
  s = SamplingArrays.from_params(params)
  drafts = _random_rows(rng, len(params), 5).astype(np.int32)
  n_draft = np.asarray([5, 5, 3, 2, 5, 0], np.int32)
  new, forced = thought.force_block(s, jnp.asarray(s.think_state), jnp.asarray(s.think_count),
                                    jnp.asarray(drafts), jnp.asarray(n_draft))
  for i, p in enumerate(params):
    h = p.thought()
    for j in range(6):
      assert bool(forced[i, j]) == bool(h is not None and h.must_end), (i, j)
      if j == 5 or j >= n_draft[i]:
        break
      want = 2 if h is not None and h.must_end else int(drafts[i, j])
      assert int(new[i, j]) == want, (i, j)
      if h is not None:
        h.step(want)
  assert int(jnp.sum(forced)) <= len(params)  # one forced slot per row at most


def test_the_chat_splitter_counts_with_the_engines_rule():
  ids = ThinkIds(start=1, end=2, also_end=(3,))
  split = ReasoningSplitter(None, starts_in_reasoning=True, ids=ids)
  assert split.count([5, 6, 1, 7, 2, 5, 1]) == 3   # a repeated <think> is a marker
  state = thought.ThoughtState.for_params(None, 1, (2, 3), inside=True).replay(
      [5, 6, 1, 7, 2, 5, 1])
  assert state.count == 3 and state.state == thought.ANSWER


# ---- the engine on the K2.5 fixture ---------------------------------------------------------

@pytest.fixture(scope="module")
def k25():
  model = moejax.load(FIXTURE)
  model = dataclasses.replace(model, config=dataclasses.replace(
      model.config, max_position_embeddings=256))
  with open(K25, encoding="utf-8") as fh:
    template = ChatTemplate(fh.read())
  return model, template


def _prompt(model, template, text):
  limits = RequestLimits(vocab_size=model.config.vocab_size, max_model_len=256,
                         num_eos_ids=len(model.eos_token_ids),
                         eos_token_ids=tuple(model.eos_token_ids))
  inputs = chat.prepare(template, model.tokenizer, limits,
                        chat.ChatRequest(messages=[{"role": "user", "content": text}]),
                        family=None)
  assert inputs.starts_in_reasoning and inputs.think_ids.end == THINK_END
  return inputs


def _budgeted(inputs, budget, **kw):
  return SamplingParams(**kw, **chat.sampling_fields(dataclasses.replace(
      inputs, thinking_budget=budget)))


def _reasoning(inputs, ids):
  split = ReasoningSplitter(None, starts_in_reasoning=True, ids=inputs.think_ids)
  return split.count(ids)


@pytest.fixture(scope="module")
def spec_eng(k25):
  """An n-gram speculative engine; requests choose drafter "off" for plain decoding."""
  model, _ = k25
  return Engine.from_model(model, EngineConfig(
      page_size=4, max_num_seqs=4, max_num_batched_tokens=64, row_widths=(16,),
      max_model_len=256, max_decode_steps=4, speculative="ngram", num_draft_tokens=3,
      measure_spec_costs=False))


TEXTS = ["Weather in Paris?", "Say hi hi hi hi hi hi.", "Count: 1 2 3 1 2 3 1 2 3", "Why?"]


@pytest.mark.slow
def test_budget_forces_the_marker_plain_and_speculative_alike(k25, spec_eng):
  model, template = k25
  inputs = [_prompt(model, template, t) for t in TEXTS]
  # (the first prompt's greedy thought repeats a token from its 16th on, so n-gram drafts are
  # accepted around its budget: there the marker replaces an accepted draft)
  budgets = [20, 0, 1, 5]
  stop = StopParams(max_tokens=28, skip_special_tokens=False)
  outs = {}
  for drafter in ("off", "ngram"):
    for temp in (0.0, 1.0):
      samp = [_budgeted(x, b, drafter=drafter, temperature=temp, seed=7 + i)
              for i, (x, b) in enumerate(zip(inputs, budgets))]
      done = spec_eng.generate([x.prompt_ids for x in inputs], samp, stop)
      outs[drafter, temp] = [r.output_ids for r in done]
      for x, b, r in zip(inputs, budgets, done):
        # exactly `budget` reasoning tokens, then `</think>` (a completion token)
        assert r.output_ids[b] == THINK_END, (drafter, temp, b, r.output_ids)
        assert THINK_END not in r.output_ids[:b]
        assert _reasoning(x, r.output_ids) == b
        assert r.thought.count == b and r.thought.state == thought.ANSWER
  # Speculative decoding is lossless relative to the budgeted plain output.
  assert outs["ngram", 0.0] == outs["off", 0.0]
  assert outs["ngram", 1.0] == outs["off", 1.0]
  assert spec_eng.counters["spec_accepted"] > 0
  # Without a budget the thought runs on (the marker above is the budget's doing).
  free = spec_eng.generate([inputs[0].prompt_ids], SamplingParams(drafter="off"), stop)[0]
  assert THINK_END not in free.output_ids[:21]
  assert free.output_ids[:20] == outs["off", 0.0][0][:20]


@pytest.mark.slow
def test_preemption_keeps_the_count(k25):
  model, template = k25
  inputs = [_prompt(model, template, t) for t in TEXTS]
  stop = StopParams(max_tokens=24, skip_special_tokens=False)
  samp = [_budgeted(x, 12 + i, temperature=float(i % 2), seed=i) for i, x in enumerate(inputs)]
  roomy = Engine.from_model(model, EngineConfig(
      page_size=4, max_num_seqs=4, max_num_batched_tokens=32, row_widths=(16,),
      max_model_len=256, max_decode_steps=4))
  want = [r.output_ids for r in roomy.generate([x.prompt_ids for x in inputs], samp, stop)]
  need = max(len(x.prompt_ids) for x in inputs) + 24
  tight = Engine.from_model(model, EngineConfig(
      page_size=4, num_pages=-(-need // 4) * 2 + 2, max_num_seqs=4, max_num_batched_tokens=32,
      row_widths=(16,), max_model_len=256, max_decode_steps=4))
  got = tight.generate([x.prompt_ids for x in inputs], samp, stop)
  assert tight.scheduler.num_preemptions > 0
  assert [r.output_ids for r in got] == want
  for x, s, r in zip(inputs, samp, got):
    b = s.thinking_token_budget
    assert r.output_ids[b] == THINK_END and _reasoning(x, r.output_ids) == b
