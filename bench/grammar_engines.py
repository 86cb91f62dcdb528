"""Grammar engines for structured outputs, llguidance vs xgrammar, on our vocabularies.

    PYTHONPATH=$PWD .venv/bin/python bench/grammar_engines.py --out ge.json
    PYTHONPATH=$PWD .venv-xgrammar/bin/python bench/grammar_engines.py --out ge_xgrammar.json

Runs whichever engines import (xgrammar needs torch: a throwaway venv, never the project's),
on two vocabularies: the demo model's byte-level BPE `tokenizer.json` (8,192 ids, 3 specials
first) and a Kimi-sized tiktoken vocabulary (163,584 ranks + 256 specials = 163,840; Kimi's own
`tiktoken.model` is not available offline, so the ranks are byte strings from Python source,
made into a `TiktokenTokenizer` with Kimi's pattern and special ids). Per grammar: compile
time (cold: the engine's cache off or a fresh object), then along a valid output (the text
encoded by our tokenizer) the time to fill each step's allowed-token mask, and whether the
next token is allowed. With both engines it also counts, per step, tokens one allows and the
other does not, and special tokens allowed anywhere but where EOS may end the output (special
tokens are control tokens, never text). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The `engine` package without its __init__ (which imports jax, absent from the xgrammar
# venv): only the grammar and tokenizer modules are used, and they need neither.
_pkg = types.ModuleType("engine")
_pkg.__path__ = [os.path.join(ROOT, "engine")]
sys.modules.setdefault("engine", _pkg)
from engine.model.tiktoken_tokenizer import (KIMI_PAT_STR, NUM_SPECIAL_IDS,  # noqa: E402
                                             TiktokenTokenizer)

KIMI_VOCAB = 163_840

SCHEMAS = {
    "object_required": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                              "maximum": 120},
        "email": {"type": "string"}}, "required": ["name", "age", "email"],
        "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "enum_array": ({"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}},
        "required": ["colour", "sizes"], "additionalProperties": False},
        {"colour": "green", "sizes": [1, 22, 333]}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "tags": {"type": "array",
                                                           "items": {"type": "string"}}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["user", "items"], "additionalProperties": False},
        {"user": {"id": 7, "tags": ["a", "bc"]}, "items": [{"sku": "X-1", "qty": 2},
                                                           {"sku": "Y", "qty": 10}]}),
}
REGEX = (r"[0-9]{4}-[0-9]{2}-[0-9]{2} [a-z]+", "2024-05-17 tuesday")
# The same small expression grammar in each engine's syntax.
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'
GRAMMAR_TEXT = "(12+3)-45+(6-(7+8))"


# ---- vocabularies ------------------------------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
  """GPT-2's byte-level alphabet, char -> byte."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs)}


def demo_vocab():
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(os.path.join(ROOT, "checkpoints", "demo", "tokenizer.json"))
  n = tok.get_vocab_size()
  dec = _byte_decoder()
  data = json.loads(tok.to_str())
  specials = {a["id"] for a in data["added_tokens"] if a.get("special")}
  strings = [tok.id_to_token(i) for i in range(n)]
  raw = [s.encode() if i in specials else bytes(dec[c] for c in s)
         for i, s in enumerate(strings)]
  return dict(name="demo BPE 8192", tokenizer=tok, vocab_size=n, strings=strings, raw=raw,
              specials=specials, eos=[2], byte_level=True,
              encode=lambda text: tok.encode(text, add_special_tokens=False).ids)


