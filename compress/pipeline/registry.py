"""The stage registry: every stage the CLI, recipes and the Python API can run, by name."""

from __future__ import annotations

from llmopt.core.errors import LlmoptError
from llmopt.pipeline.stages.base import StageSpec
from llmopt.pipeline.stages.distill import DistillConfig, run_distill_stage
from llmopt.pipeline.stages.evaluate import EvalConfig, run_evaluate
from llmopt.pipeline.stages.export import ExportConfig, run_export
from llmopt.pipeline.stages.prune import PruneConfig, run_prune
from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec("quantize", QuantizeConfig, run_quantize, "quantize Linear weights (RTN, GPTQ, AWQ, SmoothQuant) to a compressed-tensors checkpoint"),
        StageSpec("prune", PruneConfig, run_prune, "prune weights (unstructured, N:M), layers or channels / heads"),
        StageSpec("distill", DistillConfig, run_distill_stage, "train a student to match a teacher", input_field="student"),
        StageSpec("export", ExportConfig, run_export, "write GGUF, dense safetensors or compressed-tensors"),
        StageSpec("eval", EvalConfig, run_evaluate, "perplexity, and KLD / top-1 against a baseline"),
    )
}
PIPELINE_STAGES = ("quantize", "prune", "distill", "export")  # what a recipe's `stages:` list may hold


def stage(name: str) -> StageSpec:
    """The registry entry for ``name``; LlmoptError naming the known stages."""
    if name not in STAGES:
        raise LlmoptError(f"unknown stage '{name}'", f"use one of {', '.join(PIPELINE_STAGES)}")
    return STAGES[name]
