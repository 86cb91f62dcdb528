"""moejax: a JAX/XLA inference engine for mixture-of-experts models.

Notebook entry points: `engine.load(path)` and `engine.generate(model, prompts, ...)`
(see `engine.api`); for a stream of requests, `engine.Engine.from_model(model, EngineConfig())`
(continuous batching, prefix cache, see `engine.runtime.engine`). The command line is `python -m engine.generate` (`engine/generate.py`), a
thin script that is never imported as `engine.generate`: that name is the function.
"""

from engine.api import GenerationResult, LoadedModel, generate, load
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.batch import SpeculativeConfig
from engine.runtime.request import RequestOutput, StopParams
from engine.runtime.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "LoadedModel", "RequestOutput",
           "SamplingParams", "SpeculativeConfig", "StopParams", "generate", "load"]
