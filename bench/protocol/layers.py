"""Stage `layers` (issue 49): the scanned layer stack on a GPU. Opt-in:
`STAGES=ceilings,layers bash bench/gpu_check.sh`.

    python -m bench.protocol.layers OUT --deadline_s=110

In priority order, each row written as it is measured (a stage cut at its limit keeps them):
1. Decode step time, B = 1 then 64, on a Kimi K2.5-width slice (`k25_slice.slice_config`:
   hidden 7168, MLA, INT4 experts; `--layers` layers, the first dense; `--experts` routed
   experts, an EP-8 shard's 48, so that it fits one device twice over), 8 greedy steps (2 in
   the dry run) per call in one program (`bench.scan_step._program`), the cache donated:
   `scan` (the forward as served), `separate` (each layer called on arrays of its own, copied
   out of the stacks before the program: nothing is sliced inside it), `unrolled`
   (`scan_layers=False`: one call per layer on its stack's static slice). Per row: `us` per
   step, `bytes` a step must read (`bench.decode_profile.bytes_floor`) and so the fractions of
   this run's ceilings; then a `vs_separate` row: each program's step time over `separate`'s
   and whether its greedy tokens equal `separate`'s.
   The `scan` row also carries the compiled program's slice copies (`scan_step.slice_copies`:
   per loop body, the bytes its fusions copy out of a dynamic-slice of a stack per iteration)
   and `layer_nonexpert_bytes` (one MoE layer's weights but its routed experts, which the MoE
   kernels read in place by layer index). Zero on a GPU means XLA:GPU's gemms read the
   stacked weights in place; about `layer_nonexpert_bytes` means each iteration copies its
   layer's weights before its gemms read them.
2. Compile depth (`bench.compile_depth`'s programs: prefill of 64 tokens, 8 decode steps in a
   `fori_loop`) at 4 and 61 layers, tiny widths wide enough for the Mosaic GPU kernels
   (`MOSAIC_TINY`), scanned then unrolled: lower and compile seconds and HLO instructions,
   jax's caches cleared before each (a Mosaic kernel lowered for one program is not reused).
   A program starts only if 1.5x the slowest compile so far still fits the deadline.
Dry run (DRY_RUN=1, CPU): the slice at `k25_slice.TOY` widths, depths 4 and 8, reference
kernels (XLA:CPU copies each layer's slice: nonzero `slice_copy_bytes`), then the slice's
`separate` decode at its real widths and compile_depth's 4-layer scanned decode lowered for
CUDA with the Mosaic GPU kernels (an abstract H200).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp

from bench import compile_depth, scan_step
from bench.decode_profile import bytes_floor, random_params_on_device
from bench.protocol import timing
from bench.protocol.k25_slice import PAGE, slice_config
from bench.protocol.rows import Recorder, dry_run
from engine.model import kernels
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import config_from_dict
from engine.model.kernels import KernelChoice
from engine.model.params import abstract_params, layer_params

PROGRAMS = ("scan", "separate", "unrolled")
BATCHES = (1, 64)
# compile_depth's tiny DeepSeek-V3 with the narrowest widths both Mosaic GPU kernels take
# (MoE: hidden and expert width multiples of 64; MLA: latent and rope head dims of 64).
MOSAIC_TINY = dict(hidden_size=128, moe_intermediate_size=64, kv_lora_rank=64,
                   qk_rope_head_dim=64)


def _auto(cfg, params, page: int) -> KernelChoice:
  """The kernels "auto" resolves to for these parameters' device (the line printed)."""
  return kernels.announce(kernels.resolve_for_params(
      KernelChoice(attention="auto", moe="auto"), cfg, params, page_size=page)).choice


def _label(impl: KernelChoice) -> dict:
  return dict(kernels=f"{impl.attention}+{impl.moe}", xla_flags=os.environ.get("XLA_FLAGS", ""))


def layer_nonexpert_bytes(params) -> int:
  """Bytes of one layer of the last stack but its routed experts (what a scan would copy per
  iteration if no gemm read its stack in place)."""
  stack = params["stacks"][-1]
  rest = {k: v for k, v in stack.items() if k != "moe"}
  rest["moe"] = {k: v for k, v in stack.get("moe", {}).items() if k != "experts"}
  return sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(rest))


