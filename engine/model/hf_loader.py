"""Loads a Hugging Face safetensors checkpoint into the parameter pytree of `params.py`.

    params = load_hf_params("/ckpt/DeepSeek-V3", cfg, dtype=jnp.bfloat16, shardings=shardings)

The loader first reads every shard's header and checks the full set of tensor names, shapes and
dtypes against `param_shapes(cfg)`, so a wrong checkpoint fails in seconds with the HF tensor
named. Then it reads shard by shard (each in file order), filling one host buffer per leaf of
the per-layer layout (stacked expert leaves expert by expert) as `hf_mapping.Plan` says (HF's
[out, in] Linear weights transposed to our [in, out] layout with explicit head axes), casting,
and placing each leaf on device as soon as it is complete: a layer's leaf goes into its stack
(`params.py`: the layers' leaves stacked on a leading axis), written in place
(`LayerStacker`). Only incomplete leaves are held on the host, so peak host memory is a few
leaves, not the model. Nothing is unpickled: `.bin`/`.pt` checkpoints are refused.

Supported tensor encodings: F32/F16/BF16, DeepSeek-V3/Kimi-K2 FP8 block quantization
(dequantized at load), and compressed-tensors INT4 routed experts (Kimi K2.5 / K2-Thinking: kept
packed as `Int4Weight` leaves; `quantized.py` has both formats' tensors and rules). Experts are accepted per expert (Hub layout `mlp.experts.{e}.gate_proj.weight`) or
stacked (transformers 5: `mlp.experts.gate_up_proj` [E, 2*Im, H] gate first, and
`mlp.experts.down_proj` [E, H, Im]; or stacked `gate_proj`/`up_proj` [E, Im, H]).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.model import quantized, vision_checkpoint
from engine.model.config import ModelConfig, load_config, without_mtp, without_vision
from engine.model.hf_mapping import (FP8_SCALE_SUFFIX, K25_PREFIX, K25_VISION_PREFIXES, Plan,
                                     build_plan, shown)
from engine.model.params import (Params, check_params, is_shape, leaf_dtype, param_shapes,
                                 path_str, shape_leaves, shardings_by_leaf, stacked_leaf)
from engine.model.safetensors_io import (FLOAT_DTYPES, SafetensorsError, SafetensorsFile,
                                         TensorInfo, read_header)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Print progress lines (when asked) if stderr is a terminal or the load is at least this large.
PROGRESS_MIN_BYTES = 1 << 30
MAX_LISTED_PROBLEMS = 8


log = logging.getLogger("moejax")


class CheckpointError(ValueError):
  """A checkpoint whose files or tensors do not match the config (tensor and shapes named)."""


# ---- finding and indexing the files ---------------------------------------------------------

def _checkpoint_files(ckpt_dir: str) -> tuple[list[str], dict[str, str] | None]:
  """(shard paths in load order, index weight_map or None)."""
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"{ckpt_dir}: not a directory")
  index_path = os.path.join(ckpt_dir, INDEX_FILE)
  if os.path.exists(index_path):
    try:
      with open(index_path) as fh:
        weight_map = json.load(fh)["weight_map"]
      if not isinstance(weight_map, dict):
        raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
    shards = sorted({str(v) for v in weight_map.values()})
    for shard in shards:
      if os.path.basename(shard) != shard:
        raise CheckpointError(f"{index_path}: shard {shard!r} is not a file name in {ckpt_dir}")
      if not os.path.isfile(os.path.join(ckpt_dir, shard)):
        example = next(n for n, s in weight_map.items() if s == shard)
        raise CheckpointError(
            f"{index_path} names shard file {shard!r} (e.g. for tensor {example!r}) but "
            f"{os.path.join(ckpt_dir, shard)} does not exist")
    return [os.path.join(ckpt_dir, s) for s in shards], weight_map
  single = os.path.join(ckpt_dir, SINGLE_FILE)
  if os.path.isfile(single):
    return [single], None
  entries = sorted(os.listdir(ckpt_dir))
  others = [e for e in entries if e.endswith(".safetensors")]
  if others:
    return [os.path.join(ckpt_dir, e) for e in others], None
  pickled = [e for e in entries if e.endswith(PICKLE_SUFFIXES)]
  if pickled:
    raise CheckpointError(
        f"{ckpt_dir}: only pickle-based weights ({', '.join(pickled[:3])}); safetensors is "
        f"required (this loader never unpickles). Convert them with "
        f"transformers' save_pretrained(safe_serialization=True).")
  raise CheckpointError(f"{ckpt_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


@dataclasses.dataclass
class _Source:
  """Where a (canonical) tensor lives."""
  raw_name: str
  file: str
  info: TensorInfo
  scale: "_Source | None" = None

  @property
  def nbytes(self) -> int:
    return self.info.nbytes + (self.scale.info.nbytes if self.scale else 0)


def _read_headers(files: list[str], weight_map: dict[str, str] | None,
                  ckpt_dir: str) -> dict[str, _Source]:
  """{raw tensor name: source} over all shards; duplicates and index mismatches are errors."""
  sources: dict[str, _Source] = {}
  for path in files:
    try:
      tensors, _ = read_header(path)
    except SafetensorsError as e:
      raise CheckpointError(str(e)) from e
    for name, info in tensors.items():
      if name in sources:
        raise CheckpointError(
            f"tensor {name!r} appears in two shards: {os.path.basename(sources[name].file)} "
            f"and {os.path.basename(path)}")
      sources[name] = _Source(name, path, info)
  if weight_map is not None:
    for name, shard in weight_map.items():
      src = sources.get(name)
      if src is None or os.path.basename(src.file) != os.path.basename(shard):
        where = "no shard" if src is None else os.path.basename(src.file)
        raise CheckpointError(
            f"{os.path.join(ckpt_dir, INDEX_FILE)} maps tensor {name!r} to {shard!r} but it is "
            f"in {where}")
  return sources


def checkpoint_headers(ckpt_dir: str) -> dict[str, _Source]:
  """{raw tensor name: where it lives} over a directory's safetensors (`model.safetensors`, an
  index's shards, or every `*.safetensors`), checked: a name in two shards, an index that
  disagrees with the files, pickle-only weights are `CheckpointError`s."""
  files, weight_map = _checkpoint_files(ckpt_dir)
  return _read_headers(files, weight_map, ckpt_dir)


# ---- validation -----------------------------------------------------------------------------

def _raw_config(ckpt_dir: str) -> dict[str, Any]:
  path = os.path.join(ckpt_dir, "config.json")
  if not os.path.exists(path):
    return {}
  with open(path) as fh:
    try:
      return json.load(fh)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _canonical(name: str, cfg: ModelConfig) -> str | None:
  """Our HF-style name for a raw tensor name, or None if the tensor is knowingly skipped."""
  if cfg.model_type == "kimi_k25":
    if name.startswith(K25_VISION_PREFIXES):
      return vision_checkpoint.canonical(name) if cfg.vision is not None else None
    if name.startswith(K25_PREFIX):
      name = name[len(K25_PREFIX):]
  if name.endswith("rotary_emb.inv_freq"):
    return None
  if cfg.tie_word_embeddings and name == "lm_head.weight":
    return None
  m = re.match(r"model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight$", name)
  # DeepSeek-V3's MTP layers store copies of the shared embedding and output head; the model
  # uses the main ones.
  if (m and cfg.is_mla
      and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_nextn_predict_layers):
    return None
  return name


def _mtp_tensor_names(raw_names: Any, cfg: ModelConfig) -> list[str]:
  """The raw names of the tensors of `cfg`'s MTP layers (stored as layers num_layers + k)."""
  n, names = cfg.num_layers, []
  for name in raw_names:
    c = _canonical(name, cfg)
    m = re.match(r"model\.layers\.(\d+)\.", c or "")
    if m and n <= int(m.group(1)) < n + cfg.num_nextn_predict_layers:
      names.append(name)
  return names


