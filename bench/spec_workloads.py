"""Prompts shared by the speculative-decoding benchmarks (`speculative.py`, `spec_serving.py`,
`spec_constants.py`).

* FRESH: short code openings the model continues freely (little to copy); `fresh_prompts`
  adds held-out openings for batches past its 8;
* `agent_turn`: a later turn that resends the conversation (the prompt, the model's answer, a
  blank line, the prompt again), so the answer repeats earlier context; `agent_turns` makes
  them for a batch of prompts with the model's greedy answers (after a `document`, if asked);
* `novel_prompts`: a new batch of code from modules the demo model never trained on (the demo
  corpus's held-out side) for every pass: traffic neither the model nor a learned table has
  seen, where FRESH repeated across passes becomes draftable.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Sequence

FRESH = ["def read_config(path):\n", "class Point:\n    def __init__(self, x, y):\n",
         "import os\nimport sys\n\n\ndef main(argv):\n", "    for i, item in enumerate(items):\n",
         "def parse_args():\n    parser = argparse.ArgumentParser(", "    @property\n    def name",
         "def merge(a, b):\n", "with open(path) as fh:\n"]


def fresh_prompts(model: Any, n: int) -> list[str]:
  """n fresh prompts: FRESH, then (past its 8) openings of 16 tokens of held-out code
  (`novel_prompts`; no prompt twice in a batch, so no row copies another's answer)."""
  extra = novel_prompts(model, max(n - len(FRESH), 0), 0, tokens=16) if n > len(FRESH) else []
  return FRESH[:n] + [model.decode(ids[1:]) for ids in extra]


def agent_turn(model: Any, prompt: str, prompt_ids: Sequence[int],
               answer_ids: Sequence[int]) -> list[int]:
  """The token ids of the turn that resends `prompt` after its answer."""
  return list(prompt_ids) + list(answer_ids) + model.encode("\n\n" + prompt)


@functools.lru_cache(maxsize=1)
def _heldout_lines() -> tuple[str, ...]:
  """The lines of the demo corpus's held-out modules (the running interpreter's stdlib)."""
  from checkpoints import demo_corpus
  _, heldout = demo_corpus.split(demo_corpus.stdlib_files())
  return tuple(line for text in demo_corpus.read_texts(heldout) for line in text.split("\n"))


def novel_prompts(model: Any, n: int, batch: int, tokens: int = 48) -> list[list[int]]:
  """n prompts of `tokens` token ids each (BOS first), the batch-th of a seeded sequence of
  batches: windows of held-out stdlib code starting at a non-blank line drawn at random (a
  window shared by two batches is rare: ~20k lines)."""
  lines = _heldout_lines()
  rng = random.Random(batch)
  out = []
  while len(out) < n:
    start = rng.randrange(len(lines) - 64)
    if not lines[start].strip():
      continue
    ids = model.encode("\n".join(lines[start:start + 64]))[:tokens]
    if len(ids) == tokens:
      out.append(ids)
  return out


def document(model: Any, i: int, n: int) -> list[int]:
  """About n token ids of held-out stdlib code (whole lines from a seeded random line), the
  i-th of a seeded sequence: the long context an agent's turn carries."""
  lines = _heldout_lines()
  rng = random.Random(1000 + i)
  start, text = rng.randrange(len(lines) // 2), ""
  ids: list[int] = []
  while len(ids) < n and start < len(lines):
    text += lines[start] + "\n"
    start += 1
    if start % 16 == 0:  # (encoding the whole text every line would be quadratic)
      ids = model.encode(text)
  return model.encode(text)[:n]


def agent_turns(model: Any, prompts: list[str], max_new: int, context: int = 0
                ) -> list[list[int]]:
  """Each prompt's second turn: the first (after `context` tokens of a document, when asked)
  with its greedy answer, then the prompt again."""
  import engine
  first = [model.encode(p) for p in prompts]
  if context:  # (the document's BOS starts the sequence: the prompt's is dropped)
    first = [document(model, i, context) + ids[1:] for i, ids in enumerate(first)]
  answers = engine.generate(model, first, max_new_tokens=max_new, ignore_eos=True)
  return [agent_turn(model, p, ids, a.token_ids) for ids, a, p in
          zip(first, answers, prompts)]
