"""What the Triton kernels share: the guarded import and a few helpers.

Triton is optional: without it the engine's backend choice (``runtime.backends``) never picks
the Triton backend. ``TRITON_INTERPRET=1`` (set before triton is first imported) runs the
same kernels on CPU tensors with numpy, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import os

import torch

try:  # triton is an optional dependency ("gpu" extra); everything here must import without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None


def triton_available() -> bool:
    """Whether triton could be imported."""
    return triton is not None


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs serially)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_dtype_is_f32(dtype: torch.dtype) -> bool:
    """Whether the kernels should feed ``tl.dot`` float32 operands: always for float32 inputs,
    and for bfloat16 under the interpreter, whose bfloat16 matmul is wrong (triton 3.8)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


if triton is not None:

    @triton.jit
    def fp8e4m3_bits_to_f32(bits):
        """float32 values of float8 e4m3fn codes given as integer bytes (NaN codes excepted).

        Exponent and mantissa shifted into a float16's bits give the value / 256 exactly
        (subnormals included), so no native fp8 conversion, which older GPUs lack, is needed."""
        b = bits.to(tl.int32)
        mag = ((b & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((b & 0x80) != 0, -mag, mag)
