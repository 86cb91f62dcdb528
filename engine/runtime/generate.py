"""Batch generation: one jitted prefill, then one jitted `lax.while_loop` of decode steps.

Data flow for a batch of B prompts of different lengths:
1. `prefill` runs the prompts (right-padded to a length bucket) through the model, writing the
   paged cache, and returns the logits of each row's last prompt token.
2. `decode` samples the first new token from those logits, then loops on the device: forward one
   token per row through the cache, sample, record, check stops. Rows stop independently (EOS,
   stop token ids, their own max_new_tokens); a finished row writes nothing and changes nothing.
   No host round trip happens until the loop ends. The cache is donated to both calls.

Everything is static-shaped: the prompt bucket, the batch size and the output buffer length
select the compiled program.
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
  b = first_logits.shape[0]
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

@dataclasses.dataclass
class Completion:
  """One prompt's result."""
  token_ids: list[int]
  finish_reason: str  # "stop" or "length"
  prompt_tokens: int
  spec: dict | None = None  # speculative decoding counters of this row (see spec_summary)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How `generate_tokens` speculates (see `engine.runtime.speculative`).

  method: "ngram" (prompt lookup), "mtp" (the checkpoint's MTP layer), "draft" (a small
  model with the same tokenizer: `draft_cfg`, `draft_params`) or "learned" (an n-gram table
  learned across requests: `memory`, a `learned.NgramMemory` updated in place; a fresh one per
  call if None). "auto" (every drafter the model supports, chosen as it goes, adaptive k) is
  not this module's: `engine.generate` runs it through the serving engine
  (`engine.api.generate_on_engine`). num_draft_tokens: K >= 1. adaptive: pick the draft
  length (<= K) every loop step by the goodput model of `speculative.goodput`, with each
  draft length's step time measured on this machine the first time a batch shape is seen
  (`speculative.probes.loop_costs`), or, when `draft_cost` or `verify_cost` is given, modelled
  as 1 + k (draft_cost + verify_cost B) relative to a plain decode step; once plain decoding
  (timed too) would finish sooner, the loop of a model drafter (mtp, draft) stops speculating
  and decodes the rest plainly, without the drafter's upkeep (`speculative.loop`, plain phase).
  rests: after such a call, the next calls of the same model, drafter and shape decode
  plainly, without the drafter's set-up, before one speculates again (`speculative.rest`;
  their `Completion.spec` says "rested"). False: every call speculates.
  """
  method: str
  num_draft_tokens: int = 4
  draft_cfg: ModelConfig | None = None
  draft_params: Params | None = None
  memory: object | None = None  # engine.runtime.speculative.learned.NgramMemory
  adaptive: bool = False
  draft_cost: float | None = None
  verify_cost: float | None = None
  rests: bool = True

  def validate(self, cfg: ModelConfig) -> None:
    methods = ("ngram", "mtp", "draft", "learned")  # speculative.loop.DRAFTERS
    if self.method == "auto":
      raise ValueError("speculative method 'auto' runs on the serving engine: use "
                       "engine.generate (engine.api.generate_on_engine), not generate_tokens")
    if self.method not in methods:
      raise ValueError(f"unknown speculative method {self.method!r}; expected one of {methods}")
    if self.num_draft_tokens < 1:
      raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
    if self.method == "mtp" and cfg.num_nextn_predict_layers < 1:
      raise ValueError(f"speculative method 'mtp' needs an MTP layer: {cfg.no_mtp_reason}")
    if self.method == "draft":
      if self.draft_cfg is None or self.draft_params is None:
        raise ValueError("speculative method 'draft' needs draft_cfg and draft_params")
      if self.draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({self.draft_cfg.vocab_size}) differs "
                         f"from the target's ({cfg.vocab_size})")


def spec_summary(drafted_steps: int, draft_tokens: int, accepted: int, steps: int,
                 emitted: int, accepted_at: Sequence[int]) -> dict:
  """Counters as reported: mean accepted length = tokens emitted per target forward."""
  return {"steps": steps, "drafts": drafted_steps, "drafted": draft_tokens,
          "accepted": accepted, "accepted_at": list(accepted_at),
          "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
          "mean_accepted_length": emitted / steps if steps else 0.0}


def bucket(n: int, minimum: int = 16) -> int:
  """Next power of two >= n (and >= minimum): bounds the number of compiled shapes."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def generate_tokens(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int | Sequence[int] = 32,
                    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                    eos_ids: Sequence[int] = (), stop_token_ids: Sequence[Sequence[int]] = (),
                    ignore_eos: bool = False, min_new_tokens: int = 0, page_size: int = 16,
                    cache_dtype=None, impl: KernelChoice = REFERENCE,
                    speculative: SpeculativeConfig | None = None) -> list[Completion]:
  """Generates for a batch of token-id prompts of different lengths.

  With `speculative`, decoding drafts and verifies several tokens per target forward; the
  output is the same as without it (identical under greedy, same distribution when sampling),
  and each `Completion.spec` carries the row's counters.
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
  if speculative is not None:
    speculative.validate(cfg)
  total = max(l + m for l, m in zip(lengths, max_new))
  if total > cfg.max_position_embeddings:
    raise ValueError(f"prompt + max_new_tokens = {total} exceeds the model's "
                     f"max_position_embeddings ({cfg.max_position_embeddings})")

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
  rest = rested = None  # an adaptive model drafter's rest schedule (`speculative.rest`)
  if speculative is not None:  # the compiled loop's shape (its measured costs' key)
    shape_key = (cfg, b, speculative.num_draft_tokens, speculative.method, page_table.shape,
                 max_steps, page_size, jnp.dtype(dtype).name, speculative.draft_cfg, impl)
  if (speculative is not None and speculative.adaptive and speculative.rests
      and speculative.method in ("mtp", "draft")):
    from engine.runtime.speculative.rest import loop_rest
    rest = loop_rest(shape_key + (id(params), id(speculative.draft_params),
                                  speculative.draft_cost, speculative.verify_cost))
    if rest.take():  # this call decodes plainly: no drafter set-up, no speculative loop
      rested, speculative = speculative, None
  if speculative is not None and speculative.method == "mtp":
    from engine.runtime.speculative.loop import prefill_hidden  # imports this module
    logits, prompt_hidden, cache = prefill_hidden(params, cache, jnp.asarray(tokens),
                                                  lengths_arr, page_table, cfg=cfg, impl=impl)
  else:
    logits, cache = prefill(params, cache, jnp.asarray(tokens), lengths_arr, page_table,
                            cfg=cfg, impl=impl)

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
  if speculative is not None:
    return _speculate(params, cfg, cache, logits, tokens, lengths, page_table,
                      SamplingArrays.from_params(samp), stops, max_steps, speculative,
                      prompt_hidden if speculative.method == "mtp" else None, page_size, dtype,
                      impl, shape_key, rest)
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
                     prompt_tokens=lengths[i],
                     spec=None if rested is None else _rested_summary(
                         rested, int(counts[i]) - 1, int(max(counts)) - 1))
          for i in range(b)]


def _rested_summary(spec: SpeculativeConfig, steps: int, loop_steps: int) -> dict:
  """A resting call's counters (`speculative.rest`): every step plain, nothing drafted."""
  from engine.runtime.speculative.loop import spec_k_choices  # imports this module
  summary = spec_summary(0, 0, 0, steps, steps, [0] * spec.num_draft_tokens)
  summary.update(k_steps={c: 0 for c in spec_k_choices(spec.num_draft_tokens, spec.method)},
                 plain_steps=loop_steps, rested=True, model_expected_tokens=0.0,
                 model_emitted_tokens=0.0)
  return summary


