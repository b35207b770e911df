"""Where llmopt keeps its cache and finds its data."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def cache_dir(*parts: str) -> Path:
    """A folder under the user cache (``LLMOPT_CACHE`` overrides the location), created on demand."""
    root = Path(os.environ.get("LLMOPT_CACHE") or user_cache_dir("llmopt"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir_candidates() -> list[Path]:
    """Data folders tried in order: ``LLMOPT_DATA``, then ``shared/data`` beside the checkout or cwd."""
    candidates = []
    if os.environ.get("LLMOPT_DATA"):
        candidates.append(Path(os.environ["LLMOPT_DATA"]).expanduser())
    checkout = Path(__file__).resolve().parents[1]
    candidates += [checkout.parent / "shared" / "data", Path.cwd().parent / "shared" / "data", Path.cwd() / "data"]
    return candidates


def data_dir() -> Path | None:
    """The first existing data folder, or None (datasets are then fetched with ``datasets``)."""
    for path in data_dir_candidates():
        if path.is_dir():
            return path
    return None
