"""Trains the demo target's EAGLE-3 head (`checkpoints/demo/eagle3`) with the training-time-test
objective, and writes it in the published MLA layout (`config.json` + `model.safetensors`,
`midlayer.*` names, bf16), reusing the target's embedding (the head ships no `embed_tokens`).

    python -m checkpoints.train_eagle3 --steps=1500 --out=checkpoints/demo/eagle3
    # the shipped head's last phase (from the previous head; data cached in --data):
    python -m checkpoints.train_eagle3 --sequences=4096 --new_tokens=96 --greedy_only \
        --steps=1000 --lr=1e-3 --draft_vocab=2048 --data=eagle3_data.npz \
        --init_from=checkpoints/demo/eagle3 --out=eagle3_head

Data: prompts cut from the demo corpus' train split, continued by the target itself
(`engine.generate`, float32; half greedy, half sampled at temperature 1), as the published Kimi
heads were trained on regenerated responses. Objective (EAGLE-3's training-time test, TorchSpec's
`eagle3_trainer.py`): for K unrolled steps k = 0 .. K - 1, the head runs on (the embedding of the
token k + 1 ahead, the target's fused aux states at k = 0, its own previous output after), its
attention seeing the step-0 prefix plus its own earlier steps' entries at the same index (the
"diagonal"), exactly as chained drafting at serving time does; loss_k is the soft cross-entropy
against the target's distribution of the token k + 2 ahead; total = sum 0.8^k loss_k.

The target is frozen, so its aux residual streams and final hidden state are computed once per
sequence (`precompute`) and a step runs only the head (`head_losses`; `losses`, the target run
inside, is the reference it must equal). With `--draft_vocab` the head drafts from the training
data's most frequent ids (`d2t` / `t2d`), its lm_head a quarter the size or less.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

from absl import app, flags
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from safetensors.numpy import save_file

from checkpoints import demo_corpus
from engine.model import eagle3
from engine.model.cache import init_cache
from engine.model.eagle3_loader import expected_tensors, load_eagle3
from engine.model.rope import apply_rope, rope_cos_sin
from engine.model.transformer import compute_logits, forward_hidden_states, rms_norm
from pallas_kernels.moe.reference import swiglu_mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "checkpoints", "demo")
AUX_IDS = [2, 3, 4]  # input convention: entering layers 2 and 3, and the 4th layer's output
TTT_DECAY = 0.8


def _define_flags() -> None:
  flags.DEFINE_string("target", os.path.join(DEMO, "target"), "Target checkpoint.")
  flags.DEFINE_string("out", os.path.join(DEMO, "eagle3"), "Head directory to write.")
  flags.DEFINE_integer("steps", 1500, "Optimizer steps.")
  flags.DEFINE_integer("batch", 8, "Sequences per step.")
  flags.DEFINE_integer("ttt", 3, "Unrolled training-time-test steps (K).")
  flags.DEFINE_integer("sequences", 512, "Target-generated sequences.")
  flags.DEFINE_integer("prompt_len", 32, "Prompt tokens cut from the train split.")
  flags.DEFINE_integer("new_tokens", 160, "Tokens the target generates per sequence.")
  flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
  flags.DEFINE_integer("intermediate", 640, "The head's MLP width.")
  flags.DEFINE_integer("seed", 0, "Seed.")
  flags.DEFINE_string("init_from", None, "A head directory to start from (a second phase).")
  flags.DEFINE_bool("greedy_only", False, "Only greedy continuations (default: half sampled).")
  flags.DEFINE_integer("draft_vocab", 0, "A reduced draft vocabulary of this many ids (the "
                       "training data's most frequent; 0: the target's full vocabulary).")
  flags.DEFINE_string("data", None, "An .npz of generated sequences: read when it exists, "
                      "else written after generating.")
  flags.DEFINE_string("corpus_cache", demo_corpus.default_cache_dir(), "Tokenized corpus.")


# ---- the head as published -------------------------------------------------------------------

def head_config(target_dir: str, intermediate: int) -> dict[str, Any]:
  """config.json of an MLA head (lightseekorg/kimi-k2.5-eagle3-mla's layout) for the target in
  `target_dir` (a DeepSeek-V3 config)."""
  with open(os.path.join(target_dir, "config.json")) as fh:
    return head_config_dict(json.load(fh), intermediate)


def head_config_dict(raw: dict[str, Any], intermediate: int,
                     aux_ids: list[int] | None = None) -> dict[str, Any]:
  """`head_config` from the target's config.json as a dict."""
  keep = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
          "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_interleave", "max_position_embeddings", "hidden_size", "vocab_size",
          "bos_token_id", "eos_token_id", "pad_token_id")
  out = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3"}
  out.update({k: raw[k] for k in keep if k in raw})
  out.update(num_key_value_heads=raw["num_attention_heads"], intermediate_size=intermediate,
             num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False,
             draft_vocab_size=raw["vocab_size"], torch_dtype="bfloat16",
             eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids or AUX_IDS,
                           "use_aux_hidden_state": True})
  return out


