"""Incremental detokenization: the text of a growing list of token ids, a few tokens' work per
step instead of decoding the whole output again.

Each step decodes only a short window: the tokens from ``prefix_offset`` (a few already shown,
so that a piece's leading space or merge with its neighbour comes out as in a whole decode) to
the end, and subtracts the decode of the same window without the new tokens. Text is released
only when it ends in whole characters (a byte-fallback token may carry half of a UTF-8 character:
the decode then ends in U+FFFD), so the window stays short and always starts at a character
boundary. vLLM's and TGI's detokenizers follow the same rule.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push(ids)`` with the whole (growing) id list returns the text the new ids completed;
    ``text`` is everything released so far; ``flush(ids)`` releases the rest at the end (an
    incomplete character as U+FFFD, as a whole decode shows it)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0  # window start: tokens before it are settled
        self.read_offset = 0  # tokens before it are in ``text``
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        """The new text of ``ids`` (which extends the ids pushed before); '' while the newest
        tokens do not yet end in a whole character."""
        if len(ids) <= self.read_offset:
            return ""
        before = self._decode(ids[self.prefix_offset:self.read_offset])
        after = self._decode(ids[self.prefix_offset:])
        if after.endswith(REPLACEMENT):
            return ""  # half a character: wait for the rest
        if not after.startswith(before):
            return self._resync(ids)
        if len(after) == len(before):
            return ""  # the new ids add no text (e.g. a skipped special token)
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.text += delta
        return delta

    def _resync(self, ids: list[int]) -> str:
        """The window's decode changed what was shown (a tokenizer whose clean-up looks across
        tokens): fall back to one whole decode, which is still right, and go on from there."""
        whole = self._decode(ids)
        if not whole.startswith(self.text) or whole.endswith(REPLACEMENT):
            return ""
        delta = whole[len(self.text):]
        self.text = whole
        self.prefix_offset = self.read_offset = len(ids)
        return delta

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is still held back (a trailing incomplete character shown as
        U+FFFD), so ``text`` ends as a whole decode of the last window would."""
        if len(ids) <= self.read_offset:
            return ""
        before = self._decode(ids[self.prefix_offset:self.read_offset])
        after = self._decode(ids[self.prefix_offset:])
        delta = after[len(before):] if after.startswith(before) else after
        self.prefix_offset = self.read_offset = len(ids)
        self.text += delta
        return delta


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``stops``: not handed out yet,
    since the next tokens may complete the stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold
