"""Structured outputs at the API edge: `response_format` / vLLM's `structured_outputs` over
HTTP (the official `openai` client) and `StructuredOutputs` over gRPC, `tool_choice` required /
named as tool-call grammars, and every bad constraint refused naming its field.

The tool-call grammars (`tool_constraints.py`) are checked first without a model, by llguidance
matchers over the demo tokenizer, plain (markers are text) and with the families' markers added
as special tokens (as Kimi's and DeepSeek's tokenizers have them): a hand-written call is
accepted and wrong ones rejected, and random walks over the grammar's masks always parse, with
the family's parser, into calls whose arguments validate against the tool's schema. Then live,
on the demo model, which never writes tool-call markup by itself: with tool_choice required its
output is tool calls that validate, so the constraint is what makes them.
"""

import random
import re
import typing

import jsonschema
import openai
import pydantic
from tokenizers import AddedToken, Tokenizer

from engine.chat.template import ChatTemplate
from engine.runtime import grammar
from engine.chat import parsers
from engine.chat.markup import DEEPSEEK_V3, KIMI_K2, QWEN3
from engine.service import chat, structured, tool_constraints, validation
from engine.service.proto import inference_pb2 as pb
from service_harness import *  # noqa: F401,F403  (fixtures, helpers, shared imports)

KEY = "structured-key"
TOKENIZER = os.path.join(DEMO, "tokenizer.json")
MARKERS = (*KIMI_K2.markers, *DEEPSEEK_V3.markers, *QWEN3.markers, "<think>", "</think>")
# Bounded values, so a constrained small model (or a random walk) always finishes.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
READ = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 8}},
        "required": ["path"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "read.file-v2", "parameters": READ}}]
SCHEMAS = {"get_weather": WEATHER, "read.file-v2": READ}
ANSWER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "size": {"type": "integer", "minimum": 0,
                                                         "maximum": 99},
    "kind": {"enum": ["file", "dir"]}}, "required": ["name", "size", "kind"]}
TEMPLATE = CHATML_TOOLS_TEMPLATE  # (service_harness: the server parses with the qwen3 family)
USER = [{"role": "user", "content": "def read_config(path):"}]


# ---- tool-call grammars, no model ------------------------------------------------------------

def demo_tokenizer(special: bool) -> Tokenizer:
  tok = Tokenizer.from_file(TOKENIZER)
  if special:
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
  return tok


PLAIN, SPECIAL = demo_tokenizer(False), demo_tokenizer(True)


def matcher(lark, tok):
  spec = grammar.StructuredOutputsParams(grammar=lark)
  return grammar.compile_grammar(spec, tok, vocab_size=tok.get_vocab_size(),
                                 eos_token_ids=(2,)).matcher()


def accepts(lark, tok, text):
  m = matcher(lark, tok)
  ids = tok.encode(text, add_special_tokens=False).ids
  return m.allowed_prefix(ids) == len(ids) and (m.accept_tokens(ids), m.is_accepting())[1]


def parsed_calls(family, text, thinking=False):
  parser = parsers.make_parser(family, tools_enabled=True, starts_in_reasoning=thinking)
  delta = parser.feed(text)
  end = parser.finish()
  return parser.tool_calls, delta.content + end.content


def call_text(family, name, args, index=0, fenced=False):
  a = json.dumps(args)
  if family == "kimi_k2":
    return (f"{KIMI_K2.call_begin}functions.{name}:{index}{KIMI_K2.call_sep}{a}"
            f"{KIMI_K2.call_end}")
  if family == "deepseek_v3":
    p = DEEPSEEK_V3
    if fenced:
      return f"{p.call_begin}function{p.call_sep}{name}\n```json\n{a}\n```{p.call_end}"
    return f"{p.call_begin}{name}{p.call_sep}{a}{p.call_end}"
  if family == "qwen3":
    return f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>'
  return f'{{"name": "{name}", "parameters": {a}}}'


