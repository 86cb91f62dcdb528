"""Structured outputs on the serving engine with the demo model: constrained rows take the
masked step (`steps.masked_step`), unconstrained ones the decode loop, speculative drafts of
constrained rows (the n-gram drafter's on the host; the MTP layer's and the EAGLE-3 head's on
the device) are verified against the grammar's masks."""

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import engine
from engine.model.cache import init_cache
from engine.model.transformer import forward_logits
from engine.api import DEMO_CHECKPOINT
from engine.runtime import steps, structured
from engine.runtime.engine import Engine, EngineConfig
from engine.runtime.grammar import GrammarError, StructuredOutputsParams as S, compile_grammar
from engine.runtime.request import StopParams
from engine.runtime.sampling import SamplingParams
from engine_spec_helpers import check_drafter_states

SCHEMAS = {
    "required_fields": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"kind": {"enum": ["int", "str", "list"]}},
             "required": ["kind"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 1, "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["point", "tags"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 10, "maximum": 250}},
        "required": ["n"], "additionalProperties": False},
}
PROMPT = "def load(path):\n    return json.loads("
REPETITIVE = "x = 1\ny = 2\n" * 6


@pytest.fixture(scope="module")
def model():
  return engine.load(dtype="float32", progress=False)


@pytest.fixture(scope="module")
def eng(model):
  """Speculative (n-gram) engine; requests choose drafter "off" for plain decoding. 8 usable
  pages of 16 tokens: four JSON outputs at once preempt each other."""
  return Engine.from_model(model, EngineConfig(
      max_num_seqs=4, max_num_batched_tokens=64, row_widths=(16, 64), max_model_len=256,
      num_pages=9,
      max_decode_steps=8, speculative="ngram", num_draft_tokens=4, measure_spec_costs=False,
      constrained_warmup=False))


def run(eng, prompts, sampling, max_tokens=48):
  done = eng.generate(prompts, sampling, StopParams(max_tokens=max_tokens))
  return [(r.output_ids, r.finish_reason) for r in done], done


def text(model, ids):
  return model.tokenizer.decode([t for t in ids if t not in model.eos_token_ids])


def plain(spec=None, **kw):
  return SamplingParams(structured_outputs=spec, drafter="off", **kw)


