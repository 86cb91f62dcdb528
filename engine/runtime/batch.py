"""A batch run to completion on a kept serving `Engine`: how `generate_tokens(speculative=...)`
and `engine.generate` speculate. There is one speculative loop, the engine's
(`speculative/loop.py`); a batch of prompts becomes a batch of requests.

The engine is sized for the batch (max_num_seqs = batch, max_model_len = the prompt plus tokens
to a quarter octave, pages for the batch twice over, max_decode_steps the bucketed token
budget): nothing joins a closed batch, so it decodes in one call, as `generate_tokens`' plain
fixed-batch loop does (a speculative call gets that many plain iterations' time), and its decode
programs are compiled (and its cost table timed) for the whole batch only. It is kept for later
calls of the same configuration (the KEPT_ENGINES most recently used, as vLLM's `LLM` keeps its
engine): its prefix cache, its learned table and its acceptance estimates live on.
`release_engines` drops them; a call that raised drops its engine. A new engine with drafters
times its cost table once (`SpecRuntime.measure_costs`) unless the config says to keep the
roofline.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Sequence

import jax

from engine.model.config import ModelConfig
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params
from engine.runtime.buckets import bucket, quarter_bucket
from engine.runtime.engine import MAX_STOP_IDS, Engine, EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative.loop import AUTO

METHODS = ("ngram", "learned", "mtp", "draft", AUTO)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How a batch speculates (see `engine.runtime.speculative`).

  method: "ngram" (prompt lookup), "learned" (an n-gram table learned across requests:
  `memory`, a `learned.NgramMemory` updated in place; else the kept engine's own table), "mtp"
  (the checkpoint's MTP layer), "draft" (a small model with the same tokenizer: `draft_cfg`,
  `draft_params`) or "auto" (every drafter the model supports, chosen per row as it goes,
  adaptive). num_draft_tokens: K >= 1. adaptive: choose every iteration whether to draft (up to
  K per row) or decode plainly, from the acceptance estimates and the cost table (always on
  for "auto").
  measure_costs: time the cost table on this machine when the engine is built (else the
  roofline, `speculative.costs`)."""
  method: str
  num_draft_tokens: int = 4
  draft_cfg: ModelConfig | None = None
  draft_params: Params | None = None
  memory: object | None = None  # engine.runtime.speculative.learned.NgramMemory
  adaptive: bool = False
  measure_costs: bool = True

  def validate(self, cfg: ModelConfig) -> None:
    if self.method not in METHODS:
      raise ValueError(f"unknown speculative method {self.method!r}; expected one of {METHODS}")
    if self.num_draft_tokens < 1:
      raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
    if self.method == "mtp" and cfg.num_nextn_predict_layers < 1:
      raise ValueError(f"speculative method 'mtp' needs an MTP layer: {cfg.no_mtp_reason}")
    if self.method == "draft" and (self.draft_cfg is None or self.draft_params is None):
      raise ValueError("speculative method 'draft' needs draft_cfg and draft_params")
    if self.draft_cfg is not None and self.draft_cfg.vocab_size != cfg.vocab_size:
      raise ValueError(f"the draft model's vocabulary ({self.draft_cfg.vocab_size}) differs "
                       f"from the target's ({cfg.vocab_size})")

  def drafters(self, cfg: ModelConfig) -> tuple[str, ...]:
    """The engine's drafters: the method's, or for "auto" every one the model supports."""
    if self.method != AUTO:
      return (self.method,)
    out = ["ngram", "learned"]
    if cfg.num_nextn_predict_layers > 0:
      out.append("mtp")
    if self.draft_cfg is not None and self.draft_params is not None:
      out.append("draft")
    return tuple(out)


@dataclasses.dataclass
class Completion:
  """One prompt's result."""
  token_ids: list[int]
  finish_reason: str  # "stop" or "length"
  prompt_tokens: int
  spec: dict | None = None  # speculative counters of this row (`spec_summary`)


# The engines `run_on_engine` keeps, by configuration and what they hold; most recent last.
KEPT_ENGINES = 2
_ENGINES: "collections.OrderedDict[tuple, Engine]" = collections.OrderedDict()


def release_engines() -> None:
  """Drops the kept engines, and with them their caches' memory."""
  _ENGINES.clear()


def reset_prefix_caches() -> None:
  """Every kept engine forgets its cached prefixes (e.g. to time prompts as never seen)."""
  for eng in _ENGINES.values():
    eng.pool.reset_prefix_cache()


