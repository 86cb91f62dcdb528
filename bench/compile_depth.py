"""Compile time against depth: tiny DeepSeek-V3 checkpoints of 4 and 61 layers.

    python -m bench.compile_depth                              # this tree only
    python -m bench.compile_depth --base=BASE_TREE            # this tree vs another, A/B

Writes one checkpoint per depth in transformers' layout (`engine.model.hf_export`, experts as
transformers 5 saves them; tiny widths, bf16, a dense first layer then MoE layers), then, in a
fresh process per measurement (no in-memory or persistent compilation cache), loads it and
times the lowering and the compilation of two programs built from the model's own functions:

* prefill: `forward_logits` over one 64-token row (the cache donated);
* decode: 8 greedy steps of one row in a `lax.fori_loop` (forward, LM head, argmax).

and the whole cold command a new user runs, `python -m engine.generate --checkpoint=DIR
--prompt_ids=5,17,42,99,3 --max_new_tokens=8 --temperature=0 --ignore_eos --json` with
`MOEJAX_COMPILATION_CACHE_DIR=""` (wall seconds of the process). With `--base`, every
measurement runs for both trees in turn (A B A B ...: the host may be shared), the other tree
imported through PYTHONPATH. Prints a table (medians over `--rounds`) and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS


def user_cache_dir(*parts: str) -> str:
  """`engine.runtime.compile_cache.user_cache_dir`, restated: the `--measure` process imports
  the other tree's `engine`, which may predate it."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "moejax", *parts)


flags.DEFINE_list("layers", ["4", "61"], "Depths to measure.")
flags.DEFINE_string("workdir", user_cache_dir("compile_depth"),
                    "Where the checkpoints are written.")
flags.DEFINE_string("base", None, "Another source tree (e.g. a worktree of the commit before) "
                    "measured beside this one.")
flags.DEFINE_integer("rounds", 3, "Measurements per (tree, depth); medians are reported.")
flags.DEFINE_bool("generate", True, "Also time the cold `python -m engine.generate` command.")
flags.DEFINE_string("json", user_cache_dir("compile_depth.json"), "Where to write the results.")
flags.DEFINE_string("measure", None, "(internal) time the programs of this checkpoint, print "
                    "one JSON line.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFILL_TOKENS = 64
DECODE_STEPS = 8


def tiny_deepseek_v3(layers: int) -> dict:
  """A DeepSeek-V3 config.json with tiny widths: layer 0 dense, the rest MoE (8 experts)."""
  return dict(
      architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=1024,
      hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
      num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=4,
      num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
      qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
      n_shared_experts=1, n_group=2, topk_group=1, topk_method="noaux_tc",
      scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
      num_nextn_predict_layers=0, rms_norm_eps=1e-6, max_position_embeddings=4096,
      rope_theta=10000.0, rope_interleave=True, tie_word_embeddings=False,
      torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def write_checkpoint(layers: int) -> str:
  """The checkpoint of `layers` layers under --workdir (written once)."""
  out = os.path.join(FLAGS.workdir, f"deepseek_v3_{layers}l")
  if os.path.exists(os.path.join(out, "model.safetensors")):
    return out
  import jax.numpy as jnp
  import ml_dtypes
  from engine.model.config import config_from_dict
  from engine.model.hf_export import export_hf
  from engine.model.params import init_params
  cfg_dict = tiny_deepseek_v3(layers)
  params = init_params(config_from_dict(cfg_dict), seed=0, dtype=jnp.float32, scale=0.5)
  export_hf(cfg_dict, params, out, layout="stacked", dtype=ml_dtypes.bfloat16)
  return out


def measure(ckpt: str) -> dict:
  """Lower and compile seconds of the prefill and decode programs (this process is fresh)."""
  import jax
  import engine
  jax.config.update("jax_enable_compilation_cache", False)
  t0 = time.perf_counter()
  model = engine.load(ckpt, progress=False)
  load_s = time.perf_counter() - t0
  return {"load_s": load_s, **program_seconds(model.config, model.params)}


def depth_programs(cfg, params, impl=None, scan_layers: bool = True) -> dict:
  """{"prefill", "decode"}: each (jitted program, its arguments), kernels `impl` (default:
  the reference), scanned or unrolled. `params` may be ShapeDtypeStructs (a CUDA export)."""
  import jax
  import jax.numpy as jnp
  from engine.model.cache import contiguous_page_table, init_cache
  from engine.model.kernels import REFERENCE
  from engine.model.transformer import compute_logits, forward, forward_logits
  impl = impl or REFERENCE
  page = 16
  table = jnp.asarray(contiguous_page_table(1, PREFILL_TOKENS + DECODE_STEPS, page))
  cache = init_cache(cfg, int(table.size), page, params["embed"].dtype)
  ones = jnp.ones((1,), jnp.int32)

  @jax.jit
  def prefill(params, cache, tokens, start, n_new, table):
    return forward_logits(params, cache, tokens, start, n_new, table, cfg=cfg, impl=impl,
                          scan_layers=scan_layers)

  @jax.jit
  def decode(params, cache, token, start, table):
    def step(i, carry):
      cache, token = carry
      hidden, cache = forward(params, cache, token[:, None], start + i, ones, table, cfg=cfg,
                              impl=impl, scan_layers=scan_layers)
      return cache, jnp.argmax(compute_logits(params, hidden[:, 0], cfg), -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, DECODE_STEPS, step, (cache, token))

  return {
      "prefill": (prefill, (params, cache, jnp.ones((1, PREFILL_TOKENS), jnp.int32),
                            jnp.zeros((1,), jnp.int32), jnp.full((1,), PREFILL_TOKENS, jnp.int32),
                            table)),
      "decode": (decode, (params, cache, ones, jnp.full((1,), PREFILL_TOKENS, jnp.int32), table)),
  }


def lower_compile(fn, args) -> dict:
  """{"lower_s", "compile_s", "hlo_instructions"} of one program (`depth_programs`' value)."""
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1,
          "hlo_instructions": compiled.as_text().count("\n  %")}


def program_seconds(cfg, params, impl=None, scan_layers: bool = True) -> dict:
  """Lower and compile seconds of the prefill and decode programs, one after the other."""
  out = {"layers": cfg.num_layers}
  for name, (fn, args) in depth_programs(cfg, params, impl, scan_layers).items():
    out[name] = lower_compile(fn, args)
  return out


def _git_head(tree: str) -> str:
  try:
    return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], text=True,
                          capture_output=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "?"


