"""Bundled corpora: the named corpora resolve to package data, identical to the published texts."""

from __future__ import annotations

import gzip
import hashlib

import pytest
from conftest import SHARED, SharedFolderRead
from llmopt import corpora
from llmopt.core.errors import LlmoptError
from llmopt.core.data import NAMED, load_text


def test_every_named_corpus_file_is_bundled_with_its_checksum():
    names = {rel for files in NAMED.values() for rel in files}
    assert names == set(corpora.SHA256)
    for rel, digest in corpora.SHA256.items():
        raw = gzip.decompress(corpora.path(rel).read_bytes())
        assert hashlib.sha256(raw).hexdigest() == digest


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_corpora_come_from_the_package_without_a_data_folder(name):
    source = load_text(name)
    assert len(source.documents) == len(NAMED[name])
    assert source.files == [f"llmopt.corpora:{rel}" for rel in NAMED[name]]
    assert all(len(doc) > 100_000 for doc in source.documents)


def test_text_checksums_match_the_figures_in_bench_results():
    """bench/results record these text checksums: the bundled text is the same text."""
    assert load_text("austen").sha256.startswith("886a6720af1371e4")
    assert load_text("heldout").sha256.startswith("e4ef2dcca5b02cec")
    # read with universal newlines, as a file from a data folder is (the raw file has \r\n lines)
    assert "\r" not in load_text("wikitext2").documents[0]


def test_data_folder_overrides_a_bundled_file(tmp_path, monkeypatch):
    (tmp_path / "gutenberg").mkdir()
    (tmp_path / "gutenberg" / "war-of-the-worlds.txt").write_text("no martians here")
    monkeypatch.setenv("LLMOPT_DATA", str(tmp_path))
    assert load_text("heldout").documents == ["no martians here"]
    assert load_text("wikitext2").files == ["llmopt.corpora:wikitext-2-raw/wiki.test.raw"]  # not in the folder


def test_corrupt_bundled_file_is_refused(monkeypatch):
    monkeypatch.setitem(corpora.SHA256, "gutenberg/persuasion.txt", "0" * 64)
    with pytest.raises(LlmoptError, match="corrupt"):
        corpora.read("gutenberg/persuasion.txt")


def test_the_suite_cannot_read_the_shared_folder():
    with pytest.raises(SharedFolderRead):
        open(f"{SHARED}/data/README.md")  # noqa: SIM115 - the open itself must be refused
