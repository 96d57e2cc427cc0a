"""Whether an output path can be written, told before a run and without making anything."""

from __future__ import annotations

import os
import tempfile


def check_can_create(path: str) -> None:
    """OSError unless a file or folder can be made at ``path``: the nearest folder above it
    that exists is a folder this process can write in (a scratch file there, removed). The
    folders in between are not made: the run makes them when it writes, so a run refused
    meanwhile leaves none behind."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if not os.path.isdir(folder):
        raise OSError(0, f"{folder!r} is a file")
    with tempfile.TemporaryFile(dir=folder):
        pass
