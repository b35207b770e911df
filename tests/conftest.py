"""Shared fixtures: tiny random Llama-family models with a byte-level tokenizer, built in-process."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels are tested on the CPU under Triton's interpreter; the switch must be set before
# anything imports triton (transformers and torch may, before the Triton tests are collected)
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# C++ kernels compile once (about a minute) into one shared folder, not once per test's private cache
os.environ.setdefault("LLMOPT_KERNEL_CACHE", os.path.join(
    os.environ.get("LLMOPT_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmopt"), "kernels"))

# The suite must pass on a clone with nothing beside it: every open of a path under the
# workspace's ``../shared`` folder fails (an audit hook sees every open from Python code), and
# ``LLMOPT_DATA`` points at an empty folder, so named corpora come from the bundled copies.
SHARED = os.path.realpath(Path(__file__).resolve().parents[1].parent / "shared")


class SharedFolderRead(AssertionError):
    """Something read ``../shared``, which a user's clone does not have."""


def forbid_shared(event: str, args: tuple) -> None:
    if event not in ("open", "os.listdir", "os.scandir") or not args:
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)):
        full = os.path.realpath(os.fsdecode(path))
        if full == SHARED or full.startswith(SHARED + os.sep):
            raise SharedFolderRead(f"{event} {full}: tests may not read {SHARED} (use the bundled corpora)")


sys.addaudithook(forbid_shared)
_EMPTY_DATA = tempfile.mkdtemp(prefix="llmopt-empty-data-")
os.environ["LLMOPT_DATA"] = _EMPTY_DATA
atexit.register(shutil.rmtree, _EMPTY_DATA, True)

# The bundled corpora as plain files, at the data folder's relative paths, for tests that pass files
CORPORA = Path(tempfile.mkdtemp(prefix="llmopt-test-corpora-"))
atexit.register(shutil.rmtree, CORPORA, True)


def _write_corpora() -> None:
    from llmopt import corpora

    for rel in corpora.SHA256:
        (CORPORA / rel).parent.mkdir(parents=True, exist_ok=True)
        (CORPORA / rel).write_text(corpora.read(rel), encoding="utf-8")


_write_corpora()


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 256 byte tokens plus three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(seed: int | None = None, **overrides):
    """A small random LlamaForCausalLM (grouped-query attention, tied embeddings by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    settings.update(overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    with torch.no_grad():  # larger weights than the default init so outputs are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def randomize(model):
    """Weights far from their init: matrices N(0, 0.15), norms and biases moved off their trivial values."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def lazy_models(root: Path, build):
    """``get(kind) -> (model, checkpoint directory)``: ``build(kind)`` saved under ``root``, once per kind."""
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            model = build(kind)
            cache[kind] = (model, save_model(model, root / kind))
        return cache[kind]

    return get


def save_model(model, path: Path, tokenizer=None) -> Path:
    model.save_pretrained(path)
    (tokenizer or byte_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    return save_model(tiny_llama(), tmp_path / "tiny")


def _seed(text: str) -> None:
    """Seed Python's, torch's and numpy's generators from ``text`` (a test's or module's id)."""
    import random

    import numpy as np

    seed = zlib.crc32(text.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="module", autouse=True)
def seeded_module(request):
    """Module-scoped fixtures draw seeded random inputs (autouse runs first within its scope)."""
    _seed(request.module.__name__)


@pytest.fixture(autouse=True)
def seeded_test(request):
    """Every test draws the same random inputs on every run (and any selection or order): its
    generators are seeded from its own id. ``random.Random(random.getrandbits(64))`` derives a
    seeded private generator."""
    _seed(request.node.nodeid)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Keep each test's cache (converted models, baseline logits) private, except the demo model."""
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    yield


@pytest.fixture
def demo_cache(monkeypatch):
    """Share the demo model's converted checkpoint across tests (converting takes ~20 s)."""
    from platformdirs import user_cache_dir

    monkeypatch.setenv("LLMOPT_CACHE", os.environ.get("LLMOPT_TEST_CACHE", user_cache_dir("llmopt")))


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny tensors run much faster than with threads fighting over a busy
    shared CPU (modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def correlated_inputs(n: int, d: int) -> torch.Tensor:
    """Inputs with strongly correlated, unevenly scaled channels: X = Z @ A, columns scaled."""
    z = torch.randn(n, d)
    a = torch.randn(d, d) / d**0.5 + torch.eye(d) * 0.3
    return (z @ a) * torch.exp(torch.randn(d))


def out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Squared error of a layer's outputs when ``w`` is replaced by ``w_hat``."""
    return float((x @ w.T - x @ w_hat.T).pow(2).sum())
