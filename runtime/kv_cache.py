"""The paged KV cache: per layer K and V tensors, with scales when quantized."""

from __future__ import annotations

import torch

from .config import ModelArch
from .kernels import kv_quant
from .kernels.reference import Workspace


class KVCache:
    """Per layer K and V tensors ``[kv_heads, num_blocks * block_size, head_dim]``.

    ``kv_cache_dtype`` ``auto`` stores values in the model's dtype; ``int8`` / ``fp8`` store
    codes (one byte each) with float32 scales ``[kv_heads, num_blocks * block_size]`` per layer
    (one per token and KV head, see ``kernels.kv_quant``). Allocated once with ``torch.empty``:
    the operating system backs pages only as blocks are first written, so resident memory
    follows the blocks actually used.
    """

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        storage = kv_quant.storage_dtype(kv_cache_dtype, dtype)
        shape = (arch.num_layers, 2, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)
        self.data = torch.empty(shape, dtype=storage, device=device)
        self.k = [self.data[i, 0] for i in range(arch.num_layers)]
        self.v = [self.data[i, 1] for i in range(arch.num_layers)]
        self.scales = None
        self.k_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        if kv_quant.is_quantized(kv_cache_dtype):
            self.scales = torch.empty(shape[:-1], dtype=kv_quant.SCALE_DTYPE, device=device)
            self.k_scale = [self.scales[i, 0] for i in range(arch.num_layers)]
            self.v_scale = [self.scales[i, 1] for i in range(arch.num_layers)]
        self.k_space = Workspace(storage, device)  # scratch for gathered context, reused by every layer
        self.v_space = Workspace(storage, device)

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        element = torch.empty((), dtype=kv_quant.storage_dtype(kv_cache_dtype, dtype)).element_size()
        per_token_head = arch.head_dim * element
        if kv_quant.is_quantized(kv_cache_dtype):
            per_token_head += torch.empty((), dtype=kv_quant.SCALE_DTYPE).element_size()
        return arch.num_layers * 2 * arch.num_kv_heads * block_size * per_token_head

    @property
    def nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total
