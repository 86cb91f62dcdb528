"""Structured outputs: a request's constraint (JSON schema, regex, choice, Lark grammar) compiled
by llguidance into a per-request matcher that yields, per decoding step, the allowed-token bitmask.

    spec = StructuredOutputsParams(json='{"type": "object", "required": ["a"], ...}')
    spec.validate()                                  # structural checks, GrammarError
    grammar = compile_grammar(spec, tokenizer)       # cached per (tokenizer, spec); GrammarError
    m = grammar.matcher()                            # one per request
    m.fill_bitmask(bits[row])                        # int32 [ceil(V/32)], bit t of word t//32
    m.accept(token)                                  # False: the grammar forbids it
    m.is_terminated()                                # nothing but EOS may follow: finish

Why llguidance (BENCHMARKS.md, "Structured outputs: grammar engines"): Rust, no torch, masks
computed lazily per step (no per-schema precompilation of a token automaton), and it builds its
token trie from the engine's own tokenizer files: `tokenizers`' JSON for byte-level BPE
(demo model, HF checkpoints) and the tiktoken ranks + special tokens for Kimi, so every token's
bytes are exact and special tokens are known as such (never matched by grammar text).

The tokenizer is the engine's (`tokenizers.Tokenizer` or `TiktokenTokenizer`); its llguidance
form (`LLTokenizer`, ~1 s for a 160k vocabulary) is built once per (tokenizer, vocabulary size,
EOS ids). The mask covers the model's vocabulary (which may pad past the tokenizer's): ids the
tokenizer does not have are never allowed. EOS ids are allowed exactly where the grammar accepts.
"""

from __future__ import annotations

import dataclasses
import functools
import json as _json
import threading
from typing import Any, Sequence

import numpy as np

import llguidance
import llguidance.numpy as llg_np

# JSON schema compile options: no free whitespace (a small model given `[ \t\n]*` between tokens
# may emit whitespace forever); ", " and ": " as the separators (vLLM's and OpenAI's compact
# form is ","/":", but the spaced one tokenises like ordinary JSON text, which models have seen).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Limits on one grammar's parsing work, so a pathological schema costs an error, not a stall.
PARSER_LIMITS = llguidance.LLParserLimits()
_LOG_SILENT = 0


