"""Trains a bundled demo model on the Python standard library source.

    python -m checkpoints.demo_corpus --out=checkpoints/demo          # tokenizer + split, once
    python -m checkpoints.train_demo --model=target --steps=1500      # DeepSeek-V3 arch + MTP
    python -m checkpoints.train_demo --model=draft --steps=1500       # small dense Llama

The model is the engine's own forward pass (`engine.model.transformer.forward`, a fresh paged
cache per batch), trained in float32 with AdamW; the loss is next-token cross-entropy plus
`--mtp_weight` times the MTP layer's next-next-token cross-entropy (DeepSeek-V3). Routed-expert
load is balanced the DeepSeek-V3 way, without an auxiliary loss: after every step each MoE
layer's `e_score_correction_bias` moves by `--bias_update_rate` against its experts' load.

Deterministic: batch k is drawn from numpy's generator seeded with (seed, k), so a run that is
interrupted and resumed from `--workdir` (Orbax, every `--save_every` steps) reproduces the
uninterrupted one (and loads its compiled training step from JAX's persistent cache,
`--compilation_cache_dir`, as the engine's entry points do). At the end the weights are
written to `--out` in the project's Orbax format (bfloat16, with config.json and tokenizer),
with `train_report.json` beside them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging

from checkpoints import demo_corpus
from checkpoints.demo_models import MODELS
from engine.model.cache import init_cache
from engine.model.config import ModelConfig, config_from_dict
from engine.model.params import init_params
from engine.model.transformer import (compute_logits, forward_counting_experts,
                                      forward_mtp_counting_experts)
from engine.runtime import compile_cache

FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_enum("model", "target", sorted(MODELS), "Which demo model to train.")
  flags.DEFINE_string("config_json", None, "Train this config.json instead of --model's "
                      "(its vocab_size must match the tokenizer).")
  flags.DEFINE_string("out", None, "Output checkpoint dir (default checkpoints/demo/<model>).")
  flags.DEFINE_string("workdir", None, "Resumable training state (default "
                      "~/.cache/moejax/train/<model>).")
  flags.DEFINE_string("tokenizer", "checkpoints/demo/tokenizer.json", "tokenizer.json to use.")
  flags.DEFINE_string("corpus_cache", demo_corpus.default_cache_dir(),
                      "Token array cache directory.")
  flags.DEFINE_string("init_from", None, "Start from this moejax checkpoint's weights (a new "
                      "optimizer and schedule: a second training phase) instead of random ones.")
  flags.DEFINE_integer("steps", 1500, "Optimizer steps.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 8, "Sequences per step.", lower_bound=1)
  flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.", lower_bound=8)
  flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
  flags.DEFINE_integer("warmup", 100, "Warm-up steps.")
  flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only).")
  flags.DEFINE_float("mtp_weight", 0.3, "Weight of the MTP loss.")
  flags.DEFINE_float("bias_update_rate", 1e-3, "DeepSeek load-balancing bias step.")
  flags.DEFINE_integer("seed", 0, "Seed of the initial weights and the batch order.")
  flags.DEFINE_integer("save_every", 100, "Save the training state every N steps.")
  flags.DEFINE_integer("eval_windows", 0, "Held-out windows for the final evaluation "
                       "(0: the whole held-out split).")
  flags.DEFINE_float("max_minutes", 0.0, "Stop (and save) after this much training time; 0: "
                     "no limit.")
  flags.DEFINE_string("compilation_cache_dir", compile_cache.default_dir(),
                      "JAX's persistent compilation cache: a resumed run loads the training "
                      f"step instead of compiling it again (\"\": off; default "
                      f"${compile_cache.ENV} or ~/.cache/moejax/jax_cache).")


# ---- the training step ----------------------------------------------------------------------

def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def model_losses(params: Any, windows: jax.Array, cfg: ModelConfig) -> dict[str, jax.Array]:
  """windows [B, T+2] int32 -> losses, router counts and the pieces evaluation needs."""
  b, t = windows.shape[0], windows.shape[1] - 2
  tokens, targets = windows[:, :t], windows[:, 1:t + 1]
  # A fresh zero cache inside the traced step: one page of t tokens per row.
  cache = init_cache(cfg, num_pages=b, page_size=t, dtype=jnp.float32)
  page_table = jnp.arange(b, dtype=jnp.int32)[:, None]
  zeros, full = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
  hidden, cache, counts = forward_counting_experts(params, cache, tokens, zeros, full,
                                                   page_table, cfg=cfg)
  logits = compute_logits(params, hidden, cfg)
  out = {"ce": _cross_entropy(logits, targets), "counts": counts, "logits": logits}
  if cfg.num_nextn_predict_layers:
    m, _, mcounts = forward_mtp_counting_experts(params, cache, hidden, targets, zeros, full,
                                                 page_table, cfg=cfg)
    mlogits = compute_logits(params, m, cfg)
    out["mtp_ce"] = _cross_entropy(mlogits, windows[:, 2:t + 2])
    out["mtp_logits"] = mlogits
    out["counts"] = jnp.concatenate([counts, mcounts], axis=0)
  return out


def _router_bias_paths(params: Any) -> list[tuple[str, int]]:
  """(group, index) of every stack of MoE layers / MTP layer with a correction bias, in
  router-count order (a stack's bias [n, E] covers n rows of the counts, in layer order)."""
  found = [("stacks", i) for i, l in enumerate(params["stacks"]) if "router_bias" in l.get(
      "moe", {})]
  found += [("mtp", i) for i, l in enumerate(params.get("mtp", [])) if "router_bias" in l.get(
      "moe", {})]
  return found


def make_optimizer(params: Any, steps: int, lr: float, warmup: int,
                   weight_decay: float) -> optax.GradientTransformation:
  """AdamW with warm-up and cosine decay; no decay on vectors; the correction bias frozen
  (it is set by the balancing rule, not by gradients)."""
  warmup = min(warmup, max(steps // 10, 1))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                end_value=lr * 0.1)
  decay = jax.tree_util.tree_map_with_path(
      lambda p, x: x.ndim >= 2 and "router" not in str(p[-1]), params)
  labels = jax.tree_util.tree_map_with_path(
      lambda p, x: "frozen" if "router_bias" in str(p[-1]) else "train", params)
  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay)
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels),
  )