def checkpoint_config(ckpt_dir: str, cfg: ModelConfig | None = None,
                      keep_fp8: bool = False) -> ModelConfig:
  """The config the checkpoint serves: `cfg` (its config.json by default), `without_mtp` when
  config.json declares MTP layers but the checkpoint holds none of their tensors (any checkpoint
  saved by transformers, whose DeepseekV3 classes neither build nor save them); with
  `keep_fp8`, routed experts kept as FP8 blocks (`cfg.fp8_experts`) when config.json says FP8
  and every routed expert matrix is stored F8_E4M3 with its scale_inv; `without_vision` when
  config.json has a vision_config but the checkpoint no vision tensor. Reads headers."""
  ckpt_dir = os.fspath(ckpt_dir)
  cfg = cfg if cfg is not None else load_config(ckpt_dir)
  mtp = cfg.is_mla and cfg.num_nextn_predict_layers
  if not (mtp or keep_fp8 or cfg.vision is not None):
    return cfg
  raw = checkpoint_headers(ckpt_dir)
  if mtp and not _mtp_tensor_names(raw, cfg):
    cfg = without_mtp(cfg)
  if cfg.vision is not None and not any(n.startswith(K25_VISION_PREFIXES) for n in raw):
    log.info("hf_loader: config.json has a vision_config but %s no vision tensor: text only",
             ckpt_dir)
    cfg = without_vision(cfg)
  if keep_fp8 and cfg.int4 is None and cfg.num_experts:
    dtypes = {_canonical(n, cfg): s.info.dtype for n, s in raw.items()}
    block = quantized.fp8_experts_block(_raw_config(ckpt_dir), dtypes, cfg)
    if block is not None:
      cfg = dataclasses.replace(cfg, fp8_experts=block)
      dense = dataclasses.replace(cfg, fp8_dense=True)  # kept too if every one is F8 + scale
      fills = build_plan(dense, set(dtypes)).fills
      if all(dtypes.get(hf) in (f[0].dtypes or (dtypes.get(hf),)) for hf, f in fills.items()):
        cfg = dense
  return cfg



