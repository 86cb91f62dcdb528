"""The README's commands as a newcomer types them."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(after: str) -> str:
  """The first ```python block after the line starting with `after`."""
  with open(os.path.join(REPO, "README.md")) as fh:
    text = fh.read()
  start = text.index("\n" + after)
  return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_notebook_snippet_runs_as_written(tmp_path):
  code = readme_block("Notebook")
  assert "engine.load()" in code
  # From another directory: the snippet must not depend on the working directory.
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.strip(), "the snippet prints its outputs"
