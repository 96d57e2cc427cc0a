"""The ``ampkit`` command: bench, train, info, doctor, tune.

One module per subcommand (``info``, ``bench``, ``train``, ...), each with
``add_parser(sub)`` and ``run(args) -> exit status``; ``_common`` holds what they share.
Every bad value (model, policy, device, data, option) ends the command with exit status
2 and one line on stderr naming it and the valid choices; no traceback.
"""

from __future__ import annotations

import os
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ampkit`` with ``argv`` (default: sys.argv[1:]); returns the exit status.

    Example: ``main(["info"])`` prints the device report and returns 0.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version (0) and usage errors (2)
        return stop.code if isinstance(stop.code, int) else 0
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args))
    except UsageError as err:
        print(f"ampkit {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one line for users; AMPKIT_DEBUG=1 for the rest
        if os.environ.get("AMPKIT_DEBUG"):
            raise
        print(f"ampkit {args.command}: failed: {type(err).__name__}: {one_line(err)} "
              "(AMPKIT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
