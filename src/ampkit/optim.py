"""What ampkit adds to an optimizer: ``optimizer._amp_stash`` and one wrapper of its methods.

``initialize`` calls :func:`wrap` once per optimizer. Its ``step``, ``zero_grad`` and
``add_param_group`` become module-level functions that read everything from
``self._amp_stash`` (apex's attribute: clients such as mmengine test
``hasattr(optimizer, "_amp_stash")`` to know that initialize ran):

- ``step``: a no-op after an overflow that ``scale_loss`` found (params, masters and
  optimizer state untouched; the optimizer's own grads zeroed, the masters' and the half
  model's dropped), also one found in the first
  evaluation of a torch optimizer's ``step(closure)``. Otherwise the model's half
  gradients move into the fp32 masters, the inner step runs (a fused optimizer gets
  scale_loss's found-inf and skips on the device), and the masters are copied back into
  the model.
- ``zero_grad``: the optimizer's params (the masters) and the model's half params alike.
- ``add_param_group``: the new group's half params get masters.

torch's ``Optimizer.__getstate__`` keeps only defaults, state and param_groups, so
``copy.deepcopy`` or pickling an initialized optimizer gives one without this wrapper,
stepping copies of the masters that reach no model: ``_orphan`` refuses to step such a
copy, rather than letting it train nothing.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import _state
from ._checks import short_repr
from ._dtypes import HALF_DTYPES
from ._fused import clear_if_skipped, fresh_momentum
from ._torch_compat import LR_SCHEDULER_MARK, LR_SCHEDULER_STEP_CALLED, optimizer_step_function
from ._fp16_eps import warn_if_eps_vanishes
from ._orphan import ATTR, refuse_orphans_once
from ._plain_grads import warn_unscaled
from ._warn import warn
from .master import ONE_MASTER_RULE, MasterWeights, owner_of


@dataclass(eq=False)
class AmpStash:
    """ampkit's state of one initialized optimizer."""

    inner_step: Callable[..., Any]
    inner_zero_grad: Callable[..., Any]
    inner_add_param_group: Callable[..., Any]
    masters: Optional[MasterWeights] = None
    skip_next: bool = False  # scale_loss found an overflow: the next step() is a no-op
    # Fused optimizers: scale_loss's overflow flag stays on the device and the fused
    # kernel skips the update itself (no host sync).
    found_inf: Optional[Tensor] = None
    grads_unscaled: bool = False  # the grads hold unscaled values (a scale_loss exit ran)
    # One process: the inverse scale the optimizer's own grads were left scaled by (a
    # delayed exit's); another loss's exit brings them to its own scale first.
    delayed_inv: Optional[Tensor] = None
    # Overflow found by delayed scale_loss exits, checked by the next exit that does not delay.
    pending_found_inf: Optional[Tensor] = None
    # One process: the or-ed overflow flags exits counted (updated the scale with) since
    # the last step or zero_grad, whose step is therefore skipped; ``carried_inf`` once a
    # delayed exit scaled unscaled grads back up (their overflow was counted already).
    last_found_inf: Optional[Tensor] = None
    carried_inf: Optional[Tensor] = None
    stepped: bool = False  # since zero_grad: held grads may be a fused skip's inf/NaN
    unscaled_warned: bool = False  # it warned of a plain backward's fp16 grads (_plain_grads)
    bodies_seen: int = 0  # _state.bodies() when it last zeroed, stepped or left a body
    # An LR scheduler's ``_opt_called`` as the last step() left it: a skip puts it back (the
    # scheduler's wrapper set it before calling step), as if no step had been called.
    opt_called: bool = False
    # own_params' answer, with the param_groups layout it was computed for.
    own_cache: Optional[tuple[list, list[Tensor]]] = None
    # Called (then dropped) when step() begins: in a run of several processes, scale_loss's
    # loss-scale updates that wait for this optimizer's step (one per loss id at most).
    before_step: dict[Any, Callable[[], None]] = field(default_factory=dict)
    # In a run of several processes: (window, scale) of the last scale_loss exit that left
    # grads scaled on the params (frontend.overflow.Window; the scale tensor they carry).
    scaled_in: Any = None
    # The active amp state (_state.ActiveAmp) of the initialize that prepared it last: a
    # later initialize of other models replaces that state, and with it the loss scalers.
    prepared_by: Any = None


