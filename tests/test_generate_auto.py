"""`engine.generate(..., speculative=...)`: the batch runs as requests of an engine the model
keeps (`model.llm`; with "auto": every drafter the model supports); greedy output equals plain
decoding."""

import jax.numpy as jnp
import pytest

import engine
from engine import NgramMemory, SpeculativeConfig
from engine.api import LoadedModel
from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.runtime import llm as llm_lib
from model_configs import CONFIGS, perturbed


@pytest.fixture(scope="module")
def model():
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
  params = init_params(cfg, seed=11, scale=2.0)
  return LoadedModel(config=cfg, params=params, tokenizer=None, eos_token_ids=(2,))


PROMPTS = [[1] + [5, 9, 13, 17, 21, 25] * 4, [1, 9, 10, 11, 12, 13, 14, 15, 16], [1, 40]]
# At most 17 tokens: every row ends in the first decode call (a closed batch gets 16 plain
# iterations' time), so the speculative loop compiles at one batch size.
NEW = [16, 12, 17]


@pytest.fixture(scope="module")
def want(model):
  return [r.token_ids for r in engine.generate(model, PROMPTS, max_new_tokens=NEW,
                                               ignore_eos=True)]


@pytest.fixture(scope="module")
def draft(model):
  return perturbed(model.params, 0.05, seed=3)


@pytest.mark.slow
def test_auto_uses_every_drafter_and_keeps_greedy_output(model, want, draft):
  spec = SpeculativeConfig("auto", 3, model.config, draft, measure_costs=False)
  assert spec.drafters(model.config) == ("ngram", "learned", "mtp", "draft")
  # The roofline table (no measurement): it drafts, whatever this CPU's timings.
  got = engine.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, speculative=spec)
  assert [r.token_ids for r in got] == want
  for r, p, n in zip(got, PROMPTS, NEW):
    assert r.finish_reason == "length" and r.prompt_tokens == len(p)
    assert r.spec["drafters"] == ["ngram", "learned", "mtp", "draft"]
    assert r.spec["steps"] + r.spec["accepted"] == n - 1  # every forward: 1 + accepted tokens
  assert sum(r.spec["accepted"] for r in got) > 0
  assert sum(got[0].spec["auto_choices"].values()) >= 1
  # Plain decoding (the benchmark's baseline): same tokens, no counters.
  off = engine.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True)
  assert [r.token_ids for r in off] == want
  assert all(r.spec is None for r in off)


@pytest.mark.slow
def test_the_engine_is_kept_between_calls(model, want, monkeypatch):
  """The model keeps its engines (no process-wide cache): calls of one configuration share
  one (its prefix cache serves a repeated prompt); the least recently used beyond
  KEPT_ENGINES is dropped, and so is an engine whose call failed; another model object has
  engines of its own."""
  from engine.runtime.engine import Engine
  model.llm.release()
  for i in range(2):
    off = engine.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    assert [r.token_ids for r in off] == want
    (eng,) = model.llm.engines
    if i == 0:
      first, hits = eng, eng.pool.prefix_hits
  assert eng is first and eng.pool.prefix_hits > hits  # the first prompt's full page
  for n in (2, 1):  # other batch sizes: other engines
    got = engine.generate(model, PROMPTS[:n], max_new_tokens=NEW[:n], ignore_eos=True)
    assert [r.token_ids for r in got] == want[:n]
  assert len(model.llm.engines) == llm_lib.KEPT_ENGINES == 2
  assert first not in model.llm.engines
  other = LoadedModel(config=model.config, params=model.params, tokenizer=None,
                      eos_token_ids=(2,))
  assert engine.generate(other, PROMPTS[0], max_new_tokens=NEW[0],
                         ignore_eos=True).token_ids == want[0]
  assert len(other.llm.engines) == 1 and other.llm.engines[0] not in model.llm.engines

  def fail(*args, **kwargs):
    raise RuntimeError("out of memory")
  monkeypatch.setattr(Engine, "generate", fail)
  with pytest.raises(RuntimeError, match="out of memory"):
    engine.generate(model, PROMPTS[:1], max_new_tokens=NEW[:1], ignore_eos=True)
  assert len(model.llm.engines) == 1
  model.llm.release()
  assert not model.llm.engines


def test_auto_keeps_the_learned_table_in_the_callers_memory(model, want, draft):
  memory = NgramMemory()  # (the engine's default size)
  before = memory.table
  spec = SpeculativeConfig("auto", 3, model.config, draft, memory=memory)
  # engine.generate times the cost table when it builds the engine (on this CPU drafting
  # may well not pay: the table learns from plain calls too). The first test's batch: its
  # compiled programs.
  counts = []
  for _ in range(2):  # the second call starts from the table the first one left
    got = engine.generate(model, PROMPTS, max_new_tokens=NEW, ignore_eos=True,
                          speculative=spec)
    assert [r.token_ids for r in got] == want
    assert memory.table is not before and int(jnp.sum(memory.table.used)) > 0
    before = memory.table
    (eng,) = [e for e in model.llm.engines if e.spec is not None]
    counts.append(eng.spec.costs)
  assert counts[0] is counts[1] and counts[0].measured  # timed once, for the kept engine
  assert counts[0].step.shape == (len(counts[0].batch_sizes), len(counts[0].widths))
  # Without a draft model "auto" leaves the draft drafter out.
  assert SpeculativeConfig("auto").drafters(model.config) == ("ngram", "learned", "mtp")
