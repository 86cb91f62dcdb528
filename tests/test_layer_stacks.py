"""The scanned layer stacks: runs of identical layers (`cfg.layer_stacks`) stacked and run as
one `lax.scan` each. The scanned forward equals the unrolled one; the compiled decode program
does not grow with depth; the scan reads the cache and the routed experts in place; and the
forward asked for the residual stream entering given layers returns exactly those."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.model import transformer
from engine.model.cache import (clear_page, contiguous_page_table, entry_layers, init_cache,
                                layer_pages, layer_table)
from engine.model.config import config_from_dict
from engine.model.kernels import REFERENCE
from engine.model.params import abstract_params, init_params, layer_params
from engine.model.quantized import Int4Scheme
from engine.model.transformer import forward_hidden_states, forward_logits
from model_configs import CONFIGS

jax.config.update("jax_default_matmul_precision", "highest")

# Layer 2's routed experts left bf16 by the scheme's ignore list: a stack of its own.
INT4_BUT_LAYER_2 = Int4Scheme(group_size=32, targets=("Linear",),
                              ignore=(r"re:.*layers\.2\.mlp\.experts\..*",))


def _config(name: str):
  if name == "deepseek_v3_int4":
    d = dict(CONFIGS["deepseek_v3"], num_hidden_layers=4, moe_intermediate_size=64)
    return dataclasses.replace(config_from_dict(d), int4=INT4_BUT_LAYER_2)
  if name == "qwen3_moe_mixed":  # mlp_only_layers: MoE, MoE, dense, MoE, MoE
    return config_from_dict(dict(CONFIGS["qwen3_moe"], num_hidden_layers=5,
                                 mlp_only_layers=[2]))
  return config_from_dict(dict(CONFIGS[name], num_hidden_layers=4))


def test_stacks_are_the_runs_of_identical_layers():
  assert _config("deepseek_v3").layer_stacks == ((0, 1), (1, 4))  # dense prefix, MoE body
  assert _config("llama").layer_stacks == ((0, 4),)
  assert _config("qwen3_moe_mixed").layer_stacks == ((0, 2), (2, 3), (3, 5))
  cfg = _config("deepseek_v3_int4")
  assert cfg.layer_stacks == ((0, 1), (1, 2), (2, 3), (3, 4))
  params = init_params(cfg, seed=0)
  assert [jax.tree.leaves(s)[0].shape[0] for s in params["stacks"]] == [1, 1, 1, 1]
  assert type(params["stacks"][1]["moe"]["experts"]["gate"]).__name__ == "Int4Weight"
  assert params["stacks"][2]["moe"]["experts"]["gate"].dtype == jnp.float32


@pytest.mark.parametrize("name", ["deepseek_v3_int4",  # MLA, GQA
                                  pytest.param("qwen3_moe_mixed", marks=pytest.mark.slow)])
def test_scanned_forward_equals_unrolled(name):
  """Prefill then decode through the paged cache, both ways: the same logits and cache."""
  cfg = _config(name)
  params = init_params(cfg, seed=5)
  b, length, ps = 2, 11, 4
  toks = np.random.default_rng(6).integers(3, cfg.vocab_size, (b, length + 1)).astype(np.int32)
  pt = jnp.asarray(contiguous_page_table(b, 16, ps))
  lens = jnp.asarray([length, length - 3], jnp.int32)

  @functools.partial(jax.jit, static_argnames="scan")
  def prefill_then_decode(params, cache, scan):
    pre, cache = forward_logits(params, cache, jnp.asarray(toks[:, :length]),
                                jnp.zeros(b, jnp.int32), lens, pt, cfg=cfg, scan_layers=scan)
    dec, cache = forward_logits(params, cache, jnp.asarray(toks[:, length:]), lens,
                                jnp.ones(b, jnp.int32), pt, cfg=cfg, scan_layers=scan)
    return pre, dec, cache

  out = {scan: [np.asarray(x) for x in jax.tree.leaves(prefill_then_decode(
      params, init_cache(cfg, pt.size, ps, jnp.float32), scan))] for scan in (True, False)}
  assert float(np.abs(out[True][0]).max()) > 0.1
  for got, want in zip(out[True], out[False]):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _decode_hlo(layers: int, scan: bool, compile_it: bool = True) -> str:
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_hidden_layers=layers))
  b, ps = 2, 8
  pt = contiguous_page_table(b, 64, ps)
  cache = jax.eval_shape(lambda: init_cache(cfg, pt.size, ps, jnp.float32))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
  lowered = forward_logits.lower(abstract_params(cfg, jnp.float32), cache, i32(b, 1), i32(b),
                                 i32(b), i32(*pt.shape), cfg=cfg, scan_layers=scan)
  return lowered.compile().as_text() if compile_it else lowered.as_text()


def _instructions(hlo: str) -> int:
  return len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", hlo, re.M))


def test_decode_program_does_not_grow_with_depth():
  """The compiled decode step of a 61-layer DeepSeek-V3 (a dense layer, 60 MoE layers) is the
  4-layer one's size: one layer body per stack. Unrolled, the program grows with depth (what
  this measure would catch: checked on the lowered program, compiling it takes long)."""
  four, sixty_one = _instructions(_decode_hlo(4, True)), _instructions(_decode_hlo(61, True))
  assert abs(sixty_one - four) <= 8, (four, sixty_one)
  ops = lambda text: len(re.findall(r"^\s+%\S+ = ", text, re.M))  # noqa: E731
  unrolled = [ops(_decode_hlo(n, False, compile_it=False)) for n in (4, 16)]
  assert unrolled[1] > 3 * unrolled[0], unrolled


def _materialized(hlo: str) -> list[tuple[str, str]]:
  """(shape, opcode) of every instruction whose result is a buffer: those outside fusions
  (an instruction inside a fusion is computed where its consumer reads it)."""
  fused = set(re.findall(r" fusion\(.*calls=%([\w.\-]+)", hlo))
  out, comp = [], None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      comp = m.group(1)
    elif comp not in fused:
      m = re.match(r"^\s+(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\{[^}]*\} ([\w\-]+)\(", line)
      if m:
        out.append(m.groups())
  return out


def test_scan_reads_cache_and_routed_experts_in_place():
  """The compiled decode step (the routed experts gathered per token) never copies a cache
  entry, nor slices a layer's pages or a layer's experts out of their stacks into a buffer of
  their own: the kernels reach them in place through the shifted page table and the layer
  index (the index fused into the gathers)."""
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_hidden_layers=6,
                              first_k_dense_replace=0))  # one stack of 6 MoE layers
  b, ps, pages = 1, 8, 8
  buffers = _materialized(_decode_hlo_for(cfg, b, ps, pages))
  e, h, i, d = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.latent_dim
  entry = f"f32[{6 * pages},{ps},{d}]"
  one_layer = {f"f32[{pages},{ps},{d}]", f"f32[{e},{h},{i}]", f"f32[{e},{i},{h}]",
               f"f32[1,{pages},{ps},{d}]", f"f32[1,{e},{h},{i}]", f"f32[1,{e},{i},{h}]"}
  assert (entry, "scatter") in buffers or (entry, "fusion") in buffers, buffers
  assert (entry, "copy") not in buffers
  assert not {shape for shape, _ in buffers} & one_layer, buffers


def _computations(hlo: str) -> dict[str, list[str]]:
  """Each computation's instruction lines by name."""
  out, comp = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      comp = out.setdefault(m.group(1), [])
    elif comp is not None and line.strip() != "}":
      comp.append(line)
  return out


