"""Rotary position embeddings: cos / sin tables computed once, looked up per step.

The inverse frequencies come from transformers' own RoPE init functions (default, linear,
llama3, yarn, dynamic NTK, longrope), so scaled variants match what the config asks for.
Dynamic NTK and longrope depend on the sequence length: like transformers, a sequence whose
length exceeds the original context uses frequencies computed for its current length.

Layout follows transformers (``rotate_half``): the two halves of a head are the pairs.
Applying it is ``x * cos + roll(x, half) * sin_signed`` with ``sin_signed = [-sin, sin]``.
"""

from __future__ import annotations

import torch

from .config import ModelArch


def _inv_freq(arch: ModelArch, rope_type: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    cfg = arch.hf_config
    if rope_type == "default":
        base = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        dim = arch.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if seq_len is None else {"seq_len": seq_len}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, **kwargs)
    return inv_freq.float(), float(scaling)


def _tables(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * scaling
    sin = emb.sin() * scaling
    half = inv_freq.shape[0]
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.to(dtype), sin.to(dtype)


class RotaryEmbedding:
    """cos / sin (signed) rows for any positions of any sequence."""

    def __init__(self, arch: ModelArch, max_len: int, dtype: torch.dtype) -> None:
        self.arch = arch
        self.rope_type = arch.rope_type
        self.dtype = dtype
        self.original_max = arch.max_position_embeddings
        params = getattr(arch.hf_config, "rope_parameters", None) or {}
        if self.rope_type == "longrope":
            self.original_max = params.get("original_max_position_embeddings", arch.max_position_embeddings)
        # Length-dependent types use their short-context frequencies below the original length.
        inv_freq, scaling = _inv_freq(arch, self.rope_type, seq_len=self._base_len())
        self.cos, self.sin = _tables(inv_freq, scaling, torch.arange(max_len), dtype)

    def _base_len(self) -> int | None:
        if self.rope_type == "dynamic":
            return self.arch.max_position_embeddings
        if self.rope_type == "longrope":
            return self.original_max
        return None

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for ``positions`` of sequences within the original context."""
        return self.cos[positions], self.sin[positions]

    def for_long_sequence(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for a sequence that has grown to ``seq_len`` tokens (dynamic / longrope)."""
        if not self.length_dependent or seq_len <= self.original_max:
            return self.for_positions(positions)
        inv_freq, scaling = _inv_freq(self.arch, self.rope_type, seq_len=seq_len)
        return _tables(inv_freq, scaling, positions, self.dtype)


def block_means(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """``table`` ``[positions, head_dim]`` (cos or signed sin rows) averaged over each run of
    ``block_size`` positions, float32 ``[blocks, head_dim]`` (the last run may be shorter)."""
    rows = table.float()
    blocks = -(-rows.shape[0] // block_size)
    padded = torch.nn.functional.pad(rows, (0, 0, 0, blocks * block_size - rows.shape[0]))
    counts = torch.full((blocks, 1), float(block_size))
    counts[-1] = rows.shape[0] - (blocks - 1) * block_size
    return padded.view(blocks, block_size, -1).sum(1) / counts


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` with per-token ``cos``/``sin`` ``[tokens, 1, head_dim]``."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rotated, sin)
