"""llama.cpp's rounding of matmul inputs, checked against gguf-py's reference quantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmopt.formats.llama_cpp_inputs import input_rounding, rounded_to_int8_blocks


def activations(seed: int, rows: int, width: int) -> torch.Tensor:
    """Seeded inputs with a few large channels, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[:, torch.randint(0, width, (3,), generator=g)] *= 30
    x[0, :32] = 0  # an all-zero block stays zero
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_q8_0_inputs_equal_gguf_reference(seed):
    """Q8_0 (the inputs of Q4_0 / Q5_0 / Q8_0 / IQ4_NL weights): blocks of 32, float16 steps —
    value for value what gguf-py's Q8_0 quantize-dequantize gives."""
    x = activations(seed, 6, 256)
    want = dequantize(quantize(x.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    got = input_rounding("Q5_0")(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert np.array_equal(got.numpy(), want.astype(np.float32))
    assert torch.equal(got[0, :32], torch.zeros(32))


def test_q8_k_inputs_round_per_256_with_exact_steps():
    """Q8_K (the inputs of the k-quants): one float32 step per 256 values, every value within
    half a step, the largest kept exactly; a block's scale does not reach the next block."""
    x = activations(2, 4, 512)
    got = input_rounding("Q4_K")(x)
    assert got.shape == x.shape
    blocks, rounded = x.reshape(4, 2, 256), got.reshape(4, 2, 256)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert ((rounded - blocks).abs() <= step / 2 + 1e-6).all()
    top = blocks.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(rounded.gather(-1, top), blocks.gather(-1, top), rtol=1e-6, atol=0)
    x2 = x.clone()
    x2[:, 256:] *= 100  # only the second block's step changes
    assert torch.equal(input_rounding("Q4_K")(x2)[:, :256], got[:, :256])
    assert not torch.equal(rounded_to_int8_blocks(x, 32), got)  # 32-value blocks differ


def test_float_weights_keep_or_round_to_their_type():
    x = activations(3, 2, 64)
    assert input_rounding("F32") is None
    assert torch.equal(input_rounding("F16")(x), x.half().float())
    assert torch.equal(input_rounding("BF16")(x), x.bfloat16().float())