class GrammarError(ValueError):
  """A constraint that cannot be compiled; the message is the grammar engine's reason."""


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
  """A request's output constraint (vLLM's name and fields); exactly one field is set."""
  json: str | None = None  # a JSON schema, as JSON text
  json_object: bool = False  # any JSON object
  regex: str | None = None
  choice: tuple[str, ...] | None = None
  grammar: str | None = None  # a Lark-style grammar in llguidance's syntax (may embed %json{...})

  def kind(self) -> str:
    """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
    set_ = self._set_fields()
    if len(set_) != 1:
      raise GrammarError("structured_outputs: exactly one of json, json_object, regex, choice, "
                         f"grammar must be set, got {', '.join(set_) if set_ else 'none'}")
    return set_[0]

  def _set_fields(self) -> list[str]:
    return [name for name, on in (("json", self.json is not None),
                                  ("json_object", bool(self.json_object)),
                                  ("regex", self.regex is not None),
                                  ("choice", self.choice is not None),
                                  ("grammar", self.grammar is not None)) if on]

  def validate(self) -> None:
    """Structural checks (no compilation): one field set, of the right type, non-empty; the
    JSON schema parses as a JSON object or boolean. Raises GrammarError naming the field."""
    kind = self.kind()
    if kind == "json":
      if not isinstance(self.json, str):
        raise GrammarError(f"structured_outputs.json: must be the schema as JSON text, got "
                           f"{type(self.json).__name__}")
      try:
        schema = _json.loads(self.json)
      except ValueError as e:
        raise GrammarError(f"structured_outputs.json: not valid JSON ({e})") from None
      if not isinstance(schema, (dict, bool)):
        raise GrammarError("structured_outputs.json: a JSON schema must be an object or a "
                           f"boolean, got {type(schema).__name__}")
    elif kind == "json_object":
      if self.json_object is not True:
        raise GrammarError("structured_outputs.json_object: must be true or unset")
    elif kind in ("regex", "grammar"):
      value = getattr(self, kind)
      if not isinstance(value, str) or not value:
        raise GrammarError(f"structured_outputs.{kind}: must be a non-empty string")
    else:
      if not isinstance(self.choice, tuple) or not self.choice:
        raise GrammarError("structured_outputs.choice: must be a non-empty tuple of strings")
      for i, c in enumerate(self.choice):
        if not isinstance(c, str) or not c:
          raise GrammarError(f"structured_outputs.choice[{i}]: must be a non-empty string")

  def llguidance_grammar(self) -> str:
    """The constraint as an llguidance grammar (JSON text); GrammarError if it cannot be
    written as one (bad JSON; grammar errors surface when compiled against a tokenizer)."""
    self.validate()
    kind = self.kind()
    try:
      if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
      if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=JSON_OPTIONS)
      if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(self.regex)
      if kind == "choice":
        # JSON string escapes are Lark string literals' escapes in llguidance's syntax.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(_json.dumps(c) for c in self.choice))
      return llguidance.LLMatcher.grammar_from_lark(self.grammar)
    except ValueError as e:
      raise GrammarError(f"structured_outputs.{kind}: {e}") from None


# ---------------------------------------------------------------------------------------------
# The engine's tokenizer in llguidance's form, once per (tokenizer, vocabulary, EOS ids).

_LOCK = threading.Lock()
# id(tokenizer) -> (tokenizer, {(vocab_size, eos ids): LLTokenizer}); the tokenizer is kept so
# that its id is not reused while the entry lives.
_LL_TOKENIZERS: dict[int, tuple[Any, dict[tuple[int, tuple[int, ...]], Any]]] = {}


def default_eos_ids(tokenizer: Any) -> tuple[int, ...]:
  """The tokenizer's own stop tokens when it names them (TiktokenTokenizer.eos_token_ids),
  else the first of the usual EOS spellings it has."""
  ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
  if ids:
    return ids
  for name in ("<|eos|>", "</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "[EOS]",
               "<|eot_id|>"):
    i = tokenizer.token_to_id(name)
    if i is not None:
      return (int(i),)
  return ()


def _build_ll_tokenizer(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> Any:
  from engine.model.tiktoken_tokenizer import TiktokenTokenizer
  eos_arg = list(eos) if eos else None
  # llguidance needs every id of the tokenizer; a model whose embedding is smaller than its
  # tokenizer (ids it can never sample) gets masks cut to its vocabulary (`fill_bitmask`).
  vocab_size = max(vocab_size, tokenizer.get_vocab_size())
  if isinstance(tokenizer, TiktokenTokenizer):
    enc = tokenizer.encoding
    # The ranks, the 256 special ids after them (named as our tokenizer names them) and Kimi's
    # pattern: llguidance tokenises forced text the way the engine does.
    return llguidance.LLTokenizer.from_tiktoken(
        encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens, pattern=enc._pat_str,
        eos_token=eos_arg, n_vocab=vocab_size)
  to_str = getattr(tokenizer, "to_str", None)
  if to_str is None:
    raise GrammarError(f"structured outputs need a tokenizers.Tokenizer or TiktokenTokenizer, "
                       f"got {type(tokenizer).__name__}")
  from tokenizers import Tokenizer
  copy = Tokenizer.from_str(to_str())  # padding/truncation off on a copy, not the engine's
  copy.no_padding()
  copy.no_truncation()
  return llguidance.LLTokenizer(copy.to_str(), n_vocab=vocab_size, eos_token=eos_arg)


def ll_tokenizer(tokenizer: Any, vocab_size: int | None = None,
                 eos_token_ids: Sequence[int] | None = None) -> Any:
  """The cached `llguidance.LLTokenizer` of the engine's tokenizer (see module docstring)."""
  if tokenizer is None:
    raise GrammarError("structured outputs need the model's tokenizer (tokenizer.json or "
                       "tiktoken.model)")
  vocab = int(vocab_size if vocab_size is not None else tokenizer.get_vocab_size())
  eos = tuple(int(i) for i in (eos_token_ids if eos_token_ids is not None
                               else default_eos_ids(tokenizer)))
  key = (vocab, eos)
  with _LOCK:
    entry = _LL_TOKENIZERS.setdefault(id(tokenizer), (tokenizer, {}))
    built = entry[1].get(key)
  if built is None:
    built = _build_ll_tokenizer(tokenizer, vocab, eos)
    with _LOCK:
      built = entry[1].setdefault(key, built)
  return built


# ---------------------------------------------------------------------------------------------
# Compiled grammars and per-request matchers.

def bitmask_words(vocab_size: int) -> int:
  """int32 words of one row's allowed-token bitmask."""
  return (vocab_size + 31) // 32


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
  """A constraint checked against one tokenizer; `matcher()` starts a request's state."""
  spec: StructuredOutputsParams
  grammar: str  # llguidance's grammar text
  tokenizer: Any  # llguidance.LLTokenizer
  vocab_size: int  # the model's vocabulary (mask width in tokens)
  eos_token_ids: tuple[int, ...]

  def matcher(self) -> "GrammarMatcher":
    """A fresh matcher: a copy of the one built at first use (building parses the grammar
    again, ~6-18 ms for a 20-tool grammar; a copy ~0.02 ms)."""
    with _LOCK:
      start = self.__dict__.get("_start")
    if start is None:
      start = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=_LOG_SILENT,
                                   limits=PARSER_LIMITS)
      if start.is_error():
        raise GrammarError(f"structured_outputs.{self.spec.kind()}: {start.get_error()}")
      with _LOCK:
        start = self.__dict__.setdefault("_start", start)
    with _LOCK:  # (the start matcher is shared: copy it under the lock)
      return GrammarMatcher(start.deep_copy(), self)


