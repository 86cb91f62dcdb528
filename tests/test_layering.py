"""Layers import only downward (pallas_kernels <- engine.model <- engine.runtime <- engine.chat <-
engine.service) and no library code imports jax's private `jax._src`: checked on the source, no
imports run."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each layer and the packages above it that it must not import.
LAYERS = {
    "pallas_kernels": ("engine",),
    "engine/model": ("engine.runtime", "engine.chat", "engine.service", "engine.api"),
    "engine/runtime": ("engine.chat", "engine.service", "engine.api"),
    "engine/chat": ("engine.service", "engine.api"),
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.append((node.lineno, node.module))
  return found


def _sources(folder: str) -> list[pathlib.Path]:
  return sorted(p for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name)


def _is_under(module: str, package: str) -> bool:
  return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_imports_only_downward(layer):
  assert _sources(layer), f"no sources under {layer}"
  bad = [f"{p.relative_to(ROOT)}:{line} imports {module}"
         for p in _sources(layer) for line, module in _imports(p)
         if any(_is_under(module, above) for above in LAYERS[layer])]
  assert not bad, "\n".join(bad)


def test_library_code_avoids_private_jax():
  bad = [f"{p.relative_to(ROOT)}:{line} imports {module}"
         for folder in ("pallas_kernels", "engine") for p in _sources(folder)
         for line, module in _imports(p) if _is_under(module, "jax._src")]
  assert not bad, "\n".join(bad)
