"""What every ``ampkit`` subcommand shares: the parser, devices, output paths, errors.

Every bad value ends a command with exit status 2 and one line on stderr naming it and
the valid choices (a ``UsageError`` from anywhere under the command); no traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
from typing import Any, NoReturn, Optional, Sequence

import torch

from .._dtypes import default_device_type
from ..bench.errors import UsageError

__all__ = ["Parser", "UsageError", "add_common", "check_device", "check_output_paths",
           "one_line"]


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the bad value, the valid ones, a hint), and
    an unknown option is reported by the parser it was given to (a subcommand's own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return parsed

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """The usage error for arguments this parser does not know, with the closest option."""
        known = [s for action in self._actions for s in action.option_strings]
        close = [match for word in extras if word.startswith("-")
                 for match in difflib.get_close_matches(word.partition("=")[0], known, n=1)]
        self.error(f"unrecognized arguments: {' '.join(extras)}"
                   + (f"; did you mean {close[0]}?" if close else ""))


class _Subcommands(argparse._SubParsersAction):
    """argparse's subcommands, but the subcommand's parser reports what it does not know
    (argparse hands it to the top level: "ampkit: error", pointing at "ampkit --help")."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        # argparse parks the subcommand's unknown arguments here for the top level.
        extras = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        chosen = self.choices.get(values[0])
        if extras and isinstance(chosen, Parser):
            chosen.unrecognized(extras)
        if extras:
            setattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, extras)


def check_device(name: Optional[str]) -> str:
    """The device to run on: ``name`` validated, or ampkit's default device when None.

    Example: ``check_device(None)`` is "cpu" on a machine without a GPU.
    """
    if name is None:
        return default_device_type()
    valid = _valid_devices()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r}; valid: {valid}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise UsageError(f"device {name!r} is not supported by ampkit's commands; valid: {valid}")
    if not torch.cuda.is_available():
        raise UsageError(f"device {name!r} is not available here (torch {torch.__version__}, "
                         f"no CUDA device); valid: {valid}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"device {name!r} does not exist; valid: {valid}")
    return str(device)


def _valid_devices() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return "cpu, cuda, " + ", ".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))


def check_output_paths(**paths: Optional[str]) -> None:
    """Fail before a run, not after it, when an output file could not be written (makes
    nothing: see :func:`ampkit.bench.paths.check_can_create`)."""
    from ..bench.paths import check_can_create

    for flag, path in paths.items():
        if not path or path == "-":
            continue
        try:
            if os.path.isdir(path):
                raise OSError(0, "it is a folder")
            check_can_create(path)
        except OSError as err:
            raise UsageError(f"--{flag} {path!r} cannot be written ({err.strerror or err}); "
                             "valid: a file path in a folder you can write to") from None
    check_distinct(**paths)


def check_distinct(**paths: Optional[str]) -> None:
    """Refuse two outputs (or a checkpoint) naming one file: the later write replaced the
    earlier (a JSON log over a checkpoint, a plot over the JSON)."""
    seen: dict[str, str] = {}
    for flag, path in paths.items():
        if not path or path == "-":
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(f"--{flag} and --{seen[key]} name the same file {path!r}; valid: "
                             "a different path for each")
        seen[key] = flag


def add_common(p: argparse.ArgumentParser, models: str, model_default: str) -> None:
    """The options bench, train, doctor and tune share: model, batch, device, seed, JSON."""
    p.add_argument("--model", default=model_default, metavar="NAME",
                   help=f"{models} (default: {model_default})")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples per step (default: "
                   "the model's for the device)" if model_default == "gpt" else
                   "samples per step (default 64)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': to "
                   "stdout, and the human-readable output to stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (also off when "
                   "stdout is not a terminal)")


def one_line(err: BaseException) -> str:
    """An exception's message on one line (for the CLI's stderr)."""
    return " ".join(str(err).split())
