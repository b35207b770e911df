"""``--scheme AUTO``: measure per-tensor sensitivities, allocate formats under the budget (or read
a saved plan), print the plan and turn it into per-Linear schemes plus head/embedding formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmopt.core.errors import LlmoptError
from llmopt.quant.outer import EMBED, HEAD

PLAN_VERSION = 1


def plan_for(config: Any, source: Path, calib: torch.Tensor | None) -> tuple[dict, dict]:
    """(options for ``quantize_streaming``: ``plan``, ``head``, ``embedding``; the plan record)."""
    from llmopt.quant.allocate import allocate, plan_table, totals
    from llmopt.quant.sensitivity import Sensitivity, measure_sensitivity

    if config.plan is not None:
        record = read_plan(Path(config.plan))
    else:
        from llmopt.checkpoints.models import load_model

        model, _ = load_model(source)
        sens = measure_sensitivity(model, calib[: config.sensitivity_samples], seed=config.seed,
                                   head_gptq=config.method != "rtn", linear_gptq=config.linear_pricing == "gptq")
        del model
        seconds = decode_speeds(sens) if config.objective == "speed" else None
        try:
            plan = allocate(sens, config.target_bpw, config.target_kld, config.size_of, seconds)
        except ValueError as exc:
            raise LlmoptError(str(exc), "raise the target") from exc
        record = plan.to_dict()
        record["shapes"] = {t.name: list(t.shape) for t in sens.tensors}
        record["kinds"] = {t.name: t.kind for t in sens.tensors}
        record["sensitivity"] = sens.to_dict()
        record["linears_priced_by"] = config.linear_pricing
        record["table"] = plan_table(sens, plan)
        bpw, _ = totals(sens, plan.formats)
        record["bpw"] = round(bpw, 4)
        record["gguf_bpw"] = round(totals(sens, plan.formats, "gguf")[0], 4)
        if seconds is not None:
            record["decode_seconds_per_weight"] = seconds
    _print_table(record)
    return options_from_plan(record), record


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
