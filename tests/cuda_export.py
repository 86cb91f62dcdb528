"""Lowering for NVIDIA GPUs on this CPU machine: an abstract H200 mesh and `jax.export` for
"cuda" (Mosaic GPU kernels lower there without a device; shared by the kernel and engine
lowering tests)."""

import contextlib
import re

import jax

H200 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H200", platform="gpu", num_cores=132))
MOSAIC_CALL = "mosaic_gpu_v2"  # the custom-call target jax 0.11.2 emits for Mosaic GPU kernels


def export_cuda_calls(fn, *args, **kwargs) -> list[str]:
  """Custom-call targets of fn(*args, **kwargs) exported for CUDA (args: arrays or
  `jax.ShapeDtypeStruct`s). fn is jitted unless it already is (a jitted fn keeps its static
  arguments)."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  with jax.sharding.use_abstract_mesh(H200):
    exported = jax.export.export(
        jitted, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(MOSAIC_CALL)])(
            *args, **kwargs)
  assert exported.platforms == ("cuda",)
  return re.findall(r"stablehlo.custom_call @([\w.]+)", exported.mlir_module())


@contextlib.contextmanager
def gpu_interpret(detect_races: bool = False):
  """Runs Mosaic GPU kernels on the CPU (under the abstract H200 mesh); fresh buffers are NaN,
  so unwritten outputs show. The interpreter's global state is reset first, in case an earlier
  kernel raised; with `detect_races`, a race fails the test."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels.interpret import gpu_interpret_mode
  interpret_pallas_call.gpu_callbacks.reset_gpu_interpret_mode_state()
  params = plgpu.InterpretGPUParams(detect_races=detect_races, uninitialized_memory="nan")
  with jax.sharding.use_abstract_mesh(H200), gpu_interpret_mode(params):
    yield
  if detect_races:
    assert not interpret_pallas_call.get_races().races_found, "data race in the kernel"
