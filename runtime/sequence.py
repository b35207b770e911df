"""One request as the engine tracks it: tokens, KV blocks, progress, stop state and timings."""

from __future__ import annotations

import enum
import hashlib
import time
from array import array
from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestTimes:
    """Wall-clock timestamps (``time.perf_counter``) of one request."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Sequence:
    """A request: prompt + generated tokens, the blocks holding their KV, and how far it got.

    ``num_computed`` tokens have their KV in the cache; the rest (at least the newest token
    while running) are computed by the next steps. Preemption resets it to zero (recompute).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival: float | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, memoized
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_cached_tokens = 0  # prefix-cache hits at the first admission
        self.generator = generator
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.text_end: int | None = None  # cut position of the text when a stop string matched
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # per prompt token: its log-probability and the top-N given the tokens before (None for the first)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.detokenizer: IncrementalDetokenizer | None = None  # text decoded as it grows (stop strings, streaming)
        self.num_text_sent = 0  # characters of that text already handed out as ``delta_text``
        self.cumulative_logprob = 0.0
        self.times = RequestTimes(arrival if arrival is not None else time.perf_counter())
        # speculative decoding: tokens proposed after the last one, verified by the next step
        # (never part of ``token_ids``), the draft's distributions when sampled, and the proposer's state
        self.spec_tokens: list[int] = []
        self.spec_probs: list | None = None
        self.spec_state = None

    # -- tokens ----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def first_tokens(self, count: int) -> tuple[int, ...]:
        """The first ``count`` token ids (fewer when the sequence is shorter): what the K/V of
        positions ``0 .. count - 1`` depend on, the key of its attention sinks (``runtime.kv_sinks``)."""
        return tuple(self.token_ids[:count])

    def token_at(self, position: int) -> int:
        """The token at ``position``, a proposed (speculative) one past the accepted tokens."""
        n = len(self.token_ids)
        return self.token_ids[position] if position < n else self.spec_tokens[position - n]

    def clear_spec(self) -> None:
        self.spec_tokens = []
        self.spec_probs = None

    # -- prefix hashes -----------------------------------------------------------------------
    def block_hash(self, index: int, block_size: int) -> bytes:
        """Chained hash of full block ``index``: it covers every token up to the block's end."""
        while len(self.block_hashes) <= index:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else b""
            tokens = self.token_ids[i * block_size:(i + 1) * block_size]
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(array("q", tokens).tobytes())
            self.block_hashes.append(digest.digest())
        return self.block_hashes[index]

    def block_tokens(self, index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[index * block_size:(index + 1) * block_size])

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, computed={self.num_computed})"
