"""The ``llmopt`` command line."""

from __future__ import annotations

import json
import os
import sys
from functools import wraps

import click

from . import __version__
from .errors import LlmoptError

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
    from .evaluate import run_eval, save_json
    from .reports import eval_table
    from .console import out

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
    from .model_info import inspect_checkpoint
    from .models import resolve_model
    from .reports import info_tables
    from .console import out

    info = inspect_checkpoint(resolve_model(model), sparsity=not no_sparsity)
    if as_json:
        emit_json(info.to_dict())
    else:
        for table in info_tables(info):
            out.print(table)


main.__doc__ = (main.__doc__ or "") + "\n\n" + MODEL_HELP
