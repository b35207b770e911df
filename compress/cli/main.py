"""The ``llmopt`` command line."""

from __future__ import annotations

import json
import os
import sys
from functools import wraps

import click

# Libraries' own tqdm bars (ours are rich); tqdm reads this when it is first imported.
os.environ.setdefault("TQDM_DISABLE", "1")

from llmopt import __version__
from llmopt.core.errors import LlmoptError

MODEL_HELP = "MODEL is 'demo' (bundled SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file or a Hub id."


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def user_errors(func):
    """Turn LlmoptError (and a few OS errors) into one line on stderr and exit code 2."""

    @wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except LlmoptError as exc:
            if os.environ.get("LLMOPT_DEBUG"):
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def emit_json(payload) -> None:
    click.echo(json.dumps(payload, indent=2))


def finish_stage(record: dict, output: str, baseline: str, run_evaluation: bool, as_json: bool, table) -> None:
    """End of ``quantize`` / ``prune``: optionally evaluate OUTPUT against BASELINE (recorded in
    its ``llmopt.json``), then print the record as JSON or as the table ``table()`` builds."""
    from pathlib import Path

    from llmopt.core.console import out

    if run_evaluation:
        from llmopt.accuracy import run_eval
        from llmopt.pipeline.stages.quantize import add_evaluation

        record["evaluation"] = run_eval(output, baseline).to_dict()
        add_evaluation(Path(output), record["evaluation"])
    if as_json:
        emit_json(record)
    else:
        out.print(table())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmopt")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def main(debug: bool) -> None:
    """Compress, run and measure Hugging Face causal language models.

    \b
    Quick start:
      llmopt eval demo                      perplexity of the bundled demo model
      llmopt eval OUT --baseline demo       KLD and top-1 agreement against the original
      llmopt inspect OUT                    what a checkpoint holds, module by module
    """
    if debug:
        os.environ["LLMOPT_DEBUG"] = "1"
    _quiet_libraries()


@main.command("eval")
@click.argument("model")
@click.option("--baseline", metavar="MODEL", help="Also report KL divergence and top-1 agreement against this model.")
@click.option("--dataset", default="wikitext2", show_default=True, help="Corpus name, text file, folder of .txt files, or hf:NAME[:CONFIG[:SPLIT]].")
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(2), help="Tokens per window.")
@click.option("--max-windows", default=16, show_default=True, type=click.IntRange(0), help="Score the first N windows (0: the whole text, ~150 windows of 2048 for WikiText-2).")
@click.option("--top-k", default=1024, show_default=True, type=click.IntRange(1), help="Baseline log-probs cached per token for KLD (the rest is merged into one bucket).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Also write the JSON figures to this file.")
@user_errors
def eval_command(model, baseline, dataset, seq_len, max_windows, top_k, as_json, output):
    """Perplexity of MODEL on a text and, with --baseline, KLD / top-1 agreement against another model.

    Windows are non-overlapping; each scores seq_len - 1 tokens. The baseline's distributions
    are cached, so evaluating several variants against it computes them once.

    """
    from llmopt.core.console import out
    from llmopt.accuracy import run_eval, save_json
    from llmopt.cli.tables import eval_table

    result = run_eval(model, baseline, dataset, seq_len, max_windows or None, top_k)
    payload = {"model": model, "baseline": baseline, **result.to_dict()}
    if output:
        save_json(output, payload)
    if as_json:
        emit_json(payload)
    else:
        title = f"{model}" + (f" vs {baseline}" if baseline else "")
        out.print(eval_table(title, payload))


@main.command("inspect")
@click.argument("model")
@click.option("--no-sparsity", is_flag=True, help="Skip reading dense weights to measure sparsity (faster on big models).")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON, one entry per module.")
@user_errors
def inspect_command(model, no_sparsity, as_json):
    """Architecture, parameters, per-module format (dense / int4 / int8 / fp8 / nf4, group size,
    sparsity) and bytes on disk and in memory of MODEL."""
    from llmopt.core.console import out
    from llmopt.checkpoints.info import inspect_checkpoint
    from llmopt.checkpoints.models import resolve_model
    from llmopt.cli.tables import info_tables

    info = inspect_checkpoint(resolve_model(model), sparsity=not no_sparsity)
    if as_json:
        emit_json(info.to_dict())
    else:
        for table in info_tables(info):
            out.print(table)