def _resolve(cfg: ModelConfig, raw: dict[str, _Source], raw_cfg: dict[str, Any],
             ckpt_dir: str) -> tuple[Plan, dict[str, _Source], tuple[int, int]]:
  """Checks names, shapes and dtypes from the headers; returns (plan, sources, FP8 block)."""
  canon: dict[str, _Source] = {}
  for name, src in raw.items():
    c = _canonical(name, cfg)
    if c is None:
      continue
    if c in canon:  # e.g. both "language_model.X" and "X" in a Kimi-K2.5 checkpoint
      raise CheckpointError(f"tensors {canon[c].raw_name!r} and {name!r} both provide {c!r}")
    canon[c] = src
  skipped = [n for n in raw if cfg.model_type == "kimi_k25" and cfg.vision is None
             and n.startswith(K25_VISION_PREFIXES)]
  if skipped:
    log.info("hf_loader: %d vision tensors skipped (text only: no vision_config)", len(skipped))
  fp8_example = next((s.raw_name for s in canon.values() if s.info.dtype.startswith("F8")), None)
  block = quantized.fp8_block(raw_cfg, fp8_example, cfg.int4 is not None)
  plan = build_plan(cfg, set(canon))
  # FP8 scales of weights dequantized at load (kept FP8 experts plan their scales themselves).
  scales = {n[:-len(FP8_SCALE_SUFFIX)] + ".weight": canon.pop(n)
            for n in list(canon) if n.endswith(FP8_SCALE_SUFFIX) and n not in plan.fills}
  for name in canon:
    if name in plan.fills or cfg.int4 is not None:  # INT4 configs: listed as unexpected below
      continue
    for suffix, fmt in quantized.QUANT_SUFFIXES.items():
      if name.endswith(suffix):
        raise NotImplementedError(
            f"tensor {canon[name].raw_name!r} is stored in a quantized format ({fmt}) but "
            f"config.json has no compressed-tensors quantization_config for it; use an "
            f"unquantized, FP8 block-quantized or compressed-tensors INT4 checkpoint")
  problems: list[str] = []
  for hf in plan.fills:
    if hf not in canon:
      problems.append(f"missing tensor {shown(hf, cfg)!r} (expected shape {plan.hf_shape(hf)})")
  for hf, src in canon.items():
    where = os.path.basename(src.file)
    if hf not in plan.fills:
      problems.append(f"unexpected tensor {src.raw_name!r} {src.info.dtype}{list(src.info.shape)}"
                      f" in {where}")
      continue
    want, got = plan.hf_shape(hf), src.info.shape
    if got != want:
      problems.append(f"tensor {src.raw_name!r} in {where} has shape {got}, expected {want}")
    dtypes = plan.fills[hf][0].dtypes
    if dtypes is not None:  # INT4 packed words, scales, shapes
      if src.info.dtype not in dtypes:
        problems.append(f"tensor {src.raw_name!r} in {where} has dtype {src.info.dtype}, "
                        f"expected {' or '.join(dtypes)}")
      continue
    if src.info.dtype not in FLOAT_DTYPES:
      problems.append(f"tensor {src.raw_name!r} in {where} has dtype {src.info.dtype}, "
                      f"expected a float dtype")
    scale = scales.pop(hf, None)
    if src.info.dtype.startswith("F8"):
      if scale is None:
        problems.append(f"tensor {src.raw_name!r} in {where} is {src.info.dtype} but has no "
                        f"{hf[:-len('.weight')] + FP8_SCALE_SUFFIX!r} beside it")
        continue
      want_s = got[:-2] + tuple(math.ceil(d / b) for d, b in zip(got[-2:], block))
      if len(got) < 2 or scale.info.shape != want_s:
        problems.append(f"tensor {scale.raw_name!r} has shape {scale.info.shape}, expected "
                        f"{want_s} for block {list(block)} of {src.raw_name!r} {got}")
      src.scale = scale
    elif scale is not None:
      problems.append(f"tensor {scale.raw_name!r} scales {src.raw_name!r}, which is "
                      f"{src.info.dtype}, not FP8")
  for scale in scales.values():
    problems.append(f"unexpected tensor {scale.raw_name!r} (a scale with no weight)")
  if problems:
    listed = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
    more = len(problems) - MAX_LISTED_PROBLEMS
    tail = f"\n  ... and {more} more" if more > 0 else ""
    if cfg.is_mla and cfg.num_nextn_predict_layers and not _mtp_tensor_names(raw, cfg):
      tail += (f"\n  (config.json declares num_nextn_predict_layers="
               f"{cfg.num_nextn_predict_layers} but the checkpoint holds no MTP tensors: load "
               f"it with the config hf_loader.checkpoint_config returns, or engine.load)")
    raise CheckpointError(f"{ckpt_dir} does not match config {cfg.display_name}: "
                          f"{len(problems)} problem(s):\n  {listed}{tail}")
  _check_weight_shapes(plan, canon, cfg, ckpt_dir)
  return plan, canon, block


