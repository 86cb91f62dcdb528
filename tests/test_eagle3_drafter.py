"""The EAGLE-3 drafter in the serving engine (`engine/runtime/speculative/drafters/eagle3.py`) on
the tiny Kimi K2.5 INT4 target of the EAGLE-3 goldens (`golden/fixtures/eagle3`, float32):
greedy output identical to speculative decoding off for every published head layout and both
aux-id conventions; the head's KV in the target's paged cache and its row state equal a one-shot
forward over the request's tokens after chunked prefill and verified blocks; its drafts equal
the PyTorch golden's; continuous batching, prefix hits and preemption keep plain decoding's
output; a missing or mismatched head is refused naming what is wrong. (Constrained rows
drafting with the demo head, structured outputs: test_structured_outputs.py.)

Each head layout runs in an engine once, where it costs least (a head variant is a compiled
decode loop and mixed step of its own, ~10 s on CI's CPUs), and every variant's first pass and
chained drafts are checked against its PyTorch golden in test_eagle3.py
(`test_every_head_layout_runs_in_an_engine` keeps this map true):
- `mla_eagle31` (MLA, full vocabulary, EAGLE-3.1's `fc_norm` / `norm_output`, aux ids
  [1, 2, 3]: the output-of convention) and `mha_full` (MHA, full vocabulary, the residual
  after `hidden_norm`, aux ids [1, 2, 3] at the config's top level): `test_head_state_drafts_preemption_and_prefix_hits`;
- `mha_reduced` (MHA, reduced draft vocabulary, aux ids [2, 3, 4]: the input-to convention):
  `test_command_line_eagle3_prints_the_spec_keys`;
- `mla_reduced`'s layout (MLA, reduced draft vocabulary, input-to aux ids [2, 3, 4]) is the
  demo head's (`checkpoints/demo/eagle3`): test_structured_outputs.py's `test_model_drafters_
  draft_for_constrained_rows_checked_against_the_grammar` (greedy and sampled constrained
  rows, beside MTP-drafting rows), and the served and sharded engines of
  test_service_ops.py and test_sharding.py;
- `mla` is `mla_eagle31` without the EAGLE-3.1 norms, which the demo head lacks too.
The two conventions give identical drafts on the same weights (test_eagle3.py). All engines on
the fixture target share one configuration: the reference output is plain decoding's on an engine
with the `mla_eagle31` head, its requests' drafter off (the plain decode loop), whose mixed steps
are those that layout's engine test compiled (a program is compiled once per process), so the
reference costs one more program, not an engine's three."""

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.api import DEMO_CHECKPOINT, eagle3_checkpoint
from engine.model.cache import cache_bytes_per_token, first_extra_entry, init_cache
from engine.model.config import load_config
from engine.model.eagle3_config import Eagle3Error, load_eagle3_config
from engine.model.eagle3_loader import load_eagle3
from engine.model.hf_loader import load_hf_params
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.llm import SpeculativeConfig
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative.drafters import aux_layers_of, build
from engine.runtime.speculative.drafters.eagle3 import Eagle3Drafter, eagle3_propose
from engine.runtime.sampling import SamplingArrays
from engine_spec_helpers import check_head_state

FIXTURES = os.path.join(os.path.dirname(__file__), "golden", "fixtures", "eagle3")
VARIANTS = ("mla", "mla_reduced", "mla_eagle31", "mha_reduced", "mha_full")
ENGINE_VARIANTS = ("mla_eagle31", "mha_full")  # (the others: see the module docstring)
CLI_VARIANT = "mha_reduced"  # test_command_line_eagle3_prints_the_spec_keys
PAGE = 8
# Two rows, 8-token chunks, 11 pages (too few for two long rows: preemption): two mixed-step
# shapes ([1 x 8], [2 x 8]) and one decode batch per engine.
CONFIG = dict(page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=8, row_widths=(8,),
              max_model_len=96, max_decode_steps=8, cache_dtype=jnp.float32,
              num_draft_tokens=3, measure_spec_costs=False, decode_batch_sizes=(2,),
              num_pages=11, compilation_cache_dir=None)