def inner_optimizer(value: Any) -> Optional[torch.optim.Optimizer]:
    """``value`` when it is a torch optimizer; the optimizer an optimizer wrapper steps
    from its own ``step`` (apex's ``LARC`` holds it as ``.optim``, and apex took LARC
    wherever it took an optimizer); else None. ampkit prepares the inner optimizer, and
    the wrapper's ``step`` calls its ``step``, which skips after an overflow."""
    if isinstance(value, torch.optim.Optimizer):
        return value
    inner = getattr(value, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and callable(getattr(value, "step", None)):
        return inner
    return None


def as_optimizers(value: Any, name: str) -> list[torch.optim.Optimizer]:
    """``value`` (an optimizer, an optimizer wrapper, or a list of them) as the list of
    optimizers ampkit prepares; a TypeError names anything else."""
    single = inner_optimizer(value)
    if single is not None:
        return [single]
    valid = ("a torch.optim.Optimizer or a list of them (also an optimizer wrapper holding "
             "one as .optim, as apex's LARC)")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a torch.optim.Optimizer or a list of them, got "
                        f"{type(value).__name__} {short_repr(value)}; valid: {valid}")
    optimizers = []
    for i, item in enumerate(value):
        inner = inner_optimizer(item)
        if inner is None:
            raise TypeError(f"{name}[{i}] is a {type(item).__name__} ({short_repr(item)}), "
                            f"not a torch.optim.Optimizer; valid: {valid}")
        optimizers.append(inner)
    return optimizers


def stash_of(optimizer: Any) -> Optional[AmpStash]:
    """The optimizer's ampkit state, or None when ``initialize`` did not prepare it."""
    return getattr(optimizer, ATTR, None)


def master_weights_of(optimizer: Any) -> Optional[MasterWeights]:
    """The fp32 master weights ``initialize`` gave an optimizer, or None."""
    stash = stash_of(optimizer)
    return None if stash is None else stash.masters


def own_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The params a prepared optimizer steps that are not fp32 masters (their grads live
    in ``.grad``). Cached per param_groups layout, so a loop pays O(groups), not O(params).
    """
    stash: AmpStash = getattr(optimizer, ATTR)
    key = [(id(g["params"]), len(g["params"])) for g in optimizer.param_groups]
    if stash.own_cache is None or stash.own_cache[0] != key:
        masters = set() if stash.masters is None else {id(m) for m in stash.masters.master_params}
        params = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in masters]
        stash.own_cache = (key, params)
    return stash.own_cache[1]


def wrap(optimizer: torch.optim.Optimizer, *, master_weights: bool) -> AmpStash:
    """Attach ampkit's state (and fp32 masters when asked) and wrap the methods, once."""
    if stash_of(optimizer) is not None:
        raise RuntimeError(f"optimizer {type(optimizer).__name__} was already prepared by "
                           "ampkit; an optimizer is prepared once")
    stash = AmpStash(optimizer.step, optimizer.zero_grad, optimizer.add_param_group,
                     opt_called=getattr(optimizer, LR_SCHEDULER_STEP_CALLED, False) is True,
                     bodies_seen=_state.bodies())
    if master_weights:
        stash.masters = MasterWeights()
        stash.masters.adopt_param_groups(optimizer.param_groups)
        _rebind_state(optimizer, stash.masters)
        refuse_orphans_once()
    else:
        _recast_state(optimizer)
        warn_if_eps_vanishes(optimizer, optimizer.param_groups)
    setattr(optimizer, ATTR, stash)
    # Bound methods (not plain functions), as LRScheduler re-wraps ``step.__func__``.
    optimizer.step = types.MethodType(_step_for(optimizer.step), optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)  # type: ignore[method-assign]
    optimizer.add_param_group = types.MethodType(  # type: ignore[method-assign]
        _add_param_group, optimizer)
    return stash


