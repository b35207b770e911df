"""``llmopt export``: write a checkpoint as GGUF (llama.cpp), dense safetensors or compressed-tensors."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from llmopt.cli.common import emit_json, hub_options, user_errors
from llmopt.cli.options import config_from_cli, stage_options
from llmopt.cli.tables import record_table
from llmopt.pipeline.stages.export import ExportConfig


def _gguf_tables(report) -> list[Table]:
    """Summary, per-type errors, and the type decisions of a GGUF export."""
    summary = record_table(f"exported → {report.output}", [
        ("source", f"{report.source} ({report.source_kind})"),
        ("architecture / layers", f"{report.architecture} / {report.layers}"),
        ("type asked / file type", f"{report.requested_type} / {report.file_type}"),
        ("size", f"{report.bytes / 2**20:.1f} MiB"),
        ("tokenizer", f"{report.tokenizer['model']} (pre {report.tokenizer['pre']}), {report.tokenizer['tokens']:,} tokens, "
                      f"{report.tokenizer['merges']:,} merges, chat template {'yes' if report.tokenizer['chat_template'] else 'no'}"),
        ("time", f"{report.seconds:.1f} s"),
    ])
    types = Table(title="read back and compared with the source", title_justify="left")
    for column in ("GGUF type", "tensors", "weights", "max |error|", "max rel. error", "codes identical"):
        types.add_column(column, justify="right" if column not in ("GGUF type",) else "left")
    for name, s in sorted(report.by_type.items()):
        codes = "—" if s["codes_identical"] is None else ("yes" if s["codes_identical"] else "NO")
        types.add_row(name, str(s["tensors"]), f"{s['weights']:,}", f"{s['max_abs_err']:.3g}", f"{s['max_rel_err']:.3g}", codes)
    tables = [summary, types]
    if report.verify:
        v = report.verify
        check = Table(title="transformers' GGUF loader vs the source", title_justify="left", show_header=False)
        check.add_column("field")
        check.add_column("value")
        if "error" in v or "limitation" in v:
            check.add_row("load", v.get("error") or v["limitation"])
        else:
            if "config" in v:
                check.add_row("config", v["config"])
            check.add_row("token ids match", "yes" if v["token_ids_match"] else "NO")
            check.add_row("chat template match", "yes" if v["chat_template_match"] else "NO")
            check.add_row("tokens compared", str(v["tokens"]))
            check.add_row("max |Δ logit| (relative)", f"{v['max_abs_logit_diff']:.3g} ({v['rel_logit_diff']:.2g})")
            check.add_row("KLD mean", f"{v['kld_mean']:.3g}")
            check.add_row("top-1 agreement", f"{100 * v['top1_agreement']:.1f}%")
        tables.append(check)
    return tables


@click.command("export")
@stage_options(ExportConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the report (per-tensor types and errors) as JSON.")
@user_errors
@hub_options()
def export_command(as_json: bool, **params):
    """Export MODEL to OUTPUT as GGUF (llama.cpp), dense safetensors (hf) or compressed-tensors.

    GGUF: our int4/int8 checkpoints keep their integer codes unchanged (only scales become fp16);
    dense checkpoints are quantized to --type. Llama, Mistral, Qwen2 / Qwen3, Gemma 2 / 3, Phi-3,
    Mixtral and Qwen2 / Qwen3-MoE are written with gguf's tensor names (experts stacked per
    projection, Gemma norms as 1 + w, the q/k permutation llama.cpp expects), the tokenizer (vocabulary, merges, special tokens, chat template) and model metadata
    are written. The file is read back and every tensor compared with the source before it is
    moved into place; nothing is left behind on error.

    \b
    Examples:
      llmopt export demo --type Q8_0 -o demo-q8_0.gguf
      llmopt export out/w4-gptq -o w4.gguf --verify          # int4 g32 → Q4_0, codes carried
      llmopt export out/w4-gptq --format hf -o out/w4-dense   # dequantized float checkpoint
    """
    from llmopt.core.console import notice, out
    from llmopt.pipeline.stages.export import run_export

    config = config_from_cli(ExportConfig, params)
    report = run_export(config)
    if as_json:
        emit_json(report.to_dict())
        return
    if config.resolved_format == "gguf":
        for table in _gguf_tables(report):
            out.print(table)
        for line in report.decisions + report.notes:
            notice(line)
    else:
        out.print(f"exported {report.source} ({report.source_kind}) → {Path(report.output)} "
                  f"[{report.format}{', ' + report.dtype if report.dtype else ''}, {report.bytes / 2**20:.1f} MiB, {report.seconds:.1f} s]",
                  markup=False, highlight=False)
        for line in report.notes:
            notice(line)
