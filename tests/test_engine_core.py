"""The engine core apart from its model runner, and the drafter interface.

* A drafter from outside the package, registered through the interface (`drafters.registered`),
  is driven by the speculative loop: output identical to plain decoding, its acceptance counted.
* Every step is a `StepDescription` of host arrays and scalars: it survives `to_bytes` /
  `from_bytes`, and a fresh runner fed the round-tripped descriptions in order produces the
  same tokens (what a follower host of a multi-host replica does).
* Warm means warm: a second speculative `engine.generate` call compiles nothing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine
from engine.model.config import ModelConfig
from engine.runtime.buckets import CompileCounter
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.runner import ModelRunner
from engine.runtime.speculative import drafters
from engine.runtime.speculative.drafters import Drafter, Proposal
from engine.runtime.step_description import (DECODE, MIXED, SPEC_DECODE, StepDescription)
from engine_spec_helpers import SMALL, spec_model
from generation import loaded

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]
NEW = 24
# The toy drafter's fixed tokens by absolute position (set from plain decoding below); every
# WRONG-th one is changed, so some drafts are rejected.
FIXED: list[int] = []
WRONG = 5


@dataclasses.dataclass(frozen=True)
class FixedDrafter(Drafter):
  """Proposes, for the token at position p, FIXED[p]: no state, deterministic."""
  name = "fixed"
  deterministic = True
  cfg: ModelConfig
  tokens: tuple[int, ...] = ()

  @classmethod
  def create(cls, cfg, config, draft_cfg, head_cfg=None):
    return cls(cfg=cfg, tokens=tuple(FIXED))

  def propose(self, ctx, st, cache, k):
    table = jnp.asarray(self.tokens, jnp.int32)
    pos = ctx.n_cached[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
    draft = table[jnp.minimum(pos, len(self.tokens) - 1)]
    return Proposal(draft, jnp.full(ctx.tok.shape, k, jnp.int32), None, jnp.bool_(True)), st, \
        cache


@pytest.fixture(scope="module")
def model():
  return spec_model()


@pytest.fixture(scope="module")
def plain_tokens(model):
  eng = Engine(*model, EngineConfig(**SMALL))
  return eng.generate([PROMPT], stop=StopParams(max_tokens=NEW))[0].output_ids


@pytest.fixture(scope="module")
def toy(model, plain_tokens):
  """A speculative engine whose only drafter is `FixedDrafter`, and every step description it
  ran with its outputs."""
  full = PROMPT + plain_tokens
  FIXED[:] = [t + 1 if p % WRONG == 0 else t for p, t in enumerate(full)] + [0] * 8
  with drafters.registered(FixedDrafter):  # (for the module's tests)
    assert drafters.names()[-1] == "fixed"
    assert drafters.drafter_id("fixed") == len(drafters.ids()) - 1
    eng = Engine(*model, EngineConfig(**dict(SMALL, decode_batch_sizes=(1,)),
                                      speculative="fixed", num_draft_tokens=3,
                                      measure_spec_costs=False))
    seen = []
    real = eng.runner.execute

    def record(desc):
      out = real(desc)
      seen.append((desc, out))
      return out
    eng.runner.execute = record
    got = eng.generate([PROMPT], stop=StopParams(max_tokens=NEW))[0]
    eng.runner.execute = real
    yield eng, got, seen
  assert "fixed" not in drafters.names()


def test_a_registered_toy_drafter_is_lossless_and_its_acceptance_counted(toy, plain_tokens):
  eng, got, seen = toy
  assert got.output_ids == plain_tokens
  assert eng.drafters == ("fixed",) and got.spec.drafter == "fixed"
  use = got.usage()
  assert 0 < use.spec_accepted_tokens < use.spec_draft_tokens  # (every WRONG-th is wrong)
  stats = eng.stats()
  assert stats["spec_drafted_fixed"] == use.spec_draft_tokens
  assert stats["spec_accepted_fixed"] == use.spec_accepted_tokens
  assert sum(x.kind == SPEC_DECODE for x, _ in seen) >= 1
  # Rows' drafters travel as ids into the registry (the new one's is the last).
  spec = next(x for x, _ in seen if x.kind == SPEC_DECODE)
  last = len(drafters.ids()) - 1
  assert spec.arrays["row_drafter"][0] == drafters.drafter_id("fixed") == last
  assert spec.arrays["row_accept"].shape[1] == len(drafters.ids())

  @dataclasses.dataclass(frozen=True)
  class Another(FixedDrafter):
    name = "another"
  with drafters.registered(Another):
    assert drafters.names()[-2:] == ("fixed", "another")
    with pytest.raises(ValueError, match="registered already"):
      with drafters.registered(Another):
        pass
  assert "another" not in drafters.names()


def test_step_descriptions_round_trip_and_drive_a_fresh_runner(toy, model):
  """A fresh runner with the engine's static configuration, fed every description the engine
  ran, after a bytes round trip, produces the same tokens and the same cache."""
  eng, got, seen = toy
  assert {d.kind for d, _ in seen} >= {MIXED, SPEC_DECODE}
  follower = ModelRunner(*model, eng.config, num_pages=eng.pool.num_pages,
                         cache_dtype=jnp.float32, drafters=tuple(eng.runner.drafters.values()))
  for desc, out in seen:
    data = desc.to_bytes()
    assert isinstance(data, bytes)
    again = StepDescription.from_bytes(data)
    assert again.same_as(desc)
    replay = follower.execute(again)
    for key in ("sampled", "out", "count"):
      if key in out:
        np.testing.assert_array_equal(replay[key], out[key])
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, follower.cache),
               jax.tree.map(np.asarray, eng.cache))


def test_a_description_holds_host_data_only():
  desc = StepDescription(DECODE, dict(tokens=np.arange(4, dtype=np.int32),
                                      bits=np.zeros((2, 3), jnp.bfloat16)),
                         dict(num_steps=np.int32(8), want_logprobs=True, time_budget=np.inf))
  again = StepDescription.from_bytes(desc.to_bytes())
  assert again.same_as(desc) and again.arrays["bits"].dtype == jnp.bfloat16
  assert again.scalars == dict(num_steps=8, want_logprobs=True, time_budget=np.inf)
  with pytest.raises(TypeError, match="numpy array"):
    StepDescription(DECODE, dict(tokens=jnp.arange(4)))
  with pytest.raises(TypeError, match="scalar"):
    StepDescription(DECODE, {}, dict(fn=print))
  with pytest.raises(TypeError, match="numeric"):
    StepDescription(DECODE, dict(x=np.asarray(["a"], object)))
  with pytest.raises(ValueError, match="step kind"):
    StepDescription("eval")
  with pytest.raises(ValueError, match="magic"):
    StepDescription.from_bytes(b"pickle")


@pytest.mark.slow
def test_the_second_speculative_generate_compiles_nothing(model):
  """The first call makes the engine and runs; a second identical call, whose prompt now hits
  the prefix cache, finds every program compiled. (A fixed draft length drafts whatever the
  cost table says: its table is not timed, so no plain decode loop is compiled for it;
  test_generate_auto.py's "auto" engine is timed once.)"""
  cfg, params = model
  m = loaded(cfg, params)
  prompt = [1] + [5, 9, 13, 17, 21, 25] * 6  # (37 tokens: two full pages to hit)
  spec = engine.SpeculativeConfig("ngram", num_draft_tokens=3)
  first = engine.generate(m, prompt, max_new_tokens=24, ignore_eos=True, speculative=spec)
  (eng,) = m.llm.engines
  assert not eng.spec.costs.measured and not eng.config.adaptive_k
  hits = eng.pool.prefix_hits
  with CompileCounter() as counter:
    second = engine.generate(m, prompt, max_new_tokens=24, ignore_eos=True, speculative=spec)
  assert counter.count == 0
  assert second.token_ids == first.token_ids and second.spec["drafted"] > 0  # it drafted
  assert eng.pool.prefix_hits > hits and m.llm.engines == [eng]
