"""`speculative_decode_loop`: the decode-only device loop with drafting (the engine's, which
`generate_tokens` and `engine.generate` run through too).

`steps.decode_loop`'s contract, but an iteration may draft up to K tokens per row and verify
them with ONE target forward over K + 1 positions (`verify_block`), each row masked to its own
drafts. Every enabled drafter proposes for the whole batch and each row takes its own (or, for
"auto" rows, the best by its estimates); the model drafters' forwards run only when a live row
uses them (`inplace.run_if`). Every proposal is then checked against what the row emitted
(`matched`), which updates the acceptance estimates (`goodput`).
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
from engine.runtime.sampling import MAX_TOP_LOGPROBS, SamplingArrays, token_logprobs
from engine.runtime.speculative import drafters as dr, goodput, learned
from engine.runtime.speculative.acceptance import draft_sample, prefix_length, verify
from engine.runtime.speculative.inplace import run_if

DRAFTER_IDS = ("off", "ngram", "learned", "mtp", "draft")
DETERMINISTIC = ("ngram", "learned")
AUTO = "auto"  # a request's drafter chosen by the loop from measured acceptance and costs


def drafter_id(name: str | None) -> int:
  return DRAFTER_IDS.index(name or "off")


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
                 impl: KernelChoice, q_rows: jax.Array) -> Verified:
  """ONE target forward over `[tok, d_1 .. d_K]` (tok [B] at position n_cached, n_draft [B]
  real drafts), acceptance and stop ids (stop_ids [B, S] padded with -1; they count once a row
  has emitted min_before_stop [B] tokens, n_out [B] so far). q [B, K, V] is the drafts'
  distribution in `q_rows` [B]; the other rows' drafts (all, with q None) are deterministic."""
  b, k = draft.shape
  live_i = live.astype(jnp.int32)
  block = jnp.concatenate([tok[:, None], draft], axis=1)
  hidden, cache = forward(params, cache, block, n_cached, (n_draft + 1) * live_i, page_table,
                          cfg=cfg, impl=impl)
  logits = compute_logits(params, hidden, cfg)  # [B, K+1, V]
  n_acc, extra = verify(logits, draft, q, n_draft, sampling, n_cached + 1)
  if q is not None:
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
  D drafters)."""
  cache: Cache
  tok: jax.Array  # [B] newest token (position n_cached)
  n_cached: jax.Array  # [B]
  done: jax.Array  # [B] bool
  count: jax.Array  # [B] tokens emitted in this call
  out: jax.Array  # [B, max_steps] new tokens, -1 past each row's count
  stopped: jax.Array  # [B] bool: a stop id ended the row
  history: jax.Array  # [B, W] recent tokens (ngram), history_len [B] of them
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
  table: learned.NgramTable | None = None  # "learned", and its proposal for this iteration
  learned_proposal: tuple[jax.Array, jax.Array] | None = None
  mtp_hidden: jax.Array | None = None  # [B, H] "mtp"
  draft_cache: Cache | None = None  # "draft", and the tokens its fed rows still lack
  pending: jax.Array | None = None  # [B, J]
  n_pending: jax.Array | None = None  # [B]


def _draft_feed(draft_params, dcache, pending, n_pending, tok, n_cached, live, page_table, *,
                draft_cfg, impl):
  """Feeds the draft model each row's pending tokens [B, P] (positions n_cached - n_pending ..
  n_cached - 1) and its newest token. Returns (its hidden state at the newest token [B, H],
  the draft cache holding positions <= n_cached)."""
  live_i = live.astype(jnp.int32)
  block = jnp.concatenate([pending, jnp.zeros_like(pending[:, :1])], axis=1)
  block = _place(block, n_pending, tok[:, None], jnp.ones_like(n_pending))
  hidden, dcache = forward(draft_params, dcache, block, n_cached - n_pending,
                           (n_pending + 1) * live_i, page_table, cfg=draft_cfg, impl=impl)
  return jnp.take_along_axis(hidden, n_pending[:, None, None], axis=1)[:, 0], dcache


def _draft_chain(draft_params, dcache, h, n_cached, live, page_table, sampling, *, k, draft_cfg,
                 impl):
  """k >= 1 drafts from the draft model's state h [B, H] at the newest token. Returns (draft
  [B, k], q [B, k, V], draft cache holding positions < n_cached + k)."""
  drafts, qs = [], []
  for j in range(1, k + 1):
    if j > 1:
      hidden, dcache = forward(draft_params, dcache, drafts[-1][:, None], n_cached + j - 1,
                               live.astype(jnp.int32), page_table, cfg=draft_cfg, impl=impl)
      h = hidden[:, 0]
    t, q = draft_sample(compute_logits(draft_params, h, draft_cfg), sampling, n_cached + j)
    drafts.append(t)
    qs.append(q)
  return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), dcache


@functools.partial(jax.jit,
                   static_argnames=("max_steps", "widths", "drafters", "cfg", "draft_cfg",
                                    "impl"),
                   donate_argnames=("cache", "table", "draft_cache"))
def speculative_decode_loop(
    params: Params, cache: Cache, tokens: jax.Array, n_cached: jax.Array, page_table: jax.Array,
    sampling: SamplingArrays, stop_ids: jax.Array, remaining: jax.Array,
    min_before_stop: jax.Array, num_steps: jax.Array, time_budget: jax.Array,
    history: jax.Array, history_len: jax.Array, row_drafter: jax.Array, row_auto: jax.Array,
    row_max_draft: jax.Array, row_accept: jax.Array, auto_allowed: jax.Array, feed: jax.Array,
    draft_rows: jax.Array, accept: jax.Array, costs: jax.Array, force_width: jax.Array,
    want_logprobs: jax.Array, table: learned.NgramTable | None = None,
    mtp_hidden: jax.Array | None = None, draft_params: Params | None = None,
    draft_cache: Cache | None = None, *, max_steps: int, widths: tuple[int, ...],
    drafters: tuple[str, ...], cfg: ModelConfig, draft_cfg: ModelConfig | None = None,
    impl: KernelChoice = REFERENCE) -> tuple[LoopState, Cache]:
  """Up to `num_steps` (<= max_steps) new tokens per row, in about `time_budget`.

  Args beyond `steps.decode_loop`'s (whose num_steps here counts tokens, not iterations):
    time_budget: float32, the call's time in plain-loop iterations by the cost table (`costs`,
      its row for B): no iteration starts once those run reach it (inf: no bound).
    history: [B, W] int32 each row's last history_len [B] tokens, oldest first, ending with
      `tokens`; W >= history_len + max_steps (the loop appends what it emits).
    row_drafter: [B] int32 index into DRAFTER_IDS (0: off); row_auto [B] bool: rows whose
      drafter the loop chooses among auto_allowed [D]; row_max_draft [B] int32: their limit.
    row_accept: [B, D, J = K, 2] each row's decayed (accepted, ended) counts per drafter and
      draft position (`goodput`); accept [D, J, 2]: the same over drafting rows.
    feed: [D] bool model drafters kept current (those a row uses or may take); draft_rows [B]
      bool: the rows the draft model is fed (their draft cache holds positions < n_cached).
    widths: (0, K): `goodput.plan` takes plain or the block each iteration; (K,): the block.
      force_width: int32 index into `widths` forcing one (warm-up, timing), or -1.
    table ("learned"), mtp_hidden [B, H] ("mtp"), draft_params and draft_cache ("draft"): the
      drafters' state (table and draft cache donated). "mtp" observes every verified block;
      "draft" lacks the tokens in `pending` until its next forward (flushed at the end).
  """
  b = tokens.shape[0]
  n_ids = len(DRAFTER_IDS)
  k_max = widths[-1]
  limit = jnp.minimum(remaining, jnp.minimum(num_steps, max_steps))
  enabled = jnp.asarray([d in drafters for d in DRAFTER_IDS])
  step_cost, drafter_cost = costs[:len(widths)], costs[len(widths):]

  def step(k: int, s: LoopState) -> LoopState:
    live = ~s.done
    cache, tok, n_cached, ids = s.cache, s.tok, s.n_cached, s.ids
    use = {d: ids == drafter_id(d) for d in drafters}
    model_rows = jnp.asarray([i > 0 and d not in DETERMINISTIC
                              for i, d in enumerate(DRAFTER_IDS)])[ids]
    # Every drafter's proposal of kk = max(k, 1) tokens (with k = 0 they are only compared
    # with the emitted token afterwards: evidence at no verify cost). Model drafters draft
    # only when a live row uses them, and are fed (`feed`) whenever a row may switch to them.
    kk = max(k, 1)
    props = {}  # drafter -> (tokens [B, kk], proposed [B], computed: bool scalar)
    q, draft_cache = None, s.draft_cache
    full = jnp.full((b,), kk, jnp.int32)
    nothing = (jnp.zeros((b, kk), jnp.int32), jnp.zeros((b, kk, cfg.vocab_size), jnp.float32))
    if "ngram" in drafters:
      props["ngram"] = (*dr.ngram_propose(s.history, s.history_len - 1, kk), True)
    if "learned" in drafters:  # looked up before the conditional (`body`): the first kk
      d, n = s.learned_proposal
      props["learned"] = (d[:, :kk], jnp.minimum(n, kk), True)
    if "mtp" in drafters:
      wanted = jnp.any(use["mtp"] & live)
      dm, q, cache = run_if(
          wanted, lambda st: dr.mtp_propose(params, st[2], s.mtp_hidden, n_cached, live,
                                            page_table, sampling, k=kk, cfg=cfg, impl=impl),
          (*nothing, cache))
      props["mtp"] = (dm, full, wanted)
    if "draft" in drafters:  # its rows fed every iteration (k = 0 too)
      fed_rows = live & draft_rows

      def fed(st):
        return _draft_feed(draft_params, st[1], s.pending, s.n_pending, tok, n_cached,
                           fed_rows, page_table, draft_cfg=draft_cfg, impl=impl)

      wanted = jnp.any(use["draft"] & live)
      h0 = jax.eval_shape(fed, (None, s.draft_cache))[0]
      h, dcache = run_if(jnp.any(fed_rows), fed,
                         (jnp.zeros(h0.shape, h0.dtype), s.draft_cache))
      dd, qd, draft_cache = run_if(
          wanted, lambda st: _draft_chain(draft_params, st[2], h, n_cached, fed_rows,
                                          page_table, sampling, k=kk, draft_cfg=draft_cfg,
                                          impl=impl),
          (*nothing, dcache))
      props["draft"] = (dd, full, wanted & draft_rows)  # (other rows' drafts: stale context)
      q = qd if q is None else jnp.where(use["draft"][:, None, None], qd, q)
    draft = jnp.zeros((b, kk), jnp.int32)
    n_draft = jnp.zeros((b,), jnp.int32)
    for d, (t, n, _) in props.items():
      draft = jnp.where(use[d][:, None], t, draft)
      n_draft = jnp.where(use[d], n, n_draft)
    if k == 0:
      draft, n_draft, q = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32), None
    n_draft = jnp.where(live, jnp.minimum(n_draft, s.k_rows), 0)
    # Rows of model drafters use their q; the others (deterministic drafters, off) match
    # the target's own samples, so their sampled output is that of plain decoding.
    v = verify_block(params, cache, tok, draft, q, n_draft, n_cached, live, s.count,
                     stop_ids, min_before_stop, sampling, page_table, cfg=cfg, impl=impl,
                     q_rows=model_rows)
    n_acc, n_emit = v.n_accepted, v.n_emit

    def logprobs(_):
      t, vocab = v.logits.shape[1], v.logits.shape[2]
      lp = token_logprobs(v.logits.reshape(b * t, vocab), v.emitted.reshape(-1))
      return tuple(x.reshape((b, t) + x.shape[1:]) for x in lp)

    lp = jax.lax.cond(want_logprobs, logprobs, lambda _: jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(logprobs, None)), None)
    mtp_hidden, cache = s.mtp_hidden, v.cache
    if "mtp" in drafters:  # the MTP layer sees every verified block (its cache covers them)
      def observe(st):
        h, c = dr.mtp_observe(params, st[1], v.hidden, v.emitted, n_cached,
                              (n_acc + 1) * live.astype(jnp.int32), page_table, cfg=cfg,
                              impl=impl)
        return jnp.where(live[:, None], h.astype(st[0].dtype), st[0]), c

      mtp_hidden, cache = run_if(feed[drafter_id("mtp")], observe, (mtp_hidden, cache))
    pending, n_pending = s.pending, s.n_pending
    if "draft" in drafters:
      # It was fed tok and, in rows drafting with it, its drafts d_1 .. d_{k-1}: so those rows
      # lack the emitted tokens past their accepted drafts, the others every emitted token.
      seen = jnp.where(use["draft"], jnp.minimum(n_acc, max(k, 1) - 1), 0)
      n_pend = jnp.maximum(n_emit - 1 - seen, 0)
      pend = jnp.take_along_axis(
          v.emitted, jnp.minimum(seen[:, None] + jnp.arange(k_max)[None, :], k), axis=1)
      pending = jnp.where(live[:, None], pend, pending)
      n_pending = jnp.where(live, n_pend, n_pending)
    onehot = jax.nn.one_hot(ids, n_ids, dtype=jnp.int32) * live.astype(jnp.int32)[:, None]
    # Evidence for every drafter that proposed, not only the row's own: "auto" rows compare
    # drafters at no cost.
    evidence = jnp.zeros((b, n_ids, k_max, 2), jnp.float32)
    for d, (t, n, computed) in props.items():
      m, ended = matched(t, n, v.emitted, n_emit)
      evidence = evidence.at[:, drafter_id(d)].set(
          goodput.position_evidence(m, ended, k_max, live & computed))
    drafting = (live & (ids > 0)).astype(jnp.float32)
    count = s.count + n_emit
    return dataclasses.replace(
        s, cache=cache, mtp_hidden=mtp_hidden, pending=pending, n_pending=n_pending,
        draft_cache=draft_cache,
        out=_place(s.out, s.count, v.emitted, n_emit),
        lps=tuple(_place(buf, s.count, x, n_emit) for buf, x in zip(s.lps, lp)),
        history=_place(s.history, s.history_len, v.emitted, n_emit),
        count=count, history_len=s.history_len + n_emit, n_cached=n_cached + n_emit,
        tok=jnp.where(live, v.extra, tok), stopped=s.stopped | v.stopped,
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
    allowed = (enabled & auto_allowed)[None, :] & (
        (jnp.arange(n_ids) != drafter_id("draft"))[None, :] | draft_rows[:, None])
    ids, gain, column_cost = goodput.row_drafters(gain_rows, step_cost[-1], drafter_cost,
                                                  allowed, row_auto, row_drafter, live, k_max)
    room = jnp.maximum(jnp.minimum(limit - s.count - 1, row_max_draft), 0)
    drafting = live & (ids > 0)
    k_rows = jnp.where(drafting, jnp.minimum(room, k_max), 0)
    index = jnp.int32(len(widths) - 1)
    if len(widths) > 1:  # plain or the block, unless forced (warm-up, timing)
      block, planned = goodput.plan(gain, drafting, live, room, k_max, step_cost,
                                       column_cost)
      index = jnp.where(force_width >= 0, force_width, block.astype(jnp.int32))
      k_rows = jnp.where(force_width >= 0, k_rows, planned)
    drafts = index == len(widths) - 1
    taken = jnp.arange(1, k_max + 1)[None, :] <= k_rows[:, None]
    expected = jnp.sum(jnp.where(live, 1.0 + jnp.sum(jnp.where(taken, gain, 0.0), 1), 0.0))
    # (in plain iterations: what `time_budget` counts)
    seconds = step_cost[index] + jnp.where(drafts, k_max * column_cost, 0.0)
    before_count = jnp.sum(s.count)
    # The learned table stays out of the conditional, whose branches would copy it (`inplace`):
    # drafts are looked up before (k_max, or one for plain) and emitted tokens learned after.
    table, before = s.table, s.history_len
    s = dataclasses.replace(s, ids=ids, k_rows=k_rows, table=None)
    if table is not None:  # (the barrier keeps XLA from sinking the reads into the branches)
      proposal = learned.propose_or_one(table, s.history, before - 1, k_max, drafts)
      proposal, table = jax.lax.optimization_barrier((proposal, table))
      s = dataclasses.replace(s, learned_proposal=proposal)
    if len(widths) == 1:
      s = step(k_max, s)
    else:
      s = jax.lax.cond(drafts, functools.partial(step, k_max), functools.partial(step, 0), s)
    if table is not None:
      slots = jnp.arange(k_max + 1, dtype=jnp.int32)[None, :]
      table = learned.update(table, s.history, before[:, None] + slots,
                             slots < (s.history_len - before)[:, None])
    drafted = drafts.astype(jnp.float32)  # the estimates' calibration (`LoopState`)
    emitted = (jnp.sum(s.count) - before_count).astype(jnp.float32)
    return dataclasses.replace(
        s, table=table, learned_proposal=None, k_steps=s.k_steps.at[index].add(1),
        calibration=s.calibration + jnp.stack([drafted * expected, drafted * emitted,
                                               seconds]))

  zeros = jnp.zeros((b,), jnp.int32)
  kt = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
  s = LoopState(
      cache=cache, tok=tokens, n_cached=n_cached.astype(jnp.int32), done=limit <= 0,
      count=zeros, out=jnp.full((b, max_steps), -1, jnp.int32), stopped=jnp.zeros((b,), bool),
      history=history, history_len=history_len.astype(jnp.int32),
      accept=accept.astype(jnp.float32),
      row_accept=row_accept.astype(jnp.float32), ids=row_drafter.astype(jnp.int32),
      k_rows=zeros, by_drafter=jnp.zeros((b, n_ids, 3), jnp.int32),
      slots=jnp.zeros((b, 2, k_max), jnp.int32), k_steps=jnp.zeros((len(widths),), jnp.int32),
      calibration=jnp.zeros((3,), jnp.float32),
      lps=(jnp.zeros((b, max_steps), jnp.float32), jnp.zeros((b, max_steps, kt), jnp.int32),
           jnp.zeros((b, max_steps, kt), jnp.float32)),
      table=table if "learned" in drafters else None,
      mtp_hidden=mtp_hidden if "mtp" in drafters else None)
  if "draft" in drafters:
    s = dataclasses.replace(s, draft_cache=draft_cache,
                            pending=jnp.zeros((b, k_max), jnp.int32), n_pending=zeros)
  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.calibration[2] < time_budget),
                         body, s)
  if "draft" in drafters:  # flush: fed rows' draft cache holds every position < n_cached
    s = dataclasses.replace(s, draft_cache=run_if(
        jnp.any(draft_rows),
        lambda c: forward(draft_params, c, s.pending, s.n_cached - s.n_pending,
                          s.n_pending * draft_rows.astype(jnp.int32), page_table,
                          cfg=draft_cfg, impl=impl)[1],
        s.draft_cache))
  return dataclasses.replace(s, cache=None), s.cache