def initial_tensors(conf: dict[str, Any], tcfg: Any, tparams: Any, seed: int
                    ) -> dict[str, np.ndarray]:
  """HF-named float32 tensors: norms 1, matrices N(0, 1/fan_in), lm_head the target's."""
  from engine.model.eagle3_config import eagle3_config_from_dict
  hcfg = eagle3_config_from_dict(conf, tcfg)
  rng = np.random.default_rng(seed)
  out = {}
  for name, (_, shape, _, _) in expected_tensors(hcfg).items():
    if name == "embed_tokens.weight":
      continue
    if name == "lm_head.weight":
      out[name] = np.asarray(tparams["lm_head"], np.float32).T.copy()
    elif len(shape) == 1:
      out[name] = np.ones(shape, np.float32)
    else:
      out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
  return out


def to_tensors(hcfg: Any, params: Any) -> dict[str, np.ndarray]:
  """The params pytree back to HF names and shapes (the loader's transforms inverted through
  an index map), the embedding left out."""
  out = {}
  for name, (path, hf_shape, fn, _) in expected_tensors(hcfg).items():
    if name == "embed_tokens.weight":
      continue
    leaf = params
    for k in path:
      leaf = leaf[int(k)] if isinstance(leaf, (jax.Array, np.ndarray)) else leaf[k]
    index = fn(np.arange(int(np.prod(hf_shape))).reshape(hf_shape))
    flat = np.empty(int(np.prod(hf_shape)), np.float32)
    flat[np.asarray(index).ravel()] = np.asarray(leaf, np.float32).ravel()
    out[name] = flat.reshape(hf_shape)
  return out


