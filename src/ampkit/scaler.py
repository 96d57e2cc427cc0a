"""Dynamic loss scaling: a drop-in superset of ``torch.amp.GradScaler``.

Same methods, arguments, defaults, errors and state_dict keys as torch's scaler, and
bitwise the same parameters and scales over a training run. Beyond torch:
``min_scale``/``max_scale`` bounds (the scale never becomes 0 or inf), ``hysteresis``
(back off only after several overflows in a row), ``process_group`` (all ranks see one
found-inf and skip together), fp16 gradients (pure-half models, and fp32 master weights
from ``ampkit.initialize``), ``stats()`` and ``last_step_skipped``.

Host syncs: none in ``scale``/``unscale_``/``update``; one per optimizer in ``step`` with
a plain optimizer (it must know on the host whether to call ``optimizer.step``); none
with fused optimizers (``_step_supports_amp_scaling``), which read ``found_inf`` on the
device. ``get_scale``, ``stats``, ``state_dict`` and ``last_step_skipped`` read device
values and so sync (``last_step_skipped`` only when no plain ``step`` already did).

Beyond torch's methods, a small public seam for loss-scaling drivers (ampkit's
``scale_loss``): :func:`unscale_grads_`, :meth:`GradScaler.inverse_scale`,
:meth:`GradScaler.scale_tensor`, :meth:`GradScaler.update_from` and
:meth:`GradScaler.check_state_dict`.
"""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from collections import abc, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from ._checks import INT32_MAX, INT64_MAX
from ._scaler_args import (F32_MAX, F32_TINY, _ArgumentError, _StateError, _backoff_factor,
                           _bounds, _check_group, _count, _device_type, _enabled, _growth_factor,
                           _in_range, check_optimizer)
# OptState: torch's own enum objects, so code that inspects ``_per_optimizer_states``
# stages keeps working.
from ._fused import clear_if_skipped, fresh_momentum
from ._host_copy import HostCopy
from ._torch_compat import STEP_SUPPORTS_AMP_SCALING, OptState, amp_update_scale_, is_compiling
from ._unscale import fold_into, unscale_grads_, unscale_per_device
from .optim import master_weights_of

__all__ = ["GradScaler", "ScalerStats", "OptState", "unscale_grads_", "check_floor",
           "FP16_GRAD_MIN_SCALE"]

# The floor when the gradients the scaler sees come from fp16 parameters (O2/O3 in fp16)
# and no min_scale was given: below 1 the scaler can only flush more fp16 gradients to
# zero (at float32's floor all of them), so steps would be taken with zero gradients
# instead of skipped. DeepSpeed and Megatron-LM use the same floor.
FP16_GRAD_MIN_SCALE = 1.0
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@dataclass(frozen=True)
class ScalerStats:
    """A snapshot of a GradScaler: its scale and step counters.

    Attributes:
        scale: the current loss scale.
        steps: ``update()`` calls that consumed inf checks (one per training iteration).
        skipped_steps: of those, the iterations that found an inf/NaN and skipped the step.
        consecutive_skips: overflowing iterations in a row up to now (0 after a clean one).

    Example: ``scaler.stats().skipped_steps / max(1, scaler.stats().steps)``.
    """

    scale: float
    steps: int
    skipped_steps: int
    consecutive_skips: int


# Overflowing steps in a row, as seen on the host, after which the scale is read to see
# whether it sits at its floor: a real streak is caught (16 backoffs take the default
# 2**16 to 1) while an isolated overflow never costs a read.
_FLOOR_CHECK_STREAK = 16
# Optimizer classes step/unscale_ have seen with param_groups: checked once, not per step.
_CHECKED_OPTIMIZERS: set[type] = set()
_FOLD_EVERY = 64  # updates whose overflow flags are kept before the skip counters fold them


def check_floor(scaler: "GradScaler", overflow: Optional[bool]) -> None:
    """Note whether a step overflowed (None: not known on the host, e.g. a fused step)
    and warn when a streak of overflows has the scale at its floor, where it cannot back
    off further. Reads the scale only on every 16th overflow in a row. Not while
    torch.compile traces: dynamo would guard on the streak and recompile as it grows.
    """
    if is_compiling():
        return
    scaler._host_overflow_streak = scaler._host_overflow_streak + 1 if overflow else 0
    if overflow is None:
        scaler._device_updates += 1
        if not scaler._device_updates % _FLOOR_CHECK_STREAK:
            _check_floor_on_device(scaler)
        return
    if scaler._host_overflow_streak % _FLOOR_CHECK_STREAK or not scaler._host_overflow_streak:
        return
    _warn_at_floor(scaler, scaler._host_overflow_streak, scaler.get_scale())


