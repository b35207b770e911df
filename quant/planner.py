"""The AUTO planner (``--scheme AUTO``): measure per-tensor sensitivities, allocate formats under
the budget (or read a saved plan), print the plan and turn it into per-Linear schemes plus the
head / embedding formats."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llmopt.core.errors import LlmoptError
from llmopt.quant.method import PRICED_BY_GPTQ, PRICED_BY_RTN, QuantMethod
from llmopt.quant.outer import EMBED, HEAD

PLAN_VERSION = 1
OBJECTIVES = ("size", "speed")


@dataclass(frozen=True)
class AutoPlanner:
    """One budget (exactly one of ``target_bpw``, ``target_kld`` and a saved ``plan``), how bits
    are counted (``size_of``: checkpoint or gguf), what is minimised under a KLD target
    (``objective``: size or speed), the sensitivity pass's windows, how it prices the Linears'
    formats (``price_by``: gptq or rtn) and the stack that will run the checkpoint (``consumer``:
    only its formats are planned, :mod:`llmopt.quant.consumers`)."""

    target_bpw: float | None = None
    target_kld: float | None = None
    objective: str = "size"
    size_of: str = "checkpoint"
    plan: str | None = None
    sensitivity_samples: int = 4
    price_by: str = PRICED_BY_RTN
    seed: int = 0
    consumer: str = "llmopt"

    def check(self) -> None:
        """``ValueError`` for a budget that cannot be planned."""
        if (self.target_bpw is not None and self.target_bpw <= 0) or (self.target_kld is not None and self.target_kld <= 0):
            raise ValueError("--target-bpw / --target-kld must be positive (e.g. --target-bpw 4.85)")
        if self.objective == "speed" and self.target_kld is None:
            raise ValueError("--objective speed finds the fastest plan under a KLD target, not under a bits budget "
                             "or a saved plan: give --target-kld (e.g. --target-kld 0.05), or drop --objective")
        if self.plan is not None and not Path(self.plan).is_file():
            raise ValueError(f"plan file {self.plan} does not exist: give a plan.json or a checkpoint's llmopt.json")

    def make(self, source: Path, calibration: torch.Tensor | None, method: QuantMethod,
             online: list | None = None) -> tuple[dict, dict]:
        """(``plan`` (per-Linear schemes), ``head`` and ``embedding`` formats; the plan record).
        ``online``: the online input transforms (:class:`~llmopt.formats.hadamard.OnlineHadamard`)
        ``source``'s Linears read their inputs through, run while the sensitivities are measured."""
        from llmopt.quant.consumers import refused as consumer_refuses

        record = read_plan(Path(self.plan)) if self.plan is not None else self._measure(source, calibration, method, online or [])
        if self.plan is not None:
            refused = consumer_refuses(record["formats"], record.get("kinds", {}), record["shapes"], self.consumer)
            if refused:
                raise LlmoptError(f"the plan {self.plan} has formats {self.consumer} cannot run ({', '.join(refused[:3])} …)",
                                  f"plan again with --for {self.consumer}, or drop --for")
        record["consumer"] = self.consumer
        _print_table(record)
        return options_from_plan(record), record

    def _measure(self, source: Path, calibration: torch.Tensor | None, method: QuantMethod, online: list) -> dict:
        from llmopt.checkpoints.models import load_model
        from llmopt.formats.hadamard import add_input_hooks
        from llmopt.quant.allocate import allocate, plan_table, totals
        from llmopt.quant.consumers import restrict, tie, untie
        from llmopt.formats.registry import GGUF_SIZED_CANDIDATES
        from llmopt.quant.sensitivity import LINEAR_FORMATS, measure_sensitivity

        # formats that only pay off in a GGUF file are priced only when sizes are counted as one
        formats = tuple(f for f in LINEAR_FORMATS if self.size_of == "gguf" or f not in GGUF_SIZED_CANDIDATES)
        model, _ = load_model(source)
        add_input_hooks(model, online)
        sens = measure_sensitivity(model, calibration[: self.sensitivity_samples], seed=self.seed,
                                   head_gptq=method.calibrated, linear_gptq=self.price_by == PRICED_BY_GPTQ,
                                   linear_formats=formats)
        del model
        sens = restrict(sens, self.consumer)
        seconds = decode_speeds(sens) if self.objective == "speed" else None
        tied, members = tie(sens, self.consumer)
        try:
            plan = allocate(tied, self.target_bpw, self.target_kld, self.size_of, seconds)
        except ValueError as exc:
            raise LlmoptError(str(exc), "raise the target") from exc
        plan = replace(plan, formats=untie(plan.formats, members))
        record = plan.to_dict()
        record["shapes"] = {t.name: list(t.shape) for t in sens.tensors}
        record["kinds"] = {t.name: t.kind for t in sens.tensors}
        record["sensitivity"] = sens.to_dict()
        record["linears_priced_by"] = self.price_by
        record["table"] = plan_table(sens, plan)
        bpw, _ = totals(sens, plan.formats)
        record["bpw"] = round(bpw, 4)
        record["gguf_bpw"] = round(totals(sens, plan.formats, "gguf")[0], 4)
        if seconds is not None:
            record["decode_seconds_per_weight"] = seconds
        return record


