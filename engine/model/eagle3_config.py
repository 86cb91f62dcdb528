"""An EAGLE-3 head's `config.json`, read as vLLM and SGLang read it and checked against its target.

Two published families, one decoder layer each (`num_hidden_layers` 1):
* MLA, `Eagle3DeepseekV2ForCausalLM` / `Eagle3DeepseekV3ForCausalLM` (model_type `kimi_k2`,
  `deepseek_v3` or `deepseek_v2`; lightseekorg/kimi-k2.5-eagle3-mla and its K2.6 / EAGLE-3.1
  successors): a DeepSeek-V3 layer with a dense MLP whose `q_a_proj` / `kv_a_proj_with_mqa`
  (or `q_proj`) take 2H inputs. Its latent KV has the target's shape: it lives in the target's
  paged cache as one more layer, so its `kv_lora_rank + qk_rope_head_dim` must be the target's.
* MHA, `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM` (model_type `llama`;
  AQ-MedAI/Kimi-K25-eagle3, lightseekorg/kimi-k2.5-eagle3): a Llama layer whose q / k / v take
  2H inputs; its K / V live in arrays of its own, keyed by the target's page ids.

The layer itself is a `ModelConfig` (`Eagle3Config.layer`) parsed by `config_from_dict` from the
head's own fields, so it carries the head's RoPE / YaRN (`rope_theta`, `rope_scaling`), norm eps
and dimensions, never the target's.

Aux layer ids (`eagle_config.eagle_aux_hidden_state_layer_ids`, or top level as the speculators
format writes it) come in two conventions for the same hidden states (SGLang PR #25454's rule):
a list starting with 1 names layer *outputs* (TorchSpec / SpecForge training configs: 1, 29, 57
for Kimi), anything else layer *inputs* (2, 30, 58). `Eagle3Config.aux_layers` is always the
input convention: the pre-norm residual stream entering target layer i (i = num_layers: after
the last layer, before the final norm). Absent ids default to SGLang's / vLLM's
[2, L // 2, L - 3].
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from engine.model.config import MLA_TYPES, ConfigError, ModelConfig, config_from_dict

MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
MHA_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
AUX_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"
# vLLM's default when a draft config has no max_position_embeddings.
DEFAULT_MAX_POSITIONS = 8192


class Eagle3Error(ValueError):
  """An EAGLE-3 head that cannot be served with this target: the field or tensor named."""


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """Static description of an EAGLE-3 head (hashable: a static argument of jitted functions)."""
  layer: ModelConfig  # the draft decoder layer: attention kind, dims, its own RoPE and eps
  aux_layers: tuple[int, ...]  # residual stream entering these target layers (input convention)
  # As config.json wrote them (the convention aside, the same head: not part of equality).
  aux_ids_in_config: tuple[int, ...] = dataclasses.field(compare=False)
  target_hidden_size: int  # width of each aux state (fc takes num_aux * this)
  vocab_size: int  # the target's vocabulary: embedding rows, draft ids map into it
  draft_vocab_size: int  # lm_head rows; < vocab_size: a reduced vocabulary with d2t
  fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux state before fc
  norm_output: bool = False  # EAGLE-3.1: chained steps take the post-norm output
  norm_before_residual: bool = False  # the residual is hidden_norm(g) instead of g

  @property
  def is_mla(self) -> bool:
    return self.layer.is_mla

  @property
  def hidden_size(self) -> int:
    return self.layer.hidden_size

  @property
  def num_aux(self) -> int:
    return len(self.aux_layers)

  @property
  def reduced_vocab(self) -> bool:
    return self.draft_vocab_size != self.vocab_size

  @property
  def tie_word_embeddings(self) -> bool:
    return self.layer.tie_word_embeddings


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
  """SGLang's / vLLM's default capture (input convention): [2, L // 2, L - 3]."""
  n = num_target_layers
  return (2, n // 2, n - 3)


def resolve_aux_layer_ids(ids: Any, num_target_layers: int, where: str = "config.json"
                          ) -> tuple[int, ...]:
  """The config's aux ids in the input convention (SGLang's rule: a list starting with 1 names
  layer outputs and is shifted by one). Each must lie in [0, num_target_layers]."""
  field = f"{where}: {AUX_IDS_FIELD}"
  if (not isinstance(ids, (list, tuple)) or not ids
      or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
    raise Eagle3Error(f"{field} must be a non-empty list of layer indices, got {ids!r}")
  resolved = tuple(i + 1 for i in ids) if ids[0] == 1 else tuple(ids)
  bad = [i for i in resolved if not 0 <= i <= num_target_layers]
  if bad:
    convention = "outputs of layers" if ids[0] == 1 else "inputs to layers"
    raise Eagle3Error(
        f"{field} = {list(ids)} names {convention} outside the target's {num_target_layers} "
        f"layers (the residual stream entering layer {bad[0]} does not exist)")
  return resolved


def _get(d: dict[str, Any], name: str, default: Any = None) -> Any:
  """A field at the top level or inside `eagle_config` (exporters write either)."""
  eagle = d.get("eagle_config") or {}
  if d.get(name) is not None:
    return d[name]
  return eagle.get(name, default) if isinstance(eagle, dict) else default


def _kind(d: dict[str, Any], where: str) -> str:
  archs = d.get("architectures") or []
  if not isinstance(archs, list):
    raise Eagle3Error(f"{where}: field 'architectures' must be a list, got {archs!r}")
  if any(a in MLA_ARCHITECTURES for a in archs):
    return "mla"
  if any(a in MHA_ARCHITECTURES for a in archs):
    return "mha"
  if not archs and d.get("model_type") in MLA_TYPES:
    return "mla"
  if not archs and d.get("model_type") == "llama":
    return "mha"
  raise Eagle3Error(
      f"{where}: field 'architectures' = {archs!r} is not an EAGLE-3 head this engine runs "
      f"(supported: {', '.join(MLA_ARCHITECTURES + MHA_ARCHITECTURES)})")


def _refuse_unsupported(d: dict[str, Any], where: str) -> None:
  """Fields that change the forward in ways these heads' composition does not have."""
  if int(d.get("num_hidden_layers") or 1) != 1:
    raise Eagle3Error(f"{where}: field 'num_hidden_layers' = {d['num_hidden_layers']}: only "
                      f"single-layer EAGLE-3 heads are supported (as SGLang's MLA head)")
  checks = [("use_aux_hidden_state", False, "a head without aux hidden states is EAGLE-1/2"),
            ("use_input_layernorm_in_first_layer", False, "the head norms its token embedding"),
            ("use_last_layernorm", False, "the head norms its output before lm_head"),
            ("norm_before_fc", True, "gpt-oss-style one norm over the concatenation"),
            ("parallel_drafting", True, "vLLM's parallel-drafting variant"),
            ("mlp_bias", True, "the MLP has no biases")]
  for name, bad, why in checks:
    if _get(d, name) is bad:
      raise Eagle3Error(f"{where}: field {name!r} = {bad} is not supported ({why})")
  if d.get("quantization_config"):
    raise Eagle3Error(f"{where}: field 'quantization_config': quantized heads are not supported "
                      f"(load a float head)")


def _layer_config(d: dict[str, Any], kind: str, where: str) -> ModelConfig:
  """The head's decoder layer as a ModelConfig, from its own fields only."""
  layer = {k: v for k, v in d.items() if k not in ("eagle_config", "quantization_config")}
  layer.update(num_hidden_layers=1, num_nextn_predict_layers=0)
  layer.setdefault("max_position_embeddings", DEFAULT_MAX_POSITIONS)
  if kind == "mla":
    if layer.get("model_type") not in MLA_TYPES or layer["model_type"] == "kimi_k25":
      layer["model_type"] = "deepseek_v3"
    layer["n_routed_experts"] = 0  # always a dense MLP
    layer.setdefault("q_lora_rank", None)  # vLLM: absent means q_proj
  else:
    layer["model_type"] = "llama"
  try:
    return config_from_dict(layer)
  except ConfigError as e:
    msg = str(e)
    raise Eagle3Error(f"{where}: {msg.removeprefix('config.json: ')}") from None


def eagle3_config_from_dict(d: dict[str, Any], target: ModelConfig,
                            where: str = "config.json") -> Eagle3Config:
  """Parses a head's config dict and checks it against the target's config."""
  if not isinstance(d, dict):
    raise Eagle3Error(f"{where}: not a JSON object")
  kind = _kind(d, where)
  _refuse_unsupported(d, where)
  layer = _layer_config(d, kind, where)

  eagle = d.get("eagle_config") or {}
  ids = eagle.get(AUX_IDS_FIELD) if isinstance(eagle, dict) else None
  top = d.get(AUX_IDS_FIELD)
  if ids is not None and top is not None and list(ids) != list(top):
    raise Eagle3Error(f"{where}: eagle_config.{AUX_IDS_FIELD} = {ids} and top-level "
                      f"{AUX_IDS_FIELD} = {top} disagree")
  ids = ids if ids is not None else top
  if ids is None:
    aux = default_aux_layer_ids(target.num_layers)
    ids_in_config: tuple[int, ...] = ()
  else:
    aux = resolve_aux_layer_ids(ids, target.num_layers, where)
    ids_in_config = tuple(ids)
  n_aux = d.get("num_aux_hidden_states")
  if n_aux is not None and int(n_aux) != len(aux):
    raise Eagle3Error(f"{where}: field 'num_aux_hidden_states' = {n_aux} but {AUX_IDS_FIELD} "
                      f"names {len(aux)} layers")

  t_field = "target_hidden_size" if d.get("target_hidden_size") is not None else "hidden_size"
  t_hidden = int(d.get("target_hidden_size") or layer.hidden_size)
  if t_hidden != target.hidden_size:
    raise Eagle3Error(f"{where}: field {t_field!r} = {t_hidden} does not match the target's "
                      f"hidden_size {target.hidden_size} (the head reads its hidden states)")
  if layer.vocab_size != target.vocab_size:
    raise Eagle3Error(f"{where}: field 'vocab_size' = {layer.vocab_size} does not match the "
                      f"target's vocab_size {target.vocab_size}")
  draft_vocab = int(d.get("draft_vocab_size") or layer.vocab_size)
  if not 0 < draft_vocab <= layer.vocab_size:
    raise Eagle3Error(f"{where}: field 'draft_vocab_size' = {draft_vocab} must lie in "
                      f"[1, vocab_size {layer.vocab_size}]")
  if kind == "mla":
    if not target.is_mla:
      raise Eagle3Error(f"{where}: field 'architectures': an MLA head keeps its KV in the "
                        f"target's MLA cache, but the target ({target.model_type}) is not MLA")
    if layer.latent_dim != target.latent_dim:
      raise Eagle3Error(
          f"{where}: fields 'kv_lora_rank' + 'qk_rope_head_dim' = {layer.kv_lora_rank} + "
          f"{layer.qk_rope_head_dim} do not match the target's {target.kv_lora_rank} + "
          f"{target.qk_rope_head_dim} (the head's latent KV is one more layer of the target's "
          f"cache)")
  return Eagle3Config(
      layer=layer, aux_layers=aux, aux_ids_in_config=ids_in_config, target_hidden_size=t_hidden,
      vocab_size=layer.vocab_size, draft_vocab_size=draft_vocab,
      fc_norm=bool(_get(d, "fc_norm", False)), norm_output=bool(_get(d, "norm_output", False)),
      norm_before_residual=bool(_get(d, "norm_before_residual", False)))


def load_eagle3_config(head_dir: str, target: ModelConfig) -> Eagle3Config:
  """Reads `<head_dir>/config.json` (a head checkpoint directory)."""
  head_dir = os.fspath(head_dir)
  if not os.path.isdir(head_dir):
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: not a directory")
  path = os.path.join(head_dir, "config.json")
  if not os.path.isfile(path):
    raise Eagle3Error(f"EAGLE-3 head {head_dir}: no config.json")
  try:
    with open(path) as fh:
      d = json.load(fh)
  except (OSError, json.JSONDecodeError) as e:
    raise Eagle3Error(f"{path}: not valid JSON ({e})") from None
  return eagle3_config_from_dict(d, target, where=path)
