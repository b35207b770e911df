"""Ignore patterns (``--ignore``, recipes' ``ignore``): which module names they keep in float."""

from __future__ import annotations

import re


def ignore_matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` matches module ``name``: compressed-tensors' own form ``re:REGEX`` (matched
    from the start of the name, as compressed-tensors and llm-compressor read it), or a plain
    regular expression found anywhere in the name (``self_attn``, ``mlp\\.down_proj``; a whole
    name matches itself)."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), name) is not None
    return re.search(pattern, name) is not None


def check_ignore_pattern(pattern: str) -> None:
    """``ValueError`` naming the fault when ``pattern`` (either form) is not a regular expression."""
    try:
        re.compile(pattern.removeprefix("re:"))
    except re.error as exc:
        raise ValueError(f"invalid ignore pattern {pattern!r}: {exc}") from exc
