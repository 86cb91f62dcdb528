"""`speculative_decode_loop`: the serving engine's decode-only device loop with drafting.

Same contract as `steps.decode_loop` (B rows that only decode; a token budget `num_steps` per
call, for which the scheduler took pages up front; EOS/stop ids and per-row limits on the
device), but every iteration drafts up to k tokens per row and verifies them with ONE target
forward over k + 1 positions. A row never writes past `n_cached + limit - 1`, so the pages
taken for `num_steps` plain decode steps suffice.

Drafters per row: `row_drafter[b]` indexes `DRAFTER_IDS` (0 = off: the row drafts nothing and
decodes one token per iteration); `row_auto[b]` rows take, every iteration, the enabled drafter
with the best expected tokens per unit of step time from their own acceptance estimates. Every
drafter the engine enables (`drafters`, static) proposes for the whole batch and rows take
their own with `jnp.where`; the model drafters' chained forwards run only when a live row uses
them (`inplace.run_if`, which keeps their caches in place):
* "ngram": prompt lookup in the row's recent tokens (`history`);
* "learned": the engine's n-gram table, updated from every emitted token and handed back;
* "mtp": the model's MTP layer; it observes every verified block of every row (its cache covers
  all rows, so shared prefix pages stay valid for any drafter) and keeps each row's last MTP
  hidden state (`mtp_hidden`, in and out);
* "draft": a small model with its own paged cache on the same page table. The rows that may
  draft with it (`draft_rows`, caught up before the call: `catch_up.py`) feed it: tokens it has
  not seen correctly yet (`pending`, at most k) go in front of its first forward, and the loop
  flushes them at the end, so after the call their draft cache holds exactly the positions the
  target cache holds. Other rows' draft entries lag (they are caught up when they start).
Rows of deterministic drafters are verified against the target's own (seed, position) samples
(sampled output token for token that of plain decoding), rows of model drafters by speculative
sampling with their q.

Acceptance evidence: after each verify, every drafter that proposed is checked against the
tokens each row emitted (`_matched`), into decayed (accepted, ended) counts per draft position,
per row and drafter (`row_accept`, the request's, carried across calls by the engine) and over
all drafting rows (`accept`, the prior of new rows); `goodput.row_gains` turns them into each
row's chance of accepting its first j drafts.

The block width K is chosen per iteration from the compiled `choices` (`lax.switch`, only the
chosen branch runs), and each row's draft count k_b <= K with it: forced (`force_k` >= 0, an
index; rows then draft up to their room) or by the goodput model (`goodput.plan`) from the rows'
estimates and the measured costs.
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
from engine.runtime.speculative import counterfactual, drafters as dr, goodput, learned
from engine.runtime.speculative.acceptance import draft_sample
from engine.runtime.speculative.inplace import run_if
from engine.runtime.speculative.loop import SpecStats, _place, verify_block

DRAFTER_IDS = ("off", "ngram", "learned", "mtp", "draft")
DETERMINISTIC = ("ngram", "learned")
AUTO = "auto"  # a request's drafter chosen by the loop from measured acceptance and costs


def drafter_id(name: str | None) -> int:
  return DRAFTER_IDS.index(name or "off")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopResult:
  out: jax.Array  # [B, max_steps] new tokens, -1 past each row's count
  counts: jax.Array  # [B]
  stopped: jax.Array  # [B] bool
  stats: SpecStats
  k_steps: jax.Array  # [len(choices)] iterations run with each draft length
  calibration: jax.Array  # [3] float32: over iterations that drafted, tokens the goodput model
  # expected them to emit (from the rows' gains and draft counts) and tokens they emitted;
  # over all iterations, their time by the cost model (`costs`; plain-loop iterations)
  accept: jax.Array  # [D, J, 2] updated acceptance counts per draft position
  table: learned.NgramTable | None
  mtp_hidden: jax.Array | None  # [B, H] each row's MTP output at position n_cached - 1
  row_accept: jax.Array  # [B, D, J, 2] updated per-row acceptance counts
  by_drafter: jax.Array  # [B, D, 3] int32 per row and drafter: verify steps, drafted, accepted
  draft_cache: Cache | None
  logprobs: tuple[jax.Array, jax.Array, jax.Array]  # as `steps.decode_loop`'s (zeros unless
  # `want_logprobs`): chosen [B, max_steps], top ids and logprobs [B, max_steps, 20]


def _draft_feed(draft_params, dcache, pending, n_pending, tok, n_cached, live, page_table, *,
                draft_cfg, impl):
  """Feeds each row's pending tokens and its newest token to the draft model.

  pending [B, P] tokens at positions n_cached - n_pending .. n_cached - 1 the draft cache lacks.
  Returns (the draft model's hidden state at the newest token [B, H], draft cache holding
  positions <= n_cached).
  """
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
                   static_argnames=("max_steps", "choices", "drafters", "cfg", "draft_cfg",
                                    "impl"),
                   donate_argnames=("cache", "table", "draft_cache"))
def speculative_decode_loop(params: Params, cache: Cache, tokens: jax.Array,
                            n_cached: jax.Array, page_table: jax.Array,
                            sampling: SamplingArrays, stop_ids: jax.Array, remaining: jax.Array,
                            min_before_stop: jax.Array, num_steps: jax.Array,
                            time_budget: jax.Array, history: jax.Array,
                            history_len: jax.Array, row_drafter: jax.Array,
                            row_auto: jax.Array, row_max_draft: jax.Array, row_accept: jax.Array,
                            auto_allowed: jax.Array, feed: jax.Array,
                            draft_rows: jax.Array, accept: jax.Array, costs: jax.Array,
                            force_k: jax.Array,
                            want_logprobs: jax.Array, table: learned.NgramTable | None = None,
                            mtp_hidden: jax.Array | None = None,
                            draft_params: Params | None = None,
                            draft_cache: Cache | None = None, *, max_steps: int,
                            choices: tuple[int, ...], drafters: tuple[str, ...],
                            cfg: ModelConfig, draft_cfg: ModelConfig | None = None,
                            impl: KernelChoice = REFERENCE) -> tuple[LoopResult, Cache]:
  """Up to `num_steps` (<= max_steps) new tokens per row, in about `time_budget`.

  Args:
    tokens, n_cached, page_table, sampling, stop_ids, remaining, min_before_stop, num_steps:
      as in `steps.decode_loop` (num_steps counts tokens, not iterations).
    time_budget: float32 scalar, the call's time in plain-loop iterations by the cost model
      (`costs`): no iteration starts once the predicted time of those run reaches it (inf:
      the tokens alone bound the call). So a speculative call lasts about as long as a plain
      call of `time_budget` tokens, however many tokens its iterations emit.
    history: [B, W] int32 the row's most recent tokens, oldest first, ending with `tokens`;
      W >= history_len + max_steps (the loop appends what it emits).
    history_len: [B] int32 tokens in `history` (>= 1 for real rows).
    row_drafter: [B] int32 index into DRAFTER_IDS (0: off); only enabled drafters.
    row_auto: [B] bool rows whose drafter the loop chooses every iteration (row_drafter unused).
    row_max_draft: [B] int32 the most drafts per iteration each row accepts to verify.
    row_accept: [B, D, J, 2] float32 each row's decayed (accepted, ended) counts per drafter
      and draft position, J = max(choices) (its request's, carried across calls; zeros for a
      new request; `goodput.position_evidence`).
    auto_allowed: [D] bool drafters "auto" rows may take in this call.
    feed: [D] bool model drafters whose state this call keeps current: "mtp" observes every
      verified block of every row. A drafter a row uses (its own or "auto"'s choice) must be
      fed; the others lag (drafts only). ("draft": `draft_rows`.)
    draft_rows: [B] bool rows the draft model is fed (every token; their draft cache must
      hold positions < n_cached): drafter "draft" rows, and the only "auto" rows that may
      take it.
    accept: [D, J, 2] float32 the same counts over all drafting rows (the prior of new rows).
    costs: [D + 4] float32, relative to a plain decode-loop iteration: each drafter's cost
      per block column (when a live row uses it), then a speculative iteration's overhead,
      the base cost per block column, the cost per block column and live row, and the cost
      per real drafted token: T = 1 + [K > 0] overhead + K (base + pad_row B + drafters)
      + per_token sum_b k_b (`goodput.plan`).
    force_k: int32 scalar, index into `choices`, or -1 for the goodput choice.
    want_logprobs: bool scalar: compute each emitted token's logprobs from the verify logits.
    table: the learned table ("learned"; donated); mtp_hidden [B, H] ("mtp");
    draft_params, draft_cache ("draft"; the cache is donated).
  """
  b = tokens.shape[0]
  n_ids = len(DRAFTER_IDS)
  k_max = max(choices)
  limit = jnp.minimum(remaining, jnp.minimum(num_steps, max_steps))
  enabled = jnp.asarray([d in drafters for d in DRAFTER_IDS])

  def step(k, s):
    live = ~s["done"]
    cache, tok, n_cached, ids = s["cache"], s["tok"], s["n_cached"], s["ids"]
    use = {d: ids == drafter_id(d) for d in drafters}
    model_rows = functools.reduce(jnp.logical_or, [use[d] for d in drafters
                                                   if d not in DETERMINISTIC],
                                  jnp.zeros((b,), bool))
    # Every drafter's proposal of kk = max(k, 1) tokens (with k = 0 they are only compared
    # with the emitted token afterwards: evidence at no verify cost). Model drafters draft
    # only when a live row uses them, and are fed (`feed`) whenever a row may switch to them.
    kk = max(k, 1)
    props = {}  # drafter -> (tokens [B, kk], proposed [B], computed: bool scalar)
    q = None
    new = {}
    full = jnp.full((b,), kk, jnp.int32)
    nothing = (jnp.zeros((b, kk), jnp.int32), jnp.zeros((b, kk, cfg.vocab_size), jnp.float32))
    if "ngram" in drafters:
      props["ngram"] = (*dr.ngram_propose(s["history"], s["history_len"] - 1, kk), True)
    if "learned" in drafters:  # looked up before the switch (`body`): take the first kk
      d, n = s["learned_proposal"]
      props["learned"] = (d[:, :kk], jnp.minimum(n, kk), True)
    if "mtp" in drafters:
      wanted = jnp.any(use["mtp"] & live)
      dm, q, cache = run_if(
          wanted, lambda st: dr.mtp_propose(params, st[2], s["mtp_hidden"], n_cached, live,
                                            page_table, sampling, k=kk, cfg=cfg, impl=impl),
          (*nothing, cache))
      props["mtp"] = (dm, full, wanted)
    if "draft" in drafters:  # its rows fed every iteration (k = 0 too)
      fed_rows = live & draft_rows

      def fed(st):
        return _draft_feed(draft_params, st[1], s["pending"], s["n_pending"], tok, n_cached,
                           fed_rows, page_table, draft_cfg=draft_cfg, impl=impl)

      wanted = jnp.any(use["draft"] & live)
      h0 = jax.eval_shape(fed, (None, s["draft_cache"]))[0]
      h, dcache = run_if(jnp.any(fed_rows), fed,
                         (jnp.zeros(h0.shape, h0.dtype), s["draft_cache"]))
      dd, qd, new["draft_cache"] = run_if(
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
    n_draft = jnp.where(live, jnp.minimum(n_draft, s["k_rows"]), 0)
    # Rows of model drafters use their q; the others (deterministic drafters, off) match
    # the target's own samples, so their sampled output is that of plain decoding.
    v = verify_block(params, cache, tok, draft, q, n_draft, n_cached, live, s["count"],
                     stop_ids, min_before_stop, sampling, page_table, cfg=cfg, impl=impl,
                     q_rows=model_rows)
    n_acc, n_emit = v.n_accepted, v.n_emit
    s = dict(s, cache=v.cache, **new)
    s["out"] = _place(s["out"], s["count"], v.emitted, n_emit)

    def logprobs(_):
      t, vocab = v.logits.shape[1], v.logits.shape[2]
      lp = token_logprobs(v.logits.reshape(b * t, vocab), v.emitted.reshape(-1))
      return tuple(x.reshape((b, t) + x.shape[1:]) for x in lp)

    kt = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
    lp = jax.lax.cond(want_logprobs, logprobs, lambda _: (
        jnp.zeros((b, k + 1), jnp.float32), jnp.zeros((b, k + 1, kt), jnp.int32),
        jnp.zeros((b, k + 1, kt), jnp.float32)), None)
    s["lps"] = tuple(_place(buf, s["count"], x, n_emit) for buf, x in zip(s["lps"], lp))
    s["history"] = _place(s["history"], s["history_len"], v.emitted, n_emit)
    if "mtp" in drafters:  # the MTP layer sees every verified block (its cache covers them)
      def observe(st):
        h, c = dr.mtp_observe(params, st[1], v.hidden, v.emitted, n_cached,
                              (n_acc + 1) * live.astype(jnp.int32), page_table, cfg=cfg,
                              impl=impl)
        return jnp.where(live[:, None], h.astype(st[0].dtype), st[0]), c

      s["mtp_hidden"], s["cache"] = run_if(feed[drafter_id("mtp")], observe,
                                           (s["mtp_hidden"], s["cache"]))
    if "draft" in drafters:
      # The draft model was fed tok and, in rows drafting with it, its own drafts
      # d_1 .. d_{k'-1}: those rows that accepted all of them lack the last accepted one,
      # other rows every accepted token. (After a stop inside the block only the emitted
      # tokens count.)
      seen = jnp.where(use["draft"], jnp.minimum(n_acc, max(k, 1) - 1), 0)
      n_pend = jnp.maximum(n_emit - 1 - seen, 0)
      pend = jnp.take_along_axis(
          v.emitted, jnp.minimum(seen[:, None] + jnp.arange(k_max)[None, :], k), axis=1)
      s["pending"] = jnp.where(live[:, None], pend, s["pending"])
      s["n_pending"] = jnp.where(live, n_pend, s["n_pending"])
    s["count"] = s["count"] + n_emit
    s["history_len"] = s["history_len"] + n_emit
    s["n_cached"] = n_cached + n_emit
    s["tok"] = jnp.where(live, v.extra, tok)
    s["stopped"] = s["stopped"] | v.stopped
    s["done"] = s["done"] | v.stopped | (s["count"] >= limit)
    s["stats"] = s["stats"].add(live, n_draft, n_acc)
    onehot = jax.nn.one_hot(ids, n_ids, dtype=jnp.int32) * live.astype(jnp.int32)[:, None]
    s["by_drafter"] = s["by_drafter"] + onehot[:, :, None] * jnp.stack(
        [jnp.ones_like(n_draft), n_draft, n_acc], axis=1)[:, None, :]
    # Evidence for the acceptance estimates, for every drafter that proposed: how many of its
    # tokens the row's emitted tokens confirm, and whether its chain ended before the horizon
    # (the row's own drafter: exactly its accepted drafts and a rejection or missing proposal;
    # the others: what they would have achieved, so "auto" rows compare drafters at no cost).
    # Per draft position (`goodput.position_evidence`): accepted at 1 .. m, ended at m + 1.
    evidence = jnp.zeros((b, n_ids, k_max, 2), jnp.float32)
    for d, (t, n, computed) in props.items():
      m, ended = counterfactual.matched(t, n, v.emitted, n_emit)
      evidence = evidence.at[:, drafter_id(d)].set(
          goodput.position_evidence(m, ended, k_max, live & computed))
    s["row_accept"] = goodput.decay_add(s["row_accept"], evidence)
    drafting = (live & (ids > 0)).astype(jnp.float32)
    s["accept"] = goodput.decay_add(s["accept"], jnp.einsum("b,bdjc->djc", drafting, evidence))
    return s

  def body(s):
    live = ~s["done"]
    gain_rows = goodput.row_gains(s["row_accept"], s["accept"])  # [B, D, J]
    allowed = (enabled & auto_allowed)[None, :] & (
        (jnp.arange(n_ids) != drafter_id("draft"))[None, :] | draft_rows[:, None])
    ids, gain, block_cost = goodput.row_drafters(gain_rows, costs, allowed, row_auto,
                                                 row_drafter, live, k_max)
    room = jnp.maximum(jnp.minimum(limit - s["count"] - 1, row_max_draft), 0)
    index, k_rows, _ = goodput.plan(gain, live & (ids > 0), live, room, choices, block_cost,
                                 costs[-1], costs[-4])
    forced = force_k >= 0
    k_rows = jnp.where(forced, room, k_rows)
    s = dict(s, ids=ids, k_rows=k_rows)
    index = jnp.where(forced, force_k, index)
    width = jnp.asarray(choices, jnp.int32)[index]
    taken = jnp.arange(1, k_max + 1)[None, :] <= jnp.minimum(k_rows, width)[:, None]
    expected = jnp.sum(jnp.where(live, 1.0 + jnp.sum(jnp.where(taken, gain, 0.0), 1), 0.0))
    # The iteration's time as the cost model prices it (`goodput.plan`'s T, with the
    # speculative loop's overhead also at k = 0: this call runs that loop).
    predicted = (1.0 + costs[-4] + width.astype(jnp.float32) * block_cost
                 + costs[-1] * jnp.sum(jnp.where(taken & (live & (ids > 0))[:, None], 1.0, 0.0)))
    before_count = jnp.sum(s["count"])
    # The learned table stays out of the switch: a buffer carried through a conditional whose
    # branches update it is copied there (XLA), a few MB every iteration. Drafts are looked up
    # before (k_max of them, or one at k = 0; a branch takes the first k) and emitted tokens
    # learned after.
    table = s.pop("table", None)
    before = s["history_len"]
    if table is not None:  # (the barrier keeps XLA from sinking the reads into the branches)
      proposal = learned.propose_or_one(table, s["history"], before - 1, k_max, width > 0)
      s["learned_proposal"], table = jax.lax.optimization_barrier((proposal, table))
    s = jax.lax.switch(index, [functools.partial(step, kc) for kc in choices], s)
    if table is not None:
      del s["learned_proposal"]
      slots = jnp.arange(k_max + 1, dtype=jnp.int32)[None, :]
      s["table"] = learned.update(table, s["history"], before[:, None] + slots,
                                  slots < (s["history_len"] - before)[:, None])
    s["k_steps"] = s["k_steps"].at[index].add(1)
    drafted = (width > 0).astype(jnp.float32)  # the model's calibration (`LoopResult`)
    s["calibration"] = s["calibration"] + jnp.stack(
        [drafted * expected, drafted * (jnp.sum(s["count"]) - before_count).astype(jnp.float32),
         predicted])
    return s

  zeros = jnp.zeros((b,), jnp.int32)
  s = dict(cache=cache, tok=tokens, n_cached=n_cached.astype(jnp.int32), done=limit <= 0,
           count=zeros, out=jnp.full((b, max_steps), -1, jnp.int32),
           stopped=jnp.zeros((b,), bool), history=history,
           history_len=history_len.astype(jnp.int32), stats=SpecStats.zeros(b, k_max),
           accept=accept.astype(jnp.float32), row_accept=row_accept.astype(jnp.float32),
           ids=row_drafter.astype(jnp.int32), k_rows=zeros,
           by_drafter=jnp.zeros((b, n_ids, 3), jnp.int32),
           k_steps=jnp.zeros((len(choices),), jnp.int32),
           calibration=jnp.zeros((3,), jnp.float32))
  kt = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
  s["lps"] = (jnp.zeros((b, max_steps), jnp.float32), jnp.zeros((b, max_steps, kt), jnp.int32),
              jnp.zeros((b, max_steps, kt), jnp.float32))
  if "learned" in drafters:
    s["table"] = table
  if "mtp" in drafters:
    s["mtp_hidden"] = mtp_hidden
  if "draft" in drafters:
    s.update(draft_cache=draft_cache, pending=jnp.zeros((b, k_max), jnp.int32), n_pending=zeros)
  s = jax.lax.while_loop(
      lambda s: ~jnp.all(s["done"]) & (s["calibration"][2] < time_budget), body, s)
  dcache = None
  if "draft" in drafters:  # flush: fed rows' draft cache holds every position < n_cached
    dcache = run_if(
        jnp.any(draft_rows),
        lambda c: forward(draft_params, c, s["pending"], s["n_cached"] - s["n_pending"],
                          s["n_pending"] * draft_rows.astype(jnp.int32), page_table,
                          cfg=draft_cfg, impl=impl)[1],
        s["draft_cache"])
  return LoopResult(out=s["out"], counts=s["count"], stopped=s["stopped"], stats=s["stats"],
                    k_steps=s["k_steps"], calibration=s["calibration"], accept=s["accept"],
                    table=s.get("table"),
                    mtp_hidden=s.get("mtp_hidden"), row_accept=s["row_accept"],
                    by_drafter=s["by_drafter"], draft_cache=dcache,
                    logprobs=s["lps"]), s["cache"]
