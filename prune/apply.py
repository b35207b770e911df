"""One entry point for every pruning method, with its settings validated before any work.

Methods: ``magnitude``, ``wanda``, ``sparsegpt`` (unstructured ``sparsity`` per row, or an N:M
``pattern``; ``uniform`` or ``owl`` per-layer profile), ``drop-layers`` (remove ``num`` decoder
blocks ranked by ``block-influence`` or ``perplexity``), ``drop-experts`` (remove the ``num``
least-routed experts of every mixture-of-experts layer, :mod:`.experts`), ``width`` (remove ``ffn_ratio`` of MLP
channels and ``heads_ratio`` of attention heads). :func:`PruneSettings.validate` refuses bad
requests with one-line :class:`~llmopt.core.errors.LlmoptError`s; :func:`prune_model` modifies the
model in place and returns a JSON-ready record of what it did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from llmopt.core.errors import LlmoptError
from torch import nn

from llmopt.pruning.depth import METHODS as RANKINGS
from llmopt.pruning.depth import LayerRanking, check_drop_count, drop_layers, kept_layers, rank_layers
from llmopt.pruning.experts import check_expert_drop, drop_experts, measure_usage
from llmopt.pruning.masks import Pattern, parse_pattern
from llmopt.pruning.sparsify import (
    MASK_METHODS,
    PROFILES,
    SparsifyOptions,
    layer_prefixes,
    report_from_zeros,
    sparsify_model,
)
from llmopt.pruning.width import HEAD_MODES, check_ffn_ratio, plan_heads, prune_width

METHODS = (*MASK_METHODS, "drop-layers", "drop-experts", "width")


@dataclass
class PruneSettings:
    """A pruning request, independent of where the model comes from."""

    method: str
    sparsity: float | None = None
    pattern: str | None = None
    profile: str | None = None
    owl_lambda: float = 0.08
    num: int | None = None
    ranking: str | None = None
    ffn_ratio: float | None = None
    heads_ratio: float | None = None
    heads_mode: str = "auto"
    damp: float = 0.01
    batch_size: int = 8

    @property
    def needs_calibration(self) -> bool:
        return self.method != "magnitude" or self.profile == "owl"

    @property
    def parsed_pattern(self) -> Pattern | None:
        return None if self.pattern is None else parse_pattern(self.pattern)

    def validate(self, config: dict | None = None) -> None:
        """Refuse unknown methods, out-of-range values, options of another method and (given the
        model's ``config.json`` as a dict) requests the model's shape cannot satisfy."""
        if self.method not in METHODS:
            raise LlmoptError(f"unknown pruning method '{self.method}'", f"use one of {', '.join(METHODS)}")
        self._refuse_foreign_options()
        if self.method in MASK_METHODS:
            self._validate_mask(config)
        elif self.method in ("drop-layers", "drop-experts"):
            what = "decoder layers" if self.method == "drop-layers" else "experts of every mixture-of-experts layer"
            if self.num is None:
                raise LlmoptError(f"{self.method} needs --num N", f"pass how many {what} to remove, e.g. --num 2")
            if self.num < 1:
                raise LlmoptError(f"--num {self.num} drops nothing", f"drop at least one of the {what}")
            if self.method == "drop-experts":
                if config is not None:
                    check_expert_drop(config, self.num)
                return
            if (self.ranking or "block-influence") not in RANKINGS:
                raise LlmoptError(f"unknown ranking '{self.ranking}'", f"use one of {', '.join(RANKINGS)}")
            if config is not None:
                check_drop_count(int(config.get("num_hidden_layers", 0)), self.num)
        else:
            self._validate_width(config)

    def _refuse_foreign_options(self) -> None:
        given = {"--sparsity": self.sparsity, "--pattern": self.pattern, "--profile": self.profile,
                 "--num": self.num, "--ranking": self.ranking, "--ffn-ratio": self.ffn_ratio,
                 "--heads-ratio": self.heads_ratio}
        allowed = {"drop-layers": {"--num", "--ranking"}, "drop-experts": {"--num"}, "width": {"--ffn-ratio", "--heads-ratio"}}.get(
            self.method, {"--sparsity", "--pattern", "--profile"})
        for option, value in given.items():
            if value is not None and option not in allowed:
                raise LlmoptError(f"{option} does not apply to --method {self.method}", f"{self.method} takes {', '.join(sorted(allowed))}")

    def _validate_mask(self, config: dict | None) -> None:
        if (self.sparsity is None) == (self.pattern is None):
            raise LlmoptError(f"{self.method} needs exactly one of --sparsity S and --pattern N:M", "e.g. --sparsity 0.5 or --pattern 2:4")
        if self.sparsity is not None and not 0 < self.sparsity < 1:
            raise LlmoptError(f"--sparsity {self.sparsity} is outside (0, 1)", "pass the fraction of weights to remove, e.g. 0.5")
        try:
            pattern = self.parsed_pattern
        except ValueError as exc:
            raise LlmoptError(str(exc)) from exc
        if (self.profile or "uniform") not in PROFILES:
            raise LlmoptError(f"unknown profile '{self.profile}'", f"use one of {', '.join(PROFILES)}")
        if self.profile == "owl":
            if pattern is not None:
                raise LlmoptError("--profile owl varies sparsity per layer and does not apply to N:M patterns", "use --sparsity with owl, or drop --profile")
            if not 0 <= self.owl_lambda < min(self.sparsity, 1 - self.sparsity):
                raise LlmoptError(f"OWL lambda {self.owl_lambda} must lie in [0, {min(self.sparsity, 1 - self.sparsity):.3g})", "use a smaller lambda such as 0.08")
        if pattern is not None and config is not None:
            sizes = {int(config.get("hidden_size", 0)), int(config.get("intermediate_size", 0))}
            head_dim = config.get("head_dim") or int(config.get("hidden_size", 0)) // max(1, int(config.get("num_attention_heads", 1)))
            sizes.add(int(head_dim) * int(config.get("num_attention_heads", 0)))
            bad = sorted(s for s in sizes if s and s % pattern.m)
            if bad:
                raise LlmoptError(f"--pattern {pattern} needs input sizes divisible by {pattern.m}; this model has {bad}", "use another M, e.g. 2:4")

    def _validate_width(self, config: dict | None) -> None:
        ffn, heads = self.ffn_ratio or 0.0, self.heads_ratio or 0.0
        if self.heads_mode not in HEAD_MODES:
            raise LlmoptError(f"unknown heads mode '{self.heads_mode}'", f"use one of {', '.join(HEAD_MODES)}")
        if not ffn and not heads:
            raise LlmoptError("width needs --ffn-ratio and/or --heads-ratio above 0", "e.g. --ffn-ratio 0.25")
        if not 0 <= ffn < 1:
            raise LlmoptError(f"--ffn-ratio {ffn} is outside [0, 1)", "pass the fraction of MLP channels to remove, e.g. 0.25")
        if not 0 <= heads < 1:
            raise LlmoptError(f"--heads-ratio {heads} is outside [0, 1)", "pass the fraction of attention heads to remove")
        if config is not None:
            check_ffn_ratio(ffn, int(config.get("intermediate_size", 0)))
            n_heads = int(config.get("num_attention_heads", 0))
            plan_heads(n_heads, int(config.get("num_key_value_heads") or n_heads), heads, self.heads_mode)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def prune_model(
    model: nn.Module,
    settings: PruneSettings,
    calib_ids: torch.Tensor | None = None,
    *,
    ranking: LayerRanking | None = None,
    progress: Any = None,
    show_progress: bool = True,
    lifecycle: Any = None,
    observe_lifecycle: Any = None,
    device: str | torch.device | None = None,
) -> dict:
    """Prune ``model`` in place as ``settings`` say; returns a JSON-ready record.

    ``ranking`` (drop-layers) reuses an earlier block ranking instead of computing it.
    ``lifecycle`` / ``observe_lifecycle`` / ``device`` (magnitude, Wanda, SparseGPT): streaming
    and onloading, as in :func:`~llmopt.pruning.sparsify.sparsify_model`; drop-layers and width
    keep the whole model in memory.
    """
    settings.validate(model.config.to_dict())
    if settings.needs_calibration and calib_ids is None and ranking is None:
        raise LlmoptError(f"--method {settings.method} needs calibration data")
    start = time.perf_counter()
    before = _count(model)
    record: dict = {"method": settings.method}
    run = {"progress": progress, "show_progress": show_progress}
    if settings.method in MASK_METHODS:
        pattern = settings.parsed_pattern
        options = SparsifyOptions(settings.method, settings.sparsity, pattern, settings.profile or "uniform",
                                  owl_lambda=settings.owl_lambda, damp=settings.damp, batch_size=settings.batch_size)
        streaming = {} if lifecycle is None else {"lifecycle": lifecycle, "observe_lifecycle": observe_lifecycle}
        done = sparsify_model(model, options, calib_ids, **run, **streaming, device=device)
        report = report_from_zeros(layer_prefixes(model), done.layer_zeros, pattern)
        record["engine_seconds"] = {"prune": done.timings.to_dict(),
                                    **({"owl": done.owl_timings.to_dict()} if done.owl_timings else {})}
        record["sparsity"] = {
            "target": settings.sparsity if pattern is None else pattern.sparsity,
            "pattern": None if pattern is None else str(pattern), "profile": options.profile,
            "layer_targets": [round(s, 6) for s in done.layer_targets],
            **({"outlier_ratios": [round(r, 6) for r in done.outlier_ratios], "owl_lambda": settings.owl_lambda}
               if done.outlier_ratios is not None else {}),
            **report,
        }
    elif settings.method == "drop-layers":
        n_layers = int(model.config.num_hidden_layers)
        if ranking is None:
            ranking = rank_layers(model, calib_ids, settings.ranking or "block-influence", settings.batch_size)
        dropped = ranking.least_important(settings.num)
        drop_layers(model, dropped)
        record["depth"] = {"ranking": ranking.to_dict(), "dropped": dropped, "kept": kept_layers(n_layers, dropped),
                           "layers": [n_layers, n_layers - len(dropped)]}
    elif settings.method == "drop-experts":
        usage = measure_usage(model, calib_ids, settings.batch_size)
        dropped = usage.least_used(settings.num)
        before = len(usage.counts[0])
        drop_experts(model, dropped)
        record["experts"] = {"experts": [before, before - settings.num], "calibration_tokens": usage.tokens,
                             "tokens_per_expert": [c.tolist() for c in usage.counts], "dropped": dropped}
    else:
        result = prune_width(model, calib_ids, settings.ffn_ratio or 0.0, settings.heads_ratio or 0.0,
                             settings.heads_mode, batch_size=settings.batch_size, **run)
        record["width"] = {k: v for k, v in result.to_dict().items() if k not in ("kept_channels", "kept_heads", "seconds")}
        record["width"]["kept_heads"] = result.kept_heads
    record["parameters"] = {"before": before, "after": _count(model)}
    record["prune_seconds"] = round(time.perf_counter() - start, 2)
    return record