def _env(tree: str, cache_off: bool = False) -> dict:
  env = dict(os.environ, PYTHONPATH=tree)
  if cache_off:
    env["MOEJAX_COMPILATION_CACHE_DIR"] = ""
  return env


def _run_measure(tree: str, ckpt: str) -> dict:
  out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--measure={ckpt}"],
                       env=_env(tree, cache_off=True), cwd=tree, capture_output=True, text=True,
                       check=False)
  if out.returncode:
    raise RuntimeError(f"measuring {ckpt} with {tree} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _run_generate(tree: str, ckpt: str) -> float:
  cmd = [sys.executable, "-m", "engine.generate", f"--checkpoint={ckpt}",
         "--prompt_ids=5,17,42,99,3", "--max_new_tokens=8", "--temperature=0", "--ignore_eos",
         "--json"]
  t0 = time.perf_counter()
  out = subprocess.run(cmd, env=_env(tree, cache_off=True), cwd=tree, capture_output=True,
                       text=True, check=False)
  wall = time.perf_counter() - t0
  if out.returncode:
    raise RuntimeError(f"{' '.join(cmd)} with {tree} failed:\n{out.stderr[-3000:]}")
  json.loads(out.stdout.strip().splitlines()[-1])  # (its output is a JSON object)
  return wall


def main(argv: list[str]) -> None:
  del argv
  if FLAGS.measure:
    print(json.dumps(measure(FLAGS.measure)))
    return
  trees = {"this": ROOT}
  if FLAGS.base:
    trees = {"base": os.path.abspath(FLAGS.base), "this": ROOT}
  ckpts = {int(n): write_checkpoint(int(n)) for n in FLAGS.layers}
  samples: dict[str, list] = {}
  for _ in range(FLAGS.rounds):
    for layers, ckpt in ckpts.items():
      for name, tree in trees.items():  # interleaved: A B A B
        m = _run_measure(tree, ckpt)
        for prog in ("prefill", "decode"):
          for k in ("lower_s", "compile_s", "hlo_instructions"):
            samples.setdefault(f"{name}/{layers}/{prog}/{k}", []).append(m[prog][k])
        if FLAGS.generate:
          samples.setdefault(f"{name}/{layers}/generate_s", []).append(_run_generate(tree, ckpt))
  med = {k: statistics.median(v) for k, v in samples.items()}
  result = {"trees": {n: {"path": t, "commit": _git_head(t)} for n, t in trees.items()},
            "rounds": FLAGS.rounds, "medians": med, "samples": samples}
  print(f"{'tree':6} {'layers':>6} {'program':8} {'lower s':>8} {'compile s':>9} "
        f"{'HLO instr':>9}")
  for name in trees:
    for layers in ckpts:
      for prog in ("prefill", "decode"):
        key = f"{name}/{layers}/{prog}"
        print(f"{name:6} {layers:6d} {prog:8} {med[key + '/lower_s']:8.2f} "
              f"{med[key + '/compile_s']:9.2f} {med[key + '/hlo_instructions']:9.0f}")
  if FLAGS.generate:
    print(f"\n{'tree':6} " + " ".join(f"{f'generate {n}L s':>14}" for n in ckpts)
          + f" {'deep/shallow':>12}")
    for name in trees:
      walls = [med[f"{name}/{n}/generate_s"] for n in ckpts]
      print(f"{name:6} " + " ".join(f"{w:14.2f}" for w in walls)
            + f" {walls[-1] / walls[0]:12.2f}")
  with open(FLAGS.json, "w") as fh:
    json.dump(result, fh, indent=2)
  print(f"wrote {FLAGS.json}")


if __name__ == "__main__":
  app.run(main)
