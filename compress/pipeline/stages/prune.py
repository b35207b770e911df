"""``llmopt prune``: checkpoint in → pruned checkpoint out (+ provenance in ``llmopt.json``).

Unstructured and N:M pruning save ordinary dense safetensors whose pruned weights are exact
zeros (a later ``llmopt quantize`` keeps them zero); drop-layers, drop-experts and width save a
smaller model whose config describes it. Block rankings for drop-layers are cached per model and calibration
set, so dropping 2, 4 and 8 layers ranks the blocks once.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from llmopt.checkpoints.models import float_source, load_model
from llmopt.checkpoints.provenance import finish_record, versions, write_provenance
from llmopt.core.atomic import atomic_dir, check_output
from llmopt.core.data import CALIB_HELP
from llmopt.pipeline.stages.base import device_option, eval_option, option, overwrite_option
from llmopt.pipeline.stages.evaluate import evaluate_output

DEFAULT_SAMPLES = 128
DEFAULT_SAMPLES_DEPTH = 16  # ranking blocks needs far less data (and perplexity ranking runs once per block)


@dataclass
class PruneConfig:
    """Everything ``llmopt prune`` / a recipe's prune stage takes."""

    model: str = option(help="Model to prune.", argument=True, runner_owned=True)
    output: str = option(help="Output checkpoint directory.", short="-o", runner_owned=True)
    method: str = option(help="magnitude, wanda, sparsegpt (weight sparsity); drop-layers (depth); drop-experts (the least-routed "
                              "experts of a mixture-of-experts model); width (MLP channels / attention heads).",
                         metavar="METHOD")
    sparsity: float | None = option(None, "magnitude/wanda/sparsegpt: fraction of weights removed from every output row, in (0, 1).")
    pattern: str | None = option(None, "magnitude/wanda/sparsegpt: semi-structured sparsity, at most N nonzeros in every M consecutive inputs (2:4, 4:8).", metavar="N:M")
    profile: str | None = option(None, "With --sparsity: 'uniform' (default) or 'owl' (outlier-weighted per-layer sparsity, same mean).", metavar="PROFILE")
    num: int | None = option(None, "drop-layers: how many decoder layers to remove; drop-experts: how many experts to remove "
                                   "from every mixture-of-experts layer (the least used by routing frequency on the calibration data).")
    ranking: str | None = option(None, "drop-layers: 'block-influence' (1 - cos(input, output), default) or 'perplexity' (calibration perplexity without the block).", metavar="RANKING")
    ffn_ratio: float | None = option(None, "width: fraction of MLP intermediate channels removed, e.g. 0.25.")
    heads_ratio: float | None = option(None, "width: fraction of attention heads removed (whole KV groups, or the same number of query heads per group).")
    heads_mode: str = option("auto", "width: auto, kv-groups or query-heads.", metavar="MODE")
    calib: str = option("austen", CALIB_HELP)
    calib_samples: int | None = option(None, "Calibration windows (default 128; 16 for drop-layers).", min=1)
    calib_seq_len: int = option(512, "Tokens per calibration window.", min=8)
    seed: int = option(0, "Seed for the calibration sample offsets.")
    damp: float = option(0.01, "sparsegpt: dampening, fraction of the mean Hessian diagonal.")
    device: str = device_option()
    overwrite: bool = overwrite_option()
    eval: bool = eval_option()

    def __post_init__(self) -> None:
        self.method = self.method.lower()
        self.profile = None if self.profile is None else self.profile.lower()
        self.ranking = None if self.ranking is None else self.ranking.lower()
        self.heads_mode = self.heads_mode.lower()

    def settings(self):
        from llmopt.pruning.apply import PruneSettings

        return PruneSettings(
            method=self.method, sparsity=self.sparsity, pattern=self.pattern, profile=self.profile, num=self.num,
            ranking=self.ranking, ffn_ratio=self.ffn_ratio, heads_ratio=self.heads_ratio, heads_mode=self.heads_mode,
            damp=self.damp,
        )

    @property
    def needs_calibration(self) -> bool:
        return self.settings().needs_calibration

    @property
    def samples(self) -> int:
        if self.calib_samples is not None:
            return self.calib_samples
        return DEFAULT_SAMPLES_DEPTH if self.method == "drop-layers" else DEFAULT_SAMPLES

    def record(self, source: str, spec: str) -> dict:
        """The provenance record's first entries: what was pruned, and how."""
        return {"source": source, "source_spec": spec, "method": self.method, "settings": settings_record(self),
                "versions": versions()}

    def check(self, config: dict | None = None) -> None:
        """Refuse impossible requests up front (bad values, options of another method)."""
        from llmopt.core.errors import LlmoptError

        from llmopt.calibration import resolve_device

        resolve_device(self.device)  # a bad name, or cuda without a GPU, fails now
        if self.method in ("drop-layers", "drop-experts", "width") and self.device not in ("auto", "cpu"):
            raise LlmoptError(f"--device applies to the streamed methods (magnitude, wanda, sparsegpt), not {self.method}",
                              "drop --device")
        self.settings().validate(config)
        if not self.needs_calibration:
            changed = [name for name, on in (("--calib", self.calib != "austen"), ("--calib-samples", self.calib_samples is not None),
                                             ("--calib-seq-len", self.calib_seq_len != 512)) if on]
            if changed:
                raise LlmoptError(f"{', '.join(changed)} only apply to calibrated pruning, not {self.method}",
                                  "drop them, or pick --method wanda / sparsegpt / drop-layers / drop-experts / width")


