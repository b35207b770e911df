"""Write outputs completely or not at all: build in a temporary sibling, then rename."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmopt.core.errors import LlmoptError


class OutputExistsError(LlmoptError, FileExistsError):
    """The output path exists and overwriting was not asked for."""


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite`` is set, and an output that cannot be
    created (a part of its path is a file, or its folder is not writable) before any work."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"output {path} already exists", "choose another path or pass --overwrite")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LlmoptError(f"cannot write {path}: {parent} is a file, not a folder", "choose an output path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LlmoptError(f"cannot write {path}: {parent} is not writable", "choose an output path you can write to")


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; move it into place when the block succeeds.

    An existing ``target`` is refused unless ``overwrite``; then it is replaced only once the
    new directory is complete (and restored if the final rename fails).
    """
    target = Path(target)
    check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _move_into_place(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def umask() -> int:
    """The process's file-creation mask (read without changing it, where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _public_mode(path: Path, directory: bool, mask: int | None = None) -> None:
    """Give ``path`` the mode a plain ``mkdir`` / ``open`` would have (mkdtemp / mkstemp make
    them private), so that finished outputs carry the user's umask like any other tool's."""
    os.chmod(path, (0o777 if directory else 0o666) & ~(umask() if mask is None else mask))


def _public_tree(root: Path) -> None:
    """:func:`_public_mode` for ``root`` and everything under it (links left alone).

    Writers that go through a temporary file and a rename create private files whatever the
    umask: safetensors >= 0.8 (``save_file``, hence ``save_pretrained``) writes every
    ``*.safetensors`` 0600. A finished output directory is made uniform here, in one place, so
    every file in it gets ``0666 & ~umask`` (``0777 & ~umask`` if it was made executable) and
    every folder ``0777 & ~umask``, as with ``open`` / ``mkdir``.
    """
    mask = umask()
    for folder, dirs, files in os.walk(root, topdown=False):  # contents before their folder
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if not stat.S_ISLNK(st.st_mode):
                _public_mode(path, directory=stat.S_ISDIR(st.st_mode) or bool(st.st_mode & 0o100), mask=mask)
    _public_mode(root, directory=True, mask=mask)


def _move_into_place(tmp: Path, target: Path, overwrite: bool) -> None:
    _public_tree(tmp)
    if not target.exists():
        os.rename(tmp, target)
        return
    check_output(target, overwrite)  # it appeared while we were writing
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
        _public_mode(tmp, directory=False)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
