"""Turns a scheduled step into model inputs (token ids, slots, RoPE rows, block tables) and runs it."""

from __future__ import annotations

import torch

from .config import ModelArch
from .kernels.cpu_attention import use_cpu_attention
from .kernels.reference import block_rows
from .model import (
    DecodeGroup,
    ForwardBatch,
    KVCache,
    LlamaModel,
    PagedDecode,
    PrefillChunk,
)
from .rope import RotaryEmbedding
from .sequence import Sequence

GROUP_COST_BLOCKS = 12  # one more attention call costs about as much as padding this many blocks


def group_by_length(blocks: list[int], cost: int = GROUP_COST_BLOCKS) -> list[tuple[int, int]]:
    """Split ascending per-sequence block counts into ``(start, end)`` runs minimising
    ``cost * runs + sum(run length * its largest count)``: each run is padded to its longest
    sequence, and every extra run is one more attention call."""
    n = len(blocks)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            total = best[start] + cost + (end - start) * blocks[end - 1]
            if total < best[end]:
                best[end], cut[end] = total, start
    runs, end = [], n
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


class ModelRunner:
    """Owns the model and its KV cache; ``run`` computes the logits a step needs.

    ``kernels`` (auto / cpu / reference) picks decode attention: the C++ kernel through block
    tables when it is available (auto) or required (cpu), else the reference's padded groups."""

    def __init__(self, arch: ModelArch, model: LlamaModel, cache: KVCache, max_model_len: int, dtype: torch.dtype,
                 kernels: str = "auto") -> None:
        self.arch = arch
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.rope = RotaryEmbedding(arch, max_model_len, dtype)
        self.dtype = dtype
        self.cpu_attention = cache.data.device.type == "cpu" and use_cpu_attention(kernels)

    def prepare(self, items: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[Sequence]]:
        """The forward inputs for ``items`` and the sequences that get a new token (in row order)."""
        bs = self.block_size
        decodes = sorted((s for s, n in items if n == 1), key=lambda s: s.num_computed)
        chunks = [(s, n) for s, n in items if n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq in decodes:
            p = seq.num_computed
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p + 1 == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        prefills = []
        for seq, n in chunks:
            start, p = len(ids), seq.num_computed
            ids.extend(seq.token_ids[p:p + n])
            pos = range(p, p + n)
            positions.extend(pos)
            table = seq.block_table
            slots.extend(table[q // bs] * bs + q % bs for q in pos)
            if p == 0:
                prefills.append(PrefillChunk(start, n, None, None))
            else:
                ctx = p + n
                blocks = torch.tensor(table[:-(-ctx // bs)], dtype=torch.long)
                mask = torch.arange(ctx)[None, :] <= torch.arange(p, ctx)[:, None]
                prefills.append(PrefillChunk(start, n, self._rows(blocks), mask))
            if p + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        pos_t = torch.tensor(positions, dtype=torch.long)
        cos, sin = self._rope_rows([(s, 1) for s in decodes] + chunks, pos_t)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            slots=torch.tensor(slots, dtype=torch.long),
            cos=cos.unsqueeze(1),
            sin=sin.unsqueeze(1),
            decodes=[] if self.cpu_attention else self._decode_groups(decodes),
            paged_decode=self._paged_decode(decodes) if self.cpu_attention and decodes else None,
            prefills=prefills,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        )
        return batch, sampled

    def _rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_rows(block_ids, self.arch.num_kv_heads, self.cache.num_blocks)

    def _paged_decode(self, seqs: list[Sequence]) -> PagedDecode:
        """Block tables and context lengths of the decode sequences, for the C++ kernel."""
        bs = self.block_size
        lens = [s.num_computed + 1 for s in seqs]
        width = -(-max(lens) // bs)
        tables = [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in seqs]
        # int64: the kernel's own type (int32 would be converted again in every layer's call)
        return PagedDecode(0, len(seqs), torch.tensor(tables, dtype=torch.long), torch.tensor(lens, dtype=torch.long))

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """Decode sequences (sorted by length) in runs of similar length, each padded to its longest."""
        bs = self.block_size
        lens = [s.num_computed + 1 for s in seqs]
        groups = []
        for start, end in group_by_length([-(-n // bs) for n in lens]):
            width = lens[end - 1]
            nblocks = -(-width // bs)
            tables = [s.block_table[:nblocks] + [0] * (nblocks - min(nblocks, len(s.block_table))) for s in seqs[start:end]]
            rows = self._rows(torch.tensor(tables, dtype=torch.long))
            mask = None
            if lens[start] != width:
                visible = torch.arange(nblocks * bs)[None, :] < torch.tensor(lens[start:end])[:, None]
                mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))[:, None, None, :]
            groups.append(DecodeGroup(start, end - start, rows, width, mask))
        return groups

    def _rope_rows(self, items: list[tuple[Sequence, int]], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope.for_positions(positions)
        if not self.rope.length_dependent:
            return cos, sin
        row = 0
        for seq, n in items:  # sequences beyond the original context use length-scaled frequencies
            seq_len = seq.num_computed + n
            if seq_len > self.rope.original_max:
                c, s = self.rope.for_long_sequence(positions[row:row + n], seq_len)
                cos[row:row + n], sin[row:row + n] = c, s
            row += n
        return cos, sin

    def run(self, items: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the step; returns logits ``[len(sampled), vocab]`` and the sampled sequences."""
        batch, sampled = self.prepare(items)
        logits = self.model.forward(batch, self.cache)
        return logits, sampled
