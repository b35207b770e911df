"""Every output file of every command carries the user's umask, like a plain ``open`` / ``mkdir``.

safetensors >= 0.8 writes each ``*.safetensors`` through a private (0600) temporary file and a
rename, so shards, ``save_pretrained`` weights and the rest must be given the umask's mode when an
output is finished (``llmopt.core.atomic``). Each command runs on a tiny random model under
``umask 022`` (files 0644, folders 0755); quantize and GGUF export also run under ``umask 077``
(files 0600, folders 0700) so that the mode is seen to follow the umask, not a fixed value.
"""

from __future__ import annotations

import json
import os
import stat
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import CORPORA, save_model, tiny_llama
from llmopt.checkpoints.writer import ShardedWriter
from llmopt.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = (CORPORA / "gutenberg" / "persuasion.txt").read_text()[5000:25000]
CALIB = ["--calib-samples", "2", "--calib-seq-len", "16"]
SIDE = {"README.md", "config.json", "generation_config.json", "llmopt.json", "tokenizer.json", "tokenizer_config.json"}
SMALL_SHARD = 20_000  # bytes: the tiny model's weights stream out as several shards


@contextmanager
def umask(mask: int):
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def run(*args: str, mask: int = 0o022) -> dict | None:
    with umask(mask):
        result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout) if "--json" in args else None