def _check_floor_on_device(scaler: "GradScaler") -> None:
    """The same warning where the overflows are known on the device only (fused steps),
    without a host sync: on every 16th such update the run of overflows and the scale are
    copied to the host, and read once there (at once on a CPU; on a GPU at the next check).
    """
    note = scaler._floor_note
    if note is not None:
        if not note.arrived():
            return  # the next check reads it
        _read_floor_note(scaler, note)
    scaler._fold_counters()
    note = HostCopy(torch.stack([scaler._consecutive_skips.float(), scaler._scale.float()]))
    if note.arrived():
        _read_floor_note(scaler, note)
    else:
        scaler._floor_note = note


def _read_floor_note(scaler: "GradScaler", note: HostCopy) -> None:
    scaler._floor_note = None
    streak, scale = note.value.tolist()  # a host tensor that has arrived: no sync
    if streak >= _FLOOR_CHECK_STREAK:
        _warn_at_floor(scaler, int(streak), scale)


def _warn_at_floor(scaler: "GradScaler", streak: int, scale: float) -> None:
    low = scaler._scale_bounds()[0]
    if scale > low:
        return
    if low >= 1.0:  # fp16 gradients' floor (1.0, as Megatron's and DeepSpeed's), or the user's
        why = ("either the gradients are not finite at any scale (an inf or NaN in the loss or "
               "the inputs: check them, or lower the learning rate), or, where they are fp16, "
               "they exceed fp16's range (65504) even unscaled (large targets or a summed "
               f"loss: normalise them, or let the scale go below {low:g} with "
               "initialize(..., min_loss_scale=2**-8) or GradScaler(min_scale=2**-8), or "
               "train in bf16)")
    else:
        why = ("the gradients are not finite whatever the scale (check the loss and the "
               "inputs, lower the learning rate, or train in bf16)")
    warnings.warn(f"ampkit: {streak} steps in a row overflowed and the loss scale is at its "
                  f"floor ({low:g}), so every step is skipped: {why}", RuntimeWarning,
                  stacklevel=4)


