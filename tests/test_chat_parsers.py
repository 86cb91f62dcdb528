"""Streaming chat output parsers: answer / reasoning / tool calls from text deltas.

Every sample is fed whole, cut at every single character boundary, one character at a time and
in random bundles; all must give the same content, reasoning and calls as the expectation.
"""

import itertools
import random

import pytest

from engine.chat.markup import family_for, starts_in_reasoning
from engine.chat.parsers import PARSER_FAMILIES, ChatDelta, make_parser

K_SEC, K_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARG, K_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
D_SEC, D_SEC_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
D_CALL, D_SEP, D_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
ALL_MARKERS = (K_SEC, K_SEC_END, K_CALL, K_ARG, K_END, D_SEC, D_SEC_END, D_CALL, D_SEP, D_END,
               "<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>",
               "<|tool_call_section_begin|>", "<|tool_call_section_end|>")


def ids():
  counter = itertools.count()
  return lambda: f"call_{next(counter)}"


def run(family, chunks, *, reasoning=False, tools=True):
  """Feeds the chunks; returns content, reasoning, complete calls and the streamed calls
  (index -> [id, name, arguments] as the deltas built them)."""
  p = make_parser(family, starts_in_reasoning=reasoning, tools_enabled=tools, make_id=ids())
  content = thought = ""
  streamed = {}
  for d in [p.feed(c) for c in chunks] + [p.finish()]:
    assert isinstance(d, ChatDelta)
    content += d.content
    thought += d.reasoning
    for t in d.tool_calls:
      entry = streamed.setdefault(t.index, [None, None, ""])
      if t.id is not None:
        assert entry[0] is None, "a call's id is sent once"
        entry[0] = t.id
      if t.name is not None:
        assert entry[1] is None, "a call's name is sent once"
        entry[1] = t.name
      entry[2] += t.arguments
  return content, thought, p.tool_calls, streamed


def chunkings(text):
  yield [text]
  if len(text) < 2:
    return
  yield list(text)
  for i in range(1, len(text)):
    yield [text[:i], text[i:]]
  rng = random.Random(len(text))
  for _ in range(30):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def calls(*pairs, ids_=None):
  out = []
  for i, (name, args) in enumerate(pairs):
    out.append({"id": ids_[i] if ids_ else f"call_{i}", "type": "function",
                "function": {"name": name, "arguments": args}})
  return out


KIMI_TWO = (
    "Let me check." + K_SEC + K_CALL + "functions.get-weather.v2:0" + K_ARG
    + '{"city": "Paris"}' + K_END + K_CALL + "functions.search:1" + K_ARG + ' {"q": "a<b"} '
    + K_END + K_SEC_END)

