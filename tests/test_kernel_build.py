"""Kernel builds survive a build that was killed: torch's lock file left in the build folder is
removed once llmopt's own lock (released by the OS when its process dies) is held."""

from __future__ import annotations

import types

import pytest

from llmopt.runtime.kernels import build


def test_a_stale_lock_from_a_killed_build_does_not_block(monkeypatch, tmp_path):
    pytest.importorskip("fcntl")
    monkeypatch.setenv("LLMOPT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("LLMOPT_KERNELS", raising=False)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler_available", lambda: True)
    tag = f"fake-{build._digest([build.SOURCES / 'dense.cpp'], build.CFLAGS)}"
    (tmp_path / tag).mkdir()
    (tmp_path / tag / "lock").touch()  # what torch's FileBaton leaves when its build is killed
    built = types.ModuleType("fake")
    seen = []

    def fake_load(name, sources, build_directory, **kwargs):
        seen.append(sorted(p.name for p in (tmp_path / tag).iterdir()))
        return built

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build.load_extension("fake", ["dense.cpp"]) is built
    assert len(seen) == 1 and "lock" not in seen[0]


def test_another_torch_install_builds_in_its_own_folder(monkeypatch):
    sources = [build.SOURCES / "dense.cpp"]
    here = build._digest(sources, build.CFLAGS)
    monkeypatch.setattr(build.torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert build._digest(sources, build.CFLAGS) != here
