"""Prompts shared by the speculative-decoding benchmarks (`speculative.py`, `spec_serving.py`).

* FRESH: short code openings the model continues freely (little to copy);
* `agent_turn`: a later turn that resends the conversation (the prompt, the model's answer, a
  blank line, the prompt again), so the answer repeats earlier context.
"""

from __future__ import annotations

from typing import Any, Sequence

FRESH = ["def read_config(path):\n", "class Point:\n    def __init__(self, x, y):\n",
         "import os\nimport sys\n\n\ndef main(argv):\n", "    for i, item in enumerate(items):\n",
         "def parse_args():\n    parser = argparse.ArgumentParser(", "    @property\n    def name",
         "def merge(a, b):\n", "with open(path) as fh:\n"]


def agent_turn(model: Any, prompt: str, prompt_ids: Sequence[int],
               answer_ids: Sequence[int]) -> list[int]:
  """The token ids of the turn that resends `prompt` after its answer."""
  return list(prompt_ids) + list(answer_ids) + model.encode("\n\n" + prompt)
