"""Loads an EAGLE-3 head checkpoint (config.json + safetensors, as published) into a params pytree.

    cfg, params = load_eagle3(head_dir, target_cfg, target_params, dtype=jnp.bfloat16)

Tensor names as the heads ship them (vLLM's and SGLang's loaders accept the same): the decoder
layer under `midlayer.` (EAGLE / SpecForge / TorchSpec training, SGLang) or `layers.0.`
(TorchSpec's vLLM export, the speculators format), the rest unprefixed (`fc`, `fc_norm.i`,
`norm`, `lm_head`, `embed_tokens`, `d2t`, `t2d`); a leading `model.` is dropped. One file or
shards with `model.safetensors.index.json`. Every header is checked (names, shapes) before any
data is read; an unknown or missing tensor is an `Eagle3Error` naming it.

The head's params (matrices [in, out], head axes explicit, as `engine.model.params`):

    embed            [V, H]           the head's `embed_tokens`, or the target's own array when it
                                      ships none (not a copy when the dtypes agree)
    fc               [n_aux * Ht, H]
    fc_norm          [n_aux, Ht]      EAGLE-3.1 (`fc_norm: true`)
    input_norm, hidden_norm, post_attn_norm, final_norm   [H]
    attn (MLA)       q_a [2H, q_lora]  q_a_norm [q_lora]  q_b [q_lora, nH, dn+dr]  (or q [2H, nH,
                     dn+dr]);  kv_a [2H, dc+dr]  kv_a_norm [dc]  kv_b [dc, nH, dn+dv]  o [nH, dv, H]
    attn (MHA)       q [2H, nH, hd]  k [2H, nKV, hd]  v [2H, nKV, hd]  o [nH, hd, H]
                     (+ q_bias [nH, hd], k_bias, v_bias [nKV, hd], o_bias [H] with attention_bias)
    mlp              gate [H, I]  up [H, I]  down [I, H]
    lm_head          [H, Vd]          absent when tie_word_embeddings (embed.T); the target's own
                                      array when the head ships none (SGLang's
                                      `load_lm_head_from_target`; full vocabulary only)
    draft_to_target  [Vd] int32       a reduced vocabulary: target id = d + d2t[d] (`t2d`, the
                                      boolean mask of those target ids, is checked, not kept)
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
from engine.model.eagle3_config import Eagle3Config, Eagle3Error, load_eagle3_config
from engine.model.hf_loader import CheckpointError, checkpoint_headers
from engine.model.hf_mapping import Transform, _heads_in, _heads_out, _reshape, _same, _t
from engine.model.params import Params
from engine.model.safetensors_io import FLOAT_DTYPES, SafetensorsFile, TensorInfo

MAX_LISTED = 8
LAYER_PREFIXES = ("midlayer.", "layers.0.")


# name -> (leaf path, HF shape, transform, our shape); "fc_norm.i" fills row i of fc_norm.
Expected = dict[str, tuple[tuple[str, ...], tuple[int, ...], Transform, tuple[int, ...]]]


def _linear(path: tuple[str, ...], out_in: tuple[int, int]):
  """An HF Linear [out, in] kept as [in, out]."""
  return path, out_in, _t, out_in[::-1]


def _vector(path: tuple[str, ...], n: int):
  return path, (n,), _same, (n,)


def _in_heads(path: tuple[str, ...], n: int, d: int, x: int):
  """HF [n*d, x] -> [x, n, d]."""
  return path, (n * d, x), _heads_in(n, d), (x, n, d)


def _out_heads(path: tuple[str, ...], x: int, n: int, d: int):
  """HF o_proj [x, n*d] -> [n, d, x]."""
  return path, (x, n * d), _heads_out(n, d), (n, d, x)


def expected_tensors(cfg: Eagle3Config) -> Expected:
  """The tensors a head checkpoint for `cfg` holds (canonical `midlayer.` names), `embed_tokens`
  and `lm_head` included (both optional at load)."""
  lc = cfg.layer
  H, H2, nH, I = lc.hidden_size, 2 * lc.hidden_size, lc.num_heads, lc.intermediate_size
  e: Expected = {
      "embed_tokens.weight": (("embed",), (cfg.vocab_size, H), _same, (cfg.vocab_size, H)),
      "fc.weight": _linear(("fc",), (H, cfg.num_aux * cfg.target_hidden_size)),
      "norm.weight": _vector(("final_norm",), H),
      "midlayer.input_layernorm.weight": _vector(("input_norm",), H),
      "midlayer.hidden_norm.weight": _vector(("hidden_norm",), H),
      "midlayer.post_attention_layernorm.weight": _vector(("post_attn_norm",), H),
      "midlayer.mlp.gate_proj.weight": _linear(("mlp", "gate"), (I, H)),
      "midlayer.mlp.up_proj.weight": _linear(("mlp", "up"), (I, H)),
      "midlayer.mlp.down_proj.weight": _linear(("mlp", "down"), (H, I)),
  }
  if not cfg.tie_word_embeddings:
    e["lm_head.weight"] = _linear(("lm_head",), (cfg.draft_vocab_size, H))
  if cfg.fc_norm:
    for i in range(cfg.num_aux):
      e[f"fc_norm.{i}.weight"] = _vector(("fc_norm", str(i)), cfg.target_hidden_size)
  a = "midlayer.self_attn."
  if cfg.is_mla:
    dn, dr, dv, dc = lc.qk_nope_head_dim, lc.qk_rope_head_dim, lc.v_head_dim, lc.kv_lora_rank
    if lc.q_lora_rank is None:
      e[a + "q_proj.weight"] = _in_heads(("attn", "q"), nH, dn + dr, H2)
    else:
      ql = lc.q_lora_rank
      e[a + "q_a_proj.weight"] = _linear(("attn", "q_a"), (ql, H2))
      e[a + "q_a_layernorm.weight"] = _vector(("attn", "q_a_norm"), ql)
      e[a + "q_b_proj.weight"] = _in_heads(("attn", "q_b"), nH, dn + dr, ql)
    e[a + "kv_a_proj_with_mqa.weight"] = _linear(("attn", "kv_a"), (dc + dr, H2))
    e[a + "kv_a_layernorm.weight"] = _vector(("attn", "kv_a_norm"), dc)
    e[a + "kv_b_proj.weight"] = _in_heads(("attn", "kv_b"), nH, dn + dv, dc)
    e[a + "o_proj.weight"] = _out_heads(("attn", "o"), H, nH, dv)
  else:
    nKV, hd = lc.num_kv_heads, lc.head_dim
    e[a + "q_proj.weight"] = _in_heads(("attn", "q"), nH, hd, H2)
    e[a + "k_proj.weight"] = _in_heads(("attn", "k"), nKV, hd, H2)
    e[a + "v_proj.weight"] = _in_heads(("attn", "v"), nKV, hd, H2)
    e[a + "o_proj.weight"] = _out_heads(("attn", "o"), H, nH, hd)
    if lc.attention_bias:
      e[a + "q_proj.bias"] = (("attn", "q_bias"), (nH * hd,), _reshape(nH, hd), (nH, hd))
      e[a + "k_proj.bias"] = (("attn", "k_bias"), (nKV * hd,), _reshape(nKV, hd), (nKV, hd))
      e[a + "v_proj.bias"] = (("attn", "v_bias"), (nKV * hd,), _reshape(nKV, hd), (nKV, hd))
      e[a + "o_proj.bias"] = _vector(("attn", "o_bias"), H)
  return e


def abstract_head_params(cfg: Eagle3Config, dtype: Any = jnp.bfloat16) -> Params:
  """The params pytree `load_eagle3` returns for `cfg`, as `jax.ShapeDtypeStruct`s (to lower
  or size a head without weights)."""
  params: Params = {}
  for path, _, _, shape in expected_tensors(cfg).values():
    if path[0] != "fc_norm":
      _set(params, path, jax.ShapeDtypeStruct(shape, dtype))
  if cfg.fc_norm:
    params["fc_norm"] = jax.ShapeDtypeStruct((cfg.num_aux, cfg.target_hidden_size), dtype)
  if cfg.reduced_vocab:
    params["draft_to_target"] = jax.ShapeDtypeStruct((cfg.draft_vocab_size,), jnp.int32)
  return params


def canonical_name(name: str) -> str:
  """A checkpoint name as `expected_tensors` spells it: `model.` dropped, `layers.0.` ->
  `midlayer.` (as SGLang's loader renames it)."""
  if name.startswith("model."):
    name = name[len("model."):]
  if name.startswith("layers.0."):
    name = "midlayer." + name[len("layers.0."):]
  return name


def _headers(head_dir: str) -> dict[str, tuple[str, TensorInfo]]:
  """{canonical name: (file, header entry)} over the head's safetensors files (found and
  checked as a target checkpoint's: `hf_loader.checkpoint_headers`)."""
  try:
    sources = checkpoint_headers(head_dir)
  except CheckpointError as e:
    raise Eagle3Error(f"EAGLE-3 head: {e}") from None
  found: dict[str, tuple[str, TensorInfo]] = {}
  for raw, src in sources.items():
    name = canonical_name(raw)
    if name in found:
      raise Eagle3Error(f"tensor {raw!r} ({name}) appears twice: in "
                        f"{os.path.basename(found[name][0])} and {os.path.basename(src.file)}")
    found[name] = (src.file, src.info)
  return found


def _check(cfg: Eagle3Config, expected: Expected, found: dict[str, tuple[str, TensorInfo]],
           head_dir: str) -> None:
  extra = sorted(n for n in found if n not in expected and n not in ("d2t", "t2d"))
  if extra:
    layers = [n for n in extra if n.startswith("layers.")]
    why = (" (only single-layer heads are supported)" if layers else "")
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: unexpected tensors{why}: "
                      f"{', '.join(extra[:MAX_LISTED])}")
  optional = ("embed_tokens.weight", "lm_head.weight")
  missing = sorted(n for n in expected if n not in found and n not in optional)
  if missing:
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: missing tensors: "
                      f"{', '.join(missing[:MAX_LISTED])} (names may also carry `layers.0.` "
                      f"instead of `midlayer.`)")
  for name, (_, shape, _, _) in expected.items():
    if name in found:
      info = found[name][1]
      if info.shape != shape:
        raise Eagle3Error(f"EAGLE-3 head {head_dir}: tensor {name!r} has shape "
                          f"{list(info.shape)}, expected {list(shape)}")
      if info.dtype not in FLOAT_DTYPES:
        raise Eagle3Error(f"EAGLE-3 head {head_dir}: tensor {name!r} has dtype {info.dtype}, "
                          f"expected a float")
  if cfg.reduced_vocab and "d2t" not in found:
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: draft_vocab_size {cfg.draft_vocab_size} < "
                      f"vocab_size {cfg.vocab_size} but the checkpoint has no 'd2t' tensor")
  for name, shape in (("d2t", (cfg.draft_vocab_size,)), ("t2d", (cfg.vocab_size,))):
    if name in found and found[name][1].shape != shape:
      raise Eagle3Error(f"EAGLE-3 head {head_dir}: tensor {name!r} has shape "
                        f"{list(found[name][1].shape)}, expected {list(shape)}")


