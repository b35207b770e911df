"""One column of a quantizer's column loop: its codes for given scales, and the thread setting
the loop's small steps run under (shared by GPTQ, SparseGPT and the code descent)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llmopt.formats.fp4 import round_to_e2m1
from llmopt.formats.schemes import FP8_MAX, QuantScheme, round_to_grid

SMALL_STEP = 1 << 21  # elements a step touches below which its ops are latency-bound: one thread


@contextmanager
def column_loop_threads(t: torch.Tensor | torch.device, work: int = 0) -> Iterator[None]:
    """One CPU thread for the small steps of GPTQ / SparseGPT (on CPU tensors, or given their
    device: a tensor passed here stays referenced until the block ends), when each step touches
    fewer than ``SMALL_STEP`` elements (``work``; 0: always).

    Each column step is a few small vector ops; with several threads every op waits for all of
    them, which on a loaded machine costs milliseconds per op (two of the demo model's GPTQ
    solves: 48.7 s with 2 threads, 1.8 s with 1, on a shared 2-core machine). Large models'
    steps (a 7B's [128, 28672] row updates) and the factorizations and block updates outside
    these blocks keep every thread.
    """
    if (t if isinstance(t, torch.device) else t.device).type != "cpu" or work >= SMALL_STEP:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quantize_column(
    w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized values (both float32) of one weight column, exactly as
    :func:`~.formats.quantize` / :func:`~.formats.dequantize` compute them."""
    if scheme.is_fp4:
        code = round_to_e2m1(w / scale)
        return code, code * scale
    if scheme.is_float:
        code = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return code, code * scale
    if scheme.grid is not None:
        code = round_to_grid(w / scale, scheme.grid)
        return code, code * scale
    if zp is None:
        code = torch.round(w / scale).clamp_(scheme.qmin, scheme.qmax)
        return code, code * scale
    # a float zero point (llama.cpp's mins) is added before rounding; an integer one after, as quantize does
    code = torch.round(w / scale + zp) if scheme.float_zero else torch.round(w / scale).add_(zp)
    code.clamp_(scheme.qmin, scheme.qmax)
    return code, (code - zp) * scale