def calls_text(family, calls, fenced=False):
  parts = [call_text(family, n, a, i, fenced) for i, (n, a) in enumerate(calls)]
  if family == "kimi_k2":
    return KIMI_K2.tools_begin + "".join(parts) + KIMI_K2.tools_end
  if family == "deepseek_v3":
    sep = "\n" if fenced else ""
    return DEEPSEEK_V3.tools_begin + sep.join(parts) + DEEPSEEK_V3.tools_end
  return ("\n" if family == "qwen3" else "; ").join(parts)


CASES = [(f, tok, fenced) for f in tool_constraints.FAMILIES for tok in ("plain", "special")
         for fenced in ((False, True) if f == "deepseek_v3" else (False,))]


@pytest.mark.parametrize("family,tok_kind,fenced", CASES)
def test_tool_grammar_accepts_the_family_syntax_only(family, tok_kind, fenced):
  tok = SPECIAL if tok_kind == "special" else PLAIN
  lark = tool_constraints.tool_call_grammar(family, TOOLS, tokenizer=tok, fenced=fenced)
  weather = ("get_weather", {"city": "Paris", "unit": "c", "days": 3})
  good = calls_text(family, [weather, ("read.file-v2", {"path": "/a"})], fenced)
  assert accepts(lark, tok, good)
  calls, content = parsed_calls(family, good)
  assert [c["function"]["name"] for c in calls] == ["get_weather", "read.file-v2"]
  assert not content.strip()
  for call in calls:
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        SCHEMAS[call["function"]["name"]])
  bad = [calls_text(family, [("get_weather", {"city": "Paris", "unit": "k", "days": 3})], fenced),
         calls_text(family, [("get_weather", {"city": "Paris", "unit": "c"})], fenced),
         calls_text(family, [("get_weather", {**weather[1], "extra": 1})], fenced),
         calls_text(family, [("get_time", {})], fenced),
         "Sure. " + calls_text(family, [weather], fenced),   # no content before the calls
         calls_text(family, [weather], fenced)[:-3],
         ""]
  for text in bad:
    assert not accepts(lark, tok, text), text
  # A named function: exactly one call, of it.
  named = tool_constraints.tool_call_grammar(family, TOOLS[:1], parallel=False, tokenizer=tok,
                                             fenced=fenced)
  assert accepts(named, tok, calls_text(family, [weather], fenced))
  assert not accepts(named, tok, calls_text(family, [weather, weather], fenced))
  assert not accepts(named, tok, calls_text(family, [("read.file-v2", {"path": "/a"})], fenced))


def test_tool_grammar_after_reasoning():
  """A prompt that opened <think>: free reasoning, the think end, then the calls."""
  weather = ("get_weather", {"city": "Oslo", "unit": "f", "days": 1})
  for family in ("kimi_k2", "qwen3", "deepseek_v3"):
    for tok in (PLAIN, SPECIAL):
      lark = tool_constraints.tool_call_grammar(family, TOOLS, starts_in_reasoning=True,
                                                tokenizer=tok)
      sep = "\n" if family == "qwen3" else ""
      # (in the plain tokenizer marker text is just text, and reasoning may hold it)
      think = "Let me see: <tool_call> is text here." if tok is PLAIN else "Let me see."
      text = think + "</think>" + sep + calls_text(family, [weather])
      assert accepts(lark, tok, text), (family, tok is SPECIAL)
      calls, content = parsed_calls(family, text, thinking=True)
      assert [c["function"]["name"] for c in calls] == ["get_weather"] and not content.strip()
      # Without the think end the calls would be parsed as reasoning: refused, except for Kimi
      # with control-token markers, whose parser ends reasoning at the tool section too.
      direct = calls_text(family, [weather])
      kimi_tokens = family == "kimi_k2" and tok is SPECIAL
      assert accepts(lark, tok, direct) == kimi_tokens
      if kimi_tokens:
        assert len(parsed_calls(family, direct, thinking=True)[0]) == 1


