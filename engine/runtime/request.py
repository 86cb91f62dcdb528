"""A request's state as the scheduler and engine see it, and what the engine reports back.

Following vLLM V1, a request is described by two counters: `num_tokens` (known tokens: prompt
plus outputs so far) and `num_computed` (tokens whose KV entries are in the cache). One rule
then covers everything: each step schedules up to `num_tokens - num_computed` tokens; a prefill
chunk, a decode token and a recompute after preemption differ only in that difference.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Sequence

import numpy as np

from engine.runtime.sampling import SamplingParams

MAX_STOP_IDS = 16  # stop token ids per request (EOS included): a static shape of decode_loop


class Status(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  FINISHED = "finished"


FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


@dataclasses.dataclass(frozen=True)
class StopParams:
  """When a request ends. `max_tokens` counts generated tokens."""
  max_tokens: int = 64
  min_tokens: int = 0  # stop ids / strings are not honoured before this many tokens
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()  # stop strings, matched on the detokenised text
  ignore_eos: bool = False
  include_stop_str_in_output: bool = False
  # Output text keeps special-token text (`<|tool_call_begin|>`) when False: chat output
  # parsers read the markers; stop strings then match on that text too.
  skip_special_tokens: bool = True

  def validate(self) -> None:
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
    if not 0 <= self.min_tokens <= self.max_tokens:
      raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
    if any(not s for s in self.stop):
      raise ValueError("stop strings must be non-empty")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """A generated token's log-probability and the top alternatives (id, logprob), best first."""
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class Timings:
  """Wall-clock timestamps (time.monotonic) of a request's life."""
  arrival: float = 0.0
  first_scheduled: float | None = None
  first_token: float | None = None
  finished: float | None = None
  encode_s: float = 0.0  # spent encoding its images (calls that encoded one of them)

  @property
  def queue_s(self) -> float | None:
    return None if self.first_scheduled is None else self.first_scheduled - self.arrival

  @property
  def ttft_s(self) -> float | None:
    return None if self.first_token is None else self.first_token - self.arrival

  @property
  def e2e_s(self) -> float | None:
    return None if self.finished is None else self.finished - self.arrival


@dataclasses.dataclass
class Usage:
  prompt_tokens: int
  cached_tokens: int  # prompt tokens served from the prefix cache at admission
  completion_tokens: int
  spec_drafts: int = 0  # speculative verification steps with a draft
  spec_draft_tokens: int = 0
  spec_accepted_tokens: int = 0


