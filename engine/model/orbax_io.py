"""The moejax checkpoint format: params saved with Orbax next to the HF config and tokenizer.

    out_dir/
      config.json          the Hugging Face config, as is (the model is described by it)
      tokenizer.json ...   tokenizer files copied from the source checkpoint, when present
      params/              the `params.py` pytree, orbax StandardCheckpointer (OCDBT)
      moejax.json          {"format": "moejax-orbax", "version": 2, "dtype": "bfloat16"}

`moejax.json` is written last, so a directory without it is an interrupted save and is not
recognised by `is_orbax_checkpoint`. Restoring checks every leaf name and shape against
the layout from the Orbax metadata before reading any array.

Version 2 stores the stacked layout the model runs (`param_shapes`: layers stacked per run), so
a restore places each leaf where it belongs with no further work. Version 1 (the committed demo
models, checkpoints converted before the layers were stacked) stores the per-layer layout
(`per_layer_shapes`); it is restored layer by layer and stacked leaf by leaf
(`hf_loader.LayerStacker`; peak: the model plus one stacked leaf).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from engine.model.config import ModelConfig, config_from_dict, load_config
from engine.model.hf_loader import (INDEX_FILE, PICKLE_SUFFIXES, SINGLE_FILE, CheckpointError,
                                    LayerStacker, layer_sharding, shardings_by_leaf)
from engine.model.params import (Params, check_params, is_shape, leaf_dtype, param_shapes,
                                 path_str, per_layer_shapes, shape_leaves, stacked_leaf)

FORMAT = "moejax-orbax"
VERSION = 2  # written; READ_VERSIONS are read
READ_VERSIONS = (1, 2)
MANIFEST = "moejax.json"
PARAMS_DIR = "params"
# Tokenizer, generation and image-preprocessing files copied verbatim (Kimi ships
# tiktoken.model, not tokenizer.json; K2.5's preprocessor_config.json has its patch limits).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json")


def copy_tokenizer_files(src_dir: str, out_dir: str) -> None:
  """Copies the tokenizer and generation files present in `src_dir` into `out_dir`."""
  for name in TOKENIZER_FILES:
    path = os.path.join(src_dir, name)
    if os.path.isfile(path):
      shutil.copyfile(path, os.path.join(out_dir, name))


def _params_dtype(params: Params) -> str:
  """The one dtype of the free leaves (routing leaves are float32 and INT4 experts' packed
  nibbles and scales uint8 / bf16 by design: `leaf_dtype`)."""
  free = object()
  dtypes = {np.dtype(x.dtype).name for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if leaf_dtype(p, free) is free}
  if len(dtypes) != 1:
    raise ValueError(f"params mix dtypes {sorted(dtypes)}; cast them to one dtype before saving")
  return dtypes.pop()


def _is_empty_dir(path: str) -> bool:
  return os.path.isdir(path) and not os.listdir(path)


def save_orbax(out_dir: str, cfg_dict_or_src_dir: dict[str, Any] | str, params: Params,
               tokenizer_src_dir: str | None = None, overwrite: bool = False) -> None:
  """Writes a moejax checkpoint.

  cfg_dict_or_src_dir: the HF config dict, or a checkpoint directory whose config.json is copied
  (and whose tokenizer files are copied unless tokenizer_src_dir says otherwise).
  params must match `param_shapes` of that config. out_dir must be absent or empty unless
  overwrite. All processes must call this (Orbax saves collectively).
  """
  out_dir = os.path.abspath(os.fspath(out_dir))
  if isinstance(cfg_dict_or_src_dir, dict):
    cfg_dict = cfg_dict_or_src_dir
  else:
    src = os.fspath(cfg_dict_or_src_dir)
    with open(os.path.join(src, "config.json")) as fh:
      cfg_dict = json.load(fh)
    tokenizer_src_dir = src if tokenizer_src_dir is None else tokenizer_src_dir
  cfg = config_from_dict(cfg_dict)
  try:
    check_params(cfg, params)
  except ValueError as e:
    raise CheckpointError(f"params do not match config {cfg.display_name}: {e}") from e
  dtype = _params_dtype(params)

  if os.path.exists(out_dir) and not _is_empty_dir(out_dir):
    if not overwrite:
      raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True)")
    if jax.process_index() == 0:
      shutil.rmtree(out_dir)
  os.makedirs(out_dir, exist_ok=True)

  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(out_dir, PARAMS_DIR), params)
    ckptr.wait_until_finished()
  if jax.process_index() != 0:
    return
  with open(os.path.join(out_dir, "config.json"), "w") as fh:
    json.dump(cfg_dict, fh, indent=2)
  if tokenizer_src_dir is not None:
    copy_tokenizer_files(tokenizer_src_dir, out_dir)
  with open(os.path.join(out_dir, MANIFEST), "w") as fh:
    json.dump({"format": FORMAT, "version": VERSION, "dtype": dtype}, fh, indent=2)


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
  """The parsed moejax.json; CheckpointError if absent or not this format/version."""
  path = os.path.join(ckpt_dir, MANIFEST)
  try:
    with open(path) as fh:
      manifest = json.load(fh)
  except FileNotFoundError as e:
    raise CheckpointError(f"{ckpt_dir}: not a moejax checkpoint (no {MANIFEST})") from e
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from e
  if manifest.get("format") != FORMAT or manifest.get("version") not in READ_VERSIONS:
    raise CheckpointError(f"{path}: format {manifest.get('format')!r} version "
                          f"{manifest.get('version')!r}; this build reads {FORMAT!r} "
                          f"versions {', '.join(map(str, READ_VERSIONS))}")
  return manifest


def _check_stored(ckpt_dir: str, cfg: ModelConfig, stored: Any, per_layer: bool) -> None:
  """CheckpointError naming the first leaf whose presence or shape differs from the layout."""
  want = {name: shape for name, (_, shape) in shape_leaves(cfg, per_layer).items()}
  have = {path_str(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
  problems = [f"missing parameter {k!r} (expected shape {s})" for k, s in want.items()
              if k not in have]
  problems += [f"unexpected parameter {k!r} shape {s}" for k, s in have.items() if k not in want]
  problems += [f"parameter {k!r} has shape {have[k]}, expected {s}" for k, s in want.items()
               if k in have and have[k] != s]
  if problems:
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    raise CheckpointError(f"{ckpt_dir}: params do not match config {cfg.display_name}: "
                          + "; ".join(problems[:5]) + more)


def restore_orbax(ckpt_dir: str, cfg: ModelConfig | None = None, shardings: Any = None,
                  dtype: Any = None) -> Params:
  """Restores the params pytree of a moejax checkpoint.

  cfg: defaults to the checkpoint's config.json. shardings: pytree of `jax.sharding.Sharding`
  matching the params (default: all on the first device). dtype: cast non-routing leaves to it
  (default: the stored dtype, restoring bit-identical values).
  """
  ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
  manifest = read_manifest(ckpt_dir)
  cfg = cfg if cfg is not None else load_config(ckpt_dir)
  dtype = jnp.dtype(dtype if dtype is not None else manifest["dtype"])
  params_dir = os.path.join(ckpt_dir, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise CheckpointError(f"{ckpt_dir}: no {PARAMS_DIR}/ directory")
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  by_leaf = shardings_by_leaf(shardings, cfg) if shardings is not None else {}
  per_layer = manifest["version"] == 1

  def where(path: str) -> jax.sharding.Sharding:
    stacked, j = stacked_leaf(cfg, path) if per_layer else (path, None)
    s = by_leaf.get(stacked, default)
    return s if j is None else layer_sharding(s)

  with ocp.StandardCheckpointer() as ckptr:
    _check_stored(ckpt_dir, cfg, ckptr.metadata(params_dir).item_metadata.tree, per_layer)
    target = jax.tree_util.tree_map_with_path(
        lambda p, s: jax.ShapeDtypeStruct(s, leaf_dtype(p, dtype), sharding=where(path_str(p))),
        per_layer_shapes(cfg) if per_layer else param_shapes(cfg), is_leaf=is_shape)
    params = ckptr.restore(params_dir, target)
  if not per_layer:
    return params
  return _stack_on_devices(cfg, params, {name: by_leaf.get(name, default)
                                         for name in shape_leaves(cfg)}, dtype)


def _stack_on_devices(cfg: ModelConfig, params: Params, by_leaf: dict[str, Any],
                      dtype: Any) -> Params:
  """A restored per-layer tree stacked (`stack_layers`), leaf by leaf (`LayerStacker`: small
  stacks through the host, large ones in place on their devices), each layer's arrays freed
  as they are used."""
  stacker = LayerStacker(cfg, dtype, by_leaf)
  placed = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    done = stacker.add(path_str(path), leaf)
    if done is None:
      leaf.delete()
    else:
      placed[done[0]] = done[1]
  placed.update(stacker.stacks)
  return jax.tree_util.tree_map_with_path(lambda p, _: placed[path_str(p)], param_shapes(cfg),
                                          is_leaf=is_shape)


def is_orbax_checkpoint(path: str) -> bool:
  """True for a directory holding a complete moejax Orbax checkpoint."""
  path = os.fspath(path)
  if not os.path.isdir(os.path.join(path, PARAMS_DIR)):
    return False
  try:
    read_manifest(path)
  except CheckpointError:
    return False
  return True


def is_hf_checkpoint(path: str) -> bool:
  """True for a directory with config.json and weight files.

  Pickle-only weights (`.bin`/`.pt`) count, so that `load_hf_params` gets to refuse them with
  its clear "safetensors is required" error instead of a generic "unknown format".
  """
  path = os.fspath(path)
  if not os.path.isfile(os.path.join(path, "config.json")):
    return False
  if os.path.isfile(os.path.join(path, SINGLE_FILE)) or os.path.isfile(
      os.path.join(path, INDEX_FILE)):
    return True
  return any(name.endswith((".safetensors",) + PICKLE_SUFFIXES) for name in os.listdir(path))
