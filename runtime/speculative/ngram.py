"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``max_n`` down to ``min_n``), in the prompt or the text so far."""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` proposed tokens for the sequence ``tokens`` (none when no n-gram recurs)."""
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = arr[size - n:]
        # windows starting at 0 .. size - n - 1 (the suffix itself excluded), the latest match wins
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    """Proposes by prompt lookup; costs no model forward."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list, ks: list[int]) -> None:
        """Set ``spec_tokens`` of each sequence (at most its k; ``spec_probs`` stays None: the
        proposal is deterministic, a one-hot draft distribution)."""
        for seq, k in zip(seqs, ks):
            seq.spec_tokens = ngram_propose(seq.token_ids, k, self.min_n, self.max_n)
            seq.spec_probs = None

    def release(self, seq) -> None:
        """Nothing is held per sequence."""
