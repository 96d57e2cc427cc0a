"""Activation checkpointing under ampkit's regions: ``checkpoint_context_fn``, the
``context_fn`` that runs a ``torch.utils.checkpoint`` recompute inside the ampkit.autocast
regions its forward ran in, where the registered overrides act (see :mod:`ampkit.overrides`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ._torch_compat import compile_tracing, is_compiling
from .overrides import open_frames, pop_frame, push_frame


class _Replay:
    """Re-enters, around a checkpoint's recompute, the ampkit.autocast frames that were
    open in this thread when its forward ran (torch's checkpoint restores torch's autocast
    state itself, but not ampkit's regions, which the overrides act in)."""

    def __init__(self, frames: list[tuple[str, torch.dtype, bool]]) -> None:
        self.frames = frames
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for device_type, dtype, enabled in self.frames:
                push_frame(device_type, dtype, enabled)
                stack.callback(pop_frame)
            self._stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, _Replay]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    the recompute in backward runs inside the ampkit.autocast regions (and O1's) that were
    open at the forward, so registered overrides and the op decorators cast as they did.

    Without it the recompute runs after the region has closed, without the overrides:
    torch refuses it where a saved tensor's dtype differs from the forward's
    (``CheckpointError``), and otherwise the gradients differ silently, as the reentrant
    checkpoint's do (it has no ``context_fn``). Not needed without overrides: torch
    restores its own autocast state. Under torch.compile the recompute is in the compiled
    graph, where the overrides act; this then gives torch a plain checkpoint's contexts.

    Example:
        >>> import torch, ampkit
        >>> from torch.utils.checkpoint import checkpoint
        >>> handle = ampkit.register_float_function(torch, "cumsum")
        >>> x = torch.ones(2, 2, requires_grad=True)
        >>> with ampkit.autocast("cpu", dtype=torch.bfloat16):
        ...     y = checkpoint(lambda t: torch.cumsum(t @ t, 0), x, use_reentrant=False,
        ...                    context_fn=ampkit.checkpoint_context_fn)
        >>> y.dtype
        torch.float32
        >>> y.sum().backward()
        >>> handle.remove()
    """
    if is_compiling() or compile_tracing():
        # Traced, the recompute is part of the compiled graph, where the overrides act as
        # in the forward; torch takes two dispatch modes here: those of a plain checkpoint.
        return create_selective_checkpoint_contexts(_recompute)
    return contextlib.nullcontext(), _Replay(open_frames())


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE
