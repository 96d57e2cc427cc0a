"""``scale_loss``: apex's loss-scaling context manager, and its overflow handling."""

from __future__ import annotations

import functools
import weakref
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor, nn

from .. import _state
from .._checks import check_bool
from .._torch_compat import foreach_mul_
from .._warn import warn_once
from ..apply import OptimizerArg
from ..optim import AmpStash, stash_of
from ..scaler import GradScaler, unscale_grads_
from .held import Held, Started, set_aside
from .overflow import or_flag, report_overflows, update, window_for
from .scale_loss_args import check_scale_loss, require_initialized, warn_if_replaced

def scale_loss(loss: Tensor, optimizers: OptimizerArg, loss_id: int = 0,
               model: Optional[nn.Module] = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> ContextManager[Tensor]:
    """Yield ``loss.float() * scale``; on exit unscale the grads and check for overflow.

    On exit (unless ``delay_unscale``): each optimizer's gradients are unscaled (under O2
    the model's half gradients are moved into the fp32 masters as they are unscaled) and
    checked for inf/NaN, loss scaler ``loss_id`` is updated and, after an overflow, the
    next ``step()`` of exactly these optimizers does nothing (their params, masters and
    state stay as they are; their grads are dropped). Several scale_loss calls before one
    step accumulate: each unscales its own backward's grads. Gradients that reach another
    model's parameters in this backward stay there, untouched, until that model's
    ``zero_grad()`` (a GAN's generator loss through the discriminator), as in fp32.

    In a run of several processes (DDP's ``no_sync()`` accumulation) the grads stay on the
    parameters, where DDP reduces them (under O2 the masters get an unscaled copy), and
    the loss scaler's update waits for the step of these optimizers (see
    :class:`.overflow.Window`).

    If the body raises, every gradient these optimizers' parameters received in it is
    dropped (the ones they held before are put back), so no scaled gradient is ever
    stepped.

    Host syncs: none when every optimizer is fused (``fused=True`` Adam/AdamW/SGD: the
    overflow flag stays on the device and the fused kernel skips the update, as with
    torch's GradScaler); otherwise one per call with a dynamic scale (reading the overflow
    flag, as apex did); none with a fixed scale or ``delay_overflow_check``. A skipped
    fused step keeps its (inf/NaN) grads until the next ``zero_grad``.

    Args:
        loss: the loss tensor (any dtype; the scaled loss is fp32).
        optimizers: the optimizer(s) returned by ``initialize`` that this backward feeds.
        loss_id: which loss scaler, in ``range(num_losses)``.
        model: unused, as in apex.
        delay_unscale: leave the grads scaled (accumulation; a later call unscales them).
        delay_overflow_check: unscale, but neither check for overflow nor update the
            scale (no host sync; the caller takes charge, as in apex).

    Example:
        >>> with scale_loss(loss, optimizer) as scaled_loss:  # doctest: +SKIP
        ...     scaled_loss.backward()
        >>> optimizer.step()  # doctest: +SKIP
    """
    # A small class, not a @contextmanager generator: it runs every step, and the
    # generator's machinery costs 9 Python calls per step where the class costs 4.
    return _ScaleLoss(loss, optimizers, loss_id, delay_unscale, delay_overflow_check)


class _ScaleLoss:
    """One ``with scale_loss(...)``: its arguments until entered, then what exit needs."""

    __slots__ = ("loss", "optimizers", "loss_id", "delay_unscale", "delay_overflow_check",
                 "amp", "opts", "stashes", "held", "body_scale", "several")

    def __init__(self, loss: Tensor, optimizers: OptimizerArg, loss_id: int,
                 delay_unscale: bool, delay_overflow_check: bool,
                 amp: Optional[_state.ActiveAmp] = None) -> None:
        self.loss, self.optimizers, self.loss_id = loss, optimizers, loss_id
        self.delay_unscale, self.delay_overflow_check = delay_unscale, delay_overflow_check
        self.amp = amp  # the active initialize's, unless given (a _DelayedClose's own)

    def __enter__(self) -> Tensor:
        amp = self.amp = self.amp or _state.get_active() or require_initialized()
        loss, loss_id = self.loss, self.loss_id
        self.loss = None  # neither the loss nor its graph outlives the body through this object
        self.held = None
        if not amp.enabled:  # a pass-through: nothing checked, but a replaced one told
            given = self.optimizers
            for i, opt in enumerate(given if isinstance(given, (list, tuple)) else [given]):
                warn_if_replaced(i, opt, stash_of(opt), amp)
            return loss
        self.opts, self.stashes = check_scale_loss(loss, self.optimizers, loss_id, amp)
        if amp.overflow_notes:
            report_overflows(amp)
        if self.delay_unscale.__class__ is not bool:  # the checks' calls only for a non-bool
            self.delay_unscale = check_bool("delay_unscale", self.delay_unscale)
        if self.delay_overflow_check.__class__ is not bool:
            self.delay_overflow_check = check_bool("delay_overflow_check",
                                                   self.delay_overflow_check)
        if loss.dtype is not torch.float32:
            loss = loss.float()
        scaler = amp.scalers[loss_id] if amp.scaling else None
        scaled = scaler.scale(loss) if scaler is not None else loss
        window = amp.scale_windows.get(loss_id) if amp.scale_windows else None
        several = self.several = _several_processes()
        held = self.held = [set_aside(opt, stash, scaler, window, several)
                            for opt, stash in zip(self.opts, self.stashes)]
        self.body_scale = None
        if several and scaler is not None:  # grads held in place
            self._scale_held_up(scaler, held)
            if self.body_scale is not None:
                scaled = loss * self.body_scale
        for entry in held:  # a loop, not any(): this runs every step
            if entry.in_place and scaled.requires_grad:
                started = Started()  # whether a raising body's backward began (restore)
                scaled.register_hook(started)
                for each in held:
                    each.started = started
                break
        return scaled

    def _scale_held_up(self, scaler: GradScaler, held: list[Held]) -> None:
        """Bring the grads held in place to this body's scale: the loss's, or at most the
        scale they were made at (``Held.cap``), then kept in ``body_scale``."""
        body = scaler.scale_tensor()
        caps = [entry.cap for entry in held if entry.cap is not None]
        if caps:
            for cap in caps:
                body = torch.minimum(body, cap.to(body.device))
            self.body_scale = body
        for entry in held:
            entry.scale_up(body)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        held = self.held
        if held is None:  # disabled: the loss was yielded as it is
            return False
        self.held = None
        _state.body_began()  # (counted at its end: its backward may have reached others')
        if exc_type is not None:
            for stash, entry in zip(self.stashes, held):
                entry.restore()
                stash.bodies_seen = _state.bodies()  # it holds what it held before again
            return False
        amp, stashes = self.amp, self.stashes
        if amp.fixed_unskipped and not (self.delay_unscale or self.delay_overflow_check):
            _count_fixed_step(amp, self.loss_id, stashes)
        if not amp.scaling:  # a fixed scale of 1.0: nothing to unscale or check
            for stash, entry in zip(stashes, held):
                _take_grads(stash, entry, None, None, delay=True, several=self.several)
            return False
        scaler = amp.scalers[self.loss_id]
        body = self.body_scale
        inv_scale = scaler.inverse_scale() if body is None else body.reciprocal()
        found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        delay_unscale = self.delay_unscale
        counts = amp.dynamic and not self.delay_overflow_check  # its flag skips a step
        for stash, entry in zip(stashes, held):
            _take_grads(stash, entry, inv_scale, found_inf, delay=delay_unscale,
                        several=self.several, counts=counts)
        window = None
        if self.several and amp.dynamic:
            window = window_for(amp, self.loss_id, scaler, stashes)
            tag = (window, window.scale if body is None else body)
            for stash in stashes:  # the grads left scaled now carry this scale
                stash.scaled_in = tag
        if delay_unscale:
            # Checked with the call that does not delay, or, if a step() of these
            # optimizers comes first, by one exit that step runs before it decides.
            close = _DelayedClose(self.opts, self.loss_id, self.delay_overflow_check, amp)
            for stash in stashes:
                stash.pending_found_inf = or_flag(stash.pending_found_inf, found_inf)
                stash.before_step[_CLOSE_DELAYED] = close
            return False
        for stash in stashes:
            if stash.before_step:
                stash.before_step.pop(_CLOSE_DELAYED, None)
            if stash.pending_found_inf is not None:
                # A flag stays 0 or 1: fused kernels skip only on found_inf == 1.0.
                torch.maximum(found_inf, stash.pending_found_inf.to(found_inf.device),
                              out=found_inf)
                stash.pending_found_inf = None
        if amp.dynamic and not self.delay_overflow_check:
            update(amp, scaler, found_inf, self.opts, stashes, self.loss_id, window=window)
        return False


_CLOSE_DELAYED = "close delayed"  # the before_step key of a _DelayedClose


class _DelayedClose:
    """``step()`` after ``scale_loss(..., delay_unscale=True)`` with no exit since that does
    not delay (the last micro-batches of an epoch): the gradients are still scaled and
    their overflow unchecked. The first step of one of the delayed exit's optimizers runs
    an exit without a body over those of them still waiting (what that call would have
    done: unscale, check, update loss scaler ``loss_id`` once, skip their steps after an
    overflow); apex stepped the scaled gradients."""

    __slots__ = ("optimizers", "loss_id", "delay_overflow_check", "amp")

    def __init__(self, optimizers: list[torch.optim.Optimizer], loss_id: int,
                 delay_overflow_check: bool, amp: _state.ActiveAmp) -> None:
        self.optimizers = [weakref.ref(opt) for opt in optimizers]
        self.loss_id, self.delay_overflow_check = loss_id, delay_overflow_check
        self.amp = weakref.ref(amp)

    def __call__(self) -> None:
        amp = self.amp()  # the initialize that delayed (a later one may have replaced it)
        if amp is None or not amp.enabled:
            return
        waiting = []
        for ref in self.optimizers:
            optimizer = ref()
            stash = None if optimizer is None else stash_of(optimizer)
            if stash is None:
                continue
            # The stepping optimizer's callbacks are taken already; a later delayed exit
            # over another one put its own closer there.
            current = stash.before_step.get(_CLOSE_DELAYED)
            if current is not None:
                if current is not self:
                    continue
                del stash.before_step[_CLOSE_DELAYED]  # closed here, for all of them
            if stash.delayed_inv is not None or stash.pending_found_inf is not None:
                waiting.append(optimizer)  # (zero_grad() dropped the others' grads)
        if not waiting:
            return
        names = ", ".join(dict.fromkeys(type(opt).__name__ for opt in waiting))
        warn_once(("close delayed", names),
                  f"{names}.step() came after scale_loss(..., delay_unscale=True) with no "
                  "scale_loss since that does not delay: its gradients were still scaled, so "
                  "ampkit unscaled and checked them first, as that call would have (apex "
                  "stepped them scaled); end an accumulation with delay_unscale=False",
                  RuntimeWarning)
        scaler = amp.scalers[self.loss_id] if amp.scaling else None
        scale = None if scaler is None else scaler.scale_tensor()
        with _ScaleLoss(torch.zeros((), device=None if scale is None else scale.device),
                        waiting, self.loss_id, False, self.delay_overflow_check, amp):
            pass


def _count_fixed_step(amp: _state.ActiveAmp, loss_id: int, stashes: list[AmpStash]) -> None:
    """apex's ``_unskipped += 1`` under a fixed scale: at every exit that updates, except
    where apex's scale_loss returned before its update (a scale of 1.0 without masters:
    O0 and O3 as initialized)."""
    if amp.scaling or [stash for stash in stashes if stash.masters is not None]:
        amp.fixed_unskipped[loss_id] += 1


def _take_grads(stash: AmpStash, held: Held, inv_scale: Optional[Tensor],
                found_inf: Optional[Tensor], delay: bool, several: bool,
                counts: bool = False) -> None:
    """After the body: unscale what its backward produced for an optimizer (unless
    ``delay``), move the model's half grads into the fp32 masters, add back what was held.

    The half grads move on every exit, so micro-batches accumulate in fp32 in the
    masters; a delayed exit unscales them too (exact: a power-of-two multiply) and its inf
    check is carried to the exit that does not delay. In a run of several processes they
    stay on the model instead, still scaled: DDP's ``no_sync()`` accumulation must be in
    ``.grad`` when its synchronizing backward all-reduces it. There an exit that does not
    delay makes each master's grad the unscaled fp32 copy of the whole accumulation so far
    (replacing the copy an earlier exit made), and a delayed one leaves them. The
    optimizer's own grads stay scaled until the exit that does not delay, as in apex.
    """
    # Held grads still scaled join the new ones before the unscale; grads an earlier exit
    # unscaled join after it.
    holding = bool(held.own_grads or held.half_grads)
    apart = False
    if found_inf is not None and not several and held.own_grads:
        apart = _count_once(held, stash, inv_scale, found_inf, delay)
    if holding:
        _to_this_scale(held, stash, inv_scale, delay)
        held.add_back(own=delay or not (held.own_unscaled or apart), half=True)
    masters = stash.masters
    keep = several and masters is not None
    own = [] if delay else [p.grad for p in held.own if p.grad is not None]
    if inv_scale is None or found_inf is None:  # a fixed scale of 1: nothing to unscale
        if masters is not None:
            masters.move_grads(None, keep=keep)
    elif masters is not None:
        if not (delay and keep):  # (a delayed exit leaves them on the model, still scaled)
            masters.move_grads(functools.partial(_unscale_grads, own, inv_scale, found_inf),
                               keep=keep)
    else:
        _unscale_grads(own, inv_scale, found_inf, [])
    if holding and held.own_grads and (stash.stepped or held.plain) and found_inf is not None \
            and not delay:
        # Grads kept through a step (no zero_grad since): a fused kernel may have skipped
        # them on the device for their inf/NaN, unseen here; a plain backward's were never
        # checked. Checked again, as torch's GradScaler checks every grad it unscales.
        # (Grads an earlier exit checked are not: their overflow counted once already.)
        unscale_grads_([grad for _, grad in held.own_grads],
                       torch.ones((), device=found_inf.device), found_inf)
    if holding:
        held.add_back(own=True, half=False)
    # What the optimizer's own grads now hold; a delayed exit leaves them scaled. Set on
    # every exit, since model.zero_grad() (not the optimizer's) can clear them unseen.
    stash.grads_unscaled = not delay
    stash.delayed_inv = inv_scale if delay else None
    stash.bodies_seen = _state.bodies()
    if not delay:
        if counts:
            # Every grad the optimizer holds is checked now, into a flag that skips the
            # step: a later exit before the next step must not count this exit's overflow
            # again (model.zero_grad() leaves stepped set). An exit whose flag counts for
            # nothing (delay_overflow_check, a static scale) leaves the re-check to the next.
            stash.stepped = False
        # This exit's flag, where it updates the scale (then an overflow skips the step).
        earlier = stash.last_found_inf
        if counts and found_inf is not None:
            stash.last_found_inf = (found_inf if earlier is None else
                                    torch.maximum(earlier.to(found_inf.device), found_inf))
        stash.carried_inf = None


def _count_once(held: Held, stash: AmpStash, inv_scale: Optional[Tensor], found_inf: Tensor,
                delay: bool) -> bool:
    """Count each gradient's overflow in one loss-scale update only (one process).

    A delayed exit scales the grads an earlier exit unscaled (and checked) back up to its
    own scale, so the next exit that does not delay would unscale and flag them again,
    backing the scale off twice for one overflow. From that delayed exit on
    (``carried_inf``: the flags counted since the last step), each delayed exit checks its
    own new grads as it ends, and the exit that does not delay unscales the held grads
    apart: their overflow counts only where no overflow was counted since the last step
    (an fp16 grad scaled back up past its range); where one was, that step is skipped
    anyway, so nothing non-finite reaches a weight. Returns whether the held grads were
    unscaled apart (they then join after this exit's unscale)."""
    if inv_scale is None:
        return False
    if delay:
        if held.own_unscaled and stash.last_found_inf is not None:
            stash.carried_inf = stash.last_found_inf
        if stash.carried_inf is not None:
            new = [p.grad for p in held.own if p.grad is not None]
            if new:
                unscale_grads_(new, torch.ones((), device=found_inf.device), found_inf)
        return False
    carried = stash.carried_inf
    if held.own_unscaled or carried is None or stash.delayed_inv is None:
        return False
    held_inf = torch.zeros_like(found_inf)
    unscale_grads_([grad for _, grad in held.own_grads],
                   stash.delayed_inv.to(found_inf.device), held_inf)
    torch.maximum(found_inf, held_inf * (1 - carried.to(found_inf.device)), out=found_inf)
    stash.delayed_inv = None  # unscaled: _to_this_scale has nothing left to do
    return True


def _to_this_scale(held: Held, stash: AmpStash, inv_scale: Optional[Tensor],
                   delay: bool) -> None:
    """Before they join this exit's grads (one process): bring the optimizer's own held
    grads to this loss's scale. Still scaled by an earlier delayed exit, another loss's
    scale perhaps, they go from its scale to this one (a factor of 1 for the same scale);
    unscaled by an earlier exit, they go up to this scale when this exit leaves the grads
    scaled (it delays). Exact for power-of-two scales."""
    if not held.own_grads or inv_scale is None:
        return
    if held.own_unscaled:
        if not delay:
            return  # they join after this exit's unscale
        factor = inv_scale.reciprocal()
    elif stash.delayed_inv is not None:
        factor = stash.delayed_inv.to(inv_scale.device) / inv_scale
    else:
        return
    with torch.no_grad():
        foreach_mul_([grad for _, grad in held.own_grads], factor)


def _several_processes() -> bool:
    """Whether this process is one of several in a torch.distributed run (one call into
    torch while it runs alone: every scale_loss asks)."""
    return _DIST_INITIALIZED is not None and _DIST_INITIALIZED() and \
        torch.distributed.get_world_size() > 1


# torch.distributed.is_initialized, None in a build without torch.distributed.
_DIST_INITIALIZED = torch.distributed.is_initialized if torch.distributed.is_available() else None


def _unscale_grads(own: list[Tensor], inv_scale: Tensor, found_inf: Tensor,
                   new_master_grads: list[Tensor]) -> None:
    """Unscale the optimizer's own grads and the masters' new ones in one call."""
    grads = own + new_master_grads
    if grads:
        unscale_grads_(grads, inv_scale, found_inf)
