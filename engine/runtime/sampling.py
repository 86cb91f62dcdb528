"""Per-row token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Every row of a batch carries its own parameters (`SamplingArrays`), so one compiled step serves
requests with different settings. The transforms apply in Hugging Face's order, each on the
distribution left by the previous one: temperature, top-k, top-p (nucleus over the renormalised
top-k distribution), min-p (relative to the most likely token). Temperature 0 is greedy.

Randomness is a function of (request seed, position of the token being sampled) only, so a
request's samples do not depend on what else is in the batch or on being preempted and
recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.grammar import StructuredOutputsParams
from engine.runtime.thought import ANSWER, MAX_THINK_END, ThoughtState

MAX_TOP_LOGPROBS = 20  # top alternatives per token the serving programs compute (static shape)
# Sampled rows choose among their top PREFILTER_CANDIDATES tokens (lax.top_k) instead of sorting
# the whole vocabulary (160k for Kimi) whenever that is exact; see `over_kept_tokens`.
PREFILTER_CANDIDATES = 1024


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling settings (host side). Defaults give greedy decoding."""
  temperature: float = 0.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  min_p: float = 0.0  # 0: off
  seed: int = 0
  # Serving only: report the sampled token's log-probability and this many top alternatives
  # (None: off; 0: the sampled token only). Log-probabilities are of the model's distribution
  # (log_softmax of the logits), before temperature/top-k/top-p/min-p, as in vLLM.
  logprobs: int | None = None
  # Serving only: the speculative drafter for this request (None: the engine's default;
  # "off", "auto", or the name of one the engine enables: `speculative.drafters.names()`).
  drafter: str | None = None
  max_draft_tokens: int | None = None  # per-request cap on drafts per step (None: the engine's)
  # Serving and engine.generate: constrain the output to a JSON schema / regex / choice /
  # grammar (engine/runtime/grammar.py); the allowed-token mask applies before sampling.
  structured_outputs: StructuredOutputsParams | None = None
  # Serving: at most this many reasoning tokens (None: unbounded). The output starts inside a
  # thought when the prompt opened one (think_in_prompt) or no think_start_token_id is given;
  # else a thought opens where that is the first token (inside one, it is a marker). At the
  # budget every program writes think_end_token_ids[0] itself. Any of think_end_token_ids ends
  # the thought (Kimi's tool section begin too); markers are no reasoning tokens (`thought.py`).
  thinking_token_budget: int | None = None
  think_start_token_id: int | None = None
  think_end_token_ids: tuple[int, ...] = ()
  think_in_prompt: bool = False

  def thought(self) -> ThoughtState | None:
    """The output's initial thought state under the budget (None: no budget)."""
    if self.thinking_token_budget is None:
      return None
    return ThoughtState.for_params(self.thinking_token_budget, self.think_start_token_id,
                                   self.think_end_token_ids, self.think_in_prompt)

  def validate(self) -> None:
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
    if self.drafter is not None and not isinstance(self.drafter, str):
      raise ValueError(f"drafter must be a drafter's name, got {self.drafter!r}")
    if self.max_draft_tokens is not None and self.max_draft_tokens < 1:
      raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
    if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
      raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
    if self.thinking_token_budget is not None:
      if self.thinking_token_budget < 0:
        raise ValueError(f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}")
      if not self.think_end_token_ids:
        raise ValueError("thinking_token_budget needs think_end_token_ids (the marker the "
                         "engine writes at the budget)")
      if len(self.think_end_token_ids) > MAX_THINK_END:
        raise ValueError(f"think_end_token_ids: at most {MAX_THINK_END}, got "
                         f"{len(self.think_end_token_ids)}")
    if self.structured_outputs is not None:
      if not isinstance(self.structured_outputs, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                         f"{type(self.structured_outputs).__name__}")
      self.structured_outputs.validate()  # GrammarError (a ValueError) naming the field


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
  """Device-side per-row sampling parameters, each [B]."""
  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32
  min_p: jax.Array  # float32
  seed: jax.Array  # uint32
  # The thinking budget (`thought.py`): the rule's markers and each row's state at the call's
  # start (the host's `ThoughtState`); rows without a budget: budget -1, state ANSWER.
  think_budget: jax.Array  # int32, -1: none
  think_start: jax.Array  # int32, -1: none
  think_end: jax.Array  # [B, MAX_THINK_END] int32, -1 padded; [:, 0] is the forced marker
  think_state: jax.Array  # int32 (thought.START / THOUGHT / ANSWER)
  think_count: jax.Array  # int32 reasoning tokens so far

  @staticmethod
  def from_params(params: Sequence[SamplingParams],
                  thoughts: Sequence[ThoughtState | None] | None = None) -> "SamplingArrays":
    """`thoughts`: each row's current thought state (None: the request's initial one)."""
    for p in params:
      p.validate()
    thoughts = list(thoughts) if thoughts is not None else [None] * len(params)
    states = [t if t is not None else p.thought() for p, t in zip(params, thoughts)]
    ends = np.full((len(params), MAX_THINK_END), -1, np.int32)
    for i, t in enumerate(states):
      if t is not None:
        ends[i, :len(t.ends)] = t.ends
    # Host arrays: a jitted call transfers them with its other arguments (no compile, no
    # separate dispatch per field).
    return SamplingArrays(
        temperature=np.asarray([p.temperature for p in params], np.float32),
        top_k=np.asarray([p.top_k for p in params], np.int32),
        top_p=np.asarray([p.top_p for p in params], np.float32),
        min_p=np.asarray([p.min_p for p in params], np.float32),
        seed=np.asarray([p.seed for p in params], np.uint32),
        think_budget=np.asarray([-1 if t is None else t.budget for t in states], np.int32),
        think_start=np.asarray([-1 if t is None or t.start is None else t.start
                                for t in states], np.int32),
        think_end=ends,
        think_state=np.asarray([ANSWER if t is None else t.state for t in states], np.int32),
        think_count=np.asarray([0 if t is None else t.count for t in states], np.int32),
    )


