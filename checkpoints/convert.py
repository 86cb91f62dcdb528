"""Converts a Hugging Face safetensors checkpoint to the moejax Orbax format.

    python -m checkpoints.convert --hf_dir=/ckpt/DeepSeek-V3 --out=/ckpt/dsv3-moejax \
        [--dtype=bfloat16|float32] [--overwrite]

The output is written to `<out>.partial` and renamed into place when complete, so an
interrupted conversion never leaves something that looks like a checkpoint at --out.
Prints one summary line: parameter count, bytes, time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any

from absl import app, flags, logging

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when run as a script only: absl refuses a flag
  defined twice in one process, and other command lines share these names."""
  flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint directory (config.json + safetensors).")
  flags.DEFINE_string("out", None, "Output directory for the moejax Orbax checkpoint.")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                    "Dtype of the saved params (routing leaves stay float32).")
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out.")
  flags.DEFINE_bool("progress", True, "Print per-shard progress for large checkpoints.")


def convert(hf_dir: str, out: str, dtype: str = "bfloat16", overwrite: bool = False,
            progress: bool = True) -> dict[str, Any]:
  """Loads `hf_dir` and writes `out`; returns {"params", "bytes", "seconds", "dtype"}."""
  import jax
  import jax.numpy as jnp

  from engine.model.config import config_dict_without_mtp
  from engine.model.hf_loader import CheckpointError, checkpoint_config, load_hf_params
  from engine.model.orbax_io import save_orbax

  start = time.time()
  out = os.path.abspath(out)
  if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not overwrite:
    raise FileExistsError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise CheckpointError(f"--hf_dir {hf_dir}: no config.json")
  cfg = checkpoint_config(hf_dir)
  params = load_hf_params(hf_dir, cfg, dtype=jnp.dtype(dtype), progress=progress)
  with open(os.path.join(hf_dir, "config.json")) as fh:
    cfg_dict = json.load(fh)
  if cfg.mtp_layers_absent:  # the saved config describes the saved params: no MTP layers
    cfg_dict = config_dict_without_mtp(cfg_dict)
  leaves = jax.tree.leaves(params)
  partial = out.rstrip(os.sep) + ".partial"
  if os.path.exists(partial):
    shutil.rmtree(partial)  # a previous interrupted conversion
  save_orbax(partial, cfg_dict, params, tokenizer_src_dir=hf_dir)
  if os.path.exists(out):
    shutil.rmtree(out)
  os.rename(partial, out)
  return dict(params=sum(x.size for x in leaves), bytes=sum(x.nbytes for x in leaves),
              seconds=time.time() - start, dtype=dtype)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
  from engine.model.config import ConfigError
  from engine.model.hf_loader import CheckpointError
  try:
    s = convert(FLAGS.hf_dir, FLAGS.out, FLAGS.dtype, FLAGS.overwrite, FLAGS.progress)
  except (CheckpointError, ConfigError, FileExistsError, NotImplementedError) as e:
    print(f"convert: error: {e}", file=sys.stderr)
    sys.exit(1)
  n = s["params"]
  count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
  print(f"converted {FLAGS.hf_dir} -> {FLAGS.out}: {n:,} params ({count}), "
        f"{s['bytes'] / 1e9:.3f} GB {s['dtype']}, {s['seconds']:.1f} s")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["hf_dir", "out"])
  app.run(main)
