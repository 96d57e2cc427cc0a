"""The one error a command raises for a bad value a user gave it, and the interrupt that
carries what ``bench`` measured before it.

``ampkit`` exits with status 2 and prints the message on one line (no traceback) for a
UsageError raised anywhere under a command: a bad option, model, policy, dataset, plot
path or checkpoint. Every other exception is a failure (exit 1).
"""

from __future__ import annotations


class UsageError(ValueError):
    """A bad value given to an ``ampkit`` command: the message names it and the valid ones.

    Example:
        >>> raise UsageError("--steps must be at least 1, got 0")
        Traceback (most recent call last):
        ...
        ampkit.bench.errors.UsageError: --steps must be at least 1, got 0
    """


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a time limit's SIGINT) during ``bench``'s rounds:
    ``results`` are the compared rows of the steps run so far (``runner.run_bench``)."""

    def __init__(self, results: list) -> None:
        super().__init__("interrupted")
        self.results = results