def test_kimi_tool_grammar_on_a_tiktoken_tokenizer():
  """Kimi K2.5's case: a tiktoken tokenizer whose markers and </think> are special ids, a prompt
  ending in <think>. The control tokens are required; their spelling as text is not them."""
  from engine.model.tiktoken_tokenizer import KIMI_PAT_STR, NUM_SPECIAL_IDS, TiktokenTokenizer
  ranks = {bytes([i]): i for i in range(256)}
  n = len(ranks)
  names = ["[EOS]", "<|im_end|>", "</think>", KIMI_K2.tools_begin, KIMI_K2.tools_end,
           KIMI_K2.call_begin, KIMI_K2.call_sep, KIMI_K2.call_end]
  specials = {f"<|reserved_token_{i}|>": i for i in range(n + len(names), n + NUM_SPECIAL_IDS)}
  specials.update({name: n + i for i, name in enumerate(names)})
  tt = TiktokenTokenizer(ranks, specials, set(specials.values()), "[EOS]", pat_str=KIMI_PAT_STR)
  lark = tool_constraints.tool_call_grammar("kimi_k2", TOOLS, starts_in_reasoning=True,
                                            tokenizer=tt)
  assert f"<[{n + 3}]>" in lark and KIMI_K2.call_begin not in lark
  m = grammar.compile_grammar(grammar.StructuredOutputsParams(grammar=lark), tt,
                              vocab_size=n + NUM_SPECIAL_IDS).matcher()
  text = "The weather, then.</think>" + calls_text(
      "kimi_k2", [("get_weather", {"city": "Rome", "unit": "c", "days": 2})])
  ids = tt.encode(text, allow_special_tokens=True).ids
  assert m.copy().accept_tokens(ids) == len(ids)
  calls, content = parsed_calls("kimi_k2", tt.decode(ids, skip_special_tokens=False), True)
  assert [c["id"] for c in calls] == ["functions.get_weather:0"] and not content
  done = m.copy()
  done.accept_tokens(ids)
  assert done.is_terminated()  # then only EOS
  typed = m.copy()  # the markers typed as text are not the control tokens: still reasoning
  typed.accept_tokens(tt.encode(text).ids)
  assert not typed.is_accepting()


def test_chat_prepare_builds_the_constraint_after_the_prompts_think_block():
  """`chat.prepare` with the Qwen3-style template's `thinking` prompt (ends in <think>): the
  answer's schema, and tool_choice's calls, come after free reasoning."""
  limits = validation.RequestLimits(vocab_size=PLAIN.get_vocab_size(), max_model_len=4096,
                                    num_eos_ids=1, eos_token_ids=(2,))
  template = ChatTemplate(TEMPLATE)
  kw = dict(messages=USER, template_kwargs={"thinking": True})
  answer = '{"name": "a", "size": 3, "kind": "dir"}'
  c = structured.from_response_format(response_format())

  def prepare(**fields):
    return chat.prepare(template, PLAIN, limits, chat.ChatRequest(**fields), family=None)
  inputs = prepare(tools=None, tool_choice=None, response=c, **kw)
  assert inputs.starts_in_reasoning and inputs.family == "qwen3"
  assert accepts(inputs.constraint.grammar, PLAIN, "Hm.</think>\n" + answer)
  assert not accepts(inputs.constraint.grammar, PLAIN, answer)
  plain = prepare(tools=None, tool_choice=None, response=c, **{**kw, "template_kwargs": None})
  assert plain.constraint == c.spec  # no think block: the schema itself
  calls = prepare(tools=TOOLS, tool_choice="required", **kw)
  weather = calls_text("qwen3", [("get_weather", {"city": "Rome", "unit": "c", "days": 2})])
  assert accepts(calls.constraint.grammar, PLAIN, "Hm.</think>\n" + weather)
  assert not accepts(calls.constraint.grammar, PLAIN, weather)


