"""Smoothed n-gram baseline for the demo model: interpolated modified Kneser-Ney over token ids.

    python -m checkpoints.ngram_baseline [--tokenizer=checkpoints/demo/tokenizer.json] \
        [--cache_dir=DIR] [--n=4]

Prints the held-out cross-entropy (nats/token, bits/byte) of an n-gram model trained on the
train side of the demo corpus split, the figure the trained models must beat.

Streams are documents framed as BOS tokens EOS, concatenated. N-grams never cross a document
boundary: context positions before the document's BOS hold a filler symbol (id vocab_size).
Every token that is not BOS is scored (EOS included); predicting BOS is not.

Counts are numpy arrays keyed by int64 n-gram codes (base vocab_size + 1, oldest token most
significant), found with np.unique and searchsorted: ~10M tokens fit in well under a minute
and a few hundred MB.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Sequence

import numpy as np

BOS_ID = 1  # matches checkpoints.demo_corpus.BOS_ID
_CHUNK = 1 << 21  # positions per batch when scoring, bounds temporary memory


def _doc_starts(ids: np.ndarray, bos_id: int) -> np.ndarray:
  """[len(ids)] int64: index of the last BOS at or before each position (0 if none)."""
  marks = np.where(ids == bos_id, np.arange(ids.size, dtype=np.int64), -1)
  return np.maximum(np.maximum.accumulate(marks), 0) if ids.size else marks


def _context_token(ids: np.ndarray, starts: np.ndarray, pos: np.ndarray, back: int,
                   filler: int) -> np.ndarray:
  """[len(pos)] int64: ids[pos - back], or `filler` where that is outside pos's document."""
  src = pos - back
  inside = src >= starts[pos]  # starts >= 0, so this also rules out src < 0
  return np.where(inside, ids[np.maximum(src, 0)], filler).astype(np.int64, copy=False)


def _discounts(counts: np.ndarray) -> np.ndarray:
  """[3] float64: modified-KN discounts D1, D2, D3+ (Chen & Goodman) from count-of-counts."""
  n = [np.count_nonzero(counts == k) for k in (1, 2, 3, 4)]
  y = n[0] / (n[0] + 2 * n[1]) if n[0] and n[1] else 0.5
  ds = []
  for k in (1, 2, 3):
    d = k - (k + 1) * y * n[k] / n[k - 1] if n[k - 1] else 0.5 * k
    # Keep 0 < D < k: every context keeps mass for its lower order and every seen n-gram
    # keeps some of its own; tiny corpora can otherwise give degenerate values.
    ds.append(min(max(d, 0.1), k - 0.1))
  return np.asarray(ds)