def _scaled(logits: jax.Array, s: SamplingArrays) -> jax.Array:
  temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
  return logits.astype(jnp.float32) / temp[:, None]


def _keep_sorted(xs: jax.Array, s: SamplingArrays, log_z: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array]:
  """Which of `xs` [B, M] (scaled logits, descending) survive top-k, top-p and min-p.

  log_z: None when `xs` is the whole vocabulary; otherwise xs is its top M and log_z [B] the
  full vocabulary's logsumexp, the normaliser of rows without top-k (rows with
  0 < top_k <= M renormalise over their top k, all of which are in xs).
  Returns (keep [B, M] bool, probabilities after top-k [B, M]).
  """
  m = xs.shape[-1]
  rank = jnp.arange(m, dtype=jnp.int32)[None, :]
  keep = (s.top_k[:, None] <= 0) | (rank < s.top_k[:, None])
  xk = jnp.where(keep, xs, -jnp.inf)
  lz = jax.nn.logsumexp(xk, axis=-1)
  if log_z is not None:
    lz = jnp.where((s.top_k > 0) & (s.top_k <= m), lz, log_z)
  probs = jnp.exp(xk - lz[:, None])
  before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
  keep = keep & ((before < s.top_p[:, None]) | (s.top_p[:, None] >= 1.0) | (rank == 0))
  keep = keep & (probs >= s.min_p[:, None] * probs[:, :1])
  return keep, probs


