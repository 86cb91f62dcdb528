"""Demo corpus (stdlib files, split, tokenizer, framing) and the n-gram baseline."""

import os

import numpy as np
import pytest

from checkpoints import demo_corpus as dc
from checkpoints import ngram_baseline as nb

TRICKY_TEXTS = [
    "",
    "def f(x):\n\treturn x  \n",                       # tab indent, trailing spaces
    "s = 'héllo wörld — 世界 🐍'\n",                    # multi-byte UTF-8
    "if a:\r\n    pass\r\n\r\n",                          # CRLF
    "x = 1   \t \n\n\n   ",                               # trailing whitespace, no final newline
    "\ufeff# BOM\n\x00\x7f\u200b zero-width\n",           # BOM, control chars
    "token = '<|bos|>' + \"<|eos|>\"  # specials as text\n",
    "        " * 10 + "deep()\n",
]


@pytest.fixture(scope="module")
def files():
  return dc.stdlib_files()


@pytest.fixture(scope="module")
def small_tokenizer(files):
  """A 512-token BPE trained on ~40 small train files (well under a second)."""
  train, _ = dc.split(files)
  small = sorted(train, key=lambda f: os.path.getsize(f[1]))[100:140]
  return dc.train_tokenizer(dc.read_texts(small), vocab_size=512)


def test_file_list_is_deterministic_and_clean(files):
  assert files == dc.stdlib_files()
  assert files == sorted(files) and len(files) > 300
  root = dc.stdlib_dir()
  for module, path in files:
    rel = os.path.relpath(path, root)
    assert rel.endswith(".py") and "__pycache__" not in rel
    assert not rel.startswith(("site-packages", "test" + os.sep, "idlelib/idle_test"))
    assert all(part.isidentifier() for part in module.split("."))
  modules = {m for m, _ in files}
  assert {"json", "asyncio.events", "collections"} <= modules
  assert "pydoc_data.topics" not in modules  # generated data module
  assert "encodings.cp1252" not in modules  # gencodec table
  assert "encodings.idna" in modules  # hand-written codec stays


def test_split_is_deterministic_disjoint_by_module(files):
  train, heldout = dc.split(files)
  assert (train, heldout) == dc.split(list(files))
  assert sorted(train + heldout) == files
  train_units = {dc.split_unit(m) for m, _ in train}
  heldout_units = {dc.split_unit(m) for m, _ in heldout}
  assert train_units.isdisjoint(heldout_units)
  assert 0.01 < len(heldout_units) / len(train_units | heldout_units) < 0.15
  # Depends only on the top-level name, e.g. a submodule lands with its package.
  assert dc.is_heldout("asyncio.events") == dc.is_heldout("asyncio")


def test_tokenizer_special_ids_and_round_trip(small_tokenizer, files):
  tok = small_tokenizer
  assert [tok.token_to_id(t) for t in dc.SPECIAL_TOKENS] == [0, 1, 2]
  assert tok.get_vocab_size() == 512
  # Ordinary encoding starts a prompt with BOS, like a training document; without special
  # tokens (the corpus framing) there is none.
  assert tok.encode("x = 1").ids[0] == dc.BOS_ID
  assert tok.encode("x = 1", add_special_tokens=False).ids[0] != dc.BOS_ID
  real = dc.read_texts(dc.split(files)[1][:5])
  for text in TRICKY_TEXTS + real:
    ids = dc.encode_documents(tok, [text])[1:-1].tolist()
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_training_is_deterministic(small_tokenizer, files):
  train, _ = dc.split(files)
  small = sorted(train, key=lambda f: os.path.getsize(f[1]))[100:140]
  again = dc.train_tokenizer(dc.read_texts(small), vocab_size=512)
  assert again.to_str() == small_tokenizer.to_str()


def test_encode_corpus_framing(small_tokenizer, tmp_path):
  texts = ["a = 1\n", "", "b = '<|eos|>'\n"]
  files = []
  for i, text in enumerate(texts):
    path = tmp_path / f"m{i}.py"
    path.write_bytes(text.encode("utf-8"))
    files.append((f"m{i}", str(path)))
  ids = dc.encode_corpus(small_tokenizer, files)
  assert ids.dtype == np.int32
  bos = np.flatnonzero(ids == dc.BOS_ID)
  eos = np.flatnonzero(ids == dc.EOS_ID)
  assert len(bos) == len(eos) == 3 and bos[0] == 0 and eos[-1] == ids.size - 1
  assert not (ids == dc.PAD_ID).any()
  for text, b, e in zip(texts, bos, eos):
    assert small_tokenizer.decode(ids[b + 1:e].tolist(), skip_special_tokens=False) == text


