"""Cold start of `python -m engine.serve`, A/B: each run a fresh persistent compilation cache,
timed from launch to the `[moejax] ready` line; the server's CPU time (user + sys, from
/usr/bin/time) and the load average before and after, since a shared machine's load moves
the wall time more than anything compared. Variants run interleaved, round by round.

    python -m bench.cold_warmup --rounds=3 base=../moejax-base new=.
    python -m bench.cold_warmup new1=.:MOEJAX_COMPILE_WORKERS=1 new2=.:MOEJAX_COMPILE_WORKERS=2

A variant is NAME=TREE[:VAR=VALUE,...]: the server runs from that source tree (PYTHONPATH) with
those environment variables. Prints one JSON line per run, then the means per variant.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "Runs of each variant.", lower_bound=1)
flags.DEFINE_list("serve_args", [], "More flags for engine.serve (e.g. --structured_warmup).")


def run_once(tree: str, env: dict[str, str]) -> dict:
  cache = tempfile.mkdtemp(prefix="moejax-cold-")
  times = os.path.join(cache, "time.txt")
  cmd = ["/usr/bin/time", "-f", "%U %S", "-o", times, sys.executable, "-m", "engine.serve",
         f"--compilation_cache_dir={cache}/jax", "--port=0", "--host=127.0.0.1",
         *FLAGS.serve_args]
  load = os.getloadavg()[0]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=tree, **env),
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  ready = warmup = None
  for line in proc.stderr:
    m = re.search(r"warm-up compiled (\d+) programs in ([\d.]+)s", line)
    if m:
      warmup = float(m.group(2))
    if "[moejax] ready" in line:
      ready = time.perf_counter() - t0
      break
  os.killpg(proc.pid, signal.SIGINT)  # (GNU time ignores it; the server drains and exits)
  try:
    proc.wait(timeout=60)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  with open(times) as fh:
    user, sys_ = map(float, fh.read().split()[-2:])
  shutil.rmtree(cache, ignore_errors=True)
  return dict(ready_s=ready and round(ready, 1), warmup_s=warmup, cpu_s=round(user + sys_, 1),
              load_before=round(load, 2), load_after=round(os.getloadavg()[0], 2))


def main(argv: list[str]) -> None:
  variants = []
  for spec in argv[1:]:
    name, _, rest = spec.partition("=")
    tree, _, envs = rest.partition(":")
    variants.append((name, os.path.abspath(tree),
                     dict(e.split("=", 1) for e in envs.split(",") if e)))
  if not variants:
    raise app.UsageError("give at least one NAME=TREE[:VAR=VALUE,...]")
  runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
  for r in range(FLAGS.rounds):
    for name, tree, env in variants:
      rec = run_once(tree, env)
      runs[name].append(rec)
      print(json.dumps(dict(variant=name, round=r, **rec)), flush=True)
  for name, recs in runs.items():
    ok = [x for x in recs if x["ready_s"] is not None]
    mean = lambda k: sum(x[k] for x in ok) / max(len(ok), 1)  # noqa: E731
    print(f"{name}: ready {mean('ready_s'):.1f} s, cpu {mean('cpu_s'):.1f} s, load "
          f"{mean('load_before'):.1f} (mean of {len(ok)} of {len(recs)} runs)")


if __name__ == "__main__":
  app.run(main)
