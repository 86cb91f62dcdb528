"""Stage `k25_slice`: a Kimi K2.5-shaped slice of the model, step by step.

    python -m bench.protocol.k25_slice OUT --deadline_s=190

The slice: Kimi K2.5's real widths (hidden 7168, MLA 64 heads with latent 512 + rope 64,
384 INT4 experts top-8 of width 2048, one shared expert, vocabulary 163,840) and `--layers`
layers (the first dense, the rest MoE), its weights random (INT4 nibbles as random bits),
one draw per leaf repeated over the layers of a kind (each layer reads its own copy, far larger
than L2; the layers of a stack are one array, so the slice takes its full memory: ~9.5 GB per
MoE layer). Kernels: `--kernels`
("auto": resolved for this device and model, the `kernels:` line printed).

Programs, in priority order, each compiled (time recorded) and run with the cache donated:
  decode B x 1 at B = 1, 8, 64 over `--context` cached tokens per row;
  prefill: one 8,192-token chunk of one sequence (logits of its last position): FLOP/s and
           the fraction of this run's bf16 matmul rate (the reference engine publishes time
           to first token at 10,000 input tokens);
  verify B x T, T = k + 1 positions per row with logits at each: (1, 5), (8, 5), (1, 3),
           (1, 9), (8, 3), (8, 9), (32, 1), (32, 5), until the deadline (a program is started
           only if 1.5x the slowest compile so far still fits).
Each row: `us` (wall per step, steps queued back to back), the CUPTI kernels' sum and the gap
between them (`gap_us`: launches and idle time), the kernels' time by kind (attention, MoE,
GEMMs, other XLA), the top kernels, the bytes a step must read (`bytes`: weights, the
expected distinct experts of B x T tokens, the KV cache) and so GB/s against the ceilings.
In the dry run: a toy slice (plain JAX on the CPU), and the GPU programs lowered for CUDA at
the real shapes with the Mosaic GPU kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp

from bench.decode_profile import bytes_floor, random_params_on_device
from bench.expert_bytes import INT4, KIMI_K25_TEXT
from bench.protocol import timing
from bench.protocol.rows import Recorder, dry_run
from engine.model import kernels
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import ModelConfig, config_from_dict
from engine.model.kernels import KernelChoice
from engine.model.params import abstract_params, param_shapes, is_shape, path_str
from engine.model.transformer import compute_logits, forward

PAGE = 64
GPU_PROGRAMS = [("decode", 1, 1), ("decode", 8, 1), ("decode", 64, 1), ("prefill", 1, 8192),
                ("verify", 1, 5), ("verify", 8, 5), ("verify", 1, 3), ("verify", 1, 9),
                ("verify", 8, 3), ("verify", 8, 9), ("decode", 32, 1), ("verify", 32, 5)]
TOY_PROGRAMS = [("decode", 1, 1), ("prefill", 1, 128), ("decode", 8, 1), ("verify", 1, 5),
                ("verify", 8, 3)]
TOY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
           num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=64,
           kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
           max_position_embeddings=8192)


def slice_config(layers: int, toy: bool, experts: int | None = None) -> ModelConfig:
  """The slice's config: K2.5 with `layers` layers (`TOY` widths in the dry run), `experts`
  routed experts if given (the real widths only: a shard's experts, e.g. EP-8's 48)."""
  d = dict(KIMI_K25_TEXT, num_hidden_layers=layers, **(TOY if toy else {}))
  if experts and not toy:
    d["n_routed_experts"] = experts
  return dataclasses.replace(config_from_dict(d), int4=INT4)


def forward_flops(cfg: ModelConfig, b: int, t: int, context: int, logit_positions: int) -> int:
  """Matmul FLOPs of one forward over t new tokens per row after `context` cached ones: every
  weight matrix once per token (the routed experts' top-k only, the router, MLA's absorbed
  projections), scores and values over the visible keys (latent 512 + rope 64 per key, causal
  among the new tokens), and the head at `logit_positions` positions per row."""
  tokens = b * t
  flops = 0
  for path, shape in jax.tree_util.tree_flatten_with_path(
      param_shapes(dataclasses.replace(cfg, int4=None)), is_leaf=is_shape)[0]:
    name = path_str(path)
    if name.endswith("norm") or name.endswith("bias") or name == "embed" or len(shape) < 2:
      continue
    n = math.prod(shape)
    if ".experts." in name:
      n = n // cfg.num_experts * cfg.num_experts_per_tok
    flops += 2 * n * (b * logit_positions if name == "lm_head" else tokens)
  visible = context + (t + 1) / 2  # keys each new token sees, on average
  per_key = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.kv_lora_rank if cfg.is_mla else \
      2 * cfg.head_dim
  flops += 2 * tokens * cfg.num_heads * per_key * visible * cfg.num_layers
  return int(flops)


def program(cfg: ModelConfig, impl: KernelChoice, kind: str, b: int, t: int, context: int):
  """(jitted step, its arguments but params, cache size in pages): the cache is donated and
  returned, so each step writes its new tokens in place."""
  start = 0 if kind == "prefill" else context
  table = jnp.asarray(contiguous_page_table(b, start + t, PAGE))
  args = (jnp.ones((b, t), jnp.int32), jnp.full((b,), start, jnp.int32),
          jnp.full((b,), t, jnp.int32), table)
  last_only = kind == "prefill"

  def step(params, cache, tokens, start, n_new, table):
    hidden, cache = forward(params, cache, tokens, start, n_new, table, cfg=cfg, impl=impl)
    if last_only:
      hidden = hidden[:, -1:]
    return jnp.argmax(compute_logits(params, hidden, cfg), axis=-1), cache

  return jax.jit(step, donate_argnums=(1,)), args, int(table.size)


def measure(rec: Recorder, cfg, params, impl, kind: str, b: int, t: int, context: int,
            label: str, layers: int) -> dict:
  step, args, pages = program(cfg, impl, kind, b, t, context)
  cache = init_cache(cfg, pages, PAGE, jnp.bfloat16)
  t0 = time.perf_counter()
  lowered = step.lower(params, cache, *args)
  lower_s = time.perf_counter() - t0
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0 - lower_s
  state = {"cache": cache}

  def run(i):
    out, state["cache"] = compiled(params, state["cache"], *args)
    return out

  with timing.kernels_runnable():
    if dry_run():
      t1 = time.perf_counter()
      jax.block_until_ready(run(0))
      timed, per_iter = dict(us=(time.perf_counter() - t1) * 1e6), None
    else:
      timed = dict(us=timing.wall_us(run, iterations=5, reps=3))
      per_iter = timing.kernel_times(run, 3)
  ctx = 0 if kind == "prefill" else context
  row = dict(kind=kind, batch=b, width=t, context=ctx, layers=layers, lower_s=round(lower_s, 2),
             compile_s=round(compile_s, 2), flops=forward_flops(
                 cfg, b, t, ctx, 1 if kind == "prefill" else t))
  if kind != "prefill":  # the bytes a step must read; a prefill is judged by its FLOP/s
    row["bytes"] = bytes_floor(cfg, params, b, ctx, t)
  summary = timing.summarize_kernels(per_iter)
  if summary:
    row.update(kernel_us=summary["kernel_us"], gap_us=timed["us"] - summary["kernel_us"],
               by_kind=timing.by_kind(per_iter), kernels=summary["kernels"][:12])
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  row["distinct_experts"] = e * (1 - (1 - k / e) ** (b * t))
  return rec.row(label, f"{kind} B={b} T={t}", us=timed["us"], **row)


def export_rows(rec: Recorder, layers: int) -> None:
  """Dry run: the GPU's decode and prefill programs lowered for CUDA at the real shapes with
  the Mosaic GPU kernels (an abstract H200; no weights)."""
  cfg = slice_config(layers, toy=False)
  params = abstract_params(cfg, jnp.bfloat16)
  impl = KernelChoice(attention="mosaic_gpu", moe="mosaic_gpu")
  for kind, b, t in timing.first([("decode", 1, 1), ("verify", 8, 5), ("prefill", 1, 8192)]):
    step, args, pages = program(cfg, impl, kind, b, t, 4096)
    cache = jax.eval_shape(lambda: init_cache(cfg, pages, PAGE, jnp.bfloat16))
    found = timing.cuda_export(step, params, cache, *timing.spec(args))
    rec.row("cuda_export", f"{kind} B={b} T={t}", layers=layers, **found)


def run(out_dir: str, layers: int, context: int, deadline_s: float, kernel_name: str) -> None:
  t_start = time.perf_counter()
  rec = Recorder(out_dir, "k25_slice", **timing.labels())
  toy = dry_run()
  cfg = slice_config(layers, toy)
  context = min(context, 128) if toy else context
  params = jax.block_until_ready(random_params_on_device(cfg, jnp.bfloat16, share_layers=True))
  impl = KernelChoice(attention=kernel_name, moe=kernel_name)
  if kernel_name == "auto":
    impl = kernels.announce(kernels.resolve_for_params(impl, cfg, params, page_size=PAGE)).choice
  label = impl.attention if impl.attention == impl.moe else f"{impl.attention}+{impl.moe}"
  rec.row("weights", cfg.display_name, seconds=round(time.perf_counter() - t_start, 1),
          kernels=dataclasses.asdict(impl), bytes=sum(
              x.nbytes for x in {id(v): v for v in jax.tree.leaves(params)}.values()))
  slowest = 0.0
  for kind, b, t in timing.first(TOY_PROGRAMS, 2) if toy else GPU_PROGRAMS:
    left = deadline_s - (time.perf_counter() - t_start)
    if left < 1.5 * max(slowest, 10.0) + 5:
      rec.row(label, f"{kind} B={b} T={t}", skipped=f"deadline: {left:.0f}s left, slowest "
              f"compile {slowest:.0f}s")
      continue
    try:
      r = measure(rec, cfg, params, impl, kind, b, t, context, label, layers)
      slowest = max(slowest, r["lower_s"] + r["compile_s"])
    except Exception as err:  # an OOM or a failed lowering is a result; go on
      rec.row(label, f"{kind} B={b} T={t}", error=f"{type(err).__name__}: {err}"[:600])
  if toy:
    export_rows(rec, layers)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--context", type=int, default=4096)
  p.add_argument("--deadline_s", type=float,
                 default=float(os.environ.get("STAGE_LIMIT_S", 200)) - 10,
                 help="seconds from the start after which no program starts (default: the "
                 "stage's limit from gpu_check.sh, less 10)")
  p.add_argument("--kernels", default="auto", choices=["auto", "mosaic_gpu", "reference"])
  a = p.parse_args(argv)
  run(a.out, a.layers, a.context, a.deadline_s, a.kernels)


if __name__ == "__main__":
  main()