def decode_speeds(sens) -> dict[str, float]:
    """Decode seconds per weight of every format the sensitivities name, measured in the runtime
    (once per machine: cached)."""
    from llmopt.core.console import notice
    from llmopt.quant.sensitivity import format_scheme
    from llmopt.runtime.format_speed import IN_FEATURES, format_speeds

    names = sorted({f for t in sens.tensors for f in t.costs})
    notice("timing each weight format's decode in the runtime (once per machine; cached)")
    return format_speeds({name: format_scheme(name, IN_FEATURES) for name in names})


def read_plan(path: Path) -> dict:
    """A plan record from a plan.json or a checkpoint's llmopt.json (its ``plan`` entry)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LlmoptError(f"cannot read the plan {path}: {exc}", "give a plan.json written by llmopt") from exc
    data = data.get("plan", data)
    if not isinstance(data, dict) or not isinstance(data.get("formats"), dict) or not isinstance(data.get("shapes"), dict):
        raise LlmoptError(f"{path} holds no llmopt plan (formats and shapes)", "give a plan.json written by llmopt quantize --scheme AUTO")
    return data


def options_from_plan(record: dict) -> dict:
    """Per-Linear schemes and the head / embedding formats of a plan record."""
    from llmopt.quant.sensitivity import FLOAT, LINEAR_FORMATS, OUTER_FORMATS, format_scheme

    plan: dict = {}
    head = embedding = FLOAT
    kinds = record.get("kinds", {})
    for name, fmt in record["formats"].items():
        shape = record["shapes"].get(name)
        if shape is None:
            raise LlmoptError(f"the plan has no shape for {name}", "re-create the plan")
        if name in (EMBED, HEAD):
            if fmt not in (*OUTER_FORMATS, FLOAT):
                raise LlmoptError(f"plan: {name} cannot take format {fmt}", f"use one of {', '.join((*OUTER_FORMATS, FLOAT))}")
            if name == HEAD:
                head = fmt
            else:
                embedding = fmt
                if kinds.get(name) == "tied":
                    head = fmt
            continue
        if fmt not in (*LINEAR_FORMATS, FLOAT):
            raise LlmoptError(f"plan: {name} has unknown format {fmt}", f"use one of {', '.join((*LINEAR_FORMATS, FLOAT))}")
        scheme = format_scheme(fmt, shape[1])
        if scheme is not None:
            plan[name] = scheme
    return {"plan": plan, "head": head, "embedding": embedding}


def _print_table(record: dict) -> None:
    from llmopt.core.console import err

    rows = record.get("table") or []
    target = ", ".join(f"{k} {v}" for k, v in record.get("target", {}).items())
    gguf = f" ({record['gguf_bpw']} in a GGUF file)" if "gguf_bpw" in record else ""
    speed = f", predicted weight time {record['predicted_decode_ms']:.2f} ms a token" if "predicted_decode_ms" in record else ""
    err.print(f"plan ({target}): {record.get('bpw')} bits per weight{gguf}, predicted mean KLD {record.get('predicted_kld', 0):.4f}{speed}")
    if rows:
        err.print(f"  {'tensor':<14}{'format':<11}{'count':>6}{'weights':>13}{'cost':>10}")
        for r in rows:
            err.print(f"  {r['tensor']:<14}{r['format']:<11}{r['count']:>6}{r['weights']:>13,}{r['cost']:>10.4f}")
