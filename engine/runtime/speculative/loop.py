"""`speculative_decode_loop`: the decode-only device loop with drafting.

`steps.decode_loop`'s contract (a `DecodeBatch`), but an iteration may draft up to K tokens per
row and verify them with ONE target forward over K + 1 positions (`verify_block`), each row
masked to its own drafts. Every enabled drafter (`drafters.Drafter`) proposes for the whole
batch and each row takes its own (or, for "auto" rows, the best by its estimates); model
drafters run their forwards only when a live row uses them. Every proposal is then checked
against what the row emitted (`matched`), which updates the acceptance estimates (`goodput`).
The policy's inputs (estimates, costs, each row's drafter and limit) are a `SpecInputs`.

`decode_loop_learning` is the plain loop of an engine whose drafters learn from every token
(the learned table).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache, compute_logits, forward, forward_hidden_states
from engine.runtime.sampling import MAX_TOP_LOGPROBS, SamplingArrays, token_logprobs
from engine.runtime import thought
from engine.runtime.speculative import goodput
from engine.runtime.speculative.acceptance import prefix_length, verify
from engine.runtime.speculative import drafters as registry
from engine.runtime.speculative.drafters import Drafter, LoopContext, aux_layers_of, drafter_id
from engine.runtime.speculative.inplace import place
from engine.runtime.steps import DecodeBatch, decode_loop




@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecInputs:
  """The speculative policy's inputs of one call (B rows, D drafter ids (`drafters.ids()`),
  J = K)."""
  history: jax.Array  # [B, W] each row's last history_len [B] tokens, oldest first, ending
  history_len: jax.Array  # with `tokens`; W >= history_len + max_steps (emitted ones appended)
  row_drafter: jax.Array  # [B] int32 drafter id (0: off)
  row_auto: jax.Array  # [B] bool: rows whose drafter the loop chooses among auto_allowed
  row_max_draft: jax.Array  # [B] int32: their limit of drafts per iteration
  row_accept: jax.Array  # [B, D, J, 2] each row's decayed (accepted, ended) counts (`goodput`)
  accept: jax.Array  # [D, J, 2] the same over drafting rows, engine-wide
  auto_allowed: jax.Array  # [D] bool: what "auto" rows may take
  fed: jax.Array  # [B, D] bool: rows each model drafter is kept current for in this call
  costs: jax.Array  # [len(widths) + D]: T(B, k) per compiled width, each drafter's column cost
  time_budget: jax.Array  # float32: the call's time in plain iterations (inf: no bound)
  force_width: jax.Array  # int32 index into widths forcing one (warm-up, timing), or -1


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The loop's static configuration (one compiled program per value)."""
  max_steps: int  # tokens per row per call, at most
  widths: tuple[int, ...]  # (0, K): `goodput.plan` takes plain or the block; (K,): the block
  drafters: tuple[Drafter, ...]
  cfg: ModelConfig
  impl: KernelChoice = REFERENCE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
  """One verification step's result (B rows, K drafts)."""
  cache: Cache
  hidden: jax.Array  # [B, K+1, H] target hidden states of the block (for MTP)
  n_accepted: jax.Array  # [B] accepted drafts
  extra: jax.Array  # [B] the token after them (correction or bonus)
  emitted: jax.Array  # [B, K+1] d_1 .. d_a, extra, then don't-care
  n_emit: jax.Array  # [B] tokens the row emits (a + 1, cut after a stop id; 0 if not live)
  stopped: jax.Array  # [B] bool: a stop id ended the row inside the block
  logits: jax.Array  # [B, K+1, V] target logits: slot i is the distribution of emitted[:, i]
  # {layer: [B, K+1, H]} the residual streams entering the drafters' `aux_layers` (EAGLE-3)
  aux: dict[int, jax.Array]


