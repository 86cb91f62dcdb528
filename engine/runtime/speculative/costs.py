"""The cost table T[B, k]: a speculative-loop iteration's time at decode bucket B and block
width k (0 and K, or K), in plain decode-loop iterations of the same B; `drafter[B, d]`, what a
model drafter adds per drafted column; `call`, a speculative call's fixed cost beyond a plain
call's. Timed at warm-up (`measure`), else the roofline (`roofline`): an iteration reads the
weights once, so k + 1 tokens per row cost a plain step until they reach the ridge point.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

# Tokens per forward at which a bf16 matmul turns compute-bound on an H200: 790 TFLOP/s over
# 4.3 TB/s is ~184 flops per weight byte, 2 flops per 2-byte weight per token.
RIDGE_TOKENS = 184


@dataclasses.dataclass
class CostTable:
  batch_sizes: tuple[int, ...]  # the engine's decode buckets, ascending
  widths: tuple[int, ...]  # the loop's compiled block widths: (0, K) or (K,)
  step: np.ndarray  # [len(batch_sizes), len(widths)] float32
  drafter: np.ndarray  # [len(batch_sizes), D] float32, per drafted column (0: deterministic)
  call: float = 0.0  # a speculative call's fixed cost beyond a plain call's
  measured: bool = False

  def index(self, b: int) -> int:
    """The row of the smallest bucket holding b rows (the largest past them all)."""
    return min(int(np.searchsorted(self.batch_sizes, b)), len(self.batch_sizes) - 1)

  def costs(self, b: int) -> np.ndarray:
    """The loop's `costs` input for a call of b rows: step costs per width, then drafter costs."""
    i = self.index(b)
    return np.concatenate([self.step[i], self.drafter[i]]).astype(np.float32)

  def pays_at_full_acceptance(self, b: int, drafter_cost: float = 0.0) -> bool:
    """Whether the block beats plain decoding at b rows if every draft is accepted:
    (K + 1) / (T[B, K] + K c) > 1 (c: a model drafter's column cost)."""
    k = self.widths[-1]
    return k + 1 > self.step[self.index(b), -1] + k * drafter_cost

  @property
  def break_even(self) -> int | None:
    """The smallest bucket at which the block cannot beat plain decoding even at full
    acceptance (None: speculation can pay at every bucket)."""
    return next((b for b in self.batch_sizes if not self.pays_at_full_acceptance(b)), None)

  @property
  def min_call_tokens(self) -> int:
    """Calls shorter than this decode plainly: where a speculative call's fixed cost exceeds
    one plain iteration, a call must last long enough for drafting to win it back."""
    return math.ceil(self.call) + 1 if self.call > 1.0 else 1

  def summary(self) -> dict[str, Any]:
    """The table as reported (`stats`): rows by batch size, columns by block width."""
    out: dict[str, Any] = {"measured": self.measured, "call": round(self.call, 3),
                           "break_even": self.break_even}
    for i, b in enumerate(self.batch_sizes):
      out[f"b{b}"] = {k: round(float(t), 3) for k, t in zip(self.widths, self.step[i])}
    return out


def roofline(batch_sizes: Sequence[int], widths: Sequence[int], drafter_cost: Sequence[float]
             ) -> CostTable:
  """The table by the roofline (see the module docstring); `drafter_cost` [D] per drafted
  column, the same at every batch size."""
  bs = np.asarray(batch_sizes, np.float64)[:, None]
  ks = np.asarray(widths, np.float64)[None, :]
  step = np.maximum(1.0, bs * (ks + 1) / RIDGE_TOKENS) / np.maximum(1.0, bs / RIDGE_TOKENS)
  drafter = np.broadcast_to(np.asarray(drafter_cost, np.float32), (len(bs), len(drafter_cost)))
  return CostTable(tuple(batch_sizes), tuple(widths), step.astype(np.float32),
                   np.array(drafter, np.float32))


def time_rounds(programs: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, float]:
  """Median seconds of each program over `rounds` interleaved rounds (each run once first), so
  load from elsewhere on the machine slows all alike."""
  for run in programs.values():
    jax.block_until_ready(run())
  seen: dict[Any, list[float]] = {key: [] for key in programs}
  for _ in range(rounds):
    for key, run in programs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      seen[key].append(time.perf_counter() - start)
  return {key: statistics.median(ts) for key, ts in seen.items()}


def measure(batch_sizes: Sequence[int], widths: Sequence[int], drafters: Sequence[str],
            drafter_ids: Sequence[int], num_drafter_ids: int, iterations: int,
            plain: Callable[[int, int], Any], speculative: Callable[..., Any], rounds: int = 5,
            timed: Callable[..., dict[Any, float]] = time_rounds) -> CostTable:
  """Times the loops and builds the table. plain(b, n): a plain decode-loop call of b rows
  for n iterations; speculative(b, n, w, d): a speculative one forced to width index w, its
  rows drafting with model drafter d (of `drafters`, ids `drafter_ids`; None: none). A call
  takes a + n t: t comes from calls of `iterations` and of 1, the rest goes into `call`."""
  n, top, k = iterations, len(widths) - 1, widths[-1]
  programs: dict[Any, Callable[[], Any]] = {}
  for b in batch_sizes:
    programs[("plain", b, n)] = lambda b=b: plain(b, n)
    programs[("plain", b, 1)] = lambda b=b: plain(b, 1)
    for w in range(len(widths)):
      programs[("spec", b, w, n)] = lambda b=b, w=w: speculative(b, n, w, None)
    programs[("spec", b, 0, 1)] = lambda b=b: speculative(b, 1, 0, None)
    for d in drafters:
      programs[(d, b, n)] = lambda b=b, d=d: speculative(b, n, top, d)
  t = timed(programs, rounds)
  step = np.zeros((len(batch_sizes), len(widths)), np.float32)
  drafter = np.zeros((len(batch_sizes), num_drafter_ids), np.float32)
  calls = []
  for i, b in enumerate(batch_sizes):
    per_plain = max((t[("plain", b, n)] - t[("plain", b, 1)]) / (n - 1), 1e-9)
    fixed_spec = t[("spec", b, 0, 1)] - (t[("spec", b, 0, n)] - t[("spec", b, 0, 1)]) / (n - 1)
    fixed_plain = t[("plain", b, 1)] - per_plain
    step[i] = np.maximum([(t[("spec", b, w, n)] - fixed_spec) / n / per_plain
                          for w in range(len(widths))], 1e-3)
    calls.append((fixed_spec - fixed_plain) / per_plain)
    for d, j in zip(drafters, drafter_ids):
      extra = (t[(d, b, n)] - t[("spec", b, top, n)]) / n
      drafter[i, j] = max(extra / (k * per_plain), 0.0)
  return CostTable(tuple(batch_sizes), tuple(widths), step, drafter,
                   call=max(float(np.median(calls)), 0.0), measured=True)
