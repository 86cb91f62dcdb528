"""Thinking controls: whether a request thinks and how many reasoning tokens it may spend.

Every API's fields come down to one `Thinking` (engine/service parses them):
  Moonshot's `thinking`       {"type": "enabled" | "disabled"}    (Chat, Responses, Messages)
  OpenAI `reasoning_effort`   "none" | "minimal" | "low" | "medium" | "high"   (Chat)
  OpenAI `reasoning.effort`   the same values                       (Responses)
  Anthropic's `thinking`      {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}
  vLLM's `thinking_token_budget`  N                                  (Chat, Responses)
  gRPC `ChatRequest.thinking` / `thinking_token_budget`

Effort: "none" and "minimal" turn thinking off; "low", "medium" and "high" turn it on with a
budget of `EFFORT_BUDGETS` reasoning tokens (1,024 / 8,192 / 32,768: K2.5's thoughts on agent
steps run from hundreds to a few thousand tokens; "high" leaves room for long derivations).
An explicit budget wins over an effort's.

Off: the template's own flag where it has one (K2.5 and DeepSeek V3.1 read `thinking`, Qwen3
`enable_thinking`; K2.5's generation prompt then ends `<think></think>`); a template without a
flag whose prompt still opens a think block gets a budget of 0 (the engine closes the thought
at once). A budget: at that many reasoning tokens the decode loop writes the think-end marker
itself and the answer follows (`SamplingParams.thinking_token_budget`).
"""

from __future__ import annotations

import dataclasses

EFFORTS = ("none", "minimal", "low", "medium", "high")
EFFORT_BUDGETS = {"low": 1024, "medium": 8192, "high": 32768}
THINKING_VARIABLES = ("thinking", "enable_thinking")


@dataclasses.dataclass(frozen=True)
class Thinking:
  enabled: bool | None = None    # None: the template's default
  budget: int | None = None      # reasoning tokens at most (None: unbounded)
  field: str = "thinking"        # the request field that set it (errors name it)


def from_effort(effort: str, field: str) -> Thinking:
  """An effort value as thinking on/off and a budget (ValueError naming `field` otherwise)."""
  if effort not in EFFORTS:
    raise ValueError(f"{field}: must be one of {', '.join(EFFORTS)}, got {effort!r}")
  if effort in ("none", "minimal"):
    return Thinking(False, None, field)
  return Thinking(True, EFFORT_BUDGETS[effort], field)


def combine(*given: Thinking | None) -> Thinking:
  """Several fields' settings as one: enabled from the first that says, the budget from the
  first that has one; contradictions (one field on, another off) are a ValueError."""
  enabled, budget, field = None, None, "thinking"
  for t in given:
    if t is None:
      continue
    if t.enabled is not None:
      if enabled is not None and enabled != t.enabled:
        raise ValueError(f"{t.field}: turns thinking {'on' if t.enabled else 'off'}, but "
                         f"{field} turned it {'on' if enabled else 'off'}")
      if enabled is None:
        enabled, field = t.enabled, t.field
    if budget is None and t.budget is not None:
      budget = t.budget
      if enabled is None:
        field = t.field
  return Thinking(enabled, budget, field)


def template_kwargs(variables: frozenset[str], thinking: Thinking, kwargs: dict) -> dict:
  """The template kwargs with the template's thinking flag set (where it reads one and the
  request's own kwargs did not set it); a flag the kwargs set otherwise is a ValueError."""
  if thinking.enabled is None:
    return kwargs
  out = dict(kwargs)
  for name in THINKING_VARIABLES:
    if name not in variables:
      continue
    if name in out and bool(out[name]) != thinking.enabled:
      raise ValueError(f"{thinking.field}: thinking {'on' if thinking.enabled else 'off'} "
                       f"contradicts the template kwarg {name}={out[name]!r}")
    out[name] = thinking.enabled
  return out


def reads_flag(variables: frozenset[str]) -> bool:
  return any(v in variables for v in THINKING_VARIABLES)
