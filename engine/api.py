"""The notebook API: `load` a checkpoint, `generate` from prompts.

    import engine
    model = engine.load("path/to/checkpoint")          # Orbax (moejax) or Hugging Face dir
    cfg, params, tokenizer = model                     # plain pieces for direct use
    out = engine.generate(model, "def fib(n):", max_new_tokens=32)
    out.text, out.token_ids, out.finish_reason

The jitted building blocks (`engine.model.transformer.forward_logits`,
`engine.runtime.generate.prefill` / `decode`) take the same params pytree directly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp

import checkpoints
from engine.model.config import ModelConfig, load_config
from engine.model.kernels import KernelChoice, REFERENCE
from engine.model.params import Params, param_shapes
from engine.runtime import compile_cache
from engine.runtime.generate import SpeculativeConfig, bucket, generate_tokens
from engine.runtime.sampling import SamplingParams
# SpeculativeConfig.method "auto" routes through the serving engine, whose drafter it is too.
from engine.runtime.speculative.runtime import AUTO

# The bundled demo model (the `checkpoints` package installs beside `engine`).
DEMO_CHECKPOINT = os.path.join(os.path.dirname(checkpoints.__file__), "demo", "target")
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
  kernels: KernelChoice = REFERENCE
  mesh: Any = None  # the jax.sharding.Mesh the parameters live on (None: one device)

  def __iter__(self) -> Iterator[Any]:
    return iter((self.config, self.params, self.tokenizer))

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
         progress: bool = True, mesh: Any = None) -> LoadedModel:
  """Loads an Orbax (moejax) or Hugging Face safetensors checkpoint directory.

  Args:
    path: checkpoint directory; default: the bundled demo model (`DEMO_CHECKPOINT`,
      checkpoints/demo/target).
    dtype: parameter dtype ("bfloat16", "float32", or a jnp dtype). Default: the Orbax
      checkpoint's stored dtype, bfloat16 for Hugging Face checkpoints.
    shardings: optional pytree of `jax.sharding.Sharding` matching the params.
    mesh: a `jax.sharding.Mesh` or a spec like "expert:8" / "tensor:4,expert:2": every
      parameter is loaded straight into its place by `engine.model.sharding`'s rules (no
      device ever holds the whole model). Mutually exclusive with `shardings`.
  """
  from engine.model import hf_loader, orbax_io  # deferred: heavy imports (orbax)

  path = DEMO_CHECKPOINT if path is None else path
  compile_cache.enable(compile_cache.default_dir())  # before anything compiles
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint directory not found: {path}")
  cfg = load_config(path)
  is_orbax = orbax_io.is_orbax_checkpoint(path)
  if not is_orbax and orbax_io.is_hf_checkpoint(path):
    cfg = hf_loader.checkpoint_config(path, cfg)  # without MTP layers whose weights are absent
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
  tokenizer = load_tokenizer(path)
  return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, path=path,
                     eos_token_ids=_eos_ids(path, cfg, tokenizer), mesh=mesh)


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
             speculative: SpeculativeConfig | None = None
             ) -> GenerationResult | list[GenerationResult]:
  """Generates from one prompt or a batch (text or token ids, mixed lengths allowed).

  `speculative` (e.g. `SpeculativeConfig("mtp", num_draft_tokens=2)`) drafts and verifies
  several tokens per target forward without changing the output distribution. Method "auto"
  runs the batch through the serving `Engine` instead (`generate_on_engine`): every drafter
  the model supports, the drafter and draft length chosen as it goes.

  A single prompt returns one `GenerationResult`, a list returns a list. With an int `seed`,
  row i uses `seed + i`; pass a list to set each row's seed.
  """
  items, single = _as_prompt_list(prompts)
  ids = [model.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in items]
  vocab = model.config.vocab_size
  for i, row in enumerate(ids):
    bad = [t for t in row if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {vocab})")
  seeds = [seed + i for i in range(len(ids))] if isinstance(seed, int) else list(seed)
  sampling = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             seed=s) for s in seeds]
  if speculative is not None and speculative.method == AUTO:
    results = generate_on_engine(
        model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, min_new_tokens=min_new_tokens,
        speculative=speculative)
    return results[0] if single else results
  on_mesh = jax.set_mesh(model.mesh) if model.mesh is not None else contextlib.nullcontext()
  with on_mesh:
    completions = generate_tokens(
        model.params, model.config, ids, max_new_tokens=max_new_tokens, sampling=sampling,
        eos_ids=model.eos_token_ids, stop_token_ids=[list(stop_token_ids)] * len(ids),
        ignore_eos=ignore_eos, min_new_tokens=min_new_tokens, impl=model.kernels,
        speculative=speculative)
  results = [GenerationResult(token_ids=c.token_ids, text=model.decode(c.token_ids),
                              finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                              spec=c.spec)
             for c in completions]
  return results[0] if single else results


def auto_drafters(cfg: ModelConfig, speculative: SpeculativeConfig) -> tuple[str, ...]:
  """Every drafter `cfg` (and the config's draft model, if any) supports, for method "auto"."""
  drafters = ["ngram", "learned"]
  if cfg.num_nextn_predict_layers > 0:
    drafters.append("mtp")
  if speculative.draft_cfg is not None and speculative.draft_params is not None:
    drafters.append("draft")
  return tuple(drafters)


def generate_on_engine(model: LoadedModel, ids: Sequence[Sequence[int]], *,
                       max_new_tokens: int | Sequence[int] = 64,
                       sampling: Sequence[SamplingParams] | None = None,
                       stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                       min_new_tokens: int = 0, speculative: SpeculativeConfig | None = None,
                       measure_costs: bool = True, warmup: bool = False
                       ) -> list[GenerationResult]:
  """Runs token-id prompts to completion through a serving `Engine` sized for the batch.

  The engine is kept for later calls of the same configuration (model, batch size, bucketed
  length, drafters; the KEPT_ENGINES most recently used, as vLLM's `LLM` keeps its engine):
  its KV pages and prefix cache (a later turn's shared context is not computed again), its
  learned table and its adaptive state live on. `release_engines` drops them; an engine whose
  call raised is dropped.

  With `speculative` (method "auto") the engine enables every drafter the model supports
  (`auto_drafters`) with adaptive draft length up to `num_draft_tokens`; each request's drafter
  is "auto" (the engine re-chooses it every decode loop from measured acceptance and costs).
  `speculative.memory` (an `NgramMemory`), when given, is the learned drafter's table: it is
  installed in the engine and replaced by the updated table afterwards, as the fixed path does;
  without one the kept engine's own table goes on learning across calls.
  None: plain decoding on the same path (the baseline the auto mode is timed against).
  `measure_costs`: the adaptive draft length needs the verify forward's and drafters' real
  costs (their defaults suit a memory-bound GPU step; on CPU verifying k tokens costs far more),
  so the first call per (model, engine config) measures them as `Engine.warmup` does (timed
  verify forwards per compiled k, MTP layer, draft model) and later calls reuse them
  (`_MEASURED_COSTS`), with what each call's adaptive policy learned (`SpecRuntime.
  adaptive_state`: the live cost correction, acceptance counts, rest and exploration).
  `warmup`: run the whole `Engine.warmup` (every bucket compiled) first.
  """
  # The serving engine: only for this path.
  from engine.runtime.engine import MAX_STOP_IDS, Engine, EngineConfig
  from engine.runtime.request import StopParams

  cfg, b = model.config, len(ids)
  if b == 0:
    return []
  max_new = ([int(max_new_tokens)] * b if isinstance(max_new_tokens, int)
             else [int(m) for m in max_new_tokens])
  if len(max_new) != b or min(max_new) < 1:
    raise ValueError("max_new_tokens must be >= 1 for every prompt")
  if sampling is None:
    sampling = [SamplingParams()] * b
  total = max(len(p) + m for p, m in zip(ids, max_new))
  if total > cfg.max_position_embeddings:
    raise ValueError(f"prompt + max_new_tokens = {total} exceeds the model's "
                     f"max_position_embeddings ({cfg.max_position_embeddings})")
  drafters: tuple[str, ...] = ()
  k, slots = 4, 1 << 16
  if speculative is not None:
    if speculative.method != AUTO:
      raise ValueError(f"generate_on_engine runs method 'auto' (or None), got "
                       f"{speculative.method!r}")
    if speculative.num_draft_tokens < 1:
      raise ValueError(f"num_draft_tokens must be >= 1, got {speculative.num_draft_tokens}")
    drafters, k = auto_drafters(cfg, speculative), speculative.num_draft_tokens
    if speculative.memory is not None:
      slots = int(speculative.memory.table.tags.shape[0])
  # Bucketed limits: calls of similar sizes reuse the compiled programs (static shapes) and the
  # kept engine. Pages: the batch at full length, as many again for cached prefixes (not the
  # serving default, a fraction of the accelerator's free memory).
  max_len = min(bucket(total + k + 1), cfg.max_position_embeddings)
  page_size = EngineConfig.page_size
  config = EngineConfig(
      max_num_seqs=b, max_model_len=max_len, page_size=page_size,
      num_pages=2 * b * -(-max_len // page_size) + 1,
      max_decode_steps=max(16, k + 1), speculative=AUTO if drafters else None,
      drafters=drafters, num_draft_tokens=k, adaptive_k=bool(drafters),
      learned_table_slots=slots, kernels=model.kernels)
  draft = ((speculative.draft_cfg, speculative.draft_params) if "draft" in drafters else None)
  costs_key = (cfg, config, draft[0] if draft else None, str(model.params["embed"].dtype))
  # (ids of what the engine holds, so they cannot be reused while it is kept)
  engine_key = (costs_key, measure_costs, id(model.params), id(model.tokenizer),
                model.eos_token_ids, id(model.mesh), id(draft[1]) if draft else None)
  eng = _ENGINES.pop(engine_key, None)
  if eng is None:
    eng = Engine(cfg, model.params, config, model.tokenizer, model.eos_token_ids,
                 mesh=model.mesh, draft=draft)
    if drafters and measure_costs and costs_key in _MEASURED_COSTS and not warmup:
      eng.spec.set_adaptive_state(_MEASURED_COSTS[costs_key])
  memory = speculative.memory if speculative is not None else None
  if memory is not None:
    eng.spec.table = _committed_like(memory.table, model.params)
  if warmup:
    eng.warmup()  # compiles every bucket; with drafters, measures the goodput model's costs
  elif drafters and measure_costs and costs_key not in _MEASURED_COSTS:
    # What `Engine.warmup` ends with, without compiling every other bucket first (a one-shot
    # command line would spend minutes on CPU compiling shapes it never uses).
    sizes = (min(eng.buckets.decode), max(eng.buckets.decode))
    on_mesh = jax.set_mesh(model.mesh) if model.mesh is not None else contextlib.nullcontext()
    with on_mesh:
      eng.cache = eng.spec.measure_costs(model.params, eng.cache, sizes, eng.max_pages_per_seq,
                                         stop_width=MAX_STOP_IDS, impl=config.kernels)
  stops = [StopParams(max_tokens=m, min_tokens=min(min_new_tokens, m),
                      stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
           for m in max_new]
  samp = [dataclasses.replace(s, drafter=AUTO if drafters else "off") for s in sampling]
  before = _k_steps(eng.stats()) if drafters else {}
  done = eng.generate([list(p) for p in ids], samp, stops)  # (raises: the engine is dropped)
  _ENGINES[engine_key] = eng  # kept, most recently used last
  while len(_ENGINES) > KEPT_ENGINES:
    _ENGINES.popitem(last=False)
  if drafters and measure_costs:  # with what this call's adaptive policy learned
    _MEASURED_COSTS[costs_key] = eng.spec.adaptive_state()
  if memory is not None:
    memory.table = eng.spec.table
  k_steps = ({n: c - before.get(n, 0) for n, c in _k_steps(eng.stats()).items()} if drafters
             else {})
  return [GenerationResult(token_ids=list(r.output_ids), text=model.decode(r.output_ids),
                           finish_reason=r.finish_reason or "length",
                           prompt_tokens=len(r.prompt_ids),
                           spec=_engine_spec_summary(r, k_steps, drafters, k) if drafters
                           else None)
          for r in done]


# (model config, engine config, draft config, dtype) -> `SpecRuntime.adaptive_state()`: the
# costs measured as `Engine.warmup` does and what the adaptive policy learned since, so that
# repeated `generate` calls measure once per process and go on from the earlier calls (an
# engine built after another was dropped starts from there too).
_MEASURED_COSTS: dict[Any, dict] = {}
# The engines `generate_on_engine` keeps, by configuration and what they hold; most recently
# used last.
KEPT_ENGINES = 2
_ENGINES: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()


def release_engines() -> None:
  """Drops the engines `generate_on_engine` keeps, and with them their caches' memory."""
  _ENGINES.clear()


def reset_prefix_caches() -> None:
  """Every kept engine forgets its cached prefixes (e.g. to time prompts as never seen)."""
  for eng in _ENGINES.values():
    eng.pool.reset_prefix_cache()


def _k_steps(stats: dict[str, Any]) -> dict[int, int]:
  """The engine's loop iterations per block width, from its `stats()`."""
  return {int(n[len("spec_k"):-len("_loops")]): v for n, v in stats.items()
          if n.startswith("spec_k") and n.endswith("_loops")}


def _committed_like(tree: Any, params: Params) -> Any:
  """`tree` committed to the parameters' device when they live on one (as the engine commits
  its own state): an uncommitted table would compile the engine's loop a second time."""
  devices = jax.tree.leaves(params)[0].sharding.device_set
  return jax.device_put(tree, next(iter(devices))) if len(devices) == 1 else tree


def _engine_spec_summary(req: Any, k_steps: dict[int, int], drafters: tuple[str, ...],
                         k: int) -> dict[str, Any]:
  """A request's counters in the keys of `generate.spec_summary`, plus the engine's choices.

  The engine counts drafts, drafted and accepted tokens per request but not target forwards;
  every forward after the first token emits one token plus the drafts it accepted, so
  steps = (tokens - 1) - accepted. `auto_choices`: this request's speculative iterations per
  drafter the engine chose for it; `k_steps` (this call's loop iterations per block width) is
  the whole batch's: rows share a loop.
  """
  drafts, drafted, accepted = req.spec
  emitted = max(len(req.output_ids) - 1, 0)
  steps = max(emitted - accepted, 0)
  return {"steps": steps, "drafts": drafts, "drafted": drafted, "accepted": accepted,
          "acceptance_rate": accepted / drafted if drafted else 0.0,
          "mean_accepted_length": emitted / steps if steps else 0.0,
          "method": AUTO, "drafters": list(drafters),
          "auto_choices": dict(req.drafter_steps),
          "k_steps": k_steps, "num_draft_tokens": k}
