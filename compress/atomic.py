"""Write outputs completely or not at all: build in a temporary sibling, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import LlmoptError


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite`` is set."""
    if path.exists() and not overwrite:
        raise LlmoptError(f"output {path} already exists", "choose another path or pass --overwrite")


@contextmanager
def atomic_dir(target: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; move it into place when the block succeeds."""
    target = Path(target)
    check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(target: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary file path beside ``target``; rename it into place on success."""
    target = Path(target)
    check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
