import os
import sys

# Tests run against the source tree (also when the package is installed in editable mode).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import gc

import pytest


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
