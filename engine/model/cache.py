"""The paged KV cache layout: one page pool per layer, shared by all sequences.

Per layer the cache is a dict of page arrays:
* MLA: {"latent": [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]} (576 wide for V3);
* GQA: {"k": [num_pages, page_size, nKV, hd], "v": [num_pages, page_size, nKV, hd]}.

A sequence owns the pages named by its row of a page table; the forward pass reads and writes
only through that table. The foundation's generate gives each row a contiguous run of pages; the
serving runtime hands pages out from a free list with the same layout.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig

Cache = list[dict[str, jax.Array]]


def page_shapes(cfg: ModelConfig, num_pages: int, page_size: int) -> dict[str, tuple[int, ...]]:
  """Shapes of one layer's page arrays."""
  if cfg.is_mla:
    return {"latent": (num_pages, page_size, cfg.latent_dim)}
  kv = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
  return {"k": kv, "v": kv}


# A drafter's own entries after the model's (an EAGLE-3 head's KV): per entry, each page
# array's shape per token, e.g. ({"latent": (576,)},) or ({"k": (nKV, hd), "v": (nKV, hd)},).
Extra = tuple[dict[str, tuple[int, ...]], ...]


def first_extra_entry(cfg: ModelConfig) -> int:
  """The index of the first cache entry after the model's own (decoder and MTP layers)."""
  return cfg.num_layers + cfg.num_nextn_predict_layers


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any = jnp.bfloat16,
               sharding: Any = None, extra: Extra = ()) -> Cache:
  """Allocates a zeroed page pool for every layer, MTP layers included (they come last), then
  the `extra` entries (drafters' own, `first_extra_entry` on) with the same pages."""
  shapes = page_shapes(cfg, num_pages, page_size)

  def zeros(shape):
    if sharding is None:
      return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

  n = cfg.num_layers + cfg.num_nextn_predict_layers
  own = [{k: zeros(s) for k, s in shapes.items()} for _ in range(n)]
  return own + [{k: zeros((num_pages, page_size) + s) for k, s in e.items()} for e in extra]


def cache_bytes_per_token(cfg: ModelConfig, dtype: Any = jnp.bfloat16, extra: Extra = ()
                          ) -> int:
  """Bytes of cache one token occupies across all layers (and the `extra` entries)."""
  per_layer = sum(math.prod(s[2:]) for s in page_shapes(cfg, 1, 1).values())
  n = cfg.num_layers + cfg.num_nextn_predict_layers
  own = sum(math.prod(s) for e in extra for s in e.values())
  return (per_layer * n + own) * jnp.dtype(dtype).itemsize


def contiguous_page_table(batch: int, max_len: int, page_size: int) -> np.ndarray:
  """[batch, ceil(max_len / page_size)] table giving row b the pages b*n .. b*n + n - 1."""
  n = -(-max_len // page_size)
  return np.arange(batch * n, dtype=np.int32).reshape(batch, n)


def clear_page(cache: Cache, page: int) -> Cache:
  """The cache with every layer's entries of `page` zeroed (page 0, the null page, after
  programs that wrote junk there)."""
  return [{k: v.at[page].set(0) for k, v in layer.items()} for layer in cache]
