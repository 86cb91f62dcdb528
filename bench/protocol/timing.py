"""Timing, random inputs and CUDA lowering shared by the protocol's JAX stages.

Times (GPU): each kernel's own duration from CUPTI (the activity API jax's
`mosaic.gpu.profiler.measure` uses, called directly so that a run may rotate its arguments or
donate its buffers between iterations) and the wall time of back-to-back calls. Off a GPU,
wall time only. Random integer weights are random bits (every value equally likely).
"""

from __future__ import annotations

import contextlib
import functools
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.protocol.rows import dry_run

# The abstract device the dry run lowers for (and runs Mosaic GPU's interpreter under).
H200 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H200", platform="gpu", num_cores=132))
MOSAIC_CALL = "mosaic_gpu_v2"  # the custom-call target jax 0.11.2 emits for Mosaic GPU kernels


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def labels() -> dict[str, Any]:
  """The labels every row of a JAX stage carries."""
  import jaxlib
  return dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, jaxlib=jaxlib.__version__)


# ---- time ------------------------------------------------------------------------------------

def _cupti():
  """jaxlib's CUPTI hooks, or None (no GPU plugin)."""
  if not on_gpu():
    return None
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    return mosaic_gpu_lib._mosaic_gpu_ext
  except (ImportError, AttributeError):
    return None


def kernel_times(run: Callable[[int], Any], iterations: int) -> list[list[tuple[str, float]]] | None:
  """Per iteration, [(kernel name, microseconds)] of the kernels `run(i)` launched (CUPTI;
  run(i) is called once untimed first). None where CUPTI is unavailable (not a GPU)."""
  ext = _cupti()
  if ext is None:
    return None
  jax.block_until_ready(run(0))
  ext._cupti_init()
  try:
    for i in range(iterations):
      jax.block_until_ready(run(i))
  finally:
    timings = ext._cupti_get_timings(True)
  if not timings or len(timings) % iterations:
    return None
  n = len(timings) // iterations
  return [[(name, ms * 1e3) for name, ms in timings[i * n:(i + 1) * n]] for i in range(iterations)]


def wall_us(run: Callable[[int], Any], iterations: int, reps: int) -> float:
  """Median over `iterations` samples of the wall time per call of `reps` calls queued back
  to back (host dispatch overlapping device work), in microseconds."""
  jax.block_until_ready(run(0))
  samples, i = [], 0
  for _ in range(iterations):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = run(i)
      i += 1
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / reps * 1e6)
  return statistics.median(samples)


def summarize_kernels(per_iter: list[list[tuple[str, float]]] | None,
                      keep: Callable[[str], bool] = lambda name: True) -> dict[str, Any]:
  """{"kernel_us": median over iterations of the summed kernels that `keep`, "kernels": [[name,
  median us, launches]] by time, all kernels}: an empty dict without CUPTI."""
  if not per_iter:
    return {}
  totals = [sum(us for name, us in it if keep(name)) for it in per_iter]
  by_name: dict[str, list[float]] = {}
  for it in per_iter:
    seen: dict[str, float] = {}
    for name, us in it:
      seen[name] = seen.get(name, 0.0) + us
    for name, us in seen.items():
      by_name.setdefault(name, []).append(us)
  launches = {name: sum(1 for n, _ in per_iter[0] if n == name) for name in by_name}
  kernels = sorted(([short_name(n), statistics.median(v), launches[n]] for n, v in by_name.items()),
                   key=lambda k: -k[1])
  return dict(kernel_us=statistics.median(totals), kernels=kernels)


def short_name(name: str) -> str:
  return name if len(name) <= 80 else name[:77] + "..."


# Where a kernel's time goes in a model step, by its CUDA name: Mosaic GPU kernels are named
# after their Pallas body function (`paged_flash_mgpu`'s `entry`, the MoE kernels' `body`)
# with "mosaic" in the symbol; cuBLAS / cuBLASLt GEMMs by their library names; the rest are
# XLA fusions, reductions, copies.
KINDS = (("attention", re.compile(r"entry", re.I)),
         ("moe", re.compile(r"body", re.I)),
         ("mosaic_other", re.compile(r"mosaic", re.I)),
         ("gemm", re.compile(r"gemm|gemv|xmma|nvjet|cutlass|cublas|sm90_|matmul|dot", re.I)))


