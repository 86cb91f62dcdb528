"""Exports a checkpoint (Orbax or HF) as a Hugging Face safetensors checkpoint.

    python -m checkpoints.export_hf --checkpoint=checkpoints/demo/target --out=demo_hf \
        [--dtype=float32|bfloat16]

Writes `config.json` (as stored with the checkpoint), the tokenizer files, and the weights in
the Hub layout (per-expert tensors; DeepSeek MTP layers after the decoder layers), so that
transformers, vLLM or SGLang run exactly the weights this engine runs.
"""

from __future__ import annotations

import json
import os
import time

import jax
import ml_dtypes
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def export(checkpoint: str, out: str, dtype: str = "float32", overwrite: bool = False) -> dict:
  """Writes `checkpoint` to `out` in HF format; returns a summary."""
  import engine
  from engine.model.hf_export import export_hf
  from engine.model.orbax_io import copy_tokenizer_files

  if os.path.exists(out) and os.listdir(out) and not overwrite:
    raise FileExistsError(f"{out} is not empty (pass --overwrite)")
  t0 = time.time()
  model = engine.load(checkpoint, dtype="float32", progress=False)
  with open(os.path.join(checkpoint, "config.json")) as fh:
    cfg_dict = json.load(fh)
  cfg_dict["torch_dtype"] = dtype
  os.makedirs(out, exist_ok=True)
  params = jax.tree.map(np.asarray, model.params)
  # Routing leaves stay float32, as transformers keeps them (`_keep_in_fp32_modules`).
  tensors = export_hf(cfg_dict, params, out, dtype=None if dtype == "float32" else DTYPES[dtype])
  copy_tokenizer_files(checkpoint, out)
  return {"out": out, "tensors": len(tensors), "bytes": int(sum(t.nbytes for t in
                                                                tensors.values())),
          "seconds": round(time.time() - t0, 1)}


def main(argv: list[str]) -> None:
  del argv
  try:
    summary = export(FLAGS.checkpoint, FLAGS.out, FLAGS.dtype, FLAGS.overwrite)
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    raise SystemExit(f"error: {e}") from None
  print(json.dumps(summary))


if __name__ == "__main__":
  flags.DEFINE_string("checkpoint", None, "Orbax (moejax) or HF checkpoint directory.",
                      required=True)
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_enum("dtype", "float32", sorted(DTYPES), "Tensor dtype of the export.")
  flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out.")
  app.run(main)
