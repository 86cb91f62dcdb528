"""The drafters, one module each behind `base.Drafter`, and their registry.

`_REGISTERED` lists them in id order: a row's drafter travels as an int32 id into `ids()` (0:
"off"), so every per-drafter array of the loop has len(ids()) entries. A new drafter is one
module and one line here; everything else (the loop, the engine's policy, warm-up, the command
lines' choices, the gRPC names) reads what the registry and each drafter's class attributes
say. `registered(cls)` adds one for a while (tests).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from engine.model.config import ModelConfig
from engine.runtime.speculative.drafters.base import (AUTO, OFF, Drafter, LoopContext, Proposal,
                                                      aux_layers_of)
from engine.runtime.speculative.drafters.draft_model import DraftModelDrafter
from engine.runtime.speculative.drafters.eagle3 import Eagle3Drafter
from engine.runtime.speculative.drafters.learned import LearnedDrafter, NgramMemory
from engine.runtime.speculative.drafters.mtp import MtpDrafter
from engine.runtime.speculative.drafters.ngram import NgramDrafter

_REGISTERED: list[type[Drafter]] = [
    NgramDrafter,
    LearnedDrafter,
    MtpDrafter,
    DraftModelDrafter,
    Eagle3Drafter,
]

__all__ = ["AUTO", "Drafter", "aux_layers_of", "LoopContext", "NgramMemory", "OFF", "Proposal",
           "build", "drafter_class", "drafter_id", "ids", "names", "registered", "registry",
           "supported"]


def registry() -> tuple[type[Drafter], ...]:
  """The registered drafters, in id order."""
  return tuple(_REGISTERED)


def names() -> tuple[str, ...]:
  return tuple(d.name for d in _REGISTERED)


def ids() -> tuple[str, ...]:
  """A row's drafter id indexes this (0: no drafter); per-drafter arrays have this length."""
  return (OFF,) + names()


def drafter_id(name: str | None) -> int:
  """A drafter's id in the loop's arrays (None / "off": 0)."""
  return ids().index(name or OFF)


def drafter_class(name: str) -> type[Drafter]:
  for d in _REGISTERED:
    if d.name == name:
      return d
  raise ValueError(f"unknown drafter {name!r}; one of {names()}")


@contextlib.contextmanager
def registered(cls: type[Drafter]) -> Iterator[type[Drafter]]:
  """`cls` registered (last, a new id) while the block runs: a drafter from outside this
  package (a test's, a plug-in tried out) without its registry line."""
  if cls.name in ids() or cls.name == AUTO:
    raise ValueError(f"a drafter named {cls.name!r} is registered already")
  _REGISTERED.append(cls)
  try:
    yield cls
  finally:
    _REGISTERED.remove(cls)


def supported(cfg: ModelConfig, draft_cfg: ModelConfig | None, head_cfg: Any = None
              ) -> tuple[str, ...]:
  """Every drafter this model (and draft model, EAGLE-3 head) can use: what "auto" chooses
  among."""
  return tuple(d.name for d in _REGISTERED
               if d.unsupported(cfg, draft_cfg, head_cfg=head_cfg) is None)


def build(wanted: Any, cfg: ModelConfig, config: Any, draft_cfg: ModelConfig | None = None,
          head_cfg: Any = None) -> tuple[Drafter, ...]:
  """The drafters named in `wanted` (in registry order) for this model and `config` (an
  EngineConfig); ValueError naming what is missing (an MTP layer, a draft model, an EAGLE-3
  head) or unknown."""
  for n in wanted:
    drafter_class(n)  # (unknown: ValueError)
  out = []
  for d in _REGISTERED:
    if d.name not in wanted:
      continue
    why = d.unsupported(cfg, draft_cfg, head_cfg=head_cfg)
    if why is not None:
      raise ValueError(f"EngineConfig: {why}")
    out.append(d.create(cfg, config, draft_cfg, head_cfg=head_cfg))
  return tuple(out)
