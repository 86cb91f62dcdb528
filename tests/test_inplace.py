"""Large state stays in place in the compiled decode loops (no per-iteration copies).

XLA copies a buffer that a conditional nested in another conditional updates (and one whose
old value a later read still needs): on a KV cache that is a copy of the cache every decode
iteration. These tests compile the programs and look for `copy` instructions of those shapes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model.config import config_from_dict
from engine.model.params import init_params
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.speculative.inplace import run_if
from engine.runtime.step_description import SPEC_DECODE
from model_configs import CONFIGS

_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")


def copied_shapes(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
          for m in _COPY.finditer(hlo)]


def hlo_shape(x) -> tuple[str, tuple[int, ...]]:
  names = {jnp.float32: "f32", jnp.bfloat16: "bf16", jnp.int32: "s32", jnp.uint32: "u32",
           jnp.bool_: "pred"}
  return names[jnp.dtype(x.dtype).type], tuple(x.shape)


def _nested(inner):
  """A loop whose body updates a 1M-element buffer through `inner` inside a switch."""
  def f(x, n):
    def body(c):
      i, x = c
      def branch(k, x):
        x = inner(i % 2 == 0, lambda x: x.at[i].set(x[i + 1] + k), x)
        return x.at[i + 2].set(1.0)
      return i + 1, jax.lax.switch(i % 3, [lambda x, k=k: branch(k, x) for k in range(3)], x)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]
  return f


def test_run_if_matches_cond_and_updates_in_place_where_cond_copies():
  x = jnp.asarray(np.random.default_rng(0).standard_normal(1 << 20), jnp.float32)
  cond = lambda p, f, s: jax.lax.cond(p, f, lambda s: s, s)
  for n in (0, 1, 4, 7):
    np.testing.assert_array_equal(_nested(run_if)(x, n), _nested(cond)(x, n))
  big = ("f32", (1 << 20,))
  compiled = lambda inner: jax.jit(_nested(inner), donate_argnums=0).lower(
      x, jnp.int32(3)).compile().as_text()
  assert big in copied_shapes(compiled(cond))  # what run_if is for (XLA's behaviour)
  assert big not in copied_shapes(compiled(run_if))
  # Structure preserved; pred False leaves the state as it was.
  state = (jnp.ones((2, 3)), [jnp.zeros((4,), jnp.int32)])
  out = run_if(jnp.bool_(False), lambda s: (s[0] * 2, [s[1][0] + 1]), state)
  np.testing.assert_array_equal(out[0], state[0])
  out = run_if(jnp.bool_(True), lambda s: (s[0] * 2, [s[1][0] + 1]), state)
  np.testing.assert_array_equal(out[1][0], np.ones((4,), np.int32))


def _dot_homes(hlo: str) -> list[str]:
  """For every dot in the compiled module: "while body" if it runs inside a while loop's body
  (directly or through fusions and calls), else "top level"."""
  comp, callers, homes = None, {}, []
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      comp = m.group(1)
      continue
    for callee in re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", line):
      callers[callee] = (comp, "body=%" + callee in line)
    if re.search(r" dot\(", line):
      homes.append(comp)
  out = []
  for home in homes:
    while home in callers and not callers[home][1]:
      home = callers[home][0]
    out.append("while body" if home in callers else "top level")
  return out


def test_run_if_keeps_closed_over_work_inside_the_loop():
  """XLA hoists loop-invariant work out of a while loop, where it runs even with zero trips:
  a drafter's LM head over its (closed-over) hidden state would run every iteration."""
  x, w = jnp.ones((64, 64)), jnp.full((64, 64), 0.5)

  def naive(pred, fn, state):
    trips = pred.astype(jnp.int32)
    return jax.lax.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, fn(c[1])),
                              (jnp.int32(0), state))[1]

  def homes(impl):
    f = jax.jit(lambda x, w, p: impl(p, lambda s: s + jnp.tanh(w @ w), x))
    np.testing.assert_allclose(f(x, w, jnp.bool_(True)), x + np.tanh(np.asarray(w @ w)),
                               rtol=1e-6)
    np.testing.assert_array_equal(f(x, w, jnp.bool_(False)), x)
    return _dot_homes(f.lower(x, w, jnp.bool_(False)).compile().as_text())

  assert homes(naive) == ["top level"]  # what run_if guards against (XLA's behaviour)
  assert homes(run_if) == ["while body"]


@pytest.mark.slow
def test_serving_loop_keeps_caches_and_table_in_place():
  """The speculative serving loop with every drafter: no copy of a target cache layer (the
  MTP layer's included), of the draft model's cache, or of the learned table."""
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_nextn_predict_layers=1))
  params = init_params(cfg, seed=3)
  draft_cfg = config_from_dict(CONFIGS["llama"])  # (the target as its own draft model would
  # pass the same parameter buffers twice, and XLA then copies the caches once per call)
  eng = Engine(cfg, params, EngineConfig(
      page_size=8, max_num_seqs=2, max_num_batched_tokens=32, row_widths=(16,),
      max_model_len=64, max_decode_steps=8, cache_dtype=jnp.float32, speculative="auto",
      drafters=("ngram", "learned", "mtp", "draft"), num_draft_tokens=2,
      learned_table_slots=4096), draft=(draft_cfg, init_params(draft_cfg, seed=4)))
  calls = []
  real = eng.runner.execute

  def capture(desc):  # the speculative loop's program, as the runner runs it
    if desc.kind == SPEC_DECODE:
      p = eng.runner.program(desc)
      calls.append(p.fn.lower(*p.args, **p.kwargs).compile().as_text())
    return real(desc)

  eng.runner.execute = capture
  eng.generate([[1, 5, 6, 7, 5, 6]], stop=StopParams(max_tokens=6))
  assert calls
  big = {hlo_shape(x) for x in jax.tree.leaves((eng.cache, eng.runner.state)) if x.size >= 1024}
  copied = set(copied_shapes(calls[0])) & big
  assert not copied, copied