def verify_block(params: Params, cache: Cache, tok: jax.Array, draft: jax.Array,
                 q: jax.Array | None, n_draft: jax.Array, n_cached: jax.Array, live: jax.Array,
                 n_out: jax.Array, stop_ids: jax.Array, min_before_stop: jax.Array,
                 sampling: SamplingArrays, page_table: jax.Array, *, cfg: ModelConfig,
                 impl: KernelChoice, q_rows: jax.Array, aux_layers: tuple[int, ...] = (),
                 forced: jax.Array | None = None) -> Verified:
  """ONE target forward over `[tok, d_1 .. d_K]` (tok [B] at position n_cached, n_draft [B]
  real drafts), acceptance and stop ids (stop_ids [B, S] padded with -1; they count once a row
  has emitted min_before_stop [B] tokens, n_out [B] so far). q [B, K, V] is the drafts'
  distribution in `q_rows` [B]; the other rows' drafts (all, with q None) are deterministic.
  `aux_layers`: also return the residual streams entering these layers (`Verified.aux`).
  forced [B, K+1]: slots the thinking budget forces to the row's end marker (`thought.py`;
  the drafts already carry it there): verification sees only the marker allowed."""
  b, k = draft.shape
  live_i = live.astype(jnp.int32)
  block = jnp.concatenate([tok[:, None], draft], axis=1)
  aux = {}
  if aux_layers:
    hidden, cache, states = forward_hidden_states(
        params, cache, block, n_cached, (n_draft + 1) * live_i, page_table, layers=aux_layers,
        cfg=cfg, impl=impl)
    aux = dict(zip(aux_layers, states))
  else:
    hidden, cache = forward(params, cache, block, n_cached, (n_draft + 1) * live_i, page_table,
                            cfg=cfg, impl=impl)
  logits = compute_logits(params, hidden, cfg)  # [B, K+1, V]
  target = (logits if forced is None
            else thought.only_marker(logits, forced, sampling.think_end[:, 0]))
  n_acc, extra = verify(target, draft, q, n_draft, sampling, n_cached + 1)
  if q is not None:
    m_acc, m_extra = verify(target, draft, None, n_draft, sampling, n_cached + 1)
    n_acc, extra = jnp.where(q_rows, n_acc, m_acc), jnp.where(q_rows, extra, m_extra)
  slots = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  emitted = jnp.where(slots < n_acc[:, None],
                      jnp.concatenate([draft, jnp.zeros((b, 1), jnp.int32)], axis=1),
                      extra[:, None])
  n_emit = n_acc + 1
  is_stop = (jnp.any(emitted[:, :, None] == stop_ids[:, None, :], axis=-1)
             & (slots < n_emit[:, None])
             & (n_out[:, None] + slots + 1 >= min_before_stop[:, None]))
  stopped = jnp.any(is_stop, axis=1) & live
  n_emit = jnp.where(stopped, jnp.argmax(is_stop, axis=1).astype(jnp.int32) + 1, n_emit)
  return Verified(cache=cache, hidden=hidden, n_accepted=n_acc * live_i, extra=extra,
                  emitted=emitted, n_emit=n_emit * live_i, stopped=stopped, logits=logits,
                  aux=aux)


