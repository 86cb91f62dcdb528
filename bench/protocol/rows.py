"""Rows of the GPU protocol: one JSON object per line of `$OUT/results.jsonl`, appended,
flushed and fsynced as each measurement is made, so a stage stopped at its time limit loses
nothing it measured. No JAX here: the torch peers' process imports this too.

Every row carries the run's labels (device, jax version, commit, stage, dry_run) and, where it
has bytes and a time, GB/s and its fractions of the same run's ceilings (stage `ceilings`):
  frac_copy     of the XLA copy counted read + write
  frac_read     of the XLA read-only reduction
  frac_ceiling  of max(read, copy): the bandwidth a kernel that only reads should reach
and with FLOPs, TFLOP/s and `frac_matmul` of the bf16 matmul rate.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

RESULTS = "results.jsonl"


def dry_run() -> bool:
  return os.environ.get("DRY_RUN", "") not in ("", "0")


def read_rows(out_dir: str) -> list[dict[str, Any]]:
  """Every row of `out_dir/results.jsonl` (a torn last line from a killed stage is skipped)."""
  path = os.path.join(out_dir, RESULTS)
  rows = []
  if os.path.exists(path):
    with open(path) as fh:
      for line in fh:
        try:
          rows.append(json.loads(line))
        except ValueError:
          continue
  return rows


def ceilings(out_dir: str) -> dict[str, float]:
  """This run's ceilings: {"copy_gbps", "read_gbps", "matmul_tflops"} as measured (missing
  when the ceilings stage did not measure them)."""
  found = {}
  names = {"xla_copy": "copy_gbps", "xla_read": "read_gbps", "xla_matmul_bf16": "matmul_tflops"}
  for r in read_rows(out_dir):
    if r.get("stage") == "ceilings" and r.get("impl") in names:
      value = r.get("tflops") if r["impl"] == "xla_matmul_bf16" else r.get("gbps")
      if value:
        found[names[r["impl"]]] = value
  return found


class Recorder:
  """Appends rows for one stage. `labels` (device, jax, ...) go into every row."""

  def __init__(self, out_dir: str, stage: str, **labels: Any):
    self.path = os.path.join(out_dir, RESULTS)
    self.out_dir = out_dir
    self.stage = stage
    self.labels = dict(commit=os.environ.get("COMMIT", "unknown"), dry_run=dry_run(), **labels)
    self.ceil = ceilings(out_dir)
    _end_line(self.path)
    self.count = 0
    self.t0 = time.perf_counter()

  def row(self, impl: str, case: str = "", **fields: Any) -> dict[str, Any]:
    """Writes one row: stage, impl, case, the fields given (us, bytes, flops, ...), GB/s and
    the fractions derived from them, the labels. Returns it."""
    r: dict[str, Any] = dict(stage=self.stage, impl=impl, case=case, **fields)
    us, nbytes, flops = r.get("us"), r.get("bytes"), r.get("flops")
    if us and nbytes and "gbps" not in r:
      r["gbps"] = nbytes / us / 1e3
    gbps = r.get("gbps")
    if gbps:
      copy, read = self.ceil.get("copy_gbps"), self.ceil.get("read_gbps")
      if copy:
        r["frac_copy"] = gbps / copy
      if read:
        r["frac_read"] = gbps / read
      if copy or read:
        r["frac_ceiling"] = gbps / max(copy or 0, read or 0)
    if us and flops:
      r.setdefault("tflops", flops / us / 1e6)
      if self.ceil.get("matmul_tflops"):
        r["frac_matmul"] = r["tflops"] / self.ceil["matmul_tflops"]
    r.update(self.labels, t_s=round(time.perf_counter() - self.t0, 2))
    line = json.dumps(r, default=_plain)
    with open(self.path, "a") as fh:
      fh.write(line + "\n")
      fh.flush()
      os.fsync(fh.fileno())
    self.count += 1
    # (stderr: a stage's stdout may be a file of Mosaic GPU's SASS dumps)
    print(f"[{self.stage} {r['t_s']:7.1f}s] {_brief(r)}", file=sys.stderr, flush=True)
    return r

  def skip(self, reason: str) -> dict[str, Any]:
    """The stage's `{"stage": ..., "skipped": reason}` row (requirements absent)."""
    return self.row("-", skipped=reason)


def _end_line(path: str) -> None:
  """Ends a torn last line (a stage killed mid-write) so the next row starts on its own."""
  if os.path.exists(path) and os.path.getsize(path):
    with open(path, "rb+") as fh:
      fh.seek(-1, os.SEEK_END)
      if fh.read(1) != b"\n":
        fh.write(b"\n")


def _plain(x: Any) -> Any:
  """JSON for numpy scalars and the like."""
  for cast in (float, str):
    try:
      return cast(x)
    except (TypeError, ValueError):
      continue
  return repr(x)


def _brief(r: dict[str, Any]) -> str:
  """One log line: impl, case, time, GB/s, fraction, error or skip."""
  bits = [r["impl"], r.get("case", "")]
  if r.get("us") is not None:
    bits.append(f"{r['us']:.1f} us")
  if r.get("gbps"):
    bits.append(f"{r['gbps']:.0f} GB/s")
  if r.get("frac_ceiling"):
    bits.append(f"{100 * r['frac_ceiling']:.0f}% of ceiling")
  if r.get("tflops"):
    bits.append(f"{r['tflops']:.1f} TFLOP/s")
  for key in ("skipped", "error"):
    if r.get(key):
      bits.append(f"{key}: {str(r[key])[:300]}")
  return " | ".join(str(b) for b in bits if b != "")


def missing(out_dir: str, stages: list[str]) -> list[str]:
  """The stages among `stages` with neither a row of their own (an error row does not count)
  nor a skip row."""
  have = set()
  for r in read_rows(out_dir):
    if r.get("impl") != "stage_end" and (r.get("skipped") or not r.get("error")):
      have.add(r.get("stage"))
  return [s for s in stages if s and s not in have]


def main(argv: list[str]) -> int:
  """From the shell:
    python -m bench.protocol.rows OUT STAGE REASON   a skip row (requirements absent, budget
                                                     spent)
    python -m bench.protocol.rows check OUT A,B,...  exit 1 naming the stages without a row"""
  if argv[0] == "check":
    lost = missing(argv[1], argv[2].split(","))
    print("gpu_check: every stage wrote a row" if not lost else
          f"gpu_check: no row from stage(s) {', '.join(lost)}")
    return 1 if lost else 0
  out_dir, stage, reason = argv[:3]
  Recorder(out_dir, stage).skip(reason)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
