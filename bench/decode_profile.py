"""Decode-step time, its breakdown, and the bandwidth floor it should approach.

    python -m bench.decode_profile --model=demo --batch=1,8 --out=profile.json        # CPU ok
    python -m bench.decode_profile --model=dsv2_lite --batch=1,8,64 --kernels=mosaic_gpu

Per batch size B (one new token per row, `--context` cached tokens per row):
* `step`: one jitted forward + logits (T=1), device time, median of `--iters`;
* the breakdown by ablation through the kernel switch: the same step with attention replaced by
  a zero kernel, with routed experts replaced by a zero kernel, and with both; attention =
  step - no_attention, MoE = step - no_moe, other = no_attention_no_moe (projections, norms,
  shared experts, LM head, sampling). Fusion across the removed op makes this approximate;
* `host`: per-token wall time of the serving `Engine` decoding the same batch one step per
  host round trip, minus the device step: scheduling, packing, transfers, detokenisation;
* `--verify=2,3,5,9`: a speculative verify forward over T positions per row (K + 1 for K
  drafts, logits at every position) in decode steps, and over its own floor (more distinct
  experts for B T tokens): how close to free verification is on this device;
* `floor`: bytes a step must read (weights of the non-expert layers, the experts the batch
  actually routes to in expectation, the KV cache of every row) over the measured copy
  bandwidth; `step / floor` is how far from memory-bound roofline the step is.

Models: `demo` (the bundled checkpoint), `dsv2_lite` (DeepSeek-V2-Lite shapes, random weights
made on the device: 27 layers, hidden 2048, 64 experts top-6, MLA; 31 GB in bf16: GPU only),
`tiny` (a small random MoE for smoke runs). Prints a table, writes JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from engine.model import kernels
from engine.model.cache import cache_bytes_per_token, contiguous_page_table, init_cache
from engine.model.config import ModelConfig, config_from_dict
from engine.model.kernels import KernelChoice
from engine.model.params import abstract_params, path_str
from engine.model.transformer import compute_logits, forward
from engine.runtime.speculative import costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when run as a script only: absl refuses a flag
  defined twice in one process, and other command lines share these names."""
  flags.DEFINE_enum("model", "demo", ["demo", "dsv2_lite", "tiny"], "Which model.")
  flags.DEFINE_list("batch", ["1", "8"], "Batch sizes.")
  flags.DEFINE_integer("context", 1024, "Cached tokens per row.")
  flags.DEFINE_string("kernels", "reference", "Kernel choice for attention and MoE (auto: the "
                      "Mosaic GPU kernels on Hopper where the model fits them).")
  flags.DEFINE_integer("iters", 10, "Timed iterations per measurement.")
  flags.DEFINE_bool("host", True, "Also measure the serving engine's per-token host overhead.")
  flags.DEFINE_list("ablate", None, "Batch sizes to break down by ablation (default: all).")
  flags.DEFINE_list("verify", [], "Speculative verify widths T (positions per row, K + 1) to "
                    "time like the step, e.g. 2,3,5,9: what verifying K drafts costs in decode "
                    "steps (1.0: free; more distinct experts are read as T grows).")
  flags.DEFINE_string("dtype", None, "Parameter dtype of the demo model (default: its own).")
  flags.DEFINE_integer("layers", 0, "dsv2_lite / tiny with this many decoder layers (0: as "
                       "published): on an H200 the 27-layer forward with the Mosaic GPU kernels "
                       "took ~95 s to compile (BENCHMARKS.md, 'Second GPU run').")
  flags.DEFINE_string("out", "", "Write JSON here.")


DSV2_LITE = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
                 intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                 num_attention_heads=16, n_routed_experts=64, n_shared_experts=2,
                 num_experts_per_tok=6, kv_lora_rank=512, q_lora_rank=None,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False,
                 routed_scaling_factor=1.0, max_position_embeddings=32768, bos_token_id=1,
                 eos_token_id=2, rms_norm_eps=1e-6)
TINY = dict(DSV2_LITE, vocab_size=512, hidden_size=128, intermediate_size=256,
            moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            n_routed_experts=16, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, max_position_embeddings=4096)


