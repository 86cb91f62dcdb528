"""compressed-tensors INT4 checkpoints: the quantization_config, which modules it quantizes, and
the stored tensors' shapes and layout.

Kimi K2.5 and K2-Thinking ship their routed experts as compressed-tensors "pack-quantized" INT4
(one config group: `weights: {num_bits 4, type int, symmetric, strategy group, group_size 32}`,
targets `Linear`, and an ignore list keeping attention, shared experts, dense MLPs and the head
in bf16). Per quantized [out, in] Linear the checkpoint stores

    X.weight_packed  int32 [out, in/8]   element 8c + j of a row = bits [4j, 4j+4) of word c,
                                         stored as q + 8 (compressed-tensors' `pack_to_int32`)
    X.weight_scale   bf16  [out, in/group]
    X.weight_shape   int32 [2] = [out, in]

and W[o, i] = q[o, i] * scale[o, i // group] (no zero point, no g_idx). The engine keeps them
packed (`pallas_kernels.quant.Int4Weight`): little-endian int32 words viewed as bytes hold
elements 2j (low nibble) and 2j + 1 (high nibble) in byte j, so the load-time repack is a byte
view, [out, in/2], with no transpose (the W4A16 kernel reads K-contiguous weight rows).

FP8 block quantization (DeepSeek-V3 / Kimi-K2-Instruct: F8_E4M3 `X.weight` with a float32
`X.weight_scale_inv` per 128 x 128 block) is dequantized at load (`fp8_block`, `dequant_fp8`).

`parse_quantization_config` validates the config (at the top level or inside `text_config`,
where Kimi K2.5 has it) and refuses every scheme this engine cannot compute from, naming the
field. `module_quantized` applies the targets / ignore lists as compressed-tensors' `is_match`
does (`re:` prefix: `re.match` from the start of the name; else the exact name; `Linear`
names the class of every linear module), to the text model's module names (e.g.
`model.layers.3.mlp.experts.7.up_proj`, `lm_head`: the names the hub's ignore list was
written for), and also to the stored name with Kimi K2.5's `language_model.` prefix.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import numpy as np

from engine.model.safetensors_io import SafetensorsFile

COMPRESSED_TENSORS = "compressed-tensors"
PACKED_SUFFIX, SCALE_SUFFIX, SHAPE_SUFFIX = ".weight_packed", ".weight_scale", ".weight_shape"
# Scales as Kimi's checkpoints store them (the dequant product is taken in this dtype).
SCALE_DTYPES = {"bfloat16": "BF16"}
K25_PREFIX = "language_model."
DEFAULT_FP8_BLOCK = (128, 128)
# Tensor suffixes of quantization formats, by format (decoded only where a config says so).
QUANT_SUFFIXES = {
    ".weight_packed": "compressed-tensors (packed int4/int8)",
    ".weight_scale": "compressed-tensors",
    ".weight_shape": "compressed-tensors",
    ".weight_zero_point": "compressed-tensors",
    ".weight_global_scale": "compressed-tensors (nvfp4)",
    ".input_scale": "static activation quantization",
    ".qweight": "GPTQ/AWQ",
    ".qzeros": "GPTQ/AWQ",
    ".scales": "GPTQ/AWQ",
    ".g_idx": "GPTQ",
}


class QuantizationConfigError(ValueError):
  """A quantization_config this engine cannot serve (the field named)."""


@dataclasses.dataclass(frozen=True)
class Int4Scheme:
  """A compressed-tensors symmetric group-quantized INT4 weight scheme (hashable: it rides on
  the static ModelConfig)."""
  group_size: int
  targets: tuple[str, ...]
  ignore: tuple[str, ...]
  scale_dtype: str = "bfloat16"


def find_quantization_config(d: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
  """(where, quantization_config) from a config.json dict: top level or `text_config`."""
  top = d.get("quantization_config")
  text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
  inner = text.get("quantization_config")
  if top and inner and top != inner:
    raise QuantizationConfigError(
        "config.json: quantization_config and text_config.quantization_config differ; "
        "remove one")
  if top:
    return "quantization_config", top
  if inner:
    return "text_config.quantization_config", inner
  return "quantization_config", None


def parse_quantization_config(d: dict[str, Any]) -> Int4Scheme | None:
  """The INT4 scheme of a compressed-tensors config.json, None when it has none (unquantized
  or FP8, which the loader reads itself). QuantizationConfigError names the field otherwise."""
  where, qc = find_quantization_config(d)
  if qc is not None and not isinstance(qc, dict):
    raise QuantizationConfigError(f"config.json: {where} must be an object")
  if qc is None or qc.get("quant_method") != COMPRESSED_TENSORS:
    return None

  def bad(field: str, value: Any, want: str) -> QuantizationConfigError:
    return QuantizationConfigError(
        f"config.json: {where}.{field} = {value!r} is not supported ({want}); this engine "
        f"computes from compressed-tensors pack-quantized symmetric INT4 group weights only")

  fmt = qc.get("format")
  if fmt != "pack-quantized":
    raise bad("format", fmt, "want 'pack-quantized'")
  for field in ("kv_cache_scheme", "transform_config", "sparsity_config"):
    if qc.get(field):
      raise bad(field, qc[field], "want null")
  groups = qc.get("config_groups")
  if not isinstance(groups, dict) or not groups:
    raise bad("config_groups", groups, "want one group")
  if len(groups) != 1:
    raise bad("config_groups", sorted(groups), "want exactly one group")
  (gname, group), = groups.items()
  if not isinstance(group, dict):
    raise bad(f"config_groups.{gname}", group, "want an object")
  gfmt = group.get("format")
  if gfmt not in (None, "pack-quantized"):
    raise bad(f"config_groups.{gname}.format", gfmt, "want 'pack-quantized'")
  for field in ("input_activations", "output_activations"):
    if group.get(field):
      raise bad(f"config_groups.{gname}.{field}", group[field], "weight-only: want null")
  w = group.get("weights")
  if not isinstance(w, dict):
    raise bad(f"config_groups.{gname}.weights", w, "want an object")
  p = f"config_groups.{gname}.weights."
  checks = (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group"))
  for field, want in checks:
    if w.get(field) != want:
      raise bad(p + field, w.get(field), f"want {want!r}")
  for field in ("actorder", "block_structure", "zp_dtype"):
    if w.get(field) not in (None, False):
      raise bad(p + field, w.get(field), "want null (no activation reordering, g_idx or "
                                         "zero points)")
  if w.get("dynamic") not in (None, False):
    raise bad(p + "dynamic", w.get("dynamic"), "want false")
  gs = w.get("group_size")
  if not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0 or gs % 2:
    raise bad(p + "group_size", gs, "want a positive even integer")
  scale_dtype = w.get("scale_dtype") or "bfloat16"
  scale_dtype = str(scale_dtype).removeprefix("torch.")
  if scale_dtype not in SCALE_DTYPES:
    raise bad(p + "scale_dtype", w.get("scale_dtype"), f"want one of {sorted(SCALE_DTYPES)}")
  targets = group.get("targets")
  if (not isinstance(targets, list) or not targets
      or not all(isinstance(t, str) for t in targets)):
    raise bad(f"config_groups.{gname}.targets", targets, "want a list of names")
  for t in targets:
    if t != "Linear" and not t.startswith("re:") and "." not in t and t != "lm_head":
      raise bad(f"config_groups.{gname}.targets", t, "module classes other than Linear are "
                                                     "not known to this engine")
  ignore = qc.get("ignore") or []
  if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
    raise bad("ignore", ignore, "want a list of names")
  for t in list(targets) + list(ignore):
    if t.startswith("re:"):
      try:
        re.compile(t[3:])
      except re.error as e:
        raise bad("ignore" if t in ignore else f"config_groups.{gname}.targets", t,
                  f"not a valid regular expression: {e}") from None
  return Int4Scheme(group_size=gs, targets=tuple(targets), ignore=tuple(ignore),
                    scale_dtype=scale_dtype)


def _match(name: str, target: str) -> bool:
  if target.startswith("re:"):
    return re.match(target[3:], name) is not None
  return target == name or target == "Linear"


@functools.lru_cache(maxsize=8192)
def module_quantized(scheme: Int4Scheme, module: str) -> bool:
  """Whether the linear module `module` (text-model name, e.g. `model.layers.1.mlp.experts.0.
  gate_proj`) is quantized by `scheme`: matched by a target and by no ignore entry, under its
  own name or Kimi K2.5's prefixed one."""
  names = (module, K25_PREFIX + module)
  targeted = any(_match(n, t) for n in names for t in scheme.targets)
  ignored = any(_match(n, t) for n in names for t in scheme.ignore if t != "Linear") or (
      "Linear" in scheme.ignore)
  return targeted and not ignored


