"""Stage `peers`: what the GPU image's torch does on the same bytes (a separate process: torch
must not share a GPU with XLA's preallocation, and this module imports no JAX).

    python3 -m bench.protocol.peers OUT

On the bytes of 8 Kimi K2.5 experts (gate + up as one [7168 -> 32768] matrix, down as
[16384 -> 7168]: the same weights a batch-1 MoE layer reads, not the same computation), at
M = 1, 8, 64 rows, median of `triton.testing.do_bench` (which clears the L2 between runs):
  torch_copy / torch_read   device copy (read + write) and a read-only sum over 4 GiB: torch's
                            view of the ceilings, beside XLA's (stage ceilings)
  cublas_bf16               F.linear on bf16 weights (2 B / weight): the weight-streaming
                            roofline of a tuned library
  tinygemm_w4a16_g32        `aten._weight_int4pack_mm` (INT4 group 32, bf16 scale and zero per
                            group: 0.625 B / weight): an in-run W4A16 peer for the int4 stage
  scaled_mm_fp8             `torch._scaled_mm` e4m3 x e4m3 (per-tensor scales; M >= 16)
GB/s on each implementation's own bytes; the fractions against this run's XLA ceilings.
Without torch (or, outside the dry run, without CUDA) the stage writes its skip row. In the
dry run with a CPU torch: the copy, read and bf16 rows at toy sizes.
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.protocol.rows import Recorder, dry_run

H, I, EXPERTS = 7168, 2048, 8


def _bench(fn, device: str) -> float:
  """Median microseconds of fn()."""
  if device == "cuda":
    try:
      from triton.testing import do_bench
      return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    except ImportError:
      pass
  import torch
  samples = []
  fn()
  for _ in range(5 if device == "cpu" else 50):
    if device == "cuda":
      torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
      torch.cuda.synchronize()
    samples.append((time.perf_counter() - t0) * 1e6)
  return statistics.median(samples)


def run(out_dir: str) -> None:
  try:
    import torch
  except ImportError as e:
    Recorder(out_dir, "peers").skip(f"torch not importable ({e})")
    return
  cuda = torch.cuda.is_available()
  if not cuda and not dry_run():
    Recorder(out_dir, "peers", torch=torch.__version__).skip("torch sees no CUDA device")
    return
  dev = "cuda" if cuda else "cpu"
  rec = Recorder(out_dir, "peers", device=torch.cuda.get_device_name() if cuda else "cpu",
                 torch=torch.__version__)
  n = (1 << 31) if cuda else (1 << 22)
  x = torch.randn(n, device=dev, dtype=torch.bfloat16)
  y = torch.empty_like(x)
  rec.row("torch_copy", f"{2 * n / 2**30:.3g} GiB", bytes=4 * n,
          us=_bench(lambda: y.copy_(x), dev))
  rec.row("torch_read", f"{2 * n / 2**30:.3g} GiB", bytes=2 * n,
          us=_bench(lambda: x.sum(dtype=torch.float32), dev))
  x = y = None  # the buffers freed (`del` would leave the lambdas above a deleted name)
  h, i = (H, I) if cuda else (256, 128)
  mats = [(h, 2 * EXPERTS * i, "gate_up"), (EXPERTS * i, h, "down")]  # (K, N)
  for m in (1, 8, 64):
    rows = {}
    for name in ("cublas_bf16", "tinygemm_w4a16_g32", "scaled_mm_fp8"):
      try:
        us, nbytes = 0.0, 0
        for k, n_out, _ in mats:
          fn, b = _peer(torch, name, m, k, n_out, dev)
          us += _bench(fn, dev)
          nbytes += b
        rows[name] = dict(us=us, bytes=nbytes)
      except NotImplementedError as e:
        rows[name] = dict(skipped=str(e))
      except Exception as e:  # an op this torch or device lacks is a result
        rows[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
    for name, r in rows.items():
      rec.row(name, f"8 experts M={m}", m=m, **r)


def _peer(torch, name: str, m: int, k: int, n: int, dev: str):
  """(fn, weight bytes) of one matmul [m, k] x [k, n] by the named implementation."""
  x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
  if name == "cublas_bf16":
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    return (lambda: torch.nn.functional.linear(x, w)), w.numel() * 2
  if dev != "cuda":
    raise NotImplementedError(f"{name} is timed on CUDA only")
  if name == "tinygemm_w4a16_g32":
    w = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(w, 8)
    scale_zero = torch.randn(k // 32, n, 2, device=dev, dtype=torch.bfloat16)
    fn = lambda: torch.ops.aten._weight_int4pack_mm(x, packed, 32, scale_zero)
    return fn, n * k // 2 + scale_zero.numel() * 2
  if name == "scaled_mm_fp8":
    if m < 16:
      raise NotImplementedError("torch._scaled_mm needs M a multiple of 16")
    a = x.to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev, dtype=torch.float32)
    fn = lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return fn, n * k
  raise ValueError(name)


if __name__ == "__main__":
  run(sys.argv[1])
