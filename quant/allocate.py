"""Choose a format per tensor under a budget, from measured per-tensor costs (:mod:`.sensitivity`).

Greedy on each tensor's lower convex hull of (bits, cost): start every tensor at its smallest
format and repeatedly take the upgrade with the largest cost reduction per added bit, until the
bits-per-weight budget is spent (``target_bpw``) or the summed cost is at most ``target_kld``.
Bits are counted as the checkpoint stores them (codes as packed, 16-bit scales, zero points, float
tensors in their stored dtype, the safetensors headers) or, with ``size="gguf"``, as the
``--type auto`` GGUF file stores them (the block type carrying each format's codes, F16 / F32
floats, the file's metadata and tokenizer), exactly (:class:`~llmopt.quant.sensitivity.FileSizes`):
a plan's bits per weight are the written file's bytes × 8 over the source's parameter count.
On convex hulls this greedy is the optimum of the continuous relaxation of the knapsack.

With ``seconds`` (each format's measured decode time per weight in the runtime,
:mod:`llmopt.runtime.format_speed`) the resource spent is decode time instead of bits: the
fastest plan whose summed cost is at most ``target_kld`` (an embedding lookup reads one row a
token, so embedding formats cost no time).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from llmopt.quant.sensitivity import Sensitivity, TensorCost


@dataclass
class Plan:
    formats: dict[str, str]  # tensor name → format name
    bpw: float  # average stored bits per weight over everything counted
    predicted_kld: float
    target: dict
    size: str = "checkpoint"
    objective: str = "size"
    decode_ms: float | None = None  # predicted weight time of one decode step (objective speed)

    def to_dict(self) -> dict:
        record = {"version": 1, "target": self.target, "size": self.size, "objective": self.objective,
                  "bpw": round(self.bpw, 4), "predicted_kld": self.predicted_kld, "formats": self.formats}
        if self.decode_ms is not None:
            record["predicted_decode_ms"] = round(self.decode_ms, 4)
        return record


def _spent(t: TensorCost, size: str, seconds: dict[str, float] | None) -> dict[str, float]:
    """What each format of ``t`` spends per weight: bits counted as ``size``, or decode seconds."""
    if seconds is None:
        return t.sized(size)
    return {f: 0.0 if t.kind == "embedding" else seconds[f] for f in t.costs}


def decode_seconds(sens: Sensitivity, formats: dict[str, str], seconds: dict[str, float]) -> float:
    """Predicted seconds one decode step spends reading the quantizable tensors."""
    return sum(_spent(t, "checkpoint", seconds)[formats[t.name]] * t.numel for t in sens.tensors)


def _hull(t: TensorCost, size: str = "checkpoint", seconds: dict[str, float] | None = None) -> list[str]:
    """Formats on the lower convex hull of (bits or seconds, cost), by increasing bits or seconds."""
    bits = _spent(t, size, seconds)
    pts = sorted(t.costs, key=lambda f: (bits[f], t.costs[f]))
    hull: list[str] = []
    for f in pts:
        if hull and t.costs[f] >= t.costs[hull[-1]]:
            continue  # more bits for no gain
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies above the segment a→f
            if (t.costs[b] - t.costs[a]) * (bits[f] - bits[a]) >= (t.costs[f] - t.costs[a]) * (bits[b] - bits[a]):
                hull.pop()
            else:
                break
        hull.append(f)
    return hull


def totals(sens: Sensitivity, formats: dict[str, str], size: str = "checkpoint") -> tuple[float, float]:
    """(average bits per weight, summed cost) of an assignment, bits counted as ``size``."""
    bits = sens.other(size) + sum(t.sized(size)[formats[t.name]] * t.numel for t in sens.tensors)
    weights = sum(t.numel for t in sens.tensors) + _other_params(sens)
    return bits / weights, sum(t.costs[formats[t.name]] for t in sens.tensors)


def _other_params(sens: Sensitivity) -> int:
    return sens.other_params


def allocate(sens: Sensitivity, target_bpw: float | None = None, target_kld: float | None = None,
             size: str = "checkpoint", seconds: dict[str, float] | None = None) -> Plan:
    """The plan for one budget (exactly one of ``target_bpw`` / ``target_kld``), bits counted as
    ``size``; with ``seconds`` (format → decode seconds per weight) the fastest plan within ``target_kld``."""
    if (target_bpw is None) == (target_kld is None):
        raise ValueError("give exactly one of target_bpw and target_kld")
    if seconds is not None and target_kld is None:
        raise ValueError("the speed objective needs a KLD target (a bits budget is a size objective)")
    if size == "gguf" and any(not t.gguf for t in sens.tensors):
        raise ValueError("these sensitivities have no GGUF sizes: measure them again")
    missing = sorted({f for t in sens.tensors for f in t.costs} - set(seconds)) if seconds is not None else []
    if missing:
        raise ValueError(f"no decode time measured for {', '.join(missing)}")
    hulls = {t.name: _hull(t, size, seconds) for t in sens.tensors}
    by_name = {t.name: t for t in sens.tensors}
    level = {n: 0 for n in hulls}
    formats = {n: h[0] for n, h in hulls.items()}
    n_weights = sum(t.numel for t in sens.tensors) + _other_params(sens)
    budget = None if target_bpw is None else target_bpw * n_weights
    bits = sens.other(size) + sum(by_name[n].sized(size)[f] * by_name[n].numel for n, f in formats.items())
    cost = sum(by_name[n].costs[f] for n, f in formats.items())
    if budget is not None and bits > budget:
        raise ValueError(f"{target_bpw} bits per weight is below the smallest plan ({bits / n_weights:.3f})")

    def step(name: str) -> tuple[float, float, float] | None:
        h, i = hulls[name], level[name]
        if i + 1 >= len(h):
            return None
        t = by_name[name]
        spent = _spent(t, size, seconds)
        dspent = (spent[h[i + 1]] - spent[h[i]]) * t.numel
        dcost = t.costs[h[i]] - t.costs[h[i + 1]]
        return dcost / dspent if dspent > 0 else float("inf"), dspent, dcost

    heap = [(-s[0], name) for name in hulls if (s := step(name))]
    heapq.heapify(heap)
    while heap:
        if target_kld is not None and cost <= target_kld:
            break
        _, name = heapq.heappop(heap)
        s = step(name)
        if s is None:
            continue
        _, dspent, dcost = s
        if budget is not None and bits + dspent > budget:
            continue  # does not fit; a cheaper upgrade of another tensor might
        bits += dspent
        cost -= dcost
        level[name] += 1
        formats[name] = hulls[name][level[name]]
        nxt = step(name)
        if nxt:
            heapq.heappush(heap, (-nxt[0], name))
    target = {"bpw": target_bpw} if target_bpw is not None else {"kld": target_kld}
    if seconds is not None:
        bpw, _ = totals(sens, formats, size)
        return Plan(formats, bpw, cost, target, size, "speed", 1e3 * decode_seconds(sens, formats, seconds))
    return Plan(formats, bits / n_weights, cost, target, size)


def plan_table(sens: Sensitivity, plan: Plan) -> list[dict]:
    """Rows for printing: per tensor kind and format, how many tensors, weights and cost."""
    rows: dict[tuple[str, str], dict] = {}
    for t in sens.tensors:
        kind = t.kind if t.kind != "linear" else t.name.rsplit(".", 1)[-1]
        f = plan.formats[t.name]
        row = rows.setdefault((kind, f), {"tensor": kind, "format": f, "count": 0, "weights": 0, "cost": 0.0})
        row["count"] += 1
        row["weights"] += t.numel
        row["cost"] += t.costs[f]
    return sorted(rows.values(), key=lambda r: (r["tensor"], r["format"]))