def run_prune(config: PruneConfig, progress=None) -> dict:
    """Prune ``config.model`` and save the result; returns the provenance record written to ``llmopt.json``."""
    from llmopt.core.data import calibration_ids
    from llmopt.self_calibration import sampler
    from llmopt.pruning.apply import prune_model

    config.check()
    check_output(Path(config.output), config.overwrite)
    source, model_config = float_source(config.model, "pruned", "prune the float checkpoint, then quantize the result")
    settings = config.settings()
    settings.validate(model_config)
    start = time.perf_counter()
    streamed = config.method in ("magnitude", "wanda", "sparsegpt")  # layer by layer from the checkpoint
    if streamed:
        from transformers import AutoTokenizer

        from llmopt.checkpoints.remote_code import remote_code_kwargs

        model, tokenizer = None, AutoTokenizer.from_pretrained(source, **remote_code_kwargs())
    else:
        model, tokenizer = load_model(source)
    record = config.record(str(source), config.model)
    calib, ranking = None, None
    if settings.needs_calibration:
        calib, record["calibration"] = calibration_ids(tokenizer, config.calib, config.samples, config.calib_seq_len, config.seed,
            sample_self=sampler(source, config.device))
    if config.method == "drop-layers":
        ranking, record["ranking_seconds"], record["ranking_cached"] = _cached_ranking(source, record["calibration"], settings, model, calib)
    if streamed:
        from llmopt.pruning.streaming import prune_streaming

        def provenance(done: dict) -> dict:
            record.update(done, output=str(config.output))
            return finish_record(record, start)

        prune_streaming(source, Path(config.output), settings, calib, tokenizer=tokenizer, provenance=provenance,
                        overwrite=config.overwrite, progress=progress, show_progress=progress is None, device=config.device)
    else:
        record.update(prune_model(model, settings, calib, ranking=ranking, progress=progress, show_progress=progress is None))
        _save(model, tokenizer, model_config, config, finish_record(record, start))
    if config.eval:
        record["evaluation"] = evaluate_output(config.output, config.model)
    return record


def settings_record(request: PruneConfig) -> dict:
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
    from llmopt.pruning.depth import LayerRanking, rank_layers

    from llmopt.core.atomic import atomic_file
    from llmopt.checkpoints.provenance import model_fingerprint
    from llmopt.core.paths import cache_dir

    method = settings.ranking or "block-influence"
    key = hashlib.sha256(json.dumps([model_fingerprint(source), calibration, method]).encode()).hexdigest()[:20]
    path = cache_dir("rankings") / f"{key}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return LayerRanking(data["method"], data["scores"], data["tokens"]), data.get("seconds"), True
    start = time.perf_counter()
    ranking = rank_layers(model, calib, method, settings.batch_size)
    seconds = round(time.perf_counter() - start, 6)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps({"method": ranking.method, "scores": ranking.scores, "tokens": ranking.tokens, "seconds": seconds}))
    return ranking, seconds, False


def _save(model, tokenizer, model_config: dict, config: PruneConfig, record: dict) -> None:
    """Write the model in its source dtype (zeros stay exact), the tokenizer and ``llmopt.json``."""
    import torch

    dtype = model_config.get("dtype") or model_config.get("torch_dtype")
    if dtype in ("float16", "bfloat16"):
        model.to(getattr(torch, dtype))
    with atomic_dir(Path(config.output), config.overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record["output"] = str(config.output)
        record["weights_bytes"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        write_provenance(tmp, record)
