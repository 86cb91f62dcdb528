"""The serving engine's speculative decoding counters and gauges (`SpecRuntime.stats`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.runtime.speculative import goodput
from engine.runtime.speculative.serving import drafter_id


def spec_stats(spec: Any) -> dict[str, Any]:
  """Counters per k, drafter and draft position, the adaptive model's estimates, its
  calibration and costs, of `spec` (a `SpecRuntime`)."""
  s = {f"spec_k{k}_loops": int(n) for k, n in zip(spec.choices, spec.k_steps)}
  s.update(spec.per_drafter)
  for j, (drafted, accepted) in enumerate(spec.per_position.T):  # slot j (0-based)
    s[f"spec_pos{j}_drafted"], s[f"spec_pos{j}_accepted"] = int(drafted), int(accepted)
  # The adaptive model's current engine-wide estimate of P(draft j accepted | drafts < j
  # were), per drafter and slot (the decayed counts of the last loop call; computed once per
  # loop call, not at every engine step's snapshot).
  if spec._estimates[0] is not spec.accept_seen:
    spec._estimates = (spec.accept_seen, goodput.conditional_acceptance(
        spec.accept_seen, goodput.PRIOR_ACCEPT, goodput.PRIOR_WEIGHT, xp=np))
  c = spec._estimates[1]
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
  for d in spec.enabled:  # tokens per target forward of rows drafting with d
    steps_ = spec.per_drafter[f"spec_steps_{d}"]
    if steps_:
      s[f"spec_mean_accepted_length_{d}"] = 1 + spec.per_drafter[f"spec_accepted_{d}"] / steps_
  for name, value in spec.cost_fit.items():
    if isinstance(value, (int, float)):
      s[f"spec_cost_{name}"] = value
  return s
