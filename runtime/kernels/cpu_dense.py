"""C++ float GEMV for few rows (``csrc/dense.cpp``): ``x @ W.T + b`` with ``W`` the plain
``[out, in]`` float32 / bfloat16 / float16 weight.

At one to ``GEMV_ROWS`` rows (decode) each weight row is streamed once and dotted with every
activation row in float32 registers, split across torch's intra-op threads, with the
instruction set chosen at run time (AVX-512, AVX2 + FMA + F16C, or portable C++; ``isa`` or
``LLMOPT_CPU_ISA`` force one). More rows go to torch's linear (BLAS), which wins once a weight is
reused by many rows. Built at first use by :func:`build.load_extension`; when it cannot be built
:func:`available` is False and callers keep plain torch.
"""

from __future__ import annotations

import torch

from .build import IsaExtension

SOURCES = ["dense.cpp", "cpu_dense_avx2.cpp", "cpu_dense_avx512.cpp"]
GEMV_ROWS = 32  # the C++ default (kDefaultRows): up to these many rows run the GEMV


EXTENSION = IsaExtension("cpu_dense", SOURCES)
available = EXTENSION.available
supported_isas = EXTENSION.supported_isas
isa_code = EXTENSION.isa_code


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, isa: str | None = None,
           max_rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[..., in]`` of any float dtype and a contiguous
    ``weight`` ``[out, in]``; returned in ``x``'s dtype. ``max_rows`` (default ``GEMV_ROWS``)
    bounds the rows that run the GEMV; ``out`` (float32 ``x`` only) receives the result; ``isa``
    forces an instruction set (tests, benchmarks). Without the extension this is ``F.linear``."""
    module = EXTENSION.module()
    if module is None:
        y = torch.nn.functional.linear(x, weight, bias)
        return y if out is None else out.view(y.shape).copy_(y)
    return module.linear(x, weight, bias, isa_code(isa), -1 if max_rows is None else max_rows, out)
