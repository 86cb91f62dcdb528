"""JAX's persistent compilation cache, on by default for every entry point.

A cold start of the demo model compiles for most of a minute on 2 CPU cores; with the cache a
restarted server, or a notebook's new kernel, loads the programs instead. Where it lives:
`$MOEJAX_COMPILATION_CACHE_DIR` if set ("" turns it off), else
`$XDG_CACHE_HOME/moejax/jax_cache` (default `~/.cache/moejax/jax_cache`). The command lines'
`--compilation_cache_dir` sets that variable for their process. `engine.load` and `Engine`
enable it (`EngineConfig.compilation_cache_dir`, default the same directory; "" or None: not
enabled by that engine).
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

ENV = "MOEJAX_COMPILATION_CACHE_DIR"


def user_cache_dir(*parts: str) -> str:
  """`$XDG_CACHE_HOME/moejax/<parts>` (default `~/.cache/moejax/<parts>`): where this project's
  caches and scratch folders go when no flag says otherwise."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "moejax", *parts)


def default_dir() -> str:
  """The cache directory to use when nothing else is said ("" when turned off)."""
  if ENV in os.environ:
    return os.environ[ENV]
  return user_cache_dir("jax_cache")


def enable(path: str | None) -> None:
  """Points JAX's persistent cache at `path` (None or "": leaves it as it is). Every program
  is cached: on the CPU most compile in well under JAX's default one-second threshold."""
  if not path or jax.config.jax_compilation_cache_dir == path:
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  # JAX opens its cache at the first compilation; one compiled before this opens it again.
  jax_compilation_cache.reset_cache()
