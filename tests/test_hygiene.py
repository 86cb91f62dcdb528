"""The repository's own rules, checked on its files: the linter passes, every declared dependency
is imported somewhere and every imported package is declared, no default or instruction names a
path on one machine, the reference environment is found inside the checkout, and every test
module keeps a test in the fast tier."""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Distribution -> the module it is imported as, where the two names differ.
IMPORT_NAMES = {
    "absl-py": "absl",
    "grpcio": "grpc",
    "grpcio-health-checking": "grpc_health",
    "grpcio-reflection": "grpc_reflection",
    "grpcio-tools": "grpc_tools",
    "orbax-checkpoint": "orbax.checkpoint",
    "pillow": "PIL",
    "prometheus-client": "prometheus_client",
    "protobuf": "google.protobuf",
    "pytest-xdist": "xdist",
    "pyyaml": "yaml",
}
# Tools used from CI's command line, not imported: each with what `.ci/run` must say.
TOOLS = {"ruff": "ruff check", "pytest-xdist": "pytest -q -n 2"}
# Declared but imported nowhere, temporarily, with the issue that settles it. An entry that is
# imported now, or no longer declared, fails the test below: drop it then. (Issue 50 emptied it:
# the model imports flax, and jax-triton is no longer declared.)
NOT_IMPORTED_YET: dict[str, str] = {}

# A path on one machine: a user's home, this workplace's folders, a scratch folder under /tmp.
MACHINE_PATH = re.compile(r"/work/|/home/|/Users/|/root/|/tmp/|venv311ref")
# Records of past runs (their machines' paths are part of the record), and this file.
MACHINE_PATH_EXEMPT = {"BENCHMARKS.md", "tests/test_hygiene.py"}


def _python_files() -> list[pathlib.Path]:
  return sorted(p for p in ROOT.rglob("*.py")
                if not any(part.startswith(".") or part in ("build", "dist")
                           for part in p.relative_to(ROOT).parts))


def _imported_modules() -> set[str]:
  found = set()
  for path in _python_files():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        found.add(node.module)
        found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return found


def _canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _declared() -> dict[str, str]:
  """{canonical distribution name: where pyproject.toml declares it}."""
  with open(ROOT / "pyproject.toml", "rb") as fh:
    project = tomllib.load(fh)["project"]
  groups = {"dependencies": project["dependencies"], **{
      f"optional-dependencies.{k}": v for k, v in project["optional-dependencies"].items()}}
  return {_canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group()): group
          for group, reqs in groups.items() for req in reqs}


def _import_name(dist: str) -> str:
  return IMPORT_NAMES.get(dist, dist.replace("-", "_"))


def _is_imported(module: str, imported: set[str]) -> bool:
  return any(m == module or m.startswith(module + ".") for m in imported)


def test_lint_passes():
  """`ruff check` as `.ci/run` runs it (rules in pyproject.toml)."""
  r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_ci_lints_before_testing():
  with open(ROOT / ".ci" / "run") as fh:
    ci = fh.read()
  assert 0 <= ci.index("ruff check") < ci.index("pytest -q -n 2"), ci


def _unused(declared: dict[str, str], imported: set[str], ci: str) -> tuple[list, list]:
  """(declared dependencies nothing uses, NOT_IMPORTED_YET entries to drop)."""
  unused, stale = [], []
  for dist, group in sorted(declared.items()):
    if dist in TOOLS:
      if TOOLS[dist] not in ci:
        unused.append(f"{dist} ({group}): a tool that .ci/run no longer runs ({TOOLS[dist]!r})")
    elif dist in NOT_IMPORTED_YET:
      if _is_imported(_import_name(dist), imported):
        stale.append(f"{dist} is imported now: drop it from NOT_IMPORTED_YET")
    elif not _is_imported(_import_name(dist), imported):
      unused.append(f"{dist} ({group}): `{_import_name(dist)}` is imported nowhere")
  stale += [f"{dist} is no longer declared: drop it from NOT_IMPORTED_YET"
            for dist in NOT_IMPORTED_YET if dist not in declared]
  return unused, stale


