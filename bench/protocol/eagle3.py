"""Stage `eagle3` (issue 55): an EAGLE-3 head's draft step against one target decode step on
a Kimi K2.5-shaped slice. Opt-in: `STAGES=ceilings,eagle3 bash bench/gpu_check.sh`.

    python -m bench.protocol.eagle3 OUT --deadline_s=112

The heads, bf16, random weights: the MLA head (`Eagle3DeepseekV2ForCausalLM` as
lightseekorg/kimi-k2.5-eagle3-mla: hidden 7168, K2.5's MLA dims, MLP 18,432, one layer) and the
MHA head (`LlamaForCausalLMEagle3` as AQ-MedAI/Kimi-K25-eagle3: 64 heads of 128), each with the
full-vocabulary lm_head (163,840 x 7,168, 2.35 GB) and a reduced draft vocabulary (32,000 ids,
0.46 GB, through `draft_to_target`); the embedding and the full lm_head are the target slice's
arrays (a head that ships its own reads the same bytes). Programs, as the drafter runs them
(`engine/runtime/speculative/drafters/eagle3.py`), each compiled once and timed with its pool
donated and fed back:
  first    the first pass over a verified block of T = K + 1 positions per row: `fc` over the
           3 x 7168 aux states, the head's layer over the block (its KV written), then the
           lm_head at each row's last position: draft 1 (the serving observe + the first
           propose's logits);
  chained  one chained step: the layer over the previous draft with the previous carry, one
           position further, the lm_head, top-1 (through d2t when reduced);
  lm_head  the lm_head alone (x @ W -> float32 logits, top-1), full and reduced;
  target   one decode step of a K2.5-width slice (`k25_slice`'s widths, `--layers` MoE
           layers of 384 INT4 experts, no dense layer), hidden states out (no logits);
           `target_61`: its time per layer x 61 plus the full lm_head alone, the bytes likewise.
at B = 1, 8, 64 over `--context` cached tokens per row (the head's KV as long as the target's).
Each timed row: `us` (wall per call, calls queued back to back), the CUPTI kernels' sum and the
gap, `bytes` a call must read (the weights it touches: the layer and lm_head, `fc` in the first
pass only, never the embedding table; the KV it reads) and so GB/s against the ceilings, and
`vs_target` = us / target_61 at the same B. Then a `ratio` row per head, vocabulary and B:
chained / target_61, K x that (what K drafts add to a verify step, in target steps), and
(first + (K - 1) chained) / target_61 (all drafting for one verify).
Order (a program starts only if 1.5x the slowest compile of its kind still fits the deadline):
per B = 1, 8, 64 the lm_heads, the target, the MLA head with the full and the reduced
vocabulary; then the MHA head with the reduced (as published) and the full vocabulary.
Kernels: the target's "auto" (Mosaic GPU on Hopper), the heads the same (as the engine gives
the drafter the target's `KernelChoice`). Dry run (DRY_RUN=1, CPU): `TOY` widths, B = 1 and 8,
reference kernels; then the GPU's programs lowered for CUDA at the real shapes with Mosaic GPU
attention (and MoE for the target).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.decode_profile import _random_leaf, bytes_floor, random_params_on_device
from bench.expert_bytes import INT4, KIMI_K25_TEXT
from bench.protocol import timing
from bench.protocol.k25_slice import PAGE, TOY, slice_config
from bench.protocol.rows import Recorder, dry_run
from engine.model import eagle3, kernels
from engine.model.cache import contiguous_page_table, init_cache
from engine.model.config import config_from_dict
from engine.model.eagle3_config import Eagle3Config, eagle3_config_from_dict
from engine.model.eagle3_loader import abstract_head_params
from engine.model.kernels import KernelChoice
from engine.model.params import abstract_params, path_str
from engine.model.transformer import forward

K = 3  # drafts per verify (the published heads' acceptance is quoted at 3)
BATCHES = (1, 8, 64)
TARGET_LAYERS = 61  # Kimi K2.5's decoder layers (1 dense + 60 MoE; the slice's are all MoE)
REDUCED = 32000  # AQ-MedAI/Kimi-K25-eagle3's draft vocabulary
K25_MLA_HEAD = dict(  # lightseekorg/kimi-k2.5-eagle3-mla's shape (TorchSpec's training config)
    architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="kimi_k2", hidden_size=7168,
    intermediate_size=18432, num_hidden_layers=1, num_attention_heads=64,
    num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-5, vocab_size=163840,
    draft_vocab_size=163840, max_position_embeddings=262144, rope_theta=50000.0,
    rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    eagle_config=dict(eagle_aux_hidden_state_layer_ids=[1, 29, 57]))
K25_MHA_HEAD = dict(  # AQ-MedAI/Kimi-K25-eagle3's shape
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=7168,
    intermediate_size=18432, num_hidden_layers=1, num_attention_heads=64,
    num_key_value_heads=64, head_dim=128, rms_norm_eps=1e-6, vocab_size=163840,
    draft_vocab_size=32000, max_position_embeddings=262144, rope_theta=1000000.0,
    eagle_config=dict(eagle_aux_hidden_state_layer_ids=[2, 30, 58]))
# The dry run's heads at the slice's TOY widths (MLA dims as TOY's; a reduced vocabulary of 128).
TOY_HEAD = dict(hidden_size=TOY["hidden_size"], intermediate_size=TOY["intermediate_size"],
                num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                q_lora_rank=TOY["q_lora_rank"], kv_lora_rank=TOY["kv_lora_rank"],
                qk_nope_head_dim=TOY["qk_nope_head_dim"], qk_rope_head_dim=TOY["qk_rope_head_dim"],
                v_head_dim=TOY["v_head_dim"], vocab_size=TOY["vocab_size"],
                max_position_embeddings=TOY["max_position_embeddings"])
TOY_REDUCED = 128
# Priority order: (head, vocabulary) pairs per B first, then over all B.
PER_BATCH = (("mla", "full"), ("mla", "reduced"))
AFTER = (("mha", "reduced"), ("mha", "full"))


def target_config(layers: int, toy: bool):
  """The slice: K2.5 widths (`TOY` in the dry run), `layers` MoE layers (no dense first
  layer: each is one of K2.5's 60 MoE layers, so its time per layer scales to 61)."""
  d = dict(KIMI_K25_TEXT, num_hidden_layers=layers, first_k_dense_replace=0,
           **(TOY if toy else {}))
  return dataclasses.replace(config_from_dict(d), int4=INT4)


def head_config(kind: str, vocab: str, toy: bool) -> Eagle3Config:
  """The K2.5-shaped head of `kind` ("mla" / "mha") with the full or the reduced vocabulary."""
  d = dict(K25_MLA_HEAD if kind == "mla" else K25_MHA_HEAD, **(TOY_HEAD if toy else {}))
  d["draft_vocab_size"] = d["vocab_size"] if vocab == "full" else (
      TOY_REDUCED if toy else REDUCED)
  # (the aux ids are K2.5's: checked against a 61-layer target of the slice's widths)
  return eagle3_config_from_dict(d, slice_config(TARGET_LAYERS, toy))


def head_params(cfg: Eagle3Config, body: dict, embed, lm_head) -> dict:
  """A head's pytree: its layer and `fc` from `body` (`random_body`), the target's embedding,
  the lm_head's first draft_vocab_size columns, `draft_to_target` spread over the vocabulary."""
  params = dict(body, embed=embed)
  v, vd = cfg.vocab_size, cfg.draft_vocab_size
  if cfg.reduced_vocab:
    params["lm_head"] = jnp.array(lm_head[:, :vd], copy=True)
    params["draft_to_target"] = jnp.arange(vd, dtype=jnp.int32) * (v // vd)
  else:
    params["lm_head"] = lm_head
  return params


def random_leaves(abstract, seed: int):
  """Random values for a pytree of `ShapeDtypeStruct`s (norms ones; `decode_profile`'s
  leaves: integers random bits, floats of spread 0.02): on the device by one compiled program,
  or on the host in the dry run (its toy widths: no compile, seconds less on a CPU)."""
  flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
  how = [(tuple(a.shape), jnp.dtype(a.dtype), path_str(p).endswith("norm")) for p, a in flat]
  if dry_run():
    rng = np.random.default_rng(seed)

    def host(s, d, norm):
      if norm:
        return jnp.ones(s, d)
      if jnp.issubdtype(d, jnp.integer):
        info = np.iinfo(d)
        return jnp.asarray(rng.integers(info.min, info.max, s, dtype=d, endpoint=True))
      return jnp.asarray(rng.uniform(-0.02 * 3 ** 0.5, 0.02 * 3 ** 0.5, s).astype(np.float32), d)

    return jax.tree_util.tree_unflatten(tree, [host(*h) for h in how])

  @jax.jit
  def make(keys):
    return [jnp.ones(s, d) if norm else _random_leaf(k, s, d, 0.02)
            for k, (s, d, norm) in zip(keys, how)]

  return jax.tree_util.tree_unflatten(tree, make(jax.random.split(jax.random.key(seed),
                                                                  len(how))))


def random_body(cfg: Eagle3Config, seed: int = 1) -> dict:
  """Random weights of the head's layer, `fc` and norms (no embedding, lm_head or map)."""
  abstract = abstract_head_params(cfg, jnp.bfloat16)
  return random_leaves({k: v for k, v in abstract.items()
                        if k not in ("embed", "lm_head", "draft_to_target")}, seed)


def target_params(cfg):
  """The slice's random weights: in the dry run on the host (`random_leaves`), on a GPU
  `random_params_on_device` (each layer of a stack the first's values, INT4 as random bits)."""
  if dry_run():
    return random_leaves(abstract_params(cfg, jnp.bfloat16), 0)
  return random_params_on_device(cfg, jnp.bfloat16, share_layers=True)


def kv_bytes_per_token(cfg: Eagle3Config) -> int:
  """The head's bf16 KV bytes per cached token: MLA one latent row, MHA K and V per head."""
  return sum(2 * s[-1] * (s[-2] if len(s) == 4 else 1)
             for s in eagle3.pool_shapes(cfg, 1, 1).values())


def head_bytes(params: dict, cfg: Eagle3Config, program: str, b: int, context: int) -> int:
  """Bytes a call must read: the weights it touches (never the embedding table, of which it
  gathers b rows; `fc` in the first pass only) and the head's KV over the context."""
  skip = {"embed"} | ({"fc", "fc_norm"} if program == "chained" else set())
  weights = sum(leaf.nbytes for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
                if path_str(path).split(".")[0] not in skip)
  return int(weights + b * context * kv_bytes_per_token(cfg))


# ---- programs --------------------------------------------------------------------------------

def first_pass(params, pool, aux, tokens, start, n_new, table, *, cfg, impl):
  """The first pass over a verified block, then draft 1: (draft [B], carry [B, H], pool)."""
  _, carry, pool = eagle3.draft_step(params, pool, eagle3.combine_aux(params, aux, cfg),
                                     tokens, start, n_new, table, cfg=cfg, impl=impl)
  last = jnp.maximum(n_new - 1, 0)[:, None, None]
  carry = jnp.take_along_axis(carry, last, axis=1)[:, 0]
  return eagle3.draft_token_ids(params, eagle3.carry_logits(params, carry, cfg)), carry, pool


def chained_step(params, pool, carry, draft, start, live, table, *, cfg, impl):
  """One chained step: (draft [B], carry [B, H], pool), fed back as the next call's input."""
  logits, out, pool = eagle3.draft_step(params, pool, carry[:, None], draft[:, None], start,
                                        live, table, cfg=cfg, impl=impl)
  return eagle3.draft_token_ids(params, logits[:, 0]), out[:, 0], pool


def lm_head_top1(lm_head, x):
  """The lm_head alone: x [B, H] -> float32 logits -> top-1 [B]."""
  return jnp.argmax(jnp.einsum("bh,hv->bv", x, lm_head, preferred_element_type=jnp.float32),
                    axis=-1)


def target_step(params, cache, tokens, start, n_new, table, *, cfg, impl):
  """The slice's decode forward, hidden states out (the lm_head is timed alone)."""
  hidden, cache = forward(params, cache, tokens, start, n_new, table, cfg=cfg, impl=impl)
  return hidden, cache


def head_program(program: str, cfg: Eagle3Config, b: int, context: int, impl: KernelChoice):
  """(jitted fn(params, pool, *inputs) -> (draft, carry, pool), its inputs, pool pages)."""
  t = K + 1 if program == "first" else 1
  table = jnp.asarray(contiguous_page_table(b, context + K + 1, PAGE))
  start = jnp.full((b,), context, jnp.int32)
  n_new = jnp.full((b,), t, jnp.int32)
  if program == "first":
    aux = timing.random_array(jax.random.key(2), (b, t, cfg.num_aux * cfg.target_hidden_size),
                              jnp.bfloat16)
    inputs = [aux, jnp.ones((b, t), jnp.int32), start, n_new, table]
    fn = first_pass
  else:
    inputs = [jnp.zeros((b, cfg.hidden_size), jnp.bfloat16), jnp.ones((b,), jnp.int32), start,
              n_new, table]
    fn = chained_step
  jitted = jax.jit(lambda p, pool, *a: fn(p, pool, *a, cfg=cfg, impl=impl), donate_argnums=(1,))
  return jitted, inputs, int(table.size)


# ---- measuring -------------------------------------------------------------------------------

class Clock:
  """The stage's deadline and the slowest compile so far per kind of program."""

  def __init__(self, deadline_s: float):
    self.t0, self.deadline_s, self.slowest = time.perf_counter(), deadline_s, {}

  def left(self) -> float:
    return self.deadline_s - (time.perf_counter() - self.t0)

  def fits(self, kind: str) -> bool:
    floor = 2.0 if dry_run() else (10.0 if kind == "target" else 3.0)
    return self.left() >= 1.5 * max(self.slowest.get(kind, 0.0), floor) + 2

  def compiled(self, kind: str, seconds: float) -> None:
    self.slowest[kind] = max(self.slowest.get(kind, 0.0), seconds)


def timed(compiled, args: list, feedback) -> dict:
  """`compiled(*args)` timed, `feedback(args, out)` giving the next call's arguments (donated
  buffers replaced by the outputs): wall us, and CUPTI's kernel sum and gap on a GPU."""
  state = {"args": list(args)}

  def run(i):
    out = compiled(*state["args"])
    state["args"] = feedback(state["args"], out)
    return out

  with timing.kernels_runnable():
    if dry_run():
      jax.block_until_ready(run(0))
      t1 = time.perf_counter()
      jax.block_until_ready(run(1))
      return dict(us=(time.perf_counter() - t1) * 1e6)
    out = dict(us=timing.wall_us(run, iterations=5, reps=3))
    summary = timing.summarize_kernels(timing.kernel_times(run, 3))
    if summary:
      out.update(kernel_us=summary["kernel_us"], gap_us=out["us"] - summary["kernel_us"],
                 kernels=summary["kernels"][:6])
    return out


def compile_and_time(rec: Recorder, clock: Clock, kind: str, impl: str, case: str, fn,
                     args: list, feedback, target_us: float | None = None,
                     **fields) -> dict | None:
  """Lowers, compiles and times one program, writing its row (or a skip / error row); with
  `target_us`, its time over that (`vs_target`)."""
  if not clock.fits(kind):
    rec.row(impl, case, skipped=f"deadline: {clock.left():.0f}s left, slowest {kind} compile "
            f"{clock.slowest.get(kind, 0):.0f}s")
    return None
  try:
    t0 = time.perf_counter()
    with timing.kernels_runnable():
      compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    clock.compiled(kind, compile_s)
    got = timed(compiled, args, feedback)
    if target_us:
      got.update(target_us=target_us, vs_target=got["us"] / target_us)
    return rec.row(impl, case, compile_s=round(compile_s, 2), **got, **fields)
  except Exception as err:  # an OOM or a failed lowering is a result; go on
    rec.row(impl, case, error=f"{type(err).__name__}: {err}"[:600])
    return None


class Stage:
  """The stage's weights, kernels and the rows measured so far (by impl and case)."""

  def __init__(self, rec: Recorder, clock: Clock, layers: int, context: int):
    self.rec, self.clock, self.context = rec, clock, context
    toy = dry_run()
    self.cfg = target_config(layers, toy)
    self.params = jax.block_until_ready(target_params(self.cfg))
    self.impl = kernels.announce(kernels.resolve_for_params(
        KernelChoice(attention="auto", moe="auto"), self.cfg, self.params,
        page_size=PAGE)).choice
    self.heads = {}
    for kind in ("mla", "mha"):
      body = None
      for vocab in ("full", "reduced"):
        cfg = head_config(kind, vocab, toy)
        body = body if body is not None else jax.block_until_ready(random_body(cfg))
        self.heads[(kind, vocab)] = (cfg, head_params(cfg, body, self.params["embed"],
                                                      self.params["lm_head"]))
    self.got: dict[tuple[str, str], dict] = {}
    unique = {id(v): v for v in jax.tree.leaves([self.params] + [p for _, p in
                                                                 self.heads.values()])}
    rec.row("weights", self.cfg.display_name, seconds=round(time.perf_counter() - clock.t0, 1),
            layers=layers, kernels=f"{self.impl.attention}+{self.impl.moe}",
            xla_flags=os.environ.get("XLA_FLAGS", ""),
            bytes=sum(x.nbytes for x in unique.values()))

  def keep(self, r: dict | None) -> None:
    if r is not None:
      self.got[(r["impl"], r["case"])] = r

  def target_61(self, b: int) -> dict | None:
    return self.got.get(("target_61", f"decode B={b}"))

  def lm_head(self, b: int) -> None:
    h = self.cfg.hidden_size
    x = timing.random_array(jax.random.key(3), (b, h), jnp.bfloat16)
    for vocab in ("full", "reduced"):
      w = self.heads[("mla", vocab)][1]["lm_head"]
      self.keep(compile_and_time(
          self.rec, self.clock, "lm_head", "lm_head", f"V={w.shape[1]} B={b}",
          jax.jit(lm_head_top1), [w, x], lambda a, out: a, batch=b, vocab=int(w.shape[1]),
          bytes=int(w.nbytes)))

  def target(self, b: int) -> None:
    cfg, ctx = self.cfg, self.context
    table = jnp.asarray(contiguous_page_table(b, ctx + 1, PAGE))
    cache = init_cache(cfg, int(table.size), PAGE, jnp.bfloat16)
    args = [self.params, cache, jnp.ones((b, 1), jnp.int32), jnp.full((b,), ctx, jnp.int32),
            jnp.ones((b,), jnp.int32), table]
    fn = jax.jit(lambda *a: target_step(*a, cfg=cfg, impl=self.impl), donate_argnums=(1,))
    floor = bytes_floor(cfg, self.params, b, ctx, 1)
    r = compile_and_time(self.rec, self.clock, "target", "target", f"decode B={b}", fn, args,
                         lambda a, out: [a[0], out[1], *a[2:]], batch=b, context=ctx,
                         layers=cfg.num_layers, bytes=floor)
    del cache, args
    self.keep(r)
    head = self.got.get(("lm_head", f"V={cfg.vocab_size} B={b}"))
    if r is None or head is None:
      return
    # Per layer (the non-layer bytes: lm_head and final norm) x 61, plus the lm_head alone.
    lm_bytes = self.params["lm_head"].nbytes + self.params["final_norm"].nbytes
    scale = TARGET_LAYERS / cfg.num_layers
    self.keep(self.rec.row(
        "target_61", f"decode B={b}", batch=b, context=ctx, layers=TARGET_LAYERS,
        us=r["us"] * scale + head["us"], bytes=int((floor - lm_bytes) * scale + lm_bytes),
        slice_us=r["us"], lm_head_us=head["us"], slice_layers=cfg.num_layers))

  def head(self, kind: str, vocab: str, b: int) -> None:
    cfg, params = self.heads[(kind, vocab)]
    name = f"{kind} {vocab}"
    target = self.target_61(b)
    for program in ("chained", "first"):
      fn, inputs, pages = head_program(program, cfg, b, self.context, self.impl)
      pool = eagle3.init_pool(cfg, pages, PAGE, jnp.bfloat16)
      if program == "first":  # (the verified block's aux states stay; the pool comes back)
        feedback = lambda a, out: [a[0], out[2], *a[2:]]  # noqa: E731
      else:  # (the draft and carry fed back, as a chain runs)
        feedback = lambda a, out: [a[0], out[2], out[1], out[0], *a[4:]]  # noqa: E731
      t = K + 1 if program == "first" else 1
      case = f"{program} B={b}" + (f" T={t}" if program == "first" else "")
      r = compile_and_time(
          self.rec, self.clock, "head", name, case, fn, [params, pool, *inputs], feedback,
          head=kind, vocab=cfg.draft_vocab_size, program=program, batch=b, width=t,
          context=self.context,
          bytes=head_bytes(params, cfg, program, b, self.context + (t if program == "first"
                                                                     else 1)),
          target_us=None if target is None else target["us"])
      del pool
      self.keep(r)

  def ratios(self) -> None:
    """Per head, vocabulary and B: chained / target_61, K x that, all of one verify's
    drafting (first + (K - 1) chained) / target_61."""
    for (kind, vocab), (cfg, _) in self.heads.items():
      for b in BATCHES:
        target, chained = self.target_61(b), self.got.get((f"{kind} {vocab}", f"chained B={b}"))
        first = self.got.get((f"{kind} {vocab}", f"first B={b} T={K + 1}"))
        if target is None or chained is None:
          continue
        step = chained["us"] / target["us"]
        self.rec.row("ratio", f"{kind} {vocab} B={b}", head=kind, vocab=cfg.draft_vocab_size,
                     batch=b, k=K, target_us=target["us"], chained_us=chained["us"],
                     draft_step_vs_target=step, k_drafts_vs_target=K * step,
                     **({} if first is None else dict(
                         first_us=first["us"], drafting_vs_target=(
                             first["us"] + (K - 1) * chained["us"]) / target["us"])))


def export_rows(rec: Recorder, layers: int) -> None:
  """Dry run: the GPU's programs lowered for CUDA at the real shapes with the Mosaic GPU
  kernels (an abstract H200; no weights): both heads' chained step and first pass (B = 8, full
  vocabulary for MLA, reduced for MHA, as published), the target slice's decode step."""
  impl = KernelChoice(attention="mosaic_gpu", moe="mosaic_gpu")
  sds = jax.ShapeDtypeStruct
  for kind, vocab in timing.first([("mla", "full"), ("mha", "reduced")]):
    cfg = head_config(kind, vocab, toy=False)
    params = abstract_head_params(cfg, jnp.bfloat16)
    for program in timing.first(["chained", "first"]):
      fn, inputs, pages = head_program(program, cfg, 8, 1024, impl)
      pool = {k: sds(s, jnp.bfloat16) for k, s in eagle3.pool_shapes(cfg, pages, PAGE).items()}
      rec.row("cuda_export", f"{kind} {vocab} {program} B=8",
              **timing.cuda_export(fn, params, pool, *timing.spec(inputs)))
  if timing.quick():
    return
  cfg = target_config(layers, toy=False)
  table = jnp.asarray(contiguous_page_table(1, 1024 + 1, PAGE))
  cache = jax.eval_shape(lambda: init_cache(cfg, int(table.size), PAGE, jnp.bfloat16))
  fn = jax.jit(lambda *a: target_step(*a, cfg=cfg, impl=impl))
  args = [jnp.ones((1, 1), jnp.int32), jnp.full((1,), 1024, jnp.int32), jnp.ones((1,), jnp.int32),
          table]
  rec.row("cuda_export", f"target decode B=1 L={layers}", layers=layers,
          **timing.cuda_export(fn, abstract_params(cfg, jnp.bfloat16), cache,
                               *timing.spec(args)))


def run(out_dir: str, layers: int, context: int, deadline_s: float) -> None:
  clock = Clock(deadline_s)
  rec = Recorder(out_dir, "eagle3", **timing.labels())
  toy = dry_run()
  context = min(context, 64) if toy else context
  stage = Stage(rec, clock, layers, context)
  batches = timing.first(list(BATCHES[:2] if toy else BATCHES))
  for b in batches:
    stage.lm_head(b)
    stage.target(b)
    for kind, vocab in PER_BATCH:
      stage.head(kind, vocab, b)
  for kind, vocab in AFTER:
    for b in batches[:1] if toy else batches:
      stage.head(kind, vocab, b)
  stage.ratios()
  del stage
  if toy:
    export_rows(rec, layers)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out")
  p.add_argument("--layers", type=int, default=3, help="MoE layers of the target slice")
  p.add_argument("--context", type=int, default=4096, help="cached tokens per row")
  p.add_argument("--deadline_s", type=float,
                 default=float(os.environ.get("STAGE_LIMIT_S", 120)) - 8,
                 help="seconds from the start after which no program starts (default: the "
                 "stage's limit from gpu_check.sh, less 8)")
  a = p.parse_args(argv)
  run(a.out, a.layers, a.context, a.deadline_s)


if __name__ == "__main__":
  main()
