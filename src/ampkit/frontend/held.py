"""What an optimizer's parameters hold when a ``scale_loss`` body begins, set aside or
brought to the body's scale (:class:`Held`), and put back after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .. import _state
from .._torch_compat import foreach_add_, foreach_mul_
from ..master import MasterWeights
from .._plain_grads import warn_unscaled
from ..optim import AmpStash, own_params
from ..scaler import GradScaler, unscale_grads_
from .overflow import Window, or_flag


@dataclass(eq=False)
class Held:
    """What an optimizer's params held when a scale_loss body began.

    In one process the held grads are set aside (``own_grads``, ``half_grads``), so the
    body's backward writes only its own gradients: they are unscaled apart from grads an
    earlier exit unscaled, and dropped alone if the body raises. In a run of several
    processes they stay on the params instead (``in_place``): with DDP's ``no_sync()`` the
    reducer all-reduces ``.grad`` itself at the synchronizing backward, so an accumulation
    must be there whole. Grads still scaled then take the backward as they are, and grads
    an earlier exit unscaled are first scaled up in place by this loss's scale
    (``rescaled``; exact for a power-of-two scale), so the exit unscales them all together.
    The scale stays the same through an accumulation there (:class:`.overflow.Window`), and
    a body runs at most at the scale its held grads were made at (``cap``: another loss's
    larger scale could overflow fp16 grads scaled up past it; ``scale_up``).
    Nothing is held after a zero_grad: the usual case costs nothing.

    ``own``: the params the optimizer steps itself; ``half``: the half model params behind
    its fp32 masters (their held grads another body's backward left, still scaled; a plain
    backward's join the masters before the body instead, see :func:`set_aside`).
    ``started``: set once the
    scaled loss's backward began (watched only while grads are held in place).
    """

    own: list[Tensor]
    half: list[Tensor]
    own_grads: list[tuple[Tensor, Tensor]]
    half_grads: list[tuple[Tensor, Tensor]]
    own_unscaled: bool
    rescaled: list[Tensor]
    inv_scale: Optional[Tensor] = None
    in_place: bool = False
    started: Optional["Started"] = None
    retagged: list[Tensor] = field(default_factory=list)
    retag_undo: Optional[Tensor] = None
    copies: list[Tensor] = field(default_factory=list)  # masters holding copies of ``half``'s
    # Several processes: the scale the held grads were made at (``tag_scale``), an upper
    # bound on the body's scale (``cap``: fp16 grads scaled up past it could overflow), and
    # whether grads still scaled by another window's scale must be brought to the body's.
    tag_scale: Optional[Tensor] = None
    cap: Optional[Tensor] = None
    retag: bool = False
    plain: bool = False  # the optimizer's own held grads are a plain backward's: unchecked

    def scale_up(self, body: Tensor) -> None:
        """Before the body (in place, several processes): bring the held grads to the
        body's scale ``body``: unscaled ones (``rescaled``) up by it, grads still scaled by
        another window's scale (``retagged``) by ``body / tag_scale``."""
        if not (self.rescaled or self.retag):
            return
        with torch.no_grad():
            if self.rescaled:
                foreach_mul_(self.rescaled, body)
                self.inv_scale = body.reciprocal()
            if self.retag:
                ratio = body / self.tag_scale.to(body.device)
                foreach_mul_(self.retagged, ratio)
                self.retag_undo = ratio.reciprocal()

    def restore(self) -> None:
        """The body raised: undo what it did to these grads.

        Grads set aside come back as they were. Grads held in place are as they were if
        the backward had not begun (the scaling up is undone); after it began, the failed
        backward may have added to them, which cannot be told apart, so these params'
        grads are all dropped: no scaled or partial gradient is ever stepped.
        """
        if self.in_place and not (self.started is not None and self.started.value):
            with torch.no_grad():
                if self.rescaled:
                    foreach_mul_(self.rescaled, self.inv_scale)
                if self.retag_undo is not None:
                    foreach_mul_(self.retagged, self.retag_undo)
        else:
            for param in self.own + self.half + self.copies:
                param.grad = None
        for param, grad in self.own_grads + self.half_grads:
            param.grad = grad

    def add_back(self, *, own: bool, half: bool) -> None:
        pairs = (self.own_grads if own else []) + (self.half_grads if half else [])
        if not pairs:
            return  # the usual case (a zero_grad before the body)
        summed = [(p.grad, old) for p, old in pairs if p.grad is not None]
        if summed:
            with torch.no_grad():
                foreach_add_([g for g, _ in summed], [old for _, old in summed])
        for param, old in pairs:
            if param.grad is None:
                param.grad = old
        if own:
            self.own_grads = []
        if half:
            self.half_grads = []


class Started:
    """A hook on the scaled loss: records that its backward began."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False

    def __call__(self, grad: Tensor) -> None:
        self.value = True


def set_aside(optimizer: torch.optim.Optimizer, stash: AmpStash,
               scaler: Optional[GradScaler], window: Optional[Window], several: bool) -> Held:
    """What the optimizer's params hold before the body (see :class:`Held`); ``scaler``:
    this loss's, None under a fixed scale of 1 (nothing to scale up); ``window``: its open
    window, ``several``: whether this is a run of several processes."""
    own = own_params(optimizer)
    masters = stash.masters
    half = [] if masters is None else masters.model_params
    own_held = [p for p in own if p.grad is not None]
    half_held = [p for p in half if p.grad is not None]
    if not (own_held or half_held):
        # (in a run of several processes the masters' grads are copies of the half grads:
        # dropped with them if the body raises)
        copies = masters.master_params if several and masters is not None else []
        return Held(own, half, [], [], stash.grads_unscaled, [], copies=copies)
    unscaled = stash.grads_unscaled and scaler is not None
    if not several:
        # Left by a plain backward (no body ended since the optimizer last zeroed, stepped
        # or left one, and none delayed): unscaled. The half ones join the masters now, as
        # a step would move them (an earlier exit moved its own); the optimizer's own are
        # added after the unscale, as grads an earlier exit unscaled are.
        plain = (scaler is not None and stash.delayed_inv is None
                 and stash.bodies_seen == _state.bodies())
        if plain and half_held:
            _move_plain(stash, masters)
            half_held = []
        plain_own = plain and bool(own_held) and not stash.grads_unscaled
        if plain_own:
            warn_unscaled(stash, None)
        held = Held(own, half, [(p, p.grad) for p in own_held], [(p, p.grad) for p in half_held],
                     stash.grads_unscaled or plain_own, [], plain=plain_own)
        for param in own_held + half_held:
            param.grad = None
        return held
    held = Held(own, half, [], [], False, [p.grad for p in own_held] if unscaled else [],
                 in_place=True, copies=[] if masters is None else masters.master_params)
    tag = stash.scaled_in  # (window, scale) of the last exit, which made the held grads
    if scaler is None or tag is None or tag[1] is None:
        return held
    still = [p.grad for p in half_held] + ([] if unscaled else [p.grad for p in own_held])
    same = tag[0] is window
    # The body's scale is at most the held grads' own: in their window (where an earlier
    # body may have been capped so), and for fp16 grads, which scaled up past the scale
    # they were made at could overflow (another loss's larger scale). Grads still scaled
    # by another window's scale are brought to the body's.
    if same or [g for g in still + held.rescaled if g.dtype == torch.float16]:
        held.cap = tag[1]
    if still and not same:
        held.retagged, held.retag, held.tag_scale = still, True, tag[1]
    return held


def _move_plain(stash: AmpStash, masters: MasterWeights) -> None:
    """A plain backward's half grads into the masters before a body: unscaled, their
    inf/NaN checked into the flag the body's exit (or the one that does not delay) reads,
    and under fp16 loss scaling warned about, as the step that would move them warns."""
    flag = torch.zeros((), dtype=torch.float32, device=masters.master_params[0].device)

    def check(grads: list[Tensor]) -> None:
        if grads:
            unscale_grads_(grads, torch.ones((), device=flag.device), flag)
    if masters.move_grads(check):
        warn_unscaled(stash, masters)
    stash.pending_found_inf = or_flag(stash.pending_found_inf, flag)
