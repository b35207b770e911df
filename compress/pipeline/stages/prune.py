"""``llmopt prune``: checkpoint in → pruned checkpoint out (+ provenance in ``llmopt.json``).

Unstructured and N:M pruning save ordinary dense safetensors whose pruned weights are exact
zeros (a later ``llmopt quantize`` keeps them zero); drop-layers and width save a smaller model
whose config describes it. Block rankings for drop-layers are cached per model and calibration
set, so dropping 2, 4 and 8 layers ranks the blocks once.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from llmopt.core.atomic import atomic_dir, check_output
from llmopt.checkpoints.models import float_source, load_model
from llmopt.pipeline.stages.quantize import _finish, versions

DEFAULT_SAMPLES = 128
DEFAULT_SAMPLES_DEPTH = 16  # ranking blocks needs far less data (and perplexity ranking runs once per block)


@dataclass
class PruneRequest:
    """Everything ``llmopt prune`` takes, validated before any work starts."""

    model: str
    output: Path
    method: str
    sparsity: float | None = None
    pattern: str | None = None
    profile: str | None = None
    num: int | None = None
    ranking: str | None = None
    ffn_ratio: float | None = None
    heads_ratio: float | None = None
    heads_mode: str = "auto"
    calib: str = "austen"
    calib_samples: int | None = None  # None: 128 windows, 16 for drop-layers
    calib_seq_len: int = 512
    seed: int = 0
    damp: float = 0.01
    overwrite: bool = False

    def settings(self):
        from llmopt.prune.apply import PruneSettings

        return PruneSettings(
            method=self.method, sparsity=self.sparsity, pattern=self.pattern, profile=self.profile, num=self.num,
            ranking=self.ranking, ffn_ratio=self.ffn_ratio, heads_ratio=self.heads_ratio, heads_mode=self.heads_mode,
            damp=self.damp,
        )

    @property
    def samples(self) -> int:
        if self.calib_samples is not None:
            return self.calib_samples
        return DEFAULT_SAMPLES_DEPTH if self.method == "drop-layers" else DEFAULT_SAMPLES


def validate(request: PruneRequest, config: dict | None = None) -> None:
    """Refuse impossible requests up front (bad values, options of another method, existing output)."""
    check_output(request.output, request.overwrite)
    request.settings().validate(config)


def prune_checkpoint(request: PruneRequest, progress=None) -> dict:
    """Run one pruning and save the result; returns the provenance record written to ``llmopt.json``."""
    from llmopt.prune.apply import prune_model

    from llmopt.core.data import calibration_ids

    validate(request)
    source, config = float_source(request.model, "pruned", "prune the float checkpoint, then quantize the result")
    settings = request.settings()
    settings.validate(config)
    start = time.perf_counter()
    model, tokenizer = load_model(source)
    record: dict = {"source": str(source), "source_spec": request.model, "method": request.method,
                    "settings": _settings_record(request), "versions": versions()}
    calib, ranking = None, None
    if settings.needs_calibration:
        calib, record["calibration"] = calibration_ids(tokenizer, request.calib, request.samples, request.calib_seq_len, request.seed)
    if request.method == "drop-layers":
        ranking, record["ranking_seconds"], record["ranking_cached"] = _cached_ranking(source, record["calibration"], settings, model, calib)
    record.update(prune_model(model, settings, calib, ranking=ranking, progress=progress, show_progress=progress is None))
    _save(model, tokenizer, source, config, request, _finish(record, start))
    return record


def _settings_record(request: PruneRequest) -> dict:
    keys = ("sparsity", "pattern", "profile", "num", "ranking", "ffn_ratio", "heads_ratio", "heads_mode", "damp")
    out = {k: getattr(request, k) for k in keys if getattr(request, k) is not None}
    if request.method != "width":
        out.pop("heads_mode", None)
    if request.method not in ("sparsegpt",):
        out.pop("damp", None)
    return out


def _cached_ranking(source: Path, calibration: dict, settings, model, calib):
    """The block ranking for this model and calibration set, computed once and cached on disk.

    Returns ``(ranking, seconds it took to compute, whether it came from the cache)``.
    """
    from llmopt.prune.depth import LayerRanking, rank_layers

    from llmopt.core.atomic import atomic_file
    from llmopt.accuracy import model_fingerprint
    from llmopt.core.paths import cache_dir

    method = settings.ranking or "block-influence"
    key = hashlib.sha256(json.dumps([model_fingerprint(source), calibration, method]).encode()).hexdigest()[:20]
    path = cache_dir("rankings") / f"{key}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return LayerRanking(data["method"], data["scores"], data["tokens"]), data.get("seconds"), True
    start = time.perf_counter()
    ranking = rank_layers(model, calib, method, settings.batch_size)
    seconds = round(time.perf_counter() - start, 2)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps({"method": ranking.method, "scores": ranking.scores, "tokens": ranking.tokens, "seconds": seconds}))
    return ranking, seconds, False


def _save(model, tokenizer, source: Path, config: dict, request: PruneRequest, record: dict) -> None:
    """Write the model in its source dtype (zeros stay exact), the tokenizer and ``llmopt.json``."""
    import torch

    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype in ("float16", "bfloat16"):
        model.to(getattr(torch, dtype))
    with atomic_dir(request.output, request.overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record["output"] = str(request.output)
        record["weights_bytes"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        (tmp / "llmopt.json").write_text(json.dumps(record, indent=2) + "\n")
