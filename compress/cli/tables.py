"""Rendering results as rich tables (stdout) and JSON."""

from __future__ import annotations

from rich.table import Table


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def eval_table(title: str, result: dict) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("perplexity", _fmt(result["perplexity"], 6)),
        ("baseline perplexity", _fmt(result.get("baseline_perplexity"), 6)),
        ("KLD mean", _fmt(result.get("kld_mean"))),
        ("KLD median", _fmt(result.get("kld_median"))),
        ("KLD p99", _fmt(result.get("kld_p99"))),
        ("top-1 agreement", None if result.get("top1_agreement") is None else f"{100 * result['top1_agreement']:.2f}%"),
        ("dataset", result["dataset"]),
        ("window (tokens)", _fmt(result["seq_len"])),
        ("windows", _fmt(result["windows"])),
        ("scored tokens", _fmt(result["tokens"])),
    ]
    for name, value in rows:
        if value not in (None, "—"):
            table.add_row(name, value)
    return table




def task_table(result: dict) -> Table:
    """Task scores with standard errors, and with a baseline its scores and the paired difference."""
    from llmopt.tasks.scores import task_rows

    rows = task_rows(result)
    baseline = any("baseline" in r for r in rows)
    table = Table(title=f"{result.get('model')} — task accuracy (lm-evaluation-harness)", title_justify="left")
    for column in ("task", "metric", "items", "shots", "value ± stderr") + (("baseline", "difference ± stderr") if baseline else ()):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")

    def pm(value, stderr, signed: bool = False) -> str:
        if value is None:
            return "—"
        text = f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"
        return text + (f" ± {100 * stderr:.1f}" if stderr is not None else "")

    for r in rows:
        cells = [r["task"], r["metric"], str(r["n"]), str(r["num_fewshot"]), pm(r["value"], r["stderr"])]
        if baseline:
            cells += [pm(r.get("baseline"), r.get("baseline_stderr")), pm(r.get("difference"), r.get("difference_stderr"), True)]
        table.add_row(*cells)
    return table


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def pruning_summary(pruning: dict | None) -> str | None:
    """One line for the pruning recorded in a checkpoint's llmopt.json (None when there is none)."""
    if not pruning:
        return None
    text = str(pruning.get("method"))
    sparsity = pruning.get("sparsity")
    if sparsity:
        layers = sparsity.get("layers") or [sparsity.get("overall", 0)]
        text += f", {100 * sparsity['overall']:.1f}% of decoder weights zero"
        text += f" ({sparsity['pattern']} {'valid' if sparsity.get('pattern_valid') else 'VIOLATED'})" if sparsity.get("pattern") else ""
        text += f", {sparsity.get('profile', 'uniform')} profile, layers {100 * min(layers):.1f}–{100 * max(layers):.1f}%"
    if pruning.get("depth"):
        d = pruning["depth"]
        text += f", layers {d['layers'][0]} → {d['layers'][1]} (dropped {', '.join(map(str, d['dropped']))})"
    if pruning.get("width"):
        w = pruning["width"]
        text += f", MLP {w['intermediate'][0]} → {w['intermediate'][1]}, heads {w['heads'][0]}/{w['kv_heads'][0]} → {w['heads'][1]}/{w['kv_heads'][1]}"
    params = pruning.get("parameters")
    if params:
        text += f"; parameters {params['before']:,} → {params['after']:,}"
    return text


def _online_summary(transforms: list[dict] | str | None) -> str | None:
    if transforms is None or isinstance(transforms, str):
        return transforms
    return "; ".join(f"Hadamard in blocks of {t['block']} on the inputs of {t['linears']} Linears" for t in transforms)


def info_tables(info) -> list[Table]:
    """A summary table and a per-module table (consecutive layers with one format collapsed)."""
    from llmopt.checkpoints.info import grouped_rows

    summary = record_table(f"{info.path}", [
        ("architecture", f"{info.architecture} ({info.model_type})"),
        ("parameters", f"{info.parameters:,}"),
        ("layers", str(info.layers)),
        ("hidden / heads / kv heads", f"{info.hidden_size} / {info.heads} / {info.kv_heads}"),
        ("vocabulary", f"{info.vocab_size:,}"),
        ("quantization", info.quantization or "none"),
        ("pruning (llmopt.json)", pruning_summary(info.pruning)),
        ("online transforms", _online_summary(info.online_transforms)),
        ("bytes on disk", _bytes(info.bytes_on_disk)),
        ("bytes in memory (tensors as stored)", _bytes(info.bytes_in_memory)),
        *[(f"runs with {consumer}", note) for consumer, note in info.runs_with.items()],
    ])
    modules = Table(title="Linear modules", title_justify="left")
    for column in ("module", "shape", "format", "sparsity"):
        modules.add_column(column)
    for row in grouped_rows(info.modules):
        modules.add_row(*row)
    return [summary, modules]


def record_table(title: str, rows: list[tuple[str, str | None]], evaluation: dict | None = None) -> Table:
    """A two-column field / value summary (rows whose value is None are left out), with a
    compression record's evaluation figures when present."""
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("field")
    table.add_column("value")
    if evaluation:
        rows = rows + [
            ("perplexity (baseline)", f"{evaluation['perplexity']:.4f} ({evaluation['baseline_perplexity']:.4f})"),
            ("KLD mean / p99", f"{evaluation['kld_mean']:.4f} / {evaluation['kld_p99']:.4f}"),
            ("top-1 agreement", f"{100 * evaluation['top1_agreement']:.2f}%"),
            ("eval windows", f"{evaluation['windows']} × {evaluation['seq_len']} ({evaluation['tokens']:,} tokens)"),
        ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, value)
    return table


def calibration_text(calib: dict | None) -> str | None:
    return None if not calib else f"{calib['name']}: {calib['samples']} × {calib['seq_len']} tokens, seed {calib['seed']}"


def quantize_table(title: str, record: dict) -> Table:
    groups = ", ".join(f"{k}: {v}" for k, v in (record.get("group_sizes") or {}).items())
    rows = [
        ("source", record["source_spec"]),
        ("scheme / method", f"{record['scheme']} / {record['method']}"),
        ("quantized Linears", _fmt(record.get("quantized_modules"))),
        ("group sizes (layers)", groups or None),
        ("calibration", calibration_text(record.get("calibration"))),
        ("time", f"{record['total_seconds']:.1f} s"),
        ("peak RSS", f"{record['peak_rss_mib']:.0f} MiB"),
    ]
    return record_table(f"quantized → {title}", rows, record.get("evaluation"))