def transformed_logits(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
  """Applies temperature/top-k/top-p/min-p over the whole vocabulary. logits [B, V] float32.

  Returns (masked logits sorted in descending order [B, V], vocabulary ids of that order [B, V]);
  masked entries are -inf. Greedy rows are treated as temperature 1 here (callers take argmax).
  """
  x = _scaled(logits, s)
  order = jnp.argsort(-x, axis=-1)
  xs = jnp.take_along_axis(x, order, axis=-1)
  keep, _ = _keep_sorted(xs, s, None)
  return jnp.where(keep, xs, -jnp.inf), order


def candidate_logits(logits: jax.Array, s: SamplingArrays, num: int = PREFILTER_CANDIDATES
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`transformed_logits` restricted to each row's `num` most likely tokens (no full sort).

  Returns (masked [B, num], ids [B, num], exact [B] bool). A row is exact when every token the
  full transform keeps is among its candidates: top_k in [1, num]; or the candidates already
  hold top_p of the probability mass; or the num-th candidate falls below min_p of the best.
  """
  x = _scaled(logits, s)
  xs, ids = jax.lax.top_k(x, num)
  keep, probs = _keep_sorted(xs, s, jax.nn.logsumexp(x, axis=-1))
  top_k_inside = (s.top_k > 0) & (s.top_k <= num)
  normalised = (s.top_k <= 0) | (s.top_k >= x.shape[-1])  # probs are of the full vocabulary
  nucleus_inside = normalised & (jnp.sum(probs, axis=-1) >= s.top_p)
  # Later tokens are no more likely than the num-th, so min-p drops them all (a ratio: any
  # normalisation will do, but top-p must be off for rows whose normaliser is unknown).
  min_p_cut = (probs[:, -1] < s.min_p * probs[:, 0]) & (normalised | (s.top_p >= 1.0))
  exact = top_k_inside | nucleus_inside | min_p_cut
  return jnp.where(keep, xs, -jnp.inf), ids.astype(jnp.int32), exact


def over_kept_tokens(logits: jax.Array, s: SamplingArrays, fn):
  """fn(masked [B, M], ids [B, M]) on the kept tokens of every row, M <= V.

  From `candidate_logits` when that is exact for every sampled row (the usual case: top-k,
  top-p or min-p leave far fewer than PREFILTER_CANDIDATES tokens), else from the full sort.
  `fn` must give the same answer for both (it sees the same kept tokens either way).
  """
  if logits.shape[-1] <= PREFILTER_CANDIDATES:
    return fn(*transformed_logits(logits, s))
  masked, ids, exact = candidate_logits(logits, s)
  return jax.lax.cond(jnp.all(exact | (s.temperature <= 0)),
                      lambda _: fn(masked, ids),
                      lambda _: fn(*transformed_logits(logits, s)), None)


def argmax(logits: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (first index of the maximum), [..., V] -> [...] int32, as two
  plain reductions: XLA:CPU runs argmax's (value, index) reduction ~10x slower (1.1 ms of a
  ~5 ms decode step at batch 32 x 8,192 vocabulary)."""
  m = jnp.max(logits, axis=-1, keepdims=True)
  ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
  first = jnp.min(jnp.where(logits == m, ids, logits.shape[-1]), axis=-1)
  return jnp.minimum(first, logits.shape[-1] - 1)  # a NaN row: last index


def sample(logits: jax.Array, s: SamplingArrays, positions: jax.Array) -> jax.Array:
  """Chooses one token per row. logits [B, V] float32; positions [B] int32 (of the sampled
  token, used with the row's seed for randomness). Returns [B] int32."""
  greedy = argmax(logits)

  def stochastic(_):
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        s.seed, positions.astype(jnp.uint32))

    def pick(masked, ids):
      # Gumbel-max with noise drawn per (row key, vocabulary id): the same token whether it
      # is chosen among the candidates or over the fully sorted vocabulary, and only the
      # tokens considered cost a random draw.
      noise = jax.vmap(lambda k, row: jax.vmap(
          lambda i: jax.random.gumbel(jax.random.fold_in(k, i)))(row))(keys, ids)
      score = masked + noise
      best = argmax(score)[:, None]
      return jnp.take_along_axis(ids, best, axis=-1)[:, 0].astype(jnp.int32)

    return jnp.where(s.temperature > 0, over_kept_tokens(logits, s, pick), greedy)

  return jax.lax.cond(jnp.any(s.temperature > 0), stochastic, lambda _: greedy, None)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Log-probabilities of `tokens` [B] under logits [B, V] (the model's distribution), and the
  top MAX_TOP_LOGPROBS alternatives: ([B] float32, ids [B, K] int32, logprobs [B, K])."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]))
  return chosen, top_ids.astype(jnp.int32), top_lp
