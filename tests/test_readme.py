"""The README's commands as a newcomer types them."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(after: str) -> str:
  """The first ```python block after the line starting with `after`."""
  with open(os.path.join(REPO, "README.md")) as fh:
    text = fh.read()
  start = text.index("\n" + after)
  return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


@pytest.mark.slow
def test_notebook_snippet_runs_as_written(tmp_path):
  code = readme_block("Notebook")
  assert "engine.load()" in code
  # From another directory: the snippet must not depend on the working directory.
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.strip(), "the snippet prints its outputs"


def readme_bash_block(after: str) -> str:
  """The first ```bash block after the line starting with `after`."""
  with open(os.path.join(REPO, "README.md")) as fh:
    text = fh.read()
  start = text.index("\n" + after)
  return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def test_openai_http_examples_run_as_written(tmp_path):
  """The README's curl and openai client examples against the demo model served as the first
  command serves it (the port the examples name is the one this server got)."""
  import engine
  from engine.service.background import BackgroundServer
  from engine.service.server import ServerConfig
  model = engine.load()
  eng = engine.Engine.from_model(model, engine.EngineConfig(
      max_num_seqs=4, max_num_batched_tokens=32, row_widths=(32,), max_model_len=128,
      max_decode_steps=4))
  with BackgroundServer(eng, ServerConfig(port=0, http_port=0, warmup=False, model_name="target",
                                          stats_log_interval_s=0)) as bg:
    here = f"127.0.0.1:{bg.server.http_port}"
    if shutil.which("curl"):  # the shell examples where curl is installed
      curl = readme_bash_block("### OpenAI-compatible HTTP API").replace("localhost:8000", here)
      r = subprocess.run(["bash", "-ec", curl], capture_output=True, text=True, timeout=300)
      assert r.returncode == 0, r.stderr
      reply, end = json.JSONDecoder().raw_decode(r.stdout)  # then the stream's events
      assert r.stdout[end:].lstrip().startswith("data: {")
      assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
      assert r.stdout.rstrip().endswith("data: [DONE]")
    code = readme_block("### OpenAI-compatible HTTP API").replace("localhost:8000", here)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "completion_tokens=" in r.stdout  # the reply's usage and the stream's last chunk