def test_dense_moe_scan_copies_one_layer_of_each_dot_weight_at_most():
  """At a batch where every expert runs on every token (`moe_experts_all`, batch 32 of the
  demo model), the compiled decode step still updates the cache entry in place, copies no
  stack, and computes the per-call constants (rope tables, causal mask) once, outside the
  scan. What the scan's body does copy, per iteration, is layer j's slice of each weight an
  XLA dot reads (projections, shared and routed experts): XLA:CPU's dots read whole buffers,
  so a dynamic slice feeding one is materialised (the batch-32 decode step's ~5% against the
  unrolled forward of separate arrays, BENCHMARKS, issue 49). Never more than one layer's."""
  cfg = config_from_dict(dict(CONFIGS["deepseek_v3"], num_hidden_layers=6,
                              first_k_dense_replace=0))  # one stack of 6 MoE layers
  b, ps, pages = 8, 4, 3  # 16 copies over 8 experts: every expert on every token
  hlo = _decode_hlo_for(cfg, b, ps, pages)
  whole = _materialized(hlo)
  e, h, i, d = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.latent_dim
  entry = f"f32[{6 * b * pages},{ps},{d}]"
  aliases = {"parameter", "get-tuple-element", "tuple", "while", "bitcast"}  # (no new buffer)
  # One buffer of the entry's shape is written: the scatter, in place.
  assert [op for s, op in whole if s == entry and op not in aliases] in (["scatter"],
                                                                         ["fusion"]), whole
  stacked = {f"f32[{','.join(map(str, w.shape))}]" for w in jax.tree.leaves(
      abstract_params(cfg, jnp.float32)["stacks"][0])}
  assert not [(s, op) for s, op in whole if s in stacked and op not in aliases], whole
  comps = _computations(hlo)
  (body,) = re.findall(r" while\(.*body=%([\w.\-]+)", hlo)  # the layer scan
  in_body = _materialized("\n".join([f"%{body} {{"] + comps[body]))
  shapes = [s for s, _ in in_body]
  assert shapes.count(f"f32[{e},{h},{i}]") <= 2, in_body  # gate, up
  assert shapes.count(f"f32[{e},{i},{h}]") <= 1, in_body  # down
  assert shapes.count(f"f32[{e},{h},{i}]") >= 1, in_body  # (the formulation this test means)
  # Per-call constants are computed once, outside the body: the rope tables, and the causal
  # mask over the row's ps * pages key positions.
  called, todo = set(), [body]
  while todo:
    for line in comps[todo.pop()]:
      new = set(re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)) - called
      called |= new
      todo += new
  ops = [line for c in called | {body} for line in comps[c]]
  assert not [op for op in ops if re.search(r" (cosine|sine)\(", op)]
  assert not [op for op in ops if re.search(rf"\[[\d,]*\b{ps * pages}\]\{{[^}}]*\}} iota\(", op)]


