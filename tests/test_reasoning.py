"""The reasoning splitter on its own (no model): token marking and text split."""

from engine.service.reasoning import ReasoningConfig, ReasoningState

START, END = 100, 101


class CharTokenizer:
  """Token t decodes to chr(t); the think markers are special tokens that decode to nothing."""

  def decode(self, ids, skip_special_tokens=True):
    return "".join("" if t in (START, END) else chr(t) for t in ids)


def test_think_block_inside_the_generation():
  state = ReasoningState(ReasoningConfig(START, END), CharTokenizer())
  ids = [START, ord("h"), ord("m"), END, ord("o"), ord("k")]
  a = state.split(ids[:2], "h")  # all reasoning
  assert (a.num_reasoning_tokens, a.reasoning_text, a.answer_text) == (2, "h", "")
  assert not state.answer_started
  b = state.split(ids[2:5], "mo")  # straddles the end marker
  assert (b.num_reasoning_tokens, b.reasoning_text, b.answer_text) == (2, "m", "o")
  assert state.answer_started
  c = state.split(ids[5:], "k")
  assert (c.num_reasoning_tokens, c.reasoning_text, c.answer_text) == (0, "", "k")


def test_starts_in_reasoning_and_no_markers():
  state = ReasoningState(ReasoningConfig(START, END, starts_in_reasoning=True), CharTokenizer())
  s = state.split([ord("a"), END, ord("b")], "ab")
  assert (s.num_reasoning_tokens, s.reasoning_text, s.answer_text) == (2, "a", "b")
  plain = ReasoningState(ReasoningConfig(START, END), CharTokenizer())
  s = plain.split([ord("x"), ord("y")], "xy")
  assert (s.num_reasoning_tokens, s.reasoning_text, s.answer_text) == (0, "", "xy")