def test_tool_choice_needs_a_tool_call_format():
  limits = validation.RequestLimits(vocab_size=PLAIN.get_vocab_size(), max_model_len=64,
                                    num_eos_ids=1, eos_token_ids=(2,))
  kw = dict(parallel=True, starts_in_reasoning=False, fenced=False, tokenizer=PLAIN,
            limits=limits)
  with pytest.raises(validation.FieldError) as e:
    tool_constraints.constraint_for("required", None, TOOLS, family="none", **kw)
  assert e.value.field == "tool_choice"
  spaced = [TOOLS[0], {"type": "function", "function": {"name": "read file"}}]
  with pytest.raises(validation.FieldError) as e:
    tool_constraints.constraint_for("required", None, spaced, family="kimi_k2", **kw)
  assert e.value.field == "tools[1].function.name"
  spec = tool_constraints.constraint_for("named", "read file", spaced, family="qwen3", **kw)
  assert accepts(spec.grammar, PLAIN, calls_text("qwen3", [("read file", {})]))


def random_walk(m, rng, prefer, eos, max_steps=600):
  """Token ids from random choices among the allowed ones (markers preferred when allowed, so
  free text ends); None if the walk did not finish."""
  out = []
  for _ in range(max_steps):
    allowed = [int(t) for t in m.allowed_tokens()]
    marker = [t for t in allowed if t in prefer]
    if marker and rng.random() < 0.5:
      t = rng.choice(marker)
    else:
      t = rng.choice(allowed)
    if t in eos:
      return out
    assert m.accept(t)
    out.append(t)
    if m.is_terminated():
      return out
  return None


@pytest.mark.parametrize("family,thinking", [("kimi_k2", True), ("deepseek_v3", False),
                                             ("qwen3", True), ("llama3_json", False)])
def test_random_outputs_of_tool_grammars_parse_into_the_schema(family, thinking):
  tok = SPECIAL
  lark = tool_constraints.tool_call_grammar(family, TOOLS, starts_in_reasoning=thinking,
                                            tokenizer=tok)
  prefer = {tok.token_to_id(m) for m in MARKERS}
  rng, finished = random.Random(0), 0
  for _ in range(12):
    ids = random_walk(matcher(lark, tok), rng, prefer, eos={2})
    if ids is None:
      continue
    finished += 1
    calls, content = parsed_calls(family, tok.decode(ids, skip_special_tokens=False), thinking)
    assert calls and not content.strip()
    for call in calls:
      jsonschema.validate(json.loads(call["function"]["arguments"]),
                          SCHEMAS[call["function"]["name"]])
  assert finished >= 8


def test_response_constraint_after_reasoning_and_strict():
  spec = grammar.StructuredOutputsParams(json=json.dumps(ANSWER))
  for tok in (PLAIN, SPECIAL):
    wrapped = tool_constraints.response_after_reasoning(spec, "qwen3", tok)
    answer = '{"name": "a", "size": 3, "kind": "dir"}'
    assert accepts(wrapped.grammar, tok, "thinking...</think>\n" + answer)
    assert not accepts(wrapped.grammar, tok, answer)
  choice = tool_constraints.response_after_reasoning(
      grammar.StructuredOutputsParams(choice=("yes", "no")), "kimi_k2", SPECIAL)
  assert accepts(choice.grammar, SPECIAL, "hm</think>no")
  assert not accepts(choice.grammar, SPECIAL, "hm</think>maybe")
  regex = tool_constraints.response_after_reasoning(
      grammar.StructuredOutputsParams(regex=r"[0-9]{2}/[0-9]{2}"), "qwen3", PLAIN)
  assert accepts(regex.grammar, PLAIN, "x</think>12/31")
  # strict: only the declared keys, at every depth; without it JSON Schema's default holds.
  nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {
      "b": {"type": "integer"}}}}, "required": ["a"]}
  extra = '{"a": {"b": 1, "c": 2}}'
  for strict, want in ((False, True), (True, False)):
    spec = grammar.StructuredOutputsParams(json=structured.schema_text(nested, "s", strict))
    assert accepts(_lark_of(spec), PLAIN, extra) == want
  # vLLM's disable_additional_properties is the same rule.
  c = structured.from_structured_outputs({"json": nested, "disable_additional_properties": True})
  assert not accepts(_lark_of(c.spec), PLAIN, extra) and c.field == "structured_outputs.json"


