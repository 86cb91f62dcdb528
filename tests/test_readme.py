"""The README's and the docs pages' commands and code blocks, as a newcomer types them.

Every ```python block compiles; every `python -m MODULE --flag` of a ```bash block names a module
that exists and flags it defines; every repository path a command names exists; every relative
link resolves. The Python blocks that talk to the demo server run as written against one (the
addresses they name replaced by its ports), and the README's notebook block runs in a fresh
process. A Python block that runs nowhere must say why in NOT_RUN."""

import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = pathlib.Path(REPO)
DOCUMENTS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


class Block(NamedTuple):
  path: str  # the document, relative to the repository
  heading: str  # the nearest heading above the block, without its #s
  lang: str
  code: str
  line: int


def blocks(path: str) -> list[Block]:
  """The fenced code blocks of one document, with the heading each sits under."""
  found, heading, lang, code, start = [], "", None, [], 0
  for n, line in enumerate((ROOT / path).read_text().splitlines(), 1):
    if lang is None and line.startswith("#"):
      heading = line.lstrip("#").strip()
    elif lang is None and line.startswith("```"):
      lang, code, start = line[3:].strip(), [], n
    elif lang is not None and line.startswith("```"):
      found.append(Block(path, heading, lang, "\n".join(code) + "\n", start))
      lang = None
    elif lang is not None:
      code.append(line)
  assert lang is None, f"{path}: a code block opened at line {start} is never closed"
  return found


def all_blocks(lang: str) -> list[Block]:
  return [b for path in DOCUMENTS for b in blocks(path) if b.lang == lang]


def block(path: str, heading: str, lang: str = "python", index: int = 0) -> str:
  """The `index`-th block of `lang` under the heading `heading` of document `path`."""
  found = [b for b in blocks(path) if b.heading == heading and b.lang == lang]
  assert len(found) > index, f"{path}: no {lang} block #{index} under '{heading}'"
  return found[index].code


def readme_block(after: str) -> str:
  """The README's first ```python block under the heading `after`."""
  return block("README.md", after)


# Python blocks run against the demo server (test_docs_examples_run_against_the_demo_server),
# as a notebook (test_notebook_snippet_runs_as_written) or in their own process.
RUN_AGAINST_SERVER = [
    ("README.md", "The OpenAI-compatible HTTP API"),
    ("docs/http-api.md", "Chat completions and completions"),
    ("docs/http-api.md", "Agent protocols: the Responses and Messages APIs"),
    ("docs/serving.md", "Clients"),
    ("docs/structured-outputs.md", "Over HTTP"),
    ("docs/structured-outputs.md", "Over gRPC"),
]
RUN_ALONE = [
    ("README.md", "Notebook"),
    ("docs/speculative-decoding.md", "Command line and Python"),
    ("docs/structured-outputs.md", "In Python"),
    ("docs/python.md", "The notebook API"),
    ("docs/python.md", "Tokenizers and chat templates"),
]
# Python blocks no test can run here, and why (they still compile).
NOT_RUN = {
    ("docs/images.md", "Images (Kimi K2.5)"): "needs a checkpoint with a vision tower",
}


def test_every_python_block_compiles_and_is_run_or_says_why():
  covered = set(RUN_AGAINST_SERVER) | set(RUN_ALONE) | set(NOT_RUN)
  for b in all_blocks("python"):
    compile(b.code, f"{b.path}:{b.line}", "exec")
    assert (b.path, b.heading) in covered, (
        f"{b.path}:{b.line} (under '{b.heading}'): run this block in a test or list it in "
        "NOT_RUN with the reason")
  present = {(b.path, b.heading) for b in all_blocks("python")}
  assert covered <= present, f"listed but gone: {sorted(covered - present)}"


def test_every_fenced_block_names_its_language():
  for path in DOCUMENTS:
    for b in blocks(path):
      assert b.lang, f"{path}:{b.line}: a fenced block without a language"


def _commands(code: str) -> list[str]:
  """The shell commands of a bash block: continuation lines joined, comments dropped, split at
  `&&`, `;` and pipes."""
  joined = re.sub(r"\\\n\s*", " ", code)
  out = []
  for line in joined.splitlines():
    line = re.sub(r"(^|\s)#.*", "", line)
    out += [c.strip() for c in re.split(r"&&|;|\|", line) if c.strip()]
  return out