@pytest.fixture(scope="module")
def target():
  cfg = load_config(os.path.join(FIXTURES, "target"))
  params = load_hf_params(os.path.join(FIXTURES, "target"), cfg, jnp.float32, progress=False)
  return cfg, params


@functools.lru_cache(maxsize=None)
def _head(variant):
  cfg = load_config(os.path.join(FIXTURES, "target"))
  return load_eagle3(os.path.join(FIXTURES, variant), cfg, None, jnp.float32)


def head(target, variant):
  return load_eagle3(os.path.join(FIXTURES, variant), target[0], target[1], jnp.float32)


def prompts(n, seed, lo=6, hi=30):
  rng = np.random.default_rng(seed)
  return [[1] + [int(t) for t in rng.integers(3, 320, rng.integers(lo, hi))] for _ in range(n)]


_plain: dict = {}


def plain(target, ps, max_tokens):
  """Plain greedy decoding's output of each prompt (one engine for the module, its own pages and
  prefix cache; see the module docstring): nothing drafted."""
  if "engine" not in _plain:
    _plain["engine"] = Engine(*target, EngineConfig(**CONFIG, speculative="eagle3"),
                              head=head(target, ENGINE_VARIANTS[0]))
  key = (tuple(map(tuple, ps)), max_tokens)
  if key not in _plain:
    got = _plain["engine"].generate(ps, SamplingParams(drafter="off"),
                                    StopParams(max_tokens=max_tokens, ignore_eos=True))
    assert all(r.usage().spec_draft_tokens == 0 for r in got)
    _plain[key] = [r.output_ids for r in got]
  return _plain[key]


# ---- fast: configuration, refusals, the cache's size -------------------------------------------

def test_engine_without_a_head_refuses_eagle3_naming_it(target):
  with pytest.raises(ValueError, match="eagle3.*EAGLE-3 head.*--eagle3_checkpoint"):
    Engine(*target, EngineConfig(**CONFIG, speculative="eagle3"))
  with pytest.raises(ValueError, match="needs checkpoint"):
    SpeculativeConfig("eagle3").validate(target[0])
  # "auto" includes eagle3 only when a head is given
  auto = SpeculativeConfig("auto")
  assert "eagle3" not in auto.drafters(target[0])
  with_head = SpeculativeConfig("auto", checkpoint=os.path.join(FIXTURES, "mla"))
  assert "eagle3" in with_head.drafters(target[0])


def test_command_line_head_directory(target, tmp_path):
  assert eagle3_checkpoint("ngram", None, "elsewhere") is None
  assert eagle3_checkpoint("auto", None, str(tmp_path)) is None  # (auto goes without)
  assert eagle3_checkpoint("eagle3", "/some/head", str(tmp_path)) == "/some/head"
  with pytest.raises(ValueError, match="^--speculative=eagle3 needs --eagle3_checkpoint$"):
    eagle3_checkpoint("eagle3", None, str(tmp_path))
  demo_head = os.path.join(os.path.dirname(DEMO_CHECKPOINT), "eagle3")
  if os.path.isdir(demo_head):  # the demo target's default
    assert eagle3_checkpoint("eagle3", None, DEMO_CHECKPOINT) == demo_head
  # A bad directory is refused when the speculative config is checked, before any engine is
  # built: an Eagle3Error (a ValueError, which the command lines print as "error: ...") naming
  # it (each way a directory can be bad: test_eagle3.py).
  bad = eagle3_checkpoint("eagle3", str(tmp_path / "nowhere"), str(tmp_path))
  with pytest.raises(Eagle3Error, match="nowhere.*not a directory"):
    SpeculativeConfig("eagle3", checkpoint=bad).validate(target[0])
  assert issubclass(Eagle3Error, ValueError)


