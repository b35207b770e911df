"""The evaluate stage: perplexity of a checkpoint and, against a baseline, KLD / top-1 agreement."""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.accuracy import DEFAULT_MAX_WINDOWS, DEFAULT_SEQ_LEN, DEFAULT_TOP_K, run_eval
from llmopt.pipeline.stages.base import option


PERPLEXITY_DEFAULTS = {"dataset": "wikitext2", "seq_len": DEFAULT_SEQ_LEN, "max_windows": DEFAULT_MAX_WINDOWS, "top_k": DEFAULT_TOP_K}


@dataclass
class EvalConfig:
    """Everything ``llmopt eval`` / a recipe's ``evaluate:`` block takes."""

    model: str = option(help="Model to evaluate.", argument=True, runner_owned=True)
    baseline: str | None = option(None, "Also report KL divergence and top-1 agreement against this model.", metavar="MODEL",
                                  runner_owned=True)
    dataset: str = option("wikitext2", "Corpus name, text file, folder of .txt files, or hf:NAME[:CONFIG[:SPLIT]].")
    seq_len: int = option(DEFAULT_SEQ_LEN, "Tokens per window.", min=2)
    max_windows: int = option(DEFAULT_MAX_WINDOWS, "Score the first N windows (0: the whole text, ~150 windows of 2048 for WikiText-2).", min=0)
    top_k: int = option(DEFAULT_TOP_K, "Baseline log-probs cached per token for KLD (the rest is merged into one bucket).", min=1)
    tasks: str | None = option(None, "Score lm-evaluation-harness tasks instead of perplexity (comma list; needs the tasks "
                               "extra: pip install 'llmopt[tasks]'), e.g. hellaswag,arc_easy or the bundled llmopt_tiny_mc.", metavar="T1,T2")
    num_fewshot: int | None = option(None, "--tasks: few-shot examples (default: each task's own).", min=0)
    limit: int | None = option(None, "--tasks: score the first N items of each task.", min=1)
    batch_size: int = option(8, "--tasks: sequences per log-likelihood batch.", min=1)
    include_path: tuple[str, ...] = option((), "--tasks: a folder of task YAMLs (repeatable).", metavar="DIR")
    output: str | None = option(None, "Also write the JSON figures to this file.", short="-o", runner_owned=True)

    def check(self) -> None:
        """Options of one kind of evaluation are refused with the other."""
        from llmopt.core.errors import LlmoptError

        if self.tasks:
            changed = [f"--{k.replace('_', '-')}" for k, v in PERPLEXITY_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise LlmoptError(f"{', '.join(changed)} apply to perplexity, not to --tasks", "drop them, or run eval without --tasks")
        elif self.num_fewshot is not None or self.limit is not None or self.include_path or self.batch_size != 8:
            raise LlmoptError("--num-fewshot, --limit, --batch-size and --include-path apply to --tasks only", "add --tasks or drop them")


def run_evaluate(config: EvalConfig, progress=None) -> dict:
    """The figures as a dict (also written to ``config.output`` when given)."""
    from pathlib import Path

    from llmopt.accuracy import save_json

    if config.tasks:
        from llmopt.tasks.scores import run_tasks

        payload = run_tasks(config.model, config.tasks, config.num_fewshot, config.limit, config.batch_size,
                            baseline=config.baseline, include_path=config.include_path)
        if config.output:
            save_json(Path(config.output), payload)
        return payload
    result = run_eval(config.model, config.baseline, config.dataset, config.seq_len, config.max_windows or None, config.top_k)
    payload = {"model": config.model, "baseline": config.baseline, **result.to_dict()}
    if config.output:
        save_json(Path(config.output), payload)
    return payload


def evaluate_output(output: str, baseline: str) -> dict:
    """Evaluate a stage's output against its input with the default settings and record the
    figures in the output's ``llmopt.json``; returns them."""
    from llmopt.checkpoints.provenance import update_provenance

    figures = run_eval(str(output), baseline).to_dict()
    update_provenance(output, evaluation=figures)
    return figures
