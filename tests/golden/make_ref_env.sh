#!/usr/bin/env bash
# Builds the reference environment: Python 3.11 with a CPU torch and Hugging Face transformers,
# kept out of this project's environment (torch never enters it). The golden fixtures'
# generators (tests/golden/make_*.py, hf_logits.py), `python -m checkpoints.verify_hf_export`
# and `python -m bench.vs_transformers` run under it and find it at `.venv-ref/` in the
# repository root by default (checkpoints/ref_env.py).
#
#   bash tests/golden/make_ref_env.sh           # -> .venv-ref/ (about 1 GB)
#   bash tests/golden/make_ref_env.sh --vision  # and torchvision, for make_golden_k25_vision.py
#
# What the committed fixtures were made with: Python 3.11, torch 2.13.0+cpu, transformers
# 5.24.0, compressed-tensors 0.20.1, tokenizers 0.23.3, numpy 2.4.6, safetensors, tiktoken.
# --vision adds pillow, and PyPI's torchvision 0.28.0 outside the venv, in .venv-ref/torchvision/
# (its C extension does not load beside a CPU torch; make_golden_k25_vision.py explains why it
# does not need it): run that generator with PYTHONPATH=.venv-ref/torchvision.
#
# Environment: PYTHON, a Python 3.11 interpreter (default python3.11); REF_ENV, where to build
# (default <repo>/.venv-ref; an existing one is reused); TORCH_INDEX_URL, an index for the CPU
# torch wheel (https://download.pytorch.org/whl/cpu) where plain `pip install torch==2.13.0`
# would take PyPI's CUDA build.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3.11}
REF_ENV=${REF_ENV:-$ROOT/.venv-ref}
vision=0
for arg in "$@"; do
  case $arg in
    --vision) vision=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "make_ref_env.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "make_ref_env.sh: '$PYTHON' is not a Python 3.11 interpreter; set PYTHON=..." >&2
  exit 1
fi

"$PYTHON" -m venv "$REF_ENV"
pip=("$REF_ENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned, so that nothing after it asks for another (a CUDA build of several GB).
"${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
"${pip[@]}" transformers==5.24.0 compressed-tensors==0.20.1 safetensors numpy tokenizers tiktoken
if [ "$vision" = 1 ]; then
  "${pip[@]}" pillow  # the test images (vision_images.py) and torchvision's imports
  "${pip[@]}" --no-deps --upgrade --target "$REF_ENV/torchvision" torchvision==0.28.0
fi

"$REF_ENV/bin/python" - <<'EOF'
import sys
import compressed_tensors
import tokenizers
import torch
import transformers
build = "CPU" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
print(f"reference environment: Python {sys.version.split()[0]}, torch {torch.__version__} "
      f"({build}), transformers {transformers.__version__}, compressed-tensors "
      f"{compressed_tensors.__version__}, tokenizers {tokenizers.__version__}")
if torch.version.cuda is not None:
  print("warning: a CUDA build of torch; the fixtures were made with the CPU build "
        "(set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)", file=sys.stderr)
EOF
echo "ready: $REF_ENV/bin/python"
