"""Compiled shape buckets: which (rows, width) programs exist, and how a step's work is packed.

A mixed step (prefill chunks, possibly with decodes) runs `model_step` on a `[B, W]` block: each
scheduled segment of n tokens is cut into ceil(n / W) rows of width W, and B is the smallest
compiled row count that holds them. A decode-only step runs `decode_loop` on `[B]` rows. All
programs are compiled at start-up; a step only ever picks a compiled shape, so serving never
compiles.

The adaptive half: `TrafficStats` records what steps looked like; `derive_buckets` turns a
recorded histogram into the bucket set (row widths that pad the observed prefill segments
least, decode batch sizes that fit the observed batch sizes), always keeping the largest shape
the configured limits allow so that any step still fits.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import threading
from typing import Sequence

import jax

from engine.runtime.scheduler import SchedulerConfig

DEFAULT_ROW_WIDTHS = (16, 64)
# On XLA:CPU a step costs about its tokens whatever its row width (BENCHMARKS.md, "CPU: a cold
# warm-up in 11 programs"): a 3,840-token prompt prefilled in [16x16] chunks took ~3.5% longer
# than in [4x64] ones, shorter prompts alike, while the four 64-wide programs were a quarter of
# the demo's cold warm-up. So one width there.
CPU_ROW_WIDTHS = (16,)
# A row costs about this many token slots beyond its width: it re-reads its request's context
# in attention and occupies a batch slot. Keeps the packing from choosing many narrow rows.
ROW_OVERHEAD = 8


def default_row_widths(platform: str) -> tuple[int, ...]:
  """`EngineConfig.row_widths`' default on a platform ("cpu", "gpu", "tpu")."""
  return CPU_ROW_WIDTHS if platform == "cpu" else DEFAULT_ROW_WIDTHS


def bucket(n: int, minimum: int = 16) -> int:
  """Next power of two >= n (and >= minimum): bounds the number of compiled shapes."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def quarter_bucket(n: int, multiple: int = 1) -> int:
  """n rounded up to a quarter of the power of two below it (129..256 -> 160, 192, 224, 256),
  then to a multiple of `multiple`: four shapes per octave, none more than a quarter past n."""
  n = max(n, 1)
  step = 1 << max((n - 1).bit_length() - 3, 0)
  size = -(-n // step) * step
  return -(-size // multiple) * multiple


def powers_of_two_upto(n: int) -> tuple[int, ...]:
  """1, 2, 4, ... up to and including the first power of two >= n."""
  out = [1]
  while out[-1] < n:
    out.append(out[-1] * 2)
  return tuple(out)


def max_rows(cfg: SchedulerConfig, width: int) -> int:
  """Most rows a step can need at this width. A step has at most max_num_seqs segments (one per
  running request, or per span of a draft catch-up) of >= 1 token each and at most
  max_num_batched_tokens in all; a segment of n tokens takes ceil(n / W) = 1 + (n - 1) // W
  rows, so s segments take at most s + (T - s) // W rows, which grows with s (and is reached:
  s - 1 single tokens and one long segment). The looser ceil(T / W) + S compiled a shape no
  step can use whenever W >= T (e.g. [8 x 32] for 4 sequences and 32 tokens)."""
  t = cfg.max_num_batched_tokens
  s = min(cfg.max_num_seqs, t)
  return s + (t - s) // width


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
  """The compiled shapes: mixed `(width, row counts)` and decode-loop row counts."""
  mixed: tuple[tuple[int, tuple[int, ...]], ...]  # (W, sorted B's), W ascending
  decode: tuple[int, ...]  # sorted B's

  def mixed_shapes(self) -> list[tuple[int, int]]:
    return [(b, w) for w, bs in self.mixed for b in bs]

  def decode_rows(self, n: int) -> int:
    for b in self.decode:
      if b >= n:
        return b
    raise ValueError(f"{n} decode rows exceed the largest compiled batch {self.decode[-1]}")

  def pack(self, lengths: Sequence[int]) -> tuple[int, int]:
    """Chooses (B, W) for segments of these lengths: fewest token slots (counting the row
    overhead), then fewest rows."""
    best = None
    for w, bs in self.mixed:
      rows = sum(-(-n // w) for n in lengths)
      b = next((b for b in bs if b >= rows), None)
      if b is None:
        continue
      key = (b * (w + ROW_OVERHEAD), b)
      if best is None or key < best[0]:
        best = (key, (b, w))
    if best is None:
      raise ValueError(f"segments {list(lengths)} fit no compiled shape {self.mixed}")
    return best[1]


def _choose(samples: Sequence[int], candidates: Sequence[int], k: int, cost) -> tuple[int, ...]:
  """At most k candidates, the largest always among them, minimising the summed cost of every
  sample rounded up to the next chosen candidate (dynamic programming over sorted candidates)."""
  cands = sorted(set(candidates))
  top = cands[-1]
  counts = collections.Counter(min(int(x), top) for x in samples)
  values = sorted(counts)

  def interval(lo: int, hi: int) -> float:  # samples in (lo, hi] rounded up to hi
    return sum(counts[v] * cost(v, hi) for v in values if lo < v <= hi)

  m = len(cands)
  inf = float("inf")
  # best[j][i]: min cost of samples <= cands[i] using j buckets, the last one cands[i].
  best = [[inf] * m for _ in range(k + 1)]
  back = [[-1] * m for _ in range(k + 1)]
  for i in range(m):
    best[1][i] = interval(0, cands[i])
  for j in range(2, k + 1):
    for i in range(m):
      for p in range(i):
        c = best[j - 1][p] + interval(cands[p], cands[i])
        if c < best[j][i]:
          best[j][i], back[j][i] = c, p
  j = min(range(1, k + 1), key=lambda j: (best[j][m - 1], j))
  chosen, i = [], m - 1
  while i >= 0 and j >= 1:
    chosen.append(cands[i])
    i, j = back[j][i], j - 1
  return tuple(sorted(chosen))


def _choose_widths(lengths: Sequence[int], candidates: Sequence[int], k: int) -> tuple[int, ...]:
  """The k row widths that pad the recorded prefill segments least (each segment takes the
  width that wastes least for it); ties prefer wider rows (fewer rows, fewer context reads)."""
  counts = collections.Counter(int(n) for n in lengths)
  best = None
  for combo in itertools.combinations(sorted(set(candidates)), min(k, len(set(candidates)))):
    padded = sum(c * min(-(-n // w) * (w + ROW_OVERHEAD) for w in combo)
                 for n, c in counts.items())
    key = (padded, -sum(combo))
    if best is None or key < best[0]:
      best = (key, combo)
  return best[1]


def derive_buckets(cfg: SchedulerConfig, row_widths: Sequence[int] = DEFAULT_ROW_WIDTHS,
                   stats: "TrafficStats | None" = None,
                   decode_sizes: Sequence[int] | None = None) -> ShapeBuckets:
  """Bucket set from the limits, refined by a recorded traffic histogram when given.
  `decode_sizes`: the decode loop's batch sizes, as given (max_num_seqs always among them)."""
  widths = sorted({min(w, cfg.max_num_batched_tokens) for w in row_widths if w >= 2}) or [2]
  decode = list(powers_of_two_upto(cfg.max_num_seqs))
  decode[-1] = cfg.max_num_seqs  # no larger batch can exist
  if stats is not None and stats.prefill_lengths:
    cand = [w for w in powers_of_two_upto(cfg.max_num_batched_tokens) if w >= 2]
    cand[-1] = min(cand[-1], cfg.max_num_batched_tokens)
    widths = list(_choose_widths(stats.prefill_lengths, cand, len(widths)))
  if decode_sizes:
    if not all(1 <= b <= cfg.max_num_seqs for b in decode_sizes):
      raise ValueError(f"decode_batch_sizes {tuple(decode_sizes)}: each must be in [1, "
                       f"max_num_seqs = {cfg.max_num_seqs}]")
    decode = sorted(set(decode_sizes) | {cfg.max_num_seqs})
  elif stats is not None and stats.decode_rows:
    cand = [b for b in range(1, cfg.max_num_seqs + 1) if b < 8 or b % 8 == 0]
    decode = list(_choose(stats.decode_rows, cand + [cfg.max_num_seqs], len(decode),
                          lambda n, b: b))
  # The narrowest width covers every possible step; wider ones only the shapes worth having
  # (a step that fits no wide shape falls back to the narrowest).
  mixed = tuple((w, tuple(b for b in powers_of_two_upto(max_rows(cfg, w))
                          if i == 0 or b == 1 or b * w <= 2 * cfg.max_num_batched_tokens))
                for i, w in enumerate(widths))
  return ShapeBuckets(mixed=mixed, decode=tuple(decode))


