"""Rests between speculative calls: decode plainly for a while where speculation gave up.

Both paths learn across calls that a drafter does not pay (on a machine where verifying a
block costs much more than one decode step, or with a drafter that is rarely right) and then
stop paying for it:
* the serving engine (`runtime.SpecRuntime`) rests its batch after a loop call in which the
  adaptive policy chose k = 0 throughout;
* `generate_tokens` (the fixed-batch loop) rests after a call whose model drafter (mtp, draft)
  gave speculation up (`loop`'s plain phase): the next calls of the same model, drafter and
  shape run `generate.decode`, without the drafter's set-up (the MTP observe over the prompt,
  the draft model's prefill) and without the speculative iterations that precede a give-up.

A rest lasts REST_CALLS calls; the call after it speculates again (a probe): if that gives up
too, the next rest is twice as long (up to MAX_REST_CALLS), and a call that speculates to its
end resets the length. The output is the same either way (plain decoding draws the same
(seed, position) keys).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable

REST_CALLS, MAX_REST_CALLS = 3, 12


@dataclasses.dataclass
class Rest:
  """One rest schedule: calls left in the current rest, the next rest's length."""
  left: int = 0
  length: int = REST_CALLS

  def take(self) -> bool:
    """Whether this call rests (and counts it)."""
    if self.left <= 0:
      return False
    self.left -= 1
    return True

  def after_speculating(self, gave_up: bool) -> None:
    if gave_up:
      self.left, self.length = self.length, min(2 * self.length, MAX_REST_CALLS)
    else:
      self.length = REST_CALLS


# `generate_tokens`' schedules, per (model, drafter, shape) key (see `loop_key`).
_LOOP_RESTS: dict[Hashable, Rest] = {}


def loop_rest(key: Hashable) -> Rest:
  return _LOOP_RESTS.setdefault(key, Rest())


def forget_loop_rests() -> None:
  """Every `generate_tokens` call speculates again (e.g. after the weights changed in place)."""
  _LOOP_RESTS.clear()
