"""Kimi K2.5's vision tensors: hub names <-> the `params["vision"]` leaves (`params.py`).

The hub checkpoint (moonshotai/Kimi-K2.5, the original MoonViT code's names; transformers'
`conversion_mapping.py` "kimi_k25" maps them to its modules):

    vision_tower.patch_embed.proj.{weight [D, 3, p, p], bias}
    vision_tower.patch_embed.pos_emb.weight [Hp, Wp, D]
    vision_tower.encoder.blocks.N.norm0.*      (before attention)   norm1.* (before the MLP)
    vision_tower.encoder.blocks.N.wqkv.{weight [3D, D], bias [3D]}  (q, k, v rows; q and k
        rows of each head in interleaved (complex) pairs: row 2j, 2j+1 = pair j)
    vision_tower.encoder.blocks.N.wo.*  mlp.fc0.* [I, D]  mlp.fc1.* [D, I]
    vision_tower.encoder.final_layernorm.*
    mm_projector.pre_norm.*  mm_projector.proj.0.* [M*D, M*D]  mm_projector.proj.2.* [Ht, M*D]

transformers 5.24's save_pretrained writes the patch embedding as
`vision_tower.encoder.patch_embed.proj.*` (its rename reversed); both spellings load. q and k
are permuted to the rotate-half layout on load (as transformers' `PermuteForRope` does), and
back on export.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from engine.model.config import VisionConfig

PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
SAVED_PATCH_EMBED = "vision_tower.encoder.patch_embed."  # transformers' save_pretrained
HUB_PATCH_EMBED = "vision_tower.patch_embed."


def canonical(name: str) -> str:
  """The hub spelling of a vision tensor name."""
  if name.startswith(SAVED_PATCH_EMBED):
    return HUB_PATCH_EMBED + name[len(SAVED_PATCH_EMBED):]
  return name


def _rope_rows(n: int, d: int) -> Callable[[np.ndarray], np.ndarray]:
  """Per head, interleaved pair rows [(d/2, 2)] -> rotate-half rows [(2, d/2)]: [n*d, ...] ->
  [n, d, ...]."""
  return lambda x: x.reshape(n, d // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(
      n, d, *x.shape[1:])


def plan_vision(add: Callable[..., None], v: VisionConfig) -> None:
  """Adds every vision tensor's fills: add(hf name, leaf path, hf shape, fn(hf array))."""
  D, nH, hd, I, M, Ht = (v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size,
                         v.merge_size, v.text_hidden_size)
  p = v.patch_size
  same = lambda x: x  # noqa: E731
  t = lambda x: x.T  # noqa: E731
  add(HUB_PATCH_EMBED + "proj.weight", "vision.patch_embed", (D, 3, p, p),
      lambda x: x.reshape(D, -1).T)
  add(HUB_PATCH_EMBED + "proj.bias", "vision.patch_bias", (D,), same)
  add(HUB_PATCH_EMBED + "pos_emb.weight", "vision.pos_emb",
      (v.pos_emb_height, v.pos_emb_width, D), same)
  rope, heads = _rope_rows(nH, hd), lambda x: x.reshape(nH, hd, *x.shape[1:])
  for i in range(v.num_layers):
    hf, ours = f"vision_tower.encoder.blocks.{i}.", f"vision.layers.{i}."
    for norm, leaf in (("norm0", "attn_norm"), ("norm1", "mlp_norm")):
      add(hf + norm + ".weight", ours + leaf, (D,), same)
      add(hf + norm + ".bias", ours + leaf + "_bias", (D,), same)
    for j, (name, rows) in enumerate((("q", rope), ("k", rope), ("v", heads))):
      lo, hi = j * D, (j + 1) * D
      add(hf + "wqkv.weight", ours + name, (3 * D, D),
          lambda x, lo=lo, hi=hi, rows=rows: rows(x[lo:hi]).transpose(2, 0, 1))
      add(hf + "wqkv.bias", ours + name + "_bias", (3 * D,),
          lambda x, lo=lo, hi=hi, rows=rows: rows(x[lo:hi]))
    add(hf + "wo.weight", ours + "o", (D, D), lambda x: x.T.reshape(nH, hd, D))
    add(hf + "wo.bias", ours + "o_bias", (D,), same)
    add(hf + "mlp.fc0.weight", ours + "fc1", (I, D), t)
    add(hf + "mlp.fc0.bias", ours + "fc1_bias", (I,), same)
    add(hf + "mlp.fc1.weight", ours + "fc2", (D, I), t)
    add(hf + "mlp.fc1.bias", ours + "fc2_bias", (D,), same)
  add("vision_tower.encoder.final_layernorm.weight", "vision.final_norm", (D,), same)
  add("vision_tower.encoder.final_layernorm.bias", "vision.final_norm_bias", (D,), same)
  add("mm_projector.pre_norm.weight", "vision.proj_norm", (D,), same)
  add("mm_projector.pre_norm.bias", "vision.proj_norm_bias", (D,), same)
  add("mm_projector.proj.0.weight", "vision.proj_in", (M * D, M * D), t)
  add("mm_projector.proj.0.bias", "vision.proj_in_bias", (M * D,), same)
  add("mm_projector.proj.2.weight", "vision.proj_out", (Ht, M * D), t)
  add("mm_projector.proj.2.bias", "vision.proj_out_bias", (Ht,), same)


