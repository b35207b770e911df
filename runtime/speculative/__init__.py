"""Speculative decoding: a proposer guesses the next tokens of a sequence (prompt lookup, or a
small draft model), the target model verifies them all in one forward, and the accept / resample
rule keeps exactly the target's output (greedy) or its distribution (sampling).

``config`` parses ``speculative_config``; ``ngram`` and ``draft`` are the proposers;
``rejection`` is the verification rule; ``adaptive`` chooses each sequence's number of proposed
tokens; ``speculator`` ties them to the engine's step.
"""

from .config import SpeculativeConfig
from .speculator import Speculator

__all__ = ["SpeculativeConfig", "Speculator"]
