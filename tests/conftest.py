import os
import sys

# Tests run against the source tree (also when the package is installed in editable mode).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import gc
import shutil
import tempfile

import pytest

_CACHE_ENV = "MOEJAX_TEST_COMPILATION_CACHE"


def pytest_configure(config):
  """One persistent XLA compilation cache for the whole run, shared by the xdist workers (the
  controller makes it before they start; they inherit its path): the same program compiles
  once per run instead of once per worker and again after every module's
  `_release_compiled_programs`. Compiling dominates the suite's time on 2 CPU cores (a
  speculative loop takes ~9 s). Counts of programs obtained (`CompileCounter.count`) include
  programs loaded from it, so "no compilation after warm-up" is checked as before."""
  if not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="moejax-tests-xla-")
    config._moejax_cache_owner = True
  import jax
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if getattr(config, "_moejax_cache_owner", False):
    shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test module. XLA:CPU maps memory for each
  compiled executable; one test module leaves ~15,000 mappings, and a worker that runs many
  modules reached the kernel's vm.max_map_count (65,530): LLVM then fails to allocate and the
  worker aborts inside a compile ("Fatal Python error: Aborted")."""
  yield
  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _forget_loop_rests():
  """Each test starts without `generate_tokens`' rest schedules (`speculative.rest`): process
  state keyed by the model's identity, which another test's call on a shared fixture would set."""
  from engine.runtime.speculative.rest import forget_loop_rests
  forget_loop_rests()
  yield