@functools.lru_cache(maxsize=1024)
def layer_experts_int4(scheme: Int4Scheme | None, layer: int, num_experts: int) -> bool:
  """Whether layer `layer`'s routed experts are INT4; all of its 3 E matrices or none."""
  if scheme is None:
    return False
  pre = f"model.layers.{layer}.mlp.experts."
  got = {module_quantized(scheme, f"{pre}{e}.{proj}")
         for e in range(num_experts) for proj in ("gate_proj", "up_proj", "down_proj")}
  if len(got) > 1:
    raise QuantizationConfigError(
        f"config.json: quantization_config quantizes some but not all routed experts of layer "
        f"{layer} (module {pre}*); only whole layers of INT4 experts are supported")
  return got.pop()


def refuse_other_int4(hf_names: Any, scheme: Int4Scheme, shown: Any) -> None:
  """NotImplementedError naming the first linear other than a routed expert that `scheme`
  quantizes (only routed experts are computed from INT4; `shown`: the name as stored)."""
  for hf in hf_names:
    module = hf[:-len(".weight")]
    if (hf.endswith(("_proj.weight", "lm_head.weight", "proj_with_mqa.weight"))
        and ".mlp.experts." not in hf and module_quantized(scheme, module)):
      raise NotImplementedError(
          f"config.json quantization_config quantizes {shown(module)!r} (its targets "
          f"{list(scheme.targets)} match and no ignore entry does): only routed experts "
          f"(mlp.experts.*) are computed from INT4 here")


