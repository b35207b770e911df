"""Shared rich consoles and progress bars: data to stdout, progress and notices to stderr."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

out = Console()
err = Console(stderr=True)


def notice(message: str) -> None:
    """A one-line notice on stderr (never mixed into --json output)."""
    err.print(f"[yellow]note:[/yellow] {message}", highlight=False)


def make_progress(transient: bool = True) -> Progress:
    return Progress(
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=transient,
    )


_active: Progress | None = None  # the display on screen; nested bars join it as extra lines


@contextmanager
def progress_task(description: str, total: int) -> Iterator:
    """Yield an ``advance()`` callable for a progress bar.

    Nested calls (a quantization inside a recipe inside ``llmopt demo``) add a line to the one
    display already on screen instead of starting a second one.
    """
    global _active
    if _active is not None:
        progress = _active
        task = progress.add_task(description, total=total)
        try:
            yield lambda n=1: progress.advance(task, n)
        finally:
            progress.remove_task(task)
        return
    with make_progress() as progress:
        _active = progress
        try:
            task = progress.add_task(description, total=total)
            yield lambda n=1: progress.advance(task, n)
        finally:
            _active = None
