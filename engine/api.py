"""The notebook API: `load` a checkpoint, `generate` from prompts.

    import engine
    model = engine.load("path/to/checkpoint")          # Orbax (moejax) or Hugging Face dir
    cfg, params, tokenizer = model                     # plain pieces for direct use
    out = engine.generate(model, "def fib(n):", max_new_tokens=32)
    out.text, out.token_ids, out.finish_reason

`generate` adds the prompts as requests to an engine the model owns (`model.llm`, an
`engine.runtime.llm.LLM`: nano-vllm's object over its engine), run together until done; the
engine and its compiled programs serve later calls of the same shape. The jitted building
blocks (`engine.model.transformer.forward_logits`, `engine.runtime.steps.model_step` /
`decode_loop`) take the same params pytree directly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterator, Sequence

import jax.numpy as jnp

import checkpoints
from engine.chat.template import ChatTemplate
from engine.model.config import ModelConfig, load_config
from engine.model import kernels as kernels_lib
from engine.model.kernels import AUTO, KernelChoice
from engine.model.params import Params, param_shapes
from engine.runtime import compile_cache
from engine.runtime.grammar import StructuredOutputsParams
from engine.runtime.llm import LLM, SpeculativeConfig
from engine.runtime.sampling import SamplingParams

# The bundled demo model (the `checkpoints` package installs beside `engine`).
DEMO_CHECKPOINT = os.path.join(os.path.dirname(checkpoints.__file__), "demo", "target")
# The demo target's EAGLE-3 head (the default of --eagle3_checkpoint with the demo target).
DEMO_EAGLE3 = os.path.join(os.path.dirname(checkpoints.__file__), "demo", "eagle3")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
  """A loaded checkpoint. Unpacks as `cfg, params, tokenizer = model`."""
  config: ModelConfig
  params: Params
  # tokenizers.Tokenizer (tokenizer.json), TiktokenTokenizer (tiktoken.model), or None.
  tokenizer: Any
  path: str = ""
  eos_token_ids: tuple[int, ...] = ()
  # The kernels asked for (`load(kernels=...)`); "auto" paths resolve per use: the Mosaic GPU
  # kernels on Hopper where the model fits them (`resolved_kernels`).
  kernels: KernelChoice = AUTO
  mesh: Any = None  # the jax.sharding.Mesh the parameters live on (None: one device)
  # The checkpoint's chat template (engine.chat.template), None if it ships none.
  chat_template: ChatTemplate | None = None
  _llm: LLM | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def resolved_kernels(self, page_size: int = 16) -> KernelChoice:
    """`kernels` with "auto" made concrete for this model, its devices and `page_size` (the
    result announced on stderr once: `kernels.announce`)."""
    return kernels_lib.announce(kernels_lib.resolve_for_params(
        self.kernels, self.config, self.params, mesh=self.mesh, page_size=page_size)).choice

  def __iter__(self) -> Iterator[Any]:
    return iter((self.config, self.params, self.tokenizer))

  @property
  def llm(self) -> LLM:
    """The model's generate path and the engines it keeps (`engine.generate` runs on it;
    `model.llm.release()` frees them)."""
    if self._llm is None:
      self._llm = LLM(self)
    return self._llm

  def encode(self, text: str) -> list[int]:
    if self.tokenizer is None:
      raise ValueError(f"checkpoint {self.path!r} has no tokenizer (tokenizer.json or "
                       f"tiktoken.model): pass token ids")
    return list(self.tokenizer.encode(text).ids)

  def decode(self, ids: Sequence[int]) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclasses.dataclass
class GenerationResult:
  token_ids: list[int]  # generated tokens only (a final EOS/stop token is included)
  text: str
  finish_reason: str  # "stop" or "length"
  prompt_tokens: int
  spec: dict | None = None  # speculative decoding counters (drafted, accepted, ...) if used


def eagle3_checkpoint(method: str, flag: str | None, target: str) -> str | None:
  """The EAGLE-3 head directory the command lines use for drafter `method`: `flag`
  (--eagle3_checkpoint), else the demo target's own head when it is there; ValueError naming
  the flag when "eagle3" needs one and none is given ("auto" then goes without). None for
  methods that use no head."""
  from engine.runtime.speculative import drafters
  auto = method == drafters.AUTO
  if not auto and not drafters.drafter_class(method).uses_head:
    return None
  path = flag
  if path is None and os.path.abspath(target) == os.path.abspath(DEMO_CHECKPOINT) and (
      os.path.isdir(DEMO_EAGLE3)):
    path = DEMO_EAGLE3
  if path is None and not auto:
    raise ValueError(f"--speculative={method} needs --eagle3_checkpoint")
  return path


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path) as fh:
    return json.load(fh)


def _eos_ids(path: str, cfg: ModelConfig, tokenizer: Any = None) -> tuple[int, ...]:
  """EOS ids from generation_config.json when present (it may list several), else config;
  then a tiktoken tokenizer's (Kimi: [EOS] and <|im_end|>, which its files name apart)."""
  gen = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
  ids = cfg.eos_token_ids if gen is None else tuple(
      int(x) for x in (gen if isinstance(gen, list) else [gen]))
  return tuple(dict.fromkeys(ids + tuple(getattr(tokenizer, "eos_token_ids", ()))))