# ---- the stored tensors ---------------------------------------------------------------------

def stored_shapes(out: int, inp: int, group: int) -> dict[str, tuple[int, ...]]:
  """{suffix: shape} compressed-tensors stores for an [out, in] weight."""
  return {PACKED_SUFFIX: (out, inp // 8), SCALE_SUFFIX: (out, inp // group), SHAPE_SUFFIX: (2,)}


def check_layer_dims(module: str, out: int, inp: int, group: int) -> None:
  if inp % group or inp % 8:
    raise QuantizationConfigError(
        f"module {module!r}: input width {inp} is not a multiple of group_size {group} and of "
        f"8 (an int32 word of nibbles)")


def repack(packed: np.ndarray) -> np.ndarray:
  """Stored int32 [out, in/8] -> uint8 [out, in/2] (byte j of a row: elements 2j, 2j + 1): the
  same bytes, little-endian words viewed as bytes."""
  words = np.ascontiguousarray(packed, dtype="<i4")
  return words.view(np.uint8).reshape(packed.shape[0], -1)


def scale_t(scale: np.ndarray) -> np.ndarray:
  """Stored [out, in/group] -> [in/group, out]."""
  return np.asarray(scale).T


def check_weight_shape(name: str, value: np.ndarray, out: int, inp: int) -> str | None:
  """A problem line when a stored `weight_shape` disagrees with [out, in], else None."""
  v = np.asarray(value).reshape(-1)
  if v.shape != (2,) or v.tolist() != [out, inp]:
    return f"tensor {name!r} is {v.tolist()}, expected [{out}, {inp}] (the weight's [out, in])"
  return None


def plan_int4_experts(add: Any, ex_hf: str, ex: str, num_experts: int, hidden: int, inter: int,
                      scheme: Int4Scheme, same: Any) -> None:
  """The loader's plan entries of one layer's INT4 experts (`hf_mapping.Plan.add`): per expert
  and matrix the packed words and scales into the `Int4Weight` leaves, the weight_shape only
  checked (leaf "")."""
  g = scheme.group_size
  for e in range(num_experts):
    for proj, leaf, (out, inp) in (("gate_proj", "gate", (inter, hidden)),
                                   ("up_proj", "up", (inter, hidden)),
                                   ("down_proj", "down", (hidden, inter))):
      name = f"{ex_hf}{e}.{proj}"
      check_layer_dims(name, out, inp, g)
      shapes = stored_shapes(out, inp, g)
      add(name + PACKED_SUFFIX, f"{ex}{leaf}.packed", shapes[PACKED_SUFFIX], repack, (e,),
          ("I32",))
      add(name + SCALE_SUFFIX, f"{ex}{leaf}.scale", shapes[SCALE_SUFFIX], scale_t, (e,),
          (SCALE_DTYPES[scheme.scale_dtype],))
      add(name + SHAPE_SUFFIX, "", shapes[SHAPE_SUFFIX], same, (), ("I32", "I64"))


def plan_fp8_experts(add: Any, ex_hf: str, ex: str, num_experts: int, hidden: int, inter: int,
                     block: tuple[int, int], t: Any) -> None:
  """The loader's plan entries of one layer's FP8 experts kept quantized: per expert and matrix
  the F8_E4M3 `weight` into the `Fp8Weight`'s `w`, its float32 `weight_scale_inv` into
  `scale_inv`, both transposed from [out, in] to [in, out]."""
  b_out, b_in = block
  for e in range(num_experts):
    for proj, leaf, (out, inp) in (("gate_proj", "gate", (inter, hidden)),
                                   ("up_proj", "up", (inter, hidden)),
                                   ("down_proj", "down", (hidden, inter))):
      name = f"{ex_hf}{e}.{proj}"
      add(name + ".weight", f"{ex}{leaf}.w", (out, inp), t, (e,), ("F8_E4M3",))
      add(name + ".weight_scale_inv", f"{ex}{leaf}.scale_inv",
          (-(-out // b_out), -(-inp // b_in)), t, (e,), ("F32",))


def fp8_experts_block(raw_cfg: dict[str, Any], dtypes: dict[str | None, str],
                      cfg: Any) -> tuple[int, int] | None:
  """The block to keep routed experts FP8 in: config.json says fp8 and every routed expert
  matrix of `cfg` is stored F8_E4M3 with a weight_scale_inv (`dtypes`: {canonical name:
  safetensors dtype}); None otherwise (they are dequantized at load)."""
  text = raw_cfg.get("text_config") if isinstance(raw_cfg.get("text_config"), dict) else {}
  qc = raw_cfg.get("quantization_config") or text.get("quantization_config") or {}
  if qc.get("quant_method") != "fp8":
    return None
  for i in range(len(cfg.moe_layers)):  # MTP layers (after the decoder layers) included
    if not cfg.is_moe_layer(i):
      continue
    for e in range(cfg.num_experts):
      for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.{i}.mlp.experts.{e}.{proj}"
        if dtypes.get(name + ".weight") != "F8_E4M3" or name + ".weight_scale_inv" not in dtypes:
          return None
  return fp8_block(raw_cfg, None)


def check_weight_shapes(where: dict[str, tuple[str, str]], hf_shape: Any) -> list[str]:
  """Problem lines for stored `weight_shape` values ({hf name: (raw name, file)}) that
  disagree with their packed weight's [out, in] (`hf_shape(name)`: the planned shape)."""
  by_file: dict[str, list[str]] = {}
  for hf, (_, path) in where.items():
    by_file.setdefault(path, []).append(hf)
  problems = []
  for path, names in by_file.items():
    with SafetensorsFile(path) as f:
      for hf in names:
        out, words = hf_shape(hf[:-len(SHAPE_SUFFIX)] + PACKED_SUFFIX)
        raw = where[hf][0]
        p = check_weight_shape(raw, f.get(raw), out, words * 8)
        if p:
          problems.append(p)
  return problems


# ---- FP8 block quantization (DeepSeek-V3 / Kimi-K2-Instruct) --------------------------------

def fp8_block(raw_cfg: dict[str, Any], example: str | None,
              int4: bool = False) -> tuple[int, int]:
  """The FP8 block size, or NotImplementedError for any other quantization_config (INT4
  compressed-tensors when the config carries its parsed scheme, `int4`)."""
  text = raw_cfg.get("text_config") if isinstance(raw_cfg.get("text_config"), dict) else {}
  qc = raw_cfg.get("quantization_config") or text.get("quantization_config")
  if not qc:
    return DEFAULT_FP8_BLOCK
  method = qc.get("quant_method")
  if method == COMPRESSED_TENSORS and int4:
    return DEFAULT_FP8_BLOCK
  fmt = qc.get("fmt", qc.get("format"))
  if method == "fp8" and fmt in (None, "e4m3"):
    block = qc.get("weight_block_size") or DEFAULT_FP8_BLOCK
    return int(block[0]), int(block[1])
  hint = f" (e.g. tensor {example!r})" if example else ""
  raise NotImplementedError(
      f"config.json quantization_config quant_method={method!r} format={fmt!r}{hint} is not "
      f"supported: only unquantized and FP8 block-quantized (DeepSeek-V3 style) checkpoints load")


def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """weight * scale per (b0 x b1) block of the last two axes, in float32."""
  out = w.astype(np.float32)
  b0, b1 = block
  cols = out.shape[-1]
  s = np.asarray(scale_inv, np.float32)
  # One block row at a time keeps the extra memory at a row of blocks, not a full-size scale.
  for r in range(s.shape[-2]):
    out[..., r * b0:(r + 1) * b0, :] *= np.repeat(s[..., r, :], b1, axis=-1)[..., None, :cols]
  return out