def _step_for(current: Any) -> Callable[..., Any]:
    """The step function for an optimizer whose step is ``current``: ``_step``, or, when an
    LR scheduler built before initialize wrapped ``current`` (it calls it, so the
    scheduler still sees the optimizer step), a function of this optimizer's own that
    carries the scheduler's mark, so the scheduler does not warn that the step was
    overridden after it."""
    if not getattr(current, LR_SCHEDULER_MARK, False):
        return _step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return _step(self, *args, **kwargs)

    setattr(step, LR_SCHEDULER_MARK, True)
    return step


def attach_master_weights(optimizer: torch.optim.Optimizer) -> MasterWeights:
    """Give ``optimizer`` fp32 masters for its half parameters (and the wrapper)."""
    masters = wrap(optimizer, master_weights=True).masters
    assert masters is not None
    return masters


def _rebind_state(optimizer: torch.optim.Optimizer, masters: MasterWeights) -> None:
    """Move optimizer state that was keyed by a half param onto its master."""
    for param, master in zip(masters.model_params, masters.master_params):
        if param in optimizer.state:
            state = optimizer.state.pop(param)
            optimizer.state[master] = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point()
                                           and v.dim() > 0 else v) for k, v in state.items()}


@torch.no_grad()
def _recast_state(optimizer: torch.optim.Optimizer) -> None:
    """Give state a cast parameter already has (a resumed optimizer, O3) the parameter's
    dtype, as torch's ``load_state_dict`` would ("step" keeps its own), so the next step
    does not mix dtypes. apex's initialize reloaded the state dict for this.
    """
    for param, state in optimizer.state.items():
        if not (torch.is_tensor(param) and param.is_floating_point()):
            continue
        for key, value in state.items():
            if (key != "step" and torch.is_tensor(value) and value.is_floating_point()
                    and value.dtype != param.dtype):
                state[key] = value.to(param.dtype)


# --- the wrapper --------------------------------------------------------------------------
def _step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    stash: AmpStash = getattr(self, ATTR)
    if _skips(self, stash):
        return None  # step(closure) is not evaluated: the skip was decided before it
    masters = stash.masters
    # Grads no scale_loss/unscale_ moved (a loss scale of 1, or a plain backward).
    if masters is not None and masters.move_grads():
        warn_unscaled(stash, masters)
    closure = _closure_in(args, kwargs)
    if closure is not None:
        args, kwargs = _checked_closure(self, stash, closure, args, kwargs)
    try:
        if stash.found_inf is not None:
            result = _fused_step(self, stash, args, kwargs)
        else:
            result = stash.inner_step(*args, **kwargs)
    except _SkippedInClosure as skipped:
        # The closure's first evaluation overflowed, before the optimizer changed anything.
        _skipped(self)
        return skipped.loss
    if masters is not None:
        masters.copy_to_model()
        # Consumed, as apex did: code that zeroes only the model's grads
        # (model.zero_grad()) does not accumulate into the masters.
        masters.clear_master_grads()
    stash.last_found_inf = stash.carried_inf = None  # the overflows counted for this step
    stash.stepped = True
    stash.opt_called = getattr(self, LR_SCHEDULER_STEP_CALLED, False) is True
    stash.bodies_seen = _state.bodies()
    return result