def test_a_mismatched_head_is_refused_naming_the_field(target, tmp_path):
  d = tmp_path / "head"
  shutil.copytree(os.path.join(FIXTURES, "mla"), d)
  conf = json.loads((d / "config.json").read_text())
  conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 9]
  (d / "config.json").write_text(json.dumps(conf))
  with pytest.raises(Eagle3Error, match="aux"):
    SpeculativeConfig("eagle3", checkpoint=str(d)).validate(target[0])
  cfg, _ = _head("mla")
  why = Eagle3Drafter.unsupported(target[0], None,
                                  head_cfg=dataclasses.replace(cfg, vocab_size=512))
  assert "vocab_size 512" in why
  why = Eagle3Drafter.unsupported(target[0], None,
                                  head_cfg=dataclasses.replace(cfg, target_hidden_size=128))
  assert "hidden size 128" in why
  with pytest.raises(ValueError, match="EngineConfig: EAGLE-3 head: vocab_size 512"):
    Engine(*target, EngineConfig(**CONFIG, speculative="eagle3"),
           head=(dataclasses.replace(cfg, vocab_size=512), None))


def layout(hcfg):
  """What tells the published layouts apart: attention kind, a reduced draft vocabulary, the
  aux-id convention as written, where the residual is taken, EAGLE-3.1's norms (last)."""
  written = hcfg.aux_ids_in_config
  convention = "default" if not written else "output" if written[0] == 1 else "input"
  return (hcfg.is_mla, hcfg.reduced_vocab, convention, hcfg.norm_before_residual, hcfg.fc_norm,
          hcfg.norm_output)


def test_every_head_layout_runs_in_an_engine():
  """The module docstring's map, kept true: each fixture variant's layout is one an engine test
  here runs (`ENGINE_VARIANTS`, the command line's head, the demo head), or that of one with
  EAGLE-3.1's norms while another of its attention kind runs without them; both aux-id
  conventions run."""
  demo = load_eagle3_config(os.path.join(os.path.dirname(DEMO_CHECKPOINT), "eagle3"),
                            load_config(DEMO_CHECKPOINT))
  tcfg = load_config(os.path.join(FIXTURES, "target"))

  def fixture(v):
    return layout(load_eagle3_config(os.path.join(FIXTURES, v), tcfg))
  run = {fixture(v) for v in ENGINE_VARIANTS + (CLI_VARIANT,)} | {layout(demo)}
  assert {"output", "input"} <= {r[2] for r in run}
  for variant in VARIANTS:
    mine = fixture(variant)
    plain_norms = any(r[0] == mine[0] and not r[-2] and not r[-1] for r in run)
    assert mine in run or (mine[:-2] + (True, True) in run and plain_norms), (variant, run)


def test_the_heads_kv_is_an_entry_of_the_targets_cache(target):
  """MLA head: one more layer of the target's latent shape; MHA head: its own K / V arrays on
  the same pages; both counted in the cache's bytes per token."""
  tcfg = target[0]
  base = cache_bytes_per_token(tcfg, jnp.float32)
  for variant, shapes in (("mla", {"latent": (tcfg.latent_dim,)}),
                          ("mha_full", None)):
    hcfg, _ = _head(variant)
    d = build({"eagle3"}, tcfg, EngineConfig(**CONFIG), head_cfg=hcfg)[0]
    assert aux_layers_of([d]) == hcfg.aux_layers == d.aux_layers
    entries = d.cache_entries()
    if shapes is not None:
      assert entries == (shapes,)
    else:
      lc = hcfg.layer
      assert entries == ({"k": (lc.num_kv_heads, lc.head_dim),
                          "v": (lc.num_kv_heads, lc.head_dim)},)
    per_token = sum(int(np.prod(s)) for s in entries[0].values()) * 4
    assert cache_bytes_per_token(tcfg, jnp.float32, entries) == base + per_token
    cache = init_cache(tcfg, 3, PAGE, jnp.float32, extra=entries)
    assert len(cache) == first_extra_entry(tcfg) + 1
    assert {k: v.shape[2:] for k, v in cache[-1].items()} == entries[0]


