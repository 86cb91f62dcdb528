"""The cost model's correction by what live speculative calls take (host side).

The warm-up fits the goodput model's step time T(B, k) on probes (`serving_costs`). Real calls
cost more or less than it predicts: their fixed costs, the draft model's catch-up, host work,
iterations dearer on real rows than on the probes'. After each speculative call `SpecRuntime.
decode` folds its predicted (by the uncorrected model) and measured time, both in plain-loop
iterations, into decayed evidence; once COST_MIN_EVIDENCE predicted iterations stand behind it,
the ratio measured / predicted (clipped to COST_SCALE_RANGE) scales every speculative T(k)
(`costs`); plain decoding's unit stays 1.

Two kinds of call are corrected apart: those that keep a model drafter current (the draft
model is caught up and fed, the MTP layer observes every verified block) and the rest. The
former measured ~3x their prediction on the CPU demo; one shared correction then priced the
deterministic drafters' calls out for good, and none ran again to bring it back.
"""

from __future__ import annotations

import numpy as np

# Decay of the evidence per speculative call, the predicted plain-loop iterations it needs
# before it applies, and the correction's range.
COST_DECAY, COST_MIN_EVIDENCE, COST_SCALE_RANGE = 0.9, 32.0, (0.5, 2.0)


class LiveCorrection:
  """measured / predicted time of speculative calls, per kind of call (index: whether the call
  kept a model drafter current)."""

  def __init__(self):
    self.evidence = np.zeros((2, 2), np.float64)  # [kind, (predicted, measured)], decayed
    self.scale = np.ones((2,), np.float64)

  def of(self, models: bool) -> float:
    """The correction applied to a call that keeps a model drafter current (`models`) or not."""
    return float(self.scale[int(models)])

  def learn(self, predicted: float, measured: float, models: bool) -> None:
    """Folds one call's predicted and measured time (plain-loop iterations) into its kind's
    evidence, and its correction once the evidence suffices."""
    ev = self.evidence[int(models)]
    ev *= COST_DECAY
    ev += predicted, measured
    if ev[0] >= COST_MIN_EVIDENCE:
      self.scale[int(models)] = np.clip(ev[1] / ev[0], *COST_SCALE_RANGE)

  def costs(self, costs: np.ndarray, models: bool) -> np.ndarray:
    """The cost model's slots (`SpecRuntime.costs`: per-drafter costs, then overhead, base,
    pad_row, per_token) corrected: with r the correction, every speculative iteration's
    T(k) = 1 + overhead + ... becomes r T(k) (overhead r (1 + overhead) - 1, the per-column,
    per-drafter and per-token costs times r)."""
    r = self.of(models)
    out = costs.astype(np.float32) * np.float32(r)
    out[-4] = r * (1.0 + float(costs[-4])) - 1.0
    return out

  def copy(self) -> "LiveCorrection":
    out = LiveCorrection()
    out.evidence, out.scale = self.evidence.copy(), self.scale.copy()
    return out
