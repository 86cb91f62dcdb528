"""`LLM`: a loaded model's batch generation, as requests added to engines the model owns.

    llm = LLM(model)                     # `engine.load`'s result holds one: `model.llm`
    done = llm.generate([[1, 5, 6], [1, 9]], max_new_tokens=[8, 16],
                        sampling=[SamplingParams()] * 2)       # -> [Completion]

nano-vllm's shape: the caller holds an object over an engine (`engine.Engine`: scheduler,
pages, outputs, its model runner). `engine.generate(model, ...)` is `model.llm.generate`: its
prompts become requests added together to one of the model's engines, run until done (a closed
batch: nothing else joins, so decode-only calls take `max_decode_steps` at once).

An engine is sized for the batch: max_num_seqs = batch, decode programs at that size only,
the length its need to a quarter octave (the reference attention reads every position below
512), pages for the batch twice over and max_decode_steps the bucketed token budget. Its mixed
step's rows are W wide, the longest prompt to a power of two (the whole batch prefills in one
[B, W] step, B the batch to a power of two; a later call whose prompts hit the prefix cache
packs the same shape), and for rows wider than TAIL_ROWS_FROM (the roofline's ridge point) also
a page wide (such a call leaves at most a page per prompt to compute, and past the ridge a long
row of a few real tokens costs nearly a whole prefill). When an engine is made, its page-wide
step is compiled and, if its draft length is adaptive, its cost table timed
(`warmup.measure_costs`; a fixed draft length drafts whatever the table says and a closed batch
has no waiting request to fit a call's time to, so timing would compile a plain decode loop
such an engine never runs), so the first call pays every compile and a second call of the
batch's shape none. The KEPT_ENGINES most recently used live on (their prefix cache, learned
table and acceptance estimates too); `release` drops them, and a call that raised drops its
engine.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Sequence

from engine.model.config import ModelConfig
from engine.model.eagle3_config import load_eagle3_config
from engine.model.eagle3_loader import load_eagle3
from engine.model.params import Params
from engine.runtime import warmup as warmup_lib
from engine.runtime.buckets import bucket, powers_of_two_upto, quarter_bucket
from engine.runtime.engine import Engine
from engine.runtime.engine_config import EngineConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import drafters as drafter_registry
from engine.runtime.speculative.costs import RIDGE_TOKENS
from engine.runtime.speculative.drafters import AUTO, OFF

KEPT_ENGINES = 2  # as vLLM's `LLM` keeps its engine; two: a batch and its plain baseline
# Rows wider than this get a second, page-wide mixed step for a later call's prefix-cache tails:
# a [1, W] row reads the weights once whatever W up to the roofline's ridge point, so only past
# it does a row of a page of real tokens (the rest padding) cost more than a page-wide row
# (prompts of 256 tokens or more, W being a power of two). The CPU demo turns earlier (a
# 16-token tail: ~10 ms page wide, 10-40 ms at W = 128, ~90 at 256, 190-630 at 512).
TAIL_ROWS_FROM = RIDGE_TOKENS


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How a batch speculates (see `engine.runtime.speculative`).

  method: a drafter's name: "ngram" (prompt lookup), "learned" (an n-gram table learned across
  requests: `memory`, an `NgramMemory` updated in place; else the kept engine's own table),
  "mtp" (the checkpoint's MTP layer), "draft" (a small model with the same tokenizer:
  `draft_cfg`, `draft_params`), "eagle3" (an EAGLE-3 head: `checkpoint`, its directory as
  published, loaded once per model and path); or "auto" (every drafter the model supports,
  the EAGLE-3 head when `checkpoint` is given, chosen per row as it goes, adaptive).
  num_draft_tokens: K >= 1. adaptive: choose every iteration whether to draft (up to K per row)
  or decode plainly, from the acceptance estimates and the cost table (always on for "auto").
  measure_costs: time an adaptive engine's cost table on this machine when it is made (else
  the roofline, `speculative.costs`; a fixed draft length drafts whatever the table says)."""
  method: str
  num_draft_tokens: int = 4
  draft_cfg: ModelConfig | None = None
  draft_params: Params | None = None
  memory: object | None = None  # engine.NgramMemory
  adaptive: bool = False
  measure_costs: bool = True
  checkpoint: str | None = None  # an EAGLE-3 head's directory (drafter "eagle3")

  def validate(self, cfg: ModelConfig) -> None:
    methods = drafter_registry.names() + (AUTO,)
    if self.method not in methods:
      raise ValueError(f"unknown speculative method {self.method!r}; expected one of {methods}")
    if self.num_draft_tokens < 1:
      raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
    if self.draft_cfg is not None and self.draft_cfg.vocab_size != cfg.vocab_size:
      raise ValueError(f"the draft model's vocabulary ({self.draft_cfg.vocab_size}) differs "
                       f"from the target's ({cfg.vocab_size})")
    if self.method != AUTO:
      cls = drafter_registry.drafter_class(self.method)
      if cls.uses_draft_model and (self.draft_cfg is None or self.draft_params is None):
        raise ValueError(f"speculative method {self.method!r} needs draft_cfg and "
                         "draft_params")
      if cls.uses_head and self.checkpoint is None:
        raise ValueError(f"speculative method {self.method!r} needs checkpoint (an EAGLE-3 "
                         "head's directory)")
      why = cls.unsupported(cfg, self.draft_cfg, head_cfg=self.head_config(cfg))
      if why is not None:
        raise ValueError(f"speculative method {self.method!r}: {why}")

  def head_config(self, cfg: ModelConfig) -> Any:
    """The EAGLE-3 head's config checked against the target (`Eagle3Error` naming the field),
    or None without `checkpoint`."""
    if self.checkpoint is None:
      return None
    return load_eagle3_config(self.checkpoint, cfg)

  def drafters(self, cfg: ModelConfig) -> tuple[str, ...]:
    """The engine's drafters: the method's, or for "auto" every one the model supports."""
    if self.method != AUTO:
      return (self.method,)
    draft = self.draft_cfg if self.draft_params is not None else None
    return drafter_registry.supported(cfg, draft, head_cfg=self.head_config(cfg))