def test_tokenized_corpus_cache(small_tokenizer, files, tmp_path):
  train, heldout = dc.split(files)
  train, heldout = train[:3], heldout[:2]
  a = dc.tokenized_corpus(str(tmp_path), small_tokenizer, train, heldout)
  cached = sorted(os.listdir(tmp_path))
  assert len(cached) == 2
  b = dc.tokenized_corpus(str(tmp_path), small_tokenizer, train, heldout)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert sorted(os.listdir(tmp_path)) == cached  # reused, not rewritten under a new key
  np.testing.assert_array_equal(a[1], dc.encode_corpus(small_tokenizer, heldout))
  dc.tokenized_corpus(str(tmp_path), small_tokenizer, train[:2], heldout)
  assert len(os.listdir(tmp_path)) == 4  # another file list, another key


# --- n-gram baseline ---------------------------------------------------------------------


def _docs(rng, n_docs, length, vocab, bos=1, eos=2, low=3):
  """BOS doc EOS ... with uniform random ids in [low, vocab)."""
  out = []
  for _ in range(n_docs):
    out += [bos] + rng.integers(low, vocab, length).tolist() + [eos]
  return np.asarray(out, np.int32)


def _markov_docs(rng, table, n_docs, length, bos=1, eos=2):
  """Documents from a 3rd-order chain: next = table[prev3, prev2, prev1] (+ 10% noise)."""
  vocab = table.shape[0]
  out = []
  for _ in range(n_docs):
    doc = rng.integers(3, vocab, 3).tolist()
    for _ in range(length):
      nxt = table[doc[-3], doc[-2], doc[-1]]
      doc.append(int(nxt) if rng.random() > 0.1 else int(rng.integers(3, vocab)))
    out += [bos] + doc + [eos]
  return np.asarray(out, np.int32)


def test_ngram_probabilities_sum_to_one():
  rng = np.random.default_rng(0)
  vocab = 20
  train = _docs(rng, 30, 40, vocab)
  model = nb.KneserNeyLM(train, n=4, vocab_size=vocab)
  contexts = [[], [1], [1, 5], train[:10].tolist(), [7, 7, 7, 7], [3, 4, 2, 1, 19, 18]]
  for ctx in contexts:
    p = model.next_token_probs(ctx)
    assert p.shape == (vocab,) and (p > 0).all()
    np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-12)
    assert model.prob(ctx, 5) == pytest.approx(p[5])
  # Tokens before the last BOS belong to another document.
  np.testing.assert_allclose(model.next_token_probs([4, 9, 2, 1, 6]),
                             model.next_token_probs([1, 6]))
  # log_probs scores exactly the non-BOS positions, consistently with next_token_probs.
  held = np.array([1, 5, 6, 7, 2, 1, 8, 2], np.int32)
  logp = model.log_probs(held)
  assert logp.size == 6
  np.testing.assert_allclose(logp[2], np.log(model.prob([1, 5, 6], 7)))
  np.testing.assert_allclose(logp[4], np.log(model.prob([2, 1], 8)))


def test_ngram_repetitive_text_beats_random():
  rng = np.random.default_rng(1)
  vocab = 50
  pattern = [1] + list(range(10, 30)) * 20 + [2]
  train = np.asarray(pattern * 20, np.int32)
  repetitive = np.asarray(pattern * 2, np.int32)
  random = _docs(rng, 2, len(pattern) - 2, vocab)
  ce_rep = nb.ngram_cross_entropy(train, repetitive, n=4, vocab_size=vocab)
  ce_rand = nb.ngram_cross_entropy(train, random, n=4, vocab_size=vocab)
  assert ce_rep < 0.1 < np.log(vocab) < ce_rand


def test_four_gram_beats_unigram_on_markov_chain():
  rng = np.random.default_rng(2)
  vocab = 24
  table = rng.integers(3, vocab, (vocab, vocab, vocab))
  train = _markov_docs(rng, table, 200, 200)
  heldout = _markov_docs(rng, table, 20, 200)
  ce = {n: nb.ngram_cross_entropy(train, heldout, n=n, vocab_size=vocab) for n in (1, 2, 4)}
  assert ce[4] < ce[2] < ce[1]
  assert ce[4] < 0.6 * ce[1]
  result = nb.evaluate(train, heldout, n=4, vocab_size=vocab, heldout_bytes=1000)
  assert result["nats_per_token"] == pytest.approx(ce[4])
  assert result["tokens_scored"] == heldout.size - 20