def load_tokenizer(path: str) -> Any:
  """`tokenizer.json` as a `tokenizers.Tokenizer`, else `tiktoken.model` (with
  tokenizer_config.json's special tokens) as a `TiktokenTokenizer`, else None."""
  tok_path = os.path.join(path, "tokenizer.json")
  if os.path.exists(tok_path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(tok_path)
  from engine.model import tiktoken_tokenizer
  if os.path.exists(os.path.join(path, tiktoken_tokenizer.RANKS_FILE)):
    return tiktoken_tokenizer.TiktokenTokenizer.from_dir(path)
  return None


def load(path: str | None = None, dtype: str | Any | None = None, shardings: Any = None,
         progress: bool = True, mesh: Any = None,
         kernels: KernelChoice | str = AUTO) -> LoadedModel:
  """Loads an Orbax (moejax) or Hugging Face safetensors checkpoint directory.

  Args:
    path: checkpoint directory; default: the bundled demo model (`DEMO_CHECKPOINT`,
      checkpoints/demo/target).
    dtype: parameter dtype ("bfloat16", "float32", or a jnp dtype). Default: the Orbax
      checkpoint's stored dtype, bfloat16 for Hugging Face checkpoints, whose FP8 block-quantized
      routed experts then stay FP8 on the device (any explicit dtype dequantizes them at load);
      INT4 experts always stay packed.
    shardings: optional pytree of `jax.sharding.Sharding` matching the params.
    mesh: a `jax.sharding.Mesh` or a spec like "expert:8" / "tensor:4,expert:2": every
      parameter is loaded straight into its place by `engine.model.sharding`'s rules (no
      device ever holds the whole model). Mutually exclusive with `shardings`.
    kernels: the hot paths' implementations, a `KernelChoice` or one name for both
      ("auto": the Mosaic GPU kernels on a Hopper GPU where the model's shapes fit them, plain
      JAX otherwise; "reference"; "mosaic_gpu"). Resolved here once; the result is one line
      on stderr (`kernels: attention=... moe=... (reasons)`).
  """
  from engine.model import hf_loader, orbax_io  # deferred: heavy imports (orbax)

  path = DEMO_CHECKPOINT if path is None else path
  compile_cache.enable(compile_cache.default_dir())  # before anything compiles
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint directory not found: {path}")
  cfg = load_config(path)
  is_orbax = orbax_io.is_orbax_checkpoint(path)
  if not is_orbax and orbax_io.is_hf_checkpoint(path):
    # Without MTP layers whose weights are absent; FP8 experts kept quantized unless a dtype
    # asks for them dequantized at load.
    cfg = hf_loader.checkpoint_config(path, cfg, keep_fp8=dtype is None)
  if mesh is not None:
    from engine.model import sharding
    if shardings is not None:
      raise ValueError("pass either mesh or shardings, not both")
    mesh = sharding.make_mesh(mesh) if isinstance(mesh, str) else mesh
    shardings = sharding.param_shardings(cfg, param_shapes(cfg), mesh)
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dtype = DTYPES[dtype]
  if is_orbax:
    params = orbax_io.restore_orbax(path, cfg, shardings=shardings, dtype=dtype)
  elif orbax_io.is_hf_checkpoint(path):
    params = hf_loader.load_hf_params(path, cfg, dtype=dtype or jnp.bfloat16,
                                      shardings=shardings, progress=progress)
  else:
    raise ValueError(f"{path} is neither a moejax Orbax checkpoint (moejax.json) nor a Hugging "
                     "Face checkpoint (model.safetensors or model.safetensors.index.json)")
  from engine.model import sharding as sharding_lib
  for line in sharding_lib.format_param_bytes(sharding_lib.param_bytes_by_kind(params)):
    logging.getLogger("moejax").info("engine.load: parameters on %s", line)
  tokenizer = load_tokenizer(path)
  model = LoadedModel(config=cfg, params=params, tokenizer=tokenizer, path=path,
                      eos_token_ids=_eos_ids(path, cfg, tokenizer), mesh=mesh,
                      kernels=KernelChoice(attention=kernels, moe=kernels)
                      if isinstance(kernels, str) else kernels,
                      chat_template=ChatTemplate.from_dir(path))
  model.resolved_kernels()  # at the engines' default page size: the stderr line, once
  return model


def _as_prompt_list(prompts: Any) -> tuple[list[Any], bool]:
  """Returns (list of prompts, whether a single prompt was given)."""
  if isinstance(prompts, str):
    return [prompts], True
  if isinstance(prompts, (list, tuple)) and prompts and all(
      isinstance(x, int) for x in prompts):
    return [list(prompts)], True
  if isinstance(prompts, (list, tuple)) and prompts:
    return list(prompts), False
  raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")


def generate(model: LoadedModel, prompts: Any, *, max_new_tokens: int | Sequence[int] = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | Sequence[int] = 0, stop_token_ids: Sequence[int] = (),
             ignore_eos: bool = False, min_new_tokens: int = 0,
             speculative: SpeculativeConfig | None = None,
             structured_outputs: StructuredOutputsParams | Sequence[StructuredOutputsParams
                                                                    | None] | None = None,
             warmup: bool = False) -> GenerationResult | list[GenerationResult]:
  """Generates from one prompt or a batch (text or token ids, mixed lengths allowed), as
  requests added together to the model's engine for a batch of this shape (`model.llm`).

  `speculative` (e.g. `SpeculativeConfig("ngram", num_draft_tokens=4)`, or "auto": every
  drafter the model supports, chosen per row as it goes) drafts and verifies several tokens
  per target forward without changing the output distribution.

  `structured_outputs` (`StructuredOutputsParams(json=schema_text)`, regex=, choice=,
  grammar=, json_object=True; one for every prompt or a list with one per prompt, None for
  unconstrained ones) constrains the output to it (`engine/runtime/grammar.py`: compiled once
  per tokenizer and spec, GrammarError with the reason); constrained rows take the engine's
  masked step (`engine/runtime/structured.py`).

  A single prompt returns one `GenerationResult`, a list returns a list. With an int `seed`,
  row i uses `seed + i`; pass a list to set each row's seed. `warmup`: a new engine compiles
  every bucket first (`Engine.warmup`).
  """
  items, single = _as_prompt_list(prompts)
  ids = [model.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in items]
  vocab = model.config.vocab_size
  for i, row in enumerate(ids):
    if not row:
      raise ValueError(f"prompt {i}: must contain at least one token")
    bad = [t for t in row if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {vocab})")
  b = len(ids)
  seeds = [seed + i for i in range(b)] if isinstance(seed, int) else list(seed)
  if structured_outputs is None or isinstance(structured_outputs, StructuredOutputsParams):
    constraints = [structured_outputs] * b
  else:
    constraints = list(structured_outputs)
    if len(constraints) != b:
      raise ValueError(f"structured_outputs: {len(constraints)} given for {b} prompts")
  if len(seeds) != b:
    raise ValueError(f"seed: {len(seeds)} given for {b} prompts")
  sampling = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             seed=s, structured_outputs=c) for s, c in zip(seeds, constraints)]
  for s in sampling:
    s.validate()
  max_new = ([int(max_new_tokens)] * b if isinstance(max_new_tokens, int)
             else [int(m) for m in max_new_tokens])
  if len(max_new) != b or min(max_new) < 1:
    raise ValueError("max_new_tokens must be >= 1 for every prompt")
  total = max(len(p) + m for p, m in zip(ids, max_new))
  if total > model.config.max_position_embeddings:
    raise ValueError(f"prompt + max_new_tokens = {total} exceeds the model's "
                     f"max_position_embeddings ({model.config.max_position_embeddings})")
  completions = model.llm.generate(
      ids, max_new_tokens=max_new, sampling=sampling, stop_token_ids=[list(stop_token_ids)] * b,
      ignore_eos=ignore_eos, min_new_tokens=min_new_tokens, speculative=speculative,
      warmup=warmup)
  results = [GenerationResult(token_ids=c.token_ids, text=model.decode(c.token_ids),
                              finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                              spec=c.spec)
             for c in completions]
  return results[0] if single else results