def test_declared_dependencies_are_imported():
  with open(ROOT / ".ci" / "run") as fh:
    ci = fh.read()
  unused, stale = _unused(_declared(), _imported_modules(), ci)
  assert not unused, "declared but never used (remove it, or use it):\n" + "\n".join(unused)
  assert not stale, "\n".join(stale)


# Imported but deliberately not declared, each with where it comes from.
UNDECLARED_IMPORTS = {
    "torch": "the reference environment (.venv-ref/, tests/golden/make_ref_env.sh) and the GPU "
             "image's peers stage",
    "transformers": "the reference environment",
    "torchvision": "the reference environment (--vision)",
    "compressed_tensors": "the reference environment",
    "triton": "the GPU image's peers stage (bench/protocol/peers.py skips without it)",
    "xgrammar": "bench/grammar_engines.py's optional comparison (skipped when absent)",
}


def _local_modules() -> set[str]:
  """Top-level names that are this checkout's own: its packages and the modules tests and
  scripts import by path."""
  names = {p.name for p in ROOT.iterdir() if p.is_dir()}
  return names | {p.stem for p in _python_files()}


def test_imported_packages_are_declared():
  """What the code imports from outside the standard library and the checkout is declared in
  pyproject.toml (or named above with its reason): nothing arrives only as another package's
  dependency."""
  owners = importlib.metadata.packages_distributions()
  declared = _declared()
  local = _local_modules()
  missing = []
  for module in sorted({m.split(".")[0] for m in _imported_modules()}):
    if module in sys.stdlib_module_names or module in local or module in UNDECLARED_IMPORTS:
      continue
    dists = {_canonical(d) for d in owners.get(module, [])}
    if not dists & set(declared):
      missing.append(f"{module} (installed by {sorted(dists) or 'nothing'})")
  assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(missing)


def test_import_names_match_the_installed_distributions():
  """The table above against the installed packages' own metadata, so that a wrong entry
  cannot make an unused dependency look used."""
  owners = importlib.metadata.packages_distributions()
  checked = 0
  for dist in _declared():
    try:
      importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
      continue  # not installed here (the CUDA extras)
    top = _import_name(dist).split(".")[0]
    assert dist in {_canonical(d) for d in owners.get(top, [])}, (dist, top)
    checked += 1
  assert checked >= 15


def test_the_dependency_check_finds_what_nothing_uses(monkeypatch):
  monkeypatch.setitem(IMPORT_NAMES, "jax-triton", "jax_triton")
  monkeypatch.setattr(sys.modules[__name__], "NOT_IMPORTED_YET",
                      {"flax": "issue 50", "jax-triton": "issue 50"})
  declared = {"pillow": "dependencies", "orbax-checkpoint": "dependencies", "flax": "dependencies",
              "jax-triton": "optional-dependencies.cuda12", "ruff": "optional-dependencies.test",
              "pytest-xdist": "optional-dependencies.test"}
  ci = "ruff check . && pytest -q -n 2"
  used = {"PIL.Image", "orbax.checkpoint"}
  assert _unused(declared, used, ci) == ([], [])
  unused, _ = _unused(declared, {"PIL", "orbax"}, "pytest -q -n 2")
  assert [u.split()[0] for u in unused] == ["orbax-checkpoint", "ruff"]
  _, stale = _unused({"flax": "dependencies"}, used | {"flax.nnx"}, ci)
  assert [s.split()[0] for s in stale] == ["flax", "jax-triton"]
  # With nothing allowed, a declared dependency nothing imports is reported.
  monkeypatch.setattr(sys.modules[__name__], "NOT_IMPORTED_YET", {})
  unused, _ = _unused({"flax": "dependencies"}, used, ci)
  assert [u.split()[0] for u in unused] == ["flax"]
  assert _unused({"flax": "dependencies"}, used | {"flax.nnx"}, ci) == ([], [])


