"""Teacher distributions cached on disk: the top-k log-probabilities of each training sample.

Filled as samples are first seen and reused by later steps, epochs and runs (e.g. a second
run with other student settings), so the teacher's forward pass is paid once per sample. One
file per sample; writes are atomic, so processes sharing a cache never see a partial file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from llmopt.core.paths import cache_dir

from llmopt.distillation.losses import TopK


class TeacherCache:
    """Top-k teacher log-probabilities at one temperature, one file per training sample."""

    def __init__(self, root: Path, top_k: int, temperature: float) -> None:
        self.root = Path(root)
        self.top_k = top_k
        self.temperature = temperature
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_run(cls, teacher_fingerprint: str, data: torch.Tensor, top_k: int, temperature: float, precision: str) -> TeacherCache:
        """The cache for one teacher, one packed dataset and one temperature, under the user cache."""
        data_hash = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        key = hashlib.sha256(f"{teacher_fingerprint}|{data_hash}|{top_k}|{temperature}|{precision}".encode()).hexdigest()[:20]
        return cls(cache_dir("distill-teacher", key), top_k, temperature)

    def _file(self, sample: int) -> Path:
        return self.root / f"sample-{sample:07d}.pt"

    def has_all(self, samples: list[int]) -> bool:
        return all(self._file(s).is_file() for s in samples)

    def load(self, samples: list[int]) -> TopK:
        entries = [torch.load(self._file(s), weights_only=True) for s in samples]
        return TopK(
            torch.stack([e["indices"] for e in entries]),
            torch.stack([e["log_probs"] for e in entries]),
            self.temperature,
        )

    def store(self, samples: list[int], logits: torch.Tensor) -> TopK:
        """Keep the top k of ``log_softmax(logits / T)`` for each sample; return them as a batch."""
        log_probs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        k = min(self.top_k, log_probs.shape[-1])
        top_lp, top_idx = log_probs.topk(k, dim=-1)
        top_idx = top_idx.to(torch.int32)
        for row, sample in enumerate(samples):
            entry = {"indices": top_idx[row].cpu().contiguous(), "log_probs": top_lp[row].cpu().contiguous()}
            tmp = self._file(sample).with_suffix(f".tmp{os.getpid()}")
            torch.save(entry, tmp)
            tmp.replace(self._file(sample))
        return TopK(top_idx, top_lp, self.temperature)
