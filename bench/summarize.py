"""Markdown tables from a directory of benchmark JSON files (`bench/gpu_check.sh` output).

    python -m bench.summarize OUT_DIR > summary.md

Each JSON with a list under "rows" becomes a table (one column per key); other top-level
scalars are listed above it.
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, (list, dict)):
    return json.dumps(v)[:60]
  return str(v)


def table(rows: list[dict]) -> str:
  cols: list[str] = []
  for r in rows:
    cols += [k for k in r if k not in cols]
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def main(out_dir: str) -> None:
  for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
    with open(path) as fh:
      data = json.load(fh)
    print(f"## {os.path.basename(path)}\n")
    if not isinstance(data, dict):
      print(f"```\n{json.dumps(data)[:2000]}\n```\n")
      continue
    for k, v in data.items():
      if not isinstance(v, (list, dict)):
        print(f"- {k}: {_fmt(v)}")
    print()
    for k, v in data.items():
      if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
        print(f"### {k}\n\n{table(v)}\n")


if __name__ == "__main__":
  main(sys.argv[1])
