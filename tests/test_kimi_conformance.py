"""Kimi K2 / K2.5 outputs that broke other servers' parsers, replayed through ours.

The outputs come from the bugs vLLM PR #38579 fixed (#37184 markers leaking into content,
#38441 ids with newlines dropping calls, #38353 content before the section lost, #38274 a
speculative step bundling `<|tool_call_end|><|tool_call_begin|>` and truncating arguments),
SGLang #23363 (multi-turn calls with long multi-line arguments dropped) and #20878 (names with
'-' rejected, calls missed), plus K2.5's thought running straight into the tool section and
sections closed and reopened in one delta. Each is written as the tokens a Kimi tokenizer would
produce (markers are single tokens) and fed whole, token by token, at every two-way cut of its
tokens, and in speculative bundles of 2..6 tokens; every feeding must give the same reasoning,
content and calls, and no marker text anywhere. Then the truncation rule: the token limit
cutting an output anywhere inside a call leaves no half call and no markup; and tool_choice
"none" (tools off) gives no calls, also from inside a thought.
"""

import json

import pytest

from engine.chat.markup import KIMI_K2
from engine.chat.parsers import make_parser
from engine.chat.reasoning import ThinkIds
from engine.chat.stream import ChatStream
from engine.runtime.request import FINISH_LENGTH, FINISH_STOP, RequestOutput, Timings, Usage

SEC, SEC_END = KIMI_K2.tools_begin, KIMI_K2.tools_end
CALL, ARG, END = KIMI_K2.call_begin, KIMI_K2.call_sep, KIMI_K2.call_end
THINK_END = "</think>"
MARKERS = (*KIMI_K2.markers, "<think>", THINK_END)
IDS = {THINK_END: 2, SEC: 3, SEC_END: 4, CALL: 5, ARG: 6, END: 7,
       "<|tool_call_section_begin|>": 8, "<|tool_call_section_end|>": 9}


def calls(*triples):
  return [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
          for i, n, a in triples]


MULTILINE = json.dumps({"path": "src/app.py", "content": "def main():\n    print('hi')\n" * 3})

# (name, starts_in_reasoning, tokens, reasoning, content, calls)
CASES = [
    ("#37184 no marker leaks into content", False,
     ["Sure", ".", SEC, CALL, "functions", ".get", "_weather", ":0", ARG, '{"city"', ': "Oslo"}',
      END, SEC_END], "", "Sure.",
     calls(("functions.get_weather:0", "get_weather", '{"city": "Oslo"}'))),
    ("#38441 ids with newlines", False,
     [SEC, CALL, "\n", "functions", ".bash", ":0", "\n", ARG, '{"cmd": "ls"}', END, SEC_END],
     "", "", calls(("functions.bash:0", "bash", '{"cmd": "ls"}'))),
    ("#38353 content before the section in one delta", False,
     ["I will check both files now." + SEC + CALL + "functions.read:0" + ARG + '{"p": "a"}'
      + END + SEC_END], "", "I will check both files now.",
     calls(("functions.read:0", "read", '{"p": "a"}'))),
    ("#38274 call end and the next call begin bundled", False,
     [SEC, CALL, "functions.a:0", ARG, '{"x": 1}' + END + CALL + "functions.b:1" + ARG,
      '{"y": [1, 2]}', END + SEC_END], "", "",
     calls(("functions.a:0", "a", '{"x": 1}'), ("functions.b:1", "b", '{"y": [1, 2]}'))),
    ("#20878 names with '.', '-' and ':'", False,
     [SEC, CALL, "functions.mcp", ":fs", "-server", ".read", "_file:3", ARG, "{}", END, CALL,
      "functions.web-search.v2:4", ARG, '{"q": "a:b"}', END, SEC_END], "", "",
     calls(("functions.mcp:fs-server.read_file:3", "mcp:fs-server.read_file", "{}"),
           ("functions.web-search.v2:4", "web-search.v2", '{"q": "a:b"}'))),
    ("#23363 long multi-line arguments after a turn", True,
     ["Writing", " the file", THINK_END, "Done soon.", SEC, CALL, "functions.write:7", ARG,
      *[MULTILINE[i:i + 9] for i in range(0, len(MULTILINE), 9)], END, SEC_END],
     "Writing the file", "Done soon.", calls(("functions.write:7", "write", MULTILINE))),
    ("K2.5: the thought runs into the section", True,
     ["Need", " data", SEC, CALL, "functions.f:0", ARG, "{}", END, SEC_END], "Need data", "",
     calls(("functions.f:0", "f", "{}"))),
    ("a section closed and another opened in one delta", False,
     [SEC, CALL, "functions.a:0", ARG, "{}", END, SEC_END + SEC, CALL, "functions.b:1", ARG,
      "{}", END, SEC_END], "", "",
     calls(("functions.a:0", "a", "{}"), ("functions.b:1", "b", "{}"))),
    ("Kimi's singular section spellings", True,
     ["plan", "<|tool_call_section_begin|>", CALL, "functions.g:0", ARG, "[]", END,
      "<|tool_call_section_end|>", "\n"], "plan", "", calls(("functions.g:0", "g", "[]"))),
]