@main.command("quantize")
@click.argument("model")
@click.option("--scheme", required=True, metavar="SCHEME", help="W4A16, W4A16_ASYM, W8A16, W8A8, FP8, FP8_DYNAMIC or NF4 (compressed-tensors names).")
@click.option("--method", default="rtn", show_default=True, metavar="METHOD", help="rtn, gptq, awq, awq+gptq, smoothquant, smoothquant+gptq.")
@click.option("--group-size", type=click.IntRange(0), help="int4 group size (32/64/128; 0: per-channel). Default 128.")
@click.option("--strict-groups", is_flag=True, help="Refuse layers the group size does not divide instead of using the largest divisor.")
@click.option("--calib", default="austen", show_default=True, help="Calibration text: corpus name, file, folder or hf:NAME.")
@click.option("--calib-samples", default=128, show_default=True, type=click.IntRange(1))
@click.option("--calib-seq-len", default=512, show_default=True, type=click.IntRange(8))
@click.option("--seed", default=0, show_default=True, help="Seed for the calibration sample offsets.")
@click.option("--ignore", multiple=True, metavar="REGEX", help="Keep matching Linears in float (repeatable; lm_head is always kept).")
@click.option("--act-order/--no-act-order", default=None, help="GPTQ: activation ordering with static groups, so the saved format stays plain [default: on for GPTQ methods].")
@click.option("--damp", default=0.01, show_default=True, help="GPTQ: dampening, fraction of the mean Hessian diagonal.")
@click.option("--alpha", "smooth_alpha", default=0.5, show_default=True, help="SmoothQuant migration strength.")
@click.option("--clip-search/--no-clip-search", default=None, help="Search each group's clipping range (default: on for calibrated methods).")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Output checkpoint directory.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--eval", "run_evaluation", is_flag=True, help="Evaluate the result against MODEL afterwards (16 windows of 2048) and record it.")
@click.option("--json", "as_json", is_flag=True, help="Print the provenance record as JSON.")
@user_errors
def quantize_command(model, scheme, method, group_size, strict_groups, calib, calib_samples, calib_seq_len, seed, ignore,
                     act_order, damp, smooth_alpha, clip_search, output, overwrite, run_evaluation, as_json):
    """Quantize MODEL's Linear layers and save a compressed-tensors checkpoint to OUTPUT.

    \b
    Examples:
      llmopt quantize demo --scheme W4A16 --group-size 32 --method gptq -o out/w4-gptq
      llmopt quantize demo --scheme W8A8 --method smoothquant -o out/w8a8
    """
    from pathlib import Path

    from llmopt.pipeline.stages.quantize import QuantizeRequest, quantize_checkpoint
    from llmopt.cli.tables import quantize_table

    request = QuantizeRequest(
        model=model, output=Path(output), scheme=scheme, method=method.lower(), group_size=group_size,
        calib=calib, calib_samples=calib_samples, calib_seq_len=calib_seq_len, seed=seed,
        ignore=["lm_head", *ignore], strict_groups=strict_groups, act_order=act_order, damp=damp,
        smooth_alpha=smooth_alpha, clip_search=clip_search, overwrite=overwrite,
    )
    record = quantize_checkpoint(request)
    finish_stage(record, output, model, run_evaluation, as_json, lambda: quantize_table(str(output), record))


main.__doc__ = (main.__doc__ or "") + "\n\n" + MODEL_HELP


from llmopt.cli.export import export_command

main.add_command(export_command)

from llmopt.cli.distill import distill_command

main.add_command(distill_command)


from llmopt.cli.runtime import bench_command, generate_command

main.add_command(generate_command)
main.add_command(bench_command)
from llmopt.cli.compare import compare_command, demo_command
from llmopt.cli.recipe import recipes_group, run_command

main.add_command(compare_command)
main.add_command(demo_command)

main.add_command(run_command)
main.add_command(recipes_group)


from llmopt.cli.prune import prune_command

main.add_command(prune_command)

from llmopt.cli.serve import serve_command  # noqa: E402

main.add_command(serve_command)
