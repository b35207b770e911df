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

import os
from types import ModuleType

import torch
from llmopt.errors import LlmoptError

from .build import load_extension

SOURCES = ["dense.cpp", "cpu_dense_avx2.cpp", "cpu_dense_avx512.cpp"]
ISAS = ("scalar", "avx2", "avx512")
GEMV_ROWS = 32  # the C++ default (kDefaultRows): up to these many rows run the GEMV


def _module() -> ModuleType | None:
    return load_extension("cpu_dense", SOURCES)


def available() -> bool:
    """True when the extension is built (or can be) and not disabled by ``LLMOPT_KERNELS=reference``."""
    return _module() is not None


def supported_isas() -> list[str]:
    """Instruction sets this CPU runs, slowest first (``scalar`` always)."""
    module = _module()
    return list(module.supported_isas()) if module is not None else []


_env_isa: list[int] = []  # LLMOPT_CPU_ISA's code, read once (a lookup per call costs more than a small GEMV)


def isa_code(isa: str | None) -> int:
    """The extension's code for ``isa`` (None: ``LLMOPT_CPU_ISA``, else -1 = the best one)."""
    if isa is None:
        if not _env_isa:
            _env_isa.append(isa_code(os.environ.get("LLMOPT_CPU_ISA") or "auto"))
        return _env_isa[0]
    if isa == "auto":
        return -1
    if isa not in ISAS:
        raise LlmoptError(f"unknown instruction set {isa!r} for the CPU kernels", f"use one of auto, {', '.join(ISAS)}")
    if isa not in supported_isas():
        raise LlmoptError(f"this CPU cannot run the {isa} kernels", f"use one of: auto, {', '.join(supported_isas())}")
    return ISAS.index(isa)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, isa: str | None = None,
           max_rows: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[..., in]`` of any float dtype and a contiguous
    ``weight`` ``[out, in]``; returned in ``x``'s dtype. ``max_rows`` (default ``GEMV_ROWS``)
    bounds the rows that run the GEMV; ``out`` (float32 ``x`` only) receives the result; ``isa``
    forces an instruction set (tests, benchmarks). Without the extension this is ``F.linear``."""
    module = _module()
    if module is None:
        y = torch.nn.functional.linear(x, weight, bias)
        return y if out is None else out.view(y.shape).copy_(y)
    return module.linear(x, weight, bias, isa_code(isa), -1 if max_rows is None else max_rows, out)