def tree(root: Path) -> dict[str, int]:
    """Relative path -> permission bits of ``root`` (as ".") and everything under it."""
    modes = {".": stat.S_IMODE(root.lstat().st_mode)}
    for path in sorted(root.rglob("*")):
        assert not path.is_symlink(), path
        modes[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return modes


def assert_modes(root: Path, mask: int = 0o022) -> None:
    """Every file under ``root`` (or ``root`` itself, a file) has ``0666 & ~mask``, every folder ``0777 & ~mask``."""
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    wrong = {}
    for rel, mode in tree(root).items():
        expected = dir_mode if (root / rel).is_dir() else file_mode
        if mode != expected:
            wrong[rel] = f"{mode:o} (expected {expected:o})"
    assert not wrong, wrong


def names(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_atomic_dir_gives_private_writes_the_umask(tmp_path, mask):
    """What writers create private (safetensors' temporary file, mkdtemp) ends with the umask's
    mode; an executable stays executable; a link is left alone."""
    import torch
    from safetensors.torch import save_file

    from llmopt.core.atomic import atomic_dir

    target = tmp_path / "out" / "model"
    with umask(mask), atomic_dir(target) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        private = tmp / "sub" / "deeper"
        private.mkdir(parents=True)
        private.chmod(0o700)
        (private / "state.json").write_text("{}")
        (private / "state.json").chmod(0o600)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "run.sh").chmod(0o700)
        (tmp / "link").symlink_to("model.safetensors")
    assert names(target) == {"model.safetensors", "sub/deeper/state.json", "run.sh", "link"}
    assert (target / "run.sh").stat().st_mode & 0o777 == 0o777 & ~mask
    (target / "link").unlink()
    (target / "run.sh").unlink()
    assert_modes(tmp_path / "out", mask)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """A tiny dense model, its W4A16 checkpoint and a small text (written under the default umask)."""
    root = tmp_path_factory.mktemp("sources")
    dense = save_model(tiny_llama(seed=0, num_hidden_layers=3), root / "dense")
    (root / "text.txt").write_text(TEXT)
    run("quantize", dense, "-o", root / "w4", "--scheme", "W4A16", "--group-size", "32")
    return {"dense": dense, "w4": root / "w4", "text": root / "text.txt"}


@pytest.fixture
def small_shards(monkeypatch):
    """Streamed writers cut shards of ``SMALL_SHARD`` bytes (index + several renamed shards)."""
    init = ShardedWriter.__init__
    monkeypatch.setattr(ShardedWriter, "__init__", lambda self, out_dir, *_, **__: init(self, out_dir, SMALL_SHARD))


def shards(files: set[str]) -> set[str]:
    return {f for f in files if f.startswith("model-") and f.endswith(".safetensors")}


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_quantize_streamed_shards(work, tmp_path, small_shards, mask):
    out = tmp_path / "out"
    record = run("quantize", work["dense"], "-o", out / "q", "--scheme", "W4A16", "--group-size", "32", "--json", mask=mask)
    assert record["scheme"] == "W4A16"
    files = names(out / "q")
    assert len(shards(files)) >= 2 and files == SIDE | {"model.safetensors.index.json"} | shards(files)
    assert_modes(out, mask)


def test_quantize_nf4(work, tmp_path):
    out = tmp_path / "out"
    run("quantize", work["dense"], "-o", out / "nf4", "--scheme", "NF4", "--json")
    assert names(out / "nf4") == SIDE | {"model.safetensors"}
    assert_modes(out)


def test_quantize_calibrated(work, tmp_path):
    out = tmp_path / "out"
    run("quantize", work["dense"], "-o", out / "g", "--scheme", "W8A16", "--method", "gptq", "--calib", work["text"], *CALIB, "--json")
    assert names(out / "g") == SIDE | {"model.safetensors"}
    assert_modes(out)


@pytest.mark.parametrize("method, streamed", [
    (["--method", "wanda", "--sparsity", "0.5"], True),  # layer by layer into sharded safetensors
    (["--method", "drop-layers", "--num", "1"], False),  # in memory, then save_pretrained
])
def test_prune(work, tmp_path, small_shards, method, streamed):
    out = tmp_path / "out"
    run("prune", work["dense"], "-o", out / "p", "--calib", work["text"], *CALIB, "--json", *method)
    files = names(out / "p")
    weights = {"model.safetensors.index.json"} | shards(files) if streamed else {"model.safetensors"}
    assert len(weights) >= (3 if streamed else 1) and files == SIDE | weights
    assert_modes(out)


def test_distill(work, tmp_path):
    out = tmp_path / "out"
    run("distill", "--teacher", work["dense"], "--student-from", work["dense"], "--drop-layers", "1",
        "--calib", work["text"], "--data", work["text"], "--validation", "none", "--steps", "2", "--seq-len", "16",
        "--batch-size", "2", "--save-every", "1", "--precision", "no", "-o", out / "s", "--json")
    assert names(out / "s") == SIDE | {"model.safetensors"}
    assert_modes(out)  # with anything left beside the student (its checkpoints are removed once it is saved)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_export_gguf(work, tmp_path, mask):
    out = tmp_path / "out"
    run("export", work["w4"], "-o", out / "m.gguf", "--json", mask=mask)
    run("export", work["dense"], "--type", "q8_0", "-o", out / "d.gguf", mask=mask)
    assert names(out) == {"m.gguf", "d.gguf"} and (out / "m.gguf").stat().st_size > 0
    assert_modes(out, mask)


@pytest.mark.parametrize("fmt", ["hf", "compressed-tensors"])
def test_export_checkpoint(work, tmp_path, fmt):
    out = tmp_path / "out"
    run("export", work["w4"], "--format", fmt, "-o", out / "e")
    assert names(out / "e") == SIDE | {"model.safetensors"}
    assert_modes(out)


def test_recipe_run(work, tmp_path):
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""
        model: {work["dense"]}
        output: {out / "run"}
        calibration: {{dataset: {work["text"]}, samples: 2, seq_len: 16}}
        stages:
          - prune: {{method: wanda, sparsity: 0.5}}
          - quantize: {{scheme: W4A16, group_size: 32}}
          - export: {{format: gguf}}
    """))
    record = run("run", recipe, "--json")
    assert [s["skipped"] for s in record["stages"]] == [False, False, False]
    files = names(out / "run")
    assert {"recipe.resolved.json", "recipe.yaml", "run.json", "01-prune/llmopt-stage.json", "01-prune/model.safetensors",
            "02-quantize/llmopt-stage.json", "02-quantize/model.safetensors", "03-export/model.gguf"} <= files
    assert_modes(out)