def _read(found: dict[str, tuple[str, TensorInfo]], name: str) -> np.ndarray:
  path, info = found[name]
  with SafetensorsFile(path) as f:
    return np.array(f.get(info.name))


def _draft_to_target(cfg: Eagle3Config, d2t: np.ndarray, t2d: np.ndarray | None,
                     head_dir: str) -> np.ndarray:
  """[Vd] int32 target ids from d2t's offsets, checked against t2d when it ships."""
  ids = np.arange(cfg.draft_vocab_size, dtype=np.int64) + d2t.astype(np.int64)
  if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(np.unique(ids)) != len(ids):
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: tensor 'd2t' maps draft ids outside the "
                      f"target vocabulary [0, {cfg.vocab_size}) or two onto one target id")
  if t2d is not None and (int(t2d.astype(bool).sum()) != len(ids) or not t2d[ids].all()):
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: tensors 't2d' and 'd2t' name different "
                      f"target tokens")
  return ids.astype(np.int32)


def _set(params: Params, path: tuple[str, ...], value: Any) -> None:
  node = params
  for k in path[:-1]:
    node = node.setdefault(k, {})
  node[path[-1]] = value


def load_eagle3(head_dir: str, target_cfg: ModelConfig, target_params: Params | None = None,
                dtype: Any = jnp.bfloat16) -> tuple[Eagle3Config, Params]:
  """(config, params) of the head in `head_dir`, checked against the target.

  target_params: the target's pytree; its `embed` (and `lm_head`) serve a head that ships none.
  dtype: the float dtype of every leaf (`draft_to_target` stays int32).
  """
  head_dir = os.fspath(head_dir)
  cfg = load_eagle3_config(head_dir, target_cfg)
  found = _headers(head_dir)
  expected = expected_tensors(cfg)
  _check(cfg, expected, found, head_dir)
  dtype = jnp.dtype(dtype)
  params: Params = {}
  fc_norm_rows: dict[int, np.ndarray] = {}
  for name, (path, _, fn, _) in expected.items():
    if name not in found:
      continue
    arr = fn(_read(found, name)).astype(dtype)
    if path[0] == "fc_norm":
      fc_norm_rows[int(path[1])] = arr
    else:
      _set(params, path, jnp.asarray(arr))
  if cfg.fc_norm:
    params["fc_norm"] = jnp.asarray(np.stack([fc_norm_rows[i] for i in range(cfg.num_aux)]))

  def target_leaf(name: str, what: str) -> Any:
    if target_params is None or name not in target_params:
      raise Eagle3Error(f"EAGLE-3 head {head_dir} ships no {what}; pass the target's params "
                        f"to share the target's")
    return target_params[name]

  if "embed" not in params:
    if cfg.hidden_size != target_cfg.hidden_size:
      raise Eagle3Error(f"EAGLE-3 head {head_dir}: field 'hidden_size' = {cfg.hidden_size} "
                        f"differs from the target's {target_cfg.hidden_size} and the head ships "
                        f"no 'embed_tokens.weight' to use instead of the target's")
    params["embed"] = jnp.asarray(target_leaf("embed", "'embed_tokens.weight'"), dtype)
  if not cfg.tie_word_embeddings and "lm_head" not in params:
    if cfg.reduced_vocab or cfg.hidden_size != target_cfg.hidden_size:
      raise Eagle3Error(f"EAGLE-3 head {head_dir}: missing tensor 'lm_head.weight' (the "
                        f"target's head serves only a full-vocabulary head of its width)")
    if target_cfg.tie_word_embeddings:
      params["lm_head"] = jnp.asarray(target_leaf("embed", "'lm_head.weight'"), dtype).T
    else:
      params["lm_head"] = jnp.asarray(target_leaf("lm_head", "'lm_head.weight'"), dtype)
  if "d2t" in found:
    t2d = _read(found, "t2d") if "t2d" in found else None
    params["draft_to_target"] = jnp.asarray(
        _draft_to_target(cfg, _read(found, "d2t"), t2d, head_dir))
  return cfg, params
