"""The serving engine's speculative decoding counters and gauges (`SpecRuntime.stats`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from engine.runtime.speculative import goodput
from engine.runtime.speculative.serving import drafter_id


@dataclasses.dataclass(frozen=True)
class SpecSnapshot:
  """What `spec_stats` reads of a `SpecRuntime`, copied (cheap: small arrays and dicts) so
  that the engine can take one every step and build the stats only when they are read (the
  dict and the estimates cost ~0.2 ms, ~1% of a CPU demo call)."""
  choices: tuple[int, ...]
  enabled: tuple[str, ...]
  k_steps: np.ndarray
  per_drafter: dict[str, int]
  per_position: np.ndarray
  accept_seen: np.ndarray
  calibration: np.ndarray
  cost_seen: np.ndarray
  cost_scale: float
  model_cost_scale: float
  cost_fit: dict[str, Any]

  @staticmethod
  def of(spec: Any) -> "SpecSnapshot":
    return SpecSnapshot(spec.choices, spec.enabled, spec.k_steps.copy(), dict(spec.per_drafter),
                        spec.per_position.copy(), np.array(spec.accept_seen),
                        spec.calibration.copy(), spec.cost_seen.copy(), spec.cost_scale,
                        spec.model_cost_scale, dict(spec.cost_fit))


def spec_stats(spec: SpecSnapshot) -> dict[str, Any]:
  """Counters per k, drafter and draft position, the adaptive model's estimates, its
  calibration and costs, as of `spec`."""
  s = {f"spec_k{k}_loops": int(n) for k, n in zip(spec.choices, spec.k_steps)}
  s.update(spec.per_drafter)
  for j, (drafted, accepted) in enumerate(spec.per_position.T):  # slot j (0-based)
    s[f"spec_pos{j}_drafted"], s[f"spec_pos{j}_accepted"] = int(drafted), int(accepted)
  # The adaptive model's current engine-wide estimate of P(draft j accepted | drafts < j
  # were), per drafter and slot (the decayed counts of the last loop call).
  c = goodput.conditional_acceptance(spec.accept_seen, goodput.PRIOR_ACCEPT,
                                     goodput.PRIOR_WEIGHT, xp=np)
  for d in spec.enabled:
    for j, x in enumerate(c[drafter_id(d)]):
      s[f"spec_pos{j}_estimate_{d}"] = round(float(x), 4)
  # Calibration of the goodput model over iterations that drafted: the tokens it expected
  # (rows' gains at their draft counts) and the tokens emitted; a ratio above 1 means the
  # acceptance estimates run ahead of what is accepted (so it drafts where it loses).
  s["spec_model_expected_tokens"], s["spec_model_emitted_tokens"] = (
      float(x) for x in spec.calibration)
  # And of its costs: speculative calls' time as predicted and as measured, in plain-loop
  # iterations (above 1 measured/predicted: T(k) underrates real iterations, or the calls'
  # fixed costs, catch-up and host work, which it leaves out, matter).
  s["spec_model_predicted_cost"], s["spec_model_measured_cost"] = (
      float(x) for x in spec.cost_seen)
  s["spec_cost_scale"] = spec.cost_scale  # the live correction applied (`live_costs`)
  s["spec_cost_scale_model_drafters"] = spec.model_cost_scale  # (calls feeding one)
  for d in spec.enabled:  # tokens per target forward of rows drafting with d
    steps_ = spec.per_drafter[f"spec_steps_{d}"]
    if steps_:
      s[f"spec_mean_accepted_length_{d}"] = 1 + spec.per_drafter[f"spec_accepted_{d}"] / steps_
  for name, value in spec.cost_fit.items():
    if isinstance(value, (int, float)):
      s[f"spec_cost_{name}"] = value
  return s
