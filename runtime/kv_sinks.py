"""Attention sinks of an int4 KV cache, kept in float32 beside it.

Nearly every LLM puts a large share of each query's attention on the first token of the
sequence (an attention sink), so the int4 rounding of that one token's key and value moves
every later output: on the demo model it is a third of the int4 cache's KL divergence
(bench/results/kv_int4_error.md). The cache therefore keeps the K/V of positions
``0 .. SINK_TOKENS - 1`` of each sequence also in float32, in a small store of entries, and the
attention kernels read those positions from there.

A causal model's K/V at those positions depend on the first ``SINK_TOKENS`` token ids only, so
an entry is keyed by them: sequences sharing their first tokens (a chat template's opening, a
prefix-cache hit on the first block) share one entry, which outlives its sequences. The table
hands out entries least recently used first, never one in use in the current step; a sequence
whose entry was evicted, or whose first chunk found no free one, reads the int4 codes of those
positions (always written too), so the store bounds memory without ever being wrong.
"""

from __future__ import annotations

from collections import OrderedDict

SINK_TOKENS = 1  # positions kept in float32 per sequence (bench/kv_int4_error.py measures 1 and 4)
SPARE_ENTRIES = 16  # entries beyond max_num_seqs, for sequences waiting while others run

Key = tuple[int, ...]


class SinkTable:
    """First-token keys → entries ``0 .. capacity - 1`` of the sink store, least recently used out.

    A step calls :meth:`begin_step` (entries claimed in the previous step become readable),
    then :meth:`lookup` for each sequence reading its sinks and :meth:`claim` for each sequence
    writing them; :meth:`discard_pending` forgets claims of a step whose forward failed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clear()

    def __len__(self) -> int:
        return len(self._ready)

    def begin_step(self) -> None:
        for key, entry in self._pending.items():
            self._ready[key] = entry
        self._pending.clear()
        self._in_step.clear()

    def lookup(self, key: Key) -> int:
        """The entry holding ``key``'s sinks, or -1 when none is written."""
        entry = self._ready.get(key, -1)
        if entry >= 0:
            self._ready.move_to_end(key)
            self._in_step.add(entry)
        return entry

    def claim(self, key: Key) -> int:
        """An entry for this step's forward to write ``key``'s sinks into (its own when it has
        one, which stays readable: the same first tokens give the same sinks), or -1 when every
        entry is in use this step."""
        if key in self._ready:
            return self.lookup(key)
        entry = self._pending.get(key, -1)
        if entry >= 0:
            return entry
        if self._free:
            entry = self._free.pop()
        else:
            victim = next((k for k, e in self._ready.items() if e not in self._in_step), None)
            if victim is None:
                return -1
            entry = self._ready.pop(victim)
        self._pending[key] = entry
        self._in_step.add(entry)
        return entry

    def discard_pending(self) -> None:
        """Forget this step's claims (their forward did not complete): the entries are free again."""
        self._free.extend(self._pending.values())
        self._pending.clear()

    def clear(self) -> None:
        """Forget every entry (at start, and when the cache's basis changes)."""
        self._ready: OrderedDict[Key, int] = OrderedDict()  # written entries, least recently used first
        self._pending: dict[Key, int] = {}  # claimed this step, written by its forward
        self._free = list(range(self.capacity - 1, -1, -1))
        self._in_step: set[int] = set()