def _lark_of(spec):
  """A JSON-schema spec as a Lark grammar (so `accepts` can take it)."""
  return "start: answer\nanswer: %json " + json.dumps(
      tool_constraints._with_json_options(json.loads(spec.json)))


# ---- live: HTTP and gRPC on the demo model -----------------------------------------------------

@pytest.fixture(scope="module")
def eng(demo):
  """Room for tool declarations; no warm-up: only the shapes these requests meet compile."""
  return Engine.from_model(demo, dataclasses.replace(ENGINE_CONFIG, max_model_len=512))


@pytest.fixture
def server(serve, eng, monkeypatch):
  monkeypatch.setattr(eng, "chat_template", ChatTemplate(TEMPLATE))
  bg = serve(http_port=0, model_name="demo", api_keys=frozenset({KEY}))
  assert bg.server.chat_family == "qwen3"
  return bg


def client_for(bg):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{bg.server.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=120)


class Entry(pydantic.BaseModel):
  name: str = pydantic.Field(max_length=12)
  kind: typing.Literal["file", "dir"]


def response_format(schema=ANSWER, strict=True):
  return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                 "strict": strict}}


@pytest.mark.slow
def test_response_format_and_structured_outputs_over_http(server):
  client = client_for(server)
  for sampling in (dict(temperature=0), dict(temperature=1.0, seed=7)):
    got = client.chat.completions.create(model="demo", messages=USER, max_tokens=64,
                                         response_format=response_format(), **sampling)
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), structured.strict_schema(ANSWER))
  # The client's own structured outputs: a pydantic model as a strict schema, parsed back.
  got = client.chat.completions.parse(model="demo", messages=USER, max_tokens=64,
                                      temperature=0, response_format=Entry)
  assert isinstance(got.choices[0].message.parsed, Entry)
  # Completions: response_format, and vLLM's structured_outputs (choice, regex, json).
  got = client.completions.create(model="demo", prompt="def f(x):", max_tokens=64, temperature=0,
                                  extra_body={"response_format": response_format()})
  jsonschema.validate(json.loads(got.choices[0].text), ANSWER)
  got = client.completions.create(model="demo", prompt="import", max_tokens=8, n=2, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["os", "sys"]}})
  assert {c.text for c in got.choices} <= {"os", "sys"}
  got = client.completions.create(model="demo", prompt="x = ", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{1,3}\\.5"}})
  assert re.fullmatch(r"[0-9]{1,3}\.5", got.choices[0].text), got.choices[0].text
  got = client.chat.completions.create(
      model="demo", messages=USER, max_tokens=64, temperature=0,
      extra_body={"structured_outputs": {"json": json.dumps(structured.strict_schema(READ))}})
  jsonschema.validate(json.loads(got.choices[0].message.content), READ)
  # Streaming: the deltas join to the same constrained answer.
  chunks = list(client.chat.completions.create(
      model="demo", messages=USER, max_tokens=64, temperature=0, stream=True,
      response_format=response_format()))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  jsonschema.validate(json.loads(text), ANSWER)


@pytest.mark.slow
def test_tool_choice_required_and_named_over_http(server):
  client = client_for(server)
  for sampling in (dict(temperature=0), dict(temperature=1.0, seed=11)):
    got = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=240, **sampling)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    assert not choice.message.content
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
  # Parallel calls allowed: the demo model, never trained to stop after a call, goes on calling
  # until max_tokens cuts the last call off; every call before it is whole and valid.
  got = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS,
                                       tool_choice="required", max_tokens=240, temperature=0)
  calls = got.choices[0].message.tool_calls
  whole = calls if got.choices[0].finish_reason == "tool_calls" else calls[:-1]
  assert len(whole) >= 1
  for call in whole:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
  named = {"type": "function", "function": {"name": "read.file-v2"}}
  got = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS, seed=5,
                                       tool_choice=named, max_tokens=64)
  calls = got.choices[0].message.tool_calls
  assert [c.function.name for c in calls] == ["read.file-v2"]
  jsonschema.validate(json.loads(calls[0].function.arguments), READ)
  assert got.choices[0].finish_reason == "tool_calls"
  # Streamed: the calls' fragments assemble into the same kind of call.
  chunks = list(client.chat.completions.create(
      model="demo", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=240,
      temperature=0, stream=True, parallel_tool_calls=False))
  frags = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
  assert {f.index for f in frags} == {0}
  name = "".join(f.function.name or "" for f in frags)
  jsonschema.validate(json.loads("".join(f.function.arguments or "" for f in frags)),
                      SCHEMAS[name])
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def grpc_tools():
  return [pb.Tool(function=pb.FunctionDefinition(
      name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"])))
      for t in TOOLS]


def chat_request(**kwargs):
  req = pb.ChatRequest(**kwargs)
  req.messages.add(role="user", content=USER[0]["content"])
  return req


def test_structured_outputs_and_tool_choice_over_grpc(server):
  so = pb.StructuredOutputs(json_schema=json.dumps(ANSWER), strict=True)
  with InferenceClient(target(server), api_key=KEY) as client:
    for sampling in (dict(), dict(temperature=1.0, seed=2)):
      done = client.generate(PROMPT, max_tokens=64, structured_outputs=so, **sampling)
      assert done.finish_reason == "stop"
      jsonschema.validate(json.loads(done.text), structured.strict_schema(ANSWER))
    done = client.generate(PROMPT, max_tokens=8, structured_outputs=pb.StructuredOutputs(
        choice=pb.Choices(values=["yes", "no"])))
    assert done.text in ("yes", "no")
    last = list(client.stub.Chat(chat_request(structured_outputs=so,
                                              sampling=pb.SamplingParams(max_tokens=64)),
                                 metadata=client.metadata))
    jsonschema.validate(json.loads("".join(r.content for r in last)), ANSWER)
    for choice, names in ((pb.ToolChoice(mode="required"), set(SCHEMAS)),
                          (pb.ToolChoice(function_name="get_weather"), {"get_weather"})):
      responses = list(client.stub.Chat(chat_request(
          tools=grpc_tools(), tool_choice=choice, parallel_tool_calls=False,
          sampling=pb.SamplingParams(max_tokens=240)), metadata=client.metadata))
      final = responses[-1]
      assert final.final.finish_reason == pb.FINISH_REASON_TOOL_CALLS
      assert len(final.complete_tool_calls) == 1 and not "".join(r.content for r in responses)
      for call in final.complete_tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_client_command_line_constrains(server):
  done = subprocess.run(
      [sys.executable, "-m", "engine.client", f"--target={target(server)}", f"--api_key={KEY}",
       "--json", "--prompt=import ", "--max_tokens=4", "--choice=os", "--choice=sys"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout.strip().splitlines()[-1])["text"] in ("os", "sys")


BAD_HTTP = [
    ("chat", dict(response_format={"type": "xml"}), "response_format.type"),
    ("chat", dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"schema": ANSWER}}),
     "response_format.json_schema.name"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                          "schema": [1]}}),
     "response_format.json_schema.schema"),
    ("chat", dict(response_format=response_format({"type": "object", "properties": {
        "d": {"type": "string", "format": "no-such-format"}}})),
     "response_format.json_schema.schema"),
    ("chat", dict(response_format=response_format({"type": "strin"})),
     "response_format.json_schema.schema"),
    ("completions", dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}),
     "structured_outputs.regex"),
    ("completions", dict(extra_body={"structured_outputs": {"choice": []}}),
     "structured_outputs.choice"),
    ("completions", dict(extra_body={"structured_outputs": {"json": "{not json"}}),
     "structured_outputs.json"),
    ("completions", dict(extra_body={"structured_outputs": {"grammar": "start: undefined_rule"}}),
     "structured_outputs.grammar"),
    ("completions", dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
     "structured_outputs"),
    ("completions", dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
    ("completions", dict(extra_body={"structured_outputs": {"regex": "a", "backend": "outlines"}}),
     "structured_outputs.backend"),
    ("completions", dict(extra_body={"structured_outputs": {"structural_tag": "{}"}}),
     "structured_outputs.structural_tag"),
    ("chat", dict(response_format={"type": "json_object"},
                  extra_body={"structured_outputs": {"regex": "a"}}), "structured_outputs"),
    ("chat", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    ("chat", dict(tool_choice="required"), "tool_choice"),
    ("chat", dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    ("chat", dict(tools=[TOOLS[0], {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}}}],
                  tool_choice="required"),
     "tools[1].function.parameters"),
]


