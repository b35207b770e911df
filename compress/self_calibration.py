"""Calibration windows the model writes itself: ``--calib self``, alone or as a share of a mix
(``--calib austen+self``).

GPTQ, AWQ and the sensitivity pass fit the quantized model to the inputs they are calibrated on,
and a corpus of one kind (novels) fits it to that kind of text. Sequences the float model samples
with no prompt (temperature 1 from its BOS token) follow the distribution it learned instead — the
data-free calibration of LLM-QAT (Liu et al., 2023) — so the fit carries to text unlike any one
corpus. They are written once by llmopt's runtime (batched) and cached per checkpoint, count,
length and seed; special tokens the model samples on the way (an end of text) stay in, as it
would see them when it continues past them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from llmopt.checkpoints.provenance import model_fingerprint
from llmopt.core.atomic import atomic_file
from llmopt.core.data import SELF
from llmopt.core.errors import LlmoptError
from llmopt.core.paths import cache_dir

TEMPERATURE = 1.0
BATCH = 32  # sequences sampled side by side
VERSION = 1


def sampler(model: Path, device: str | None = None, show_progress: bool = True):
    """``sample_self`` for :func:`llmopt.core.data.calibration_ids`: windows sampled by ``model``
    on ``device`` (``cpu`` / ``cuda`` / ``auto``; default the CPU)."""

    def sample(tokenizer, samples: int, seq_len: int, seed: int) -> tuple[torch.Tensor, dict]:
        return self_windows(model, tokenizer, samples, seq_len, seed, device, show_progress)

    return sample


def start_token(tokenizer) -> int:
    """The token every sample starts from: the tokenizer's BOS, else its EOS (a document boundary)."""
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    raise LlmoptError("the tokenizer has neither a BOS nor an EOS token to start sampling from",
                      "calibrate on a corpus instead of 'self'")


def self_windows(model: Path, tokenizer, samples: int, seq_len: int, seed: int = 0, device: str | None = None,
                 show_progress: bool = True) -> tuple[torch.Tensor, dict]:
    """``samples`` windows of ``seq_len`` tokens sampled by the float checkpoint at ``model``:
    ``(ids [samples, seq_len], record)``; the start token itself is not part of a window."""
    fingerprint = model_fingerprint(model)
    key = hashlib.sha256(f"v{VERSION}|{fingerprint}|{samples}|{seq_len}|{seed}|{TEMPERATURE}".encode()).hexdigest()[:24]
    path = cache_dir("calibration-self") / f"{key}.pt"
    record = {"name": SELF, "model": fingerprint[:16], "temperature": TEMPERATURE}
    ids = _cached(path, samples, seq_len)
    if ids is None:
        ids = _sample(model, start_token(tokenizer), samples, seq_len, seed, device, show_progress)
        try:
            with atomic_file(path) as tmp:
                torch.save(ids, tmp)
        except OSError:  # a read-only cache only costs sampling again
            pass
    return ids, record


def _cached(path: Path, samples: int, seq_len: int) -> torch.Tensor | None:
    try:
        ids = torch.load(path, weights_only=True) if path.is_file() else None
    except (OSError, RuntimeError, EOFError):  # a damaged entry is sampled again
        return None
    return ids if ids is not None and tuple(ids.shape) == (samples, seq_len) else None


def _sample(model: Path, start: int, samples: int, seq_len: int, seed: int, device: str | None,
            show_progress: bool) -> torch.Tensor:
    """Sampled in bfloat16 where the device computes it natively (a large model fits), else float32."""
    from llmopt.calibration import resolve_device
    from llmopt.core.hardware import native_bf16
    from llmopt.runtime import LLM, SamplingParams

    where = resolve_device(device) or torch.device("cpu")
    dtype = "bfloat16" if native_bf16(where) else "float32"
    llm = LLM(model, max_num_seqs=min(samples, BATCH), max_model_len=seq_len + 1, seed=seed, device=str(where), dtype=dtype)
    params = [SamplingParams(max_tokens=seq_len, temperature=TEMPERATURE, ignore_eos=True, skip_special_tokens=False,
                             seed=seed * 1_000_003 + i) for i in range(samples)]
    outputs = llm.generate([[start]] * samples, params, progress=show_progress)
    rows = [list(out.token_ids) for out in outputs]
    if len(rows) != samples or any(len(row) != seq_len for row in rows):
        raise LlmoptError(f"sampling calibration text gave {[len(r) for r in rows][:4]}… tokens, {seq_len} each expected",
                          "calibrate on a corpus instead of 'self'")
    return torch.tensor(rows, dtype=torch.long)
