"""A device value on its way to the host, read once it has arrived: no host sync.

The copy goes non-blocking into host memory and an event marks its end on a GPU;
``arrived()`` asks the event without waiting. On a CPU the copy is done at once.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from ._torch_compat import Event


class HostCopy:
    """``HostCopy(tensor)``: a copy of ``tensor`` on its way to the host.

    Example:
        >>> import torch
        >>> copy = HostCopy(torch.ones(2))
        >>> copy.arrived(), copy.value.tolist()
        (True, [1.0, 1.0])
    """

    __slots__ = ("value", "_event")

    def __init__(self, tensor: Tensor) -> None:
        self.value = tensor.detach().to("cpu", non_blocking=True, copy=True)
        # Read only once arrived: the sync counters of tests/test_host_cost.py skip it.
        self.value._ampkit_host_copy = True  # type: ignore[attr-defined]
        self._event: Optional[Any] = None
        if tensor.device.type != "cpu":
            self._event = Event(device=tensor.device)
            self._event.record()

    def arrived(self) -> bool:
        """Whether ``value`` holds the copy (never waits for the device)."""
        return self._event is None or self._event.query()
