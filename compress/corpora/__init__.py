"""Text corpora bundled with llmopt (gzip-compressed package data; see README.md here).

``path(name)`` is the bundled file for a corpus file name such as ``"gutenberg/emma.txt"``;
``read(name)`` its text. Sources, licenses and SHA-256 of the uncompressed texts are in
README.md and in ``SHA256`` below, which ``read`` checks.
"""

from __future__ import annotations

import gzip
import hashlib
import io
from importlib import resources
from pathlib import Path

from llmopt.core.errors import LlmoptError

# SHA-256 of each uncompressed text (the same bytes as the published files named in README.md)
SHA256 = {
    "wikitext-2-raw/wiki.test.raw": "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c",
    "gutenberg/emma.txt": "dd08b340a56ad4a0a00718d5682528a5a5886ae0aef91c9e0fa528074fa64b75",
    "gutenberg/great-expectations.txt": "d5e9ecca630da7a004b927ee0c9b439a9aa86025b49db5bd4df24ee3671fa15b",
    "gutenberg/mansfieldpark.txt": "e0e9ef3863ea77f51f6070062ee0dd50ad9b933223880617629e4e4963ea40ff",
    "gutenberg/northangerabbey.txt": "8618a5acf5be50cc6e9b7680c7469fb6012649ab08c709dfc63c6367989fd31d",
    "gutenberg/persuasion.txt": "726513a6c18bb678427bcbcf7c72d0d20816a67c25b0471b26ddcabf3ebac140",
    "gutenberg/prideprejudice.txt": "2e44edaa4946d64ad541c68e0224f5d672f43bf3ce2a8a0b0637ad5e02fc6eb3",
    "gutenberg/sensesensibility.txt": "0996d90842bbe8093f3b8142c1e77d1b20cff52d1d0615f3ed67733653e74e26",
    "gutenberg/twenty-thousand-leagues.txt": "140db6a20190d462430c291aea14a1dea0a79eb57598abd727a8eb94854aaed3",
    "gutenberg/war-of-the-worlds.txt": "e4ef2dcca5b02cecb49112a04e30f0433ac2d73e9a505a2b58d06ef1edd7c785",
}


def path(name: str) -> Path:
    """The bundled gzip file of corpus file ``name`` (a key of ``SHA256``)."""
    if name not in SHA256:
        raise KeyError(f"no bundled corpus file {name!r}")
    return Path(str(resources.files(__name__).joinpath(Path(name).name + ".gz")))


def read(name: str) -> str:
    """The text of bundled corpus file ``name``, checked against its SHA-256."""
    raw = gzip.decompress(path(name).read_bytes())
    if hashlib.sha256(raw).hexdigest() != SHA256[name]:
        raise LlmoptError(f"bundled corpus file {name} is corrupt (SHA-256 mismatch)", "reinstall llmopt")
    # universal newlines, as ``Path.read_text`` reads a file from a data folder: same text either way
    return io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8").read()
