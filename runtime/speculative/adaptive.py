"""Adaptive number of proposed tokens per sequence.

A sequence proposing k tokens, each accepted with probability r (the sequence's measured
acceptance, a moving average), gains ``1 + r + r^2 + … + r^k`` tokens per step. The step costs
the target forward of its ``1 + k`` rows plus k draft tokens; the target's step time is fitted
online as ``a + b * rows`` (decode steps only, exponentially weighted), the draft's cost per
proposed token is measured. k maximises tokens per second; k = 0 (plain decoding) when nothing
beats it. A sequence at k = 0 tries one proposal again every ``PROBE_EVERY`` steps so a change
in its text (a quoted passage begins) is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97  # weight of the past in the running fits
PRIOR_SLOPE = 0.1  # b / a assumed until the step times vary enough in rows to fit it
PRIOR_RATE = 0.7  # a new sequence's assumed acceptance
RATE_DECAY = 0.8
PROBE_EVERY = 16
MIN_GAIN = 1.02  # speculate only when the estimate beats plain decoding by this much


@dataclass
class SeqSpecState:
    """One sequence's acceptance record."""

    rate: float = PRIOR_RATE
    proposed: int = 0
    accepted: int = 0
    idle_steps: int = 0


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

    def __init__(self, k_max: int, enabled: bool = True) -> None:
        self.k_max = k_max
        self.enabled = enabled
        self.target = StepCostModel()
        self.draft_s0 = self.draft_sy = 0.0  # seconds per proposed token, weighted

    def state(self, seq) -> SeqSpecState:
        if seq.spec_state is None:
            seq.spec_state = SeqSpecState()
        return seq.spec_state

    def choose(self, seq, batch: int) -> int:
        """k for ``seq`` in a step decoding ``batch`` sequences."""
        if not self.enabled:
            return self.k_max
        st = self.state(seq)
        k = self.best_k(st.rate, batch)
        if k == 0:
            st.idle_steps += 1
            if st.idle_steps >= PROBE_EVERY:
                st.idle_steps = 0
                return 1
        else:
            st.idle_steps = 0
        return k

    def best_k(self, rate: float, batch: int) -> int:
        fit = self.target.coefficients()
        if fit is None:
            return self.k_max
        a, b = fit
        draft = self.draft_sy / self.draft_s0 if self.draft_s0 else 0.0
        base = a / max(batch, 1) + b
        plain = 1.0 / base
        best, best_value = 0, plain
        gain = 1.0
        for k in range(1, self.k_max + 1):
            gain += rate ** k
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
        st.rate = RATE_DECAY * st.rate + (1 - RATE_DECAY) * (accepted / proposed)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.draft_s0 = self.draft_s0 * DECAY + tokens
            self.draft_sy = self.draft_sy * DECAY + seconds
