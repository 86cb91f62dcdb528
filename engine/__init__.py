"""moejax: a JAX/XLA inference engine for mixture-of-experts models.

Notebook entry points: `engine.load(path)` and `engine.generate(model, prompts, ...)`
(see `engine.api`: the prompts run as requests of an engine the model owns, `model.llm`); for
a stream of requests, `engine.Engine.from_model(model, EngineConfig())`
(continuous batching, prefix cache, see `engine.runtime.engine`). The command line is `python -m engine.generate` (`engine/generate.py`), a
thin script that is never imported as `engine.generate`: that name is the function.

The names below are imported when first used: `python -m engine.client` / `engine.bench` (gRPC
and HTTP clients) then start without importing JAX.
"""

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "GenerationResult": "engine.api", "LoadedModel": "engine.api", "generate": "engine.api",
    "load": "engine.api", "Engine": "engine.runtime.engine", "LLM": "engine.runtime.llm",
    "EngineConfig": "engine.runtime.engine", "SpeculativeConfig": "engine.runtime.llm",
    "NgramMemory": "engine.runtime.speculative.drafters",
    "RequestOutput": "engine.runtime.request", "StopParams": "engine.runtime.request",
    "SamplingParams": "engine.runtime.sampling",
}

__all__ = ["Engine", "EngineConfig", "GenerationResult", "LLM", "LoadedModel", "NgramMemory",
           "RequestOutput", "SamplingParams", "SpeculativeConfig", "StopParams", "generate",
           "load"]

if TYPE_CHECKING:
  from engine.api import GenerationResult, LoadedModel, generate, load
  from engine.runtime.engine import Engine, EngineConfig
  from engine.runtime.llm import LLM, SpeculativeConfig
  from engine.runtime.request import RequestOutput, StopParams
  from engine.runtime.sampling import SamplingParams
  from engine.runtime.speculative.drafters import NgramMemory


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif not name.startswith("__"):
    try:  # a subpackage or module (`engine.api`, `engine.runtime`, ...)
      value = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{__name__}.{name}":
        raise
      raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
