"""The paged KV cache layout: one page pool per layer, shared by all sequences, the layers of a
stack in one array.

A layer's pool is a dict of page arrays:
* MLA: {"latent": [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]} (576 wide for V3);
* GQA: {"k": [num_pages, page_size, nKV, hd], "v": [num_pages, page_size, nKV, hd]}.

The cache is a list with one entry per stack of decoder layers (`cfg.layer_stacks`), then one
per MTP layer. A stack's entry holds its layers' pools end to end, [layers * num_pages,
page_size, ...]: layer j of the stack owns pages j * num_pages .. (j + 1) * num_pages - 1, and
reads and writes them through the page table shifted by j * num_pages (`layer_table`). So the
scanned forward updates a stack's pages in place in its carry, layer after layer, and no layer's
pages are ever sliced out, copied or reshaped; an MTP layer's entry is one layer's pool, as
before the stacking. Every entry has a pool's rank and sharding (`sharding.cache_sharding`).

A sequence owns the pages named by its row of a page table (the same page ids in every layer);
the forward pass reads and writes only through that table. The foundation's generate gives each
row a contiguous run of pages; the serving runtime hands pages out from a free list with the
same layout.
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


def entry_layers(cfg: ModelConfig) -> list[int]:
  """The number of layers in each cache entry: the decoder stacks', then 1 per MTP layer."""
  return ([stop - start for start, stop in cfg.layer_stacks]
          + [1] * cfg.num_nextn_predict_layers)


def mtp_entry(cfg: ModelConfig, depth: int) -> int:
  """The cache entry of MTP layer `depth` (after the decoder stacks')."""
  return len(cfg.layer_stacks) + depth


# A drafter's own entries after the model's (an EAGLE-3 head's KV): per entry, each page
# array's shape per token, e.g. ({"latent": (576,)},) or ({"k": (nKV, hd), "v": (nKV, hd)},).
Extra = tuple[dict[str, tuple[int, ...]], ...]


def first_extra_entry(cfg: ModelConfig) -> int:
  """The index of the first cache entry after the model's own (decoder stacks, MTP layers)."""
  return len(entry_layers(cfg))


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any = jnp.bfloat16,
               sharding: Any = None, extra: Extra = ()) -> Cache:
  """Allocates a zeroed page pool of `num_pages` pages for every layer, the layers of a stack
  end to end (see the module docstring), MTP layers last, then the `extra` entries (drafters'
  own, one layer each, `first_extra_entry` on) with the same pages. `sharding`: one for
  every array."""

  def zeros(layers: int, shape: tuple[int, ...]) -> jax.Array:
    shape = (layers * shape[0],) + shape[1:]
    if sharding is None:
      return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

  shapes = page_shapes(cfg, num_pages, page_size)
  own = [{k: zeros(n, s) for k, s in shapes.items()} for n in entry_layers(cfg)]
  return own + [{k: zeros(1, (num_pages, page_size) + s) for k, s in e.items()} for e in extra]


def layer_table(page_table: jax.Array, j: Any, num_pages: int) -> jax.Array:
  """The page table through which layer j of a stack (of `num_pages` pages per layer) reads
  and writes the stack's entry."""
  return page_table + jnp.asarray(j, page_table.dtype) * num_pages


def layer_pages(entry: dict[str, jax.Array], layers: int, j: int) -> dict[str, jax.Array]:
  """Layer j's pool of a stack's entry of `layers` layers (a copy: for tests and tools)."""
  n = next(iter(entry.values())).shape[0] // layers
  return {k: v[j * n:(j + 1) * n] for k, v in entry.items()}


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


def clear_page(cache: Cache, page: int, cfg: ModelConfig) -> Cache:
  """The cache with every layer's entries of `page` zeroed (page 0, the null page, after
  programs that wrote junk there): in a stack's entry, `page` of each of its layers; the
  drafters' entries after the model's too."""

  def clear(v: jax.Array, layers: int) -> jax.Array:
    n = v.shape[0] // layers
    return v.at[page + n * np.arange(layers)].set(0)

  layers = entry_layers(cfg)
  layers += [1] * (len(cache) - len(layers))  # (drafters' own entries: one layer each)
  return [{k: clear(v, n) for k, v in entry.items()}
          for entry, n in zip(cache, layers, strict=True)]