def test_no_defaults_or_instructions_name_a_machine_path():
  tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
  if tracked.returncode != 0:
    pytest.skip("not a git checkout")
  bad = []
  for rel in tracked.stdout.split():
    if (rel in MACHINE_PATH_EXEMPT or not rel.endswith((".py", ".sh", ".md", ".toml"))
        or rel.startswith("checkpoints/demo/") or not os.path.isfile(ROOT / rel)):
      continue
    for n, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
      if MACHINE_PATH.search(line):
        bad.append(f"{rel}:{n}: {line.strip()}")
  assert not bad, ("paths on one machine (use the repository root, ~/.cache/moejax or a "
                   "required flag):\n" + "\n".join(bad))


def test_reference_environment_is_found_in_the_checkout(tmp_path):
  from checkpoints import ref_env
  assert ref_env.PYTHON == str(ROOT / ".venv-ref" / "bin" / "python")
  assert (ROOT / ref_env.MAKE_SCRIPT).is_file()
  with open(ROOT / ".gitignore") as fh:
    assert "/.venv-*/" in fh.read().split()
  missing = str(tmp_path / "no-such-env" / "bin" / "python")
  with pytest.raises(FileNotFoundError, match=re.escape(f"bash {ref_env.MAKE_SCRIPT}")):
    ref_env.require(missing)
  assert ref_env.require(sys.executable) == sys.executable


@pytest.mark.parametrize("module", ["bench.vs_transformers", "checkpoints.verify_hf_export"])
def test_transformers_commands_default_to_the_reference_environment(module, tmp_path):
  """Their --ref_python defaults to .venv-ref's interpreter and, missing, the run stops at once
  naming the script that builds it."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  r = subprocess.run([sys.executable, "-m", module, "--helpxml"], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=120)
  default = re.search(r"<name>ref_python</name>.*?<default>(.*?)</default>", r.stdout, re.S)
  assert default and default.group(1) == str(ROOT / ".venv-ref" / "bin" / "python"), r.stdout
  missing = tmp_path / "python"
  r = subprocess.run([sys.executable, "-m", module, f"--ref_python={missing}"], cwd=tmp_path,
                     env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert "tests/golden/make_ref_env.sh" in r.stderr, r.stderr[-3000:]


def test_every_test_module_keeps_a_fast_test():
  """The fast tier (`-m "not slow"`, as the README names it) runs at least one test of every
  tests/test_*.py."""
  with open(ROOT / "README.md") as fh:
    assert 'python -m pytest -q -n 2 -m "not slow"' in fh.read()
  r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                      "-p", "no:cacheprovider", "-m", "not slow", "tests"], cwd=ROOT,
                     env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
  fast = {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}
  modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
  assert fast <= modules
  assert not modules - fast, ("modules whose every test is marked slow (keep one in the fast "
                              f"tier): {sorted(modules - fast)}")


class _Item:
  """What the fast tier's collection hook reads of a collected test."""

  def __init__(self, name, case, sweep):
    self.path, self.originalname, self.marks = pathlib.Path("tests/test_x.py"), name, []
    self.callspec = None if case is None else {"case": case}
    self.sweep = sweep

  def get_closest_marker(self, name):
    return pytest.mark.sweep.mark if name == "sweep" and self.sweep else None

  def add_marker(self, mark):
    self.marks.append(mark.name)


def test_a_sweep_keeps_its_first_case_in_the_fast_tier():
  from conftest import pytest_collection_modifyitems
  items = [_Item("test_a", 0, True), _Item("test_a", 1, True), _Item("test_b", 0, False),
           _Item("test_b", 1, False), _Item("test_a", 2, True), _Item("test_c", None, True)]
  pytest_collection_modifyitems(None, items)
  assert [i.marks for i in items] == [[], ["slow"], [], [], ["slow"], []]
