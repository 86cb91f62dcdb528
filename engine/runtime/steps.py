"""The jitted programs the serving engine runs; all donate the cache.

* `model_step`: one forward over a packed block of rows `[B, W]` and one sampled token per
  row. A row is a run of up to W consecutive tokens of one request, so a long prefill chunk
  spans several rows and decode tokens sit one per row. Rows of the same request in one step
  are consistent because every layer writes the whole block's cache entries before any row
  attends (a later row sees the earlier rows' tokens). Image placeholders take their encoder
  features; drafters that observe prefill (MTP) run over the chunk too.
* `decode_loop`: up to `num_steps` decode iterations in one `lax.while_loop` for the rows of a
  `DecodeBatch` that only decode, with EOS/stop ids and length limits checked on the device;
  finished and padding rows write nothing. `num_steps` is a traced scalar, so changing it
  never recompiles.
* `masked_step`: constrained rows (structured outputs) `[B, T]`: each row's newest token and
  up to T - 1 drafted ones, one forward, the grammar's allowed-token bitmask per position
  applied to the logits (-inf elsewhere) before sampling and verification; model drafters of
  constrained rows (MTP, EAGLE-3) observe the block and propose the next step's drafts.

Sampling randomness is keyed by (request seed, position of the sampled token) in both, which is
what makes a request's output independent of its batch, its chunking and preemption.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import (Cache, compute_logits, embed_tokens, forward,
                                      forward_hidden_states)
from engine.runtime import thought
from engine.runtime.sampling import MAX_TOP_LOGPROBS, SamplingArrays, sample, token_logprobs
from engine.runtime.speculative import constrained
from engine.runtime.speculative.acceptance import verify
from engine.runtime.speculative.drafters.base import aux_layers_of


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "observers"),
                   donate_argnames=("cache",))
def model_step(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
               n_new: jax.Array, page_table: jax.Array, sampling: SamplingArrays,
               features: jax.Array | None = None, feature_mask: jax.Array | None = None,
               next_tokens: jax.Array | None = None, own_params: dict | None = None, *,
               cfg: ModelConfig,
               impl: KernelChoice = REFERENCE, observers: tuple = ()
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array], dict, Cache]:
  """Forward over packed rows and sample after each row's last real token.

  Args:
    tokens: [B, W] int32; row b holds tokens at positions start[b] .. start[b] + n_new[b] - 1.
    start, n_new: [B] int32 (n_new 0 for a padding row).
    page_table: [B, max_pages] int32, the owning request's pages.
    sampling: [B] per-row sampling parameters.
    features, feature_mask: rows holding image placeholders: positions with the mask [B, W]
      take `features` [B, W, H] (the image's encoder output rows, `multimodal_step`) as their
      input embedding instead of the token's.
    next_tokens: [B, W] the token after each position (-1 where it is the one sampled here),
      for the drafters that observe prefill (`observers`, `Drafter.observe_prefill`; those
      reading residual streams (`aux_layers`, EAGLE-3) get them from this forward).
    own_params: the observers' own weights by name (an EAGLE-3 head's).
  Returns:
    ([B] int32 token sampled at position start + n_new (meaningful where the row ends its
    request's known tokens), its logprobs (`sampling.token_logprobs`), each observer's rows'
    state at the rows' last positions {name: [B, width]}, cache).
  """
  embeds = None
  if features is not None:
    embeds = embed_tokens(params, tokens, cfg)
    embeds = jnp.where(feature_mask[..., None], features.astype(embeds.dtype), embeds)
  layers = aux_layers_of(observers)
  states = {}
  if layers:
    hidden, cache, aux = forward_hidden_states(params, cache, tokens, start, n_new, page_table,
                                               layers=layers, cfg=cfg, impl=impl,
                                               input_embeds=embeds)
    states = dict(zip(layers, aux))
  else:
    hidden, cache = forward(params, cache, tokens, start, n_new, page_table, cfg=cfg,
                            impl=impl, input_embeds=embeds)
  sampled, lps = sample_rows(params, hidden, start, n_new, sampling, cfg)
  rows = {}
  if observers:
    nxt = jnp.where(next_tokens < 0, sampled[:, None], next_tokens)
    for d in observers:
      aux = (jnp.concatenate([states[i] for i in d.aux_layers], axis=-1) if d.aux_layers
             else None)
      rows[d.name], cache = d.observe_prefill(params, cache, hidden, nxt, start, n_new,
                                              page_table, impl=impl,
                                              own_params=(own_params or {}).get(d.name),
                                              aux=aux)
  return sampled, lps, rows, cache


def sample_rows(params: Params, hidden: jax.Array, start: jax.Array, n_new: jax.Array,
                sampling: SamplingArrays, cfg: ModelConfig
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """The token after each row's last real position, and its logprobs (`model_step`)."""
  last = jnp.take_along_axis(hidden, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
  logits = compute_logits(params, last, cfg)
  tokens = sample(logits, sampling, start + n_new)
  # The thinking budget: rows sample from their request's state at the step's start.
  tokens = thought.force(sampling, sampling.think_state, sampling.think_count, tokens)
  return tokens, token_logprobs(logits, tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeBatch:
  """The rows of a decode-only call (the plain and the speculative loops' common inputs), B rows
  of which the padding ones have remaining 0. Per-row state a loop must carry is a field here
  (the thinking budget's state rides in `sampling.think_*`; the loops carry it on)."""
  tokens: jax.Array  # [B] each row's newest token, not yet in the cache (at position n_cached)
  n_cached: jax.Array  # [B] tokens in the cache per row
  page_table: jax.Array  # [B, P]
  sampling: SamplingArrays  # [B]
  stop_ids: jax.Array  # [B, S] ids that end a row (padded with -1)
  remaining: jax.Array  # [B] tokens the row may still generate (0 for padding rows)
  min_before_stop: jax.Array  # [B] stop ids are ignored until the row emitted this many more
  num_steps: jax.Array  # int32 scalar: the call's limit (iterations, or tokens speculating)
  want_logprobs: jax.Array  # bool scalar: compute logprobs (a log-softmax and top-k per token)


@functools.partial(jax.jit, static_argnames=("max_steps", "cfg", "impl"),
                   donate_argnames=("cache",))
def decode_loop(params: Params, cache: Cache, batch: DecodeBatch, *, max_steps: int,
                cfg: ModelConfig, impl: KernelChoice = REFERENCE
                ) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, ...], Cache]:
  """Runs up to `batch.num_steps` (<= max_steps) decode iterations on the device: each feeds
  every live row's newest token, samples the next, checks stop ids and limits.

  Returns:
    (out [B, max_steps] new tokens (-1 past each row's count), counts [B],
     stopped [B] bool (the last token is a stop id), logprobs (chosen [B, max_steps], top ids
     [B, max_steps, K], top logprobs [B, max_steps, K]; zeros without want_logprobs), cache).
  """
  b = batch.tokens.shape[0]
  cols = jnp.arange(max_steps, dtype=jnp.int32)[None, :]
  limit = jnp.minimum(batch.remaining, jnp.minimum(batch.num_steps, max_steps))
  page_table, sampling, stop_ids = batch.page_table, batch.sampling, batch.stop_ids

  def step(state):
    cache, tok, n_cached, done, count, out, stopped, lps, thinking = state
    live = (~done).astype(jnp.int32)
    hidden, cache = forward(params, cache, tok[:, None], n_cached, live, page_table, cfg=cfg,
                            impl=impl)
    n_cached = n_cached + live
    logits = compute_logits(params, hidden[:, 0], cfg)
    new = thought.force(sampling, *thinking, sample(logits, sampling, n_cached))
    thinking = thought.advance(sampling, *thinking, new, ~done)
    here = (cols == count[:, None]) & ~done[:, None]  # [B, max_steps]: this step's column
    out = jnp.where(here, new[:, None], out)

    def record(lps):
      chosen, top_ids, top_lp = token_logprobs(logits, new)
      return (jnp.where(here, chosen[:, None], lps[0]),
              jnp.where(here[..., None], top_ids[:, None], lps[1]),
              jnp.where(here[..., None], top_lp[:, None], lps[2]))

    lps = jax.lax.cond(batch.want_logprobs, record, lambda lps: lps, lps)
    count = count + live
    hit = (jnp.any(new[:, None] == stop_ids, axis=-1) & (count >= batch.min_before_stop)
           & ~done)
    stopped = stopped | hit
    done = done | hit | (count >= limit)
    return (cache, jnp.where(live > 0, new, tok), n_cached, done, count, out, stopped, lps,
            thinking)

  zeros = jnp.zeros((b,), jnp.int32)
  k = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
  lps = (jnp.zeros((b, max_steps), jnp.float32), jnp.zeros((b, max_steps, k), jnp.int32),
         jnp.zeros((b, max_steps, k), jnp.float32))
  state = (cache, batch.tokens, batch.n_cached.astype(jnp.int32), limit <= 0, zeros,
           jnp.full((b, max_steps), -1, jnp.int32), jnp.zeros((b,), bool), lps,
           (sampling.think_state.astype(jnp.int32), sampling.think_count.astype(jnp.int32)))
  state = jax.lax.while_loop(lambda s: ~jnp.all(s[3]), step, state)
  cache, _, _, _, count, out, stopped, lps, _ = state
  return out, count, stopped, lps, cache


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
  """logits [..., V] with -inf where `bitmask` [..., ceil(V/32)] int32 has the token's bit
  (bit t % 32 of word t // 32) clear."""
  v = logits.shape[-1]
  ids = jnp.arange(v, dtype=jnp.int32)
  words = jnp.take(bitmask, ids // 32, axis=-1)
  allowed = ((words >> (ids % 32)) & 1).astype(bool)
  return jnp.where(allowed, logits, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "drafters", "k"),
                   donate_argnames=("cache",))
def masked_step(params: Params, cache: Cache, tokens: jax.Array, start: jax.Array,
                n_draft: jax.Array, page_table: jax.Array, sampling: SamplingArrays,
                bitmask: jax.Array, want_logprobs: jax.Array | bool = False,
                rows: dict | None = None, own_params: dict | None = None,
                live: jax.Array | None = None, drafting: jax.Array | None = None, *,
                cfg: ModelConfig, impl: KernelChoice = REFERENCE, drafters: tuple = (),
                k: int = 0):
  """One masked step of constrained rows: forward over `[newest, d_1 .. d_K]`, then the
  speculative rule (`acceptance.verify`) on the masked logits. With K = 0 (T = 1) it is plain
  masked sampling; a draft the mask forbids has logit -inf, so verification rejects it, and
  the emitted tokens are what masked decoding one token at a time gives (greedy: the argmax
  over allowed tokens; sampled: the (seed, position) sample of the masked distribution).

  Args:
    tokens: [B, T] int32, each row's newest token then its drafts (padding past n_draft).
    start: [B] the newest token's position (= tokens in the cache); n_draft: [B] in [0, T-1]
      (a padding row: start past the page table, so it writes nothing).
    bitmask: [B, T, ceil(V/32)] int32: slot i's mask is for the token after tokens[:, i]
      (valid where d_1 .. d_i are accepted, the only case in which it is read).
    drafters: the model drafters that draft for constrained rows on the device
      (`speculative/constrained.py`): each observes the verified block (its row state `rows`
      {name: [B, width]}, its own weights in `own_params`) and proposes k drafts for the next
      step; live [B] bool: the real rows; drafting [B] int32: each row's drafter id.
  Returns:
    (emitted [B, T] int32 (-1 past each row's count), counts [B] (n_accepted + 1), logprobs of
    the emitted tokens under the model (chosen [B, T], top ids and logprobs [B, T, K]), the
    drafters' rows' state {name: [B, width]}, next drafts [B, k], cache).
  """
  b, t = tokens.shape
  layers = aux_layers_of(drafters)
  aux = {}
  if layers:
    hidden, cache, states = forward_hidden_states(params, cache, tokens, start, n_draft + 1,
                                                  page_table, layers=layers, cfg=cfg, impl=impl)
    aux = dict(zip(layers, states))
  else:
    hidden, cache = forward(params, cache, tokens, start, n_draft + 1, page_table, cfg=cfg,
                            impl=impl)
  logits = compute_logits(params, hidden, cfg)  # [B, T, V]
  masked = apply_bitmask(logits.astype(jnp.float32), bitmask)
  # The thinking budget: the slot it forces admits only the end marker, where the grammar
  # admits it too (a grammar that does not wins); the masks after that slot were computed
  # along the drafts, so the drafts end there.
  _, forced = thought.force_block(sampling, sampling.think_state, sampling.think_count,
                                  tokens[:, 1:], n_draft)
  marker = sampling.think_end[:, 0]
  word = jnp.take_along_axis(bitmask, jnp.broadcast_to(
      jnp.maximum(marker, 0)[:, None, None] // 32, (b, t, 1)), axis=-1)[..., 0]
  forced = forced & (((word >> (jnp.maximum(marker, 0)[:, None] % 32)) & 1) == 1)
  first = jnp.argmax(forced, axis=1).astype(jnp.int32)
  n_draft = jnp.where(jnp.any(forced, axis=1), jnp.minimum(n_draft, first), n_draft)
  masked = thought.only_marker(masked, forced, marker)
  if t == 1:  # no drafts: verify's rule at K = 0, without its conditionals
    n_acc, extra = jnp.zeros((b,), jnp.int32), sample(masked[:, 0], sampling, start + 1)
  else:
    n_acc, extra = verify(masked, tokens[:, 1:], None, n_draft, sampling, start + 1)
  cols = jnp.arange(t, dtype=jnp.int32)[None, :]
  drafts = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  emitted = jnp.where(cols < n_acc[:, None], drafts,
                      jnp.where(cols == n_acc[:, None], extra[:, None], -1))
  k = min(MAX_TOP_LOGPROBS, cfg.vocab_size)

  def record(_):
    flat = token_logprobs(logits.reshape(b * t, -1), jnp.maximum(emitted, 0).reshape(-1))
    return (flat[0].reshape(b, t), flat[1].reshape(b, t, k), flat[2].reshape(b, t, k))

  def skip(_):
    return (jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, k), jnp.int32),
            jnp.zeros((b, t, k), jnp.float32))

  lps = jax.lax.cond(want_logprobs, record, skip, None)
  new_rows, next_drafts = {}, jnp.zeros((b, k), jnp.int32)
  if drafters:
    n_acc_live = n_acc * live.astype(jnp.int32)
    block = constrained.Block(hidden=hidden, aux=aux, n_accepted=n_acc_live, extra=extra,
                              emitted=jnp.maximum(emitted, 0))
    new_rows, next_drafts, cache = constrained.observe_and_propose(
        drafters, block, params=params, own_params=own_params or {}, cache=cache, rows=rows,
        tokens=tokens, start=start, live=live, drafting=drafting, page_table=page_table,
        sampling=sampling, k=k, cfg=cfg, impl=impl)
  return emitted, n_acc + 1, lps, new_rows, next_drafts, cache
