"""``llmopt eval`` and ``llmopt inspect``: what a checkpoint scores and what it holds."""

from __future__ import annotations

import click

from llmopt.cli.common import emit_json, hub_options, user_errors
from llmopt.cli.options import config_from_cli, stage_options
from llmopt.pipeline.stages.evaluate import EvalConfig


@click.command("eval")
@stage_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@user_errors
@hub_options()
def eval_command(as_json: bool, **params):
    """Perplexity of MODEL on a text and, with --baseline, KLD / top-1 agreement against another model.

    Windows are non-overlapping; each scores seq_len - 1 tokens. The baseline's distributions
    are cached, so evaluating several variants against it computes them once.

    """
    from llmopt.cli.tables import eval_table, task_table
    from llmopt.core.console import out
    from llmopt.pipeline.stages.evaluate import run_evaluate

    payload = run_evaluate(config_from_cli(EvalConfig, params))
    if as_json:
        emit_json(payload)
    elif params.get("tasks"):
        out.print(task_table(payload))
    else:
        title = f"{params['model']}" + (f" vs {params['baseline']}" if params.get("baseline") else "")
        out.print(eval_table(title, payload))


@click.command("inspect")
@click.argument("model")
@click.option("--no-sparsity", is_flag=True, help="Skip reading dense weights to measure sparsity (faster on big models).")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON, one entry per module.")
@user_errors
@hub_options()
def inspect_command(model, no_sparsity, as_json):
    """Architecture, parameters, per-module format (dense / int4 / int8 / fp8 / nf4, group size,
    sparsity) and bytes on disk and in memory of MODEL."""
    from llmopt.checkpoints.info import inspect_checkpoint
    from llmopt.checkpoints.models import resolve_model
    from llmopt.cli.tables import info_tables
    from llmopt.core.console import out

    info = inspect_checkpoint(resolve_model(model), sparsity=not no_sparsity)
    if as_json:
        emit_json(info.to_dict())
    else:
        for table in info_tables(info):
            out.print(table)