def _python_m_commands() -> list[tuple[Block, str, list[str]]]:
  """(block, module, flag names) of every `python -m MODULE ...` in a bash block."""
  found = []
  for b in all_blocks("bash"):
    for cmd in _commands(b.code):
      m = re.search(r"(?:^|\s|/)python3?\s+-m\s+([\w.]+)(.*)$", cmd)
      if m:
        names = re.findall(r"(?:^|\s)--([A-Za-z_][\w]*)", m.group(2).split(">")[0])
        found.append((b, m.group(1), names))
  return found


@functools.cache
def _flags_of(module: str) -> frozenset[str]:
  """The absl flags a command line defines, as its `--helpfull` lists them."""
  r = subprocess.run([sys.executable, "-m", module, "--helpfull"], cwd=REPO,
                     env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=300)
  names = re.findall(r"^\s+--(?:\[no\])?(\w+)", r.stdout + r.stderr, re.M)
  assert names, f"python -m {module} --helpfull listed no flags:\n{r.stderr[-2000:]}"
  return frozenset(names)


# Command lines whose flags are not absl's (their own parsers): only the module is checked.
NOT_ABSL = {"venv", "pip", "pytest"}


def test_python_m_commands_name_real_modules_and_flags():
  import importlib.util
  commands = _python_m_commands()
  assert any(mod == "engine.serve" for _, mod, _ in commands)
  for b, module, _ in commands:
    assert importlib.util.find_spec(module) is not None, f"{b.path}:{b.line}: no module {module}"
  ours = sorted({mod for _, mod, _ in commands if mod.split(".")[0] not in NOT_ABSL})
  with ThreadPoolExecutor(2) as pool:  # each a subprocess: the flags of one command line
    defined = dict(zip(ours, pool.map(_flags_of, ours)))
  for b, module, names in commands:
    if module in defined:
      unknown = sorted(set(names) - defined[module] - {"helpfull", "help"})
      assert not unknown, f"{b.path}:{b.line}: python -m {module} has no flag {unknown}"


# A repository path in a command: a file under one of the repository's folders.
REPO_PATH = re.compile(r"(?<![\w./$~-])((?:deploy|tests|checkpoints|bench|engine|proto|docs|\.ci)/"
                       r"[\w./-]*\w)")


def test_paths_in_commands_exist():
  made = {"checkpoints/demo/hf_parity.json"}  # written by the command that names it
  for b in all_blocks("bash"):
    for cmd in _commands(b.code):
      for path in REPO_PATH.findall(cmd):
        if path not in made and "=" not in path:
          assert (ROOT / path).exists(), f"{b.path}:{b.line}: {path} does not exist"


def test_relative_links_resolve():
  for path in DOCUMENTS + ["WORKSPACE.md", "BENCHMARKS.md"]:
    text = (ROOT / path).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target) or target.startswith("#") or not re.search(r"[./]", target):
        continue  # a URL, an anchor, or not a link at all (formula text: "E[tau](K)")
      resolved = (ROOT / path).parent / target.split("#")[0]
      assert resolved.exists(), f"{path}: the link {target} resolves to nothing"


# A reference to a BENCHMARKS section by its name: BENCHMARKS.md, "name" (or 'name').
BENCH_REF = re.compile(r"""BENCHMARKS(?:\.md)?(?:[,\s(]*"([^"]{4,})"|[,\s(]+'([^']{4,})'(?=[)\s.,]))""")


