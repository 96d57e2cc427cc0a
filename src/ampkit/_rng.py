"""Replaying random numbers: runs compared with each other draw the same ones.

``inspect`` runs its fp32 reference and its policy pass from one RNG state, and
``autotune`` starts every candidate's step from the same one, so dropout masks (and any
other random op) are the same in every run and only precision tells them apart. CPU and
CUDA generators are replayed; others are not.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor


class RngReplay:
    """The CPU (and, on a CUDA device, that device's) generator state at a mark.

    Example:
        >>> replay = RngReplay(torch.device("cpu"))
        >>> a = torch.rand(2); replay.rewind(); torch.equal(a, torch.rand(2))
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu: Tensor = torch.get_rng_state()
        self.cuda: Optional[Tensor] = None
        self.mark()

    def mark(self) -> None:
        """Remember the current state: :meth:`rewind` returns to it."""
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def rewind(self) -> None:
        """Set the generators back to the state at the last :meth:`mark`."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


@contextlib.contextmanager
def replayable_rng(device: torch.device) -> Iterator[RngReplay]:
    """An :class:`RngReplay` marked at entry; the caller's RNG state is restored at exit
    (also when the body raises)."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        yield RngReplay(device)