def kernel_kind(name: str) -> str:
  mosaic = "mosaic" in name.lower()
  for kind, pattern in KINDS:
    if kind in ("attention", "moe") and not mosaic:
      continue
    if pattern.search(name):
      return kind
  return "xla_other"


def by_kind(per_iter: list[list[tuple[str, float]]] | None) -> dict[str, float]:
  """Median microseconds per step of each `kernel_kind`."""
  if not per_iter:
    return {}
  out: dict[str, list[float]] = {}
  for it in per_iter:
    sums: dict[str, float] = {}
    for name, us in it:
      sums[kernel_kind(name)] = sums.get(kernel_kind(name), 0.0) + us
    for kind, us in sums.items():
      out.setdefault(kind, []).append(us)
  return {k: statistics.median(v) for k, v in sorted(out.items())}


def time_call(run: Callable[[int], Any], *, iterations: int, reps: int,
              keep: Callable[[str], bool] = lambda name: True) -> dict[str, Any]:
  """`run(i)` timed both ways: {"us": wall per call, "kernel_us", "kernels"} (CUPTI fields
  only on a GPU)."""
  out = dict(us=wall_us(run, iterations, reps))
  out.update(summarize_kernels(kernel_times(run, iterations), keep))
  return out


# ---- inputs ----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def random_array(key, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
  """Random bits for integer dtypes (each value equally likely: INT4 nibbles are uniform over
  0..15), FP8 bits with the two NaN codes moved to their neighbours, else N(0, scale^2)."""
  dt = jnp.dtype(dtype)
  if jnp.issubdtype(dt, jnp.integer):
    unsigned = jnp.dtype(f"uint{dt.itemsize * 8}")
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, unsigned), dt)
  if dt == jnp.dtype(jnp.float8_e4m3fn):
    b = jax.random.bits(key, shape, jnp.uint8)
    return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b ^ 1, b), dt)
  return (jax.random.normal(key, shape, dt) * jnp.asarray(scale, dt)).astype(dt)


def keys(seed: int, n: int) -> list[jax.Array]:
  return list(jax.random.split(jax.random.key(seed), n))


# ---- the Mosaic GPU kernels off a GPU --------------------------------------------------------

@contextlib.contextmanager
def kernels_runnable():
  """On a GPU nothing; on the CPU (dry run) Mosaic GPU's interpreter under an abstract H200,
  its global state reset first (an earlier kernel may have raised)."""
  if on_gpu():
    yield
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels.interpret import gpu_interpret_mode
  interpret_pallas_call.gpu_callbacks.reset_gpu_interpret_mode_state()
  with jax.sharding.use_abstract_mesh(H200), gpu_interpret_mode(
      plgpu.InterpretGPUParams(uninitialized_memory="nan")):
    yield


def cuda_export(fn: Callable, *specs: Any) -> dict[str, Any]:
  """`jax.export` of fn for CUDA under the abstract H200 (no device; the dry run's check that
  a GPU program lowers): {"mosaic_calls", "export_s"} or {"error"}."""
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  t0 = time.perf_counter()
  try:
    with jax.sharding.use_abstract_mesh(H200):
      exported = jax.export.export(
          jitted, platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(MOSAIC_CALL)])(*specs)
    calls = re.findall(r"stablehlo.custom_call @([\w.]+)", exported.mlir_module())
    return dict(mosaic_calls=calls.count(MOSAIC_CALL), export_s=round(time.perf_counter() - t0, 2))
  except Exception as e:  # a program that does not lower is the finding
    return dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")


def spec(x: Any) -> Any:
  """ShapeDtypeStructs of a pytree of arrays or specs."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)


def rel_err(got: Any, want: Any) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if not np.isfinite(got).all():
    return float("inf")
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def quick() -> bool:
  """QUICK=1 (with DRY_RUN=1): each stage's first case and first CUDA lowering only (the CI
  test's subset of the dry run)."""
  import os
  return dry_run() and os.environ.get("QUICK", "") not in ("", "0")


def first(items: list, n: int = 1) -> list:
  """All of items, or the first n in QUICK mode."""
  return items[:n] if quick() else items


def scaled(full: int, toy: int) -> int:
  """The GPU size, or the dry run's toy size."""
  return toy if dry_run() else full
