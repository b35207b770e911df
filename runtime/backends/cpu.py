"""The C++ CPU kernels (``kernels.cpu_*``): linears, paged decode attention, fused float32 steps, argmax."""

from __future__ import annotations

import torch
from llmopt.core.errors import LlmoptError

from ..kernels import cpu_attention, cpu_dense, cpu_fused, cpu_linear
from ..kernels.reference import Workspace
from ..layers import DenseLinear, QuantLinear
from .base import AttentionMetadata, Backend, ForwardBatch, decode_sinks


EXACT_HEAD_ROWS = 16  # up to these many rows a float head keeps the exact GEMV under medium / low


def available() -> bool:
    """Whether every C++ extension builds here (and ``LLMOPT_KERNELS=reference`` is not set)."""
    return all(ext.available() for ext in (cpu_linear, cpu_dense, cpu_fused, cpu_attention))


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"the C++ kernels run on the CPU, not on {device}"
    if not available():
        return "the C++ CPU kernels are not available (no C++ compiler, a failed build, or LLMOPT_KERNELS=reference)"
    return None


class CpuBackend(Backend):
    """Quantized weights packed for the C++ kernels (formats they do not cover keep the
    reference), float weights ``[out, in]`` for the C++ GEMV, decode attention reading the cache
    through block tables in place; float32 models also run the residual add + RMSNorm, SwiGLU's
    product and RoPE + KV write as one C++ call each (other dtypes: the composites)."""

    name = "cpu"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.ops = cpu_fused.extension() if dtype == torch.float32 else None  # called directly: 30 layers a token
        self.paged = cpu_attention.extension().paged_decode
        self.out_space = Workspace(dtype)  # the decode attention's output, consumed by o before the next layer

    def prepare_linear(self, lin: DenseLinear | QuantLinear) -> None:
        if isinstance(lin, DenseLinear):
            lin.set_layout(transposed=False)
            weight, bias = lin.weight, lin.bias
            lin.run = lambda x: cpu_dense.linear(x, weight, bias)
            return
        lin.packed = cpu_linear.pack(lin.codes, lin.scale, lin.zero_point, lin.group_size, lin.activations, lin.kernel)
        if lin.packed is None:
            super().prepare_linear(lin)
            return
        lin.codes = lin.codes[:, :0]  # the packed copy replaces them (int4 codes one per byte would double the memory)
        low = self.matmul_precision == "low"
        bf16 = self.matmul_precision == "medium" or (low and cpu_linear.bf16_supported())
        lin.run = cpu_linear.bind(lin.packed, lin.bias, bf16=bf16, levels=1 if low else 3)

    def input_transform(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """The fast Walsh–Hadamard transform in C++ for float32 inputs."""
        if self.ops is None or x.dtype != torch.float32:
            return super().input_transform(x, block)
        return self.ops.hadamard(x.contiguous(), block)

    def prepare_head(self, head: DenseLinear | QuantLinear) -> None:
        """Under ``medium`` / ``low`` (AVX512-BF16 CPUs) a float head also keeps a bfloat16 copy in
        the panel's pair layout (``cpu_linear.pack_bf16``: as many bytes again as a 16-bit head) for
        more than ``EXACT_HEAD_ROWS`` rows at once, decode of many sequences: bfloat16 products, twice
        the float GEMV's products per instruction. Fewer rows keep the exact GEMV."""
        if not isinstance(head, DenseLinear) or self.matmul_precision == "highest":
            return
        pairs = cpu_linear.pack_bf16(head.weight)
        if pairs is None:
            return
        exact, bias, rows = head.run, head.bias, EXACT_HEAD_ROWS * head.weight.shape[1]
        head.extra = pairs
        head.run = lambda x: exact(x) if x.numel() <= rows else cpu_linear.linear(x, pairs, bias, bf16=True)

    def set_matmul_precision(self, precision: str) -> None:
        """``medium``: the quantized linears' panel path multiplies in bfloat16 (AVX512-BF16 CPUs
        only); ``low``: int8 activations in the integer GEMV at every batch size (AVX2 or AVX-512),
        bfloat16 products elsewhere where the CPU has them."""
        if precision == "medium" and not cpu_linear.bf16_supported():
            raise LlmoptError("matmul_precision=medium needs a CPU with AVX512-BF16 (bfloat16 dot products); this one has none",
                              "leave matmul_precision at highest")
        if precision == "low" and cpu_linear.running_isa() == "scalar":
            raise LlmoptError("matmul_precision=low needs the AVX2 or AVX-512 kernels (integer dot products); they do not run here "
                              "(this CPU, or LLMOPT_CPU_ISA=scalar)", "leave matmul_precision at highest")
        self.matmul_precision = precision

    def add_rms_norm(self, h, delta, weight, eps, out):
        if self.ops is None:
            return super().add_rms_norm(h, delta, weight, eps, out)
        self.ops.add_rms_norm(h, delta, weight, eps, out)
        return out

    def silu_mul(self, gate_up):
        if self.ops is None:
            return super().silu_mul(gate_up)
        return self.ops.silu_mul(gate_up)

    def rope_and_store(self, qkv, heads, qk_norm, eps, batch: ForwardBatch, cache, index):
        """In place on ``qkv``; a float cache is written in the same call."""
        if self.ops is None:
            return super().rope_and_store(qkv, heads, qk_norm, eps, batch, cache, index)
        k_cache, v_cache = cache.k[index], cache.v[index]
        kv_heads, dim = k_cache.shape[0], cache.head_dim
        slots = batch.attn.slots
        fused_write = k_cache.dtype == torch.float32  # the fused step writes float32 caches
        if fused_write:
            self.ops.rope(qkv, batch.cos, batch.sin, heads, kv_heads, qk_norm, eps, k_cache, v_cache, slots)
        else:
            self.ops.rope(qkv, batch.cos, batch.sin, heads, kv_heads, qk_norm, eps, None, None, None)
        qkv = cache.qkv_to_cache_basis(qkv.view(qkv.shape[0], heads + 2 * kv_heads, dim), heads, index)
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        if fused_write:
            return q, k, v
        if cache.scales is not None:  # quantized in one C++ call (self.ops runs float32 models only)
            offsets = cache.offsets_of(index)
            self.ops.store_kv(k, v, slots, k_cache, v_cache, cache.k_scale[index], cache.v_scale[index], offsets,
                              None if offsets is None else batch.attn.key_blocks)
            cache.store_sinks(index, k, v, batch.attn.sink_writes)
        else:
            cache.store(index, k, v, slots, batch.attn.sink_writes, batch.attn.key_blocks)
        return q, k, v

    def decode_attention(self, q: torch.Tensor, meta: AttentionMetadata, cache, index: int, scale: float) -> torch.Tensor:
        out = self.out_space.take(q.shape[0], q.shape[1] * q.shape[2])
        return self.paged(q, cache.k[index], cache.v[index], cache.k_scale[index], cache.v_scale[index], meta.block_tables,
                          meta.context_lens, cache.block_size, scale, out, False, 0,
                          *(decode_sinks(cache, meta, index) or (None, None, None)), cache.offsets_of(index))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype == torch.float32 and logits.is_contiguous():
            return cpu_fused.extension().argmax(logits)
        return logits.argmax(-1)


BACKEND = CpuBackend
