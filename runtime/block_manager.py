"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, prefix caching.

A block holds the KV of ``block_size`` consecutive tokens of one sequence. Full blocks are
registered under a chained hash of all tokens up to their end; a new sequence whose prompt
starts with the same tokens reuses them (after checking the tokens really are equal).
Freed blocks keep their content and stay findable until the free list hands them out again,
oldest first; blocks with nothing reusable in them are handed out before cached ones.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] | None = None


class BlockManager:
    """Allocates KV blocks to sequences and keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.peak_used = 0

    # -- state -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of ``seq`` (full blocks, at least one token left)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(seq.block_hash(i, self.block_size))
            if block_id is None or self.blocks[block_id].tokens != seq.block_tokens(i, self.block_size):
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the newly completed full blocks of ``seq`` findable by later requests."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_registered_blocks, min(seq.num_computed // bs, len(seq.block_table))):
            seq.num_registered_blocks = i + 1
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            key = seq.block_hash(i, bs)
            if key in self._cached:  # the same content was computed twice at once; keep the first
                continue
            block.hash, block.tokens = key, seq.block_tokens(i, bs)
            self._cached[key] = block.block_id

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens, taking ``prefix`` (cached
        blocks, only for a sequence with no blocks yet) first. False, changing nothing, when
        there are not enough free blocks."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table) - len(prefix)
        reclaimed = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        if needed > len(self._free) - reclaimed:
            return False
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(max(needed, 0)):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached content
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                block.hash = block.tokens = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return True

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; the last ones are freed first so a prefix outlives its tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:  # nothing reusable: hand it out first
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def check(self) -> None:
        """Assert the accounting is consistent (used by tests)."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self._free), block
        for key, block_id in self._cached.items():
            assert self.blocks[block_id].hash == key