class TrafficStats:
  """A rolling record of step shapes (prefill segment lengths, decode batch sizes)."""

  def __init__(self, max_samples: int = 20000):
    self.prefill_lengths: collections.deque[int] = collections.deque(maxlen=max_samples)
    self.decode_rows: collections.deque[int] = collections.deque(maxlen=max_samples)

  def record_mixed(self, lengths: Sequence[int]) -> None:
    self.prefill_lengths.extend(n for n in lengths if n > 1)

  def record_decode(self, rows: int) -> None:
    self.decode_rows.append(rows)

  def save(self, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
      json.dump({"prefill_lengths": list(self.prefill_lengths),
                 "decode_rows": list(self.decode_rows)}, fh)
    os.replace(tmp, path)

  @staticmethod
  def load(path: str) -> "TrafficStats | None":
    if not path or not os.path.exists(path):
      return None
    with open(path) as fh:
      data = json.load(fh)
    stats = TrafficStats()
    stats.prefill_lengths.extend(int(x) for x in data.get("prefill_lengths", []))
    stats.decode_rows.extend(int(x) for x in data.get("decode_rows", []))
    return stats


class CompileCounter:
  """Counts XLA executables this process obtains (all threads) while active.

  `count`: programs compiled or loaded because the in-memory jit cache missed (what "no
  compilation after warm-up" is about); `persistent_hits`: of those, loaded from JAX's
  persistent compilation cache instead of compiled.
  """

  _lock = threading.Lock()
  _active: list["CompileCounter"] = []
  _registered = False

  def __init__(self):
    self.count = 0
    self.persistent_hits = 0

  @property
  def compiled(self) -> int:
    return self.count - self.persistent_hits

  @classmethod
  def _on_duration(cls, event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      with cls._lock:
        for c in cls._active:
          c.count += 1

  @classmethod
  def _on_event(cls, event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      with cls._lock:
        for c in cls._active:
          c.persistent_hits += 1

  def __enter__(self) -> "CompileCounter":
    with CompileCounter._lock:
      if not CompileCounter._registered:
        jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_duration)
        jax.monitoring.register_event_listener(CompileCounter._on_event)
        CompileCounter._registered = True
      CompileCounter._active.append(self)
    return self

  def __exit__(self, *exc) -> None:
    with CompileCounter._lock:
      CompileCounter._active.remove(self)
