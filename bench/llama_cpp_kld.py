"""Score a GGUF file in llama.cpp itself against a reference computed by us.

``llama-perplexity --kl-divergence`` compares a model's next-token distributions with the ones
saved in a "base" file. We write that file from any torch model (transformers' float model, our
dequantized checkpoint), in llama.cpp's own layout, so llama.cpp evaluates the GGUF on the same
tokens and reports mean / p99 KL divergence and top-1 agreement with our reference.

Base file layout (little-endian, as llama-perplexity writes it with ``--kl-divergence-base``):
``_logits_``, uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk × n_ctx]; then,
per chunk, for positions n_ctx/2 … n_ctx-2, ``2·⌈n_vocab/2⌉ + 4`` uint16: a float32 step and a
float32 minimum log-probability followed by each logit's offset above the clipped minimum
(at most 16 below the maximum) in steps of (max - min) / 65535.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import torch


def gguf_bos(path: Path) -> int | None:
    """The BOS id llama.cpp puts at each chunk's start, or None when the file does not add one."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    if add is None or not add.contents():
        return None
    return int(fields["tokenizer.ggml.bos_token_id"].contents())


def _records(logits: np.ndarray) -> np.ndarray:
    """llama.cpp's compressed log-probabilities of ``logits`` [positions, vocab] → uint16 [positions, nv]."""
    positions, n_vocab = logits.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    out = np.zeros((positions, nv), dtype=np.uint16)
    top = logits.max(axis=1)
    low = np.maximum(logits.min(axis=1), top - 16)
    log_sum = np.log(np.exp(logits.astype(np.float64) - top[:, None]).sum(axis=1)).astype(np.float32)
    step = ((top - low) / 65535.0).astype(np.float32)
    header = np.stack([step, (low - top - log_sum).astype(np.float32)], axis=1)
    out[:, :4] = header.view(np.uint16).reshape(positions, 4)
    safe = np.where(step > 0, step, 1.0)[:, None]
    values = np.where(logits > low[:, None], np.rint((logits - low[:, None]) / safe), 0)
    values[step == 0] = 0
    out[:, 4:4 + n_vocab] = values.astype(np.uint16)
    return out


@torch.inference_mode()
def write_base(path: Path, tokens: np.ndarray, logits_of: Callable[[torch.Tensor], torch.Tensor], bos: int | None) -> None:
    """Write the base file for ``tokens`` [n_chunk, n_ctx] with the reference ``logits_of(ids) → [n_ctx, vocab]``;
    each chunk starts with ``bos`` where llama.cpp adds one."""
    n_chunk, n_ctx = tokens.shape
    first = n_ctx // 2
    chunks = []
    n_vocab = None
    for row in tokens:
        ids = torch.tensor(row, dtype=torch.long)[None]
        if bos is not None:
            ids[0, 0] = bos
        logits = logits_of(ids).float().numpy()
        n_vocab = logits.shape[1]
        chunks.append(_records(logits[first:n_ctx - 1]))
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx], dtype=np.uint32).tobytes())
        f.write(np.array([n_vocab, n_chunk], dtype=np.int32).tobytes())
        f.write(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
        for records in chunks:
            f.write(records.tobytes())


def run_kld(bin_dir: Path, gguf: Path, base: Path, n_ctx: int, threads: int = 2, timeout: int = 600, tries: int = 3) -> dict:
    """llama-perplexity's KL divergence of ``gguf`` against ``base``: mean, p99, top-1 agreement.

    llama.cpp prints through a logging thread that the process sometimes leaves unflushed at exit
    (seen here: the statistics missing from a run that exited 0); such a run is repeated."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "--kl-divergence-base", str(base), "--kl-divergence",
           "-c", str(n_ctx), "-b", str(n_ctx), "-t", str(threads)]
    for attempt in range(tries):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text = done.stdout + done.stderr
        if done.returncode != 0:
            tail = [line for line in text.splitlines() if line.strip()][-3:]
            raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {' | '.join(tail)}")
        if re.search(r"Same top p\s*:", text):
            break
    return _statistics(text)


def _statistics(text: str) -> dict:
    def stat(pattern: str) -> float:
        found = re.search(pattern + r"\s*:\s*([-0-9.]+)", text)
        if not found:
            tail = " | ".join(line for line in text.splitlines()[-4:] if line.strip())
            raise RuntimeError(f"no '{pattern}' in llama-perplexity's output (it ends: {tail})")
        return float(found.group(1))

    return {"kld_mean": stat(r"Mean\s+KLD"), "kld_p99": stat(r"99\.0%\s+KLD"), "top1": stat(r"Same top p") / 100}