def _decode_hlo_for(cfg, b, ps, pages) -> str:
  pt = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
  cache = jax.eval_shape(lambda: init_cache(cfg, b * pages, ps, jnp.float32))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
  return forward_logits.lower(abstract_params(cfg, jnp.float32), cache, i32(b, 1), i32(b),
                              i32(b), i32(*pt.shape), cfg=cfg).compile().as_text()


def test_hidden_states_entering_given_layers():
  """The residual stream entering layers 0, 2, 3 and after the last (before the final norm),
  against the layers run one by one; the scans split there, and only those are returned."""
  cfg = _config("deepseek_v3")  # stacks (0, 1), (1, 4)
  params = init_params(cfg, seed=8)
  b, t, ps = 2, 5, 4
  toks = jnp.asarray(np.random.default_rng(9).integers(3, cfg.vocab_size, (b, t)), jnp.int32)
  pt = jnp.asarray(contiguous_page_table(b, 8, ps))
  zeros, n = jnp.zeros(b, jnp.int32), jnp.asarray([t, t - 2], jnp.int32)
  layers = (0, 2, 3, cfg.num_layers)
  fn = jax.jit(forward_hidden_states, static_argnames=("layers", "cfg"))
  hidden, _, states = fn(params, init_cache(cfg, pt.size, ps, jnp.float32), toks, zeros, n, pt,
                         layers=layers, cfg=cfg)
  assert states.shape == (len(layers), b, t, cfg.hidden_size)

  @jax.jit
  def one_by_one(params, cache):  # the layers called one at a time, every input recorded
    ctx = transformer._Ctx(zeros, n, t, pt)
    x, seen = params["embed"][toks], []
    for i in range(cfg.num_layers):
      seen.append(x)
      r, j = cfg.layer_stack_of(i)
      lctx = ctx.with_page_table(layer_table(pt, j, pt.size))
      x, cache[r], _ = transformer.decoder_layer(layer_params(cfg, params, i), x, cache[r],
                                                 lctx, cfg, REFERENCE)
    return seen + [x], transformer.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)

  seen, want_hidden = one_by_one(params, init_cache(cfg, pt.size, ps, jnp.float32))
  want = np.stack([np.asarray(seen[l]) for l in layers])
  np.testing.assert_allclose(np.asarray(states), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), rtol=1e-5, atol=1e-5)
  cache = init_cache(cfg, pt.size, ps, jnp.float32)
  with pytest.raises(ValueError, match="outside"):
    forward_hidden_states(params, cache, toks, zeros, n, pt, layers=(5,), cfg=cfg)
  # Six layers: the MoE stack's one scan (layers 1-5) becomes two (1-2, 3-5).
  deep = config_from_dict(dict(CONFIGS["deepseek_v3"], num_hidden_layers=6))
  scans = [str(jax.make_jaxpr(lambda p, c, at=at: forward_hidden_states(
      p, c, toks, zeros, n, pt, layers=at, cfg=deep))(
          abstract_params(deep, jnp.float32), jax.eval_shape(
              lambda: init_cache(deep, pt.size, ps, jnp.float32)))).count("scan[")
           for at in ((), (3,))]
  assert scans == [1, 2], scans


def test_clear_page_clears_that_page_of_every_layer_of_a_stack():
  # A page id names one page in each of a stack's layers (the entry holds their pools end to
  # end): clearing the null page clears it in every layer, and nothing else.
  cfg = _config("deepseek_v3")
  cache = [{k: jnp.ones_like(v) for k, v in e.items()} for e in init_cache(cfg, 3, 4, jnp.float32)]
  cleared = clear_page(cache, 0, cfg)
  for entry, layers in zip(cleared, entry_layers(cfg), strict=True):
    for j in range(layers):
      for pages in layer_pages(entry, layers, j).values():
        assert not np.asarray(pages[0]).any() and np.asarray(pages[1:]).all()