def save_head(path: str, conf: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(conf, fh, indent=2)
  save_file({k: v if k in ("d2t", "t2d") else v.astype(ml_dtypes.bfloat16)
             for k, v in tensors.items()},
            os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def vocab_map(used: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
  """`d2t` (int64 offsets: target id = draft id + d2t) and `t2d` (bool [V]) of the sorted
  target ids `used` [Vd]."""
  t2d = np.zeros(vocab_size, bool)
  t2d[used] = True
  return {"d2t": (used.astype(np.int64) - np.arange(len(used))), "t2d": t2d}


def reduce_vocab(conf: dict[str, Any], tensors: dict[str, np.ndarray], vocab_size: int,
                 used: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """A full-vocabulary head's config and tensors cut to the draft vocabulary `used` (its
  `lm_head` rows kept, `d2t` / `t2d` added)."""
  out = dict(tensors)
  out["lm_head.weight"] = tensors["lm_head.weight"][used]
  out.update(vocab_map(used, vocab_size))
  return dict(conf, draft_vocab_size=len(used)), out


# ---- training-time test ------------------------------------------------------------------------

def _attend(p: Any, x: jax.Array, positions: jax.Array, hcfg: Any, keys: list) -> tuple:
  """MLA (not absorbed) of one unrolled step: x [B, T, 2H] at `positions` [B, T]; `keys`: the
  earlier steps' (k, v) [B, T, nH, *] (step 0's attended causally, later ones on the diagonal).
  Returns (out [B, T, H], this step's (k, v))."""
  lc = hcfg.layer
  dn, dc, eps = lc.qk_nope_head_dim, lc.kv_lora_rank, lc.rms_norm_eps
  q = jnp.einsum("btr,rnd->btnd", rms_norm(x @ p["q_a"], p["q_a_norm"], eps), p["q_b"])
  kv = x @ p["kv_a"]
  cos, sin = rope_cos_sin(lc.rope, lc.rope_dim, positions)
  k_rope = apply_rope(kv[..., dc:], cos, sin, lc.rope.interleave)
  q_rope = apply_rope(q[..., dn:], cos, sin, lc.rope.interleave)
  latent = rms_norm(kv[..., :dc], p["kv_a_norm"], eps)
  k_nope = jnp.einsum("btc,cnd->btnd", latent, p["kv_b"][..., :dn])
  v = jnp.einsum("btc,cnv->btnv", latent, p["kv_b"][..., dn:])
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3]
                                                + k_rope.shape[-1:])], -1)
  qf = jnp.concatenate([q[..., :dn], q_rope], -1)
  mine = (k, v)
  all_keys = keys + [mine]
  t = x.shape[1]
  k0, v0 = all_keys[0]
  s0 = jnp.einsum("btnd,bsnd->bnts", qf, k0) * lc.softmax_scale
  s0 = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], s0, -jnp.inf)
  diag = [jnp.einsum("btnd,btnd->bnt", qf, kj)[..., None] * lc.softmax_scale
          for kj, _ in all_keys[1:]]
  w = jax.nn.softmax(jnp.concatenate([s0] + diag, -1), -1)
  out = jnp.einsum("bnts,bsnv->btnv", w[..., :t], v0)
  for j, (_, vj) in enumerate(all_keys[1:]):
    out = out + w[..., t + j].transpose(0, 2, 1)[..., None] * vj
  return jnp.einsum("btnv,nvh->bth", out, p["o"]), mine


def ttt_logits(params: Any, aux: jax.Array, ids: jax.Array, hcfg: Any, k_steps: int
               ) -> list[jax.Array]:
  """The head's logits [B, T, V] at each unrolled step; aux [B, T, 3H] at positions 0..T-1,
  ids [B, T + K + 1]. Step k at index t: position t + k, token ids[t + k + 1]."""
  lc = hcfg.layer
  eps = lc.rms_norm_eps
  b, t = aux.shape[:2]
  hidden = eagle3.combine_aux(params, aux, hcfg)
  keys, out = [], []
  for k in range(k_steps):
    emb = params["embed"][ids[:, k + 1:k + 1 + t]]
    g = hidden
    if hcfg.norm_before_residual:
      g = rms_norm(g, params["hidden_norm"], eps)
      residual = g
    else:
      residual, g = g, rms_norm(g, params["hidden_norm"], eps)
    x = jnp.concatenate([rms_norm(emb, params["input_norm"], eps), g], -1)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None] + k, (b, t))
    a, kv = _attend(params["attn"], x, positions, hcfg, keys)
    keys.append(kv)
    h = residual + a
    m = params["mlp"]
    h = h + swiglu_mlp(rms_norm(h, params["post_attn_norm"], eps), m["gate"], m["up"],
                       m["down"])
    o = rms_norm(h, params["final_norm"], eps)
    out.append(eagle3.head_logits(params, o, hcfg))
    hidden = o if hcfg.norm_output else h
  return out