def test_references_to_benchmarks_sections_resolve():
  """Code and documents cite figures as BENCHMARKS.md, "section": the name must still be in
  BENCHMARKS.md (or in docs/design/gpu-predictions.md, where the predictions went)."""
  here = pathlib.Path(__file__).resolve()
  targets = " ".join(re.sub(r"\s+", " ", (ROOT / p).read_text()).lower()
                     for p in ("BENCHMARKS.md", "docs/design/gpu-predictions.md"))
  files = [p for p in ROOT.rglob("*.py") if p != here
           and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
  files += [ROOT / p for p in DOCUMENTS + ["WORKSPACE.md"]]
  found = 0
  for path in files:
    text = re.sub(r"\s+", " ", re.sub(r"\n\s*#\s*", " ", path.read_text()))
    for m in BENCH_REF.finditer(text):
      name = (m.group(1) or m.group(2)).lower()
      found += 1
      assert name in targets, f"{path.relative_to(ROOT)} cites BENCHMARKS \"{name}\": no such text"
  assert found >= 10


def test_readme_test_command_is_ci():
  """The README's second command is what CI runs, verbatim (`.ci/run`)."""
  ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
  assert ci in block("README.md", "Two commands", "bash").splitlines()


def _run_python(code: str, cwd, timeout: int = 600) -> str:
  # From another directory: a block must not depend on the working directory.
  r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                     timeout=timeout, env=dict(os.environ, PYTHONPATH=REPO))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert r.stdout.strip(), "the block prints its outputs"
  return r.stdout


@pytest.mark.slow
def test_notebook_snippet_runs_as_written(tmp_path):
  code = readme_block("Notebook")
  assert "engine.load()" in code
  _run_python(code, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("where", [w for w in RUN_ALONE if w != ("README.md", "Notebook")],
                         ids=lambda w: f"{w[0]}:{w[1]}")
def test_docs_blocks_run_as_written(where, tmp_path):
  _run_python(block(*where), tmp_path)


@pytest.fixture(scope="module")
def demo_server():
  """The demo model served as the README's first command serves it (gRPC and HTTP)."""
  import engine
  from engine.service.background import BackgroundServer
  from engine.service.server import ServerConfig
  model = engine.load()
  eng = engine.Engine.from_model(model, engine.EngineConfig(
      max_num_seqs=4, max_num_batched_tokens=32, row_widths=(32,), max_model_len=128,
      max_decode_steps=4))
  with BackgroundServer(eng, ServerConfig(port=0, http_port=0, warmup=False, model_name="target",
                                          stats_log_interval_s=0)) as bg:
    yield bg


def _here(code: str, bg) -> str:
  """A block with the addresses it names replaced by the demo server's."""
  return (code.replace("localhost:8000", f"127.0.0.1:{bg.server.http_port}")
          .replace("127.0.0.1:50051", f"127.0.0.1:{bg.port}"))


def _run_bash(code: str) -> str:
  r = subprocess.run(["bash", "-ec", code], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  return r.stdout


def test_openai_http_examples_run_as_written(demo_server, tmp_path):
  """The README's curl and openai client examples against the demo model served as the first
  command serves it (the port the examples name is the one this server got)."""
  where = "The OpenAI-compatible HTTP API"
  if shutil.which("curl"):  # the shell examples where curl is installed
    out = _run_bash(_here(block("README.md", where, "bash"), demo_server))
    reply, end = json.JSONDecoder().raw_decode(out)  # then the stream's events
    assert out[end:].lstrip().startswith("data: {")
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert out.rstrip().endswith("data: [DONE]")
  out = _run_python(_here(readme_block(where), demo_server), tmp_path, 300)
  assert "completion_tokens=" in out  # the reply's usage and the stream's last chunk


@pytest.mark.slow
def test_docs_examples_run_against_the_demo_server(demo_server, tmp_path):
  """Every docs page's examples against the demo server: the Python blocks run as written,
  and the shell blocks that name the server's address (curl) answer what they should."""
  for path, heading in RUN_AGAINST_SERVER[1:]:
    out = _run_python(_here(block(path, heading), demo_server), tmp_path, 300)
    if heading.startswith("Agent protocols"):
      assert "end_turn" in out or "max_tokens" in out  # the Messages reply's stop reason
  if not shutil.which("curl"):
    return
  for path in DOCUMENTS[1:]:
    for b in blocks(path):
      if b.lang == "bash" and "localhost:8000" in b.code:
        out = _run_bash(_here(b.code, demo_server))
        replies = []
        decoder, rest = json.JSONDecoder(), out.strip()
        while rest:
          reply, end = decoder.raw_decode(rest)
          replies.append(reply)
          rest = rest[end:].strip()
        assert replies and not any("error" in r for r in replies), (b.path, b.line, out[-2000:])
        if "structured_outputs" in b.code:
          assert replies[0]["choices"][0]["text"] in ("os", "sys")
