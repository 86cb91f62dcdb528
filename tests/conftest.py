import os
import sys

# Compile the tests' programs with LLVM's optimizations off (XLA's own HLO passes still run):
# XLA:CPU compiling is most of this suite's time (a speculative decode loop took ~12 s at the
# default level, ~8 s here; the suite 26 min -> 19 min on 2 cores), and these tiny models do
# not run noticeably slower. Numerics keep IEEE semantics (no fast math either way); what -O0
# exposes is a program relying on what the optimizer happens to do (it found one: expert
# dispatch moved ids as bf16 bits, which a float copy at -O0 flushed as subnormals). Set before
# JAX starts its CPU client; subprocesses inherit it. Benchmarks keep the default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

# Tests run against the source tree (also when the package is installed in editable mode).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import gc
import shutil
import tempfile
import uuid

import pytest

CACHE_ENV = "MOEJAX_COMPILATION_CACHE_DIR"  # engine.runtime.compile_cache.ENV


def pytest_configure(config):
  """One persistent compilation cache per test run, shared by the xdist workers (they inherit
  the controller's environment) and the processes tests start: a program compiled once is
  loaded wherever else it is needed (the demo engine's, for one, in several modules), and
  nothing is written to the user's own cache."""
  if CACHE_ENV not in os.environ:
    path = os.path.join(tempfile.gettempdir(), f"moejax-test-jax-cache-{uuid.uuid4().hex[:12]}")
    os.environ[CACHE_ENV] = config._moejax_cache_dir = path
  # Warm-up compiles one program at a time: the two xdist workers already keep both cores busy,
  # and two compiles at once cost ~25% more CPU each (BENCHMARKS.md, "a cold warm-up in 11
  # programs"). tests/test_warmup_ahead.py asks for threads explicitly.
  os.environ.setdefault("MOEJAX_COMPILE_WORKERS", "1")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
  """The fast tier (`-m "not slow"`) runs a `sweep`'s first case: the cases after it, of a
  parametrized test marked `sweep` (or in a module so marked), are marked `slow`."""
  seen = set()
  for item in items:
    if getattr(item, "callspec", None) is None or item.get_closest_marker("sweep") is None:
      continue
    key = (item.path, item.originalname)
    if key in seen:
      item.add_marker(pytest.mark.slow)
    seen.add(key)


def pytest_unconfigure(config):
  path = getattr(config, "_moejax_cache_dir", None)
  if path:
    shutil.rmtree(path, ignore_errors=True)


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