def _names_cuda(device: Any) -> bool:
    """Whether a ``device`` argument names CUDA ("cuda", "cuda:1", a torch.device)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.strip().lower().split(":")[0] == "cuda"


def _optimizer_grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]


def _refresh_per_optimizer_state() -> dict[str, Any]:
    # torch's two keys; ampkit's own ("found_inf", "found_inf_from", "found_inf_devices")
    # are added when it records a flag (GradScaler._found_inf reads a state without them)
    return {"stage": OptState.READY, "found_inf_per_device": {}}


# Whether an optimizer's step takes the deprecated ``grad_scaler`` keyword, per function:
# inspect.signature costs tens of microseconds, too much to pay on every step.
_TAKES_GRAD_SCALER: "weakref.WeakKeyDictionary[Callable, bool]" = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step: Callable) -> bool:
    func = getattr(step, "__func__", step)
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):
        takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:  # not weak-referenceable: just not cached
        pass
    return takes


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling, drop-in for ``torch.amp.GradScaler`` with bounds and hysteresis.

    A subclass of ``torch.amp.GradScaler``, so that code checking
    ``isinstance(scaler, torch.amp.GradScaler)`` (to scale the loss, to save or load the
    scaler's state) uses it; none of torch's code runs on it: every method torch's class
    defines is defined here (``__init__`` does not call torch's).

    Each iteration: ``scale(loss).backward()``, optionally ``unscale_(optimizer)`` (to clip
    or inspect gradients), ``step(optimizer)`` (skipped when a gradient holds an inf/NaN),
    then ``update()``: after an overflow the scale is multiplied by ``backoff_factor``,
    after ``growth_interval`` clean iterations in a row by ``growth_factor``.

    Args:
        device: device type ("cuda", "cpu", ...); None infers it like ``ampkit.autocast``.
            Like torch, "cuda" on a machine without CUDA warns and disables the scaler.
        init_scale: first scale, in (0, float32 max]; clamped into [min_scale, max_scale].
        growth_factor: > 1. backoff_factor: in (0, 1). growth_interval: int >= 1.
        enabled: False makes every method a no-op (``step`` just calls ``optimizer.step``;
            ``unscale_`` still moves O2's half grads into the masters, for a clip there).
        min_scale, max_scale: bounds of the scale (default: the normal float32 range, so the
            scale and its reciprocal are always finite and non-zero).
        hysteresis: back off only on the ``hysteresis``-th overflowing iteration in a row
            and on every further one in that run; earlier ones are skipped without backing
            off. A clean iteration resets the count. 1 is torch's rule.
        process_group: a torch.distributed group; found-inf is all-reduced (its max) over
            it before the skip decision, so all ranks skip together (sharded gradients).
            Not pickled: set ``scaler.process_group`` again after unpickling.

    Example::

        scaler = GradScaler(min_scale=1.0, hysteresis=2)
        with ampkit.autocast():
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if not scaler.last_step_skipped:
            lr_scheduler.step()
    """

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *,
                 min_scale: Optional[float] = None, max_scale: Optional[float] = None,
                 hysteresis: int = 1, process_group: Any = None) -> None:
        self._enabled = _enabled(enabled)
        if self._enabled and _names_cuda(device) and not torch.cuda.is_available():
            # torch disables itself here, before it checks any setting: so does this class
            warnings.warn("ampkit.GradScaler is enabled, but CUDA is not available.  Disabling.",
                          stacklevel=2)
            self._enabled = False
        try:
            self._configure(device, init_scale, growth_factor, backoff_factor, growth_interval,
                            min_scale, max_scale, hysteresis, process_group)
        except (TypeError, ValueError):
            if self._enabled:
                raise
            # torch checks nothing for a disabled scaler (one loop serves every precision
            # with settings that only matter when enabled): accept what it accepts.
            self._configure(device if isinstance(device, str) else None, 2.0**16, 2.0, 0.5,
                            2000, None, None, 1, None, check_device=False)
        self._init_growth_tracker = 0
        self._init_skipped_steps = 0
        self._init_consecutive_skips = 0
        self._steps = 0
        # Device tensors, created on the first scaled tensor's device.
        self._traced_steps: Optional[Tensor] = None  # updates counted inside torch.compile
        self._scale: Optional[Tensor] = None
        self._growth_tracker: Optional[Tensor] = None
        self._skipped_steps: Optional[Tensor] = None
        self._consecutive_skips: Optional[Tensor] = None
        self._pending_found: list[Tensor] = []  # overflow flags not yet in the counters
        self._last_skipped_host: Optional[bool] = False
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(
            _refresh_per_optimizer_state)

    def _configure(self, device: Optional[str], init_scale: Any, growth_factor: Any,
                   backoff_factor: Any, growth_interval: Any, min_scale: Any, max_scale: Any,
                   hysteresis: Any, process_group: Any, check_device: bool = True) -> None:
        """Validate the settings (everything, before any is kept) and keep them."""
        device_type = _device_type(device) if check_device or device is None else device
        init = _in_range("init_scale", init_scale, 0.0, F32_MAX, low_open=True)
        growth, backoff = _growth_factor(growth_factor), _backoff_factor(backoff_factor)
        interval = _count("growth_interval", growth_interval, 1, INT64_MAX)
        hyst = _count("hysteresis", hysteresis, 1, INT32_MAX)
        bounds = _bounds(min_scale, max_scale)
        group = _check_group(process_group)
        self._device, self._growth_factor, self._backoff_factor = device_type, growth, backoff
        self._growth_interval, self._hysteresis, self._process_group = interval, hyst, group
        self._min_scale, self._max_scale = bounds
        self._fp16_grads = False  # set when unscale_ first sees gradients of fp16 params
        self._host_overflow_streak = 0  # overflowing steps in a row known on the host
        self._device_updates = 0  # updates whose overflow the host did not read
        self._floor_note: Optional[HostCopy] = None  # the run of overflows on its way
        self._init_scale = self._clamp(init)

    # --- scale tensors ----------------------------------------------------------------------
    def _scale_bounds(self) -> tuple[float, float]:
        low = self._min_scale
        if low is None:
            low = FP16_GRAD_MIN_SCALE if self._fp16_grads else F32_TINY
        return low, F32_MAX if self._max_scale is None else self._max_scale

    def _clamp(self, scale: float) -> float:
        low, high = self._scale_bounds()
        return min(max(scale, low), high)

    def _lazy_init_scale_growth_tracker(self, dev: Union[torch.device, str]) -> None:
        """Create the scale, growth tracker and skip counters on ``dev`` (first ``scale``)."""
        if self._growth_tracker is not None:
            raise _StateError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._skipped_steps = torch.full((), self._init_skipped_steps, dtype=torch.int64, device=dev)
        self._consecutive_skips = torch.full((), self._init_consecutive_skips, dtype=torch.int32,
                                             device=dev)
        self._traced_steps = torch.zeros((), dtype=torch.int64, device=dev)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        fix = ("This may indicate your script did not use scaler.scale(loss or outputs) "
               "earlier in the iteration.")
        if self._scale is None:
            raise _StateError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise _StateError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _inverse_scale(self) -> Tensor:
        """1/scale as a float32 device tensor (shared with ``ampkit.frontend``); no host sync.

        The reciprocal is taken in fp64 and rounded once, as torch does, so that
        non-power-of-two scales unscale bitwise like torch's.
        """
        scale, _ = self._check_scale_growth_tracker("unscale_")
        if scale.device.type == "mps":  # no fp64 there
            return scale.reciprocal()
        return scale.double().reciprocal().float()

    def _get_scale_async(self) -> Optional[Tensor]:
        return self._scale

    # --- the seam for loss-scaling drivers (ampkit's scale_loss), beyond torch's API --------
    def inverse_scale(self) -> Tensor:
        """1/scale as a float32 device tensor, for unscaling gradients by hand; no host sync."""
        return self._inverse_scale()

    def scale_tensor(self) -> Optional[Tensor]:
        """The scale as a device tensor (None before the first ``scale``); no host sync."""
        return self._scale

    def update_from(self, found_inf: Tensor, *, handed_over: bool = False) -> None:
        """One iteration's update from a combined found-inf flag (what ``update`` applies):
        all-reduced over ``process_group``, counted, backoff/growth, clamp. No host sync.

        The skip counters read the flag later (see :meth:`stats`), so a copy is kept, one
        device op; ``handed_over=True`` promises that nothing writes to ``found_inf``
        again (a fresh flag per step) and keeps the tensor itself.

        Example: ``unscale_grads_(grads, scaler.inverse_scale(), found); scaler.update_from(found)``.
        """
        if not handed_over and self._enabled:
            found_inf = found_inf.clone()
        self._apply_update(found_inf)

    def update_window(self, found_inf: Tensor, iterations: int) -> None:
        """``iterations`` updates at once: clean ones, then one with ``found_inf`` (the
        flag of them all); when it is set, the window counts as one overflow from the
        scale it began with (one backoff, the growth tracker reset), so a growth its clean
        iterations reached does not survive it. What ``scale_loss`` applies in a run of
        several processes, where an accumulation's flag is known only at its end. No host
        sync; ``found_inf`` is handed over (nothing may write to it again). With
        ``hysteresis`` > 1 the updates simply run in order.
        """
        if iterations <= 1 or not self._enabled:
            self.update_from(found_inf, handed_over=True)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if found_inf.device != scale.device:
            found_inf = found_inf.to(scale.device, non_blocking=True)
        self._sync_found_inf(found_inf)
        start, start_tracker = scale.clone(), tracker.clone()
        clean = torch.zeros_like(found_inf)  # never written: kept by the skip counters
        for _ in range(iterations - 1):
            self._apply_update(clean, synced=True)
        self._apply_update(found_inf, synced=True)
        if self._hysteresis == 1:  # an overflow: the update from the window's start instead
            self._update_scale(start, start_tracker, found_inf)
            scale.copy_(torch.where(found_inf.reshape(()) > 0, start, scale))

    def set_scale(self, scale: float) -> None:
        """Make ``scale`` the current scale as given, in (0, float32 max], also outside
        [min_scale, max_scale]: the bounds apply again from the next update. What apex's
        writes to ``LossScaler._loss_scale`` did (``ampkit._amp_state`` uses it). No-op
        when disabled.
        """
        value = _in_range("scale", scale, 0.0, F32_MAX, low_open=True)
        if not self._enabled:
            return
        if self._scale is None:
            self._init_scale = value
        else:
            self._scale.fill_(value)

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise as ``load_state_dict`` would, without loading anything."""
        self._parse_state_dict(state_dict)

    # --- scale ------------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or tensors nested in lists/tuples/iterables, by the scale.

        The scale is created on the first tensor's device and copied to others once per
        call. Returns ``outputs`` unchanged when disabled.

        Example: ``scaler.scale(loss).backward()``; ``scaler.scale([l1, l2])``.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * self._scale_on(outputs.device, {})
        return self._scale_nested(outputs, {})

    def _scale_on(self, device: torch.device, copies: dict[torch.device, Tensor]) -> Tensor:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        copy = copies.get(device)
        if copy is None:
            scale = self._scale  # (a .to() that changes nothing still costs host time)
            copy = copies[device] = (scale if scale.device == device
                                     else scale.to(device=device, non_blocking=True))
        return copy

    def _scale_nested(self, value: Any, copies: dict[torch.device, Tensor]) -> Any:
        if isinstance(value, Tensor):
            return value * self._scale_on(value.device, copies)
        if isinstance(value, abc.Iterable):
            scaled = map(lambda item: self._scale_nested(item, copies), value)
            return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    # --- unscale_ and step --------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place, recording any inf/NaN.

        Optional: call it to clip or inspect gradients before ``step``, at most once per
        optimizer per iteration. fp16 gradients are accepted (torch refuses them). For an
        optimizer with ampkit fp32 master weights the master gradients are unscaled. With a
        ``process_group`` found-inf is all-reduced here (a collective: every rank must call
        it). No host sync.

        Example: ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0)``.
        """
        if not self._enabled:  # nothing to unscale; O2's gradients still join the masters
            masters = master_weights_of(optimizer)
            if masters is not None:
                masters.move_grads()
            return
        self._check_scale_growth_tracker("unscale_")
        if optimizer.__class__ not in _CHECKED_OPTIMIZERS:
            check_optimizer(optimizer)
            _CHECKED_OPTIMIZERS.add(optimizer.__class__)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._inverse_scale()
        self._record_found_inf(optimizer, inv_scale)
        state["stage"] = OptState.UNSCALED

    def _record_found_inf(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor) -> None:
        scale = self._scale
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        # Through torch's hook, as torch's unscale_ does, so a subclass's override runs.
        per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        fold_into(found_inf, per_device)
        self._sync_found_inf(found_inf)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = per_device
        state["found_inf"] = found_inf
        state["found_inf_from"] = per_device
        state["found_inf_devices"] = len(per_device)

    def _found_inf(self, state: dict[str, Any]) -> Tensor:
        """An optimizer's found-inf flag, 0 or 1, as torch reads it from the state's
        ``found_inf_per_device`` (the one place this is decided).

        The flag ampkit folded when it recorded the dict, unless other code has since put
        another dict there, as torch's protocol lets it (an optimizer taking
        ``grad_scaler=`` records its own; a subclass may write flags reduced across
        ranks), or changed the flag of another device in place: then that dict's flags,
        folded again. Over ``process_group`` a new dict's flag is all-reduced (its max), as
        every flag ampkit decides on is. Clamped to 1: a fused optimizer skips only on
        exactly 1.0 (a flag summed over ranks, 2.0, would step on inf/NaN).
        """
        per_device = state["found_inf_per_device"]
        try:  # subscripts, not calls: this runs in every step and update
            if state["found_inf_from"] is per_device:
                found_inf = state["found_inf"]
                if state["found_inf_devices"] > 1:  # another device's flag may have changed
                    fold_into(found_inf, per_device)
                    found_inf.clamp_(max=1.0)
                return found_inf
        except KeyError:  # a state made by other code (torch's own factory)
            pass
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        fold_into(found_inf, per_device)
        found_inf.clamp_(max=1.0)
        self._sync_found_inf(found_inf)
        state["found_inf"], state["found_inf_from"] = found_inf, per_device
        state["found_inf_devices"] = len(per_device)
        return found_inf

    def _grads_to_unscale(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """The optimizer's gradients, the model's half ones moved into its masters first."""
        masters = master_weights_of(optimizer)
        if masters is not None:
            fp16 = any(p.dtype == torch.float16 for p in masters.model_params)
            masters.move_grads()  # the param_groups hold the fp32 masters: unscale those
        grads = _optimizer_grads(optimizer)
        if not self._fp16_grads and self._min_scale is None:
            # Gradients computed in fp16 (a pure-fp16 model, or the masters' fp16 params)
            # get the fp16 floor; torch's scaler never sees them (it refuses fp16 grads).
            self._fp16_grads = (masters is not None and fp16) or any(
                g.dtype == torch.float16 for g in grads)
        return grads

    def _sync_found_inf(self, found_inf: Tensor) -> None:
        if self._process_group is None:
            return
        # The max over ranks, so every rank makes the same skip and backoff decision and
        # the flag stays 0 or 1: torch's fused optimizers skip only on found_inf == 1.0
        # (a sum is 2.0 when two ranks overflow, as every rank does under DDP, and the
        # fused step then writes inf/NaN). NCCL queues this on the current stream (no
        # host sync); gloo completes it on the host.
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=self._process_group)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        """Record found-inf for ``optimizer`` without unscaling (fused optimizers unscale)."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        self._record_found_inf(optimizer, torch.full((), 1.0, dtype=torch.float32, device=scale.device))
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor,
                        found_inf: Tensor, allow_fp16: bool = True) -> dict[torch.device, Tensor]:
        """torch's private hook, which ``unscale_`` calls (subclasses may override it):
        the optimizer's grads (its masters' under O2) unscaled, one found-inf per device.
        fp16 is accepted whatever ``allow_fp16``."""
        return unscale_per_device(self._grads_to_unscale(optimizer), inv_scale, found_inf)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` ran) and call ``optimizer.step`` if no inf/NaN was found.

        Plain optimizers: one host sync (reading found-inf) to decide whether to step.
        Fused optimizers (``_step_supports_amp_scaling``) get ``grad_scale`` and
        ``found_inf`` tensors and skip on the device: no host sync. Closures are rejected.

        Returns:
            What ``optimizer.step`` returned, or None when the step was skipped.

        Example: ``scaler.step(optimizer)``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            # torch checks the keyword only; a closure passed positionally re-evaluated the
            # loss on scaled, unchecked gradients, and an inf there reached the weights.
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        if optimizer.__class__ not in _CHECKED_OPTIMIZERS:
            check_optimizer(optimizer)  # before the per-optimizer state below exists
            _CHECKED_OPTIMIZERS.add(optimizer.__class__)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, STEP_SUPPORTS_AMP_SCALING, False):
            return self._fused_step(optimizer, state, args, kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise _StateError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:
        # The one host sync of a plain step: Python must know whether to call step().
        # Zeroing the grads instead would not be a skip (momentum, Adam moments and
        # step counts, weight decay still change the parameters).
        found = self._found_inf(state).item()
        state["found_host"] = found
        if not found:
            return optimizer.step(*args, **kwargs)
        masters = master_weights_of(optimizer)
        if masters is not None:
            # The masters' grads are a per-step buffer that step() consumes; a skipped step
            # consumes them too, or the inf/NaN would stay and poison every later step
            # in loops that zero only the model's grads (model.zero_grad()).
            masters.clear_master_grads()
        return None

    def _fused_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    args: tuple, kwargs: dict) -> Any:
        if _takes_grad_scaler(optimizer.step):
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning, stacklevel=3)
            retval = optimizer.step(*args, **dict(kwargs, grad_scaler=self))
            state["stage"] = OptState.STEPPED
            return retval
        if state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
        previous = getattr(optimizer, "grad_scale", None)
        if state["stage"] is OptState.UNSCALED:
            grad_scale = previous  # already unscaled: the optimizer must not unscale again
        else:
            grad_scale = self._scale if previous is None else self._scale * previous
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        found_inf = self._found_inf(state)
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        fresh = fresh_momentum(optimizer)
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        if fresh:
            clear_if_skipped(optimizer, fresh, found_inf)
        state["stage"] = OptState.STEPPED
        return retval

    # --- update -------------------------------------------------------------------------------
    def update(self, new_scale: Union[float, Tensor, None] = None) -> None:
        """Update the scale from this iteration's inf checks (or set it to ``new_scale``).

        Backoff after an overflow (on the ``hysteresis``-th in a row), growth after
        ``growth_interval`` clean iterations, then the scale is clamped into
        [min_scale, max_scale]. All on the device: no host sync. ``new_scale`` (a float, or
        a 1-element tensor on the scaler's device type) replaces the rule for this call; it
        is clamped into the bounds and leaves the growth tracker as it is, like torch.

        Example: ``scaler.update()`` once per iteration, after every ``step``.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("update")
        states = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        found_inf = self._combined_found_inf(states, required=new_scale is None)
        if new_scale is not None:
            self._set_scale(new_scale)
            if found_inf is not None:
                self._count_step(found_inf)
        else:
            # Every recorded found-inf was all-reduced already, in unscale_ or before a fused step.
            self._apply_update(found_inf, synced=True)
        if not is_compiling():  # (traced, the values read would become guards: recompiles)
            hosts = [s.get("found_host") for s in states]
            known = bool(hosts) and None not in hosts  # every optimizer plain: known, no sync
            if known:
                self._last_skipped_host = any(hosts)
            check_floor(self, self._last_skipped_host if known else None)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _combined_found_inf(self, states: list[dict[str, Any]],
                            required: bool) -> Optional[Tensor]:
        """The sum of the found-inf flags of ``states`` (the optimizers that recorded one)."""
        if not states:
            if required:
                raise _StateError("No inf checks were recorded prior to update.")
            return None
        combined = None
        for state in states:  # a loop, not sum(<genexpr>): update runs every step
            flag = self._found_inf(state)
            combined = flag if combined is None else combined + flag
        return combined

    def _apply_update(self, found_inf: Tensor, *, synced: bool = False) -> None:
        """Apply the full scale rule for one iteration given its combined ``found_inf``.

        Shared with ``ampkit.frontend``, and what ``update()`` runs: all-reduces
        ``found_inf`` in place over ``process_group`` unless ``synced`` (so a caller that
        reads it afterwards sees every rank's overflow), counts the step and skip, then
        updates the growth tracker and the scale (backoff with hysteresis, growth, clamp).
        No host sync.

        Args:
            found_inf: 1-element float32 tensor on the scale's device; non-zero = overflow.
            synced: True when ``found_inf`` was already all-reduced over ``process_group``.

        Callers outside this class use :meth:`update_from`.
        """
        scale, tracker = self._check_scale_growth_tracker("update")
        if found_inf.device != scale.device:
            found_inf = found_inf.to(scale.device, non_blocking=True)
        if not synced:
            self._sync_found_inf(found_inf)
        self._count_step(found_inf)
        self._update_scale(scale, tracker, found_inf)

    def _update_scale(self, scale: Tensor, tracker: Tensor, found_inf: Tensor) -> None:
        """The scale rule, in place on ``scale`` and ``tracker``: backoff (with hysteresis)
        or growth, then the bounds. No host sync."""
        if self._hysteresis == 1:
            amp_update_scale_(scale, tracker, found_inf, self._growth_factor,
                              self._backoff_factor, self._growth_interval)
        else:
            # torch's kernel resets the tracker and backs off on every overflow; keep its
            # tracker reset but restore the old scale for overflows before the
            # hysteresis-th in a row. A device-side select, so no host sync.
            hold = (found_inf > 0) & (self._consecutive_skips < self._hysteresis)
            before = scale.clone()
            amp_update_scale_(scale, tracker, found_inf, self._growth_factor,
                              self._backoff_factor, self._growth_interval)
            scale.copy_(torch.where(hold, before, scale))
        # Bounds: also catch a backoff below float32's normal range (torch lets the scale
        # decay to 0, after which 1/scale is inf and every step is skipped forever).
        scale.clamp_(*self._scale_bounds())

    def _count_step(self, found_inf: Tensor) -> None:
        """Count an update; its skip counts are folded in later, a few ops per 64 updates.

        Counting on every update took 4 device ops (torch's update takes 1); the flags
        are kept (references to tensors nothing writes to again) and folded when the
        counters are read, or every 64 updates. Hysteresis reads the run of overflows
        every update, so it folds at once.
        """
        self._last_skipped_host = None  # known on the device only, until someone asks
        if is_compiling():
            # Traced: dynamo would guard on a Python count and on the list's length, and
            # recompile at every update; counted and folded on the device instead.
            if self._pending_found:  # eager updates before: in order
                self._fold_counters()
            self._traced_steps.add_(1)
            self._fold_flag(found_inf)
            return
        self._steps += 1
        self._pending_found.append(found_inf)
        if self._hysteresis > 1 or len(self._pending_found) >= _FOLD_EVERY:
            self._fold_counters()

    def _fold_counters(self) -> None:
        """Add the pending updates' overflows to the skip counters, on the device."""
        pending, self._pending_found = self._pending_found, []
        if len(pending) == 1:
            self._fold_flag(pending[0])
        elif pending:
            n = len(pending)
            flags = torch.stack([f.reshape(()) for f in pending]) > 0
            self._skipped_steps.add_(flags.sum())
            # 1-based position of the last clean update (0: none): the run of overflows
            # after it is the new count, or the old count grows by n if there was none.
            order = torch.arange(1, n + 1, device=flags.device)
            last_clean = torch.where(flags, 0, order).max()
            run = torch.where(last_clean > 0, n - last_clean, self._consecutive_skips + n)
            self._consecutive_skips.copy_(run)

    def _fold_flag(self, found_inf: Tensor) -> None:
        """Add one update's overflow flag to the skip counters, on the device."""
        overflow = found_inf > 0
        self._skipped_steps.add_(overflow)
        self._consecutive_skips.add_(1).mul_(overflow)

    def _set_scale(self, new_scale: Union[float, Tensor]) -> None:
        scale = self._scale
        if isinstance(new_scale, Tensor):
            reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                      "torch.FloatTensor with requires_grad=False.")
            if (new_scale.device.type != scale.device.type or new_scale.numel() != 1
                    or new_scale.requires_grad):
                raise _ArgumentError(reason + f" Got {new_scale!r} on {new_scale.device}.")
            value = new_scale.detach().reshape(()).to(scale.device, torch.float32)
            # A NaN would poison every later step: keep the current scale instead.
            scale.copy_(torch.where(torch.isnan(value), scale, value))
        else:
            scale.fill_(_in_range("new_scale", new_scale, 0.0, F32_MAX, low_open=True))
        scale.clamp_(*self._scale_bounds())

    # --- getters and setters --------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._growth_factor = _growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._backoff_factor = _backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1).

        A growth tracker already at or past the new interval is set to ``interval - 1``,
        so the next clean step grows the scale (torch's rule, ``tracker + 1 == interval``,
        would never grow it again before an overflow).
        """
        self._growth_interval = _count("growth_interval", new_interval, 1, INT64_MAX)
        last = min(self._growth_interval - 1, INT32_MAX)
        self._init_growth_tracker = min(self._init_growth_tracker, last)
        if self._growth_tracker is not None:
            self._growth_tracker.clamp_(max=last)  # on the device: no sync

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def min_scale(self) -> Optional[float]:
        return self._min_scale

    @property
    def max_scale(self) -> Optional[float]:
        return self._max_scale

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    @property
    def process_group(self) -> Any:
        """The group found-inf is all-reduced over (None: this process only)."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._process_group = _check_group(group)

    # --- statistics -----------------------------------------------------------------------------
    def stats(self) -> ScalerStats:
        """The scale and step counters; one host sync (all values read in one transfer).

        Example: ``s = scaler.stats(); print(s.scale, s.skipped_steps, "/", s.steps)``.
        """
        if not self._enabled:
            return ScalerStats(1.0, 0, 0, 0)
        if self._scale is None:
            return ScalerStats(self._init_scale, self._steps, self._init_skipped_steps,
                               self._init_consecutive_skips)
        self._fold_counters()
        values = torch.stack([self._scale.double(), self._skipped_steps.double(),
                              self._consecutive_skips.double(),
                              self._traced_steps.double()]).tolist()
        return ScalerStats(values[0], self._steps + int(values[3]), int(values[1]), int(values[2]))

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``update()`` saw an inf/NaN, i.e. some optimizer skipped its step.

        Free after plain-optimizer steps (``step`` already read found-inf on the host); one
        host sync after fused steps, since the decision was taken on the device.
        Example: ``if not scaler.last_step_skipped: scheduler.step()``.
        """
        if not self._enabled:
            return False
        if self._last_skipped_host is None:
            self._fold_counters()
            self._last_skipped_host = bool(self._consecutive_skips.item() > 0)
        return self._last_skipped_host

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries plus min_scale, max_scale, hysteresis and the step counters.

        torch.amp.GradScaler.load_state_dict reads its five keys and ignores the rest, so
        either scaler loads the other's. Empty when disabled. Syncs with the device.
        Example: ``torch.save({"scaler": scaler.state_dict()}, path)``.
        """
        if not self._enabled:
            return {}
        stats = self.stats()
        return {
            "scale": stats.scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "hysteresis": self._hysteresis,
            "steps": stats.steps,
            "skipped_steps": stats.skipped_steps,
            "consecutive_skips": stats.consecutive_skips,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of torch.amp.GradScaler (a no-op when disabled).

        Keys torch's lacks keep this scaler's settings (min/max scale, hysteresis) and start
        the counters at 0. A saved scale of 0 or inf (torch can reach both) is clamped into
        [min_scale, max_scale], a growth tracker at or past the growth interval to
        ``interval - 1`` (the next clean step grows; see ``set_growth_interval``).
        Everything is validated before anything changes.
        Example: ``scaler.load_state_dict(torch.load(path)["scaler"])``.
        """
        if not self._enabled:
            return
        new = self._parse_state_dict(state_dict)
        self._min_scale, self._max_scale = new["min_scale"], new["max_scale"]
        self._growth_factor, self._backoff_factor = new["growth_factor"], new["backoff_factor"]
        self._growth_interval, self._hysteresis = new["growth_interval"], new["hysteresis"]
        self._init_scale = self._clamp(new["scale"])
        self._init_growth_tracker = new["_growth_tracker"]
        self._steps = new["steps"]
        self._init_skipped_steps = new["skipped_steps"]
        self._init_consecutive_skips = new["consecutive_skips"]
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._skipped_steps.fill_(self._init_skipped_steps)
            self._consecutive_skips.fill_(self._init_consecutive_skips)
            self._traced_steps.zero_()
        self._pending_found = []
        self._last_skipped_host = self._init_consecutive_skips > 0

    def _parse_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"GradScaler.load_state_dict takes a dict, got "
                            f"{type(state_dict).__name__} {state_dict!r:.80}; valid: the "
                            "state_dict() of an ampkit or torch.amp GradScaler")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = [key for key in _TORCH_KEYS if key not in state_dict]
        if missing:
            raise KeyError(f"GradScaler state_dict lacks {missing}; it needs at least "
                           f"{list(_TORCH_KEYS)}")
        low, high = _bounds(state_dict.get("min_scale", self._min_scale),
                            state_dict.get("max_scale", self._max_scale))
        scale = _in_range("scale", state_dict["scale"], 0.0, math.inf, low_open=False)
        interval = _count("growth_interval", state_dict["growth_interval"], 1, INT64_MAX)
        tracker = _count("_growth_tracker", state_dict["_growth_tracker"], 0, INT32_MAX)
        return {
            "scale": scale, "min_scale": low, "max_scale": high,
            "growth_factor": _growth_factor(state_dict["growth_factor"]),
            "backoff_factor": _backoff_factor(state_dict["backoff_factor"]),
            "growth_interval": interval,
            "hysteresis": _count("hysteresis", state_dict.get("hysteresis", self._hysteresis), 1,
                                 INT32_MAX),
            "_growth_tracker": min(tracker, interval - 1),
            "steps": _count("steps", state_dict.get("steps", 0), 0),
            "skipped_steps": _count("skipped_steps", state_dict.get("skipped_steps", 0), 0,
                                    INT64_MAX),
            "consecutive_skips": _count("consecutive_skips",
                                        state_dict.get("consecutive_skips", 0), 0, INT32_MAX),
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_process_group"] = None  # a live communicator cannot be pickled
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise _StateError("A GradScaler instance may only be pickled at the beginning "
                                  "of an iteration, or at the end after scaler.update().")
            # Device tensors travel as Python numbers and are re-created lazily.
            stats = self.stats()
            state["_init_scale"] = stats.scale
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_skipped_steps"] = stats.skipped_steps
            state["_init_consecutive_skips"] = stats.consecutive_skips
            state["_last_skipped_host"] = stats.consecutive_skips > 0
            state["_steps"] = stats.steps
            for name in ("_scale", "_growth_tracker", "_skipped_steps", "_consecutive_skips",
                         "_traced_steps"):
                state[name] = None
            state["_pending_found"] = []  # folded into the counters read by stats() above
        state["_floor_note"] = None  # a copy on its way (an event cannot be pickled)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_fp16_grads", False)  # pickled before the fp16 floor existed
        state.setdefault("_host_overflow_streak", 0)
        state.setdefault("_device_updates", 0)
        state.setdefault("_floor_note", None)
        state.setdefault("_pending_found", [])
        state.setdefault("_traced_steps", None)
        self.__dict__.update(state)
