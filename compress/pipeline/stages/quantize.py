"""``llmopt quantize``: checkpoint in → quantized compressed-tensors checkpoint out (+ provenance)."""

from __future__ import annotations

import json
import platform
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.core.atomic import check_output
from llmopt.core.errors import LlmoptError
from llmopt.checkpoints.models import float_source, load_model

NF4 = "NF4"


@dataclass
class QuantizeRequest:
    """Everything ``llmopt quantize`` takes, validated before any work starts."""

    model: str
    output: Path
    scheme: str
    method: str = "rtn"
    group_size: int | None = None
    calib: str = "austen"
    calib_samples: int = 128
    calib_seq_len: int = 512
    seed: int = 0
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    strict_groups: bool = False
    act_order: bool | None = None  # None: on for GPTQ methods
    damp: float = 0.01
    smooth_alpha: float = 0.5
    clip_search: bool | None = None
    overwrite: bool = False

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"


def validate(request: QuantizeRequest) -> None:
    """Refuse impossible requests up front (unknown scheme, bad combination, existing output)."""
    from llmopt.quant.apply import validate_request

    check_output(request.output, request.overwrite)
    if request.scheme.upper() == NF4:
        if request.method != "rtn":
            raise LlmoptError(f"NF4 is quantized by bitsandbytes and takes no --method {request.method}", "drop --method or use --method rtn")
        return
    try:
        validate_request(request.scheme, request.method, request.group_size, True, request.act_order)
    except ValueError as exc:
        raise LlmoptError(str(exc)) from exc


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def versions() -> dict:
    import compressed_tensors
    import torch
    import transformers

    from llmopt import __version__

    return {"llmopt": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__, "python": platform.python_version()}


def quantize_checkpoint(request: QuantizeRequest, progress=None) -> dict:
    """Run one quantization and save it; returns the provenance record written to ``llmopt.json``."""
    from llmopt.quant.apply import quantize_model
    from llmopt.formats.compressed import save_compressed, save_nf4

    from llmopt.core.console import notice
    from llmopt.core.data import calibration_ids

    validate(request)
    source, _ = float_source(request.model, "quantized again", "quantize the original float checkpoint instead")
    start = time.perf_counter()
    model, tokenizer = load_model(source)
    record: dict = {
        "source": str(source), "source_spec": request.model, "scheme": request.scheme.upper(),
        "method": request.method, "ignore": request.ignore, "versions": versions(),
    }
    if request.scheme.upper() == NF4:
        save_nf4(model, tokenizer, request.output, request.ignore, _finish(record, start), overwrite=request.overwrite)
        return record
    calib = None
    if request.needs_calibration:
        calib, record["calibration"] = calibration_ids(tokenizer, request.calib, request.calib_samples, request.calib_seq_len, request.seed)
    try:
        result = quantize_model(
            model, request.scheme, request.method, request.group_size, calib, request.ignore, request.strict_groups,
            clip_search=request.clip_search, act_order=request.act_order, damp=request.damp,
            smooth_alpha=request.smooth_alpha, progress=progress, show_progress=progress is None,
        )
    except ValueError as exc:
        raise LlmoptError(str(exc)) from exc
    for line in result.notices:
        notice(line)
    record.update({
        "group_size_asked": request.group_size,
        "group_sizes": _group_size_summary(result.group_sizes),
        "quantized_modules": len(result.weights),
        "notices": result.notices,
        "options": {"act_order": request.act_order, "damp": request.damp, "smooth_alpha": request.smooth_alpha,
                    "clip_search": request.clip_search},
        "quantize_seconds": round(result.seconds, 2),
    })
    save_compressed(model, tokenizer, request.output, result.weights, request.ignore, _finish(record, start), overwrite=request.overwrite)
    return record


def _finish(record: dict, start: float) -> dict:
    record["total_seconds"] = round(time.perf_counter() - start, 2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 1)  # whole process, loading included
    record["peak_rss_mib"] = round(peak_rss_mib(), 1)
    return record


def _group_size_summary(sizes: dict[str, int | None]) -> dict[str, int]:
    """How many Linears use each group size ("per-channel" for None)."""
    summary: dict[str, int] = {}
    for g in sizes.values():
        key = "per-channel" if g is None else str(g)
        summary[key] = summary.get(key, 0) + 1
    return summary


def add_evaluation(output: Path, figures: dict) -> None:
    """Record evaluation figures in the checkpoint's ``llmopt.json``."""
    from llmopt.core.atomic import atomic_file

    path = output / "llmopt.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["evaluation"] = figures
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