def feedings(tokens):
  """Whole; token by token; every two-way cut of the tokens; bundles of 2..6 tokens."""
  yield ["".join(tokens)]
  yield list(tokens)
  for i in range(1, len(tokens)):
    yield ["".join(tokens[:i]), "".join(tokens[i:])]
  for k in range(2, 7):
    yield ["".join(tokens[i:i + k]) for i in range(0, len(tokens), k)]


def parse(chunks, in_thought, tools=True, truncated=False):
  p = make_parser("kimi_k2", starts_in_reasoning=in_thought, tools_enabled=tools)
  deltas = [p.feed(c) for c in chunks] + [p.finish(truncated=truncated)]
  streamed = {}
  for d in deltas:
    for t in d.tool_calls:
      entry = streamed.setdefault(t.index, ["", "", ""])
      entry[0] += t.id or ""
      entry[1] += t.name or ""
      entry[2] += t.arguments
  return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
          p.tool_calls, streamed)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_outputs_that_broke_other_parsers(case):
  _, in_thought, tokens, reasoning, content, want = case
  for chunks in feedings(tokens):
    got_r, got_c, got_calls, streamed = parse(chunks, in_thought)
    where = f"chunks={chunks!r}"
    assert (got_r, got_c) == (reasoning, content), where
    assert got_calls == want, where
    # Streamed: the deltas add up to the same calls (id and name once, arguments in pieces).
    assert [[c["id"], c["function"]["name"], c["function"]["arguments"]] for c in want] == \
        [streamed[i] for i in sorted(streamed)], where
    for m in MARKERS:
      assert m not in got_c and m not in got_r, (m, where)


def outputs(tokens, finish):
  """Engine deltas of one token each, ids as a Kimi tokenizer's (text tokens numbered)."""
  out = []
  for i, t in enumerate(tokens):
    last = i == len(tokens) - 1
    out.append(RequestOutput("r", [IDS.get(t, 100 + i)], t, last, finish if last else None,
                             None, Usage(10, 0, i + 1), Timings(0.0)))
  return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_token_limit_never_leaves_half_a_call(case):
  """Cut after every token: a call is among tool_calls only if its end marker came, the
  content never holds markup or header text, and the reasoning counted by id matches."""
  _, in_thought, tokens, reasoning, content, want = case
  ids = ThinkIds(None, IDS[THINK_END], (IDS[SEC], IDS["<|tool_call_section_begin|>"]))
  for n in range(1, len(tokens) + 1):
    stream = ChatStream("kimi_k2", starts_in_reasoning=in_thought, tools_enabled=True,
                        think_ids=ids)
    for out in outputs(tokens[:n], FINISH_LENGTH):
      stream.feed(out)
    got = stream.tool_calls
    closed = "".join(tokens[:n]).count(END)
    assert got == want[:closed], (n, got)
    text = "".join(stream.content)
    assert not any(m in text for m in MARKERS) and "functions." not in text, (n, text)
    assert stream.finish_reason(outputs(tokens[:n], FINISH_LENGTH)[-1]) == "length"
    ends = [i for i, t in enumerate(tokens[:n]) if t in (THINK_END, SEC,
                                                          "<|tool_call_section_begin|>")]
    thought_tokens = (ends[0] if ends else n) if in_thought else 0
    assert stream.reasoning_tokens == thought_tokens, n
  # Whole and stopped by itself: "tool_calls" when it called.
  stream = ChatStream("kimi_k2", starts_in_reasoning=in_thought, tools_enabled=True)
  outs = outputs(tokens, FINISH_STOP)
  for out in outs:
    stream.feed(out)
  assert stream.tool_calls == want
  assert stream.finish_reason(outs[-1]) == ("tool_calls" if want else "stop")


def test_tool_choice_none_gives_no_calls_also_while_thinking():
  tokens = ["thinking", SEC, CALL, "functions.f:0", ARG, "{}", END, SEC_END]
  for chunks in feedings(tokens):
    reasoning, content, got, streamed = parse(chunks, True, tools=False)
    assert got == [] and not streamed and reasoning == "thinking"
    assert content == "".join(tokens[1:])   # the markup the model wrote anyway, as text