@pytest.mark.slow
def test_greedy_equals_the_brute_force_argmax_over_allowed_tokens(model, eng):
  """At each step, the reference tries every vocabulary id against the matcher (llguidance's
  own check) and takes the model's argmax among those it allows."""
  spec = S(regex=r"(True|False|None|[0-9]{1,3})( (and|or) (True|False|[0-9]{1,3}))*")
  prompt = model.encode("if x is not ")
  (ids, reason), = run(eng, [prompt], [plain(spec)], max_tokens=12)[0]
  cfg, params = model.config, model.params
  m = compile_grammar(spec, model.tokenizer, vocab_size=cfg.vocab_size,
                      eos_token_ids=model.eos_token_ids).matcher()
  width, page = 32, 16
  ref = []
  for _ in range(len(ids)):
    seq = prompt + ref
    cache = init_cache(cfg, width // page + 1, page, jnp.float32)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    logits, _ = forward_logits(params, cache, tokens, np.zeros(1, np.int32),
                               np.asarray([len(seq)], np.int32),
                               np.arange(1, width // page + 1, dtype=np.int32)[None], cfg=cfg)
    row = np.asarray(logits[0, len(seq) - 1])
    allowed = [t for t in range(cfg.vocab_size) if m.allowed_prefix([t]) == 1]
    best = max(allowed, key=lambda t: (row[t], -t))
    ref.append(best)
    assert m.accept(best)
    if m.is_terminated() or best in model.eos_token_ids:
      break
  assert ids == ref
  if reason == "stop":
    assert re.fullmatch(spec.regex, text(model, ids))


@pytest.mark.slow
def test_json_schemas_validate_greedy_and_sampled(model, eng):
  cases = [(name, t, seed) for name in SCHEMAS for t, seed in ((0.0, 0), (1.0, 1), (1.0, 2))]
  sampling = [plain(S(json=json.dumps(SCHEMAS[name])), temperature=t, seed=seed)
              for name, t, seed in cases]
  preempted = eng.scheduler.num_preemptions
  results, _ = run(eng, [PROMPT] * len(cases), sampling, max_tokens=64)
  for (name, t, seed), (ids, reason) in zip(cases, results):
    assert reason == "stop", (name, t, seed, text(model, ids))
    jsonschema.validate(json.loads(text(model, ids)), SCHEMAS[name])
  assert eng.scheduler.num_preemptions > preempted  # constrained rows were recomputed ...
  for i in (0, 3):  # ... without changing their outputs (greedy and sampled, run alone)
    assert run(eng, [PROMPT], [sampling[i]], max_tokens=64)[0] == [results[i]]


@pytest.mark.slow
def test_regex_choice_and_lark_grammar_outputs_match(model, eng):
  lark = 'start: NAME " = " value\nvalue: NUM | NAME "(" NUM ")"\nNAME: /[a-z_]{1,8}/\n' \
         'NUM: /[0-9]{1,4}/'
  specs = [S(regex=r"[a-z_]{2,10}\([a-z_, ]{0,12}\)"), S(choice=("None", "True", "False")),
           S(grammar=lark), S(json_object=True)]
  sampling = [plain(s, temperature=t, seed=5) for s in specs for t in (0.0, 1.0)]
  results, _ = run(eng, ["def f(x):\n    return "] * len(sampling), sampling, max_tokens=40)
  outs = [text(model, ids) for ids, _ in results]
  assert all(reason == "stop" for _, reason in results), outs
  for out in outs[:2]:
    assert re.fullmatch(specs[0].regex, out)
  assert set(outs[2:4]) <= {"None", "True", "False"}
  for out in outs[4:6]:
    assert re.fullmatch(r"[a-z_]{1,8} = ([0-9]{1,4}|[a-z_]{1,8}\([0-9]{1,4}\))", out)
  for out in outs[6:8]:
    assert isinstance(json.loads(out), dict)


@pytest.mark.slow
def test_unconstrained_rows_beside_constrained_ones_are_unchanged(model, eng):
  free = [plain(), plain(temperature=0.8, seed=3)]
  prompts = ["import os\n", "class Config:\n"]
  alone, _ = run(eng, prompts, free, max_tokens=24)
  spec = S(json=json.dumps(SCHEMAS["nested"]))
  mixed, done = run(eng, [PROMPT, prompts[0], PROMPT, prompts[1]],
                    [plain(spec), free[0], plain(spec, temperature=1.0, seed=9), free[1]],
                    max_tokens=24)
  assert [mixed[1], mixed[3]] == alone
  assert all(r.grammar.is_accepting() or r.finish_reason == "length" for r in done[::2])


@pytest.mark.slow
def test_speculative_constrained_output_equals_plain_constrained(model, eng):
  # The prompt's "y = 2" is forbidden: drafts that copy it are cut where the grammar refuses.
  spec = S(regex=r"(x = 1\n|y = 3\n|z = [0-9]\n){1,12}")
  stats0 = eng.stats()
  rows = [(0.0, 0), (1.0, 4)]
  spec_out, _ = run(eng, [REPETITIVE] * 2,
                    [SamplingParams(structured_outputs=spec, temperature=t, seed=s)
                     for t, s in rows], max_tokens=40)
  stats1 = eng.stats()
  plain_out, _ = run(eng, [REPETITIVE] * 2, [plain(spec, temperature=t, seed=s) for t, s in rows],
                     max_tokens=40)
  assert stats1["structured_drafted"] > stats0["structured_drafted"]  # drafts were proposed
  assert stats1["spec_accepted"] > stats0["spec_accepted"]  # and some were accepted
  assert spec_out == plain_out
  # Compiled widths only: [B, 1] and [B, k + 1] per decode bucket (what warm-up compiles).
  assert steps.masked_step._cache_size() <= 2 * len(eng.buckets.decode)
  for ids, _ in spec_out:
    assert re.fullmatch(spec.regex, text(model, ids))


FUNCTION = r"def [a-z]{1,6}\(self\):\n    return [a-z]{1,6}\n"


@pytest.mark.slow
def test_model_drafters_draft_for_constrained_rows_checked_against_the_grammar(model, eng,
                                                                                 monkeypatch):
  """Constrained rows drafting with the demo target's MTP layer and with its EAGLE-3 head
  (`checkpoints/demo/eagle3`) in one batch, on one engine with both: each drafter's top-1
  drafts, proposed by each masked step on the device and cut on the host at the first token the
  grammar forbids, verified under the masks. Every row, greedy
  and seeded sampled, keeps plain decoding's output, each constrained one within its grammar;
  each drafter's constrained rows drafted, had drafts accepted and had drafts cut; an "auto"
  constrained row drafts with MTP (the first device drafter the engine has, in registry
  order); the MTP layer's and the head's cache entries and row state equal a one-shot pass
  mid-request (the masked step's `observe` keeps them current, as the speculative loop
  does). (Unconstrained rows beside constrained ones:
  `test_unconstrained_rows_beside_constrained_ones_are_unchanged`; the demo head in the decode
  loop: the served and sharded engines' tests. An eagle3 row here would compile this engine's
  speculative loop, ~10 s.)"""
  tok = model.tokenizer
  schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "size": {"type": "integer"}},
            "required": ["name", "size"], "additionalProperties": False}
  lines = S(regex=r"(x = 1\n|y = 3\n|z = [0-9]\n){1,12}")  # (the prompt's "y = 2" forbidden)
  short = StopParams(max_tokens=32, ignore_eos=True)
  rows = [  # (prompt, sampling, stop); the engine's default drafter is eagle3
      ("def add(a, b):", SamplingParams(structured_outputs=S(regex="(yes|no|maybe)")), short),
      ("import os\n", SamplingParams(structured_outputs=S(regex=FUNCTION)), short),
      ("x = ", SamplingParams(structured_outputs=S(json=json.dumps(schema)), temperature=0.7,
                              seed=3), short),
      (REPETITIVE, SamplingParams(structured_outputs=lines, drafter="mtp"),
       StopParams(max_tokens=40)),
      (REPETITIVE, SamplingParams(structured_outputs=lines, temperature=1.0, seed=4,
                                  drafter="auto"), StopParams(max_tokens=40))]
  ps = [tok.encode(p).ids for p, _, _ in rows]
  want = eng.generate(ps, [dataclasses.replace(s, drafter="off") for _, s, _ in rows],
                      [t for _, _, t in rows])
  # One engine with both drafters; the whole batch's prompts prefill in one [16 x 16] step
  # (one mixed-step program), then every row takes one [5, 4] masked step.
  head = model.llm.head(os.path.join(os.path.dirname(DEMO_CHECKPOINT), "eagle3"))
  both = Engine.from_model(model, EngineConfig(
      page_size=16, max_num_seqs=5, max_num_batched_tokens=128, row_widths=(16,),
      max_model_len=96, max_decode_steps=8, cache_dtype=jnp.float32, speculative="eagle3",
      drafters=("mtp",), num_draft_tokens=3, measure_spec_costs=False,
      decode_batch_sizes=(5,)), head=head)
  cut = dict(mtp=0, eagle3=0)
  prepare = structured.prepare

  def counting(reqs, draft_k, *args):  # each drafter's drafts the grammar cut
    proposed = [structured.proposed_drafts(r)[:k] for r, k in zip(reqs, draft_k)]
    prep = prepare(reqs, draft_k, *args)
    mine = [len(p) - len(d) for p, d in zip(proposed, prep.drafts)]
    assert sum(mine) == prep.cut  # (every constrained row here drafts on the device)
    for n, name in zip(mine, prep.drafters):
      cut[name] += n
    return prep
  monkeypatch.setattr(structured, "prepare", counting)
  reqs = [both.requests[both.add_request(p, s, t)] for p, (_, s, t) in zip(ps, rows)]
  # Mid-request, after masked steps that verified drafts (an eagle3 row's), or accepted some
  # (each MTP row's): both drafters' states, which every constrained row keeps.
  unchecked = {"eagle3": (reqs[:3], lambda r: r.spec.drafted)}
  unchecked.update({r.request_id: ([r], lambda r: r.spec.accepted) for r in reqs[3:]})
  while both.has_unfinished():
    both.step()
    for key, (rs, ready) in list(unchecked.items()):
      r = next((r for r in rs if not r.finished and ready(r)), None)
      if r is not None:
        check_drafter_states(both, r, (model.config, model.params), mtp=True, head=head)
        del unchecked[key]
  assert not unchecked, list(unchecked)
  assert [(r.output_ids, r.finish_reason) for r in reqs] == [
      (r.output_ids, r.finish_reason) for r in want]
  out = [text(model, r.output_ids) for r in reqs]
  assert out[0] in ("yes", "no", "maybe")
  assert re.fullmatch(FUNCTION, out[1]), out[1]
  assert set(json.loads(out[2])) == {"name", "size"}
  for o in out[3:]:
    assert re.fullmatch(lines.regex, o), o
  s = both.stats()
  info = ([(r.spec.drafted, r.spec.accepted, r.spec.drafter_steps, len(r.output_ids))
           for r in reqs], cut, {k: v for k, v in s.items() if k.startswith("structured_")})
  # (the first masked step has no drafts: "yes" / "no" / "maybe" may end before any)
  assert all(r.spec.drafted > 0 for r in reqs[1:]), info  # every other row drafted
  assert sum(r.spec.accepted for r in reqs[:3]) > 0, info
  assert all(r.spec.accepted > 0 for r in reqs[3:]), info
  assert all(set(r.spec.drafter_steps) <= {"eagle3"} for r in reqs[:3]), info
  assert all(set(r.spec.drafter_steps) == {"mtp"} for r in reqs[3:]), info  # "auto" too
  assert cut["mtp"] > 0 and cut["eagle3"] > 0, info  # drafts the grammar forbids: never verified
  assert s["structured_drafts_cut"] == cut["mtp"] + cut["eagle3"], info
  assert s["structured_drafted"] == sum(r.spec.drafted for r in reqs), info
  assert s["structured_drafted"] > s["structured_accepted"] > 0, info
  assert s["spec_drafted_mtp"] == sum(r.spec.drafted for r in reqs[3:]), info
  assert s["spec_drafted_eagle3"] == sum(r.spec.drafted for r in reqs[:3]), info


def test_bad_schema_is_refused_at_add_request(eng):
  with pytest.raises(GrammarError, match="strnig"):
    eng.add_request("x", plain(S(json='{"type": "strnig"}')))
  with pytest.raises(ValueError, match="unclosed"):
    eng.add_request("x", plain(S(regex="(a")))


@pytest.mark.slow
def test_engine_generate_takes_structured_outputs(model):
  out = engine.generate(model, ["x = ", "y = "], max_new_tokens=8,
                        structured_outputs=[S(choice=("1", "2")), None])
  assert text(model, out[0].token_ids) in ("1", "2") and out[0].finish_reason == "stop"
  assert out[1].token_ids == engine.generate(model, "y = ", max_new_tokens=8).token_ids
  model.llm.release()