def matched(proposal: jax.Array, n_proposed: jax.Array, emitted: jax.Array, n_emit: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """What a drafter's proposal [B, P] (first n_proposed real) achieved against the tokens the
  row emitted [B, >= P] (first n_emit real): (leading matches [B], ended [B] bool: a mismatch
  or no proposal before the horizon min(P, n_emit); else censored)."""
  p = proposal.shape[1]
  m = prefix_length(proposal == emitted[:, :p], jnp.minimum(n_proposed, n_emit))
  return m, m < jnp.minimum(p, n_emit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
  """What one iteration hands the next, and the loop returns (B rows, J = K draft positions,
  D drafter ids)."""
  cache: Cache
  tok: jax.Array  # [B] newest token (position n_cached)
  n_cached: jax.Array  # [B]
  done: jax.Array  # [B] bool
  count: jax.Array  # [B] tokens emitted in this call
  out: jax.Array  # [B, max_steps] new tokens, -1 past each row's count
  stopped: jax.Array  # [B] bool: a stop id ended the row
  history: jax.Array  # [B, W] recent tokens, history_len [B] of them
  history_len: jax.Array
  accept: jax.Array  # [D, J, 2]
  row_accept: jax.Array  # [B, D, J, 2]
  ids: jax.Array  # [B] this iteration's drafter per row
  k_rows: jax.Array  # [B] this iteration's drafts per row
  by_drafter: jax.Array  # [B, D, 3] int32 per row and drafter: verify steps, drafted, accepted
  slots: jax.Array  # [B, 2, J] int32 steps that drafted / accepted a token at slot j (0-based)
  k_steps: jax.Array  # [len(widths)] iterations run with each block width
  calibration: jax.Array  # [3] tokens expected, emitted (when drafting); time (cost table)
  lps: tuple[jax.Array, jax.Array, jax.Array]  # as `steps.decode_loop`'s (if want_logprobs)
  drafters: dict[str, Any]  # each drafter's own loop state
  think_state: jax.Array  # [B] the thinking budget's state and count (`thought.py`)
  think_count: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopResult:
  """The loop's outputs (the cache and the drafters' persistent state come back apart)."""
  out: jax.Array
  count: jax.Array
  stopped: jax.Array
  lps: tuple[jax.Array, jax.Array, jax.Array]
  slots: jax.Array
  k_steps: jax.Array
  row_accept: jax.Array
  by_drafter: jax.Array
  accept: jax.Array
  calibration: jax.Array
  rows: dict[str, jax.Array]  # drafters' row state {name: [B, width]}


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache", "state"))
def speculative_decode_loop(params: Params, cache: Cache, batch: DecodeBatch, spec: SpecInputs,
                            state: dict[str, Any], rows: dict[str, jax.Array],
                            own_params: dict[str, Params], *, config: LoopConfig
                            ) -> tuple[LoopResult, Cache, dict[str, Any]]:
  """Up to `batch.num_steps` (<= max_steps; here tokens, not iterations) new tokens per row, in
  about `spec.time_budget`: no iteration starts once the iterations run (by the cost table,
  `spec.costs`) reach it.

  state: each drafter's persistent device state (donated: the learned table, the draft cache);
  rows: each drafter's row state [B, width] (the MTP hidden state); own_params: drafters' own
  weights (the draft model's). Returns (result, cache, state).
  """
  cfg, widths, drafters, impl = config.cfg, config.widths, config.drafters, config.impl
  aux_layers = aux_layers_of(drafters)
  b = batch.tokens.shape[0]
  all_ids = registry.ids()
  n_ids = len(all_ids)
  k_max = widths[-1]
  limit = jnp.minimum(batch.remaining, jnp.minimum(batch.num_steps, config.max_steps))
  present = {d.name for d in drafters}
  enabled = jnp.asarray([name in present for name in all_ids])
  model_ids = jnp.asarray([any(d.name == name and not d.deterministic for d in drafters)
                           for name in all_ids])
  fed_only = jnp.asarray([any(d.name == name and d.fed_per_row for d in drafters)
                          for name in all_ids])
  step_cost, drafter_cost = spec.costs[:len(widths)], spec.costs[len(widths):]
  page_table, sampling = batch.page_table, batch.sampling

  def context(d: Drafter, s: LoopState, live: jax.Array) -> LoopContext:
    i = drafter_id(d.name)
    return LoopContext(params=params, own_params=own_params.get(d.name), cfg=cfg, impl=impl,
                       page_table=page_table, sampling=sampling, tok=s.tok,
                       n_cached=s.n_cached, live=live, history=s.history,
                       history_len=s.history_len, uses=s.ids == i, fed=spec.fed[:, i],
                       k_max=k_max)

  def step(k: int, s: LoopState) -> LoopState:
    live = ~s.done
    # Every drafter's proposal of kk = max(k, 1) tokens (with k = 0 they are only compared
    # with the emitted token afterwards: evidence at no verify cost).
    kk = max(k, 1)
    cache, props, states, q = s.cache, {}, dict(s.drafters), None
    for d in drafters:
      ctx = context(d, s, live)
      props[d.name], states[d.name], cache = d.propose(ctx, states[d.name], cache, kk)
      p = props[d.name]
      if p.q is not None:
        q = p.q if q is None else jnp.where(ctx.uses[:, None, None], p.q, q)
    draft = jnp.zeros((b, kk), jnp.int32)
    n_draft = jnp.zeros((b,), jnp.int32)
    for name, p in props.items():
      use = s.ids == drafter_id(name)
      draft = jnp.where(use[:, None], p.tokens, draft)
      n_draft = jnp.where(use, p.count, n_draft)
    if k == 0:
      draft, n_draft, q = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32), None
    n_draft = jnp.where(live, jnp.minimum(n_draft, s.k_rows), 0)
    # The thinking budget: the end marker replaces the draft where the budget forces it.
    draft, forced = thought.force_block(sampling, s.think_state, s.think_count, draft, n_draft)
    # Rows of model drafters use their q; the others (deterministic drafters, off) match
    # the target's own samples, so their sampled output is that of plain decoding.
    v = verify_block(params, cache, s.tok, draft, q, n_draft, s.n_cached, live, s.count,
                     batch.stop_ids, batch.min_before_stop, sampling, page_table, cfg=cfg,
                     impl=impl, q_rows=model_ids[s.ids], aux_layers=aux_layers,
                     forced=forced)
    n_acc, n_emit = v.n_accepted, v.n_emit
    think = (s.think_state, s.think_count)
    for i in range(v.emitted.shape[1]):
      think = thought.advance(sampling, *think, v.emitted[:, i], live & (i < n_emit))

    def logprobs(_):
      t, vocab = v.logits.shape[1], v.logits.shape[2]
      lp = token_logprobs(v.logits.reshape(b * t, vocab), v.emitted.reshape(-1))
      return tuple(x.reshape((b, t) + x.shape[1:]) for x in lp)

    lp = jax.lax.cond(batch.want_logprobs, logprobs, lambda _: jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(logprobs, None)), None)
    cache = v.cache
    for d in drafters:
      states[d.name], cache = d.observe(context(d, s, live), states[d.name], cache, v, k)
    onehot = jax.nn.one_hot(s.ids, n_ids, dtype=jnp.int32) * live.astype(jnp.int32)[:, None]
    # Evidence for every drafter that proposed, not only the row's own: "auto" rows compare
    # drafters at no cost.
    evidence = jnp.zeros((b, n_ids, k_max, 2), jnp.float32)
    for name, p in props.items():
      m, ended = matched(p.tokens, p.count, v.emitted, n_emit)
      evidence = evidence.at[:, drafter_id(name)].set(
          goodput.position_evidence(m, ended, k_max, live & p.computed))
    drafting = (live & (s.ids > 0)).astype(jnp.float32)
    count = s.count + n_emit
    return dataclasses.replace(
        s, cache=cache, drafters=states, think_state=think[0], think_count=think[1],
        out=place(s.out, s.count, v.emitted, n_emit),
        lps=tuple(place(buf, s.count, x, n_emit) for buf, x in zip(s.lps, lp)),
        history=place(s.history, s.history_len, v.emitted, n_emit),
        count=count, history_len=s.history_len + n_emit, n_cached=s.n_cached + n_emit,
        tok=jnp.where(live, v.extra, s.tok), stopped=s.stopped | v.stopped,
        done=s.done | v.stopped | (count >= limit),
        slots=s.slots + (jnp.arange(k_max)[None, None, :] < jnp.stack(
            [n_draft, n_acc], axis=1)[:, :, None]).astype(jnp.int32),
        by_drafter=s.by_drafter + onehot[:, :, None] * jnp.stack(
            [jnp.ones_like(n_draft), n_draft, n_acc], axis=1)[:, None, :],
        row_accept=goodput.decay_add(s.row_accept, evidence),
        accept=goodput.decay_add(s.accept, jnp.einsum("b,bdjc->djc", drafting, evidence)))

  def body(s: LoopState) -> LoopState:
    live = ~s.done
    gain_rows = goodput.row_gains(s.row_accept, s.accept)  # [B, D, J]
    allowed = (enabled & spec.auto_allowed)[None, :] & (~fed_only[None, :] | spec.fed)
    ids, gain, column_cost = goodput.row_drafters(gain_rows, step_cost[-1], drafter_cost,
                                                  allowed, spec.row_auto, spec.row_drafter,
                                                  live, k_max)
    room = jnp.maximum(jnp.minimum(limit - s.count - 1, spec.row_max_draft), 0)
    drafting = live & (ids > 0)
    k_rows = jnp.where(drafting, jnp.minimum(room, k_max), 0)
    index = jnp.int32(len(widths) - 1)
    if len(widths) > 1:  # plain or the block, unless forced (warm-up, timing)
      block, planned = goodput.plan(gain, drafting, live, room, k_max, step_cost, column_cost)
      index = jnp.where(spec.force_width >= 0, spec.force_width, block.astype(jnp.int32))
      k_rows = jnp.where(spec.force_width >= 0, k_rows, planned)
    drafts = index == len(widths) - 1
    taken = jnp.arange(1, k_max + 1)[None, :] <= k_rows[:, None]
    expected = jnp.sum(jnp.where(live, 1.0 + jnp.sum(jnp.where(taken, gain, 0.0), 1), 0.0))
    # (in plain iterations: what `time_budget` counts)
    seconds = step_cost[index] + jnp.where(drafts, k_max * column_cost, 0.0)
    before_count, before = jnp.sum(s.count), s.history_len
    s = dataclasses.replace(s, ids=ids, k_rows=k_rows)
    # What a drafter keeps out of the conditional (`Drafter.prepare`; the learned table),
    # whose branches would copy it (`inplace`).
    held, states = {}, dict(s.drafters)
    for d in drafters:
      held[d.name], states[d.name] = d.prepare(context(d, s, live), states[d.name], drafts)
    s = dataclasses.replace(s, drafters=states)
    if len(widths) == 1:
      s = step(k_max, s)
    else:
      s = jax.lax.cond(drafts, functools.partial(step, k_max), functools.partial(step, 0), s)
    states = dict(s.drafters)
    for d in drafters:
      states[d.name] = d.learn(context(d, s, ~s.done), states[d.name], held[d.name], before)
    drafted = drafts.astype(jnp.float32)  # the estimates' calibration (`LoopState`)
    emitted = (jnp.sum(s.count) - before_count).astype(jnp.float32)
    return dataclasses.replace(
        s, drafters=states, k_steps=s.k_steps.at[index].add(1),
        calibration=s.calibration + jnp.stack([drafted * expected, drafted * emitted,
                                               seconds]))

  zeros = jnp.zeros((b,), jnp.int32)
  kt = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
  s = LoopState(
      cache=cache, tok=batch.tokens, n_cached=batch.n_cached.astype(jnp.int32),
      done=limit <= 0, count=zeros, out=jnp.full((b, config.max_steps), -1, jnp.int32),
      stopped=jnp.zeros((b,), bool), history=spec.history,
      history_len=spec.history_len.astype(jnp.int32), accept=spec.accept.astype(jnp.float32),
      row_accept=spec.row_accept.astype(jnp.float32), ids=spec.row_drafter.astype(jnp.int32),
      k_rows=zeros, by_drafter=jnp.zeros((b, n_ids, 3), jnp.int32),
      slots=jnp.zeros((b, 2, k_max), jnp.int32), k_steps=jnp.zeros((len(widths),), jnp.int32),
      calibration=jnp.zeros((3,), jnp.float32),
      lps=(jnp.zeros((b, config.max_steps), jnp.float32),
           jnp.zeros((b, config.max_steps, kt), jnp.int32),
           jnp.zeros((b, config.max_steps, kt), jnp.float32)),
      drafters={d.name: d.start(state.get(d.name), rows.get(d.name), b, k_max)
                for d in drafters},
      think_state=batch.sampling.think_state.astype(jnp.int32),
      think_count=batch.sampling.think_count.astype(jnp.int32))
  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.calibration[2] < spec.time_budget),
                         body, s)
  new_state, new_rows = {}, {}
  for d in drafters:
    st, r = d.finish(context(d, s, ~s.done), s.drafters[d.name])
    if st is not None:
      new_state[d.name] = st
    if r is not None:
      new_rows[d.name] = r
  result = LoopResult(out=s.out, count=s.count, stopped=s.stopped, lps=s.lps, slots=s.slots,
                      k_steps=s.k_steps, row_accept=s.row_accept, by_drafter=s.by_drafter,
                      accept=s.accept, calibration=s.calibration, rows=new_rows)
  return result, s.cache, new_state


@functools.partial(jax.jit, static_argnames=("max_steps", "cfg", "impl", "learners"),
                   donate_argnames=("cache", "state"))
def decode_loop_learning(params: Params, cache: Cache, batch: DecodeBatch,
                         state: dict[str, Any], inputs: dict[str, dict[str, jax.Array]], *,
                         max_steps: int, cfg: ModelConfig, impl: KernelChoice = REFERENCE,
                         learners: tuple[Drafter, ...] = ()):
  """`steps.decode_loop`, then every learner (`Drafter.learns_from_plain`) taught the call's
  new tokens (`inputs[name]`: its `plain_inputs`), in one program (as a program of its own
  the update costs a dispatch per call). Returns (out, count, stopped, lps, cache, state)."""
  out, count, stopped, lps, cache = decode_loop(params, cache, batch, max_steps=max_steps,
                                                cfg=cfg, impl=impl)
  state = dict(state)
  for d in learners:
    state[d.name] = d.learn_plain(state[d.name], inputs[d.name], out, count)
  return out, count, stopped, lps, cache, state