class Clock:
  """The stage's deadline and the slowest compile so far."""

  def __init__(self, deadline_s: float):
    self.t0, self.deadline_s, self.slowest = time.perf_counter(), deadline_s, 0.0

  def left(self) -> float:
    return self.deadline_s - (time.perf_counter() - self.t0)

  def fits(self) -> bool:
    return self.left() >= 1.5 * max(self.slowest, 5.0 if dry_run() else 10.0) + 3

  def compiled(self, seconds: float) -> None:
    self.slowest = max(self.slowest, seconds)


def step_rows(rec: Recorder, clock: Clock, cfg, params, per_layer, impl, b: int, context: int,
              steps: int) -> None:
  """Step time of the three programs at batch b (the `scan` row first, with its copies)."""
  table = jnp.asarray(contiguous_page_table(b, context + steps, PAGE))
  dtype = params["embed"].dtype
  floor = bytes_floor(cfg, params, b, context, 1)
  tokens, us_of = {}, {}
  for name in PROGRAMS:
    case = f"decode B={b}"
    if not clock.fits():
      rec.row(name, case, skipped=f"deadline: {clock.left():.0f}s left, slowest compile "
              f"{clock.slowest:.0f}s")
      continue
    try:
      fn = scan_step._program(name, cfg, b, table, impl, context, steps)
      state = [init_cache(cfg, int(table.size), PAGE, dtype), jnp.ones((b,), jnp.int32)]
      t0 = time.perf_counter()
      lowered = fn.lower(params, per_layer, *state)
      lower_s = time.perf_counter() - t0
      compiled = lowered.compile()
      compile_s = time.perf_counter() - t0 - lower_s
      clock.compiled(lower_s + compile_s)
      extra = {}
      if name == "scan":
        copies = scan_step.slice_copies(compiled.as_text())
        extra = dict(slice_copies=copies, layer_nonexpert_bytes=layer_nonexpert_bytes(params),
                     slice_copy_bytes=max([c["bytes_per_iteration"] for c in copies] or [0]))

      def run(i):
        state[:] = compiled(params, per_layer, *state)
        return state[1]

      with timing.kernels_runnable():
        tokens[name] = jax.device_get(run(0))
        if dry_run():
          t1 = time.perf_counter()
          jax.block_until_ready(run(1))
          us = (time.perf_counter() - t1) * 1e6 / steps
        else:
          us = timing.wall_us(run, iterations=5, reps=2) / steps
      us_of[name] = us
      rec.row(name, case, kind="decode", batch=b, context=context, layers=cfg.num_layers,
              experts=cfg.num_experts, steps=steps, us=us, bytes=floor,
              lower_s=round(lower_s, 2), compile_s=round(compile_s, 2), **_label(impl), **extra)
    except Exception as err:  # an OOM or a failed lowering is a result; go on
      rec.row(name, case, error=f"{type(err).__name__}: {err}"[:600])
  if "separate" in us_of and len(us_of) > 1:  # the ratios, and whether the tokens agree
    others = [n for n in us_of if n != "separate"]
    rec.row("vs_separate", f"decode B={b}", batch=b,
            **{n: us_of[n] / us_of["separate"] for n in others},
            tokens_agree={n: bool((tokens[n] == tokens["separate"]).all()) for n in others})


def depth_rows(rec: Recorder, clock: Clock, depths: tuple[int, ...]) -> None:
  """Lower + compile seconds of compile_depth's prefill and decode programs per depth,
  scanned first (the claim: constant in depth), then unrolled (deepest last)."""
  for scan_layers in (True, False):
    for layers in depths:
      cfg = config_from_dict(dict(compile_depth.tiny_deepseek_v3(layers), **MOSAIC_TINY))
      # (zeros: a compile does not read the values, and random weights take a compile too)
      params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                            abstract_params(cfg, jnp.bfloat16))
      impl = _auto(cfg, params, 16)
      programs = compile_depth.depth_programs(cfg, params, impl, scan_layers)
      for prog, (fn, args) in programs.items():
        impl_name, case = "scan" if scan_layers else "unrolled", f"compile {prog} L={layers}"
        if not clock.fits():
          rec.row(impl_name, case, skipped=f"deadline: {clock.left():.0f}s left, slowest "
                  f"compile {clock.slowest:.0f}s")
          continue
        try:
          jax.clear_caches()
          with timing.kernels_runnable():
            m = compile_depth.lower_compile(fn, args)
          clock.compiled(m["lower_s"] + m["compile_s"])
          rec.row(impl_name, case, kind="compile", program=prog, layers=layers,
                  lower_s=round(m["lower_s"], 3), compile_s=round(m["compile_s"], 3),
                  hlo_instructions=m["hlo_instructions"], **_label(impl))
        except Exception as err:
          rec.row(impl_name, case, error=f"{type(err).__name__}: {err}"[:600])


