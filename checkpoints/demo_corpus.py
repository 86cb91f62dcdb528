"""Corpus and tokenizer of the bundled demo model: the Python standard library source.

    python -m checkpoints.demo_corpus --out=checkpoints/demo [--cache_dir=DIR]

Writes `OUT/tokenizer.json` (byte-level BPE, `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2),
`OUT/split.json` (the modules, files, bytes and tokens of each side) and the token arrays
(int32 .npy, one per side) under `--cache_dir` (default `~/.cache/moejax/corpus`), named by a
hash of the file list and the tokenizer. Prints a summary. Everything is deterministic for a
given interpreter: the corpus is the source of the Python that runs the script, present on
every machine.

Documents are framed as BOS + tokens + EOS and concatenated (encoded without special tokens).
The saved tokenizer prepends BOS when asked for special tokens (the default of
`Tokenizer.encode`), so a prompt encoded the ordinary way starts like a training document.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = (PAD, BOS, EOS)  # trainer assigns ids in this order: 0, 1, 2

HELDOUT_PERCENT = 5  # crc32 buckets (of 100) that go to the held-out side

# Subtrees left out of the corpus, relative to the stdlib directory. The regression test
# suites are ~20 MB (2/3 of the stdlib's .py bytes): mostly assertion boilerplate plus
# deliberately malformed fixtures (bad syntax, odd encodings), so they would swamp the
# library code we want the model to learn and push the corpus past ~25 MB.
EXCLUDED_DIRS = ("site-packages", "test", "idlelib/idle_test")

# Machine-generated data modules (codec tables, Sphinx topic dumps, token/stringprep
# tables): long literal tables, not representative code. Matched in a file's first lines.
_GENERATED_HEADER = re.compile(r"auto-?generated|do not edit|generated from .* with gencodec",
                               re.IGNORECASE)
_GENERATED_HEADER_LINES = 3


def stdlib_dir() -> str:
  """The standard library directory of the running interpreter."""
  return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _read_utf8(path: str) -> str | None:
  """File contents decoded as UTF-8 (exactly, no newline translation); None if not UTF-8."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def _is_generated(text: str) -> bool:
  head = "\n".join(text.split("\n", _GENERATED_HEADER_LINES)[:_GENERATED_HEADER_LINES])
  return bool(_GENERATED_HEADER.search(head))


def _module_name(rel_path: str) -> str:
  """'email/mime/text.py' -> 'email.mime.text'; 'json/__init__.py' -> 'json'."""
  parts = rel_path[:-len(".py")].split("/")
  if parts[-1] == "__init__" and len(parts) > 1:
    parts = parts[:-1]
  return ".".join(parts)