def _random_leaf(key, shape, dtype, scale):
  """Integer leaves (INT4 packed nibbles) as random bits, so every nibble value is equally
  likely (a float cast to uint8 would be mostly zeros); FP8 values as random bits less the
  NaN codes; float leaves of standard deviation `scale`."""
  dt = jnp.dtype(dtype)
  if jnp.issubdtype(dt, jnp.integer):
    unsigned = jnp.dtype(f"uint{dt.itemsize * 8}")
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, unsigned), dt)
  if dt == jnp.dtype(jnp.float8_e4m3fn):
    b = jax.random.bits(key, shape, jnp.uint8)
    return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b ^ 1, b), dt)
  # (uniform with the same spread as N(0, scale^2): a generator XLA compiles in a fraction of
  # the time of a normal's, for a program making every leaf)
  return jax.random.uniform(key, shape, jnp.float32, -scale * 3 ** 0.5,
                            scale * 3 ** 0.5).astype(dtype)


def _layer_free(path, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int]:
  """(name without its layer, one layer's shape, layers): `stacks.1.moe.experts.gate.packed`
  [3, E, K/2, N] -> (`layer.moe.experts.gate.packed`, [E, K/2, N], 3); `mtp.0.attn.q_a` ->
  (`layer.attn.q_a`, its shape, 0: not stacked); other leaves as they are."""
  parts = path_str(path).split(".")
  if len(parts) > 1 and parts[0] in ("stacks", "mtp") and parts[1].isdigit():
    stacked = parts[0] == "stacks"
    return ".".join(["layer"] + parts[2:]), shape[1:] if stacked else shape, (
        shape[0] if stacked else 0)
  return ".".join(parts), shape, 0


def random_params_on_device(cfg: ModelConfig, dtype, seed: int = 0,
                            share_layers: bool = False):
  """Random weights generated on the device (never on the host) by one compiled program. With
  `share_layers`, every layer holds the values of the first layer of its kind (one draw per
  leaf name and shape, repeated over a stack's layers: each layer still reads its own copy,
  far larger than the L2 cache); the memory is the model's (the layers of a stack are one
  array each, so a slice of a big model cannot share buffers between them)."""
  abstract = abstract_params(cfg, dtype)
  flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(flat))
  index, specs = [], {}  # leaf i -> (the made leaf it is, layers to repeat it over)
  for i, (path, a) in enumerate(flat):
    name = path_str(path)
    free, shape, layers = _layer_free(path, tuple(a.shape))
    if not share_layers:
      shape, layers = tuple(a.shape), 0
    shared = (free, shape, str(a.dtype)) if share_layers else i
    if shared not in specs:
      scale = 1.0 if name == "embed" else 0.02 / 4.6 if name.endswith(".scale") else 0.02
      specs[shared] = (len(specs), shape, jnp.dtype(a.dtype), scale, name.endswith("norm"))
    index.append((specs[shared][0], layers))
  how = [s[1:] for s in specs.values()]

  @jax.jit
  def make(keys):
    made = [jnp.ones(shape, dtype) if norm else _random_leaf(k, shape, dtype, scale)
            for k, (shape, dtype, scale, norm) in zip(keys, how)]
    return [jnp.broadcast_to(made[j], (n,) + made[j].shape) if n else made[j]
            for j, n in index]

  return jax.tree_util.tree_unflatten(tree, make(keys[:len(how)]))


def load_model(name: str):
  if name == "demo":
    import engine
    m = engine.load(os.path.join(ROOT, "checkpoints", "demo", "target"), dtype=FLAGS.dtype)
    return m.config, m.params
  shape = dict(DSV2_LITE if name == "dsv2_lite" else TINY)
  if FLAGS.layers:
    shape["num_hidden_layers"] = FLAGS.layers
  cfg = config_from_dict(shape)
  return cfg, random_params_on_device(cfg, jnp.bfloat16)


def _register_zero_kernels() -> None:
  kernels.register("mla_attention", "zero", lambda q_latent, *a, **k: jnp.zeros_like(q_latent))
  kernels.register("gqa_attention", "zero", lambda q, *a, **k: jnp.zeros_like(q))
  kernels.register("moe_experts", "zero", lambda x, *a, **k: jnp.zeros_like(x))


def _median_time(fn, iters: int) -> float:
  jax.block_until_ready(fn())
  samples = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - t)
  return statistics.median(samples)