def make_train_step(cfg: ModelConfig, opt: optax.GradientTransformation, mtp_weight: float,
                    bias_rate: float):
  def loss_fn(params, windows):
    out = model_losses(params, windows, cfg)
    loss = out["ce"] + mtp_weight * out.get("mtp_ce", 0.0)
    return loss, {k: out[k] for k in ("ce", "mtp_ce", "counts") if k in out}

  @jax.jit
  def step(params, opt_state, windows):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, windows)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # Auxiliary-loss-free balancing: overloaded experts' bias goes down, idle ones' up.
    row = 0
    for group, i in _router_bias_paths(params):
      moe = params[group][i]["moe"]
      bias = moe["router_bias"]
      n = bias.shape[0] if bias.ndim == 2 else 1
      load = aux["counts"][row:row + n].astype(jnp.float32).reshape(bias.shape)
      moe["router_bias"] = bias - bias_rate * jnp.sign(
          load - jnp.mean(load, axis=-1, keepdims=True))
      row += n
    metrics = {"loss": loss, "ce": aux["ce"], "mtp_ce": aux.get("mtp_ce", jnp.float32(0)),
               "max_load": jnp.max(aux["counts"]) / jnp.maximum(jnp.mean(
                   aux["counts"].astype(jnp.float32)), 1) if aux["counts"].size else 0.0}
    return params, opt_state, metrics

  return step


# ---- data -----------------------------------------------------------------------------------