def stdlib_files(root: str | None = None,
                 excluded: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
  """[(module_name, path)] of the stdlib's importable .py modules, sorted by module name.

  Kept: every importable module and package of the standard library (path components are
  identifiers), including idlelib, lib2to3, tkinter and turtledemo: real application and
  library code. Excluded: site-packages (third-party), __pycache__, the test suites
  (`test/`, `idlelib/idle_test/`: see EXCLUDED_DIRS), machine-generated data modules
  (gencodec codec tables in encodings/, pydoc_data/topics.py, token.py, stringprep.py,
  re/_casefix.py, _sysconfigdata_*: long literal tables), non-importable paths such as
  config-3.12-*/python-config.py, and files that are not valid UTF-8. This leaves ~9 MB of
  code on CPython 3.12. If `excluded` is a list, (relative path, reason) is appended to it
  for each skipped .py file outside the excluded directories.
  """
  def skip(rel: str, reason: str) -> None:
    if excluded is not None:
      excluded.append((rel, reason))

  root = stdlib_dir() if root is None else os.path.realpath(root)
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
    rel_dir = "" if rel_dir == "." else rel_dir
    # Prune in place so os.walk never descends; sorted for a deterministic walk order.
    dirnames[:] = sorted(
        d for d in dirnames
        if d != "__pycache__" and d.isidentifier()
        and f"{rel_dir}/{d}".lstrip("/") not in EXCLUDED_DIRS)
    for name in sorted(filenames):
      if not name.endswith(".py"):
        continue
      rel = f"{rel_dir}/{name}".lstrip("/")
      path = os.path.join(dirpath, name)
      text = _read_utf8(path)
      if not name[:-3].isidentifier():
        skip(rel, "not importable")
      elif text is None:
        skip(rel, "not UTF-8")
      elif name.startswith("_sysconfigdata_") or _is_generated(text):
        skip(rel, "generated")
      else:
        found.append((_module_name(rel), path))
  return sorted(found)


def split_unit(module_name: str) -> str:
  """The unit a split keeps together: the top-level package or module name."""
  return module_name.split(".", 1)[0]


def is_heldout(module_name: str) -> bool:
  """Stable across runs and machines (crc32, never Python's salted hash())."""
  unit = split_unit(module_name)
  return zlib.crc32(unit.encode("utf-8")) % 100 < HELDOUT_PERCENT


def split(files: Sequence[tuple[str, str]]
          ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
  """(train, heldout): whole top-level packages/modules per side, ~5% of them held out."""
  train = [f for f in files if not is_heldout(f[0])]
  heldout = [f for f in files if is_heldout(f[0])]
  return train, heldout


def read_texts(files: Iterable[tuple[str, str]]) -> list[str]:
  texts = []
  for _, path in files:
    text = _read_utf8(path)
    if text is None:
      raise ValueError(f"{path} is not valid UTF-8")
    texts.append(text)
  return texts


def train_tokenizer(train_texts: Sequence[str], vocab_size: int = 8192,
                    min_frequency: int = 2):
  """Byte-level BPE over `train_texts`; ids 0/1/2 are <|pad|>/<|bos|>/<|eos|>.

  No normalizer and the byte-level alphabet seeded in full, so decode(encode(x)) == x for
  any string. min_frequency=2: a pair seen once is noise, not a reusable unit.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      # Long runs of '#', '=' or spaces otherwise take whole vocab entries each.
      max_token_length=24)
  tokenizer.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
  for token, want in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID)):
    got = tokenizer.token_to_id(token)
    if got != want:
      raise AssertionError(f"{token} got id {got}, want {want}")
  # A prompt encoded the ordinary way (add_special_tokens=True, as the engine and transformers
  # do) starts with BOS like every training document; corpus framing encodes without it.
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)])
  return tokenizer


def load_tokenizer(path: str):
  from tokenizers import Tokenizer
  return Tokenizer.from_file(path)


def encode_documents(tokenizer, texts: Sequence[str]) -> np.ndarray:
  """[sum(len_i + 2)] int32: each text as BOS + tokens + EOS, concatenated in order.

  Special-token strings inside a text are encoded as plain text, so ids 0/1/2 only ever
  come from the framing.
  """
  # A literal "<|eos|>" in a source file must stay text, not end the document early.
  saved = tokenizer.encode_special_tokens
  tokenizer.encode_special_tokens = True
  try:
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
  finally:
    tokenizer.encode_special_tokens = saved
  pieces = []
  for enc in encodings:
    ids = np.asarray(enc.ids, dtype=np.int32)
    pieces += [np.array([BOS_ID], np.int32), ids, np.array([EOS_ID], np.int32)]
  if not pieces:
    return np.zeros((0,), np.int32)
  return np.concatenate(pieces)


def encode_corpus(tokenizer, files: Sequence[tuple[str, str]]) -> np.ndarray:
  """[n_tokens] int32: each file as BOS + tokens + EOS, concatenated in `files` order."""
  return encode_documents(tokenizer, read_texts(files))


def corpus_key(tokenizer, train_files: Sequence[tuple[str, str]],
               heldout_files: Sequence[tuple[str, str]]) -> str:
  """16 hex digits over the module names, file contents and the tokenizer JSON."""
  h = hashlib.sha256()
  for side, files in (("train", train_files), ("heldout", heldout_files)):
    h.update(side.encode())
    for module, path in files:
      with open(path, "rb") as f:
        data = f.read()
      h.update(f"{module}\0{len(data)}\0".encode())
      h.update(data)
  h.update(tokenizer.to_str().encode("utf-8"))
  return h.hexdigest()[:16]


def default_cache_dir() -> str:
  """Where the token arrays are cached unless a flag says otherwise: ~/.cache/moejax/corpus."""
  from engine.runtime.compile_cache import user_cache_dir
  return user_cache_dir("corpus")


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
  tmp = f"{path}.tmp{os.getpid()}.npy"
  np.save(tmp, array)
  os.replace(tmp, path)


def tokenized_corpus(cache_dir: str, tokenizer,
                     train_files: Sequence[tuple[str, str]] | None = None,
                     heldout_files: Sequence[tuple[str, str]] | None = None,
                     ) -> tuple[np.ndarray, np.ndarray]:
  """(train_ids, heldout_ids) int32, cached as `cache_dir/{train,heldout}-<key>.npy`.

  `tokenizer` is a Tokenizer or a tokenizer.json path; files default to
  split(stdlib_files()). The key hashes files and tokenizer, so stale caches never match.
  """
  if isinstance(tokenizer, (str, os.PathLike)):
    tokenizer = load_tokenizer(os.fspath(tokenizer))
  if train_files is None or heldout_files is None:
    default_train, default_heldout = split(stdlib_files())
    train_files = default_train if train_files is None else train_files
    heldout_files = default_heldout if heldout_files is None else heldout_files
  key = corpus_key(tokenizer, train_files, heldout_files)
  paths = [os.path.join(cache_dir, f"{side}-{key}.npy") for side in ("train", "heldout")]
  if all(os.path.isfile(p) for p in paths):
    return tuple(np.load(p) for p in paths)
  os.makedirs(cache_dir, exist_ok=True)
  arrays = (encode_corpus(tokenizer, train_files), encode_corpus(tokenizer, heldout_files))
  for path, array in zip(paths, arrays):
    _save_npy_atomic(path, array)
  return arrays


def split_summary(files: Sequence[tuple[str, str]], ids: np.ndarray | None = None) -> dict:
  """{"modules": sorted top-level units, "files", "bytes", "tokens"} of one side."""
  summary = dict(
      modules=sorted({split_unit(m) for m, _ in files}),
      files=len(files),
      bytes=sum(os.path.getsize(p) for _, p in files))
  if ids is not None:
    summary["tokens"] = int(ids.size)
  return summary


def main(argv: list[str]) -> None:
  from absl import flags

  del argv
  FLAGS = flags.FLAGS
  if not FLAGS.out:
    raise SystemExit("--out is required")
  os.makedirs(FLAGS.out, exist_ok=True)

  t0 = time.time()
  excluded = []
  files = stdlib_files(excluded=excluded)
  train_files, heldout_files = split(files)
  train_texts = read_texts(train_files)
  t_list = time.time() - t0

  t0 = time.time()
  tokenizer = train_tokenizer(train_texts, vocab_size=FLAGS.vocab_size)
  t_tok = time.time() - t0
  tokenizer.save(os.path.join(FLAGS.out, "tokenizer.json"), pretty=False)  # 220 KB, not 540

  t0 = time.time()
  train_ids, heldout_ids = tokenized_corpus(FLAGS.cache_dir, tokenizer, train_files,
                                            heldout_files)
  t_enc = time.time() - t0
  key = corpus_key(tokenizer, train_files, heldout_files)

  report = dict(
      python=".".join(map(str, sys.version_info[:3])),
      excluded_dirs=list(EXCLUDED_DIRS),
      excluded_files={reason: sorted(rel for rel, r in excluded if r == reason)
                      for reason in sorted({r for _, r in excluded})},
      heldout_rule=f"zlib.crc32(top-level name) % 100 < {HELDOUT_PERCENT}",
      vocab_size=tokenizer.get_vocab_size(),
      special_tokens={PAD: PAD_ID, BOS: BOS_ID, EOS: EOS_ID},
      framing="each file: <|bos|> tokens <|eos|>, concatenated in module-name order",
      corpus_key=key,
      train=split_summary(train_files, train_ids),
      heldout=split_summary(heldout_files, heldout_ids))
  with open(os.path.join(FLAGS.out, "split.json"), "w") as f:
    json.dump(report, f, indent=1)
    f.write("\n")

  print(f"stdlib {stdlib_dir()}: {len(files)} files listed in {t_list:.1f}s")
  for side in ("train", "heldout"):
    s = report[side]
    print(f"  {side:8s} {len(s['modules']):4d} modules {s['files']:5d} files "
          f"{s['bytes'] / 1e6:7.2f} MB {s['tokens']:9d} tokens "
          f"({s['bytes'] / max(s['tokens'], 1):.2f} bytes/token)")
  print(f"tokenizer: vocab {report['vocab_size']}, trained in {t_tok:.1f}s; "
        f"corpus encoded in {t_enc:.1f}s")
  print(f"wrote {FLAGS.out}/tokenizer.json, {FLAGS.out}/split.json, "
        f"{FLAGS.cache_dir}/{{train,heldout}}-{key}.npy")


def _define_flags() -> None:
  from absl import flags
  flags.DEFINE_string("out", None, "Directory for tokenizer.json and split.json.")
  flags.DEFINE_string("cache_dir", default_cache_dir(),
                      "Directory for the token arrays (train/heldout-<key>.npy).")
  flags.DEFINE_integer("vocab_size", 8192, "BPE vocabulary size, special tokens included.")


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main)
