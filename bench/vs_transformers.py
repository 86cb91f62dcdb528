"""This engine against Hugging Face transformers on the same weights, side by side in one run.

    python -m bench.vs_transformers --out=vs.json

The bundled demo model is exported to Hugging Face format (float32) and run by transformers'
`generate` in the reference interpreter (Python 3.11 with torch, as a subprocess:
`bench/hf_generate_child.py`; `--ref_python`, default `.venv-ref/bin/python`, which
`bash tests/golden/make_ref_env.sh` builds) and by this engine (`engine.generate`, float32),
on the same prompts (held-out standard-library modules), greedy, fixed output length (EOS
ignored).
Rounds alternate transformers / engine (`--rounds`); each side warms up first (our compile,
their first call) and reports the median of its timed runs. Every call of ours computes its
prompt (the model's engines' prefix caches are emptied before it), as transformers' does.

Jobs: output tokens/s at batch 1 and 32; time to first token (generate 1 token) for 512- and
2,048-token prompts; speculation at batch 1 (transformers' prompt lookup vs our n-gram
drafter; transformers' assistant model vs our draft model, both the bundled draft). Greedy
outputs are compared token for token. Peak RSS of each process is reported. Prints ratios
(transformers time / ours) and writes JSON.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from checkpoints import ref_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
flags.DEFINE_string("ref_python", ref_env.PYTHON,
                    "Python with torch + transformers (kept out of this environment; "
                    f"`bash {ref_env.MAKE_SCRIPT}` builds the default).")
flags.DEFINE_string("checkpoint", os.path.join(ROOT, "checkpoints", "demo", "target"), "Model.")
flags.DEFINE_string("draft_checkpoint", os.path.join(ROOT, "checkpoints", "demo", "draft"),
                    "Draft model for the assistant / draft-model jobs.")
flags.DEFINE_integer("rounds", 2, "Alternating rounds (each side runs every job per round).")
flags.DEFINE_integer("output_len", 64, "Generated tokens per throughput job.")
flags.DEFINE_integer("num_draft_tokens", 4, "Draft tokens per step for the speculative jobs.")
flags.DEFINE_bool("speculative", True, "Include the speculative jobs.")
flags.DEFINE_string("out", "", "Write JSON here.")


def _prompts(tokenizer, n: int, length: int, offset: int = 0) -> list[list[int]]:
  """n prompts of exactly `length` tokens cut from the held-out corpus."""
  from checkpoints import demo_corpus
  _, heldout = demo_corpus.split(demo_corpus.stdlib_files())
  ids = demo_corpus.encode_documents(tokenizer, demo_corpus.read_texts(heldout[:400]))
  step = max(length, (len(ids) - length) // max(n, 1) // 2)
  return [ids[offset + i * step: offset + i * step + length].astype(int).tolist()
          for i in range(n)]


def _jobs(tok) -> list[dict]:
  out = FLAGS.output_len
  jobs = [dict(name="batch 1, 64-token prompt", prompts=_prompts(tok, 1, 64), max_new_tokens=out,
               mode="plain"),
          dict(name="batch 32, 64-token prompts", prompts=_prompts(tok, 32, 64, 7),
               max_new_tokens=out, mode="plain"),
          dict(name="TTFT 512-token prompt", prompts=_prompts(tok, 1, 512, 11), max_new_tokens=1,
               mode="plain"),
          dict(name="TTFT 2048-token prompt", prompts=_prompts(tok, 1, 2048, 13),
               max_new_tokens=1, mode="plain")]
  if FLAGS.speculative:
    # Source code repeats itself (names, call patterns): what prompt lookup feeds on.
    long_prompt = _prompts(tok, 1, 512, 17)
    jobs += [dict(name="batch 1, n-gram / prompt lookup", prompts=long_prompt,
                  max_new_tokens=out, mode="prompt_lookup"),
             dict(name="batch 1, draft model / assistant", prompts=long_prompt,
                  max_new_tokens=out, mode="assistant"),
             dict(name="batch 1, 512-token prompt (no speculation)", prompts=long_prompt,
                  max_new_tokens=out, mode="plain")]
  for j in jobs:
    j.update(num_draft_tokens=FLAGS.num_draft_tokens, repeats=1)
  return jobs


def _run_transformers(hf_dir: str, draft_dir: str, jobs: list[dict], tmp: str) -> dict:
  for j in jobs:
    j["assistant_dir"] = draft_dir
  path = os.path.join(tmp, "jobs.json")
  with open(path, "w") as fh:
    json.dump(jobs, fh)
  out = os.path.join(tmp, "hf_out.json")
  subprocess.run([FLAGS.ref_python, os.path.join(ROOT, "bench", "hf_generate_child.py"),
                  f"--model_dir={hf_dir}", f"--jobs={path}", f"--out={out}"], check=True)
  with open(out) as fh:
    return json.load(fh)


def _run_ours(model, draft, jobs: list[dict], warm: bool) -> list[dict]:
  import engine
  results = []
  for j in jobs:
    spec = None
    if j["mode"] != "plain":
      from engine import SpeculativeConfig
      spec = (SpeculativeConfig("ngram", num_draft_tokens=j["num_draft_tokens"])
              if j["mode"] == "prompt_lookup" else
              SpeculativeConfig("draft", num_draft_tokens=j["num_draft_tokens"],
                                draft_cfg=draft.config, draft_params=draft.params))
    kwargs = dict(max_new_tokens=j["max_new_tokens"], ignore_eos=True)
    if spec is not None:
      kwargs["speculative"] = spec
    times = []
    for i in range(j["repeats"] + (0 if warm else 1)):
      model.llm.reset_prefix_caches()  # (each call computes its prompt, as transformers' do)
      t = time.perf_counter()
      res = engine.generate(model, j["prompts"], **kwargs)
      if i or warm:
        times.append(time.perf_counter() - t)
    results.append(dict(name=j["name"], times=times, token_ids=[r.token_ids for r in res]))
  return results


def main(argv):
  del argv
  ref_env.require(FLAGS.ref_python)
  import engine
  from checkpoints.export_hf import export
  model = engine.load(FLAGS.checkpoint, dtype="float32")
  draft = engine.load(FLAGS.draft_checkpoint, dtype="float32") if FLAGS.speculative else None
  jobs = _jobs(model.tokenizer)
  theirs: dict[str, list[float]] = {}
  ours: dict[str, list[float]] = {}
  their_ids, our_ids, their_rss = {}, {}, []
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir, draft_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "hf_draft")
    export(FLAGS.checkpoint, hf_dir, "float32")
    if FLAGS.speculative:
      export(FLAGS.draft_checkpoint, draft_dir, "float32")
    for r in range(FLAGS.rounds):
      print(f"round {r + 1}/{FLAGS.rounds}: transformers", file=sys.stderr, flush=True)
      hf = _run_transformers(hf_dir, draft_dir, [dict(j) for j in jobs], tmp)
      their_rss.append(hf["peak_rss_mb"])
      for res in hf["results"]:
        theirs.setdefault(res["name"], []).extend(res["times"])
        their_ids[res["name"]] = res["token_ids"]
      print(f"round {r + 1}/{FLAGS.rounds}: moejax", file=sys.stderr, flush=True)
      for res in _run_ours(model, draft, jobs, warm=r > 0):
        ours.setdefault(res["name"], []).extend(res["times"])
        our_ids[res["name"]] = res["token_ids"]
  rows = []
  for j in jobs:
    name = j["name"]
    t_hf, t_us = statistics.median(theirs[name]), statistics.median(ours[name])
    n_tokens = len(j["prompts"]) * j["max_new_tokens"]
    same = [a == b for a, b in zip(their_ids[name], our_ids[name])]
    rows.append(dict(job=name, transformers_s=t_hf, moejax_s=t_us, speedup=t_hf / t_us,
                     transformers_tok_s=n_tokens / t_hf, moejax_tok_s=n_tokens / t_us,
                     greedy_identical_rows=f"{sum(same)}/{len(same)}"))
  result = dict(rows=rows, transformers_peak_rss_mb=max(their_rss),
                moejax_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                rounds=FLAGS.rounds, output_len=FLAGS.output_len, cpu_count=os.cpu_count())
  print(f"\n{'job':44} {'transformers':>12} {'moejax':>9} {'speedup':>8} {'tok/s hf':>9} "
        f"{'tok/s ours':>10} {'same':>6}")
  for r in rows:
    print(f"{r['job']:44} {r['transformers_s']:>11.3f}s {r['moejax_s']:>8.3f}s "
          f"{r['speedup']:>7.2f}x {r['transformers_tok_s']:>9.1f} {r['moejax_tok_s']:>10.1f} "
          f"{r['greedy_identical_rows']:>6}")
  print(f"peak RSS: transformers {result['transformers_peak_rss_mb']:.0f} MB, moejax "
        f"{result['moejax_peak_rss_mb']:.0f} MB")
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
