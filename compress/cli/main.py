"""The ``llmopt`` command group: every command registered in one place."""

from __future__ import annotations

import os

import click

# Libraries' own tqdm bars (ours are rich); tqdm reads this when it is first imported. Hub downloads
# keep huggingface_hub's bars, on stderr (llmopt.checkpoints.hub.progress_bar).
os.environ.setdefault("TQDM_DISABLE", "1")

from llmopt import __version__
from llmopt.cli.common import MODEL_HELP


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


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


main.__doc__ = (main.__doc__ or "") + "\n\n" + MODEL_HELP


def _register() -> None:
    from llmopt.cli.compare import compare_command, demo_command
    from llmopt.cli.distill import distill_command
    from llmopt.cli.evaluate import eval_command, inspect_command
    from llmopt.cli.export import export_command
    from llmopt.cli.prune import prune_command
    from llmopt.cli.quantize import quantize_command
    from llmopt.cli.recipe import recipes_group, run_command
    from llmopt.cli.runtime import bench_command, generate_command
    from llmopt.cli.serve import serve_command

    for command in (eval_command, inspect_command, quantize_command, export_command, distill_command, generate_command,
                    bench_command, serve_command, compare_command, demo_command, run_command, recipes_group, prune_command):
        main.add_command(command)


_register()