def run_on_engine(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: Sequence[int], sampling: Sequence[SamplingParams],
                  eos_ids: Sequence[int] = (), stop_token_ids: Sequence[Sequence[int]] = (),
                  ignore_eos: bool = False, min_new_tokens: int = 0,
                  speculative: SpeculativeConfig | None = None, cache_dtype: Any = None,
                  impl: KernelChoice = REFERENCE, tokenizer: Any = None, mesh: Any = None,
                  warmup: bool = False) -> list[Completion]:
  """Token-id prompts to completion on the kept engine for this configuration (module doc).
  `speculative` None: plain decoding on the same path. `warmup`: `Engine.warmup` first (every
  bucket compiled) when the engine is new."""
  b = len(prompts)
  if speculative is not None:
    speculative.validate(cfg)
  drafters = speculative.drafters(cfg) if speculative is not None else ()
  k = speculative.num_draft_tokens if speculative is not None else 4
  memory = speculative.memory if speculative is not None else None
  slots = (int(memory.table.tags.shape[0]) if memory is not None
           else EngineConfig.learned_table_slots)
  total = max(len(p) + m for p, m in zip(prompts, max_new_tokens))
  # Bucketed limits: calls of similar sizes reuse the compiled programs and the kept engine.
  # The length to a quarter octave: the reference attention reads every position of it, and
  # at a power of two a 142-token call decoded at 0.92x of the fixed-batch loop (BENCHMARKS.md,
  # "the closed batch's length").
  page_size = EngineConfig.page_size
  max_len = min(quarter_bucket(total + k + 1, page_size), cfg.max_position_embeddings)
  config = EngineConfig(
      max_num_seqs=b, decode_batch_sizes=(b,), max_model_len=max_len,
      num_pages=2 * b * -(-max_len // page_size) + 1,
      max_decode_steps=max(bucket(max(max_new_tokens)), k + 1),
      speculative=drafters[0] if len(drafters) == 1 else (AUTO if drafters else None),
      drafters=drafters, num_draft_tokens=k,
      adaptive_k=bool(drafters) and (speculative.adaptive or speculative.method == AUTO),
      learned_table_slots=slots, cache_dtype=cache_dtype, kernels=impl)
  draft = ((speculative.draft_cfg, speculative.draft_params) if "draft" in drafters else None)
  measure = bool(drafters) and speculative.measure_costs
  # (ids of what the engine holds, so they cannot be reused while it is kept)
  key = (cfg, config, draft[0] if draft else None, measure, id(params), id(tokenizer),
         tuple(eos_ids), id(mesh), id(draft[1]) if draft else None)
  eng = _ENGINES.pop(key, None)
  if eng is None:
    eng = Engine(cfg, params, config, tokenizer, eos_ids, mesh=mesh, draft=draft)
    if warmup:
      eng.warmup(progress=False)  # (it times the cost table too)
    elif measure:
      with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        eng.cache = eng.spec.measure_costs(params, eng.cache, eng.max_pages_per_seq,
                                           stop_width=MAX_STOP_IDS, impl=impl)
  if memory is not None:
    eng.spec.table = _committed_like(memory.table, params)
  stops = [StopParams(max_tokens=m, min_tokens=min(min_new_tokens, m),
                      stop_token_ids=tuple(stop_token_ids[i]) if i < len(stop_token_ids)
                      else (), ignore_eos=ignore_eos)
           for i, m in enumerate(max_new_tokens)]
  drafter = (speculative.method if speculative.method != AUTO else AUTO) if drafters else "off"
  samp = [dataclasses.replace(s, drafter=drafter) for s in sampling]
  before = _k_steps(eng.stats()) if drafters else {}
  done = eng.generate([list(p) for p in prompts], samp, stops, closed=True)  # (raises:
  # the engine is dropped)
  _ENGINES[key] = eng  # kept, most recently used last
  while len(_ENGINES) > KEPT_ENGINES:
    _ENGINES.popitem(last=False)
  if memory is not None:
    memory.table = eng.spec.table
  k_steps = {n: c - before.get(n, 0) for n, c in _k_steps(eng.stats()).items()}
  return [Completion(token_ids=list(r.output_ids), finish_reason=r.finish_reason or "length",
                     prompt_tokens=len(r.prompt_ids),
                     spec=spec_summary(r, k_steps, speculative.method, drafters, k) if drafters
                     else None)
          for r in done]


def spec_summary(req: Any, k_steps: dict[int, int], method: str, drafters: tuple[str, ...],
                 k: int) -> dict[str, Any]:
  """A request's speculative counters. The engine counts drafts, drafted and accepted tokens
  per request but not target forwards; every forward after the first token emits one token
  plus the drafts it accepted, so steps = (tokens - 1) - accepted. `auto_choices`: its verify
  steps per drafter; `k_steps` (this call's loop iterations per block width) is the whole
  batch's: rows share a loop."""
  s = req.spec
  drafts, drafted, accepted = (s.drafts, s.drafted, s.accepted) if s is not None else (0, 0, 0)
  emitted = max(len(req.output_ids) - 1, 0)
  steps = max(emitted - accepted, 0)
  return {"steps": steps, "drafts": drafts, "drafted": drafted, "accepted": accepted,
          "acceptance_rate": accepted / drafted if drafted else 0.0,
          "accepted_at": [int(x) for x in s.accepted_at] if s is not None else [0] * k,
          "mean_accepted_length": emitted / steps if steps else 0.0,
          "method": method, "drafters": list(drafters),
          "auto_choices": dict(s.drafter_steps) if s is not None else {},
          "k_steps": k_steps, "num_draft_tokens": k}


def _k_steps(stats: dict[str, Any]) -> dict[int, int]:
  """The engine's loop iterations per block width, from its `stats()`."""
  return {int(n[len("spec_k"):-len("_loops")]): v for n, v in stats.items()
          if n.startswith("spec_k") and n.endswith("_loops")}


def _committed_like(tree: Any, params: Params) -> Any:
  """`tree` committed to the parameters' device when they live on one (as the engine commits
  its own state): an uncommitted table would compile the engine's loop a second time."""
  devices = jax.tree.leaves(params)[0].sharding.device_set
  return jax.device_put(tree, next(iter(devices))) if len(devices) == 1 else tree