def _skips(optimizer: torch.optim.Optimizer, stash: AmpStash) -> bool:
    """Whether this step is the overflowing one (after the callbacks a step begins with,
    which may decide it): then params, masters and optimizer state stay as they are, and
    the inf/NaN grads are dropped so they do not leak into the next iteration."""
    while stash.before_step:  # (one may add another: an exit it runs joins a window)
        callbacks, stash.before_step = stash.before_step, {}
        for callback in callbacks.values():
            callback()
    if not stash.skip_next:
        return False
    stash.skip_next = False
    _skipped(optimizer)
    return True


def _skipped(optimizer: torch.optim.Optimizer) -> None:
    """What a skipped step leaves: the inf/NaN grads of the params the optimizer steps
    itself zeroed in place (as torch's ``zero_grad(set_to_none=False)`` does; the masters',
    consumed by every step, and the half model's dropped, the latter to come back as
    zeros at a ``zero_grad(set_to_none=False)``), so none leaks into the next iteration,
    while a parameter the next backward does not reach still steps after a
    ``zero_grad(set_to_none=False)``, as after torch's skip. An LR scheduler's wrapper
    (which ran first) sees no step: its flag goes back to what the last step left, so a
    skipped first step warns "lr_scheduler.step() before optimizer.step()", as under apex
    and torch's GradScaler, and a later one does not."""
    stash: AmpStash = getattr(optimizer, ATTR)
    masters = stash.masters
    if masters is not None:
        freed = masters.freed()
        masters.clear_master_grads()
        masters.zero_model_grads(set_to_none=True)
        masters.refreed(freed)  # a user's zero_grad(set_to_none=False) zeroes them, as after a step
    stash.inner_zero_grad(set_to_none=False)
    _forget_grads(stash, zeroed=True)
    if getattr(optimizer, LR_SCHEDULER_STEP_CALLED, None) is True:
        setattr(optimizer, LR_SCHEDULER_STEP_CALLED, stash.opt_called)


def _closure_in(args: tuple, kwargs: dict) -> Optional[Callable[[], Any]]:
    closure = kwargs.get("closure", args[0] if args else None)
    return closure if callable(closure) else None


class _SkippedInClosure(Exception):
    """Raised out of the first evaluation of a closure that overflowed, through a torch
    optimizer's step (which evaluates its closure before it changes anything)."""

    def __init__(self, loss: Any) -> None:
        super().__init__("the closure's scale_loss found an overflow")
        self.loss = loss