def _speculate(params, cfg, cache, logits, tokens, lengths, page_table, sampling, stops,
               max_steps, spec, prompt_hidden, page_size, dtype, impl, shape_key, rest
               ) -> list[Completion]:
  """`generate_tokens`' speculative tail: drafter set-up, `speculative_decode`, counters;
  `shape_key` keys the measured step costs; `rest` (a `speculative.rest.Rest` or None) learns
  whether the loop gave speculation up."""
  from engine.runtime.speculative.loop import speculative_decode  # imports this module

  lengths_arr = jnp.asarray(lengths, jnp.int32)
  draft_cache = None
  if spec.method == "draft":
    draft_cache = init_cache(spec.draft_cfg, page_table.size, page_size, dtype)
    _, draft_cache = prefill(spec.draft_params, draft_cache, jnp.asarray(tokens), lengths_arr,
                             page_table, cfg=spec.draft_cfg, impl=impl)
  memory = None
  if spec.method == "learned":
    from engine.runtime.speculative.learned import NgramMemory
    memory = spec.memory if spec.memory is not None else NgramMemory()
    devices = params["embed"].sharding.device_set
    if len(devices) == 1:  # committed like the returned table: a reused one compiles nothing
      memory.table = jax.device_put(memory.table, next(iter(devices)))
  from engine.runtime.speculative import goodput, probes
  from engine.runtime.speculative.loop import spec_k_choices
  choices = spec_k_choices(spec.num_draft_tokens, spec.method) if spec.adaptive else ()

  def run(cache, table, stops, costs, plain_cost, force_k):
    return speculative_decode(
        params, cache, logits, jnp.asarray(tokens), lengths_arr, page_table, sampling, stops,
        prompt_hidden, spec.draft_params if spec.method == "draft" else None, draft_cache,
        table, max_steps=max_steps, num_draft=spec.num_draft_tokens, drafter=spec.method,
        cfg=cfg, draft_cfg=spec.draft_cfg if spec.method == "draft" else None, impl=impl,
        adaptive=spec.adaptive, step_costs=costs, force_k=np.int32(force_k),
        plain_cost=plain_cost)

  costs = plain_cost = None
  # The plain phase (`speculative.loop`): for the model drafters, whose upkeep it drops. A
  # deterministic drafter's k = 0 costs little more than plain decoding and keeps looking one
  # token ahead, so it can start drafting again when the text turns repetitive.
  upkeep = spec.adaptive and spec.method in ("mtp", "draft")
  if spec.adaptive and spec.draft_cost is None and spec.verify_cost is None:
    # Timed on this very program (forced to each choice, on a scratch cache and table, its
    # own budgets and no stop ids), so the probes compile nothing the real call will not use.
    scratch = {"cache": jax.tree.map(jnp.zeros_like, cache),
               "table": None if memory is None else jax.tree.map(jnp.copy, memory.table)}
    def probe(i, n):
      budget = StopCriteria(max_new_tokens=jnp.full_like(stops.max_new_tokens, n),
                            stop_ids=jnp.full_like(stops.stop_ids, -1),
                            min_new_tokens=jnp.zeros_like(stops.min_new_tokens))
      res, scratch["cache"] = run(scratch["cache"], scratch["table"], budget,
                                  goodput.step_costs(choices, len(lengths)),
                                  np.float32(1.0) if upkeep else None, i)
      scratch["table"] = res.ngram_table
      return jnp.append(res.k_steps, res.plain_steps)

    costs, plain_cost = probes.loop_costs(shape_key, probe, choices,
                                          min(max_steps, probes.LOOP_PROBE_TOKENS),
                                          plain=upkeep)
    costs = jnp.asarray(costs, jnp.float32)
    plain_cost = np.float32(plain_cost) if upkeep else None
    del scratch
  elif spec.adaptive:  # relative to a plain decode step: an unmeasured plain phase costs 1
    costs = goodput.step_costs(choices, len(lengths), spec.draft_cost or 0.0,
                               spec.verify_cost or 0.0)
    plain_cost = np.float32(1.0) if upkeep else None
  out, cache = run(cache, memory.table if memory is not None else None, stops, costs,
                   plain_cost, -1)
  del cache
  if memory is not None:
    memory.table = out.ngram_table
  if rest is not None:
    rest.after_speculating(gave_up=int(out.plain_steps) > 0)
  toks, counts, reasons, st, k_steps, calibration, plain_steps = jax.device_get(
      (out.tokens, out.num_tokens, out.finish_reason, out.stats, out.k_steps, out.calibration,
       out.plain_steps))
  result = []
  for i in range(len(lengths)):
    # Tokens from verification steps: all but the first (which prefill produced).
    summary = spec_summary(int(st.drafted_steps[i]), int(st.draft_tokens[i]),
                           int(st.accepted_tokens[i]), int(st.steps[i]), int(counts[i]) - 1,
                           [int(x) for x in st.accepted_at[i]])
    if spec.adaptive:  # loop steps per draft length (the whole batch shares the choice)
      summary["k_steps"] = dict(zip(choices, map(int, k_steps)))
      summary["plain_steps"] = int(plain_steps)  # after the loop gave speculation up
      summary["rested"] = False
      # the goodput model's tokens expected / emitted over the batch's steps that drafted
      summary["model_expected_tokens"], summary["model_emitted_tokens"] = map(float,
                                                                              calibration)
    result.append(Completion(token_ids=[int(t) for t in toks[i, :counts[i]]],
                             finish_reason=FINISH_REASONS[int(reasons[i])] or "length",
                             prompt_tokens=lengths[i], spec=summary))
  return result
