"""The memory-bandwidth roofline of decoding: the machine's measured read bandwidth and the bytes
one decoded token reads (weights from the checkpoint, plus the KV cache of its context).

    python bench/bandwidth.py [--threads 2] [MODEL ...]   # bandwidth, and bytes per token of each model
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import torch

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "I32": 4, "I64": 8, "BOOL": 1}


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum) over a ``gib`` GiB float32 buffer, far larger
    than any cache, with ``threads`` torch threads; the best of ``repeats`` after a warm-up."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def _tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Name → (dtype, shape) of every tensor in the checkpoint's safetensors files (headers only)."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def _grid_savings(path: Path, config: dict) -> int:
    """Bytes the runtime does not read of int8 codes on the IQ4_NL grid (nl4 / nl4x): it repacks
    them as 4-bit indices, half their stored bytes."""
    if "quantization_config" not in config:
        return 0
    from llmopt.formats.compressed import read_compressed
    from llmopt.formats.schemes import on_grid

    weights, _ = read_compressed(path)
    return sum(qw.codes.numel() // 2 for qw in weights.values()
               if qw.scheme.num_bits == 8 and qw.zero_point is None and on_grid(qw.codes))


def bytes_per_token(path: str | Path, context: int, head: str = "auto") -> dict[str, int]:
    """Bytes a decoded token reads: every stored weight once (an untied input embedding only one
    row; a tied one once, as the output head), ``head`` ``bf16`` / ``int8`` the head at 2 / 1
    byte per weight (+ a float32 scale per row for int8), plus the float32 KV of ``context`` tokens;
    nl4 / nl4x codes at the half byte the runtime reads."""
    from llmopt.checkpoints.models import resolve_model

    path = resolve_model(str(path))
    config = json.loads((path / "config.json").read_text())
    tensors = _tensors(path)
    weights = 0
    head_numel = head_rows = 0
    for name, (dtype, shape) in tensors.items():
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPE_BYTES.get(dtype, 4)
        if name.endswith("embed_tokens.weight"):
            if config.get("tie_word_embeddings", False) and not any(n.endswith("lm_head.weight") for n in tensors):
                head_numel, head_rows = numel, shape[0]
                weights += nbytes
            else:
                weights += nbytes // shape[0]  # one row looked up
            continue
        if name.endswith("lm_head.weight"):
            head_numel, head_rows = numel, shape[0]
        weights += nbytes
    weights -= _grid_savings(path, config)
    if head != "auto" and head_numel:  # the head as the runtime holds it after --lm-head
        weights -= head_numel * 4
        weights += head_numel * 2 if head == "bf16" else head_numel + head_rows * 4
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = context * config["num_hidden_layers"] * 2 * heads * head_dim * 4
    return {"weights": weights, "kv": kv, "total": weights + kv}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    bw = read_bandwidth(args.threads)
    print(json.dumps({"read_bandwidth_gb_s": bw / 1e9, "threads": args.threads,
                      **{m: bytes_per_token(m, args.context) for m in args.models}}, indent=2))


if __name__ == "__main__":
    main()
