"""``llmopt prune``: unstructured, N:M and structured (layers, channels, heads) pruning."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from llmopt.cli.main import finish_stage, user_errors
from llmopt.cli.tables import calibration_text, record_table


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
@click.argument("model")
@click.option("--method", required=True, metavar="METHOD", help="magnitude, wanda, sparsegpt (weight sparsity); drop-layers (depth); width (MLP channels / attention heads).")
@click.option("--sparsity", type=float, help="magnitude/wanda/sparsegpt: fraction of weights removed from every output row, in (0, 1).")
@click.option("--pattern", metavar="N:M", help="magnitude/wanda/sparsegpt: semi-structured sparsity, at most N nonzeros in every M consecutive inputs (2:4, 4:8).")
@click.option("--profile", metavar="PROFILE", help="With --sparsity: 'uniform' (default) or 'owl' (outlier-weighted per-layer sparsity, same mean).")
@click.option("--num", type=int, help="drop-layers: how many decoder layers to remove.")
@click.option("--ranking", metavar="RANKING", help="drop-layers: 'block-influence' (1 - cos(input, output), default) or 'perplexity' (calibration perplexity without the block).")
@click.option("--ffn-ratio", type=float, help="width: fraction of MLP intermediate channels removed, e.g. 0.25.")
@click.option("--heads-ratio", type=float, help="width: fraction of attention heads removed (whole KV groups, or the same number of query heads per group).")
@click.option("--heads-mode", default="auto", show_default=True, metavar="MODE", help="width: auto, kv-groups or query-heads.")
@click.option("--calib", default="austen", show_default=True, help="Calibration text: corpus name, file, folder or hf:NAME.")
@click.option("--calib-samples", type=click.IntRange(1), help="Calibration windows (default 128; 16 for drop-layers).")
@click.option("--calib-seq-len", default=512, show_default=True, type=click.IntRange(8), help="Tokens per calibration window.")
@click.option("--seed", default=0, show_default=True, help="Seed for the calibration sample offsets.")
@click.option("--damp", default=0.01, show_default=True, help="sparsegpt: dampening, fraction of the mean Hessian diagonal.")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Output checkpoint directory.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--eval", "run_evaluation", is_flag=True, help="Evaluate the result against MODEL afterwards (16 windows of 2048) and record it.")
@click.option("--json", "as_json", is_flag=True, help="Print the provenance record as JSON.")
@user_errors
def prune_command(model, method, sparsity, pattern, profile, num, ranking, ffn_ratio, heads_ratio, heads_mode, calib,
                  calib_samples, calib_seq_len, seed, damp, output, overwrite, run_evaluation, as_json):
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
    from llmopt.pipeline.stages.prune import PruneRequest, prune_checkpoint

    request = PruneRequest(
        model=model, output=Path(output), method=method.lower(), sparsity=sparsity, pattern=pattern,
        profile=None if profile is None else profile.lower(), num=num, ranking=None if ranking is None else ranking.lower(),
        ffn_ratio=ffn_ratio, heads_ratio=heads_ratio, heads_mode=heads_mode.lower(), calib=calib,
        calib_samples=calib_samples, calib_seq_len=calib_seq_len, seed=seed, damp=damp, overwrite=overwrite,
    )
    record = prune_checkpoint(request)
    finish_stage(record, output, model, run_evaluation, as_json, lambda: prune_table(record))

