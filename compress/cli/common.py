"""What every command shares: the error boundary, JSON output and the MODEL help text."""

from __future__ import annotations

import errno
import json
import os
import sys
from functools import wraps

import click

from llmopt.core.errors import LlmoptError

MODEL_HELP = ("MODEL is 'demo' (bundled SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file or a Hub id "
              "(org/name or org/name@revision).")

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")


def hub_options(model_param: str | None = "model"):
    """``--trust-remote-code`` and, for the parameter ``model_param`` (None: no such option),
    ``--revision``. Goes below ``user_errors``, so that a conflict is a one-line error."""

    def decorate(func):
        @wraps(func)
        def wrapper(*args, trust_remote_code: bool = False, revision: str | None = None, **kwargs):
            from llmopt.checkpoints.hub import with_revision
            from llmopt.checkpoints.remote_code import trusting

            if model_param:
                kwargs[model_param] = with_revision(kwargs[model_param], revision)
            with trusting(trust_remote_code):
                return func(*args, **kwargs)

        wrapper = click.option("--trust-remote-code", is_flag=True,
                               help="Let a checkpoint run its own Python code (its config's auto_map); only for "
                                    "repositories you trust.")(wrapper)
        if model_param:
            wrapper = click.option("--revision", metavar="REV",
                                   help=f"Hub branch, tag or commit of {model_param.upper()} (same as "
                                        f"{model_param.upper()}@REV) [default: the repository's default branch].")(wrapper)
        return wrapper

    return decorate


def user_message(exc: BaseException) -> str | None:
    """One line for failures a user can cause (and fix); None for genuine bugs."""
    if isinstance(exc, LlmoptError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        hints = {
            errno.EACCES: "check the permissions of that path, or write somewhere else",
            errno.EPERM: "check the permissions of that path, or write somewhere else",
            errno.ENOSPC: "free disk space or write to another disk",
            errno.EROFS: "write to a writable location",
            errno.ENOENT: "check the path",
            errno.ENOTDIR: "check the path: a part of it is a file",
            errno.EISDIR: "pass a file path, not a directory",
            errno.EEXIST: "remove it or pass --overwrite",
        }
        fix = hints.get(exc.errno, "check the path and the disk")
        return f"cannot access{where}: {exc.strerror or exc}; {fix}"
    if isinstance(exc, MemoryError):
        return "out of memory; use a smaller model, fewer calibration samples or a machine with more memory"
    if isinstance(exc, ModuleNotFoundError):
        return f"a required package is missing ({exc.name}); run: pip install {exc.name}"
    try:
        import torch
    except ImportError:
        return None
    if isinstance(exc, torch.linalg.LinAlgError):
        return (f"numerical failure: {str(exc).splitlines()[0]}; the calibration Hessian is not positive definite — "
                "raise --damp (e.g. 0.1) or use more calibration samples")
    return None


def user_errors(func):
    """The error boundary: user-caused failures become one line on stderr and exit code 2
    (Ctrl-C: 130); anything else is a bug and keeps its traceback (``--debug`` shows all)."""

    @wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the boundary decides what the user sees
            message = user_message(exc)
            if message is None or os.environ.get("LLMOPT_DEBUG"):
                raise
            click.echo(f"error: {message}", err=True)
            sys.exit(getattr(exc, "exit_code", 2))

    return wrapper


def emit_json(payload) -> None:
    click.echo(json.dumps(payload, indent=2, default=str))
