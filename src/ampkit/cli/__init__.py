"""The ``ampkit`` command: bench, train, info, doctor, tune.

One module per subcommand (``info``, ``bench``, ``train``, ...), each with
``add_parser(sub)`` and ``run(args) -> exit status``; ``_common`` holds what they share.
Every bad value (model, policy, device, data, option) ends the command with exit status
2 and one line on stderr naming it and the valid choices; no traceback. A reader that
closes stdout early (``ampkit train | head -1``) ends the command quietly with status 141,
a shell's status for a process SIGPIPE ended.
"""

from __future__ import annotations

import os
import select
import sys
from typing import Optional, Sequence

from .. import __version__
from . import bench, doctor, info, train, tune
from ._common import Parser, UsageError, one_line

_COMMANDS = (bench, train, info, doctor, tune)


def build_parser() -> Parser:
    """The ``ampkit`` argument parser with its subcommands."""
    parser = Parser(prog="ampkit", description="Automatic mixed precision for PyTorch: "
                    "compare precisions (bench), train with one (train), see what this "
                    "machine runs natively (info), find the module a precision hurts "
                    "(doctor), choose a precision by measuring (tune).")
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for command in _COMMANDS:
        command.add_parser(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    return parser


def _check_seed(seed: int) -> None:
    """The seeds every command takes: torch's int64 (a larger one failed deep in torch)."""
    if not -(2**63) <= seed <= 2**63 - 1:
        raise UsageError(f"--seed {seed} is out of range; valid: an integer in "
                         f"[-2**63, 2**63 - 1]")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ampkit`` with ``argv`` (default: sys.argv[1:]); returns the exit status.

    Example: ``main(["info"])`` prints the device report and returns 0.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version (0) and usage errors (2)
        return stop.code if isinstance(stop.code, int) else 0
    if args.command is None:  # as argparse's own usage errors: to stderr, status 2
        parser.print_help(sys.stderr)
        return 2
    try:
        _check_seed(getattr(args, "seed", 0))
        status = int(args.handler(args))
        sys.stdout.flush()  # what is still buffered: a closed pipe shows here, not at exit
        return status
    except UsageError as err:
        print(f"ampkit {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one line for users; AMPKIT_DEBUG=1 for the rest
        if isinstance(err, BrokenPipeError) and _stdout_closed():
            return _closed_stdout()
        if os.environ.get("AMPKIT_DEBUG"):
            raise
        print(f"ampkit {args.command}: failed: {type(err).__name__}: {one_line(err)} "
              "(AMPKIT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


# A shell's status for a process killed by SIGPIPE (128 + 13), what `cmd | head` expects.
SIGPIPE_STATUS = 141


def _closed_stdout() -> int:
    """A reader that stopped reading (``ampkit train | head -1``) is no failure: exit
    quietly. stdout goes to os.devnull first, so that the interpreter's own flush at exit
    does not report the pipe again (Python's docs, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_STATUS


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (and not another pipe, such as a
    worker's, that broke): poll reports an error on its write end then."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured output: no pipe of ours closed
        return False
    if not hasattr(select, "poll"):  # Windows: a broken pipe there is taken to be stdout
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