def _unrope_rows(x: np.ndarray) -> np.ndarray:
  """[n, d, ...] rotate-half rows -> [n*d, ...] interleaved pair rows (the hub's)."""
  n, d = x.shape[:2]
  return x.reshape(n, 2, d // 2, *x.shape[2:]).swapaxes(1, 2).reshape(n * d, *x.shape[2:])


def vision_hf_tensors(vp: dict[str, Any], patch_size: int) -> dict[str, np.ndarray]:
  """{hub name: array} of a numpy `params["vision"]` (the inverse of `plan_vision`)."""
  D = vp["patch_bias"].shape[0]
  out = {HUB_PATCH_EMBED + "proj.weight": vp["patch_embed"].T.reshape(D, 3, patch_size,
                                                                       patch_size),
         HUB_PATCH_EMBED + "proj.bias": vp["patch_bias"],
         HUB_PATCH_EMBED + "pos_emb.weight": vp["pos_emb"]}
  for i, lp in enumerate(vp["layers"]):
    hf = f"vision_tower.encoder.blocks.{i}."
    out[hf + "norm0.weight"], out[hf + "norm0.bias"] = lp["attn_norm"], lp["attn_norm_bias"]
    out[hf + "norm1.weight"], out[hf + "norm1.bias"] = lp["mlp_norm"], lp["mlp_norm_bias"]
    q, k = (_unrope_rows(lp[n].transpose(1, 2, 0)) for n in ("q", "k"))
    v = lp["v"].transpose(1, 2, 0).reshape(D, D)
    out[hf + "wqkv.weight"] = np.concatenate([q, k, v])
    out[hf + "wqkv.bias"] = np.concatenate([_unrope_rows(lp["q_bias"]),
                                            _unrope_rows(lp["k_bias"]), lp["v_bias"].reshape(-1)])
    out[hf + "wo.weight"] = lp["o"].reshape(D, D).T
    out[hf + "wo.bias"] = lp["o_bias"]
    out[hf + "mlp.fc0.weight"], out[hf + "mlp.fc0.bias"] = lp["fc1"].T, lp["fc1_bias"]
    out[hf + "mlp.fc1.weight"], out[hf + "mlp.fc1.bias"] = lp["fc2"].T, lp["fc2_bias"]
  out["vision_tower.encoder.final_layernorm.weight"] = vp["final_norm"]
  out["vision_tower.encoder.final_layernorm.bias"] = vp["final_norm_bias"]
  out["mm_projector.pre_norm.weight"] = vp["proj_norm"]
  out["mm_projector.pre_norm.bias"] = vp["proj_norm_bias"]
  out["mm_projector.proj.0.weight"] = vp["proj_in"].T
  out["mm_projector.proj.0.bias"] = vp["proj_in_bias"]
  out["mm_projector.proj.2.weight"] = vp["proj_out"].T
  out["mm_projector.proj.2.bias"] = vp["proj_out_bias"]
  return out