CASES = [
    # (family, starts_in_reasoning, text, content, reasoning, calls)
    ("kimi_k2", False, KIMI_TWO, "Let me check.", "",
     calls(("get-weather.v2", '{"city": "Paris"}'), ("search", '{"q": "a<b"}'),
           ids_=["functions.get-weather.v2:0", "functions.search:1"])),
    # K2.5: the prompt ends in <think>; the thought ends at the tool section.
    ("kimi_k2", True, "I need the weather" + K_SEC + K_CALL + "functions.get_weather:0" + K_ARG
     + '{"city":"Oslo"}' + K_END + K_SEC_END, "", "I need the weather",
     calls(("get_weather", '{"city":"Oslo"}'), ids_=["functions.get_weather:0"])),
    ("kimi_k2", True, "hmm</think>The answer is 4.", "The answer is 4.", "hmm", []),
    ("kimi_k2", True, "plan<|tool_call_section_begin|>" + K_CALL + "functions.f:0" + K_ARG + "{}"
     + K_END + "<|tool_call_section_end|>", "", "plan",   # the singular spellings Kimi writes
     calls(("f", "{}"), ids_=["functions.f:0"])),
    ("kimi_k2", False, "<think>plan</think>Sure." + K_SEC + K_CALL + "functions.a.b:0" + K_ARG
     + "{}" + K_END + K_SEC_END + "\n", "Sure.", "plan",
     calls(("a.b", "{}"), ids_=["functions.a.b:0"])),
    # DeepSeek-V3: function<sep>NAME ```json fence; V3.1: NAME<sep>{json}.
    ("deepseek_v3", False, "Checking." + D_SEC + D_CALL + "function" + D_SEP + "get_weather\n"
     "```json\n{\"city\": \"Paris\"}\n```" + D_END + "\n" + D_CALL + "function" + D_SEP
     + "web-search.v1\n```json\n{\"q\": \"x\"}\n```" + D_END + D_SEC_END, "Checking.", "",
     calls(("get_weather", '{"city": "Paris"}'), ("web-search.v1", '{"q": "x"}'))),
    ("deepseek_v3", False, "<think>think</think>" + D_SEC + D_CALL + "get_time" + D_SEP
     + '{"tz": "UTC"}' + D_END + D_CALL + "function" + D_SEP + '{"a": 1}' + D_END + D_SEC_END,
     "", "think", calls(("get_time", '{"tz": "UTC"}'), ("function", '{"a": 1}'))),
    ("qwen3", False, "<think>\nhm\n</think>\n\nOK.<tool_call>\n{\"name\": \"get_weather\", "
     "\"arguments\": {\"city\": {\"n\": \"Paris\"}}}\n</tool_call>\n<tool_call>\n{\"arguments\": "
     "{}, \"name\": \"b-c.d\"}\n</tool_call>", "\n\nOK.", "\nhm\n",
     calls(("get_weather", '{"city": {"n": "Paris"}}'), ("b-c.d", "{}"))),
    ("qwen3", False, "plain answer", "plain answer", "", []),
    # Llama 3: the reply is the call(s); JSON inside an answer stays the answer.
    ("llama3_json", False, '{"name": "search-v.2", "parameters": {"q": "a {b} [c]", "n": '
     '{"k": "He said \\"hi {x}\\""}}}; {"name": "b", "arguments": {}}\n{"name": "c", '
     '"parameters": [1]} Anything else?', "Anything else?", "",
     calls(("search-v.2", '{"q": "a {b} [c]", "n": {"k": "He said \\"hi {x}\\""}}'), ("b", "{}"),
           ("c", "[1]"))),
    ("llama3_json", False, '<|python_tag|>{"name": "f", "parameters": {"a": 1}, "x": {"y": '
     '[2, 3]}, "z": 4}<|eom_id|>', "", "", calls(("f", '{"a": 1}'))),
    ("llama3_json", False, '{"parameters": {"a": 1}, "name": "g"}', "", "",
     calls(("g", '{"a": 1}'))),
    ("llama3_json", False, 'Here: {"name": "x", "parameters": {}}',
     'Here: {"name": "x", "parameters": {}}', "", []),
    ("llama3_json", False, '{"name": "Bob", "age": 3} is JSON', '{"name": "Bob", "age": 3} is JSON',
     "", []),
    ("llama3_json", False, '{"name": "t", "parameters": {"a": "cut', "", "",
     calls(("t", '{"a": "cut'))),
    ("llama3_json", False, '<|python_tag|>brave_search.call(query="x")',
     'brave_search.call(query="x")', "", []),
    ("think", True, "a</think>b", "b", "a", []),
    ("none", False, "<think>x</think>" + K_SEC, "<think>x</think>" + K_SEC, "", []),
    # Cut off: a call already announced stays a call (arguments as far as they came);
    # malformed text never announced is content, without markers; never an exception.
    ("kimi_k2", False, "x" + K_SEC + K_CALL + "functions.f:0 " + K_ARG + '{"a": 1', "x", "",
     calls(("f", '{"a": 1'), ids_=["functions.f:0"])),
    ("kimi_k2", False, K_SEC + K_CALL + "functions.a:0" + K_ARG + '{"x"' + K_CALL
     + "functions.b:1" + K_ARG + "{}" + K_END + K_SEC_END, "", "",
     calls(("a", '{"x"'), ("b", "{}"), ids_=["functions.a:0", "functions.b:1"])),
    ("kimi_k2", False, "y" + K_SEC + K_CALL + "functions.invalid.0" + K_ARG + "{}" + K_END
     + K_SEC_END, "yfunctions.invalid.0{}", "", []),
    ("kimi_k2", False, "x" + K_SEC + K_CALL + "bad header here" + K_ARG + "{}" + K_END
     + K_CALL + "functions.ok:1" + K_ARG + "{}" + K_END + K_SEC_END + "tail",
     "xbad header here{}tail", "", calls(("ok", "{}"), ids_=["functions.ok:1"])),
    ("kimi_k2", False, "x" + K_SEC + "junk" + K_CALL + "functions.f:0" + K_CALL
     + "functions.g:1" + K_ARG + "[]" + K_END + K_SEC_END, "xjunkfunctions.f:0", "",
     calls(("g", "[]"), ids_=["functions.g:1"])),
    ("deepseek_v3", False, D_SEC + D_CALL + "function" + D_SEP + "f\n```json\n{\"a\": 1}\n```",
     "", "", calls(("f", '{"a": 1}'))),
    ("deepseek_v3", False, "z" + D_SEC + D_CALL + "func tion" + D_SEP + "{}" + D_END + D_SEC_END,
     "zfunc tion{}", "", []),
    # vLLM's malformed DeepSeek-V3 cases: JSON cut short (still a call), no call marker (text).
    ("deepseek_v3", False, D_SEC + D_CALL + "function" + D_SEP + 'get_weather\n```json\n'
     '{"city": "Tokyo"\n```' + D_END + D_SEC_END, "", "", calls(("get_weather", '{"city": "Tokyo"'))),
    ("deepseek_v3", False, D_SEC + "function" + D_SEP + 'get_weather\n```json\n{"city": "Tokyo"}'
     '\n```' + D_SEC_END, 'functionget_weather\n```json\n{"city": "Tokyo"}\n```', "", []),
    ("qwen3", False, "a<tool_call>\nnot json\n</tool_call>b", "a\nnot json\nb", "", []),
    ("qwen3", False, "a<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}", "a", "",
     calls(("f", '{"x": 1}'))),
    ("qwen3", False, "a<tool_call>\n{\"name\": \"f\", \"argu", "a\n{\"name\": \"f\", \"argu",
     "", []),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_any_cut_gives_the_same_result(case):
  family, reasoning, text, content, thought, want_calls = CASES[case]
  for chunks in chunkings(text):
    got_content, got_thought, got_calls, streamed = run(family, chunks, reasoning=reasoning)
    where = f"chunks={chunks!r}"
    assert got_content == content, where
    assert got_thought == thought, where
    assert got_calls == want_calls, where
    for c in want_calls:  # the deltas add up to the calls
      assert [c["id"], c["function"]["name"], c["function"]["arguments"]] in streamed.values()
    for m in ALL_MARKERS:
      if family != "none":
        assert m not in got_content and m not in got_thought, (m, where)


def test_bundles_of_markers_from_speculative_steps():
  # Tokens as a Kimi tokenizer would cut them, then grouped 2..5 tokens per delta.
  tokens = ["Let", " me", " check.", K_SEC, K_CALL, "functions", ".get", "-weather", ".v2",
            ":", "0", K_ARG, '{"', "city", '":', ' "', "Paris", '"}', K_END, K_CALL,
            "functions", ".search", ":1", K_ARG, ' {"q', '": "', 'a<b', '"} ', K_END, K_SEC_END]
  assert "".join(tokens) == KIMI_TWO
  want = run("kimi_k2", [KIMI_TWO])
  for k in range(1, 6):
    bundles = ["".join(tokens[i:i + k]) for i in range(0, len(tokens), k)]
    assert run("kimi_k2", bundles) == want


def test_arguments_stream_before_the_call_ends():
  p = make_parser("kimi_k2", starts_in_reasoning=False, tools_enabled=True)
  d = p.feed(K_SEC + K_CALL + "functions.get_weather:0" + K_ARG + '{"city": "Par')
  assert [(t.index, t.id, t.name) for t in d.tool_calls] == [
      (0, "functions.get_weather:0", "get_weather")]
  assert d.tool_calls[0].arguments == '{"city": "Par'
  assert p.tool_calls == []  # not complete yet
  d = p.feed('is"}' + K_END)
  assert [(t.index, t.id, t.name, t.arguments) for t in d.tool_calls] == [(0, None, None, 'is"}')]
  assert p.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'

  q = make_parser("qwen3", tools_enabled=True)
  d = q.feed('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2')
  assert d.tool_calls[0].name == "f" and d.tool_calls[0].arguments == '{"a": [1, 2'
  d = q.feed(']}}')   # the last brace may close the wrapper: held back until it is known
  assert d.tool_calls[0].arguments == "]}"
  assert q.tool_calls == []  # </tool_call> has not come yet
  assert q.finish() == ChatDelta()   # the output ended: the call stays as far as it came
  assert q.tool_calls[0]["function"]["arguments"] == '{"a": [1, 2]}'


def test_partial_marker_is_held_back_then_released_as_text():
  p = make_parser("kimi_k2", tools_enabled=True)
  assert p.feed("a <|tool_calls").content == "a "
  assert p.feed(" not a marker").content == "<|tool_calls not a marker"
  p = make_parser("qwen3", tools_enabled=True)
  assert p.feed("x<tool_ca").content == "x"
  assert p.finish().content == "<tool_ca"
  # A thought opens only at the output's start: held back there, answer text afterwards.
  p = make_parser("qwen3", tools_enabled=True)
  assert p.feed("<thi").content == ""
  assert p.finish().content == "<thi"
  p = make_parser("qwen3", tools_enabled=True)
  assert p.feed("x<think>y</think>").content == "x<think>y</think>"


def test_tools_disabled_leave_tool_markup_in_the_content():
  content, thought, got, _ = run("kimi_k2", [KIMI_TWO], tools=False)
  assert content == KIMI_TWO and got == [] and thought == ""
  content, thought, got, _ = run("kimi_k2", ["r" + K_SEC + "x"], reasoning=True, tools=False)
  assert (content, thought, got) == (K_SEC + "x", "r", [])


def test_generated_ids_and_kimi_ids():
  p = make_parser("qwen3", tools_enabled=True)
  p.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
  p.finish()
  got = [c["id"] for c in p.tool_calls]
  assert all(i.startswith("call_") and len(i) > 10 for i in got) and len(set(got)) == 2


def test_families_and_defaults():
  assert set(PARSER_FAMILIES) >= {"kimi_k2", "deepseek_v3", "qwen3", "none"}
  assert family_for("kimi_k25") == family_for("kimi_k2") == "kimi_k2"
  assert family_for("deepseek_v3") == "deepseek_v3"
  assert family_for("qwen3_moe") == family_for("qwen3") == "qwen3"
  assert family_for("llama") == "llama3_json" and family_for("mystery") == "none"
  with pytest.raises(ValueError, match="tool_parser"):
    make_parser("nope", starts_in_reasoning=False, tools_enabled=True)
  assert starts_in_reasoning("<|im_assistant|>assistant<|im_middle|><think>")
  assert not starts_in_reasoning("<|im_assistant|>assistant<|im_middle|><think></think>")
  assert not starts_in_reasoning("<|im_start|>assistant\n")


# ---- generated outputs: random conversations written in each family's format ----------------

NAMES = ["get_weather", "web-search.v2", "a.b.c", "x", "fn-1"]
ARGS = ['{}', '{"q": "a < b"}', '{"s": "}"}', '{"code": "```py\\nx\\n```"}', '{"n": [1, {"k": {}}]}',
        '{"t": "line\\nbreak", "u": "é"}']
TEXTS = ["", "Sure.", "Let me think: 2 < 3 and 4 > 1.", "a\nb", "Use `<tag>` here."]


def _write(family, rng):
  """A model output in `family`'s format and what parsing it must give."""
  thought, content = rng.choice(TEXTS), rng.choice(TEXTS)
  picked = [(rng.choice(NAMES), rng.choice(ARGS)) for _ in range(rng.randint(0, 3))]
  if family == "kimi_k2":   # K2.5: the prompt ends in <think>
    text = f"{thought}</think>{content}"
    if picked and rng.random() < 0.3:   # the thought runs into the tool section
      text, content = thought, ""
    if picked:
      text += K_SEC + "".join(f"{K_CALL}functions.{n}:{i}{K_ARG}{a}{K_END}"
                              for i, (n, a) in enumerate(picked)) + K_SEC_END
    ids_ = [f"functions.{n}:{i}" for i, (n, _) in enumerate(picked)]
    return text, True, content, thought, calls(*picked, ids_=ids_)
  if family == "deepseek_v3":
    text = f"<think>{thought}</think>{content}" if thought else content
    if picked:
      v31 = rng.random() < 0.5
      text += D_SEC + "\n".join(
          f"{D_CALL}{n}{D_SEP}{a}{D_END}" if v31 else
          f"{D_CALL}function{D_SEP}{n}\n```json\n{a}\n```{D_END}" for n, a in picked) + D_SEC_END
    return text, False, content, thought, calls(*picked)
  if family == "llama3_json":   # as Llama 3's template writes them: the reply is the calls
    if not picked:
      return content, False, content, "", []
    sep = rng.choice(["; ", ";", "\n", ";\n"])
    text = rng.choice(["", "<|python_tag|>"]) + sep.join(
        f'{{"name": "{n}", "parameters": {a}}}' for n, a in picked)
    return text, False, "", "", calls(*picked)
  text = f"<think>{thought}</think>{content}" if thought else content
  for i, (n, a) in enumerate(picked):   # as Qwen3's template writes them
    sep = "\n" if (i or content) else ""
    text += f'{sep}<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>'
  return text, False, content, thought, calls(*picked)


@pytest.mark.parametrize("family", ["kimi_k2", "deepseek_v3", "qwen3", "llama3_json"])
def test_generated_outputs_parse_back(family):
  rng = random.Random(family)
  for _ in range(40):
    text, in_thought, content, thought, want = _write(family, rng)
    for chunks in itertools.islice(chunkings(text), 0, None, 7):   # whole, by char, a sample of cuts
      got = run(family, chunks, reasoning=in_thought)
      assert got[:3] == (content, thought, want), (text, chunks)