def export_rows(rec: Recorder, layers: int, experts: int) -> None:
  """Dry run: the GPU's programs lowered for CUDA with the Mosaic GPU kernels (abstract
  H200): the slice's `separate` decode at B=1 (real widths), compile_depth's scanned decode at
  4 tiny layers."""
  impl = KernelChoice(attention="mosaic_gpu", moe="mosaic_gpu")
  cfg = slice_config(layers, toy=False, experts=experts)
  params = abstract_params(cfg, jnp.bfloat16)
  per_layer = jax.eval_shape(
      lambda p: [layer_params(cfg, p, i) for i in range(cfg.num_layers)], params)
  table = jnp.asarray(contiguous_page_table(1, 1024 + 2, PAGE))
  fn = scan_step._program("separate", cfg, 1, table, impl, 1024, 2)
  cache = jax.eval_shape(lambda: init_cache(cfg, int(table.size), PAGE, jnp.bfloat16))
  tok = jax.ShapeDtypeStruct((1,), jnp.int32)
  rec.row("cuda_export", "separate decode B=1", layers=layers,
          **timing.cuda_export(fn, params, per_layer, cache, tok))
  if timing.quick():
    return
  cfg = config_from_dict(dict(compile_depth.tiny_deepseek_v3(4), **MOSAIC_TINY))
  fn, args = compile_depth.depth_programs(cfg, abstract_params(cfg, jnp.bfloat16), impl)["decode"]
  rec.row("cuda_export", "compile decode L=4 (tiny, scanned)", layers=4,
          **timing.cuda_export(fn, *timing.spec(args)))


def run(out_dir: str, layers: int, experts: int, context: int, deadline_s: float) -> None:
  clock = Clock(deadline_s)
  rec = Recorder(out_dir, "layers", **timing.labels())
  toy = dry_run()
  cfg = slice_config(layers, toy, experts=experts)
  context = min(context, 64) if toy else context
  params = jax.block_until_ready(random_params_on_device(cfg, jnp.bfloat16, share_layers=True))
  impl = _auto(cfg, params, PAGE)
  # Each layer's arrays of its own (copies made before any program runs).
  per_layer = jax.block_until_ready(
      [jax.tree.map(lambda a: jnp.array(a, copy=True), layer_params(cfg, params, i))
       for i in range(cfg.num_layers)])
  rec.row("weights", cfg.display_name, seconds=round(time.perf_counter() - clock.t0, 1),
          layers=cfg.num_layers, experts=cfg.num_experts, **_label(impl), bytes=sum(
              x.nbytes for x in {id(v): v for v in jax.tree.leaves(params)}.values()))
  steps = 2 if toy else 8
  for b in timing.first(list(BATCHES)):
    step_rows(rec, clock, cfg, params, per_layer, impl, b, context, steps)
  del params, per_layer
  depth_rows(rec, clock, timing.first([4, 8], 1) if toy else (4, 61))
  if toy:
    export_rows(rec, layers, experts)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--experts", type=int, default=48)
  p.add_argument("--context", type=int, default=1024,
                 help="cached tokens per row (short: the weights' bytes dominate the step)")
  p.add_argument("--deadline_s", type=float,
                 default=float(os.environ.get("STAGE_LIMIT_S", 120)) - 8,
                 help="seconds from the start after which no program starts (default: the "
                 "stage's limit from gpu_check.sh, less 8)")
  a = p.parse_args(argv)
  run(a.out, a.layers, a.experts, a.context, a.deadline_s)


if __name__ == "__main__":
  main()
