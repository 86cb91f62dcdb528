"""Warm-up runs every branch of the decode loops (in a module of its own: an engine's compiled
programs hold ~10,000 memory mappings until the module's end, `conftest.py`)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.speculative import runtime
from engine.runtime.speculative.loop import DRAFTER_IDS
from engine_spec_helpers import SMALL, spec_model


def test_warmup_runs_every_branch_of_the_decode_loops_and_learns_nothing(monkeypatch):
  """A branch's first run is slow (~40 ms on the CPU demo): warm-up runs the speculative
  loop at every batch size and block width with rows live, with and without logprobs and
  with rows drafting with each model drafter (here MTP), and the plain loop with logprobs;
  on the null page (the caches keep their values), and the table, the acceptance counts and
  the statistics stay as they were."""
  cfg, params = spec_model()
  eng = Engine(cfg, params, EngineConfig(**dict(SMALL, max_num_seqs=2),
                                         drafters=("learned", "mtp"),
                                         num_draft_tokens=2, adaptive_k=True))
  eng.spec.measure_costs = lambda *args, **kwargs: eng.cache  # (timed elsewhere)
  rng = np.random.default_rng(0)  # caches full of values: a stray write would show
  eng.cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                           eng.cache)
  before = jax.tree.map(np.asarray, eng.cache)
  table = jax.tree.map(np.asarray, eng.spec.table)
  stats = eng.stats()
  real_loop, runs = runtime.speculative_decode_loop, set()
  plain_runs = set()

  def recorded(real):
    def plain_loop(*args, **kwargs):
      a = inspect.signature(real).bind(*args, **kwargs).arguments
      if (not isinstance(a["remaining"], jax.core.Tracer)  # (not inside another program)
          and (np.asarray(a["remaining"]) > 0).all()):
        plain_runs.add((len(a["remaining"]), bool(a["want_logprobs"])))
      return real(*args, **kwargs)
    return plain_loop
  # (with a learned table, plain calls run the loop that also learns their tokens)
  monkeypatch.setattr(runtime.steps, "decode_loop", recorded(runtime.steps.decode_loop))
  monkeypatch.setattr(runtime, "decode_loop_learning", recorded(runtime.decode_loop_learning))

  def loop(*args, **kwargs):
    a = inspect.signature(real_loop).bind(*args, **kwargs).arguments
    live = np.asarray(a["remaining"]) > 0
    if live.all():
      drafters = {DRAFTER_IDS[int(i)] for i in np.asarray(a["row_drafter"])}
      runs.add((len(live), int(a["force_k"]), bool(a["want_logprobs"]), frozenset(drafters)))
    return real_loop(*args, **kwargs)
  monkeypatch.setattr(runtime, "speculative_decode_loop", loop)
  eng.warmup()
  for b in eng.buckets.decode:
    assert {(b, False), (b, True)} <= plain_runs
    for i in range(len(eng.spec.widths)):
      assert (b, i, False, frozenset({"off"})) in runs
      assert (b, i, True, frozenset({"mtp"})) in runs
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, eng.cache))
  jax.tree.map(np.testing.assert_array_equal, table, jax.tree.map(np.asarray,
                                                                   eng.spec.table))
  assert not eng.spec.accept_seen.any() and not np.asarray(eng.spec.accept).any()
  assert not eng.spec.k_steps.any() and eng.stats() == stats
