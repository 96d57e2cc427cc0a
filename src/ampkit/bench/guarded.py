"""A benchmarked policy that fails becomes an error row, and the others go on.

``ampkit bench`` compares several policies in one run: one that raises while building,
warming up, stepping or finishing must not lose the others' results. ``guarded`` turns
an exception (anything but a ``UsageError``, a bad setting the same for every policy)
into ``{"policy", "resolved", "error", "traceback"}``; ``Guarded`` wraps a run that
takes turns in rounds, so that it sits out the rounds after it failed.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any, Callable, Sequence

import torch

from .errors import UsageError
from .policies import PolicySpec

__all__ = ["Guarded", "error_row", "failed", "free_device_memory", "guarded"]


def failed(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The error rows of ``run_bench``'s results (policies that raised)."""
    return [r for r in results if "error" in r]


def error_row(spec: PolicySpec, err: BaseException) -> dict[str, Any]:
    message = " ".join(str(err).split())
    return {"policy": spec.label, "resolved": spec.resolved,
            "error": f"{type(err).__name__}: {message}"[:2000],
            "traceback": traceback.format_exc(limit=-8)}


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def guarded(spec: PolicySpec, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s result, or an error row when it raises anything but a ``UsageError``."""
    try:
        return fn()
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - one failing policy must not lose the others
        row = error_row(spec, err)
    free_device_memory()  # out of the except block: its traceback holds the failed frames
    return row


class Guarded:
    """A run (``PolicyRun`` or a worker standing in for one) whose failure is recorded in
    ``error`` instead of raised; ``play_rounds`` then leaves it out of the later rounds."""

    def __init__(self, spec: PolicySpec, make: Callable[[], Any]) -> None:
        self.spec, self.label, self.error = spec, spec.label, None
        self._run: Any = None
        self._run = self._call(make)

    @property
    def round_ms(self) -> list[float]:
        return [] if self._run is None else self._run.round_ms

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        result = guarded(self.spec, lambda: {"value": fn(*args)})
        if "error" in result:
            self.error = result
            self._run = None  # a PolicyRun's model and batches: freed now
            free_device_memory()
            return None
        return result["value"]

    def warm_up(self) -> None:
        if self.error is None:
            self._call(self._run.warm_up)

    def run(self, steps: int) -> list[float]:
        return ([] if self.error is not None else self._call(self._run.run, steps)) or []

    def finish(self) -> dict[str, Any]:
        if self.error is None:
            result = self._call(self._run.finish)
            if result is not None:
                return dict(result, interleaved=True)
        return self.error  # type: ignore[return-value]