def _check_weight_shapes(plan: Plan, canon: dict[str, _Source], cfg: ModelConfig,
                         ckpt_dir: str) -> None:
  """Reads every INT4 `weight_shape` (a few bytes each) before any leaf is placed."""
  names = [hf for hf in plan.fills if hf.endswith(quantized.SHAPE_SUFFIX)]
  problems = quantized.check_weight_shapes(
      {hf: (canon[hf].raw_name, canon[hf].file) for hf in names}, plan.hf_shape)
  if problems:
    listed = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
    raise CheckpointError(f"{ckpt_dir} does not match config {cfg.display_name}: "
                          f"{len(problems)} problem(s):\n  {listed}")


# ---- reading --------------------------------------------------------------------------------

def _read(src: _Source, f: SafetensorsFile, block: tuple[int, int]) -> np.ndarray:
  arr = f.get(src.raw_name)
  if src.scale is None:
    return arr
  if src.scale.file == f.path:
    scale = f.get(src.scale.raw_name)
  else:
    with SafetensorsFile(src.scale.file) as g:
      scale = np.array(g.get(src.scale.raw_name))
  return quantized.dequant_fp8(arr, scale, block)


def _place(buf: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
  if sharding is None:
    arr = jax.device_put(buf)
  else:
    # Works for multi-process shardings too: each process transfers only its own shards.
    arr = jax.make_array_from_callback(buf.shape, sharding, lambda idx: buf[idx])
  # Waiting bounds host memory: the buffer is released before the next leaf is built.
  return arr.block_until_ready()


# Stacked leaves up to this size are assembled on the host and placed once; larger ones are
# allocated on their devices and written layer by layer in place (a small compiled update per
# leaf shape: ~0.1 s each, which loading the demo model in ~2 s should not pay ~20 times).
HOST_STACK_MAX_BYTES = 64 << 20


class LayerStacker:
  """Builds the stacked leaves (`params.stack_layers`' layout) from layers' leaves given one at
  a time, in any order: a small stacked leaf is filled on the host and placed once complete; a
  large one is allocated once on its devices and every layer's leaf is written into it in
  place (a donated update), so no second copy of a large stack ever exists on the host or a
  device. `shardings`: {stacked leaf name: Sharding} (absent: the default device)."""

  def __init__(self, cfg: ModelConfig, dtype: Any,
               shardings: dict[str, jax.sharding.Sharding]):
    self.cfg, self.dtype, self.shardings = cfg, dtype, shardings
    self.layout = shape_leaves(cfg)
    self.stacks: dict[str, jax.Array] = {}  # complete (host) or being filled (device)
    self._host: dict[str, tuple[np.ndarray, int]] = {}  # (buffer, layers still missing)

  def add(self, name: str, leaf: np.ndarray | jax.Array) -> tuple[str, jax.Array] | None:
    """Places the per-layer leaf `name`; returns (leaf name, array) when that is not a layer's
    leaf (placed as is), None when it went into a stack (`stacks` has the stacks)."""
    stacked, j = stacked_leaf(self.cfg, name)
    sharding = self.shardings.get(stacked)
    if j is None:
      return stacked, _place_leaf(leaf, sharding)
    key_path, shape = self.layout[stacked]
    dtype = leaf_dtype(key_path, self.dtype)
    on_host = isinstance(leaf, np.ndarray) or leaf.is_fully_addressable
    if on_host and math.prod(shape) * np.dtype(dtype).itemsize <= HOST_STACK_MAX_BYTES:
      buf, missing = self._host.get(stacked) or (np.empty(shape, dtype), shape[0])
      buf[j] = np.asarray(leaf)
      if missing > 1:
        self._host[stacked] = (buf, missing - 1)
      else:
        self._host.pop(stacked, None)
        self.stacks[stacked] = _place(buf, sharding)
      return None
    if stacked not in self.stacks:
      self.stacks[stacked] = _zeros(shape, dtype, sharding)
    self.stacks[stacked] = _set_layer(self.stacks[stacked],
                                      _place_leaf(leaf, layer_sharding(sharding)),
                                      np.int32(j)).block_until_ready()
    return None


def _place_leaf(leaf: np.ndarray | jax.Array, sharding: Any) -> jax.Array:
  if isinstance(leaf, jax.Array) and (sharding is None or leaf.sharding == sharding):
    return leaf
  if isinstance(leaf, jax.Array):
    return jax.device_put(leaf, sharding).block_until_ready()
  return _place(leaf, sharding)


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.Array:
  if sharding is None:
    return jnp.zeros(shape, dtype)
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def layer_sharding(sharding: Any) -> Any:
  """One layer's sharding in a stack's (the layer axis, never split, dropped)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
  return sharding


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack: jax.Array, layer: jax.Array, j: jax.Array) -> jax.Array:
  """stack[j] = layer, in place (the stack is donated)."""
  return jax.lax.dynamic_update_index_in_dim(stack, layer, j, 0)


def load_hf_params(ckpt_dir: str, cfg: ModelConfig | None = None, dtype: Any = jnp.bfloat16,
                   shardings: Any = None, progress: bool = True) -> Params:
  """Loads a safetensors checkpoint directory into the `param_shapes(cfg)` pytree.

  cfg: the parsed config (`checkpoint_config(ckpt_dir)` when None). dtype: the float dtype of
  every leaf except the float32 routing leaves. shardings: optional pytree of
  `jax.sharding.Sharding` matching the params; leaves go to the default device otherwise.
  Raises CheckpointError (names, shapes) before reading any data if the checkpoint does not match.
  """
  ckpt_dir = os.fspath(ckpt_dir)
  cfg = cfg if cfg is not None else checkpoint_config(ckpt_dir)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a float dtype, got {dtype}")
  layout = shape_leaves(cfg, per_layer=True)  # checkpoints name layers one by one
  flat_shardings = shardings_by_leaf(shardings, cfg) if shardings is not None else {}
  stacker = LayerStacker(cfg, dtype, flat_shardings)

  files, weight_map = _checkpoint_files(ckpt_dir)
  raw_cfg = _raw_config(ckpt_dir)
  plan, sources, block = _resolve(cfg, _read_headers(files, weight_map, ckpt_dir), raw_cfg,
                                  ckpt_dir)

  pending = {leaf: 0 for leaf in layout}
  for fills in plan.fills.values():
    for fill in fills:
      if fill.leaf:  # "" only checks (INT4 weight_shape, read by _check_weight_shapes)
        pending[fill.leaf] += 1  # KeyError here means the plan and params.py disagree
  uncovered = [leaf for leaf, n in pending.items() if n == 0]
  assert not uncovered, f"hf_loader has no HF source for {uncovered}"

  by_file: dict[str, list[str]] = {}
  for hf, fills in plan.fills.items():
    if fills[0].leaf:
      by_file.setdefault(sources[hf].file, []).append(hf)
  total = sum(sources[hf].nbytes for names in by_file.values() for hf in names)
  show = progress and (sys.stderr.isatty() or total >= PROGRESS_MIN_BYTES)
  start, done_bytes = time.time(), 0
  bufs: dict[str, np.ndarray] = {}
  placed: dict[str, jax.Array] = {}
  shard_files = [f for f in files if f in by_file]
  for k, path in enumerate(shard_files, 1):
    names = sorted(by_file[path], key=lambda hf: sources[hf].info.begin)
    with SafetensorsFile(path) as f:
      for hf in names:
        src = sources[hf]
        arr = _read(src, f, block)
        for fill in plan.fills[hf]:
          key_path, shape = layout[fill.leaf]
          buf = bufs.get(fill.leaf)
          if buf is None:
            buf = bufs[fill.leaf] = np.empty(shape, leaf_dtype(key_path, dtype))
          buf[fill.index] = fill.fn(arr)  # copies out of the mmap, casting to the leaf dtype
          pending[fill.leaf] -= 1
          if pending[fill.leaf] == 0:
            done = stacker.add(fill.leaf, bufs.pop(fill.leaf))
            if done is not None:
              placed[done[0]] = done[1]
        done_bytes += src.nbytes
        del arr
    if show:
      print(f"hf_loader: shard {k}/{len(shard_files)} {os.path.basename(path)}: "
            f"{done_bytes / 1e9:.2f}/{total / 1e9:.2f} GB read, {time.time() - start:.1f} s",
            file=sys.stderr, flush=True)

  placed.update(stacker.stacks)
  params = jax.tree_util.tree_map_with_path(
      lambda p, _: placed[path_str(p)], param_shapes(cfg), is_leaf=is_shape)
  check_params(cfg, params)
  return params