# ---- slow: the engine --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_head_state_drafts_preemption_and_prefix_hits(target, variant):
  """One request prefilled in chunks: the head's KV and row state equal a one-shot pass, and
  its first drafts are the PyTorch golden's; after decode loops (verified blocks observed) the
  state still does, and so does a request's after a prefix-cache hit. Then a continuous batch
  (MLA: in a pool too small for it (preemption, recompute), its prompts sharing a prefix
  (prefix-cache hits)): plain decoding's output, eagle3 drafting. (Every engine here runs
  rows that join and leave a continuous batch: two rows at most, more requests.)"""
  hcfg, hparams = head(target, variant)
  states = np.load(os.path.join(FIXTURES, "target_states.npz"))
  golden = np.load(os.path.join(FIXTURES, variant, "golden.npz"))
  eng = Engine(*target, EngineConfig(**CONFIG, speculative="eagle3"), head=(hcfg, hparams))
  prompt = [int(t) for t in states["prompt_1"]]  # 13 tokens: two 8-token chunks
  mla = hcfg.is_mla
  max_tokens = 30 if mla else 14
  rid = eng.add_request(prompt, SamplingParams(), StopParams(max_tokens=max_tokens,
                                                             ignore_eos=True))
  req = eng.requests[rid]
  while not req.output_ids:
    eng.step()
  assert req.output_ids == [int(states["next_token_1"])]
  check_head_state(eng, req, target, hcfg, hparams)
  n = req.num_computed
  pt = jnp.asarray([req.pages + [0] * (eng.max_pages_per_seq - len(req.pages))])
  entry = first_extra_entry(target[0])
  sampling = SamplingArrays.from_params([SamplingParams()])
  propose = jax.jit(functools.partial(eagle3_propose, k=3, cfg=hcfg, impl=eng.runner.impl))
  drafts, _, _ = propose(hparams, jax.tree.map(jnp.copy, eng.cache[entry]),
                         jnp.asarray(req.spec.rows["eagle3"][None]), jnp.asarray([n]),
                         jnp.asarray([True]), pt, sampling)
  np.testing.assert_array_equal(np.asarray(drafts)[0], golden["draft_tokens_1"][:3])
  while len(req.output_ids) < max_tokens - 4:
    eng.step()
  check_head_state(eng, req, target, hcfg, hparams)
  assert req.spec.drafted > 0
  for _ in eng.run():
    pass
  assert req.output_ids == plain(target, [prompt], max_tokens)[0]
  # A prefix hit whose next token differs: the head's entry at the hit's last position (and
  # the row state) depend on it, so the hit's last page is computed again.
  hits = eng.stats()["prefix_cache_hits"]
  other = req.all_ids[:2 * PAGE] + [3 + (req.all_ids[2 * PAGE] - 2) % 300, 5, 6]
  hit = eng.requests[eng.add_request(other, SamplingParams(), StopParams(max_tokens=2))]
  while not hit.output_ids:
    eng.step()
  assert eng.stats()["prefix_cache_hits"] > hits
  check_head_state(eng, hit, target, hcfg, hparams)
  for _ in eng.run():
    pass
  if not mla:  # (short rows: no preemption)
    ps = prompts(4, seed=3, lo=4, hi=12)
    got = eng.generate(ps, SamplingParams(), StopParams(max_tokens=12, ignore_eos=True))
    assert [r.output_ids for r in got] == plain(target, ps, 12)
  else:
    shared = prompts(1, seed=5, lo=17, hi=18)[0]
    ps = [shared + p[1:] for p in prompts(4, seed=6, lo=4, hi=12)]
    got = eng.generate(ps, SamplingParams(), StopParams(max_tokens=24, ignore_eos=True))
    assert [r.output_ids for r in got] == plain(target, ps, 24)
    assert sum(r.num_preemptions for r in got) > 0
    assert eng.stats()["prefix_cache_hits"] > 0
  assert sum(r.usage().spec_draft_tokens for r in got) > 0
  s = eng.stats()
  assert s["spec_steps_eagle3"] > 0 and s["spec_drafted_eagle3"] > 0


