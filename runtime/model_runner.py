"""Turns a scheduled step into model inputs (token ids, slots, RoPE rows, block tables) and runs it."""

from __future__ import annotations

import torch

from .backends import AttentionMetadata, ForwardBatch, PrefillChunk
from .config import ModelArch
from .kernels.reference import block_rows
from .kv_cache import KVCache
from .kv_sinks import SINK_TOKENS
from .model import LlamaModel
from .rope import RotaryEmbedding
from .sequence import Sequence


class ModelRunner:
    """Owns the model and its KV cache; ``run`` computes the logits a step needs. Inputs are
    built on the CPU and moved to the cache's device in one go."""

    def __init__(self, arch: ModelArch, model: LlamaModel, cache: KVCache, max_model_len: int, dtype: torch.dtype) -> None:
        self.arch = arch
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.rope = RotaryEmbedding(arch, max_model_len, dtype)
        self.device = cache.data.device

    def prepare(self, items: list[tuple[Sequence, int]], prompt_rows: list | None = None) -> tuple[ForwardBatch, list[Sequence]]:
        """The forward inputs for ``items`` and the sequences that get a new token (in row order).
        With ``prompt_rows``, the rows of prompt positions whose next prompt token's log-probability
        a sequence asked for are computed too (after the sampled rows): ``(seq, positions)`` pairs
        are appended to it, in that row order."""
        bs = self.block_size
        sinks = self.cache.sinks
        if sinks is not None:
            sinks.begin_step()
        # decode rows (sequence, position), ascending context: one per decoding sequence, and one
        # per token being verified for a sequence with proposed tokens (speculative decoding:
        # each attends like a decode token, to the cache up to and including itself)
        decodes = sorted(((s, s.num_computed + i) for s, n in items if n == 1 or s.spec_tokens for i in range(n)),
                         key=lambda row: row[1])
        chunks = [(s, n) for s, n in items if n > 1 and not s.spec_tokens]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        extra: list[int] = []  # prompt rows scored for prompt log-probabilities (after the sampled ones)
        sink_writes: list[tuple[int, int]] = []  # (batch row of a sequence's position 0, its sink entry)
        for seq, p in decodes:
            if p == 0 and sinks is not None and SINK_TOKENS == 1:  # a one-token prompt: its only token is its sink
                entry = sinks.claim(seq.first_tokens(SINK_TOKENS))
                if entry >= 0:
                    sink_writes.append((len(ids), entry))
            ids.append(seq.token_at(p))
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p + 1 >= seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
            elif prompt_rows is not None and seq.prompt_logprobs is not None and p + 1 < seq.num_prompt_tokens:
                extra.append(len(ids) - 1)  # a one-token prompt chunk
                prompt_rows.append((seq, [p]))
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
                if sinks is not None and n >= SINK_TOKENS:
                    entry = sinks.claim(seq.first_tokens(SINK_TOKENS))
                    if entry >= 0:
                        sink_writes.append((start, entry))
            else:
                ctx = p + n
                blocks = torch.tensor(table[:-(-ctx // bs)], dtype=torch.long)
                mask = torch.arange(ctx)[None, :] <= torch.arange(p, ctx)[:, None]
                sink = sinks.lookup(seq.first_tokens(SINK_TOKENS)) if sinks is not None else -1
                prefills.append(PrefillChunk(start, n, self._rows(blocks), mask, sink))
            if p + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
            if prompt_rows is not None and seq.prompt_logprobs is not None and p + 1 < seq.num_prompt_tokens:
                scored = range(p, min(p + n, seq.num_prompt_tokens - 1))  # each predicts a prompt token
                extra.extend(start + q - p for q in scored)
                prompt_rows.append((seq, list(scored)))
        sample_rows += extra
        pos_t = torch.tensor(positions, dtype=torch.long)
        cos, sin = self._rope_rows([(p + 1, 1) for _, p in decodes] + [(s.num_computed + n, n) for s, n in chunks], pos_t)
        attn = AttentionMetadata(torch.tensor(slots, dtype=torch.long), len(decodes), prefills=prefills,
                                 key_blocks=pos_t // self.block_size)
        if decodes:
            attn.block_tables, attn.context_lens = self._block_tables(decodes)
        if sinks is not None:
            if decodes:
                attn.decode_sinks = torch.tensor([sinks.lookup(s.first_tokens(SINK_TOKENS)) for s, _ in decodes], dtype=torch.long)
            if sink_writes:
                attn.sink_writes = tuple(torch.tensor(column, dtype=torch.long) for column in zip(*sink_writes))
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long), cos.unsqueeze(1), sin.unsqueeze(1), attn,
                             torch.tensor(sample_rows, dtype=torch.long), pos_t)
        return (batch if self.device.type == "cpu" else batch.to(self.device)), sampled

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward; a failed one leaves no half-written sink entry behind."""
        try:
            return self.model.forward(batch, self.cache)
        except BaseException:
            if self.cache.sinks is not None:
                self.cache.sinks.discard_pending()
            raise

    def _rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        return block_rows(block_ids, self.arch.num_kv_heads, self.cache.num_blocks)

    def _block_tables(self, rows: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables (padded with block 0) and context lengths of the decode rows (int64:
        the C++ kernel's own type, not converted again in every layer)."""
        bs = self.block_size
        seqs = [s for s, _ in rows]
        lens = [p + 1 for _, p in rows]
        width = -(-max(lens) // bs)
        tables = [s.block_table[:width] + [0] * (width - min(width, len(s.block_table))) for s in seqs]
        return torch.tensor(tables, dtype=torch.long), torch.tensor(lens, dtype=torch.long)

    def _rope_rows(self, items: list[tuple[int, int]], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE rows; ``items`` are (sequence length after the rows, number of rows) in row order."""
        cos, sin = self.rope.for_positions(positions)
        if not self.rope.length_dependent:
            return cos, sin
        row = 0
        for seq_len, n in items:  # sequences beyond the original context use length-scaled frequencies
            if seq_len > self.rope.original_max:
                c, s = self.rope.for_long_sequence(positions[row:row + n], seq_len)
                cos[row:row + n], sin[row:row + n] = c, s
            row += n
        return cos, sin

    def run(self, items: list[tuple[Sequence, int]], prompt_rows: list | None = None) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the step; returns logits ``[len(sampled), vocab]`` and the sampled sequences (a
        sequence with proposed tokens once per verified row, in position order). With
        ``prompt_rows`` (a list), ``(seq, positions, logits [len(positions), vocab])`` is appended
        for each sequence whose prompt log-probabilities this step scores."""
        scored: list | None = [] if prompt_rows is not None else None
        batch, sampled = self.prepare(items, scored)
        if not scored:
            return self._forward(batch), sampled
        rows, order = batch.sample_rows.sort()  # the models take rows in ascending order
        batch.sample_rows = rows
        logits = torch.empty_like(computed := self._forward(batch))
        logits[order] = computed
        row = len(sampled)
        for seq, positions in scored or ():
            prompt_rows.append((seq, positions, logits[row:row + len(positions)]))
            row += len(positions)
        return logits[:len(sampled)], sampled
