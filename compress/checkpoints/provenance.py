"""``llmopt.json``: what every checkpoint llmopt writes records about how it was made.

One file name, one reader, one writer; plus the pieces every stage records (library versions,
time, CPU time, peak memory) and the checkpoint fingerprint that caches key on.
"""

from __future__ import annotations

import hashlib
import json
import platform
import resource
import time
from pathlib import Path

PROVENANCE_FILE = "llmopt.json"


def read_provenance(path: str | Path) -> dict:
    """The checkpoint's ``llmopt.json`` as a dict ({} when there is none or it is unreadable)."""
    file = Path(path) / PROVENANCE_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_provenance(directory: str | Path, record: dict) -> None:
    """Write ``record`` as ``llmopt.json`` into a directory being built (no atomic rename: the
    directory itself is renamed into place when complete). A ``source`` downloaded from the Hub
    adds ``hub``: the repository id, the revision asked for and the commit it resolved to."""
    from llmopt.checkpoints.hub import hub_origin

    from llmopt.checkpoints.model_card import command_line, write_model_card

    origin = None if "hub" in record else hub_origin(record.get("source"))
    record = {**record, "hub": origin} if origin else record
    command = None if "command" in record else command_line()
    record = {**record, "command": command} if command else record
    (Path(directory) / PROVENANCE_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    write_model_card(directory, record)


def update_provenance(path: str | Path, **entries) -> None:
    """Add or replace top-level entries of a finished checkpoint's ``llmopt.json`` (atomically)."""
    from llmopt.core.atomic import atomic_file

    record = read_provenance(path)
    record.update(entries)
    with atomic_file(Path(path) / PROVENANCE_FILE, overwrite=True) as tmp:
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    from llmopt.checkpoints.model_card import write_model_card

    write_model_card(path, record)


def versions() -> dict:
    """Versions of the libraries that shaped a checkpoint."""
    import compressed_tensors
    import torch
    import transformers

    from llmopt import __version__

    return {"llmopt": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__, "python": platform.python_version()}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def finish_record(record: dict, start: float) -> dict:
    """Add wall time since ``start``, process CPU time and peak RSS to a stage record."""
    record["total_seconds"] = round(time.perf_counter() - start, 2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 1)  # whole process, loading included
    record["peak_rss_mib"] = round(peak_rss_mib(), 1)
    return record


def model_fingerprint(path: str | Path) -> str:
    """Identity of a checkpoint directory: its files' names, sizes and modification times."""
    parts = []
    for file in sorted(Path(path).iterdir()):
        if file.is_file() and file.suffix in {".safetensors", ".json", ".bin"}:
            stat = file.stat()
            parts.append(f"{file.name}:{stat.st_size}:{int(stat.st_mtime_ns)}")
    return hashlib.sha256(f"{Path(path).resolve()}|{'|'.join(parts)}".encode()).hexdigest()
