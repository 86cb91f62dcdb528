"""Where the reference environment lives: Python 3.11 with a CPU torch and transformers, kept out
of this project's environment. `bash tests/golden/make_ref_env.sh` builds it into `.venv-ref/` at
the repository root; the commands that run transformers (`checkpoints.verify_hf_export`,
`bench.vs_transformers`) default to its interpreter and name that script when it is missing.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE_SCRIPT = "tests/golden/make_ref_env.sh"
PYTHON = os.path.join(ROOT, ".venv-ref", "bin", "python")


def require(python: str) -> str:
  """`python` if it is an interpreter, else a FileNotFoundError saying how to build one."""
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    raise FileNotFoundError(
        f"no reference interpreter at {python}: build the reference environment (Python 3.11, "
        f"CPU torch, transformers) with `bash {MAKE_SCRIPT}` from the repository root, or pass "
        "--ref_python=<its python>")
  return python