def _evaluates_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step is one of torch's own (a subclass that keeps it too):
    those call the closure before they read or change anything (LBFGS: after two
    setdefaults of its counters); another step may not (SAM perturbs the weights first),
    so it cannot be abandoned half-way."""
    return getattr(optimizer_step_function(optimizer), "__module__", "").startswith("torch.optim.")


def _checked_closure(optimizer: torch.optim.Optimizer, stash: AmpStash,
                     closure: Callable[[], Any], args: tuple, kwargs: dict
                     ) -> tuple[tuple, dict]:
    """``step(closure)``'s closure, made safe for an optimizer that calls it inside the step.

    Before each evaluation the half model follows the masters (O2), or an optimizer that
    evaluates it again after changing the params (LBFGS) would see the weights the step
    began with; after each, the gradients a plain ``backward()`` left on the half model
    move into the masters the optimizer reads. A fused optimizer's found-inf flag from the
    closure's ``scale_loss`` is read on the host (a closure's step is synchronous anyway).
    An overflow in the first evaluation makes the step of a torch optimizer (which has
    changed nothing yet) a skip, as an overflow found before ``step()`` does; otherwise
    (a later evaluation, another optimizer) the inf/NaN grads are zeroed before the
    optimizer reads them: LBFGS then ends the step, and nothing non-finite reaches a weight.
    """
    masters = stash.masters
    calls = [0]

    def evaluate() -> Any:
        if masters is not None:
            masters.copy_to_model()
        loss = closure()
        if masters is not None and masters.move_grads():
            warn_unscaled(stash, masters)  # a plain backward in the closure
        if stash.found_inf is not None:
            found_inf, stash.found_inf = stash.found_inf, None
            stash.skip_next = stash.skip_next or bool(found_inf.item())
        calls[0] += 1
        if not stash.skip_next:
            return loss
        stash.skip_next = False
        if calls[0] == 1 and _evaluates_closure_first(optimizer):
            raise _SkippedInClosure(loss)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.zero_()
        return loss
    if "closure" in kwargs:
        return args, dict(kwargs, closure=evaluate)
    return (evaluate, *args[1:]), kwargs


def _fused_step(optimizer: torch.optim.Optimizer, stash: AmpStash, args: tuple,
                kwargs: dict) -> Any:
    """Step a fused optimizer that reads found_inf on the device (as torch's GradScaler does).

    The grads are unscaled already (grad_scale None); a non-zero found_inf makes the fused
    kernel leave params and state untouched, including the step count.
    """
    found_inf, stash.found_inf = stash.found_inf, None
    optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
    fresh = fresh_momentum(optimizer)
    try:
        result = stash.inner_step(*args, **kwargs)
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    if fresh:
        clear_if_skipped(optimizer, fresh, found_inf)
    return result


def _zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    stash: AmpStash = getattr(self, ATTR)
    stash.inner_zero_grad(set_to_none=set_to_none)
    if stash.masters is not None:
        stash.masters.zero_model_grads(set_to_none)
    _forget_grads(stash, zeroed=not set_to_none)


def _forget_grads(stash: AmpStash, zeroed: bool = False) -> None:
    """What zero_grad (or a skip) ends: the state of the gradients held until now;
    ``zeroed``: they were zeroed in place (zeros hold the same at any scale)."""
    stash.grads_unscaled = zeroed
    stash.pending_found_inf = stash.delayed_inv = None
    stash.last_found_inf = stash.carried_inf = None
    stash.stepped = False
    stash.bodies_seen = _state.bodies()


def _add_param_group(self: torch.optim.Optimizer, group: dict) -> None:
    stash: AmpStash = getattr(self, ATTR)
    masters = stash.masters
    if masters is None:
        stash.inner_add_param_group(group)
        warn_if_eps_vanishes(self, self.param_groups[-1:])  # torch filled in the defaults
        return
    # torch validates the group (duplicates, non-leaf tensors, ...) and adds it first;
    # only then are its half params swapped for masters, so a refused group changes nothing.
    params = group["params"]
    params = [params] if torch.is_tensor(params) else list(params)
    if any(masters.owns(p) for p in params):
        # torch sees only the masters in param_groups, so it cannot catch this one.
        raise ValueError("some parameters appear in more than one parameter group: a half "
                         "parameter given again is already stepped through its fp32 master; "
                         "valid: parameters not yet in this optimizer")
    taken = next((p for p in params if p.dtype in HALF_DTYPES
                  and owner_of(p) not in (None, masters)), None)
    if taken is not None:
        # Two masters of one weight: each step would copy its own into the model, the
        # later one undoing the other's update (initialize refuses the same).
        raise ValueError(f"a parameter of shape {tuple(taken.shape)} is already stepped by "
                         f"another optimizer through its fp32 master; {ONE_MASTER_RULE}; "
                         "valid: parameters of no other optimizer (to move one, build the "
                         "optimizers anew and pass them to ampkit.initialize again)")
    stash.inner_add_param_group(dict(group, params=params))
    fresh = sum(p.dtype in HALF_DTYPES and owner_of(p) is None for p in params)
    masters.adopt_param_groups(self.param_groups[-1:])
    if fresh:
        warn(f"add_param_group: {fresh} half parameter(s) join this optimizer without an fp32 "
             "master, which starts from their half values. If they were fp32 before "
             "initialize (a frozen layer left out of the optimizer then), its cast rounded "
             "them: for staged unfreezing, pass every parameter to the optimizer before "
             "initialize (requires_grad=False ones take no step until unfrozen), or keep_fp32 "
             "them. Parameters made half since (a new head) lose nothing")