@dataclasses.dataclass
class Completion:
  """One prompt's result."""
  token_ids: list[int]
  finish_reason: str  # "stop" or "length"
  prompt_tokens: int
  spec: dict | None = None  # speculative counters of this row (`spec_summary`)


class LLM:
  """A loaded model's generate path (see the module docstring). `model`: anything with
  `config`, `params`, `tokenizer`, `eos_token_ids`, `kernels` and `mesh` (`engine.load`'s
  `LoadedModel`), read at each call."""

  def __init__(self, model: Any):
    self.model = model
    # key -> (engine, what it was made from: it serves only the same objects)
    self._engines: "collections.OrderedDict[tuple, tuple[Engine, tuple]]" = (
        collections.OrderedDict())
    self._heads: dict[str, tuple[Any, Params, Any]] = {}  # path -> (cfg, params, made from)

  def head(self, checkpoint: str) -> tuple[Any, Params]:
    """The EAGLE-3 head at `checkpoint` for this model (loaded once per path and weights)."""
    m = self.model
    path = os.path.abspath(checkpoint)
    kept = self._heads.get(path)
    if kept is None or kept[2] is not m.params:
      cfg, params = load_eagle3(path, m.config, m.params, dtype=m.params["embed"].dtype)
      kept = self._heads[path] = (cfg, params, m.params)
    return kept[0], kept[1]

  @property
  def engines(self) -> list[Engine]:
    """The kept engines, least recently used first."""
    return [eng for eng, _ in self._engines.values()]

  def release(self) -> None:
    """Drops the kept engines, and with them their caches' memory."""
    self._engines.clear()

  def reset_prefix_caches(self) -> None:
    """Every kept engine forgets its cached prefixes (e.g. to time prompts as never seen)."""
    for eng in self.engines:
      eng.pool.reset_prefix_cache()

  def engine_config(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                    speculative: SpeculativeConfig | None) -> EngineConfig:
    """The engine a batch runs on (see the module docstring); bucketed, so calls of similar
    sizes share it and its compiled programs."""
    cfg = self.model.config
    b = len(prompts)
    drafters = speculative.drafters(cfg) if speculative is not None else ()
    k = speculative.num_draft_tokens if speculative is not None else 4
    memory = speculative.memory if speculative is not None else None
    total = max(len(p) + m for p, m in zip(prompts, max_new_tokens))
    # The length to a quarter octave: the reference attention reads every position of it,
    # and at a power of two a 142-token call decoded at 0.92x of a fixed-batch loop
    # (BENCHMARKS.md, "the closed batch's length").
    page_size = EngineConfig.page_size
    need = total + (k + 1 if drafters else 0)  # (a block's drafts lie past the last token)
    max_len = min(quarter_bucket(need, page_size), cfg.max_position_embeddings)
    width = bucket(max(len(p) for p in prompts))
    rows = powers_of_two_upto(b)[-1]
    adaptive = bool(drafters) and (speculative.adaptive or speculative.method == AUTO)
    return EngineConfig(
        max_num_seqs=b, decode_batch_sizes=(b,), max_model_len=max_len,
        num_pages=2 * b * -(-max_len // page_size) + 1,
        row_widths=(page_size, width) if width > TAIL_ROWS_FROM else (width,),
        max_num_batched_tokens=rows * width,
        max_decode_steps=max(bucket(max(max_new_tokens)), k + 1),
        speculative=drafters[0] if len(drafters) == 1 else (AUTO if drafters else None),
        drafters=drafters, num_draft_tokens=k,
        adaptive_k=adaptive, measure_spec_costs=adaptive and speculative.measure_costs,
        learned_table_slots=(memory.num_slots if memory is not None
                             else EngineConfig.learned_table_slots),
        kernels=self.model.kernels)

  def _engine(self, config: EngineConfig, speculative: SpeculativeConfig | None,
              warmup: bool) -> tuple[tuple, Engine, tuple]:
    """(its key, the kept engine for `config` or a new one (warmed up, or its cost table
    timed), what it was made from)."""
    m = self.model
    draft = head = None
    if speculative is not None and any(drafter_registry.drafter_class(d).uses_draft_model
                                       for d in config.drafters):
      draft = (speculative.draft_cfg, speculative.draft_params)
    if speculative is not None and any(drafter_registry.drafter_class(d).uses_head
                                       for d in config.drafters):
      head = self.head(speculative.checkpoint)
    key = (config, draft[0] if draft else None, head[0] if head else None)
    kept = self._engines.pop(key, None)
    made_from = (m.params, m.tokenizer, m.mesh, draft[1] if draft else None,
                 head[1] if head else None)
    if kept is not None and all(a is b for a, b in zip(kept[1], made_from)) and (
        kept[0].eos_token_ids == tuple(m.eos_token_ids)):
      return key, kept[0], made_from
    eng = Engine(m.config, m.params, config, m.tokenizer, m.eos_token_ids, mesh=m.mesh,
                 draft=draft, head=head)
    if warmup:
      eng.warmup(progress=False)  # (it times an adaptive engine's cost table too)
      return key, eng, made_from
    with eng._lock:
      if config.measure_spec_costs:  # (adaptive engines only: `engine_config`)
        warmup_lib.measure_costs(eng)
      if len(config.row_widths) > 1:
        # A later call whose prompts hit the prefix cache prefills at most a page per prompt:
        # long prompts' engines give it page-wide rows, compiled now, so that call compiles
        # nothing.
        warmup_lib.run_shapes(eng, [("step", *eng.buckets.pack([1] * config.max_num_seqs))])
    return key, eng, made_from

  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
               sampling: Sequence[SamplingParams], stop_token_ids: Sequence[Sequence[int]] = (),
               ignore_eos: bool = False, min_new_tokens: int = 0,
               speculative: SpeculativeConfig | None = None, warmup: bool = False
               ) -> list[Completion]:
    """Token-id prompts to completion on the model's engine for this batch (module doc).
    `speculative` None: plain decoding. `warmup`: `Engine.warmup` first (every bucket
    compiled) when the engine is new."""
    cfg = self.model.config
    if speculative is not None:
      speculative.validate(cfg)
    config = self.engine_config(prompts, max_new_tokens, speculative)
    key, eng, made_from = self._engine(config, speculative, warmup)
    drafters = config.drafters
    memory = speculative.memory if speculative is not None else None
    if memory is not None and eng.runner.state.get(memory.drafter) is not memory.table:
      eng.runner.state[memory.drafter] = eng.runner.place_state(memory.table)
    # (a row whose min_new_tokens exceeds its max_new_tokens never honours a stop id)
    stops = [StopParams(max_tokens=m, min_tokens=min(min_new_tokens, m),
                        stop_token_ids=tuple(stop_token_ids[i])
                        if i < len(stop_token_ids) and min_new_tokens <= m else (),
                        ignore_eos=ignore_eos or min_new_tokens > m)
             for i, m in enumerate(max_new_tokens)]
    drafter = speculative.method if drafters else OFF
    samp = [dataclasses.replace(s, drafter=drafter) for s in sampling]
    before = _k_steps(eng.stats()) if drafters else {}
    done = eng.generate([list(p) for p in prompts], samp, stops, closed=True)  # (raises:
    # the engine is dropped)
    self._engines[key] = (eng, made_from)  # kept, most recently used last
    while len(self._engines) > KEPT_ENGINES:
      self._engines.popitem(last=False)
    if memory is not None:
      memory.table = eng.runner.state[memory.drafter]
    k_steps = {n: c - before.get(n, 0) for n, c in _k_steps(eng.stats()).items()}
    k = config.num_draft_tokens
    return [Completion(token_ids=list(r.output_ids), finish_reason=r.finish_reason or "length",
                       prompt_tokens=len(r.prompt_ids),
                       spec=spec_summary(r, k_steps, speculative.method, drafters, k)
                       if drafters else None)
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