def test_bad_constraints_are_400_and_invalid_argument(server):
  client = client_for(server)
  for api, kwargs, field in BAD_HTTP:
    try:
      if api == "chat":
        client.chat.completions.create(model="demo", messages=USER, max_tokens=4, **kwargs)
      else:
        client.completions.create(model="demo", prompt="x", max_tokens=4, **kwargs)
    except openai.BadRequestError as e:
      assert e.status_code == 400 and e.param == field, (kwargs, e.message)
    else:
      pytest.fail(f"accepted: {kwargs}")
  # A tool whose schema is bad does not matter unless the call is constrained.
  got = client.chat.completions.create(model="demo", messages=USER, max_tokens=2,
                                       tools=BAD_HTTP[-1][1]["tools"])
  assert got.choices[0].finish_reason in ("stop", "length")
  bad_grpc = [
      (pb.GenerateRequest(text=PROMPT, structured_outputs=pb.StructuredOutputs(
          json_schema="{")), "structured_outputs.json_schema"),
      (pb.GenerateRequest(text=PROMPT, structured_outputs=pb.StructuredOutputs(
          json_schema='{"type": "strin"}')), "structured_outputs.json_schema"),
      (pb.GenerateRequest(text=PROMPT, structured_outputs=pb.StructuredOutputs(regex="[a-")),
       "structured_outputs.regex"),
      (pb.GenerateRequest(text=PROMPT, structured_outputs=pb.StructuredOutputs(
          choice=pb.Choices())), "structured_outputs.choice.values"),
      (pb.GenerateRequest(text=PROMPT, structured_outputs=pb.StructuredOutputs(
          regex="a", strict=True)), "structured_outputs.strict"),
      (chat_request(tools=grpc_tools(), tool_choice=pb.ToolChoice(function_name="nope")),
       "tool_choice.function.name"),
      (chat_request(tool_choice=pb.ToolChoice(mode="required")), "tool_choice"),
      (chat_request(tools=grpc_tools(), tool_choice=pb.ToolChoice(mode="required"),
                    structured_outputs=pb.StructuredOutputs(json_object=True)),
       "structured_outputs"),
      (chat_request(structured_outputs=pb.StructuredOutputs(grammar="start: x\nx: y")),
       "structured_outputs.grammar"),
  ]
  with InferenceClient(target(server), api_key=KEY) as client_grpc:
    for req, field in bad_grpc:
      rpc = (client_grpc.stub.Generate if isinstance(req, pb.GenerateRequest)
             else client_grpc.stub.Chat)
      code, details = status_of(lambda: list(rpc(req, metadata=client_grpc.metadata)))
      assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), (
          field, details)
    # The server still serves, constrained and not.
    assert client_grpc.generate(PROMPT, max_tokens=4).completion_tokens == 4
  got = client.chat.completions.create(model="demo", messages=USER, max_tokens=64,
                                       temperature=0, response_format=response_format())
  jsonschema.validate(json.loads(got.choices[0].message.content), ANSWER)
