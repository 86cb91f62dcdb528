"""`speculative_decode`: the speculative counterpart of `generate.decode`, one jitted while loop.

Each iteration, for every live row (B rows, K = num_draft):
1. the drafter proposes up to K tokens (`drafters`), capped so the row cannot pass its limit;
2. ONE target forward over `[newest, d_1 .. d_K]` (T = K + 1; positions n_cached .. n_cached+K,
   the first n_draft + 1 real);
3. `acceptance.verify` accepts a prefix d_1 .. d_a and chooses the extra token (correction or
   bonus), so the row emits a + 1 tokens; stop ids inside the block end the row there;
4. the row advances by length only: n_cached += a + 1. Cache slots of rejected drafts were
   written but lie past n_cached, so attention never reads them and later steps overwrite them.

Rows accept different counts and finish independently (EOS/stop ids after min_new_tokens,
max_new_tokens); finished rows write nothing. No host round trip until every row is done.
With `adaptive`, each iteration first picks its draft length (`goodput`) and runs the step
compiled for it (`lax.switch`).

Plain phase: given `plain_cost` (a plain iteration's measured time, in the step costs' unit),
once plain decoding would have finished the batch sooner than every choice (by PLAIN_MARGIN)
for PLAIN_PATIENCE iterations in a row, the loop ends its speculation and a second while loop
decodes the rest plainly: one token per row and iteration, without the drafter's upkeep (the
draft model's or MTP layer's forward, which the k = 0 choice still pays to keep its cache
current). It does not go back (that upkeep has stopped); the serving engine, which can catch a
draft cache up, rests and probes instead (`runtime.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import Cache, compute_logits, forward
from engine.runtime.generate import (FINISH_LENGTH, FINISH_NONE, FINISH_STOP, StopCriteria)
from engine.runtime.sampling import SamplingArrays, sample
from engine.runtime.speculative import drafters, goodput, learned
from engine.runtime.speculative.acceptance import verify
from engine.runtime.speculative.inplace import run_if

DRAFTERS = ("ngram", "mtp", "draft", "learned")
# The plain phase starts once plain decoding wins by this fraction of the best choice's time
# for this many iterations in a row (the estimates start from a prior and move with evidence;
# a drafter whose k = 0 costs about what plain decoding does is never given up for noise).
PLAIN_MARGIN = 0.05
PLAIN_PATIENCE = 8
# A drafting choice is taken over k = 0 only when the model says it finishes the batch this
# fraction sooner. Both sides of the comparison are noisy: the measured step costs (T(1)
# came out anywhere from 1.11 to 1.47 T(0) between processes on the CPU demo) and the
# acceptance estimates (the choice picks the iterations where they happen to run high: on
# fresh text the model expected 16% more tokens than the drafting iterations emitted). Without
# it, fresh text drafted at k = 2 for 17 of 61 iterations and lost 14%; where drafting pays
# (repetitive text, 2-3x) the margin costs nothing.
DRAFT_MARGIN = 0.1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStats:
  """Per-row counters of one `speculative_decode` call."""
  steps: jax.Array  # [B] target verification forwards the row took part in
  drafted_steps: jax.Array  # [B] of those, steps with at least one drafted token
  draft_tokens: jax.Array  # [B] drafted tokens
  accepted_tokens: jax.Array  # [B] accepted drafted tokens
  accepted_at: jax.Array  # [B, K] steps whose draft at slot i (0-based) was accepted
  drafted_at: jax.Array  # [B, K] steps that drafted a token at slot i

  @staticmethod
  def zeros(b: int, k: int) -> "SpecStats":
    z = jnp.zeros((b,), jnp.int32)
    return SpecStats(z, z, z, z, jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.int32))

  def add(self, live: jax.Array, n_draft: jax.Array, n_accepted: jax.Array) -> "SpecStats":
    """Counts one verification step of the `live` rows."""
    k = self.accepted_at.shape[1]
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    return SpecStats(
        steps=self.steps + live.astype(jnp.int32),
        drafted_steps=self.drafted_steps + (n_draft > 0).astype(jnp.int32),
        draft_tokens=self.draft_tokens + n_draft,
        accepted_tokens=self.accepted_tokens + n_accepted,
        accepted_at=self.accepted_at + (slot < n_accepted[:, None]).astype(jnp.int32),
        drafted_at=self.drafted_at + (slot < n_draft[:, None]).astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecOutput:
  tokens: jax.Array  # [B, max_steps] int32, -1 past each row's end
  num_tokens: jax.Array  # [B] int32
  finish_reason: jax.Array  # [B] int32 (FINISH_*)
  cache_lengths: jax.Array  # [B] int32 tokens whose cache entries are valid at the end
  stats: SpecStats
  ngram_table: learned.NgramTable | None  # the updated table (drafter "learned")
  k_steps: jax.Array  # [len(choices)] loop steps run with each draft length (see k_choices)
  calibration: jax.Array  # [2] float32 over steps that drafted: tokens the goodput model
  # expected (live rows' E[tau] at their room), tokens emitted
  plain_steps: jax.Array  # int32 scalar: iterations of the plain phase (see the module doc)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
def prefill_hidden(params: Params, cache: Cache, tokens: jax.Array, lengths: jax.Array,
                   page_table: jax.Array, *, cfg: ModelConfig, impl: KernelChoice = REFERENCE
                   ) -> tuple[jax.Array, jax.Array, Cache]:
  """`generate.prefill` that also returns every position's hidden state (for MTP).

  Returns (last-token logits [B, V], hidden [B, T, H], cache)."""
  b = tokens.shape[0]
  hidden, cache = forward(params, cache, tokens, jnp.zeros((b,), jnp.int32), lengths,
                          page_table, cfg=cfg, impl=impl)
  last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  return compute_logits(params, last, cfg), hidden, cache


def _place(buffer: jax.Array, start: jax.Array, values: jax.Array, count: jax.Array
           ) -> jax.Array:
  """buffer[b, start[b] + i] = values[b, i] for i < count[b]. buffer [B, N], values [B, T]."""
  t = values.shape[1]
  cols = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  cols = jnp.where(jnp.arange(t)[None, :] < count[:, None], cols, buffer.shape[1])
  rows = jnp.arange(buffer.shape[0])[:, None]
  return buffer.at[rows, cols].set(values, mode="drop")


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


def verify_block(params: Params, cache: Cache, tok: jax.Array, draft: jax.Array,
                 q: jax.Array | None, n_draft: jax.Array, n_cached: jax.Array, live: jax.Array,
                 n_out: jax.Array, stop_ids: jax.Array, min_before_stop: jax.Array,
                 sampling: SamplingArrays, page_table: jax.Array, *, cfg: ModelConfig,
                 impl: KernelChoice, q_rows: jax.Array | None = None) -> Verified:
  """ONE target forward over `[tok, d_1 .. d_K]`, acceptance and stop ids.

  Args:
    tok: [B] newest token (position n_cached); draft [B, K]; q [B, K, V] or None (one-hot);
    n_draft: [B] real drafts (0 for rows that are not live); live: [B] bool.
    n_out: [B] tokens the row emitted so far; a stop id counts only once the row has emitted
      at least `min_before_stop` [B] tokens; stop_ids: [B, S] padded with -1.
    q_rows: [B] bool, with q: the rows whose drafts come from q; the others are deterministic
      (verified against the target's own samples, as with q None).
  """
  b, k = draft.shape
  live_i = live.astype(jnp.int32)
  block = jnp.concatenate([tok[:, None], draft], axis=1)
  hidden, cache = forward(params, cache, block, n_cached, (n_draft + 1) * live_i, page_table,
                          cfg=cfg, impl=impl)
  logits = compute_logits(params, hidden, cfg)  # [B, K+1, V]
  n_acc, extra = verify(logits, draft, q, n_draft, sampling, n_cached + 1)
  if q is not None and q_rows is not None:
    m_acc, m_extra = verify(logits, draft, None, n_draft, sampling, n_cached + 1)
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
                  emitted=emitted, n_emit=n_emit * live_i, stopped=stopped, logits=logits)


@functools.partial(
    jax.jit, static_argnames=("max_steps", "num_draft", "drafter", "cfg", "draft_cfg", "impl",
                              "adaptive"),
    donate_argnames=("cache", "ngram_table"))
def speculative_decode(params: Params, cache: Cache, first_logits: jax.Array,
                       prompt_tokens: jax.Array, lengths: jax.Array, page_table: jax.Array,
                       sampling: SamplingArrays, stops: StopCriteria,
                       prompt_hidden: jax.Array | None = None, draft_params: Params | None = None,
                       draft_cache: Cache | None = None,
                       ngram_table: learned.NgramTable | None = None, *, max_steps: int,
                       num_draft: int,
                       drafter: str, cfg: ModelConfig, draft_cfg: ModelConfig | None = None,
                       impl: KernelChoice = REFERENCE, adaptive: bool = False,
                       step_costs: jax.Array | None = None, force_k: jax.Array | int = -1,
                       plain_cost: jax.Array | float | None = None
                       ) -> tuple[SpecOutput, Cache]:
  """Speculative generation of up to `max_steps` tokens per row.

  Args:
    first_logits: [B, V] logits of each row's last prompt token (from prefill).
    prompt_tokens: [B, Tp] right-padded prompts (the n-gram history starts from them).
    lengths: [B] prompt lengths (tokens in the cache).
    prompt_hidden: [B, Tp, H] target hidden states of the prompt (drafter "mtp").
    draft_params, draft_cache: the draft model and its cache holding the prompts ("draft");
      its cache uses the same page table.
    ngram_table: the learned n-gram table ("learned"); donated, the updated one is returned.
    num_draft: K, drafted tokens per step (>= 1); with `adaptive`, the most per step.
    drafter: one of DRAFTERS.
    adaptive: choose the draft length every step from `goodput` (k in `spec_k_choices`);
      step_costs [len(choices)]: an iteration's time at each choice, relative to the first
      (`probes.loop_costs` measures them; None: `goodput.step_costs` with draft cost 0 and
      verify cost 0.02 per row and token); force_k: an index into the choices (the loop
      probes), or -1 for the goodput choice; len(choices): the plain phase only. At k = 0
      deterministic drafters still look up one token, compared with the emitted one, so the
      estimate keeps tracking them.
    plain_cost: with `adaptive`, a plain-phase iteration's time in step_costs' unit
      (`probes.loop_costs` measures it): the loop may end its speculation (module doc).
      None: it speculates to the end.
  Returns:
    (SpecOutput, cache).
  """
  if drafter not in DRAFTERS:
    raise ValueError(f"unknown drafter {drafter!r}; expected one of {DRAFTERS}")
  b, k = first_logits.shape[0], num_draft
  history_len = prompt_tokens.shape[1] + max_steps
  limit = jnp.minimum(stops.max_new_tokens, max_steps)

  # The first token comes from the prefill logits exactly as in `generate.decode`.
  tok = sample(first_logits, sampling, lengths)
  out = jnp.full((b, max_steps), -1, jnp.int32).at[:, 0].set(tok)
  n_out = jnp.ones((b,), jnp.int32)
  hit_stop = jnp.any(tok[:, None] == stops.stop_ids, axis=-1) & (n_out >= stops.min_new_tokens)
  reasons = jnp.where(hit_stop, FINISH_STOP, jnp.where(n_out >= limit, FINISH_LENGTH,
                                                       FINISH_NONE))
  history = jnp.zeros((b, history_len), jnp.int32).at[:, :prompt_tokens.shape[1]].set(
      jnp.where(jnp.arange(prompt_tokens.shape[1])[None, :] < lengths[:, None], prompt_tokens, 0))
  history = _place(history, lengths, tok[:, None], jnp.ones((b,), jnp.int32))
  n_cached = lengths.astype(jnp.int32)

  aux = {}
  if drafter == "mtp":
    # MTP over the prompt: position i combines h_i with token i+1 (the first output at the end).
    shifted = jnp.take_along_axis(history, jnp.minimum(
        jnp.arange(prompt_tokens.shape[1])[None, :] + 1, history_len - 1), axis=1)
    aux["mtp_hidden"], cache = drafters.mtp_observe(
        params, cache, prompt_hidden, shifted, jnp.zeros((b,), jnp.int32), n_cached,
        page_table, cfg=cfg, impl=impl)
  elif drafter == "draft":
    aux = {"cache": draft_cache, "lag": jnp.zeros((b,), bool), "lag_tok": tok}
  elif drafter == "learned":  # the table stays out of the steps (see `body`)
    aux = {"proposal": (jnp.zeros((b, k), jnp.int32), jnp.zeros((b,), jnp.int32))}

  stats = SpecStats.zeros(b, k)

  def step(k, state):
    """One draft-verify step with k (static) drafts; returns (state, each row's acceptance
    evidence per draft position [B, num_draft, 2], `goodput.position_evidence`)."""
    cache, aux, history, tok, n_cached, n_out, out, reasons, stats = state
    live = reasons == FINISH_NONE
    live_i = live.astype(jnp.int32)

    # 1. Draft.
    q = None
    lookahead = None  # k = 0: a deterministic drafter's next token, checked for the estimate
    if k == 0:  # plain decoding through the same program
      draft, n_draft = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)
      if drafter == "ngram":
        lookahead = drafters.ngram_propose(history, n_cached, 1)
      elif drafter == "learned":
        lookahead = (aux["proposal"][0][:, :1], jnp.minimum(aux["proposal"][1], 1))
    elif drafter == "ngram":
      draft, n_draft = drafters.ngram_propose(history, n_cached, k)
    elif drafter == "learned":  # looked up before the switch: the first k of num_draft
      draft, n_draft = aux["proposal"][0][:, :k], jnp.minimum(aux["proposal"][1], k)
    elif drafter == "mtp":
      # (run_if, a loop of one trip here: XLA copied the MTP layer's cache, updated in this
      # k-switch branch, every iteration; see `inplace.run_if`)
      draft, q, cache = run_if(jnp.bool_(True), lambda st: drafters.mtp_propose(
          params, st[2], aux["mtp_hidden"], n_cached, live, page_table, sampling, k=k, cfg=cfg,
          impl=impl), (jnp.zeros((b, k), jnp.int32),
                       jnp.zeros((b, k, cfg.vocab_size), jnp.float32), cache))
      n_draft = jnp.full((b,), k, jnp.int32)
    else:
      draft, q, dcache = drafters.draft_model_propose(
          draft_params, aux["cache"], tok, n_cached, aux["lag"], aux["lag_tok"], live,
          page_table, sampling, k=k, draft_cfg=draft_cfg, impl=impl)
      n_draft = jnp.full((b,), k, jnp.int32)
    # The step emits n_draft + 1 tokens at most: never pass the row's limit (nor the cache).
    space = jnp.where(live, limit - n_out - 1, 0)  # drafts the row could still take
    room = jnp.minimum(k, space)
    n_draft = jnp.minimum(n_draft, room)

    # 2-3. Verify with one target forward, emit d_1 .. d_a and the extra token.
    v = verify_block(params, cache, tok, draft, q, n_draft, n_cached, live, n_out,
                     stops.stop_ids, stops.min_new_tokens, sampling, page_table, cfg=cfg,
                     impl=impl)
    cache, hidden, n_acc, emitted, n_emit = v.cache, v.hidden, v.n_accepted, v.emitted, v.n_emit
    out = _place(out, n_out, emitted, n_emit)
    history = _place(history, n_cached + 1, emitted, n_emit)
    n_out = n_out + n_emit
    reason = jnp.where(v.stopped, FINISH_STOP, jnp.where(n_out >= limit, FINISH_LENGTH,
                                                         FINISH_NONE))
    reasons = jnp.where(live, reason, reasons)
    new_tok = jnp.where(live, v.extra, tok)
    # Rollback of rejected drafts (and of tokens after a stop): by length only.
    new_cached = n_cached + n_emit

    # 4. Let the drafter see what was verified (MTP: the verified block's hidden states).
    if drafter == "mtp":
      def observe(st):
        h, c = drafters.mtp_observe(params, st[1], hidden, emitted, n_cached,
                                    (n_acc + 1) * live_i, page_table, cfg=cfg, impl=impl)
        return h.astype(st[0].dtype), c

      mtp_hidden, cache = run_if(jnp.bool_(True), observe,
                                 (jnp.zeros_like(aux["mtp_hidden"]), cache))
      aux = {"mtp_hidden": jnp.where(live[:, None], mtp_hidden, aux["mtp_hidden"])}
    elif drafter == "draft":
      all_in = live & (n_acc == k)  # d_K was accepted but never fed to the draft model
      aux = {"cache": dcache, "lag": jnp.where(live, all_in, aux["lag"]),
             "lag_tok": jnp.where(live, draft[:, k - 1], aux["lag_tok"])}

    stats = stats.add(live, n_draft, n_acc)
    # Every row with room: accepted at positions 1 .. n_acc, ended at n_acc + 1 on a rejection
    # or where the drafter proposed nothing (a row without a proposal gains nothing from the
    # block it pays for: P(proposed and accepted) is what E[tau] needs); censored past its room.
    ended = (n_acc < n_draft) | (n_draft < room)
    evidence = goodput.position_evidence(n_acc, ended, num_draft, room > 0)
    if lookahead is not None:  # evidence at no verify cost: would the drafter have been right?
      right = (lookahead[1] > 0) & (lookahead[0][:, 0] == v.emitted[:, 0])
      evidence = goodput.position_evidence(right, ~right, num_draft, space > 0)
    return (cache, aux, history, new_tok, new_cached, n_out, out, reasons, stats), evidence

  choices = spec_k_choices(k, drafter) if adaptive else (k,)
  costs = (goodput.step_costs(choices, b) if step_costs is None
           else jnp.asarray(step_costs, jnp.float32))
  plain_only = jnp.asarray(force_k) == len(choices)
  choice_costs = costs * jnp.where(jnp.asarray(choices) > 0, 1.0 + DRAFT_MARGIN, 1.0)

  def learn(table, state, state_after):  # the learned drafter learns every emitted token
    slots = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    return learned.update(table, state_after[2], state[4][:, None] + 1 + slots,
                          slots < (state_after[4] - state[4])[:, None])

  def body(loop_state):
    # gain [B, K]: each row's estimates from the counts so far (`row_gains`, computed where
    # the counts last changed: the plain-phase test needs them too)
    state, counts, row_counts, gain, k_steps, calibration, table, patience = loop_state
    n_out, live = state[5], state[7] == FINISH_NONE
    history, n_cached = state[2], state[4]
    if adaptive:
      index = goodput.choose(gain, choice_costs, choices, jnp.where(live, limit - n_out, 0))
      index = jnp.where(force_k >= 0, force_k, index)
    else:
      index = jnp.int32(0)
    width = jnp.asarray(choices, jnp.int32)[index]
    if table is not None:
      # The learned table stays out of the switch (a buffer that a conditional's branches
      # update is copied there, the whole table every iteration): num_draft drafts are looked
      # up before it (a branch takes the first k; k = 0 looks up one) and the emitted tokens
      # learned after. The barrier keeps XLA from sinking the reads into the branches.
      proposal = learned.propose_or_one(table, history, n_cached, k, width > 0)
      proposal, table = jax.lax.optimization_barrier((proposal, table))
      state = (state[0], {"proposal": proposal}, *state[2:])
    if adaptive:
      state_after, evidence = jax.lax.switch(
          index, [functools.partial(step, kc) for kc in choices], state)
    else:
      state_after, evidence = step(k, state)
    # Calibration: tokens the model expected of this iteration (each live row's E[tau] at the
    # drafts it had room for) against those emitted, over iterations that drafted.
    room = jnp.minimum(width, jnp.maximum(limit - n_out - 1, 0))
    taken = jnp.arange(1, k + 1)[None, :] <= room[:, None]
    expected = jnp.sum(jnp.where(live, 1.0 + jnp.sum(jnp.where(taken, gain, 0.0), 1), 0.0))
    emitted = jnp.sum(state_after[5] - n_out).astype(jnp.float32)
    calibration = calibration + (width > 0) * jnp.stack([expected, emitted])
    if table is not None:  # learn from every emitted token (history now holds them)
      table = learn(table, state, state_after)
    counts = goodput.decay_add(counts, jnp.sum(evidence, axis=0))
    row_counts = goodput.decay_add(row_counts, evidence)
    gain = goodput.row_gains(row_counts[:, None], counts[None])[:, 0]
    if adaptive and plain_cost is not None:  # would plain decoding now finish sooner?
      after_live = state_after[7] == FINISH_NONE
      wins = goodput.plain_wins(gain, costs, choices,
                                jnp.where(after_live, limit - state_after[5], 0), plain_cost,
                                PLAIN_MARGIN)
      patience = jnp.where(wins & (force_k < 0), patience + 1, 0)
    return (state_after, counts, row_counts, gain, k_steps.at[index].add(1), calibration,
            table, patience)

  def speculating(loop_state):
    return (jnp.any(loop_state[0][7] == FINISH_NONE) & (loop_state[7] < PLAIN_PATIENCE)
            & ~plain_only)

  def plain_body(plain_state):
    """One plain decode step, as lean as `generate.decode`'s (same (seed, position) keys)."""
    state, table, n = plain_state
    cache, aux, history, tok, n_cached, n_out, out, reasons, stats = state
    live = reasons == FINISH_NONE
    live_i = live.astype(jnp.int32)
    hidden, cache = forward(params, cache, tok[:, None], n_cached, live_i, page_table, cfg=cfg,
                            impl=impl)
    new_tok = sample(compute_logits(params, hidden[:, 0], cfg), sampling, n_cached + 1)
    out = _place(out, n_out, new_tok[:, None], live_i)
    if table is not None:
      history = _place(history, n_cached + 1, new_tok[:, None], live_i)
    n_out = n_out + live_i
    stopped = (jnp.any(new_tok[:, None] == stops.stop_ids, axis=-1)
               & (n_out >= stops.min_new_tokens))
    reason = jnp.where(stopped, FINISH_STOP, jnp.where(n_out >= limit, FINISH_LENGTH,
                                                       FINISH_NONE))
    zeros = jnp.zeros_like(n_out)
    state_after = (cache, aux, history, jnp.where(live, new_tok, tok), n_cached + live_i, n_out,
                   out, jnp.where(live, reason, reasons), stats.add(live, zeros, zeros))
    return state_after, table if table is None else learn(table, state, state_after), n + 1

  state = (cache, aux, history, tok, n_cached, n_out, out, reasons, stats)
  counts, row_counts = jnp.zeros((k, 2), jnp.float32), jnp.zeros((b, k, 2), jnp.float32)
  loop_state = (state, counts, row_counts,
                goodput.row_gains(row_counts[:, None], counts[None])[:, 0],
                jnp.zeros((len(choices),), jnp.int32), jnp.zeros((2,), jnp.float32),
                ngram_table if drafter == "learned" else None, jnp.int32(0))
  state, _, _, _, k_steps, calib, table, _ = jax.lax.while_loop(speculating, body, loop_state)
  if adaptive and plain_cost is not None:
    state, table, plain_steps = jax.lax.while_loop(
        lambda s: jnp.any(s[0][7] == FINISH_NONE), plain_body, (state, table, jnp.int32(0)))
  else:
    plain_steps = jnp.int32(0)
  cache, _, _, _, n_cached, n_out, out, reasons, stats = state
  return SpecOutput(tokens=out, num_tokens=n_out, finish_reason=reasons,
                    cache_lengths=n_cached, stats=stats, ngram_table=table,
                    k_steps=k_steps, calibration=calib, plain_steps=plain_steps), cache


def spec_k_choices(num_draft: int, drafter: str) -> tuple[int, ...]:
  """Draft lengths an adaptive loop compiles. The draft model always drafts (its cache may
  lag by one token only, which a step without drafts would not feed)."""
  return goodput.k_choices(num_draft, allow_zero=drafter != "draft")
