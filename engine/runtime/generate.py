"""Batch generation: one jitted prefill, then one jitted `lax.while_loop` of decode steps.

Data flow for a batch of B prompts of different lengths:
1. `prefill` runs the prompts (right-padded to a length bucket) through the model, writing the
   paged cache, and returns the logits of each row's last prompt token.
2. `decode` samples the first new token from those logits, then loops on the device: forward one
   token per row through the cache, sample, record, check stops. Rows stop independently (EOS,
   stop token ids, their own max_new_tokens); a finished row writes nothing and changes nothing.
   No host round trip happens until the loop ends. The cache is donated to both calls.

Everything is static-shaped: the prompt bucket, the batch size and the output buffer length
select the compiled program. Speculative decoding runs on the serving engine (`batch.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.cache import Cache, contiguous_page_table, init_cache
from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.model.transformer import compute_logits, forward
from engine.runtime.batch import Completion, SpeculativeConfig, run_on_engine
from engine.runtime.buckets import bucket
from engine.runtime.sampling import SamplingArrays, SamplingParams, sample

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_REASONS = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
def prefill(params: Params, cache: Cache, tokens: jax.Array, lengths: jax.Array,
            page_table: jax.Array, *, cfg: ModelConfig,
            impl: KernelChoice = REFERENCE) -> tuple[jax.Array, Cache]:
  """Prompts [B, T] (right-padded), lengths [B] -> (last-token logits [B, V] float32, cache)."""
  b = tokens.shape[0]
  hidden, cache = forward(params, cache, tokens, jnp.zeros((b,), jnp.int32), lengths,
                          page_table, cfg=cfg, impl=impl)
  last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  return compute_logits(params, last, cfg), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StopCriteria:
  """Per-row stopping rules, all device arrays."""
  max_new_tokens: jax.Array  # [B] int32, each >= 1
  stop_ids: jax.Array  # [B, S] int32, padded with -1 (EOS ids go here unless ignored)
  min_new_tokens: jax.Array  # [B] int32: stop ids are not honoured before this many tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeOutput:
  tokens: jax.Array  # [B, max_steps] int32, -1 past each row's end
  num_tokens: jax.Array  # [B] int32
  finish_reason: jax.Array  # [B] int32 (FINISH_*)


def _choose(logits, n_cached, n_out, done, out, reasons, *, sampling: SamplingArrays,
            stops: StopCriteria, max_steps: int):
  """Samples the next token of every live row and records it; finished rows stay put."""
  steps = jnp.arange(max_steps, dtype=jnp.int32)[None, :]
  tok = sample(logits, sampling, n_cached)
  live = ~done
  out = jnp.where((steps == n_out[:, None]) & live[:, None], tok[:, None], out)
  n_out = n_out + live.astype(jnp.int32)
  hit_stop = jnp.any(tok[:, None] == stops.stop_ids, axis=-1) & (n_out >= stops.min_new_tokens)
  hit_len = n_out >= jnp.minimum(stops.max_new_tokens, max_steps)  # also bounds the loop
  reason = jnp.where(hit_stop, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, FINISH_NONE))
  reasons = jnp.where(live, reason, reasons)
  return tok, n_out, done | (reasons != FINISH_NONE), out, reasons


def _choose_first(first_logits, lengths, choose, max_steps: int):
  b = first_logits.shape[0]
  zeros = jnp.zeros((b,), jnp.int32)
  return choose(first_logits, lengths, zeros, jnp.zeros((b,), bool),
                jnp.full((b, max_steps), -1, jnp.int32), zeros)


@jax.jit
def first_token(first_logits: jax.Array, lengths: jax.Array, sampling: SamplingArrays,
                stops: StopCriteria) -> DecodeOutput:
  """`decode` for max_new_tokens == 1 (time to first token): samples from the prefill's logits
  without the decode program (and without touching the cache)."""
  choose = functools.partial(_choose, sampling=sampling, stops=stops, max_steps=1)
  _, n_out, _, out, reasons = _choose_first(first_logits, lengths, choose, 1)
  return DecodeOutput(tokens=out, num_tokens=n_out, finish_reason=reasons)


@functools.partial(jax.jit, static_argnames=("max_steps", "cfg", "impl"),
                   donate_argnames=("cache",))
def decode(params: Params, cache: Cache, first_logits: jax.Array, lengths: jax.Array,
           page_table: jax.Array, sampling: SamplingArrays, stops: StopCriteria, *,
           max_steps: int, cfg: ModelConfig,
           impl: KernelChoice = REFERENCE) -> tuple[DecodeOutput, Cache]:
  """Samples up to `max_steps` tokens per row inside one `lax.while_loop`.

  Args:
    first_logits: [B, V] logits of each row's last prompt token (from `prefill`).
    lengths: [B] tokens already in the cache per row (the prompt lengths).
  Returns:
    (DecodeOutput, cache).
  """
  choose = functools.partial(_choose, sampling=sampling, stops=stops, max_steps=max_steps)

  def step(state):
    cache, tok, n_cached, done, n_out, out, reasons = state
    live = (~done).astype(jnp.int32)
    hidden, cache = forward(params, cache, tok[:, None], n_cached, live, page_table,
                            cfg=cfg, impl=impl)
    n_cached = n_cached + live
    logits = compute_logits(params, hidden[:, 0], cfg)
    tok, n_out, done, out, reasons = choose(logits, n_cached, n_out, done, out, reasons)
    return cache, tok, n_cached, done, n_out, out, reasons

  tok, n_out, done, out, reasons = _choose_first(first_logits, lengths, choose, max_steps)
  # The newest token is not in the cache yet: each step feeds it, then samples the next one.
  state = (cache, tok, lengths.astype(jnp.int32), done, n_out, out, reasons)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s[3]), step, state)
  cache, _, _, _, n_out, out, reasons = state
  return DecodeOutput(tokens=out, num_tokens=n_out, finish_reason=reasons), cache


# ---- host-side driver ------------------------------------------------------------------------

def generate_tokens(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int | Sequence[int] = 32,
                    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                    eos_ids: Sequence[int] = (), stop_token_ids: Sequence[Sequence[int]] = (),
                    ignore_eos: bool = False, min_new_tokens: int = 0, page_size: int = 16,
                    cache_dtype=None, impl: KernelChoice = REFERENCE,
                    speculative: SpeculativeConfig | None = None) -> list[Completion]:
  """Generates for a batch of token-id prompts of different lengths.

  With `speculative`, the batch runs as requests of a kept serving engine (`batch.py`, the one
  speculative loop): drafts are verified several per target forward and the output is the
  same as without it (identical under greedy, same distribution when sampling); each
  `Completion.spec` carries the row's counters.
  """
  b = len(prompts)
  if b == 0:
    return []
  lengths = [len(p) for p in prompts]
  if min(lengths) == 0:
    raise ValueError("every prompt needs at least one token")
  max_new = ([int(max_new_tokens)] * b if isinstance(max_new_tokens, int)
             else [int(m) for m in max_new_tokens])
  if len(max_new) != b or min(max_new) < 1:
    raise ValueError("max_new_tokens must be >= 1 for every prompt")
  samp = [sampling] * b if isinstance(sampling, SamplingParams) else list(sampling)
  if len(samp) != b:
    raise ValueError(f"got {len(samp)} sampling settings for {b} prompts")
  total = max(l + m for l, m in zip(lengths, max_new))
  if total > cfg.max_position_embeddings:
    raise ValueError(f"prompt + max_new_tokens = {total} exceeds the model's "
                     f"max_position_embeddings ({cfg.max_position_embeddings})")
  if speculative is not None:
    return run_on_engine(params, cfg, prompts, max_new_tokens=max_new, sampling=samp,
                         eos_ids=eos_ids, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                         min_new_tokens=min_new_tokens, speculative=speculative,
                         cache_dtype=cache_dtype, impl=impl)

  t_bucket = bucket(max(lengths))
  max_steps = bucket(max(max_new), minimum=8)
  capacity = max(t_bucket, max(lengths) + max_steps)
  page_table = jnp.asarray(contiguous_page_table(b, capacity, page_size))
  dtype = cache_dtype or params["embed"].dtype
  cache = init_cache(cfg, page_table.size, page_size, dtype)

  tokens = np.zeros((b, t_bucket), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lengths_arr = jnp.asarray(lengths, jnp.int32)
  logits, cache = prefill(params, cache, jnp.asarray(tokens), lengths_arr, page_table, cfg=cfg,
                          impl=impl)
  stop_rows = []
  for i in range(b):
    row = list(stop_token_ids[i]) if i < len(stop_token_ids) else []
    if not ignore_eos:
      row += list(eos_ids)
    stop_rows.append(row)
  width = max(1, max(len(r) for r in stop_rows))
  stop_arr = np.full((b, width), -1, np.int32)
  for i, r in enumerate(stop_rows):
    stop_arr[i, :len(r)] = r
  stops = StopCriteria(max_new_tokens=jnp.asarray(max_new, jnp.int32),
                       stop_ids=jnp.asarray(stop_arr),
                       min_new_tokens=jnp.full((b,), min_new_tokens, jnp.int32))
  if max(max_new) == 1:
    out = first_token(logits, lengths_arr, SamplingArrays.from_params(samp), stops)
  else:
    out, cache = decode(params, cache, logits, lengths_arr, page_table,
                        SamplingArrays.from_params(samp), stops, max_steps=max_steps, cfg=cfg,
                        impl=impl)
  del cache
  toks, counts, reasons = jax.device_get((out.tokens, out.num_tokens, out.finish_reason))
  return [Completion(token_ids=[int(t) for t in toks[i, :counts[i]]],
                     finish_reason=FINISH_REASONS[int(reasons[i])] or "length",
                     prompt_tokens=lengths[i])
          for i in range(b)]
