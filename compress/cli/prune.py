"""``llmopt prune``: unstructured, N:M and structured (layers, channels, heads) pruning."""

from __future__ import annotations

import click
from rich.table import Table

from llmopt.cli.common import emit_json, hub_options, json_option, user_errors
from llmopt.cli.options import config_from_cli, stage_options
from llmopt.cli.tables import calibration_text, record_table
from llmopt.pipeline.stages.prune import PruneConfig


def prune_table(record: dict) -> Table:
    """A summary of what a pruning did."""
    params = record["parameters"]
    rows: list[tuple[str, str | None]] = [
        ("source", record["source_spec"]),
        ("method", record["method"] + "".join(f", {k} {v}" for k, v in record.get("settings", {}).items())),
        ("parameters", f"{params['before']:,} → {params['after']:,} ({100 * (1 - params['after'] / params['before']):.1f}% fewer)"),
        ("calibration", calibration_text(record.get("calibration"))),
    ]
    if "sparsity" in record:
        s = record["sparsity"]
        rows.append(("decoder Linear sparsity", f"{100 * s['overall']:.2f}% (per layer {100 * min(s['layers']):.1f}–{100 * max(s['layers']):.1f}%)"))
        if s.get("pattern"):
            rows.append((f"{s['pattern']} pattern", "valid in every Linear" if s.get("pattern_valid") else "VIOLATED"))
    if "depth" in record:
        d = record["depth"]
        rows.append(("layers", f"{d['layers'][0]} → {d['layers'][1]} (dropped {', '.join(map(str, d['dropped']))}; ranking {d['ranking']['method']})"))
    if "width" in record:
        w = record["width"]
        rows.append(("MLP channels", f"{w['intermediate'][0]} → {w['intermediate'][1]}"))
        rows.append(("heads / KV heads", f"{w['heads'][0]}/{w['kv_heads'][0]} → {w['heads'][1]}/{w['kv_heads'][1]} ({w['head_mode']})"))
    rows += [("weights on disk", f"{record['weights_bytes'] / 2**20:.1f} MiB"), ("time", f"{record['total_seconds']:.1f} s"),
             ("peak RSS", f"{record['peak_rss_mib']:.0f} MiB")]
    return record_table(f"pruned → {record.get('output')}", rows, record.get("evaluation"))


@click.command("prune")
@stage_options(PruneConfig)
@json_option
@user_errors
@hub_options()
def prune_command(as_json: bool, **params):
    """Prune MODEL and save the result to OUTPUT.

    Weight sparsity (magnitude, wanda, sparsegpt) keeps the model's shapes and saves dense
    safetensors with exact zeros (a later `llmopt quantize` keeps them zero); llmopt.json
    records the sparsity per layer and module. drop-layers and width save a smaller model
    that transformers loads as it is.

    \b
    Examples:
      llmopt prune demo --method sparsegpt --sparsity 0.5 -o out/sgpt50
      llmopt prune demo --method wanda --pattern 2:4 -o out/wanda24
      llmopt prune demo --method wanda --sparsity 0.6 --profile owl -o out/owl60
      llmopt prune demo --method drop-layers --num 4 --ranking perplexity -o out/drop4
      llmopt prune demo --method width --ffn-ratio 0.25 --heads-ratio 0.333 -o out/narrow

    MODEL is 'demo' (bundled SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file or a Hub id.
    """
    from llmopt.core.console import out
    from llmopt.pipeline.stages.prune import run_prune

    record = run_prune(config_from_cli(PruneConfig, params))
    if as_json:
        emit_json(record)
    else:
        out.print(prune_table(record))
