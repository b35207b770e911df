"""What the machine computes natively: bfloat16 arithmetic decides whether mixed precision pays."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether the CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX); float32 otherwise."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return bool(set(line.split()) & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 is computed natively on ``device`` (faster than float32 there). Without
    it a CPU emulates bfloat16 matmuls, about 4× slower than float32 (2-core AVX2 machine)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()