def _find(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(index, found) of `keys` in the sorted unique array `sorted_keys`."""
  if sorted_keys.size == 0:
    return np.zeros(keys.shape, np.int64), np.zeros(keys.shape, bool)
  idx = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
  return idx, sorted_keys[idx] == keys


class KneserNeyLM:
  """Interpolated modified Kneser-Ney n-gram model over token ids in [0, vocab_size).

  The highest order uses raw counts, lower orders continuation counts (distinct left
  extensions; raw counts for n-grams at a document start, which cannot be extended, as in
  KenLM). The unigram level interpolates with the uniform 1/vocab_size, so every token has
  nonzero probability and each conditional distribution sums to 1 over the vocabulary.
  """

  def __init__(self, train_ids: np.ndarray, n: int = 4, vocab_size: int | None = None,
               bos_id: int = BOS_ID):
    ids = np.asarray(train_ids, dtype=np.int64).ravel()
    if vocab_size is None:
      vocab_size = int(ids.max()) + 1 if ids.size else bos_id + 1
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"token ids must lie in [0, {vocab_size})")
    self.n, self.vocab_size, self.bos_id = n, vocab_size, bos_id
    self.filler = vocab_size  # "before the document start", never a real token
    self.base = vocab_size + 1
    if self.base ** n >= 2 ** 63:
      raise ValueError(f"{n}-grams over {vocab_size} ids do not fit int64 keys")

    # Highest order: raw counts of (context, token) over every non-BOS position.
    pos = np.flatnonzero(ids != bos_id)
    starts = _doc_starts(ids, bos_id)
    top = ids[pos]
    for back in range(1, n):
      top += _context_token(ids, starts, pos, back, self.filler) * self.base ** back
    del pos, starts
    keys, counts = np.unique(top, return_counts=True)
    del top
    # int32 counts: no count exceeds the number of tokens; halves the biggest arrays.
    self.keys = {n: keys}  # order -> sorted unique int64 keys
    self.counts = {n: counts.astype(np.int32)}  # order -> count of each key
    # Lower orders from the distinct (m+1)-gram types: each type is one left extension of
    # its m-gram suffix; a filler extension (document start) contributes its full count.
    for m in range(n - 1, 0, -1):
      higher, higher_counts = self.keys[m + 1], self.counts[m + 1]
      weight = np.where(higher // self.base ** m == self.filler, higher_counts, 1)
      keys, inverse = np.unique(higher % self.base ** m, return_inverse=True)
      self.keys[m] = keys
      self.counts[m] = np.bincount(inverse.ravel(), weights=weight,
                                   minlength=keys.size).astype(np.int32)
      del weight, inverse

    # Per order and context: total count and the interpolation weight of the lower order.
    self.discounts, self.ctx_keys, self.ctx_total, self.ctx_gamma = {}, {}, {}, {}
    for m in range(1, n + 1):
      keys, counts = self.keys[m], self.counts[m]
      d = _discounts(counts)
      ctx = keys // self.base  # sorted, since keys are
      ctx_keys, first_idx = np.unique(ctx, return_index=True)
      if ctx_keys.size:
        total = np.add.reduceat(counts.astype(np.int64), first_idx)
        n_by_count = [np.add.reduceat(sel.astype(np.int64), first_idx)
                      for sel in (counts == 1, counts == 2, counts >= 3)]
        gamma = (d[0] * n_by_count[0] + d[1] * n_by_count[1] + d[2] * n_by_count[2]) / total
      else:
        total, gamma = np.zeros(0, np.int64), np.zeros(0)
      self.discounts[m], self.ctx_keys[m] = d, ctx_keys
      self.ctx_total[m], self.ctx_gamma[m] = total, gamma

  def _prob(self, contexts: list[np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """[N] float64 P(token | context); contexts[k-1] is the token k back (filler if none)."""
    p = np.full(tokens.shape, 1.0 / self.vocab_size)
    key = tokens.astype(np.int64)
    for m in range(1, self.n + 1):
      if m > 1:
        key = key + contexts[m - 2] * self.base ** (m - 1)
      ci, has_ctx = _find(self.ctx_keys[m], key // self.base)
      if not has_ctx.any():
        continue
      gi, seen = _find(self.keys[m], key)
      count = np.where(seen, self.counts[m][gi], 0)
      discount = self.discounts[m][np.clip(count, 1, 3) - 1] * (count > 0)
      p_here = ((count - discount) / np.maximum(self.ctx_total[m][ci], 1)
                + self.ctx_gamma[m][ci] * p)
      p = np.where(has_ctx, p_here, p)  # an unseen context backs off entirely
    return p

  def next_token_probs(self, context: Sequence[int]) -> np.ndarray:
    """[vocab_size] float64 distribution of the token after `context`.

    Tokens before the last BOS in `context` belong to an earlier document and are ignored;
    a context shorter than n-1 tokens is read as the start of a document.
    """
    context = [int(t) for t in context]
    if self.bos_id in context:
      context = context[len(context) - 1 - context[::-1].index(self.bos_id):]
    recent = context[::-1][: self.n - 1]
    recent += [self.filler] * (self.n - 1 - len(recent))
    tokens = np.arange(self.vocab_size, dtype=np.int64)
    contexts = [np.full(tokens.shape, t, np.int64) for t in recent]
    return self._prob(contexts, tokens)

  def prob(self, context: Sequence[int], token: int) -> float:
    """P(token | context), with `context` read as in next_token_probs."""
    return float(self.next_token_probs(context)[token])

  def log_probs(self, ids: np.ndarray) -> np.ndarray:
    """[number of non-BOS positions] float64 natural-log probabilities of those tokens."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
    starts = _doc_starts(ids, self.bos_id)
    scored = np.flatnonzero(ids != self.bos_id)
    out = np.empty(scored.size)
    for lo in range(0, scored.size, _CHUNK):
      pos = scored[lo:lo + _CHUNK]
      contexts = [_context_token(ids, starts, pos, back, self.filler)
                  for back in range(1, self.n)]
      out[lo:lo + _CHUNK] = np.log(self._prob(contexts, ids[pos]))
    return out


def ngram_cross_entropy(train_ids: np.ndarray, heldout_ids: np.ndarray, n: int = 4,
                        vocab_size: int | None = None, bos_id: int = BOS_ID) -> float:
  """Mean nats/token of an n-gram model fit on `train_ids`, over non-BOS `heldout_ids`.

  Pass the tokenizer's vocab_size: the uniform floor (1/vocab_size) depends on it. When
  None it is inferred as the largest id seen plus one.
  """
  if vocab_size is None:
    vocab_size = int(max(np.max(train_ids), np.max(heldout_ids))) + 1
  model = KneserNeyLM(train_ids, n=n, vocab_size=vocab_size, bos_id=bos_id)
  return float(-model.log_probs(heldout_ids).mean())


def evaluate(train_ids: np.ndarray, heldout_ids: np.ndarray, n: int = 4,
             vocab_size: int | None = None, heldout_bytes: int | None = None,
             bos_id: int = BOS_ID) -> dict:
  """{"n", "nats_per_token", "tokens_scored", "bits_per_byte" (if bytes given), "fit_s",
  "eval_s"} for the report."""
  if vocab_size is None:
    vocab_size = int(max(np.max(train_ids), np.max(heldout_ids))) + 1
  t0 = time.time()
  model = KneserNeyLM(train_ids, n=n, vocab_size=vocab_size, bos_id=bos_id)
  t1 = time.time()
  logp = model.log_probs(heldout_ids)
  result = dict(n=n, nats_per_token=float(-logp.mean()), tokens_scored=int(logp.size),
                fit_s=t1 - t0, eval_s=time.time() - t1)
  if heldout_bytes:
    result["bits_per_byte"] = float(-logp.sum() / heldout_bytes / math.log(2))
  return result


def main(argv: list[str]) -> None:
  from absl import flags

  from checkpoints import demo_corpus

  del argv
  FLAGS = flags.FLAGS
  tokenizer = demo_corpus.load_tokenizer(FLAGS.tokenizer)
  train_files, heldout_files = demo_corpus.split(demo_corpus.stdlib_files())
  t0 = time.time()
  train_ids, heldout_ids = demo_corpus.tokenized_corpus(FLAGS.cache_dir, tokenizer,
                                                        train_files, heldout_files)
  t_load = time.time() - t0
  heldout_bytes = sum(os.path.getsize(p) for _, p in heldout_files)
  print(f"corpus: {train_ids.size} train / {heldout_ids.size} held-out tokens "
        f"(loaded or encoded in {t_load:.1f}s)")
  for n in FLAGS.orders:
    r = evaluate(train_ids, heldout_ids, n=int(n), vocab_size=tokenizer.get_vocab_size(),
                 heldout_bytes=heldout_bytes)
    print(f"{r['n']}-gram modified Kneser-Ney: held-out {r['nats_per_token']:.4f} nats/token, "
          f"{r['bits_per_byte']:.4f} bits/byte over {r['tokens_scored']} tokens "
          f"(fit {r['fit_s']:.1f}s, eval {r['eval_s']:.1f}s)")
  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"peak RSS {peak_mb:.0f} MB")


def _define_flags() -> None:
  from absl import flags

  from checkpoints import demo_corpus
  flags.DEFINE_string("tokenizer", "checkpoints/demo/tokenizer.json", "tokenizer.json path.")
  flags.DEFINE_string("cache_dir", demo_corpus.default_cache_dir(), "Token array cache directory.")
  flags.DEFINE_list("orders", ["4"], "n-gram orders to evaluate, e.g. 1,2,3,4.")


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main)
