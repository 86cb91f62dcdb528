"""Checks that transformers runs the exported demo model exactly as this engine does.

    python -m checkpoints.verify_hf_export --checkpoint=checkpoints/demo/target

Exports the checkpoint to Hugging Face format (float32), takes the first tokens of a few
held-out stdlib modules as prompts, computes our logits (float32, highest matmul precision) and
greedy tokens, runs `tests/golden/hf_logits.py` under the reference interpreter (Python 3.11 with
torch + transformers, kept out of this project's environment; `--ref_python`, default
`.venv-ref/bin/python`, which `bash tests/golden/make_ref_env.sh` builds), and prints a JSON
summary: relative error max|ours - theirs| / max|theirs| per prompt, and whether the 32 greedy
tokens agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import jax
import numpy as np
from absl import app, flags

from checkpoints import ref_env

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verify(checkpoint: str, ref_python: str = ref_env.PYTHON, prompt_len: int = 96,
           n_prompts: int = 3) -> dict:
  ref_env.require(ref_python)
  jax.config.update("jax_default_matmul_precision", "highest")
  import engine
  from checkpoints import demo_corpus
  from checkpoints.export_hf import export
  from engine.model.cache import contiguous_page_table, init_cache
  from engine.model.transformer import forward_logits
  import jax.numpy as jnp

  model = engine.load(checkpoint, dtype="float32", progress=False)
  _, heldout = demo_corpus.split(demo_corpus.stdlib_files())
  texts = demo_corpus.read_texts(heldout[:n_prompts])
  ids = demo_corpus.encode_documents(model.tokenizer, texts)
  starts = np.flatnonzero(ids == demo_corpus.BOS_ID)[:n_prompts]
  prompts = {f"prompt_{i}": ids[s:s + prompt_len].astype(np.int32) for i, s in enumerate(starts)}
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = os.path.join(tmp, "hf")
    export(checkpoint, hf_dir, "float32")
    np.savez(os.path.join(tmp, "prompts.npz"), **prompts)
    cmd = [ref_python, os.path.join(ROOT, "tests", "golden", "hf_logits.py"),
           f"--model_dir={hf_dir}", f"--prompts={os.path.join(tmp, 'prompts.npz')}",
           f"--out={os.path.join(tmp, 'ref.npz')}"]
    ref_log = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
    ref = dict(np.load(os.path.join(tmp, "ref.npz")))
  cfg, params, _ = model
  results = []
  for key, p in prompts.items():
    i = key.split("_")[-1]
    pt = contiguous_page_table(1, len(p), len(p))
    logits, _ = forward_logits(params, init_cache(cfg, 1, len(p), jnp.float32),
                               jnp.asarray(p[None]), jnp.zeros(1, jnp.int32),
                               jnp.asarray([len(p)]), jnp.asarray(pt), cfg=cfg)
    ours = np.asarray(logits[0], np.float64)
    theirs = ref[f"logits_{i}"].astype(np.float64)
    greedy = engine.generate(model, p.tolist(), max_new_tokens=32, ignore_eos=True).token_ids
    results.append({
        "prompt_tokens": len(p),
        "rel_err": float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))),
        "argmax_agree": float(np.mean(ours.argmax(-1) == theirs.argmax(-1))),
        "greedy_identical": greedy == ref[f"greedy_{i}"].tolist(),
    })
  return {"checkpoint": checkpoint, "reference": ref_log, "prompts": results}


def main(argv: list[str]) -> None:
  del argv
  print(json.dumps(verify(FLAGS.checkpoint, FLAGS.ref_python), indent=1))


if __name__ == "__main__":
  flags.DEFINE_string("checkpoint", "checkpoints/demo/target", "Checkpoint to verify.")
  flags.DEFINE_string("ref_python", ref_env.PYTHON,
                      "Python with torch + transformers (the reference environment; "
                      f"`bash {ref_env.MAKE_SCRIPT}` builds the default).")
  app.run(main)
