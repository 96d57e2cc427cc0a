"""Presenting results, shared by the commands: progress, tables, environment, JSON.

The bench's own table, sentences and recommendation are ``bench.verdict``; its plot is
``bench.plot``.

rich and matplotlib are optional (the ``cli`` extra): without rich the tables are plain
text and the progress is one updating line; without matplotlib ``--plot`` is refused
before anything runs.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
from typing import IO, Any, Callable, Optional, Sequence

import torch

from .. import __version__
from .._dtypes import capability, fp8_supported, recommend_policy
from .errors import UsageError

OnStep = Callable[[int, int], None]



def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def environment(device: str) -> dict[str, Any]:
    """Versions, device and what it runs natively, as stored in every JSON document."""
    cap = capability(device)
    policy, reason = recommend_policy(device)
    env = {"ampkit": __version__, "torch": torch.__version__, "device": cap.device,
           "device_name": cap.name,
           "native": {"bf16": cap.bf16, "fp16": cap.fp16, "fp8": fp8_supported(device)},
           "recommended_policy": policy, "recommended_reason": reason}
    if torch.device(device).type == "cuda":
        env["fp32_math"] = fp32_math()
    return env


def fp32_math() -> str:
    """How torch runs "fp32" on CUDA right now (its defaults are left as they are).

    torch's defaults: fp32 matmuls in full fp32, but cuDNN convolutions in TF32 — so an
    fp32 CNN row on an Ampere+ GPU already has TF32 convolutions in it.
    """
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    conv_tf32 = conv == "tf32" if conv is not None else bool(torch.backends.cudnn.allow_tf32)
    return (f"matmul precision {torch.get_float32_matmul_precision()!r} (TF32 unless 'highest'), "
            f"cuDNN convolutions {'TF32' if conv_tf32 else 'fp32'}")


def write_json(document: dict[str, Any], path: str) -> None:
    """Write ``document`` to ``path`` ("-": stdout), creating the folder.

    Strict JSON: inf, -inf and NaN (an SQNR, a diverged loss) become the strings "inf",
    "-inf" and "nan" (see :func:`strict_json`), which every JSON reader accepts.
    """
    text = json.dumps(strict_json(document), indent=2, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as out:
        out.write(text + "\n")


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by "inf", "-inf" or "nan".

    Example:
        >>> strict_json({"sqnr": [float("inf"), 3.0], "loss": float("nan")})
        {'sqnr': ['inf', 3.0], 'loss': 'nan'}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


# --- progress ----------------------------------------------------------------------------
class Progress:
    """A progress bar per task (rich when installed, else one updating line on stderr).

    Args:
        enabled: False (``--quiet``, or stdout is not a terminal) shows nothing.
        keep_done: finished bars stay (one per policy); False: each new task replaces
            the previous bar (one per epoch).

    Example:
        >>> with Progress(enabled=False) as progress:
        ...     progress.task("32-true")(1, 10)
    """

    def __init__(self, enabled: bool, keep_done: bool = True) -> None:
        self.enabled = enabled
        self.keep_done = keep_done
        self._rich: Any = None
        self._last: Any = None

    def __enter__(self) -> "Progress":
        if self.enabled and have_rich():
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn)
            # Redrawn twice a second: the drawing thread takes the GIL from the loop that
            # launches the kernels, so it should take it rarely.
            self._rich = RichProgress(TextColumn("{task.description:>18}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                                      refresh_per_second=2)
            self._rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.stop()  # also when the body raised: the terminal is given back
            self._rich = None
        elif self.enabled:
            sys.stderr.write("\n")

    def task(self, label: str) -> OnStep:
        """A callback ``(done, total)`` that advances ``label``'s bar."""
        if not self.enabled:
            return lambda done, total: None
        if self._rich is not None:
            if not self.keep_done and self._last is not None:
                self._rich.remove_task(self._last)
            task_id = self._last = self._rich.add_task(label, total=None)
            return lambda done, total: self._rich.update(task_id, completed=done, total=total)

        def plain(done: int, total: int) -> None:
            sys.stderr.write(f"\r{label:>18}: {done}/{total}")
            sys.stderr.flush()
        return plain


# --- tables --------------------------------------------------------------------------------
def console(out: IO[str], width: Optional[int] = None) -> Any:
    """A rich Console on ``out`` (rich must be installed) whose closed pipe raises
    BrokenPipeError, as ``print`` does: rich's own exits with status 1 and points stdout at
    os.devnull, whatever ``out`` is; the CLI ends quietly on it (``ampkit.cli.main``)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return _Console(file=out, width=width)


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                 out: IO[str], left: Sequence[int] = (0,)) -> None:
    """A table: rich's when installed, else plain text; columns in ``left`` left-aligned,
    the others (numbers) right-aligned."""
    if have_rich():
        from rich.table import Table
        table = Table(title=title)
        for i, head in enumerate(headers):
            table.add_column(head, justify="left" if i in left else "right")
        for row in rows:
            table.add_row(*row)
        # A terminal's own width; files and pipes get one that fits the table unwrapped
        # (each column's widest cell plus rich's 3 characters of border and padding).
        natural = 1 + sum(3 + max([len(h)] + [len(r[i]) for r in rows])
                          for i, h in enumerate(headers))
        width = None if out.isatty() else max(130, len(title), natural)
        console(out, width).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out.write(title + "\n")
    for row in [list(headers)] + [list(r) for r in rows]:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.write("  ".join(cells).rstrip() + "\n")


# --- plot ----------------------------------------------------------------------------------
def require_matplotlib(path: str) -> None:
    """Refuse ``--plot PATH`` before running when matplotlib is absent or PATH is no PNG."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path!r}: the plot is a PNG; valid: a path ending in .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot {path!r} needs matplotlib, which is not installed; valid: "
                          "pip install 'ampkit[cli]' (or matplotlib), or leave out --plot") from None
