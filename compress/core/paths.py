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


def data_dir() -> Path | None:
    """The optional data folder ``$LLMOPT_DATA`` overriding the bundled corpora, or None."""
    value = os.environ.get("LLMOPT_DATA")
    return Path(value).expanduser() if value else None
