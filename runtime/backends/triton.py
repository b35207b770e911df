"""Triton kernels (``kernels.triton_*``): quantized linears and paged decode attention on CUDA.

Float linears run torch's (cuBLAS), prompt chunks the reference attention, the elementwise
steps the composites. Under Triton's interpreter (``TRITON_INTERPRET=1``) the same kernels run
on CPU tensors: that is how the tests run the whole engine on this backend without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.formats.hadamard import fast_transform_inputs

from ..kernels.triton_attention import triton_paged_decode_attention
from ..kernels.triton_common import interpreting, triton_available
from ..kernels.triton_linear import pack_weight, triton_quant_linear
from ..layers import DenseLinear, QuantLinear
from .base import AttentionMetadata, Backend, decode_sinks


KERNEL_BITS = {"int4": 4, "int8": 8, "nl4": 8}  # a weight format's kernel → the code width the Triton kernel runs


def unavailable_reason(device: torch.device) -> str | None:
    if not triton_available():
        return "triton is not installed (pip install 'llmopt[gpu]', or triton)"
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return f"the Triton kernels run on CUDA devices, not on {device} (on the CPU only under TRITON_INTERPRET=1, for tests)"


class TritonBackend(Backend):
    """Quantized weights repacked once (:func:`pack_weight`) for :func:`triton_quant_linear`;
    decode tokens attend through their block tables in place (flash-decoding partitions)."""

    name = "triton"

    def prepare_linear(self, lin: DenseLinear | QuantLinear) -> None:
        if isinstance(lin, DenseLinear):
            lin.set_layout(transposed=False)
            weight, bias = lin.weight, lin.bias
            lin.run = lambda x: F.linear(x, weight.to(x.dtype), bias)
            return
        try:  # the format's kernel (nl4's grid codes run as int8 here); None: from the codes
            packed = pack_weight(lin.codes, lin.scale, lin.zero_point, lin.group_size, KERNEL_BITS.get(lin.kernel))
        except (TypeError, ValueError):  # a layout the kernel does not cover: dequantized per call
            super().prepare_linear(lin)
            return
        lin.packed, lin.codes = packed, lin.codes[:, :0]  # the packed copy replaces the codes
        activations, bias = lin.activations, lin.bias
        lin.run = lambda x: triton_quant_linear(x, packed, activations, bias)

    def input_transform(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """The online Hadamard as a fast Walsh–Hadamard transform (float32 butterflies on the GPU)."""
        return fast_transform_inputs(x, block)

    def decode_attention(self, q: torch.Tensor, meta: AttentionMetadata, cache, index: int, scale: float) -> torch.Tensor:
        tables = meta.derived.get("tables32")
        if tables is None:
            tables = meta.derived["tables32"] = (meta.block_tables.to(torch.int32), meta.context_lens.to(torch.int32))
        return triton_paged_decode_attention(q, cache.k[index], cache.v[index], tables[0], tables[1], cache.block_size, scale,
                                             cache.k_scale[index], cache.v_scale[index], sinks=decode_sinks(cache, meta, index),
                                             key_offsets=cache.offsets_of(index))


BACKEND = TritonBackend
