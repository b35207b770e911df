"""Decode and prompt speed of this tree's runtime against an earlier commit's, in one run.

The earlier commit is checked out with ``git worktree`` into a temporary folder and imported
through a folder of links laid out as ``pyproject.toml``'s ``package-dir`` says (so the installed
llmopt is not touched). Each measurement is a child process (``single_stream``: pp512 and tg128,
one request at a time, 2 threads) for one (code, checkpoint) pair; the two codes alternate over
``--rounds`` interleaved rounds and the median over rounds is reported. A checkpoint the earlier
code cannot load is reported as such, not dropped.

    .venv/bin/python bench/runtime_regression.py --baseline b0c8853 --model demo --model out/bench-e2e/W4A16_g32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_name, log

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CODE = ("compress", "quant", "prune", "distill", "runtime", "recipes", "pyproject.toml")  # what the comparison is about
CHILD = """
import json, sys, torch
from llmopt.runtime import LLMEngine
from llmopt.runtime.bench import single_stream
torch.set_num_threads({threads})
engine = LLMEngine({model!r}, threads={threads})
r = single_stream(engine, pp={pp}, tg={tg}, repetitions={reps})
print("RESULT " + json.dumps({{"pp": r["pp{pp}_tok_s"], "tg": r["tg{tg}_tok_s"]}}))
"""


def package_dirs(tree: Path) -> dict[str, str]:
    """``package-dir`` of ``tree``'s pyproject.toml: import name -> folder."""
    import tomllib

    project = tomllib.loads((tree / "pyproject.toml").read_text())
    return project["tool"]["setuptools"]["package-dir"]


def link_site(tree: Path, site: Path) -> None:
    """A folder importable as ``llmopt`` whose packages are links into ``tree``."""
    dirs = package_dirs(tree)
    top = site / "llmopt"
    top.mkdir(parents=True)
    for entry in (tree / dirs["llmopt"]).iterdir():
        (top / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name != "llmopt":
            link = top / name.split(".", 1)[1]
            if link.exists() or link.is_symlink():
                link.unlink()
            link.symlink_to(tree / folder)


def measure(python: str, pythonpath: str | None, model: str, args) -> dict:
    """One child process's pp / tg rates, or ``{"error": line}``."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = CHILD.format(threads=args.threads, model=model, pp=args.pp, tg=args.tg, reps=args.repetitions)
    run = subprocess.run([python, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    lines = [x for x in run.stderr.strip().splitlines() if x.strip()]
    return {"error": lines[-1] if lines else f"exit {run.returncode}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="earlier commit to compare with")
    parser.add_argument("--model", action="append", required=True, help="checkpoint (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    runs: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory(prefix="llmopt-baseline-") as tmp:
        tree, site = Path(tmp) / "tree", Path(tmp) / "site"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), commit], cwd=ROOT, capture_output=True, check=True)
        try:
            link_site(tree, site)
            codes = {"baseline": str(site), "current": None}
            for r in range(args.rounds):
                for model in args.model:
                    for name, path in codes.items():
                        result = measure(sys.executable, path, model, args)
                        runs.setdefault(model, {}).setdefault(name, []).append(result)
                        log(f"round {r + 1} {model} {name}: {result}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    rows = []
    for model, by_code in runs.items():
        row = {"model": model}
        for name, results in by_code.items():
            good = [x for x in results if "error" not in x]
            row[name] = {"pp_tok_s": [x["pp"] for x in good], "tg_tok_s": [x["tg"] for x in good],
                         "errors": [x["error"] for x in results if "error" in x]}
            if good:
                row[name]["pp_median"] = statistics.median(x["pp"] for x in good)
                row[name]["tg_median"] = statistics.median(x["tg"] for x in good)
        if "tg_median" in row["baseline"] and "tg_median" in row["current"]:
            row["tg_ratio"] = row["current"]["tg_median"] / row["baseline"]["tg_median"]
            row["pp_ratio"] = row["current"]["pp_median"] / row["baseline"]["pp_median"]
        rows.append(row)
    result = {"baseline": commit, "current": head, "current_has_uncommitted_changes": dirty, "threads": args.threads,
              "rounds": args.rounds, "pp": args.pp, "tg": args.tg, "repetitions": args.repetitions,
              "machine": platform.machine(), "cpu": cpu_name(), "load_average_before": load_before,
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "seconds": time.time() - started, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime_regression.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "runtime_regression.md").write_text(render(result))
    print(render(result))



def render(r: dict) -> str:
    def rates(values: list[float]) -> str:
        return ", ".join(f"{v:.1f}" for v in values)

    lines = ["# Runtime speed against an earlier commit", "",
             f"Current code {r['current']}{' (with uncommitted changes)' if r['current_has_uncommitted_changes'] else ''} "
             f"against {r['baseline']}, in one run: each cell is a child process measuring pp{r['pp']} and tg{r['tg']} "
             f"(one request at a time, median of {r['repetitions']}), {r['threads']} threads, {r['cpu']}; the two codes alternate "
             f"over {r['rounds']} rounds, median over rounds. Load average {r['load_average_before']} → {r['load_average_after']}; "
             f"{r['seconds']:.0f} s.", "",
             f"| checkpoint | tg{r['tg']} baseline | tg{r['tg']} current | current / baseline | per round (baseline; current) | pp{r['pp']} baseline | pp{r['pp']} current | current / baseline |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        b, c = row["baseline"], row["current"]
        if "tg_ratio" not in row:
            problem = "; ".join(b["errors"][:1] + c["errors"][:1])
            lines.append(f"| {row['model']} | {b.get('tg_median', '—')} | {c.get('tg_median', '—')} | not compared: {problem} | | | | |")
            continue
        lines.append(f"| {row['model']} | {b['tg_median']:.1f} | {c['tg_median']:.1f} | {row['tg_ratio']:.3f}× | "
                     f"{rates(b['tg_tok_s'])}; {rates(c['tg_tok_s'])} | {b['pp_median']:.1f} | {c['pp_median']:.1f} | {row['pp_ratio']:.3f}× |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
