"""Progress of a training run: a rich live panel on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


@dataclass
class Progress:
    """What the display shows after each optimizer step."""

    step: int
    total: int
    terms: dict[str, float]
    lr: float
    tokens_per_s: float
    eta_s: float
    validation: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        terms = " ".join(f"{k} {v:.4f}" for k, v in self.terms.items())
        val = " ".join(f"val {k} {v:.4g}" for k, v in self.validation.items())
        return f"step {self.step}/{self.total}  {terms}  lr {self.lr:.2e}  {self.tokens_per_s:,.0f} tok/s  eta {_duration(self.eta_s)}  {val}".rstrip()

    def table(self) -> Table:
        table = Table(title="llmopt distill", title_justify="left", show_header=False, box=None)
        table.add_column("field", style="bold blue")
        table.add_column("value")
        table.add_row("step", f"{self.step}/{self.total}")
        for k, v in self.terms.items():
            table.add_row(k, f"{v:.4f}")
        table.add_row("lr", f"{self.lr:.2e}")
        table.add_row("tokens/s", f"{self.tokens_per_s:,.0f}")
        table.add_row("time left", _duration(self.eta_s))
        for k, v in self.validation.items():
            table.add_row(f"validation {k}", f"{v:.4g}")
        return table


class TrainDisplay:
    """Show :class:`Progress` live (terminal) or as a line every ``log_every`` steps (logs, pipes)."""

    def __init__(self, console: Console, enabled: bool = True, log_every: int = 10) -> None:
        self.console = console
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self.live = console.is_terminal and enabled
        self._live: Live | None = None

    def __enter__(self) -> TrainDisplay:
        if self.live:
            self._live = Live(console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, progress: Progress, force: bool = False) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(progress.table())
        elif force or progress.step % self.log_every == 0 or progress.step == progress.total:
            self.console.print(progress.line(), highlight=False, soft_wrap=True)

    def note(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)