class GrammarMatcher:
  """One request's position in its grammar. Not thread-safe; the engine uses one at a time."""

  def __init__(self, matcher: Any, grammar: CompiledGrammar):
    self._m = matcher
    self.grammar = grammar
    self.num_accepted = 0  # tokens consumed (what rollback can undo)

  def fill_bitmask(self, out: np.ndarray) -> None:
    """Writes the allowed next tokens into `out` (int32 [bitmask_words(V)], C-contiguous):
    bit t % 32 of word t // 32 set iff token t is allowed. A terminated matcher allows only
    EOS; one in an error state allows only EOS too (llguidance's rule)."""
    words = bitmask_words(self.grammar.tokenizer.vocab_size)
    if words <= out.size:
      llg_np.fill_next_token_bitmask(self._m, out.reshape(1, -1), 0)
      return
    full = np.zeros((1, words), np.int32)   # the tokenizer has ids past the model's
    llg_np.fill_next_token_bitmask(self._m, full, 0)
    out.reshape(-1)[:] = full[0, :out.size]

  def accept(self, token: int) -> bool:
    """Consumes `token`; False (and the matcher in an error state) if the grammar forbids it."""
    ok = self._m.consume_token(int(token))
    if ok:
      self.num_accepted += 1
    return ok

  def accept_tokens(self, tokens: Sequence[int]) -> int:
    """Consumes the longest allowed prefix of `tokens` and returns its length."""
    tokens = [int(t) for t in tokens]
    n = self._m.validate_tokens(tokens)
    if n and not self._m.consume_tokens(tokens[:n]):
      raise GrammarError(f"grammar matcher failed on tokens it validated: {self._m.get_error()}")
    self.num_accepted += n
    return n

  def allowed_prefix(self, tokens: Sequence[int]) -> int:
    """How many of `tokens` the grammar allows in a row from here (nothing consumed)."""
    return self._m.validate_tokens([int(t) for t in tokens])

  def rollback(self, num_tokens: int) -> None:
    if num_tokens > self.num_accepted or not self._m.rollback(int(num_tokens)):
      raise GrammarError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
    self.num_accepted -= num_tokens

  def is_terminated(self) -> bool:
    """True when nothing but EOS may follow (the output is complete); also on error."""
    return self._m.is_stopped()

  def is_accepting(self) -> bool:
    """True when the output so far is a complete match (EOS allowed here)."""
    return self._m.is_accepting()

  def is_error(self) -> bool:
    return self._m.is_error()

  def error(self) -> str:
    return self._m.get_error()

  def copy(self) -> "GrammarMatcher":
    c = GrammarMatcher(self._m.deep_copy(), self.grammar)
    c.num_accepted = self.num_accepted
    return c

  def allowed_tokens(self) -> np.ndarray:
    """The allowed next token ids (host, for tests and debugging)."""
    bits = np.zeros(bitmask_words(self.grammar.vocab_size), np.int32)
    self.fill_bitmask(bits)
    return np.flatnonzero(unpack_bitmask(bits, self.grammar.vocab_size))


def unpack_bitmask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
  """int32 [..., W] bitmask -> bool [..., vocab_size] (host side)."""
  as_bytes = np.ascontiguousarray(bits, dtype="<i4").view(np.uint8)
  return np.unpackbits(as_bytes, axis=-1, bitorder="little")[..., :vocab_size].astype(bool)


@functools.lru_cache(maxsize=512)
def _compile_cached(spec: StructuredOutputsParams, ll_tok: Any, vocab: int,
                    eos: tuple[int, ...]) -> CompiledGrammar:
  grammar = spec.llguidance_grammar()
  is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
      grammar, ll_tok, limits=PARSER_LIMITS)
  if is_error:
    raise GrammarError(f"structured_outputs.{spec.kind()}: {messages[0]}")
  return CompiledGrammar(spec=spec, grammar=grammar, tokenizer=ll_tok, vocab_size=vocab,
                         eos_token_ids=eos)


def compile_grammar(spec: StructuredOutputsParams, tokenizer: Any, *,
                    vocab_size: int | None = None,
                    eos_token_ids: Sequence[int] | None = None) -> CompiledGrammar:
  """Compiles `spec` against the engine's tokenizer; cached per (tokenizer, vocabulary, EOS ids,
  spec). `vocab_size`: the model's (default: the tokenizer's); `eos_token_ids`: the ids allowed
  where the grammar accepts (default: the tokenizer's own, `default_eos_ids`). Raises
  GrammarError with the grammar engine's reason."""
  if not isinstance(spec, StructuredOutputsParams):
    raise GrammarError(f"structured_outputs: expected StructuredOutputsParams, got "
                       f"{type(spec).__name__}")
  spec.validate()
  ll_tok = ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
  vocab = int(vocab_size if vocab_size is not None else tokenizer.get_vocab_size())
  eos = tuple(int(i) for i in (eos_token_ids if eos_token_ids is not None
                               else default_eos_ids(tokenizer)))
  return _compile_cached(spec, ll_tok, vocab, eos)