def target_states(tparams: Any, tcfg: Any, hcfg: Any, ids: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """(aux [B, L, 3H], the target's final normed hidden [B, L, H]) of ids [B, L] from an empty
  cache: what the head trains on, fixed while it trains (`precompute` keeps them)."""
  b, n = ids.shape
  cache = init_cache(tcfg, b + 1, n, jnp.float32)
  table = jnp.arange(1, b + 1, dtype=jnp.int32)[:, None]
  hidden, _, states = forward_hidden_states(
      tparams, cache, ids, jnp.zeros((b,), jnp.int32), jnp.full((b,), n, jnp.int32), table,
      layers=hcfg.aux_layers, cfg=tcfg)
  return jax.lax.stop_gradient(jnp.concatenate(list(states), -1)), jax.lax.stop_gradient(hidden)


def target_pass(tparams: Any, tcfg: Any, hcfg: Any, ids: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
  """(aux [B, L, 3H], target logits [B, L, V]) of ids [B, L] from an empty cache."""
  aux, hidden = target_states(tparams, tcfg, hcfg, ids)
  return aux, compute_logits(tparams, hidden, tcfg)


def precompute(tparams: Any, tcfg: Any, hcfg: Any, data: np.ndarray, chunk: int = 16
               ) -> tuple[np.ndarray, np.ndarray]:
  """`target_states` of every sequence of data [N, L], once, in chunks: float32 host arrays
  (aux [N, L, 3H], final hidden [N, L, H]). Training then runs only the head."""
  fn = jax.jit(lambda ids: target_states(tparams, tcfg, hcfg, ids))
  aux, final = [], []
  for i in range(0, len(data), chunk):
    a, f = fn(jnp.asarray(data[i:i + chunk]))
    aux.append(np.asarray(a, np.float32))
    final.append(np.asarray(f, np.float32))
  return np.concatenate(aux), np.concatenate(final)


def soft_ce(logits: list[jax.Array], tlogits: jax.Array, used: jax.Array | None = None
            ) -> tuple[jax.Array, dict]:
  """The training-time-test loss: step k's logits [B, T, Vd] against the target's distribution
  of the token k + 2 ahead (tlogits [B, >= T + K, V], index t: the token after t);
  sum 0.8^k CE_k, and per-step CE and top-1 agreement. With a reduced draft vocabulary (`used`
  [Vd]: its target ids) the target's distribution is renormalised over it and positions whose
  target top-1 lies outside it are left out (SpecForge's / TorchSpec's rule); agreement counts
  them as misses."""
  t = logits[0].shape[1]
  total, metrics = 0.0, {}
  for k, lg in enumerate(logits):
    tl = tlogits[:, k + 1:k + 1 + t]
    top = jnp.argmax(tl, -1)
    mine = jnp.argmax(lg, -1)
    if used is None:
      ce = -jnp.mean(jnp.sum(jax.nn.softmax(tl, -1) * jax.nn.log_softmax(lg, -1), -1))
    else:
      inside = jnp.zeros(tl.shape[-1], bool).at[used].set(True)[top]
      per = -jnp.sum(jax.nn.softmax(tl[..., used], -1) * jax.nn.log_softmax(lg, -1), -1)
      ce = jnp.sum(per * inside) / jnp.maximum(jnp.sum(inside), 1)
      mine = used[mine]
    total = total + TTT_DECAY ** k * ce
    metrics[f"ce{k}"] = ce
    metrics[f"agree{k}"] = jnp.mean(mine == top)
  return total, metrics


def draft_vocab(data: np.ndarray, vocab_size: int, n: int) -> np.ndarray:
  """The n most frequent token ids of data (the sorted target ids of a reduced draft
  vocabulary; SpecForge's rule on the training tokens)."""
  counts = np.bincount(data.ravel(), minlength=vocab_size)
  return np.sort(np.argsort(-counts, kind="stable")[:n]).astype(np.int32)


def losses(train: Any, frozen: Any, tparams: Any, ids: jax.Array, *, tcfg: Any, hcfg: Any,
           k_steps: int) -> tuple[jax.Array, dict]:
  """The loss with the target run inside (ids [B, L]): the reference `head_losses` must equal."""
  t = ids.shape[1] - k_steps - 1
  aux, tlogits = target_pass(tparams, tcfg, hcfg, ids)
  logits = ttt_logits(dict(train, **frozen), aux[:, :t], ids, hcfg, k_steps)
  return soft_ce(logits, tlogits, frozen.get("draft_to_target"))


def head_losses(train: Any, frozen: Any, lm_head: jax.Array, aux: jax.Array, final: jax.Array,
                ids: jax.Array, *, hcfg: Any, k_steps: int) -> tuple[jax.Array, dict]:
  """`losses` from `precompute`'s arrays (aux, final [B, L, *] of ids [B, L]): the target's
  logits from its final hidden and its `lm_head` [H, V] (one matmul, no gradient)."""
  t = ids.shape[1] - k_steps - 1
  logits = ttt_logits(dict(train, **frozen), aux[:, :t], ids, hcfg, k_steps)
  tlogits = jnp.einsum("bth,hv->btv", final[:, :t + k_steps], lm_head,
                       preferred_element_type=jnp.float32)
  return soft_ce(logits, jax.lax.stop_gradient(tlogits), frozen.get("draft_to_target"))


def with_earlier_phases(report: dict, init_from: str | None) -> dict:
  """The report with the phases the start head trained in (`earlier_phases`, oldest first,
  their histories dropped), read from its train_report.json."""
  path = init_from and os.path.join(init_from, "train_report.json")
  if not path or not os.path.exists(path):
    return report
  with open(path) as fh:
    prev = json.load(fh)
  earlier = prev.pop("earlier_phases", [])
  if "phase1" in prev:
    earlier.append(prev.pop("phase1"))
  prev.pop("history", None)
  return dict(report, earlier_phases=earlier + [prev])


def generate_data(model: Any, train_ids: np.ndarray, n: int, prompt_len: int, new: int,
                  seed: int) -> np.ndarray:
  """[n, prompt_len + new] target-generated sequences from train-split prompts."""
  import engine
  rng = np.random.default_rng(seed)
  out = []
  for start in range(0, n, 32):
    m = min(32, n - start)
    starts = rng.integers(0, len(train_ids) - prompt_len, m)
    prompts = [[int(x) for x in train_ids[s:s + prompt_len]] for s in starts]
    temp = 0.0 if (start // 32) % 2 == 0 or FLAGS.greedy_only else 1.0
    res = engine.generate(model, prompts, max_new_tokens=new, temperature=temp,
                          seed=seed + start, ignore_eos=True)
    out += [p + list(r.token_ids) for p, r in zip(prompts, res)]
    print(f"data: {len(out)}/{n} sequences", flush=True)
  model.llm.release()
  return np.asarray(out, np.int32)


def main(argv: list[str]) -> None:
  del argv
  import engine
  model = engine.load(FLAGS.target, dtype="float32")
  tcfg, tparams = model.config, model.params
  conf = head_config(FLAGS.target, FLAGS.intermediate)
  if FLAGS.init_from:
    with open(os.path.join(FLAGS.init_from, "config.json")) as fh:
      conf = json.load(fh)
  init_dir = FLAGS.out + ".init"
  save_head(init_dir, conf, initial_tensors(conf, tcfg, tparams, FLAGS.seed))
  hcfg, params = load_eagle3(FLAGS.init_from or init_dir, tcfg, tparams, jnp.float32)
  train_ids, _ = demo_corpus.tokenized_corpus(FLAGS.corpus_cache,
                                               os.path.join(DEMO, "tokenizer.json"))
  t0 = time.time()
  if FLAGS.data and os.path.exists(FLAGS.data):
    saved_data = np.load(FLAGS.data)
    data, gen_s = saved_data["ids"], float(saved_data["seconds"])
  else:
    data = generate_data(model, train_ids, FLAGS.sequences, FLAGS.prompt_len, FLAGS.new_tokens,
                         FLAGS.seed)
    gen_s = time.time() - t0
    if FLAGS.data:
      np.savez(FLAGS.data, ids=data, seconds=gen_s)
  if 0 < FLAGS.draft_vocab < hcfg.draft_vocab_size:  # (rows of the start's lm_head kept)
    conf, tensors = reduce_vocab(conf, to_tensors(hcfg, params), hcfg.draft_vocab_size,
                                 draft_vocab(data[:-16], tcfg.vocab_size, FLAGS.draft_vocab))
    save_head(init_dir, conf, tensors)
    hcfg, params = load_eagle3(init_dir, tcfg, tparams, jnp.float32)
  frozen = {n: params.pop(n) for n in ("embed", "draft_to_target") if n in params}
  k = FLAGS.ttt
  # Step 0 of the unrolled forward is the serving head's first pass (same weights, same logits).
  probe = jnp.asarray(data[:2, :40])
  aux, _ = target_pass(tparams, tcfg, hcfg, probe)
  mine = ttt_logits(dict(params, **frozen), aux[:, :36], probe, hcfg, 1)[0]
  pool = eagle3.init_pool(hcfg, 3, 64, jnp.float32)
  served, _, _ = eagle3.draft_step(dict(params, **frozen), pool, eagle3.combine_aux(
      dict(params, **frozen), aux[:, :36], hcfg), probe[:, 1:37], jnp.zeros(2, jnp.int32),
      jnp.full(2, 36, jnp.int32), jnp.asarray([[1], [2]], jnp.int32), cfg=hcfg)
  np.testing.assert_allclose(np.asarray(mine), np.asarray(served), rtol=2e-4, atol=2e-4)
  # The target's states once per sequence: the steps run only the head.
  t0 = time.time()
  all_aux, all_final = precompute(tparams, tcfg, hcfg, data)
  pre_s = time.time() - t0
  lm_head = tparams["lm_head"]
  schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, max(FLAGS.steps // 20, 1),
                                                FLAGS.steps, end_value=FLAGS.lr * 0.05)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01))
  state = opt.init(params)
  head_loss = functools.partial(head_losses, hcfg=hcfg, k_steps=k)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, aux, final, ids):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: head_loss(p, frozen, lm_head, aux, final, ids), has_aux=True)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, dict(metrics, loss=loss)

  rng = np.random.default_rng(FLAGS.seed + 1)
  n_train = len(data) - 16  # (the last 16: a check on sequences never trained on)
  history = []
  t1 = time.time()
  for i in range(FLAGS.steps):
    pick = np.sort(rng.integers(0, n_train, FLAGS.batch))
    params, state, m = step(params, state, jnp.asarray(all_aux[pick]),
                            jnp.asarray(all_final[pick]), jnp.asarray(data[pick]))
    if i % 100 == 0 or i == FLAGS.steps - 1:
      m = {n: round(float(v), 4) for n, v in m.items()}
      history.append(dict(step=i, **m))
      print(f"step {i}: {m} ({time.time() - t1:.0f} s)", flush=True)
  train_s = time.time() - t1
  _, held_metrics = jax.jit(head_loss)(params, frozen, lm_head, jnp.asarray(all_aux[n_train:]),
                                       jnp.asarray(all_final[n_train:]),
                                       jnp.asarray(data[n_train:]))
  tensors = to_tensors(hcfg, params)
  if "draft_to_target" in frozen:
    tensors.update(vocab_map(np.asarray(frozen["draft_to_target"]), tcfg.vocab_size))
  save_head(FLAGS.out, conf, tensors)
  _, saved = load_eagle3(FLAGS.out, tcfg, tparams, jnp.float32)  # (the export round-trips)
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    y = functools.reduce(lambda node, key: node[key.key], path, saved)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(
        jnp.asarray(x, jnp.bfloat16), np.float32), err_msg=str(path))
  import shutil
  shutil.rmtree(init_dir)
  n_params = sum(int(np.prod(v.shape)) for v in to_tensors(hcfg, params).values())
  vocab = dict(draft_vocab=hcfg.draft_vocab_size)
  if "draft_to_target" in frozen:  # (the held-out sequences' generated tokens it covers)
    vocab["draft_vocab_coverage"] = round(float(np.isin(
        data[n_train:, FLAGS.prompt_len:], np.asarray(frozen["draft_to_target"])).mean()), 4)
  report = dict(model="eagle3 head (MLA, published layout)", params=n_params,
                aux_layer_ids=AUX_IDS, ttt_steps=k, decay=TTT_DECAY, steps=FLAGS.steps,
                batch=FLAGS.batch, sequences=len(data), prompt_len=FLAGS.prompt_len,
                new_tokens=data.shape[1] - FLAGS.prompt_len, lr=FLAGS.lr,
                generate_seconds=round(gen_s, 1), precompute_seconds=round(pre_s, 1), **vocab,
                init_from=FLAGS.init_from, greedy_only=FLAGS.greedy_only,
                train_seconds=round(train_s, 1),
                heldout={n: round(float(v), 4) for n, v in held_metrics.items()},
                history=history)
  report = with_earlier_phases(report, FLAGS.init_from)
  with open(os.path.join(FLAGS.out, "train_report.json"), "w") as fh:
    json.dump(report, fh, indent=1)
  print(json.dumps({k_: report[k_] for k_ in ("params", "train_seconds", "heldout")}))


FLAGS = flags.FLAGS

if __name__ == "__main__":
  _define_flags()
  app.run(main)
