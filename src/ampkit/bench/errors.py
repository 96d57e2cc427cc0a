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


def torchvision_install() -> str:
    """The pip command for the torchvision of the installed torch: a bare ``pip install
    torchvision`` pulls the newest torch with it (the multi-GB CUDA build over a CPU one).
    torchvision 0.N+15 goes with torch 2.N; a local build tag (``+cpu``) names its index."""
    import torch

    base, _, local = torch.__version__.partition("+")
    parts = base.split(".")
    if len(parts) < 2 or parts[0] != "2" or not parts[1].isdigit():
        return "pip install torchvision (the release made for your torch)"
    command = f'pip install "torchvision==0.{int(parts[1]) + 15}.*"'
    if local:
        command += f" --index-url https://download.pytorch.org/whl/{local}"
    return command


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a time limit's SIGINT) during ``bench``'s rounds:
    ``results`` are the compared rows of the steps run so far (``runner.run_bench``)."""

    def __init__(self, results: list) -> None:
        super().__init__("interrupted")
        self.results = results
