"""Prune a model object in memory, in place: the prune stage's config and record, the same
algorithms (magnitude, Wanda and SparseGPT layer by layer in float32, as the CLI streams them)."""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from llmopt.pipeline.objects.common import calibration, finish, layer_device, no_dataset, prepare
from llmopt.pipeline.stages.prune import PruneConfig

REFUSALS = (
    ("eval", bool, "eval compares checkpoints on disk",
     "llmopt.save(model, path, tokenizer=tokenizer), then llmopt.evaluate(path, baseline=...)"),
)


def prune_object(model: nn.Module, tokenizer: Any, values: dict, dataset: Any = None, progress: Any = None) -> nn.Module:
    """Prune ``model`` in place with the options ``values`` (as ``llmopt prune`` takes them) on
    calibration ``dataset``; returns it (written to ``values['output']`` too if given)."""
    from llmopt.checkpoints.attached import describe
    from llmopt.checkpoints.in_memory import InMemoryModel
    from llmopt.pruning.apply import prune_model
    from llmopt.pruning.sparsify import MASK_METHODS

    config: PruneConfig = prepare(model, PruneConfig, values, REFUSALS, "pruned", "pruned")
    settings = config.settings()
    settings.validate(model.config.to_dict())
    start = time.perf_counter()
    record = config.record(describe(model), describe(model))
    calib = None
    if settings.needs_calibration:
        calib, record["calibration"] = calibration(config, values, dataset, tokenizer, model, config.samples)
    else:
        no_dataset(dataset, f"pruning method {config.method}")
    run: dict[str, Any] = {"progress": progress, "show_progress": progress is None}
    if config.method in MASK_METHODS:  # layer by layer in float32, as the CLI streams them
        layers = InMemoryModel(model)
        run.update(lifecycle=layers, observe_lifecycle=layers, device=layer_device(model, config.device))
    record.update(prune_model(model, settings, calib, **run))
    return finish(model, record, start, config, values, tokenizer)
