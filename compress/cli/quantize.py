"""``llmopt quantize``: the quantize stage from the command line."""

from __future__ import annotations

import click

from llmopt.cli.common import emit_json, hub_options, json_option, user_errors
from llmopt.cli.options import config_from_cli, stage_options
from llmopt.pipeline.stages.quantize import QuantizeConfig


@click.command("quantize")
@stage_options(QuantizeConfig)
@json_option
@user_errors
@hub_options()
def quantize_command(as_json: bool, **params):
    """Quantize MODEL's Linear layers and save a compressed-tensors checkpoint to OUTPUT.

    \b
    Examples:
      llmopt quantize demo --scheme W4A16 --group-size 32 --method gptq -o out/w4-gptq
      llmopt quantize demo --scheme W8A8 --method smoothquant -o out/w8a8
    """
    from llmopt.cli.tables import quantize_table
    from llmopt.core.console import out
    from llmopt.pipeline.stages.quantize import run_quantize

    record = run_quantize(config_from_cli(QuantizeConfig, params))
    if as_json:
        emit_json(record)
    else:
        out.print(quantize_table(str(params["output"]), record))
