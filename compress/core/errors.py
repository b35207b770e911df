"""User-facing errors: one line saying what is wrong and how to fix it."""

from __future__ import annotations


class LlmoptError(Exception):
    """A problem with the user's input. The CLI prints the message alone and exits with 2."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class NumericalError(LlmoptError):
    """A numerical failure of a calibrated method (e.g. a Hessian that is not positive definite)."""

    def at(self, where: str) -> "NumericalError":
        """The same failure, naming where it happened (a module or layer)."""
        return NumericalError(f"{where}: {self.problem}", self.fix)