def kimi_sized_vocab():
  """163,584 ranks (every byte, then the most frequent pieces and their prefixes of Python
  source text, then filler) + Kimi's 256 special ids."""
  import sysconfig
  lib = sysconfig.get_paths()["stdlib"]
  files = sorted(os.path.join(d, f) for d, _, fs in os.walk(lib) for f in fs if f.endswith(".py"))
  counts: collections.Counter = collections.Counter()
  size = 0
  piece = re.compile(r" ?[A-Za-z_]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9_]+|\s+")
  for path in files:
    try:
      text = open(path, encoding="utf-8").read()
    except (UnicodeDecodeError, OSError):
      continue
    for p in piece.findall(text):
      b = p.encode()
      for j in range(2, min(len(b), 16) + 1):
        counts[b[:j]] += 1
    size += len(text)
    if size > 12_000_000:
      break
  n_ranks = KIMI_VOCAB - NUM_SPECIAL_IDS
  tokens = [bytes([i]) for i in range(256)]
  seen = set(tokens)
  for b, _ in counts.most_common():
    if len(tokens) >= n_ranks:
      break
    if b not in seen:
      seen.add(b)
      tokens.append(b)
  rng = np.random.default_rng(0)
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
  while len(tokens) < n_ranks:  # filler, if the text ran short
    b = b" " + bytes(rng.choice(letters, rng.integers(3, 9)))
    if b not in seen:
      seen.add(b)
      tokens.append(b)
  ranks = {b: i for i, b in enumerate(tokens)}
  specials = {"[BOS]": n_ranks, "[EOS]": n_ranks + 1, "<|im_end|>": n_ranks + 2,
              "<|im_user|>": n_ranks + 3}
  for i in range(n_ranks, n_ranks + NUM_SPECIAL_IDS):
    if i not in specials.values():
      specials[f"<|reserved_token_{i}|>"] = i
  tok = TiktokenTokenizer(ranks, specials, set(specials.values()), "[EOS]", pat_str=KIMI_PAT_STR)
  by_id = {i: s for s, i in specials.items()}
  raw = tokens + [by_id[i].encode() for i in range(n_ranks, KIMI_VOCAB)]
  return dict(name="Kimi-sized tiktoken 163840", tokenizer=tok, vocab_size=KIMI_VOCAB,
              strings=None, raw=raw, specials=set(range(n_ranks, KIMI_VOCAB)),
              eos=list(tok.eos_token_ids), byte_level=False,
              encode=lambda text: tok.encode(text).ids)


# ---- engines -----------------------------------------------------------------------------------

class LLGuidance:
  name = "llguidance"

  def __init__(self, vocab):
    from engine.runtime import grammar
    self.g = grammar
    t0 = time.perf_counter()
    self.ll_tok = grammar.ll_tokenizer(vocab["tokenizer"], vocab["vocab_size"], vocab["eos"])
    self.tokenizer_s = time.perf_counter() - t0
    self.vocab = vocab

  def compile(self, kind, spec):
    g = self.g
    params = {"json": lambda: g.StructuredOutputsParams(json=json.dumps(spec)),
              "regex": lambda: g.StructuredOutputsParams(regex=spec),
              "grammar": lambda: g.StructuredOutputsParams(grammar=LARK)}[kind]()
    text = params.llguidance_grammar()
    import llguidance
    return lambda: _LLMatcher(llguidance.LLMatcher(self.ll_tok, text, log_level=0))


class _LLMatcher:
  def __init__(self, m):
    self.m = m

  def fill(self, out):
    import llguidance.numpy as ln
    ln.fill_next_token_bitmask(self.m, out.reshape(1, -1), 0)

  def accept(self, t):
    return self.m.consume_token(int(t))


class XGrammar:
  name = "xgrammar"

  def __init__(self, vocab):
    import xgrammar as xgr
    self.xgr = xgr
    t0 = time.perf_counter()
    if vocab["byte_level"]:
      self.info = xgr.TokenizerInfo(vocab["strings"], xgr.VocabType.BYTE_LEVEL,
                                    vocab_size=vocab["vocab_size"], stop_token_ids=vocab["eos"])
    else:
      self.info = xgr.TokenizerInfo(vocab["raw"], xgr.VocabType.RAW,
                                    vocab_size=vocab["vocab_size"], stop_token_ids=vocab["eos"])
    self.tokenizer_s = time.perf_counter() - t0

  def compile(self, kind, spec):
    xgr = self.xgr
    compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
    if kind == "json":
      cg = compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                        separators=(", ", ": "))
    elif kind == "regex":
      cg = compiler.compile_regex(spec)
    else:
      cg = compiler.compile_grammar(EBNF)
    return lambda: _XGMatcher(xgr.GrammarMatcher(cg))


