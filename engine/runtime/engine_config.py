"""`EngineConfig`: a serving engine's limits, shapes, speculative decoding and warm-up choices
(`engine.py` reads them; `python -m engine.serve` sets them from its flags)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.model import kernels as kernels_lib
from engine.model.kernels import AUTO, KernelChoice
from engine.runtime import compile_cache


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  page_size: int = 16
  num_pages: int | None = None  # default: kv_cache_memory_fraction on GPU, else enough for all
  kv_cache_memory_fraction: float = 0.85  # of the device memory left after the weights
  max_num_seqs: int = 16
  max_num_batched_tokens: int = 256
  max_model_len: int | None = None  # default: min(max_position_embeddings, 4096)
  enable_prefix_cache: bool = True
  row_widths: tuple[int, ...] | None = None  # default: buckets.default_row_widths (CPU: 16)
  # The decode loop's compiled batch sizes, max_num_seqs always among them (vLLM's
  # cuda_graph_sizes). Default: powers of two up to it, or chosen from `traffic_stats_path`.
  decode_batch_sizes: tuple[int, ...] | None = None
  # Most plain decode iterations per device loop (1 disables the loop); a speculative loop gets
  # as much time by the cost model, up to num_draft_tokens + 1 tokens per iteration of it.
  max_decode_steps: int = 16
  # Speculative decoding (`speculative/policy.py`): the drafter of requests that choose none
  # (None: off, a registered drafter's name (`speculative.drafters`): "ngram", "learned",
  # "mtp", "draft" (`Engine(draft=...)`); or "auto"), `drafters`
  # more that they may choose; up to `num_draft_tokens` per iteration, or with `adaptive_k`
  # that or none, every iteration, by the goodput model (costs measured at warmup). A loop gets
  # a budget of at least num_draft_tokens + 1 tokens (max_decode_steps must allow it).
  speculative: str | None = None
  drafters: tuple[str, ...] = ()
  num_draft_tokens: int = 4
  adaptive_k: bool = False
  # Time the speculative cost table at warm-up (`SpecPolicy.measure_costs`); False keeps
  # the roofline: a policy that must not depend on this machine's timings (tests).
  measure_spec_costs: bool = True
  ngram_window: int = 512
  learned_table_slots: int = 1 << 16
  cache_dtype: Any = None  # default: the parameters' dtype
  # JAX's persistent cache (`compile_cache`): restarts load, not recompile ("" or None: off).
  compilation_cache_dir: str | None = dataclasses.field(default_factory=compile_cache.default_dir)
  traffic_stats_path: str | None = None  # histogram read at start (bucket choice), written back
  # "auto" paths resolve when the engine is built (`with_kernels_resolved`): the Mosaic GPU
  # kernels on Hopper where the model's shapes fit them, plain JAX otherwise.
  kernels: KernelChoice = AUTO
  # Image encoder outputs kept for images sent again (`multimodal.EncoderCache`), in bytes.
  encoder_cache_bytes: int = 256 << 20
  # Warm-up also compiles the masked step of constrained rows (structured outputs) at every
  # decode batch size: [B, 1], and [B, num_draft_tokens + 1] with drafters. Off by default: on
  # the 2-core CPU it adds ~25% to warm-up (a serving engine that takes structured outputs
  # should turn it on; otherwise the first constrained request compiles its shape).
  constrained_warmup: bool = False
  # While constrained rows run (one token per engine step, in the masked step), the other rows'
  # decode loop runs at most this many iterations per step, so constrained requests are not
  # starved by long loops (BENCHMARKS.md, "Structured outputs: constrained vs unconstrained").
  constrained_decode_steps: int = 4


def with_kernels_resolved(config: EngineConfig, cfg: Any, params: Any,
                          mesh: Any = None) -> EngineConfig:
  """`config` with its "auto" kernel paths made concrete for the devices holding `params`, the
  model, the cache dtype and the page size (`kernels.resolve`; the result on stderr, once)."""
  if "auto" not in (config.kernels.attention, config.kernels.moe):
    return config
  res = kernels_lib.announce(kernels_lib.resolve_for_params(
      config.kernels, cfg, params, mesh=mesh, cache_dtype=config.cache_dtype,
      page_size=config.page_size))
  return dataclasses.replace(config, kernels=res.choice)
