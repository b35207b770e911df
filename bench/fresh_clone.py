"""The README's two commands on a fresh clone, timed: writes bench/results/fresh_clone.{json,md}.

Clones the repository (the committed HEAD) into a temporary folder with no ``../shared`` beside
it, then runs, each under ``/usr/bin/time -v`` with an empty user cache:

1. ``bash scripts/install.sh && .venv/bin/llmopt demo`` (the main job), then the demo a second
   time (everything cached: speed is measured again);
2. ``bash scripts/install.sh && .venv/bin/python -m pytest -q`` (the tests).

Records wall time, peak RSS, exit status, the test summary line and the machine's load average
before and after each command. Usage: ``python bench/fresh_clone.py [--only demo|tests]``.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _timed(command: str, cwd: Path, env: dict, log: Path) -> dict:
    """Run ``command`` under /usr/bin/time -v; wall seconds, peak RSS, exit status, output tail."""
    load_before = os.getloadavg()
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(["/usr/bin/time", "-v", "bash", "-c", command], cwd=cwd, env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    peak = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", text)
    summary = [line for line in text.splitlines() if re.search(r"\d+ passed", line)]
    return {"command": command, "exit_status": done.returncode, "wall_seconds": round(seconds, 1),
            "peak_rss_mib": round(int(peak[-1]) / 1024, 1) if peak else None,
            "test_summary": summary[-1].strip("= ") if summary else None,
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "output_tail": text[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("demo", "tests"))
    parser.add_argument("--report", action="store_true", help="Rewrite the report from the JSON only.")
    args = parser.parse_args()
    if args.report:
        record = json.loads((RESULTS / "fresh_clone.json").read_text())
        _write(_with_commits(record))
        return
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="llmopt-fresh-"))  # /tmp: no ../shared beside the clone
    clone = work / "llmopt"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    assert not (clone.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMOPT_", "VIRTUAL_ENV"))}
    env["LLMOPT_CACHE"] = str(work / "cache")
    env["LLMOPT_KERNEL_CACHE"] = str(work / "cache" / "kernels")  # the demo builds its C++ kernels anew
    runs = {}
    if args.only in (None, "demo"):
        runs["demo"] = _timed("bash scripts/install.sh && .venv/bin/llmopt demo", clone, env, work / "demo.log")
        runs["demo_second_run"] = _timed(".venv/bin/llmopt demo", clone, env, work / "demo2.log")
    if args.only in (None, "tests"):
        runs["tests"] = _timed("bash scripts/install.sh && .venv/bin/python -m pytest -q", clone, env, work / "tests.log")
    for run in runs.values():
        run["commit"] = commit
    record = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "shared_beside_clone": (clone.parent / "shared").exists(), "runs": runs}
    path = RESULTS / "fresh_clone.json"
    old = _with_commits(json.loads(path.read_text())) if path.is_file() else {}
    old_runs = old.get("runs", {}) if args.only else {}
    record["runs"] = {**old_runs, **runs}
    _write(record)
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(max(r["exit_status"] for r in runs.values()))


def _with_commits(record: dict) -> dict:
    """Runs recorded before commits were kept per run take the file's commit."""
    for run in record.get("runs", {}).values():
        run.setdefault("commit", record.get("commit", "?"))
    record.pop("commit", None)
    return record


def _write(record: dict) -> None:
    (RESULTS / "fresh_clone.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# The README's commands on a fresh clone", "",
             f"{record['cpus']} CPUs, no `../shared` beside the clone, empty user cache "
             "(written by `bench/fresh_clone.py`).", "",
             "| run | commit | exit | wall | peak RSS | tests | load avg before → after (1 min) |", "|---|---|---|---|---|---|---|"]
    for name, r in record["runs"].items():
        minutes = f"{int(r['wall_seconds'] // 60)} min {r['wall_seconds'] % 60:.0f} s"
        lines.append(f"| {name} | {r.get('commit', '?')[:10]} | {r['exit_status']} | {minutes} | {r['peak_rss_mib']} MiB | {r['test_summary'] or '—'} | "
                     f"{r['load_before'][0]} → {r['load_after'][0]} |")
    (RESULTS / "fresh_clone.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