@pytest.mark.slow
def test_prefix_hits_on_pages_a_plain_row_decoded(target):
  """A drafter-off request decodes past its prompt in the plain loop, which writes no head KV.
  An eagle3 request over those tokens still hits them (less the last page), counted as hits
  lacking drafter entries, its output plain greedy's, its head KV a one-shot pass's where it
  computed it; the page it recomputed takes over the plain row's key, so a third request hits
  a page holding the head's entries there. (The engine's programs are the head-state test's,
  the reference the module's plain engine: none compiled.)"""
  hcfg, hparams = head(target, ENGINE_VARIANTS[0])
  eng = Engine(*target, EngineConfig(**CONFIG, speculative="eagle3"), head=(hcfg, hparams))
  prompt = [1] + list(range(5, 21))  # 17 tokens: pages 0 and 1 prefilled, then page 2 plain
  (a,) = eng.generate([prompt], SamplingParams(drafter="off"),
                      StopParams(max_tokens=26, ignore_eos=True))
  if a.usage().spec_draft_tokens or len(a.output_ids) != 26:
    pytest.fail(f"the plain row drafted or stopped early: {a.usage()}")
  lacking = lambda: eng.stats()["prefix_cache_hits_lacking_drafter_entries"]

  def first_token(ids, max_tokens):
    req = eng.requests[eng.add_request(ids, SamplingParams(),
                                       StopParams(max_tokens=max_tokens, ignore_eos=True))]
    while not req.output_ids:
      eng.step()
    return req

  b = first_token((prompt + a.output_ids)[:40] + [11, 12], 8)
  assert b.cached_tokens == 4 * PAGE and lacking() == 2  # pages 0-3 hit; 2-3 plain-decoded
  check_head_state(eng, b, target, hcfg, hparams, since=4 * PAGE)
  b_pages = list(b.pages)
  while not b.finished:
    eng.step()
  assert b.output_ids == plain(target, [b.prompt_ids], 8)[0]
  c = first_token(b.all_ids + [13], 2)
  assert c.cached_tokens == 5 * PAGE and lacking() == 4  # b's page 4 holds the head's entries
  assert c.pages[:5] == b_pages[:5] and eng.pool.observed(c.pages[4]) == {"eagle3"}
  eng.pool.check_invariants()


@pytest.mark.slow
def test_command_line_eagle3_prints_the_spec_keys(target):
  """`python -m engine.generate --speculative=eagle3 --eagle3_checkpoint=DIR --json`: plain
  decoding's tokens, and the `spec` keys every drafter prints. The head is `mha_reduced`: this
  is that layout's engine run (greedy output identical to speculative off; see the module
  docstring)."""
  import subprocess
  import sys
  states = np.load(os.path.join(FIXTURES, "target_states.npz"))
  ids = ",".join(map(str, states["prompt_0"].tolist()))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-m", "engine.generate",
                      f"--checkpoint={os.path.join(FIXTURES, 'target')}", f"--prompt_ids={ids}",
                      "--max_new_tokens=12", "--ignore_eos", "--dtype=float32", "--json",
                      "--speculative=eagle3", "--num_draft_tokens=3",
                      f"--eagle3_checkpoint={os.path.join(FIXTURES, CLI_VARIANT)}"],
                     cwd=root, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  obj = json.loads(r.stdout.strip().splitlines()[-1])
  assert obj["token_ids"] == plain(target, [states["prompt_0"].tolist()], 12)[0]
  spec = obj["spec"]
  assert spec["method"] == "eagle3" and spec["drafters"] == ["eagle3"]
  assert {"drafted", "accepted", "accepted_at", "mean_accepted_length"} <= set(spec)
  assert len(spec["accepted_at"]) == 3 and spec["accepted"] <= spec["drafted"]
  # (a fixed draft length: every verify step drafts, whatever the cost table says)
  assert spec["drafted"] > 0
  assert spec["steps"] + spec["accepted"] == 11  # every forward: 1 + its accepted drafts
