"""Warnings given once per process and key, attributed to the user's own line.

The one set of keys already warned about is the only state here; the test fixture
empties it with :func:`forget`.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Hashable

from ._torch_compat import is_compiling

_INTERNAL = (os.path.join("ampkit", ""), os.path.join("torch", "nn", ""),
             os.path.join("torch", "overrides"))
_given: set = set()


def warn_once(key: Hashable, message: str, category: type[Warning] = UserWarning) -> None:
    """Warn ``message`` unless a warning with ``key`` was given before in this process.

    ``key`` must name a kind of warning, not an object: keys stay for the whole process
    (a warning once per object keeps its flag on that object and calls :func:`warn`)."""
    if key in _given or is_compiling():  # dynamo cannot trace the frame walk below
        return
    _given.add(key)
    warnings.warn(message, category, stacklevel=_caller_stacklevel())


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn ``message`` at the user's own line (none while dynamo traces)."""
    if not is_compiling():
        warnings.warn(message, category, stacklevel=_caller_stacklevel())


def forget() -> None:
    """Warn again about every key (tests)."""
    _given.clear()


def _caller_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside ampkit and torch.nn."""
    frame, level = sys._getframe(2), 2
    while frame is not None and any(part in frame.f_code.co_filename for part in _INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