def step_time(cfg, params, batch: int, context: int, impl: KernelChoice, iters: int,
              t: int = 1) -> float:
  """Device seconds of one decode step (t = 1) for `batch` rows with `context` cached tokens,
  or of a speculative verify forward over t positions per row (logits at every position)."""
  return _median_time(step_program(cfg, params, batch, context, impl, t), iters)


def step_program(cfg, params, batch: int, context: int, impl: KernelChoice, t: int = 1):
  """`step_time`'s program, as a function of no arguments."""
  page = 64
  table = jnp.asarray(contiguous_page_table(batch, context + t, page))
  cache = init_cache(cfg, int(table.size), page, params["embed"].dtype)
  tokens = jnp.ones((batch, t), jnp.int32)
  start = jnp.full((batch,), context, jnp.int32)
  n_new = jnp.full((batch,), t, jnp.int32)

  @jax.jit
  def step(params, cache):
    hidden, _ = forward(params, cache, tokens, start, n_new, table, cfg=cfg, impl=impl)
    return jnp.argmax(compute_logits(params, hidden, cfg), axis=-1)

  return lambda: step(params, cache)


def bytes_floor(cfg: ModelConfig, params, batch: int, context: int, t: int = 1) -> int:
  """Bytes one decode step (or a verify forward of t positions per row) must read: all
  non-expert weights (less the unused embedding rows), the expected number of distinct
  experts the batch's tokens route to, and the KV cache."""
  expert_bytes = 0
  other = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = path_str(path)
    if ".experts." in name:
      expert_bytes += leaf.nbytes
    elif name != "embed":
      other += leaf.nbytes
  e, k = max(cfg.num_experts, 1), cfg.num_experts_per_tok
  touched = e * (1 - (1 - k / e) ** (batch * t)) if cfg.num_experts else 0
  kv = batch * context * cache_bytes_per_token(cfg, params["embed"].dtype)
  return int(other + expert_bytes * touched / e + kv)


def copy_bandwidth(iters: int) -> float:
  n = (1 << 30) if jax.default_backend() == "gpu" else (1 << 24)
  a = jnp.ones((n,), jnp.bfloat16)
  f = jax.jit(lambda v: v + 1)
  return 2 * 2 * n / _median_time(lambda: f(a), iters)


def host_overhead(cfg, params, batch: int, context: int, impl: KernelChoice) -> float:
  """Median wall seconds of the Engine's full-batch decode steps (one step per host round trip,
  max_decode_steps=1) for `batch` requests of `context` prompt tokens."""
  from engine.runtime.engine import Engine, EngineConfig
  from engine.runtime.request import StopParams
  eng = Engine(cfg, params, EngineConfig(page_size=64, max_num_seqs=batch,
                                         max_num_batched_tokens=512, row_widths=(64,),
                                         max_model_len=context + 192, max_decode_steps=1,
                                         kernels=impl))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, cfg.vocab_size, context).tolist() for _ in range(batch)]
  eng.generate([p[:8] for p in prompts], stop=StopParams(max_tokens=4, ignore_eos=True))
  for p in prompts:
    eng.add_request(p, stop=StopParams(max_tokens=160, ignore_eos=True))
  samples = []
  while eng.has_unfinished():
    loops = eng.counters["decode_loops"]
    t = time.perf_counter()
    eng.step()
    if eng.counters["decode_loops"] > loops and len(eng.scheduler.running) == batch:
      samples.append(time.perf_counter() - t)  # a full-batch decode step (not prefill)
  return statistics.median(samples) if samples else float("nan")


