"""The command line: the only layer that imports click and builds rich tables."""

from llmopt.cli.main import main

__all__ = ["main"]
