"""Adaptive number of proposed tokens per sequence.

Acceptance comes in runs (a draft that agrees on one token tends to agree on the next; prompt
lookup inside a copied passage is right many times in a row), so it is modelled per position: the
sequence's first proposed token is accepted with probability ``p1`` (its own first-position
record: accepted over tried, both exponentially decayed, from a prior worth ``PRIOR_WEIGHT``
tries that decays with them, so a few rejections already move it; the prior is the first-position
acceptance of the engine's recent sequences, ``PRIOR_RATE`` before any), token j > 1, once token
j - 1 was accepted, with the engine-wide conditional rate ``c_j`` (decayed counts, same prior).
Proposing k tokens then gains ``1 + p1 + p1 c2 + … + p1 c2 … ck`` tokens per step. The step costs
the target forward of its ``1 + k`` rows plus k draft tokens; the target's step time is fitted
online as ``a + b * rows`` (decode steps only, exponentially weighted), the draft's cost per
proposed token is measured (until it is, it is taken as ``draft_cost_ratio`` times a one-row
target step: the draft's share of the target's weight bytes). k maximises tokens per second;
k = 0 (plain decoding) when nothing beats it. Until a first decode step has been timed, sequences
decode plainly. A sequence at k = 0 tries one proposal again after ``PROBE_EVERY`` steps so a
change in its text (a quoted passage begins) is noticed; each probe that is rejected doubles the
wait (up to ``PROBE_MAX``), one that is accepted resets it, so a draft that never agrees costs
almost nothing. No probe is made while the batch is so large that even a draft accepted every
time would not pay (verifying more rows then costs more than it saves): probing there would only
pay a draft's catch-up over the whole prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # weight of the past in the running fits
PRIOR_SLOPE = 0.1  # b / a assumed until the step times vary enough in rows to fit it
PRIOR_RATE = 0.7  # a new sequence's assumed acceptance
PRIOR_WEIGHT = 2.0  # ... worth this many proposed tokens
RATE_DECAY = 0.8  # weight of the past acceptance counts at each verification
PROBE_EVERY = 16
PROBE_MAX = 64
MIN_GAIN = 1.02  # speculate only when the estimate beats plain decoding by this much


@dataclass
class SeqSpecState:
    """One sequence's acceptance record."""

    proposed: int = 0
    accepted: int = 0
    recent_tried: float = PRIOR_WEIGHT  # decayed first-position counts behind ``rate``, the prior included
    recent_accepted: float = PRIOR_WEIGHT * PRIOR_RATE
    idle_steps: int = 0
    probe_every: int = PROBE_EVERY
    probing: bool = False  # the pending proposal is a probe

    @property
    def rate(self) -> float:
        """Estimated probability that the first proposed token is accepted."""
        return self.recent_accepted / self.recent_tried


class StepCostModel:
    """Exponentially weighted least squares of step seconds against rows."""

    def __init__(self) -> None:
        self.s0 = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        d = DECAY
        self.s0 = self.s0 * d + 1.0
        self.sx = self.sx * d + rows
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + rows * rows
        self.sxy = self.sxy * d + rows * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``seconds = a + b * rows``, or None before the first step."""
        if self.s0 == 0.0:
            return None
        mx, my = self.sx / self.s0, self.sy / self.s0
        var = self.sxx / self.s0 - mx * mx
        if var > 0.25:
            b = (self.sxy / self.s0 - mx * my) / var
            a = my - b * mx
            if a > 0 and b >= 0:
                return a, b
        a = my / (1.0 + PRIOR_SLOPE * mx)
        return a, PRIOR_SLOPE * a


class AdaptiveK:
    """Chooses k per sequence and step from acceptance and measured costs."""

    def __init__(self, k_max: int, enabled: bool = True, draft_cost_ratio: float = 0.0) -> None:
        self.k_max = k_max
        self.enabled = enabled
        self.draft_cost_ratio = draft_cost_ratio
        self.target = StepCostModel()
        self.draft_s0 = self.draft_sy = 0.0  # seconds per proposed token, weighted
        # all sequences' decayed counts per position j: proposals that reached j (every earlier
        # token accepted) and those whose token j was accepted too; j = 0 is new sequences' prior
        self.reached = [0.0] * k_max
        self.kept = [0.0] * k_max

    def conditional(self, j: int) -> float:
        """Probability that proposed token j (0-based) is accepted once the tokens before it were."""
        return (self.kept[j] + PRIOR_RATE * PRIOR_WEIGHT) / (self.reached[j] + PRIOR_WEIGHT)

    def state(self, seq) -> SeqSpecState:
        if seq.spec_state is None:
            seq.spec_state = SeqSpecState(recent_accepted=PRIOR_WEIGHT * self.conditional(0))
        return seq.spec_state

    def choose(self, seq, batch: int) -> int:
        """k for ``seq`` in a step decoding ``batch`` sequences."""
        if not self.enabled:
            return self.k_max
        if self.target.coefficients() is None:
            return 0
        st = self.state(seq)
        k = self.best_k(st.rate, batch)
        if k == 0:
            st.idle_steps += 1
            if st.idle_steps >= st.probe_every and self.best_k(1.0, batch, certain=True) > 0:
                st.idle_steps = 0
                st.probing = True
                return 1
        else:
            st.idle_steps = 0
        return k

    def best_k(self, rate: float, batch: int, certain: bool = False) -> int:
        """k that maximises tokens per second at first-position acceptance ``rate`` (``certain``:
        every proposed token accepted), 0 when plain decoding is as good."""
        fit = self.target.coefficients()
        if fit is None:
            return self.k_max
        a, b = fit
        draft = self.draft_sy / self.draft_s0 if self.draft_s0 else self.draft_cost_ratio * (a + b)
        base = a / max(batch, 1) + b
        plain = 1.0 / base
        best, best_value = 0, plain
        gain, reach = 1.0, 1.0
        for k in range(1, self.k_max + 1):
            if not certain:  # the probability that token k is accepted
                reach *= rate if k == 1 else self.conditional(k - 1)
            gain += reach
            value = gain / (base + k * (b + draft))
            if value > best_value and value > plain * MIN_GAIN:
                best, best_value = k, value
        return best

    def observe_acceptance(self, seq, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        st = self.state(seq)
        st.proposed += proposed
        st.accepted += accepted
        st.recent_tried = RATE_DECAY * st.recent_tried + 1
        st.recent_accepted = RATE_DECAY * st.recent_accepted + (accepted > 0)
        for j in range(min(proposed, accepted + 1, self.k_max)):  # positions verified with all before accepted
            self.reached[j] = DECAY * self.reached[j] + 1
            self.kept[j] = DECAY * self.kept[j] + (j < accepted)
        if st.probing:
            st.probing = False
            st.probe_every = PROBE_EVERY if accepted else min(2 * st.probe_every, PROBE_MAX)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.draft_s0 = self.draft_s0 * DECAY + tokens
            self.draft_sy = self.draft_sy * DECAY + seconds
