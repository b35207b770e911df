"""How llama.cpp rounds the input of a matmul with a quantized weight.

ggml multiplies a quantized weight with its input converted to the weight type's ``vec_dot_type``:
int8 blocks — Q8_0 / Q8_1 (32 values, the step ``max|x| / 127`` kept in float16) for Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0 and IQ4_NL weights; Q8_K (256 values, a float32 step) for the k-quants and the
256-block i-quants — float16 for F16 weights, bfloat16 for BF16, and float32 inputs stay as they
are. AWQ's scale search for llama.cpp counts this rounding (:mod:`llmopt.quant.awq`), and the
interop bench rounds its reference this way to compare llama.cpp with the model it computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INT8_LEVELS = 127  # an int8 activation block's step: its largest |x| / 127
Q8_0_INPUTS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"})
Q8_K_INPUTS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS",
                         "IQ2_XXS", "IQ1_S", "IQ1_M"})


def rounded_to_int8_blocks(x: torch.Tensor, block: int, half_step: bool = False) -> torch.Tensor:
    """``x`` (``[..., in]``, ``in`` a multiple of ``block``) as llama.cpp's int8 blocks hold it:
    per ``block`` values, codes ``round(x / step)`` with ``step = max|x| / 127``, the step kept in
    float16 when ``half_step`` (Q8_0 / Q8_1) — in ``x``'s dtype."""
    xf = x.float()
    blocks = xf.reshape(*xf.shape[:-1], -1, block)
    step = blocks.abs().amax(-1, keepdim=True) / INT8_LEVELS
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = torch.round(blocks * inverse).clamp(-INT8_LEVELS, INT8_LEVELS)
    kept = step.half().float() if half_step else step
    return (codes * kept).reshape(xf.shape).to(x.dtype)


def input_rounding(ggml_type: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How llama.cpp rounds the input of a matmul with a ``ggml_type`` weight (a type name such as
    ``"Q4_K"``); None when the input stays float32."""
    if ggml_type in Q8_0_INPUTS:
        return lambda x: rounded_to_int8_blocks(x, 32, half_step=True)
    if ggml_type in Q8_K_INPUTS:
        return lambda x: rounded_to_int8_blocks(x, 256)
    if ggml_type == "F16":
        return lambda x: x.half().to(x.dtype)
    if ggml_type == "BF16":
        return lambda x: x.bfloat16().to(x.dtype)
    return None
