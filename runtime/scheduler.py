"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running sequences go first, in arrival order: one token each
when decoding, or the next chunk of a prompt that did not fit before (chunked prefill). Then
waiting requests are admitted first-come-first-served while budget, the running cap and KV
blocks allow. A decoding sequence with proposed tokens (speculative decoding, ``spec_tokens``)
runs them too, trimmed to the budget, and drops them rather than preempt another sequence. When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it goes back to the front of
the queue to be recomputed later (its prefix is often still cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's work: (sequence, number of new tokens to compute) pairs."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Owns the waiting queue and the running list; allocates blocks through the BlockManager."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if seq.spec_tokens:  # a decode with proposed tokens: verify as many as the budget allows
                if n == 1 and budget > 1:
                    _trim_spec(seq, budget - 1)
                    n += len(seq.spec_tokens)
                else:
                    seq.clear_spec()
            while not self.blocks.allocate(seq, seq.num_computed + n):
                if seq.spec_tokens:  # drop the proposal before preempting anyone
                    seq.clear_spec()
                    n = 1
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            prefix = self.blocks.cached_prefix(seq) if seq.prompt_logprobs is None else []  # scoring needs every row
            cached = len(prefix) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.allocate(seq, cached + n, prefix):
                break
            self.waiting.popleft()
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += cached
            if seq.times.first_scheduled is None:
                seq.num_cached_tokens = cached
            seq.num_computed = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        seq.clear_spec()
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished, take it off the queues and release its blocks."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.clear_spec()
        seq.status = Status.FINISHED
        seq.finish_reason = reason


def _trim_spec(seq: Sequence, keep: int) -> None:
    """Keep the first ``keep`` proposed tokens of ``seq`` (and their draft distributions)."""
    del seq.spec_tokens[keep:]
    if seq.spec_probs is not None:
        del seq.spec_probs[keep:]
