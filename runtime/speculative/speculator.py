"""The engine's side of speculative decoding: propose before scheduling, verify after the forward,
keep the figures (acceptance, accepted length, draft and verify time)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..sequence import Sequence
from .adaptive import AdaptiveK
from .config import SpeculativeConfig
from .draft import DraftProposer
from .ngram import NgramProposer
from .rejection import Verdict, greedy_accept, verify


def weight_bytes(path) -> int:
    """Bytes of a checkpoint's weight files (a directory's safetensors, or one GGUF file)."""
    path = Path(path)
    files = [path] if path.is_file() else list(path.glob("*.safetensors")) + list(path.glob("*.gguf"))
    return sum(f.stat().st_size for f in files)


class Speculator:
    """Proposes tokens for the decoding sequences of ``engine`` and verifies them.

    ``draft_engine`` (an ``LLMEngine`` on the draft model) is required for ``method="draft"``."""

    def __init__(self, config: SpeculativeConfig, engine, draft_engine=None) -> None:
        self.config = config
        self.engine = engine
        ratio = 0.0
        if config.method == "draft":
            self.proposer = DraftProposer(draft_engine)
            ratio = weight_bytes(draft_engine.path) / max(weight_bytes(engine.path), 1)
        else:
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.adaptive = AdaptiveK(config.num_speculative_tokens, config.adaptive, ratio)
        self.reset()

    def reset(self) -> None:
        self.proposed = self.accepted = self.verified_seqs = self.emitted = 0
        self.draft_seconds = self.verify_seconds = 0.0
        self.draft_forwards = 0
        self.spec_steps = 0

    # -- before the step --------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_tokens`` of every running sequence that decodes next (adaptive k, capped by
        the model length and the request's remaining tokens)."""
        decoding = [s for s in running if s.num_tokens - s.num_computed == 1]
        if not decoding:
            return
        limit = self.engine.max_model_len
        ks = []
        for seq in decoding:
            k = self.adaptive.choose(seq, len(decoding))
            k = min(k, limit - seq.num_tokens)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            ks.append(max(k, 0))
        if not any(ks):
            for seq in decoding:
                seq.clear_spec()
            return
        started = time.perf_counter()
        if isinstance(self.proposer, DraftProposer):
            forwards = self.proposer.propose(decoding, ks, self.engine.sampler.generator)
            self.draft_forwards += len(forwards)
            for seqs, rows, seconds in forwards:
                if rows <= 2 * seqs:  # decode-like forwards (a prompt's catch-up is a one-time cost)
                    self.adaptive.observe_draft(seqs, seconds)
        else:
            self.proposer.propose(decoding, ks)
            self.adaptive.observe_draft(max(sum(len(s.spec_tokens) for s in decoding), 1), time.perf_counter() - started)
        self.draft_seconds += time.perf_counter() - started

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: drop what the proposer holds for it."""
        self.proposer.release(seq)

    # -- after the forward ------------------------------------------------------------------------
    def observe_step(self, items: list[tuple[Sequence, int]], seconds: float, verifying: bool) -> None:
        """Time of a target forward; decode-only steps feed the cost model."""
        if all(n == 1 or s.spec_tokens for s, n in items):
            self.adaptive.observe_step(sum(n for _, n in items), seconds)
        if verifying:
            self.verify_seconds += seconds
            self.spec_steps += 1

    def verify(self, logits: torch.Tensor, sampled: list[Sequence], sampler) -> list[tuple[Sequence, Verdict | None, object]]:
        """Per sequence in first-row order: (seq, verdict, None) for a verified one, (seq, None,
        sample result) for one sampled as usual."""
        rows: dict[int, list[int]] = {}
        order: list[Sequence] = []
        for i, seq in enumerate(sampled):
            if id(seq) not in rows:
                rows[id(seq)] = []
                order.append(seq)
            rows[id(seq)].append(i)
        plain = [s for s in order if not s.spec_tokens]
        results: dict[int, tuple] = {}
        if plain:
            index = torch.tensor([rows[id(s)][0] for s in plain], dtype=torch.long, device=logits.device)
            for seq, result in zip(plain, sampler(logits.index_select(0, index), plain)):
                results[id(seq)] = (seq, None, result)
        spec = [s for s in order if s.spec_tokens]
        fast = [s for s in spec if not s.params.needs_row_processing]
        argmax = sampler.argmax(logits).tolist() if fast else None
        cpu = logits.cpu() if len(fast) < len(spec) else None
        for seq in spec:
            mine = rows[id(seq)]
            drafts = seq.spec_tokens
            if seq.params.needs_row_processing:
                verdict = verify(cpu[mine], seq, drafts, seq.spec_probs, seq.generator or sampler.generator)
            else:
                verdict = greedy_accept([argmax[i] for i in mine], drafts)
            self.proposed += len(drafts)
            self.accepted += verdict.accepted
            self.verified_seqs += 1
            self.emitted += len(verdict.tokens)
            self.adaptive.observe_acceptance(seq, len(drafts), verdict.accepted)
            seq.clear_spec()
            results[id(seq)] = (seq, verdict, None)
        return [results[id(s)] for s in order]

    def metrics(self) -> dict:
        """``spec_*`` figures of the run so far."""
        return {
            "spec_method": self.config.method,
            "spec_num_speculative_tokens": self.config.num_speculative_tokens,
            "spec_num_drafts": self.verified_seqs,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            # tokens emitted per verified sequence-step (accepted proposals + the target's own)
            "spec_mean_accepted_length": self.emitted / self.verified_seqs if self.verified_seqs else 0.0,
            "spec_verify_steps": self.spec_steps,
            "spec_draft_s": self.draft_seconds,
            "spec_verify_s": self.verify_seconds,
            "spec_draft_forwards": self.draft_forwards,
        }
