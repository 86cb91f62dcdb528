"""The reasoning splitter on its own (no model): token marking and text split, gRPC Generate's
split by ids, and the same rule on text and on ids."""

import itertools

from engine.chat.markup import KIMI_K2, THINK
from engine.chat.reasoning import ReasoningConfig, ReasoningSplitter, ThinkIds

START, END = 100, 101


class CharTokenizer:
  """Token t decodes to chr(t); the think markers are special tokens that decode to nothing."""

  def decode(self, ids, skip_special_tokens=True):
    return "".join("" if t in (START, END) else chr(t) for t in ids)


def test_think_block_inside_the_generation():
  state = ReasoningSplitter.for_ids(ReasoningConfig(START, END))
  tok = CharTokenizer()
  ids = [START, ord("h"), ord("m"), END, ord("o"), ord("k")]
  a = state.split_ids(ids[:2], "h", tok)  # all reasoning (the marker is none of its tokens)
  assert (a.num_reasoning_tokens, a.reasoning_text, a.answer_text) == (1, "h", "")
  assert not state.answer_started
  b = state.split_ids(ids[2:5], "mo", tok)  # straddles the end marker
  assert (b.num_reasoning_tokens, b.reasoning_text, b.answer_text) == (1, "m", "o")
  assert state.answer_started
  c = state.split_ids(ids[5:], "k", tok)
  assert (c.num_reasoning_tokens, c.reasoning_text, c.answer_text) == (0, "", "k")
  assert state.reasoning_tokens == 2


def test_starts_in_reasoning_and_no_markers():
  tok = CharTokenizer()
  state = ReasoningSplitter.for_ids(ReasoningConfig(START, END, starts_in_reasoning=True))
  s = state.split_ids([ord("a"), END, ord("b")], "ab", tok)
  assert (s.num_reasoning_tokens, s.reasoning_text, s.answer_text) == (1, "a", "b")
  plain = ReasoningSplitter.for_ids(ReasoningConfig(START, END))
  s = plain.split_ids([ord("x"), ord("y")], "xy", tok)
  assert (s.num_reasoning_tokens, s.reasoning_text, s.answer_text) == (0, "", "xy")
  # A thought opens only at the start: <think> after answer text is answer.
  late = ReasoningSplitter.for_ids(ReasoningConfig(START, END))
  s = late.split_ids([ord("x"), START, ord("y")], "xy", tok)
  assert s.num_reasoning_tokens == 0 and s.answer_text == "xy"


# Tokens as (id, text): Kimi-like markers are single tokens with their own text.
T = {"<think>": 1, "</think>": 2, KIMI_K2.tools_begin: 3}


def tokens(*pieces):
  return [(T.get(p, 1000 + i), p) for i, p in enumerate(pieces)]


OUTPUTS = [
    # (starts_in_reasoning, pieces, reasoning text, answer text, reasoning tokens)
    (True, ("a", "b", "</think>", "c"), "ab", "c", 2),
    (False, ("<think>", "x", "<think>", "y", "</think>", "z"), "xy", "z", 2),
    (False, (" ", "<think>", "x"), "", " <think>x", 0),
    (False, ("q", "<think>", "r"), "", "q<think>r", 0),
    (True, ("p", KIMI_K2.tools_begin, "t"), "p", KIMI_K2.tools_begin + "t", 1),
    (True, ("only", " thought"), "only thought", "", 2),
]


def test_text_and_ids_follow_one_rule_at_every_cut():
  """The text split (any cut of the deltas) and the id count agree, on K2's markers."""
  ids = ThinkIds(T["<think>"], T["</think>"], (T[KIMI_K2.tools_begin],))
  for thought, pieces, want_r, want_a, n in OUTPUTS:
    toks = tokens(*pieces)
    text = "".join(p for _, p in toks)
    cuts = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for chunks in cuts:
      s = ReasoningSplitter.for_markup(KIMI_K2, starts_in_reasoning=thought, ids=ids)
      parts = [s.feed(c) for c in chunks] + [s.finish()]
      assert "".join(r for r, _ in parts) == want_r, (pieces, chunks)
      assert "".join(a for _, a in parts) == want_a, (pieces, chunks)
    for k in (1, 2, 3):
      s = ReasoningSplitter.for_markup(KIMI_K2, starts_in_reasoning=thought, ids=ids)
      for batch in itertools.batched([t for t, _ in toks], k):
        s.count(batch)
      assert s.reasoning_tokens == n, (pieces, k)


def test_a_family_without_section_markers_keeps_them_in_the_thought():
  s = ReasoningSplitter.for_markup(THINK, starts_in_reasoning=True)
  r, a = s.feed("x" + KIMI_K2.tools_begin + "y</think>z")
  r2, a2 = s.finish()
  assert (r + r2, a + a2) == ("x" + KIMI_K2.tools_begin + "y", "z")