@dataclasses.dataclass
class Request:
  """One generation request and its progress."""
  request_id: str
  prompt_ids: list[int]
  sampling: SamplingParams
  stop: StopParams
  stop_ids: tuple[int, ...]  # token ids that end the request (stop ids + EOS unless ignored)
  arrival_order: int
  output_ids: list[int] = dataclasses.field(default_factory=list)
  output_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # if asked
  status: Status = Status.WAITING
  num_computed: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  page_keys: list[int] = dataclasses.field(default_factory=list)  # keys of full known pages
  num_cached_pages: int = 0  # leading pages already registered in the prefix cache
  # Its pages (by index) where some position lacks an entry of a drafter with entries of its
  # own in the cache (`Scheduler.observers`): no forward wrote it there, or a prefix hit's page
  # lacked it. Absent: the page holds every such entry.
  pages_lacking: dict[int, set[str]] = dataclasses.field(default_factory=dict)
  cached_tokens: int | None = None
  num_preemptions: int = 0
  # Speculative decoding: its drafter, estimates, counters and drafters' row state
  # (`speculative.policy.RequestSpec`, set at admission; None: the request drafts nothing).
  spec: Any = None
  # Images (`multimodal.ImageInput`, in prompt order): their placeholder spans, pixels and
  # content hashes; `image_features` holds encoder outputs by image index while it prefills.
  images: tuple[Any, ...] = ()
  image_features: dict[int, Any] = dataclasses.field(default_factory=dict)
  # Structured outputs: the request's grammar matcher (`grammar.GrammarMatcher`, set at
  # admission; None: unconstrained). Constrained requests sample only in the engine's masked
  # step (`steps.masked_step`), never in `model_step` or the decode loops.
  grammar: Any = None
  # The thinking budget's state (`thought.ThoughtState`, from `SamplingParams.thought()` at
  # admission; None: no budget): advanced with every output token (`outputs.append_tokens`),
  # so a preempted request's replay and every program start from its current count.
  thought: Any = None
  finish_reason: str | None = None
  stop_reason: str | int | None = None  # the stop string or stop token id that ended it
  timings: Timings = dataclasses.field(default_factory=lambda: Timings(time.monotonic()))
  # Host-side detokenisation state (engine-owned).
  text: str = ""
  num_sent_ids: int = 0
  num_sent_chars: int = 0

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_ids) + len(self.output_ids)

  @property
  def all_ids(self) -> list[int]:
    return self.prompt_ids + self.output_ids

  @property
  def num_uncomputed(self) -> int:
    return self.num_tokens - self.num_computed

  @property
  def is_decoding(self) -> bool:
    """Only the newest sampled token is missing from the cache."""
    return bool(self.output_ids) and self.num_uncomputed == 1

  @property
  def constrained(self) -> bool:
    return self.grammar is not None

  @property
  def finished(self) -> bool:
    return self.status is Status.FINISHED

  def usage(self) -> Usage:
    spec = self.spec
    return Usage(prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached_tokens or 0,
                 completion_tokens=len(self.output_ids),
                 spec_drafts=spec.drafts if spec is not None else 0,
                 spec_draft_tokens=spec.drafted if spec is not None else 0,
                 spec_accepted_tokens=spec.accepted if spec is not None else 0)


@dataclasses.dataclass
class RequestOutput:
  """An incremental update for one request (what a stream yields)."""
  request_id: str
  new_token_ids: list[int]
  text_delta: str
  finished: bool
  finish_reason: str | None  # "stop", "length", "abort" once finished
  usage: Usage
  timings: Timings
  stop_reason: str | int | None = None  # with finish "stop": the stop string or token id
  new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked


def stop_ids_for(stop: StopParams, eos_ids: Sequence[int]) -> tuple[int, ...]:
  return tuple(stop.stop_token_ids) + (() if stop.ignore_eos else tuple(eos_ids))


def check_stop_and_room(ids: Sequence[int], stop: StopParams, eos_ids: Sequence[int], *,
                        vocab_size: int, max_model_len: int, page_size: int,
                        usable_pages: int) -> tuple[int, ...]:
  """Validates `stop` and that the prompt leaves room to generate, in the model and in the
  pool; returns the request's stop ids. ValueError names the offending field."""
  stop.validate()
  stop_ids = stop_ids_for(stop, eos_ids)
  if len(stop_ids) > MAX_STOP_IDS:
    raise ValueError(f"stop_token_ids: at most {MAX_STOP_IDS - len(eos_ids)} "
                     f"allowed, got {len(stop.stop_token_ids)}")
  bad = [t for t in stop.stop_token_ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"stop_token_ids: {bad[0]} outside the vocabulary [0, {vocab_size})")
  if len(ids) >= max_model_len:
    raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                     f"max_model_len {max_model_len}")
  need = -(-min(len(ids) + stop.max_tokens, max_model_len) // page_size)  # pages
  if need > usable_pages:
    raise ValueError(f"max_tokens: prompt + max_tokens needs {need} cache pages, the pool "
                     f"has {usable_pages}")
  return stop_ids


def wants_logprobs(reqs: Sequence[Request], forced: bool | None = None) -> np.bool_:
  """Whether a decode program over `reqs` must compute logprobs (a device scalar argument):
  `forced` if not None (warm-up), else whether a request asks for them."""
  if forced is not None:
    return np.bool_(forced)
  return np.bool_(any(r.sampling.logprobs is not None for r in reqs))
