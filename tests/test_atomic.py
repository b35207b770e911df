"""Atomic outputs: complete or absent, and with the permissions the user's umask gives."""

from __future__ import annotations

import os
import stat

import pytest
from llmopt.core.atomic import OutputExistsError, atomic_dir, atomic_file, umask


@pytest.fixture(params=[0o022, 0o027, 0o002])
def mask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_umask_is_read_without_changing_it(mask):
    assert umask() == mask
    assert umask() == mask


def test_finished_directory_and_its_files_carry_the_umask(tmp_path, mask):
    target = tmp_path / "out" / "model"
    with atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
        (tmp / "sub").mkdir()
    assert mode(target) == 0o777 & ~mask
    assert mode(target / "model.safetensors") == 0o666 & ~mask
    assert mode(target / "sub") == 0o777 & ~mask
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no temporary left


def test_finished_file_carries_the_umask(tmp_path, mask):
    target = tmp_path / "report.json"
    with atomic_file(target) as tmp:
        tmp.write_text("{}")
    assert target.read_text() == "{}"
    assert mode(target) == 0o666 & ~mask


def test_replaced_file_written_by_the_block_carries_the_umask(tmp_path, mask):
    target = tmp_path / "a.bin"
    with atomic_file(target) as tmp:
        tmp.unlink()
        tmp.write_bytes(b"new")  # a writer that recreates the file
    assert mode(target) == 0o666 & ~mask


def test_failed_block_leaves_nothing_and_keeps_the_old_output(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in target.iterdir()) == ["old"]
    with pytest.raises(OutputExistsError), atomic_dir(target):
        pass
