"""Kimi's tokenizer as shipped (`tiktoken.model` + `tokenizer_config.json`), behind the part of
the `tokenizers.Tokenizer` interface the engine uses.

    tok = TiktokenTokenizer.from_dir("/ckpt/Kimi-K2.5")
    tok.encode("hi").ids; tok.encode_batch(["a", "b"]); tok.decode(ids, skip_special_tokens=True)

Encoding reproduces Kimi's reference `TikTokenTokenizer` (moonshotai's `tokenization_kimi.py`):
the same `tiktoken.Encoding` (its `pat_str`, the BPE ranks, 256 special ids from len(ranks) on,
named by `added_tokens_decoder`, else `<|reserved_token_{id}|>`), the text cut into chunks of
400,000 characters and those into pieces of at most 25,000 consecutive whitespace or
non-whitespace characters, each piece encoded on its own. One deliberate difference: text that
spells a special token (`<|im_end|>` typed by a user) is encoded as ordinary text unless the
caller passes `allow_special_tokens=True` (the reference's default makes it the control token).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
import re
from typing import Any, Sequence

import tiktoken

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_SPECIAL_IDS = 256
# As tokenization_kimi.py (TikTokenTokenizer.pat_str); tiktoken's regex engine (fancy-regex)
# reads the `&&` class intersections as written.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MAX_ENCODE_CHARS = 400_000  # the reference's chunk (tiktoken panicked on longer input)
MAX_RUN_CHARS = 25_000  # the reference's longest run of whitespace / non-whitespace per piece
# The chat format's end of turn: a stop token besides tokenizer_config's eos_token ([EOS]).
END_OF_TURN = "<|im_end|>"
# Python's `\s` is exactly str.isspace() (both Py_UNICODE_ISSPACE), the reference's test.
_RUN = re.compile(r"\s+|\S+")


class TokenizerError(ValueError):
  """A tokenizer file that cannot be used, with the file and the line or field named."""


@dataclasses.dataclass(frozen=True)
class Encoding:
  """What the engine reads of a `tokenizers.Encoding`."""
  ids: list[int]


def split_pieces(text: str) -> list[str]:
  """The reference's pieces: chunks of MAX_ENCODE_CHARS, each cut so that no piece holds more
  than MAX_RUN_CHARS consecutive whitespace or non-whitespace characters."""
  pieces = []
  for start in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
    chunk = text[start:start + MAX_ENCODE_CHARS]
    cuts = []
    if len(chunk) > MAX_RUN_CHARS:
      for m in _RUN.finditer(chunk):
        cuts.extend(range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS))
    bounds = [0, *cuts, len(chunk)]
    pieces.extend(chunk[a:b] for a, b in zip(bounds, bounds[1:]))
  return pieces


def load_ranks(path: str) -> dict[bytes, int]:
  """A tiktoken BPE file: one `<base64 token> <rank>` per line, ranks 0..n-1, every byte."""
  ranks: dict[bytes, int] = {}
  seen: dict[int, int] = {}
  with open(path, "rb") as fh:
    for lineno, line in enumerate(fh, 1):
      if not line.strip():
        continue
      parts = line.split()
      try:
        if len(parts) != 2:
          raise ValueError("not two fields")
        token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
      except (ValueError, binascii.Error) as e:
        raise TokenizerError(f"{path}:{lineno}: expected '<base64 token> <rank>', got "
                             f"{line[:60]!r} ({e})") from None
      if token in ranks or rank in seen:
        what = f"token {token!r}" if token in ranks else f"rank {rank}"
        first = seen[ranks[token]] if token in ranks else seen[rank]
        raise TokenizerError(f"{path}:{lineno}: {what} already on line {first}")
      ranks[token] = rank
      seen[rank] = lineno
  if not ranks:
    raise TokenizerError(f"{path}: no ranks")
  if max(seen) != len(ranks) - 1 or min(seen) != 0:
    raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} (the special ids follow "
                         f"them), got {min(seen)}..{max(seen)}")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise TokenizerError(f"{path}: no rank for single byte(s) {missing[:8]}: text holding them "
                         f"could not be encoded")
  return ranks


def _token_text(value: Any) -> str | None:
  """An AddedToken as tokenizer_config.json writes it: a string or {"content": ...}."""
  return value.get("content") if isinstance(value, dict) else value


def load_special_tokens(path: str | None, num_ranks: int
                        ) -> tuple[dict[str, int], set[int], str | None]:
  """({name: id} of the NUM_SPECIAL_IDS ids after the ranks, the ids decode skips, eos_token)
  from tokenizer_config.json (`path` None: every id reserved). Entries `"special": false` (Kimi's
  tool-call markers) stay in decoded text, as transformers keeps them."""
  names: dict[int, str] = {}
  kept: set[int] = set()
  eos = None
  if path is not None:
    try:
      with open(path) as fh:
        config = json.load(fh)
    except json.JSONDecodeError as e:
      raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
      raise TokenizerError(f"{path}: added_tokens_decoder must be an object of id -> token")
    for key, entry in decoder.items():
      field = f"{path}: added_tokens_decoder[{key!r}]"
      if not (isinstance(key, str) and key.isdigit()):
        raise TokenizerError(f"{field}: the key must be a token id")
      i, content = int(key), _token_text(entry)
      if not num_ranks <= i < num_ranks + NUM_SPECIAL_IDS:
        raise TokenizerError(f"{field}: id outside the special ids {num_ranks}.."
                             f"{num_ranks + NUM_SPECIAL_IDS - 1} (after the "
                             f"{num_ranks} ranks)")
      if not isinstance(content, str) or not content:
        raise TokenizerError(f"{field}: 'content' must be a non-empty string")
      names[i] = content
      if isinstance(entry, dict) and entry.get("special", True) is False:
        kept.add(i)
    eos = _token_text(config.get("eos_token"))
  specials: dict[str, int] = {}
  for i in range(num_ranks, num_ranks + NUM_SPECIAL_IDS):
    name = names.get(i, f"<|reserved_token_{i}|>")
    if name in specials:
      raise TokenizerError(f"{path}: added_tokens_decoder: ids {specials[name]} and {i} are "
                           f"both {name!r}")
    specials[name] = i
  return specials, set(specials.values()) - kept, eos if isinstance(eos, str) else None


class TiktokenTokenizer:
  """A `tiktoken.Encoding` with Kimi's pattern, splitting and special tokens, called as the
  engine calls a `tokenizers.Tokenizer`. The tiktoken core releases the GIL while it encodes
  or decodes; the batch calls spread their pieces over a thread pool."""

  def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int],
               skip_ids: set[int] = frozenset(), eos_token: str | None = None,
               name: str = RANKS_FILE, pat_str: str = KIMI_PAT_STR):
    self.encoding = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                                      special_tokens=special_tokens)
    self.special_tokens = dict(special_tokens)
    self._skip_ids = frozenset(skip_ids)
    self._n_vocab = self.encoding.n_vocab
    self.eos_token_ids = tuple(dict.fromkeys(  # stop tokens for serving: [EOS], <|im_end|>
        special_tokens[t] for t in (eos_token, END_OF_TURN) if t in special_tokens))

  @classmethod
  def from_dir(cls, path: str) -> "TiktokenTokenizer":
    ranks_path = os.path.join(path, RANKS_FILE)
    ranks = load_ranks(ranks_path)
    config_path = os.path.join(path, CONFIG_FILE)
    specials, skip, eos = load_special_tokens(
        config_path if os.path.isfile(config_path) else None, len(ranks))
    return cls(ranks, specials, skip, eos, name=ranks_path)

  def _allowed(self, allow_special_tokens: bool) -> Any:
    return self.encoding.special_tokens_set if allow_special_tokens else set()

  def encode(self, text: str, allow_special_tokens: bool = False) -> Encoding:
    """`text`'s ids; special-token text becomes its control token only if allowed."""
    allowed = self._allowed(allow_special_tokens)
    ids: list[int] = []
    for piece in split_pieces(text):
      ids.extend(self.encoding.encode(piece, allowed_special=allowed, disallowed_special=()))
    return Encoding(ids)

  def encode_batch(self, texts: Sequence[str], allow_special_tokens: bool = False
                   ) -> list[Encoding]:
    """`encode` of each text, the pieces of all of them encoded on a thread pool."""
    per_text = [split_pieces(t) for t in texts]
    pieces = [p for ps in per_text for p in ps]
    allowed = self._allowed(allow_special_tokens)
    if len(pieces) == 1:
      encoded = [self.encoding.encode(pieces[0], allowed_special=allowed,
                                      disallowed_special=())]
    else:
      encoded = self.encoding.encode_batch(pieces, num_threads=min(8, max(len(pieces), 1)),
                                           allowed_special=allowed, disallowed_special=())
    out, k = [], 0
    for ps in per_text:
      out.append(Encoding([i for ids in encoded[k:k + len(ps)] for i in ids]))
      k += len(ps)
    return out

  def _known(self, ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """Ids to decode: out-of-vocabulary ids dropped (as `tokenizers` does), specials if asked."""
    skip = self._skip_ids if skip_special_tokens else frozenset()
    return [int(i) for i in ids if 0 <= i < self._n_vocab and int(i) not in skip]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids` (invalid UTF-8 replaced), without special tokens unless asked."""
    return self.encoding.decode(self._known(ids, skip_special_tokens))

  def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
                   ) -> list[str]:
    known = [self._known(ids, skip_special_tokens) for ids in batch]
    if len(known) == 1:
      return [self.encoding.decode(known[0])]
    return self.encoding.decode_batch(known)

  def token_to_id(self, token: str) -> int | None:
    """The id of a special token or of a single-token string, else None."""
    if token in self.special_tokens:
      return self.special_tokens[token]
    try:
      return self.encoding.encode_single_token(token.encode())
    except KeyError:
      return None

  def get_vocab_size(self) -> int:
    return self._n_vocab
