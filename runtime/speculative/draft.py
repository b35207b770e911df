"""Draft-model proposer: a small model sharing the target's tokenizer proposes k tokens, one
batched draft forward per token, through its own paged KV cache.

Each target sequence has a shadow sequence in the draft's block manager. Before proposing, the
shadow is synchronised with the target's accepted tokens: its KV stays valid up to the longest
common prefix (accepted proposals included), the rest is recomputed in the first forward
together with the tokens the draft has not seen (the prompt, the target's own token).
Only blocks of accepted tokens are offered to the draft's prefix cache.
"""

from __future__ import annotations

import time

import torch

from ..sequence import Sequence
from .rejection import distribution


class DraftProposer:
    """Proposes with ``engine`` (the draft's ``LLMEngine``: its runner, KV cache and block
    manager are used; its scheduler is not)."""

    name = "draft"

    def __init__(self, engine) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.blocks = engine.block_manager
        self.argmax = engine.backend.argmax
        self.shadows: dict[str, Sequence] = {}
        self._bases: dict[str, int] = {}  # accepted tokens of each shadow at its last proposal

    def propose(self, seqs: list[Sequence], ks: list[int], generator: torch.Generator) -> list[tuple[int, int, float]]:
        """Set ``spec_tokens`` (and ``spec_probs`` for sampled requests) of each sequence, at most
        its k; returns (sequences, rows, seconds) per draft forward run."""
        active = []
        for seq, k in zip(seqs, ks):
            seq.clear_spec()
            if k < 1:
                continue
            shadow = self._sync(seq)
            if shadow is None or not self.blocks.allocate(shadow, seq.num_tokens + k - 1):
                self.release(seq)  # no room in the draft's cache: plain decoding this step
                continue
            if not seq.params.is_greedy:
                seq.spec_probs = []
            active.append((seq, shadow, k))
        items = [(shadow, shadow.num_tokens - shadow.num_computed) for _, shadow, _ in active]
        forwards = []
        while active:
            started = time.perf_counter()
            logits, sampled = self.runner.run(items)
            for shadow, n in items:
                shadow.num_computed += n
            row_of = {id(s): i for i, s in enumerate(sampled)}
            greedy = self.argmax(logits).tolist() if any(seq.params.is_greedy for seq, _, _ in active) else None
            logits = logits.cpu()
            still = []
            for seq, shadow, k in active:
                row = row_of[id(shadow)]
                if seq.params.is_greedy:
                    token = greedy[row]
                else:
                    q = distribution(logits[row], seq.params)
                    token = int(torch.multinomial(q, 1, generator=seq.generator or generator))
                    seq.spec_probs.append(q)
                seq.spec_tokens.append(token)
                shadow.append_token(token)
                if len(seq.spec_tokens) < k:
                    still.append((seq, shadow, k))
            forwards.append((len(items), sum(n for _, n in items), time.perf_counter() - started))
            active = still
            items = [(shadow, 1) for _, shadow, _ in active]
        return forwards

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The shadow of ``seq`` holding its accepted tokens, KV valid for its common prefix."""
        rid = seq.request_id
        shadow = self.shadows.get(rid)
        bs = self.blocks.block_size
        if shadow is None:
            shadow = Sequence(rid, seq.token_ids, seq.params)
            prefix = self.blocks.cached_prefix(shadow)
            if not self.blocks.allocate(shadow, len(prefix) * bs, prefix):
                return None
            shadow.num_computed = len(prefix) * bs
            self.shadows[rid] = shadow
        else:
            mine, theirs = shadow.token_ids, seq.token_ids
            common = self._bases[rid]
            limit = min(len(mine), len(theirs))
            while common < limit and mine[common] == theirs[common]:
                common += 1
            del mine[common:]
            mine.extend(theirs[common:])
            # the last token is always run again: its logits give the first proposal
            shadow.num_computed = min(shadow.num_computed, common, seq.num_tokens - 1)
            del shadow.block_hashes[common // bs:]
            self.blocks.register_full_blocks(shadow)
        self._bases[rid] = seq.num_tokens
        return shadow

    def release(self, seq: Sequence) -> None:
        """Free the shadow of ``seq`` (finished, preempted, or no room)."""
        shadow = self.shadows.pop(seq.request_id, None)
        self._bases.pop(seq.request_id, None)
        if shadow is not None:
            self.blocks.free(shadow)
