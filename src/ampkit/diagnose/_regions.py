"""Stepping out of the caller's autocast regions: diagnostics choose their own dtypes.

``inspect`` and ``watch`` may be called inside a region the caller opened
(``torch.autocast`` or ``ampkit.autocast``, any device type). Their own arithmetic (the
fp32 reference pass, the flag folds) must not run in it: under a bf16 region the
"reference" would be bf16, and ops that promote (``torch.stack``) refuse an fp16 operand.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .._torch_compat import is_autocast_enabled, privateuse1_backend_name
from ..autocast import autocast
from ..overrides import disable_casts

# The device types torch.autocast knows (each has its own switch); the privateuse1
# backend's name is added at call time (it can be renamed after import).
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")


def _enabled(device_type: str) -> bool:
    try:
        return bool(is_autocast_enabled(device_type))
    except RuntimeError:  # a device type this torch has no autocast switch for
        return False


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Run the block with every autocast region of this thread off: torch's switch of each
    device type that has one on, and ampkit's frames (so its overrides cast nothing).

    A region entered inside the block (a policy's own) works as usual; the caller's
    regions are back as they were afterwards, also when the block raises.

    Example:
        >>> import torch
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off():
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(disable_casts())
        for device_type in _AUTOCAST_DEVICE_TYPES + (privateuse1_backend_name(),):
            if _enabled(device_type):
                stack.enter_context(autocast(device_type, enabled=False))
        yield
