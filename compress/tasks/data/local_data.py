"""Loaders for the bundled task YAMLs: JSON-lines files beside this module, one split per row's
``split`` field. Referenced from the YAMLs as ``custom_dataset: !function local_data.NAME``, so
the tasks need no download (lm-evaluation-harness calls them with the task's metadata)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_jsonl(file: str | Path, **_metadata):
    """A ``datasets.DatasetDict`` with one split per distinct ``split`` value of the rows."""
    import datasets

    path = Path(file)
    path = path if path.is_absolute() else HERE / path
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    splits: dict[str, list[dict]] = {}
    for row in rows:
        splits.setdefault(row.get("split", "test"), []).append({k: v for k, v in row.items() if k != "split"})
    return datasets.DatasetDict({name: datasets.Dataset.from_list(items) for name, items in splits.items()})


def tiny_mc(**metadata):
    return load_jsonl("tiny_mc.jsonl", **metadata)


def tiny_gen(**metadata):
    return load_jsonl("tiny_gen.jsonl", **metadata)
