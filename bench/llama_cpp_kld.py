"""Score a GGUF file run by llama.cpp itself against a reference computed by us.

``llama-perplexity --kl-divergence-base FILE -f TEXT`` evaluates the GGUF on TEXT and saves the
tokens it used and, for each position in the second half of every chunk, its whole next-token
log-probability distribution. We read that file, run our reference model (transformers' float
model, our dequantized checkpoint) on the very same tokens, and compute KL(reference ‖ llama.cpp)
and top-1 agreement ourselves. (Its own statistics pass through a logging thread llama.cpp does not
flush at exit, so runs here lost them at random; the file is written directly.)

File layout (little-endian): ``_logits_``, uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32
tokens[n_chunk × n_ctx]; then per chunk, for positions n_ctx/2 … n_ctx-2, ``2·⌈n_vocab/2⌉ + 4``
uint16: a float32 step, a float32 minimum log-probability, then each token's offset above that
minimum in steps (0: at or below the minimum, which is at most 16 below the top log-probability).
"""

from __future__ import annotations

import subprocess
import tempfile
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


def llama_cpp_distributions(bin_dir: Path, gguf: Path, text: str, n_ctx: int, chunks: int, threads: int = 2,
                            timeout: int = 1800, extra: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [chunks, n_ctx], log-probabilities [chunks, n_ctx/2 - 1, vocab]) of ``gguf`` on ``text``, by llama.cpp
    (``extra``: more llama-perplexity arguments, such as KV cache types)."""
    with tempfile.TemporaryDirectory() as tmp:
        text_file, out = Path(tmp) / "text.txt", Path(tmp) / "logits.bin"
        text_file.write_text(text)
        cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx),
               "--chunks", str(chunks), "-t", str(threads), "--kl-divergence-base", str(out), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.is_file():
            tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-3:]
            raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {' | '.join(tail)}")
        return read_distributions(out.read_bytes())


def read_distributions(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    if raw[:8] != b"_logits_":
        raise RuntimeError("not a llama-perplexity logits file")
    n_ctx = int(np.frombuffer(raw, np.uint32, 1, 8)[0])
    n_vocab, n_chunk = (int(x) for x in np.frombuffer(raw, np.int32, 2, 12))
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    positions = n_ctx - 1 - n_ctx // 2
    nv = 2 * ((n_vocab + 1) // 2) + 4
    records = np.frombuffer(raw, np.uint16, n_chunk * positions * nv, 20 + 4 * n_chunk * n_ctx).reshape(n_chunk, positions, nv)
    header = np.ascontiguousarray(records[..., :4]).view(np.float32)  # [chunks, positions, 2]: step, minimum
    logp = header[..., 1:2] + records[..., 4:4 + n_vocab].astype(np.float32) * header[..., 0:1]
    return tokens, logp


@torch.inference_mode()
def compare_with(reference: Callable[[torch.Tensor], torch.Tensor], tokens: np.ndarray, logp: np.ndarray,
                 bos: int | None) -> dict:
    """KL(reference ‖ llama.cpp) (mean, p99) and top-1 agreement over every saved position;
    ``reference(ids [1, n_ctx]) → logits [n_ctx, vocab]`` runs on llama.cpp's own tokens."""
    n_ctx = tokens.shape[1]
    first = n_ctx // 2
    klds, same = [], []
    for row, theirs in zip(tokens, logp):
        ids = torch.tensor(row, dtype=torch.long)[None].clone()
        if bos is not None:
            ids[0, 0] = bos
        ours = reference(ids).float()[first:n_ctx - 1]
        ours = ours[:, :theirs.shape[1]].log_softmax(-1)
        # llama.cpp's own log-probabilities; those clipped to the minimum (16 below the top) weigh in
        # with the reference's probability there, at most e^-16 each
        theirs = torch.from_numpy(np.ascontiguousarray(theirs))
        klds.append((ours.exp() * (ours - theirs)).sum(-1))
        same.append(ours.argmax(-1) == theirs.argmax(-1))
    kld = torch.cat(klds)
    return {"kld_mean": kld.mean().item(), "kld_p99": kld.quantile(0.99).item(), "top1": torch.cat(same).float().mean().item(),
            "positions": kld.numel()}