class _XGMatcher:
  def __init__(self, m):
    self.m = m

  def fill(self, out):
    self.m.fill_next_token_bitmask(out.reshape(1, -1), 0)

  def accept(self, t):
    return self.m.accept_token(int(t))


def engines():
  out = [LLGuidance]
  try:
    import xgrammar  # noqa: F401
    out.append(XGrammar)
  except ImportError:
    pass
  return out


def unpack(bits, v):
  return np.unpackbits(bits.view(np.uint8), bitorder="little")[:v].astype(bool)


def cases():
  for name, (schema, value) in SCHEMAS.items():
    yield name, "json", schema, json.dumps(value, separators=(", ", ": "))
  yield "regex", "regex", REGEX[0], REGEX[1]
  yield "grammar", "grammar", None, GRAMMAR_TEXT


def run(vocab, engine_classes):
  v = vocab["vocab_size"]
  words = (v + 31) // 32
  rows = []
  built = {}
  for cls in engine_classes:
    built[cls.name] = cls(vocab)
  for case, kind, spec, text in cases():
    ids = vocab["encode"](text) + vocab["eos"][:1]
    masks = {}
    for name, eng in built.items():
      t0 = time.perf_counter()
      make = eng.compile(kind, spec if kind != "grammar" else None)
      m = make()
      compile_s = time.perf_counter() - t0
      times, allowed, ok, special_leaks = [], [], True, 0
      bits = np.zeros((words,), np.int32)
      for j, tok in enumerate(ids):
        t1 = time.perf_counter()
        m.fill(bits)
        times.append(time.perf_counter() - t1)
        mask = unpack(bits, v)
        allowed.append(mask)
        ok = ok and bool(mask[tok])
        if j < len(ids) - 1:  # where the output cannot end yet no special token may appear
          special_leaks += int(sum(mask[s] for s in vocab["specials"] if s not in vocab["eos"]))
        if not m.accept(tok):
          ok = False
          break
      masks[name] = allowed
      rows.append(dict(vocab=vocab["name"], engine=name, case=case,
                       tokenizer_build_ms=round(eng.tokenizer_s * 1e3, 1),
                       compile_ms=round(compile_s * 1e3, 2), steps=len(times),
                       mask_us_mean=round(statistics.mean(times) * 1e6, 1),
                       mask_us_p50=round(statistics.median(times) * 1e6, 1),
                       mask_us_max=round(max(times) * 1e6, 1), valid_path_allowed=ok,
                       special_tokens_allowed=special_leaks,
                       allowed_mean=round(float(np.mean([a.sum() for a in allowed])), 1)))
    if len(masks) == 2:
      a, b = masks.values()
      n = min(len(a), len(b))
      for r, mine, other in ((rows[-2], a, b), (rows[-1], b, a)):
        only = [np.flatnonzero(mine[j] & ~other[j]) for j in range(n)]
        r["only_this_allows_per_step"] = round(statistics.mean(len(o) for o in only), 2)
        r["only_this_allows_examples"] = sorted({repr(vocab["raw"][t])[:24] for o in only
                                                 for t in o[:3]})[:6]
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="")
  ap.add_argument("--vocab", default="demo,kimi", help="demo,kimi")
  args = ap.parse_args(argv)
  classes = engines()
  rows = []
  for which in args.vocab.split(","):
    vocab = demo_vocab() if which == "demo" else kimi_sized_vocab()
    rows += run(vocab, classes)
  cols = ["vocab", "engine", "case", "tokenizer_build_ms", "compile_ms", "steps", "mask_us_mean",
          "mask_us_p50", "mask_us_max", "valid_path_allowed", "special_tokens_allowed",
          "allowed_mean", "only_this_allows_per_step"]
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  for r in rows:
    print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(python=sys.version.split()[0], rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
