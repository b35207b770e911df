"""Training text for distillation: documents → token ids packed into fixed-length sequences,
and a seeded, resumable order in which processes draw them.

Documents are tokenized without special tokens, joined with the tokenizer's end-of-sequence
token and cut into ``seq_len`` windows (the tail that does not fill one is dropped). The
packed tensor is cached on disk, keyed by the text's hash, the tokenizer and ``seq_len``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
from llmopt.core.data import load_text, tokenize_documents
from llmopt.core.errors import LlmoptError
from llmopt.core.paths import cache_dir

DEFAULT_TRAIN = "gutenberg"
DEFAULT_VALIDATION = "heldout"


@dataclass
class PackedText:
    """``ids [n, seq_len]`` packed from one corpus, and a record of where they came from."""

    ids: torch.Tensor
    record: dict

    def __len__(self) -> int:
        return self.ids.shape[0]


def tokenizer_key(tokenizer) -> str:
    """A short hash identifying a tokenizer's vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


def pack_text(tokenizer, spec: str, seq_len: int) -> PackedText:
    """Tokenize the corpus ``spec`` (name, file, folder or ``hf:``) and pack it into windows."""
    if seq_len < 2:
        raise LlmoptError(f"sequence length {seq_len} is too short", "use at least 2 tokens (256-1024 is typical)")
    source = load_text(spec)
    key = hashlib.sha256(f"{source.sha256}|{tokenizer_key(tokenizer)}|{seq_len}".encode()).hexdigest()[:20]
    file = cache_dir("distill-data") / f"{key}.pt"
    record = {**source.record(), "seq_len": seq_len}
    if file.is_file():
        ids = torch.load(file, weights_only=True)
    else:
        ids = _pack(tokenizer, source, seq_len)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        torch.save(ids, tmp)
        tmp.replace(file)
    if len(ids) == 0:
        raise LlmoptError(f"text '{spec}' holds fewer than {seq_len} tokens", "use a longer text or a shorter --seq-len")
    record["sequences"] = len(ids)
    record["tokens"] = int(ids.numel())
    return PackedText(ids, record)


def _pack(tokenizer, source, seq_len: int) -> torch.Tensor:
    separator = tokenizer.eos_token_id
    parts = []
    for doc in tokenize_documents(tokenizer, source):
        parts.append(doc)
        if separator is not None:
            parts.append(torch.tensor([separator], dtype=torch.long))
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    n = ids.numel() // seq_len
    return ids[: n * seq_len].reshape(n, seq_len).clone()


def spread(data: PackedText, n: int) -> torch.Tensor:
    """``n`` windows evenly spaced through ``data`` (all of it when it is shorter)."""
    if n >= len(data):
        return data.ids
    positions = torch.linspace(0, len(data) - 1, n).round().long()
    return data.ids[positions]


class DataOrder:
    """Which sample each position of the training stream holds: a fresh seeded permutation per epoch.

    Position ``p`` of the global stream is sample ``perm(p // n)[p % n]``. Training step ``s``
    takes positions from ``s * global_batch`` on, split between gradient-accumulation micro
    steps and processes, so the order depends only on the seed and the step (hence resumable).
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n, generator=generator)
            self._epoch = epoch
        return self._perm

    def sample(self, position: int) -> int:
        return int(self._permutation(position // self.n)[position % self.n])

    def micro_batch(self, step: int, micro: int, rank: int, world: int, batch_size: int, accum: int) -> list[int]:
        """Sample indices for one process's micro batch ``micro`` of optimizer step ``step``."""
        start = ((step * accum + micro) * world + rank) * batch_size
        return [self.sample(p) for p in range(start, start + batch_size)]
