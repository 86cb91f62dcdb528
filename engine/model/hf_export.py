"""Writes a params pytree as a Hugging Face checkpoint (the inverse of `hf_loader`).

    export_hf(cfg_dict, params, "out/", dtype=ml_dtypes.bfloat16)

HF Linear weights are [out, in]; ours are [in, out] with explicit head axes. The mapping is
written out here independently of `hf_loader`'s plan, so a round trip through both checks it.
Experts are written in the Hub layout by default (one tensor per expert, what
`save_pretrained` writes), DeepSeek MTP layers after the decoder layers with copies of the
shared embedding and head (what vLLM and SGLang expect). The model's stacked layers are written
one by one, under each layer's own name (`params.unstack_layers`). Used by tests and by the demo
model's exporter, so that transformers and other engines run exactly our weights.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from engine.model import vision_checkpoint
from engine.model.params import unstack_layers
from pallas_kernels.quant import Fp8Weight, Int4Weight

# Our attention leaf -> HF module under self_attn.
_ATTN_NAMES = dict(q="q_proj", q_a="q_a_proj", q_b="q_b_proj", kv_a="kv_a_proj_with_mqa",
                   kv_b="kv_b_proj", o="o_proj", k="k_proj", v="v_proj")
_ATTN_NORMS = dict(q_a_norm="q_a_layernorm", kv_a_norm="kv_a_layernorm", q_norm="q_norm",
                   k_norm="k_norm")
EXPERT_LAYOUTS = ("hub", "stacked", "stacked_split")


def _linear(w: np.ndarray, name: str) -> np.ndarray:
  """Our [in, (heads,) out] -> HF [out, in]."""
  if name == "o":  # [nH, d, H] -> [H, nH*d]
    return w.reshape(-1, w.shape[-1]).T
  return w.reshape(w.shape[0], -1).T


def _attn(attn: dict[str, Any], pre: str) -> dict[str, np.ndarray]:
  out = {}
  for name, w in attn.items():
    if name in _ATTN_NAMES and isinstance(w, Fp8Weight):  # FP8 kept: values + block scales
      out[f"{pre}{_ATTN_NAMES[name]}.weight"] = _linear(w.w, name)
      out[f"{pre}{_ATTN_NAMES[name]}.weight_scale_inv"] = w.scale_inv.T
    elif name in _ATTN_NAMES:
      out[f"{pre}{_ATTN_NAMES[name]}.weight"] = _linear(w, name)
    elif name in _ATTN_NORMS:
      out[f"{pre}{_ATTN_NORMS[name]}.weight"] = w
    elif name.endswith("_bias"):
      out[f"{pre}{name[:-len('_bias')]}_proj.bias"] = w.reshape(-1)
    else:
      raise KeyError(f"no HF name for attention leaf {name!r}")
  return out


def _mlp(mlp: dict[str, Any], pre: str) -> dict[str, np.ndarray]:
  out = {}
  for k, w in mlp.items():
    if isinstance(w, Fp8Weight):
      out[f"{pre}{k}_proj.weight"], out[f"{pre}{k}_proj.weight_scale_inv"] = w.w.T, w.scale_inv.T
    else:
      out[f"{pre}{k}_proj.weight"] = w.T
  return out


def _moe(moe: dict[str, Any], pre: str, layout: str) -> dict[str, np.ndarray]:
  out = {f"{pre}gate.weight": moe["router"].T}
  if "router_bias" in moe:
    out[f"{pre}gate.e_score_correction_bias"] = moe["router_bias"]
  ex = moe["experts"]
  if isinstance(ex["gate"], Int4Weight):  # compressed-tensors pack-quantized, per expert
    if layout != "hub":
      raise ValueError("INT4 experts are written in the hub layout only")
    for k in ("gate", "up", "down"):
      w = ex[k]
      for e in range(w.packed.shape[0]):
        name = f"{pre}experts.{e}.{k}_proj."
        # [N, K/2] bytes -> little-endian int32 words [N, K/8]
        out[name + "weight_packed"] = np.ascontiguousarray(w.packed[e]).view("<i4")
        out[name + "weight_scale"] = w.scale[e].T
        out[name + "weight_shape"] = np.array([w.packed.shape[1], 2 * w.packed.shape[2]],
                                              np.int64)  # [out, in], as compressed-tensors
  elif isinstance(ex["gate"], Fp8Weight):  # DeepSeek FP8 blocks, per expert
    if layout != "hub":
      raise ValueError("FP8 experts are written in the hub layout only")
    for k in ("gate", "up", "down"):
      for e in range(ex[k].w.shape[0]):
        out[f"{pre}experts.{e}.{k}_proj.weight"] = ex[k].w[e].T
        out[f"{pre}experts.{e}.{k}_proj.weight_scale_inv"] = ex[k].scale_inv[e].T
  else:
    _moe_float(ex, out, pre, layout)
  if "shared" in moe:
    out.update(_mlp(moe["shared"], f"{pre}shared_experts."))
  return out


def _moe_float(ex: dict[str, Any], out: dict[str, np.ndarray], pre: str, layout: str) -> None:
  hf = {k: np.swapaxes(ex[k], 1, 2) for k in ("gate", "up", "down")}  # [E, out, in]
  if layout == "hub":
    for e in range(hf["gate"].shape[0]):
      for k in ("gate", "up", "down"):
        out[f"{pre}experts.{e}.{k}_proj.weight"] = hf[k][e]
  elif layout == "stacked":  # transformers 5: gate rows first, then up rows
    out[f"{pre}experts.gate_up_proj"] = np.concatenate([hf["gate"], hf["up"]], axis=1)
    out[f"{pre}experts.down_proj"] = hf["down"]
  elif layout == "stacked_split":
    for k in ("gate", "up", "down"):
      out[f"{pre}experts.{k}_proj"] = hf[k]
  else:
    raise ValueError(f"layout must be one of {EXPERT_LAYOUTS}")


def _layer(layer: dict[str, Any], pre: str, layout: str) -> dict[str, np.ndarray]:
  t = {pre + "input_layernorm.weight": layer["input_norm"],
       pre + "post_attention_layernorm.weight": layer["post_attn_norm"]}
  t.update(_attn(layer["attn"], pre + "self_attn."))
  if "moe" in layer:
    t.update(_moe(layer["moe"], pre + "mlp.", layout))
  else:
    t.update(_mlp(layer["mlp"], pre + "mlp."))
  return t


def hf_tensors(cfg_dict: dict[str, Any], params: dict[str, Any], layout: str = "hub",
               dtype: Any = None) -> dict[str, np.ndarray]:
  """{HF tensor name: numpy array} for `params` (cast to `dtype` if given)."""
  p = _to_numpy(params)
  if "stacks" in p:  # the model's layout: its layers stacked per run (`params.py`)
    p = unstack_layers(p)
  t = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
  if "lm_head" in p:
    t["lm_head.weight"] = p["lm_head"].T
  for i, layer in enumerate(p["layers"]):
    t.update(_layer(layer, f"model.layers.{i}.", layout))
  for k, mtp in enumerate(p.get("mtp", [])):
    # DeepSeek stores MTP layers after the decoder layers, with copies of the shared
    # embedding and output head (vLLM and SGLang read them from there).
    pre = f"model.layers.{len(p['layers']) + k}."
    t.update(_layer(mtp, pre, layout))
    t[pre + "enorm.weight"] = mtp["enorm"]
    t[pre + "hnorm.weight"] = mtp["hnorm"]
    t[pre + "eh_proj.weight"] = mtp["eh_proj"].T
    t[pre + "shared_head.norm.weight"] = mtp["final_norm"]
    t[pre + "embed_tokens.weight"] = p["embed"]
    t[pre + "shared_head.head.weight"] = p["lm_head"].T if "lm_head" in p else p["embed"]
  if cfg_dict.get("model_type") == "kimi_k25":
    t = {"language_model." + k: v for k, v in t.items()}
    if "vision" in p:
      patch = int(cfg_dict.get("vision_config", {}).get("patch_size", 14))
      t.update(vision_checkpoint.vision_hf_tensors(p["vision"], patch))
  def cast(name: str, x: np.ndarray) -> np.ndarray:
    # Routers stay float32, as transformers keeps them (`_keep_in_fp32_modules_strict`).
    # INT4 tensors keep their stored types.
    if dtype is None or name.endswith(("mlp.gate.weight", "e_score_correction_bias",
                                       "weight_packed", "weight_scale", "weight_shape",
                                       "weight_scale_inv")) or x.dtype.itemsize == 1:
      return x
    return x.astype(np.dtype(dtype))

  return {k: np.ascontiguousarray(cast(k, v)) for k, v in t.items()}


def _to_numpy(tree: Any) -> Any:
  if isinstance(tree, Int4Weight):
    return Int4Weight(np.asarray(tree.packed), np.asarray(tree.scale))
  if isinstance(tree, Fp8Weight):
    return Fp8Weight(np.asarray(tree.w), np.asarray(tree.scale_inv), tree.block,
                     tree.n_in)
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_to_numpy(v) for v in tree]
  return np.asarray(tree)


def write_checkpoint(cfg_dict: dict[str, Any], tensors: dict[str, np.ndarray], out_dir: str,
                     shards: int = 1, index: bool | None = None) -> list[str]:
  """Writes config.json and `tensors` over `shards` files (+ index when sharded); returns files."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as fh:
    json.dump(cfg_dict, fh, indent=2)
  names = list(tensors)
  index = shards > 1 if index is None else index
  if not index:
    assert shards == 1
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return ["model.safetensors"]
  files, weight_map = [], {}
  per = -(-len(names) // shards)
  for k in range(shards):
    fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
    chunk = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
    save_file(chunk, os.path.join(out_dir, fname))
    weight_map.update({n: fname for n in chunk})
    files.append(fname)
  total = int(sum(v.nbytes for v in tensors.values()))
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
  return files


def export_hf(cfg_dict: dict[str, Any], params: dict[str, Any], out_dir: str,
              layout: str = "hub", shards: int = 1, dtype: Any = None,
              extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
  """Writes `params` as an HF checkpoint (config.json, safetensors, index when shards > 1).

  layout: "hub" (experts.{e}.gate_proj.weight), "stacked" (transformers 5 gate_up_proj
  [E, 2*Im, H] + down_proj [E, H, Im]) or "stacked_split" (gate_proj/up_proj [E, Im, H]).
  dtype: e.g. ml_dtypes.bfloat16 to write bf16 tensors. extra: more tensors to write as is.
  Returns the tensors written.
  """
  tensors = hf_tensors(cfg_dict, params, layout, dtype)
  tensors.update(extra or {})
  write_checkpoint(cfg_dict, tensors, out_dir, shards)
  return tensors
