"""Structured outputs' grammar layer (engine/runtime/grammar.py) on the demo tokenizer and a
Kimi-style tiktoken tokenizer: compilation and its errors, masks, EOS, special tokens, caching,
and the host n-gram drafter of constrained rows against the device one."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from engine.api import load_tokenizer
from engine.model.tiktoken_tokenizer import KIMI_PAT_STR, NUM_SPECIAL_IDS, TiktokenTokenizer
from engine.runtime import grammar as g
from engine.runtime.grammar import GrammarError, StructuredOutputsParams as S, compile_grammar
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative.drafters.ngram import ngram_draft, ngram_propose

DEMO = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "demo", "target")
EOS = 2


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(DEMO)


def encode(tok, text):
  return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("spec, reason", [
    (S(regex="a(b"), "unclosed group"),
    (S(json='{"type": "strnig"}'), "strnig"),
    (S(json='{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}'), "missing"),
    (S(json="{not json"), "not valid JSON"),
    (S(json="[1, 2]"), "must be an object or a boolean"),
    (S(grammar="start: undefined_rule"), "undefined_rule"),
    (S(choice=()), "non-empty"),
    (S(choice=("a", "")), r"choice\[1\]"),
    (S(), "exactly one"),
    (S(regex="a", choice=("b",)), "regex, choice"),
])
def test_bad_constraints_raise_grammar_error_with_the_reason(tok, spec, reason):
  with pytest.raises(GrammarError, match=reason):
    compile_grammar(spec, tok, vocab_size=8192, eos_token_ids=[EOS])


def test_sampling_params_validate_the_spec_structurally():
  SamplingParams(structured_outputs=S(json_object=True)).validate()
  with pytest.raises(ValueError, match="exactly one"):
    SamplingParams(structured_outputs=S()).validate()
  with pytest.raises(ValueError, match="StructuredOutputsParams"):
    SamplingParams(structured_outputs={"json": "{}"}).validate()


def test_a_valid_output_is_allowed_token_by_token_and_eos_only_at_the_end(tok):
  schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"], "additionalProperties": False}
  m = compile_grammar(S(json=json.dumps(schema)), tok, vocab_size=8192,
                      eos_token_ids=[EOS]).matcher()
  ids = encode(tok, '{"a": 12, "b": "y"}')
  specials = {0, 1, 2}
  for t in ids:
    allowed = set(m.allowed_tokens().tolist())
    assert t in allowed and not allowed & specials  # control tokens are never text
    assert m.accept(t)
  assert m.is_accepting() and m.is_terminated()
  assert m.allowed_tokens().tolist() == [EOS]
  assert not m.accept(encode(tok, " ")[0])  # nothing may follow
  assert m.is_error()


def test_mask_equals_the_per_token_check_and_rollback_restores_it(tok):
  m = compile_grammar(S(regex=r"(def|class) [a-z_]+\(\)"), tok, vocab_size=8192,
                      eos_token_ids=[EOS]).matcher()
  prefix = encode(tok, "def read")
  for t in prefix:
    assert m.accept(t)
  mask = m.allowed_tokens()
  brute = [t for t in range(8192) if m.allowed_prefix([t]) == 1]  # llguidance's own check
  assert mask.tolist() == brute and 0 < len(brute) < 8192
  m.rollback(2)
  assert m.num_accepted == len(prefix) - 2
  for t in prefix[-2:]:
    assert m.accept(t)
  assert m.allowed_tokens().tolist() == brute
  c = m.copy()
  assert c.accept(encode(tok, "_")[0]) and m.allowed_tokens().tolist() == brute


def test_choice_and_lark_grammar_and_json_object(tok):
  m = compile_grammar(S(choice=("yes", "no", 'say "hi"')), tok, vocab_size=8192,
                      eos_token_ids=[EOS]).matcher()
  for t in encode(tok, 'say "hi"'):
    assert m.accept(t)
  assert m.is_terminated()
  lark = 'start: "x = " NUM ("+" NUM)*\nNUM: /[0-9]+/'
  m = compile_grammar(S(grammar=lark), tok, vocab_size=8192, eos_token_ids=[EOS]).matcher()
  assert m.accept_tokens(encode(tok, "x = 1+22")) == len(encode(tok, "x = 1+22"))
  assert m.is_accepting() and not m.is_terminated()
  m = compile_grammar(S(json_object=True), tok, vocab_size=8192, eos_token_ids=[EOS]).matcher()
  assert m.accept_tokens(encode(tok, '{"k": [1, {}]}')) == len(encode(tok, '{"k": [1, {}]}'))
  assert m.allowed_prefix(encode(tok, "[")) == 0  # an object, not any JSON value


def test_compiled_once_per_tokenizer_and_spec(tok):
  spec = S(regex="[ab]+")
  a = compile_grammar(spec, tok, vocab_size=8192, eos_token_ids=[EOS])
  assert compile_grammar(S(regex="[ab]+"), tok, vocab_size=8192, eos_token_ids=[EOS]) is a
  assert g.ll_tokenizer(tok, 8192, [EOS]) is a.tokenizer
  b = compile_grammar(spec, tok, vocab_size=8192 + 64, eos_token_ids=[EOS])  # padded vocab
  assert b is not a
  assert not b.matcher().allowed_tokens().max() >= 8192  # ids the tokenizer lacks: never
  assert g.default_eos_ids(tok) == (EOS,)


def test_kimi_style_tiktoken_tokenizer_exactly():
  """Ranks (bytes, then merges), 256 special ids named as Kimi's: special tokens are control
  tokens to the grammar (never the text "<|im_end|>"), and the mask covers the id layout."""
  words = [b"ab", b"abc", b" x", b'{"', b'":', b"12"]
  ranks = {bytes([i]): i for i in range(256)}
  ranks.update({w: 256 + j for j, w in enumerate(words)})
  n = len(ranks)
  specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + NUM_SPECIAL_IDS)}
  del specials[f"<|reserved_token_{n}|>"], specials[f"<|reserved_token_{n + 1}|>"]
  specials.update({"[EOS]": n, "<|im_end|>": n + 1})
  tt = TiktokenTokenizer(ranks, specials, set(specials.values()), "[EOS]", pat_str=KIMI_PAT_STR)
  assert tt.eos_token_ids == (n, n + 1)
  vocab = n + NUM_SPECIAL_IDS
  m = compile_grammar(S(regex=r"<\|im_end\|>|abc+"), tt, vocab_size=vocab).matcher()
  allowed = set(m.allowed_tokens().tolist())
  assert ord("<") in allowed and ranks[b"abc"] in allowed and ranks[b"ab"] in allowed
  assert not allowed & set(range(n, vocab))  # the special id is not the text
  ids = tt.encode("<|im_end|>").ids  # typed text: plain bytes
  assert m.accept_tokens(ids) == len(ids) and m.is_terminated()
  assert m.allowed_tokens().tolist() == [n, n + 1]  # both stop tokens end it
  # A Lark grammar may name the special token itself.
  m = compile_grammar(S(grammar='start: "ab" <|im_end|>'), tt, vocab_size=vocab).matcher()
  assert m.accept(ranks[b"ab"]) and m.allowed_tokens().tolist() == [n + 1]


def test_host_ngram_draft_equals_the_device_drafter():
  rng = np.random.default_rng(0)
  k, width = 4, 40
  for _ in range(30):
    hist = rng.integers(0, 4, (rng.integers(3, width),)).tolist()
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(hist)] = hist
    draft, n = ngram_propose(jnp.asarray(padded), jnp.asarray([len(hist) - 1]), k)
    assert ngram_draft(hist, k, width) == np.asarray(draft)[0, :int(n[0])].tolist()


def test_prepare_cuts_drafts_at_a_forbidden_token_and_pads_to_the_compiled_width(tok):
  """`structured.prepare`: drafts by prompt lookup, cut where the grammar forbids one, a mask
  per position along them (the matcher left where it was), and a block of 1 or k + 1 columns."""
  import types
  from engine.runtime.structured import prepare
  grammar = compile_grammar(S(regex=r"(ab)+"), tok, vocab_size=8192, eos_token_ids=[EOS])
  a, b = encode(tok, "a")[0], encode(tok, "b")[0]
  x = encode(tok, "x")[0]
  m = grammar.matcher()
  assert m.accept(a) and m.accept(b)
  before = m.allowed_tokens().tolist()
  # History a b a b a x a b a b: the suffix "a b a b" recurs at the start, so the lookup
  # drafts a x a b; the grammar allows a, then forbids x.
  row = types.SimpleNamespace(all_ids=[a, b, a, b, a, x, a, b, a, b], grammar=m)
  free = types.SimpleNamespace(all_ids=[5, 6, 7], grammar=grammar.matcher())
  prep = prepare([row, free], [4, 4], window=64, vocab_size=8192, max_drafts=4)
  assert prep.drafts == [[a], []]
  assert prep.bitmask.shape[:2] == (2, 5)  # k + 1 columns, whatever the drafts' lengths
  after_a = grammar.matcher()
  for t in (a, b, a):
    assert after_a.accept(t)
  masks = [np.flatnonzero(g.unpack_bitmask(prep.bitmask[0, j], 8192)).tolist() for j in (0, 1)]
  assert masks == [before, after_a.allowed_tokens().tolist()]
  assert m.num_accepted == 2 and m.allowed_tokens().tolist() == before  # rolled back
  assert prepare([free], [4], 64, 8192, 4).bitmask.shape[:2] == (1, 1)  # no draft: one column


def test_prepare_cuts_device_drafts_at_a_forbidden_token(tok):
  """A row drafting with a device drafter (EAGLE-3, `speculative/constrained.py`): the drafts
  the last masked step proposed after its newest token (`RequestSpec.proposed`), cut at the
  first one the grammar forbids (counted); drafts proposed for another position are not used.
  "auto" rows take the engine's device drafter, else the n-gram host form."""
  import types
  from engine.runtime.structured import prepare, row_drafter
  grammar = compile_grammar(S(regex=r"(ab)+"), tok, vocab_size=8192, eos_token_ids=[EOS])
  a, b = encode(tok, "a")[0], encode(tok, "b")[0]
  x = encode(tok, "x")[0]
  m = grammar.matcher()
  assert m.accept(a)
  row = types.SimpleNamespace(all_ids=[7, 8, a], num_computed=2, grammar=m,
                              spec=types.SimpleNamespace(drafter="eagle3",
                                                         proposed=(2, [b, a, x, b])))
  stale = types.SimpleNamespace(all_ids=[7, 8, a], num_computed=1, grammar=grammar.matcher(),
                                spec=types.SimpleNamespace(drafter="auto", proposed=(2, [a])))
  prep = prepare([row, stale], [4, 4], window=64, vocab_size=8192, max_drafts=4,
                 device=("eagle3",))
  assert prep.drafts == [[b, a], []] and prep.cut == 2
  assert m.num_accepted == 1  # rolled back
  assert prepare([row], [1], 64, 8192, 4, device=("eagle3",)).drafts == [[b]]  # its limit
  assert row_drafter("auto", ("eagle3",)) == "eagle3" and row_drafter("auto") == "ngram"
  assert row_drafter("ngram", ("eagle3",)) == "ngram" and row_drafter("eagle3") is None
  assert row_drafter("mtp", ("eagle3",)) is None and row_drafter(None, ("eagle3",)) is None