def main(argv):
  del argv
  _register_zero_kernels()
  impl = KernelChoice(attention=FLAGS.kernels, moe=FLAGS.kernels)
  t0 = time.perf_counter()
  cfg, params = load_model(FLAGS.model)
  if FLAGS.kernels == "auto":  # (step_program's pages are 64 tokens)
    impl = kernels.announce(kernels.resolve_for_params(impl, cfg, params, page_size=64)).choice
  bw = copy_bandwidth(FLAGS.iters)
  # Progress as it goes, and the JSON rewritten after each batch size: a run stopped at a time
  # limit (gpu_check.sh's stages) keeps what it measured and shows where the time went.
  print(f"[{time.perf_counter() - t0:.0f}s] {cfg.display_name} ready, copy {bw / 1e9:.0f} GB/s",
        flush=True)
  rows = []
  result = dict(model=FLAGS.model, config=cfg.display_name, platform=jax.default_backend(),
                device=jax.devices()[0].device_kind, kernels=FLAGS.kernels,
                context=FLAGS.context, copy_bytes_per_s=bw, rows=rows)
  for b in (int(x) for x in FLAGS.batch):
    variant = {"step": impl}
    if FLAGS.ablate is None or str(b) in FLAGS.ablate:
      variant.update(no_attention=dataclasses.replace(impl, attention="zero"),
                     no_moe=dataclasses.replace(impl, moe="zero"),
                     no_attention_no_moe=KernelChoice(attention="zero", moe="zero"))
    widths = [int(x) for x in FLAGS.verify]
    programs = {w: step_program(cfg, params, b, FLAGS.context, impl, w) for w in [1] + widths}
    for w, program in programs.items():  # compiles, each printed (GPU compiles are slow)
      jax.block_until_ready(program())
      print(f"[{time.perf_counter() - t0:.0f}s] batch {b}: width {w} compiled", flush=True)
    t = {name: (_median_time(programs[1], FLAGS.iters) if name == "step" else
                step_time(cfg, params, b, FLAGS.context, k, FLAGS.iters))
         for name, k in variant.items()}
    nan = float("nan")
    floor_bytes = bytes_floor(cfg, params, b, FLAGS.context)
    row = dict(batch=b, step_s=t["step"], attention_s=t["step"] - t.get("no_attention", nan),
               moe_s=t["step"] - t.get("no_moe", nan), other_s=t.get("no_attention_no_moe", nan),
               floor_bytes=floor_bytes, floor_s=floor_bytes / bw,
               step_over_floor=t["step"] / (floor_bytes / bw))
    # Widths timed in interleaved rounds with a width-1 step of their own (load from elsewhere
    # on the machine slows all alike), each over that step.
    # (the width-1 program is the step's: compiled once)
    tv = costs.time_rounds(programs, FLAGS.iters) if widths else {}
    for width in widths:
      row[f"verify{width}_over_step"] = tv[width] / tv[1]
      row[f"verify{width}_over_floor"] = tv[width] / (
          bytes_floor(cfg, params, b, FLAGS.context, width) / bw)
    if FLAGS.host:
      row["engine_step_s"] = host_overhead(cfg, params, b, FLAGS.context, impl)
      row["host_s"] = row["engine_step_s"] - t["step"]
    rows.append(row)
    print(f"[{time.perf_counter() - t0:.0f}s] batch {b}: step {1e3 * row['step_s']:.3f} ms",
          flush=True)
    if FLAGS.out:
      with open(FLAGS.out, "w") as fh:
        json.dump(result, fh, indent=1)
  print(f"{result['config']} on {result['device']} ({result['platform']}), kernels="
        f"{FLAGS.kernels}, context {FLAGS.context}, copy bandwidth {bw / 1e9:.1f} GB/s")
  print(f"{'batch':>5} {'step ms':>8} {'attn ms':>8} {'moe ms':>8} {'other ms':>9} "
        f"{'host ms':>8} {'floor ms':>9} {'step/floor':>10}")
  for r in rows:
    print(f"{r['batch']:>5} {1e3 * r['step_s']:>8.3f} {1e3 * r['attention_s']:>8.3f} "
          f"{1e3 * r['moe_s']:>8.3f} {1e3 * r['other_s']:>9.3f} "
          f"{1e3 * r.get('host_s', float('nan')):>8.3f} {1e3 * r['floor_s']:>9.3f} "
          f"{r['step_over_floor']:>10.1f}")
  if FLAGS.verify:
    print("verify forward over T positions per row, in decode steps (and over its own floor):")
    print(f"{'batch':>5} " + " ".join(f"{'T=' + w:>14}" for w in FLAGS.verify))
    for r in rows:
      print(f"{r['batch']:>5} " + " ".join(
          f"{r[f'verify{w}_over_step']:>7.2f} ({r[f'verify{w}_over_floor']:>4.1f})"
          for w in FLAGS.verify))


if __name__ == "__main__":
  define_flags()
  app.run(main)
