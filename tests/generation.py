"""Batch generation for tests: a model's parameters as a `LoadedModel`, and its batch path
(`model.llm.generate`, what `engine.generate` runs) with per-row stop ids and sampling."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from engine.api import LoadedModel
from engine.runtime.sampling import SamplingParams


def loaded(cfg: Any, params: Any, eos_ids: Sequence[int] = (), tokenizer: Any = None
           ) -> LoadedModel:
  return LoadedModel(config=cfg, params=params, tokenizer=tokenizer,
                     eos_token_ids=tuple(eos_ids))


def generate_ids(model: LoadedModel, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | Sequence[int] = 32,
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 eos_ids: Sequence[int] | None = None,
                 stop_token_ids: Sequence[Sequence[int]] = (), ignore_eos: bool = False,
                 min_new_tokens: int = 0, speculative: Any = None) -> list[Any]:
  """`Completion`s of token-id prompts; `eos_ids` replaces the model's (another model object,
  so other kept engines)."""
  if eos_ids is not None:
    model = dataclasses.replace(model, eos_token_ids=tuple(eos_ids))
  b = len(prompts)
  max_new = [max_new_tokens] * b if isinstance(max_new_tokens, int) else list(max_new_tokens)
  samp = [sampling] * b if isinstance(sampling, SamplingParams) else list(sampling)
  for s in samp:
    s.validate()
  return model.llm.generate([list(p) for p in prompts], max_new_tokens=max_new, sampling=samp,
                            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                            min_new_tokens=min_new_tokens, speculative=speculative)
