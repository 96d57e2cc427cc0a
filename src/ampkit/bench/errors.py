"""The one error a command raises for a bad value a user gave it.

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
