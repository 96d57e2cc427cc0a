"""What ``scale_loss`` does after an overflow check: the loss scaler's update, the skip of
the next step, the log; in a run of several processes, the updates' window."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import _state
from .._host_copy import HostCopy
from .._torch_compat import STEP_SUPPORTS_AMP_SCALING
from ..optim import AmpStash
from ..scaler import GradScaler, check_floor

logger = logging.getLogger("ampkit")


def or_flag(held: Optional[Tensor], flag: Tensor) -> Tensor:
    """Several overflow flags as one (any overflow counts)."""
    if flag.dim():
        flag = flag.reshape(())
    return flag if held is None else torch.maximum(held, flag.to(held.device))


def window_for(amp: _state.ActiveAmp, loss_id: int, scaler: GradScaler,
               stashes: list[AmpStash]) -> "Window":
    """The open window of loss ``loss_id`` (a new one if none is), closed by the next step
    of any of ``stashes``' optimizers."""
    window = amp.scale_windows.get(loss_id)
    if window is None:
        window = amp.scale_windows[loss_id] = Window(amp, loss_id, scaler)
    window.join(stashes)
    return window


def update(amp: _state.ActiveAmp, scaler: GradScaler, found_inf: Tensor,
           optimizers: list[torch.optim.Optimizer], stashes: list[AmpStash], loss_id: int, *,
           window: "Optional[Window]") -> None:
    """After an exit that checked for overflow: update loss scaler ``loss_id`` from
    ``found_inf`` and make the next step of ``optimizers`` skip if it is set. ``window``:
    in a run of several processes, the exit's window (the update waits for the step)."""
    fused = True
    for optimizer in optimizers:
        fused = fused and getattr(optimizer, STEP_SUPPORTS_AMP_SCALING, False)
    overflow = None
    if window is not None:
        overflow = None if fused else bool(found_inf.item())
        window.add(found_inf, overflow)
    else:
        scaler.update_from(found_inf, handed_over=True)  # a fresh flag per call
    if fused:
        # Fused optimizers skip on the device: no host sync here, whatever the log level.
        # A listening logger gets the overflow later, from a copy already on the host.
        for stash in stashes:
            stash.found_inf = or_flag(stash.found_inf, found_inf)
        if window is None:  # the floor's warning, from a copy on its way to the host
            check_floor(scaler, None)
        if logger.isEnabledFor(amp.log_level):
            amp.overflow_notes.append(_OverflowNote.start(found_inf, _names(optimizers), loss_id))
        return
    if window is not None:  # the flag is on the host already (window.add read it)
        if overflow:
            for stash in stashes:
                stash.skip_next = True
            logger.log(amp.log_level, "Gradient overflow: skipping the next step() of %s; loss "
                       "scaler %d backs off when that step begins", _names(optimizers), loss_id)
        return
    # The one host sync of scale_loss with plain optimizers (apex had it too): Python
    # must know now whether the next optimizer.step() runs. A listening logger's copy of
    # the new scale is queued before it, so that sync brings it to the host as well.
    listening = logger.isEnabledFor(amp.log_level)
    scale = scaler.scale_tensor()
    new_scale = (scale.to("cpu", non_blocking=True, copy=True)
                 if listening and scale is not None else None)
    overflow = bool(found_inf.item())
    check_floor(scaler, overflow)
    if not overflow:
        return
    for stash in stashes:
        stash.skip_next = True
    if new_scale is not None:
        new_scale._ampkit_host_copy = True  # type: ignore[attr-defined]
        logger.log(amp.log_level, "Gradient overflow: skipping the next step() of %s; loss "
                   "scaler %d now at %g", _names(optimizers), loss_id, new_scale.item())


class Window:
    """In a run of several processes: one loss scaler's updates since its optimizers' last
    step, applied together when the next step of one of them begins.

    Each rank's exits check their own grads, and under DDP's ``no_sync()`` those are not
    all-reduced yet: one rank may overflow in a micro-batch where another does not. Had
    each exit updated the scale, the ranks' scales would part and the next all-reduce would
    average grads scaled differently. The grads accumulate in place (scale_loss keeps
    them), so an inf/NaN one rank found reaches every rank at the synchronizing backward,
    and the window's flag, the maximum over its exits, is the same on every rank. The
    window counts as its exits' clean updates or, when that flag is set, as one overflow
    from the scale it began with (:meth:`GradScaler.update_window`): with one exit per
    step, exactly one update with that exit's flag, as in one process. Every micro-batch
    of a window is scaled by the same scale, ``scale`` (a copy taken when it opened).
    """

    __slots__ = ("amp", "loss_id", "scaler", "scale", "exits", "found", "overflow", "closed")

    def __init__(self, amp: _state.ActiveAmp, loss_id: int, scaler: GradScaler) -> None:
        self.amp, self.loss_id, self.scaler = amp, loss_id, scaler
        current = scaler.scale_tensor()
        self.scale = None if current is None else current.clone()
        self.exits = 0
        self.found: Optional[Tensor] = None
        self.overflow: Optional[bool] = False  # any overflow; None: a flag not on the host
        self.closed = False

    def add(self, found_inf: Tensor, overflow: Optional[bool]) -> None:
        """One exit's flag (``overflow``: its value on the host, None when not read)."""
        self.exits += 1
        self.found = or_flag(self.found, found_inf)
        self.overflow = None if overflow is None or self.overflow is None \
            else self.overflow or overflow

    def join(self, stashes: list[AmpStash]) -> None:
        """Close this window when the next step of one of these optimizers begins."""
        for stash in stashes:  # (replacing a window of this loss another step closed)
            stash.before_step[self.loss_id] = self.close

    def close(self) -> None:
        """Apply the window's updates (once; a later call does nothing)."""
        if self.closed:
            return
        self.closed = True
        if self.amp.scale_windows.get(self.loss_id) is self:
            del self.amp.scale_windows[self.loss_id]
        if self.found is None:
            return  # delayed exits only: they never update
        self.scaler.update_window(self.found, self.exits)
        check_floor(self.scaler, self.overflow)


def _names(optimizers: list[torch.optim.Optimizer]) -> str:
    return ", ".join(type(opt).__name__ for opt in optimizers)


@dataclass(eq=False)
class _OverflowNote:
    """A fused step's overflow flag on its way to the host, logged once it has arrived."""

    flag: HostCopy
    names: str
    loss_id: int

    @classmethod
    def start(cls, found_inf: Tensor, names: str, loss_id: int) -> "_OverflowNote":
        return cls(HostCopy(found_inf), names, loss_id)

    def arrived(self) -> bool:
        return self.flag.arrived()


def report_overflows(amp: _state.ActiveAmp) -> None:
    """Log the fused overflows whose flags have reached the host (no waiting on the device)."""
    waiting = []
    for note in amp.overflow_notes:
        if not note.arrived():
            waiting.append(note)
        elif note.flag.value.item():  # a host tensor: no device sync
            logger.log(amp.log_level, "Gradient overflow: the step of %s was skipped on the "
                       "device; loss scaler %d backed off", note.names, note.loss_id)
    amp.overflow_notes = waiting