def batch_windows(ids: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
  """Batch `step`: `batch` random windows of seq + 2 tokens, a function of (seed, step) only."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(ids) - seq - 2, size=batch)
  return np.stack([ids[s:s + seq + 2] for s in starts]).astype(np.int32)


def heldout_windows(ids: np.ndarray, seq: int, limit: int = 0) -> np.ndarray:
  """Non-overlapping windows covering the held-out split (the last partial one dropped)."""
  n = (len(ids) - 2) // seq
  if limit:
    n = min(n, limit)
  return np.stack([ids[i * seq:i * seq + seq + 2] for i in range(n)]).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _eval_stats(params: Any, w: jax.Array, cfg: ModelConfig) -> dict[str, jax.Array]:
  """One batch's evaluation statistics (module level: one compiled program for every
  `evaluate` call at the same shapes)."""
  out = model_losses(params, w, cfg)
  r = {"ce": out["ce"]}
  if "mtp_logits" in out:
    mtp_top = jnp.argmax(out["mtp_logits"][:, :-1], -1)  # predicts token i+2 at position i
    main_next = jnp.argmax(out["logits"][:, 1:], -1)  # target's prediction of token i+2
    r["mtp_ce"] = out["mtp_ce"]
    r["mtp_agree"] = jnp.mean(mtp_top == main_next)
    r["mtp_acc"] = jnp.mean(mtp_top == w[:, 2:-1])
  return r


def evaluate(params: Any, cfg: ModelConfig, windows: np.ndarray, batch: int) -> dict[str, float]:
  """Held-out cross-entropy (nats/token), and for MTP models the MTP cross-entropy, MTP top-1
  accuracy and MTP top-1 agreement with the target's own next prediction."""
  totals: dict[str, float] = {}
  n = 0
  for k in range(0, len(windows) - batch + 1, batch):
    r = jax.device_get(_eval_stats(params, jnp.asarray(windows[k:k + batch]), cfg=cfg))
    for key, v in r.items():
      totals[key] = totals.get(key, 0.0) + float(v)
    n += 1
  return {k: v / max(n, 1) for k, v in totals.items()} | {"windows": n * batch}


# ---- driver ---------------------------------------------------------------------------------

def _read_report(ckpt_dir: str) -> dict[str, Any] | None:
  path = os.path.join(ckpt_dir, "train_report.json")
  if not os.path.exists(path):
    return None
  with open(path) as fh:
    report = json.load(fh)
  report.pop("history", None)
  return {k: v for k, v in report.items() if k in (
      "steps", "tokens_seen", "train_seconds", "lr", "seed", "batch_size", "seq_len", "phases")}


class _Progress:
  """A one-line progress bar on a terminal, a log line every 50 steps otherwise."""

  def __init__(self, total: int, start: int):
    self.total, self.start, self.t0 = total, start, time.time()
    self.tty = sys.stderr.isatty()

  def update(self, step: int, metrics: dict[str, float], tokens_per_step: int) -> None:
    done = step - self.start
    if not self.tty and step % 50 and step != self.total:
      return
    dt = time.time() - self.t0
    rate = done / dt if dt > 0 else 0.0
    eta = (self.total - step) / rate if rate else 0.0
    width = 30
    bar = "#" * int(width * step / self.total)
    msg = (f"[{bar:<{width}}] {step}/{self.total} loss {metrics['loss']:.3f} ce "
           f"{metrics['ce']:.3f} mtp {metrics['mtp_ce']:.3f} | {rate * tokens_per_step:.0f} "
           f"tok/s | eta {eta / 60:.1f} min")
    print(("\r" + msg) if self.tty else msg, end="" if self.tty else "\n", file=sys.stderr,
          flush=True)


def main(argv: list[str]) -> None:
  del argv
  import orbax.checkpoint as ocp
  compile_cache.enable(FLAGS.compilation_cache_dir)  # before anything compiles
  from engine.model.orbax_io import save_orbax

  cfg_dict = MODELS[FLAGS.model]
  if FLAGS.config_json:
    with open(FLAGS.config_json) as fh:
      cfg_dict = json.load(fh)
  cfg = config_from_dict(cfg_dict)
  out_dir = FLAGS.out or os.path.join("checkpoints", "demo", FLAGS.model)
  workdir = os.path.abspath(FLAGS.workdir or compile_cache.user_cache_dir("train", FLAGS.model))
  tokenizer = demo_corpus.load_tokenizer(FLAGS.tokenizer)
  train_files, heldout_files = demo_corpus.split(demo_corpus.stdlib_files())
  train_ids, heldout_ids = demo_corpus.tokenized_corpus(FLAGS.corpus_cache, tokenizer,
                                                        train_files, heldout_files)
  logging.info("corpus: %d train tokens, %d held-out tokens", len(train_ids), len(heldout_ids))

  previous = None
  if FLAGS.init_from:
    from engine.model.orbax_io import restore_orbax
    params = restore_orbax(FLAGS.init_from, cfg, dtype=jnp.float32)
    previous = _read_report(FLAGS.init_from)
  else:
    params = init_params(cfg, seed=FLAGS.seed, dtype=jnp.float32)
    # init_params draws embeddings N(0, 1) (peaked logits for tests); a tied head then starts
    # with huge logits. Training starts from the usual small embedding instead.
    params["embed"] = params["embed"] * 0.02
  n_params = sum(x.size for x in jax.tree.leaves(params))
  opt = make_optimizer(params, FLAGS.steps, FLAGS.lr, FLAGS.warmup, FLAGS.weight_decay)
  opt_state = opt.init(params)
  manager = ocp.CheckpointManager(workdir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
  start_step, elapsed = 0, 0.0
  if manager.latest_step() is not None:
    start_step = manager.latest_step()
    state = manager.restore(start_step, args=ocp.args.StandardRestore(
        {"params": params, "opt_state": opt_state, "elapsed": 0.0}))
    params, opt_state, elapsed = state["params"], state["opt_state"], float(state["elapsed"])
    logging.info("resumed from %s at step %d", workdir, start_step)

  # One placement however the state was made (fresh, --init_from, or restored from --workdir,
  # where Orbax returns arrays on a mesh-less NamedSharding): the training step then lowers to
  # the same program, and a resumed run loads it from the compilation cache, not compiles it.
  params, opt_state = jax.device_put((params, opt_state), jax.devices()[0])
  step_fn = make_train_step(cfg, opt, FLAGS.mtp_weight, FLAGS.bias_update_rate)
  progress = _Progress(FLAGS.steps, start_step)
  tokens_per_step = FLAGS.batch_size * FLAGS.seq_len
  t_start = time.time()
  history: list[dict[str, float]] = []  # this run's part (a resumed run starts it afresh)
  metrics: dict[str, float] = {}
  step = start_step
  while step < FLAGS.steps:
    windows = batch_windows(train_ids, step, FLAGS.batch_size, FLAGS.seq_len, FLAGS.seed)
    params, opt_state, metrics = step_fn(params, opt_state, jnp.asarray(windows))
    step += 1
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    progress.update(step, metrics, tokens_per_step)
    if step % 50 == 0 or step == FLAGS.steps:
      history.append({"step": step, **metrics})
    over_time = FLAGS.max_minutes and (time.time() - t_start) / 60 > FLAGS.max_minutes
    if step % FLAGS.save_every == 0 or step == FLAGS.steps or over_time:
      manager.save(step, args=ocp.args.StandardSave(
          {"params": params, "opt_state": opt_state,
           "elapsed": elapsed + time.time() - t_start}))
      manager.wait_until_finished()
    if over_time:
      logging.warning("stopping at step %d after --max_minutes; rerun to resume", step)
      return
  train_seconds = elapsed + time.time() - t_start
  print(file=sys.stderr)

  eval_windows = heldout_windows(heldout_ids, FLAGS.seq_len, FLAGS.eval_windows)
  heldout = evaluate(params, cfg, eval_windows, FLAGS.batch_size)
  train_eval = evaluate(params, cfg, heldout_windows(train_ids, FLAGS.seq_len,
                                                     len(eval_windows)), FLAGS.batch_size)
  bf16 = jax.tree_util.tree_map_with_path(
      lambda p, x: x if "router" in str(p[-1]) else x.astype(jnp.bfloat16), params)
  save_orbax(out_dir, cfg_dict, bf16, tokenizer_src_dir=os.path.dirname(FLAGS.tokenizer),
             overwrite=True)
  report = {
      "model": FLAGS.model, "params": int(n_params),
      "bytes_bf16": int(sum(x.nbytes for x in jax.tree.leaves(bf16))),
      "steps": FLAGS.steps, "batch_size": FLAGS.batch_size, "seq_len": FLAGS.seq_len,
      "tokens_seen": FLAGS.steps * tokens_per_step, "train_seconds": round(train_seconds, 1),
      "lr": FLAGS.lr, "mtp_weight": FLAGS.mtp_weight, "seed": FLAGS.seed,
      "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(heldout_ids)),
      "heldout": heldout, "train_sample": train_eval, "history": history,
  }
  if previous:
    # A later phase: the report totals all phases and keeps the earlier ones.
    phases = previous.pop("phases", [previous])
    report["phases"] = phases + [{k: report[k] for k in (
        "steps", "tokens_seen", "train_seconds", "lr", "seed", "batch_size", "seq_len")}
                                 | {"init_from": FLAGS.init_from}]
    for key in ("steps", "tokens_seen", "train_seconds"):
      report[key] = sum(ph[key] for ph in report["phases"])
  with open(os.path.join(out_dir, "train_report.json"), "w") as fh:
    json.dump(report, fh, indent=1)
  print(json.dumps({k: report[k] for k in ("model", "params", "train_seconds", "heldout")}))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
