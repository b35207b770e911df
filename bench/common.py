"""What the benchmark scripts share: running the CLI in a child process and resumable variant loops."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable


def cpu_name() -> str:
    """The CPU's model name, as the runtime records it with its measurements."""
    from llmopt.runtime.format_speed import cpu_model

    return cpu_model()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def llmopt(*args: str) -> dict:
    """Run ``llmopt ARGS --json`` in a child process (its time and peak memory are its own) and
    return its JSON output; a failure raises with the end of its stderr."""
    done = subprocess.run([sys.executable, "-m", "llmopt", *args, "--json"], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llmopt {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def run_variants(
    names: list[str],
    results: dict,
    measure: Callable[[str], dict],
    summary: Callable[[dict], str],
    save: Callable[[], None],
    only: list[str] | None = None,
    force: bool = False,
) -> None:
    """Measure each variant not yet in ``results`` (all with ``force``; ``only``: name substrings),
    printing a one-line summary and saving after each, so an interrupted run resumes."""
    for name in names:
        if only and not any(o in name for o in only):
            continue
        if name in results and not force:
            continue
        start = time.perf_counter()
        log(f"{name} …")
        results[name] = measure(name)
        print(f"    {summary(results[name])}  ({time.perf_counter() - start:.0f}s)", flush=True)
        save()
