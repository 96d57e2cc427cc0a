"""fp32 master weights for half models (apex O2).

The optimizer steps fp32 copies ("masters") of the model's half parameters. Gradients
flow model -> master while backward runs: a post-accumulate-grad hook on each half
parameter converts its gradient into the master's fp32 ``.grad`` and frees the half
gradient at once, so the half gradients never all exist together. In a distributed run
the hooks stand aside (DDP all-reduces ``param.grad`` at the end of backward) and
``sync_grads`` moves the reduced gradients instead. After each optimizer step the masters
are copied back into the model with one fused foreach copy per dtype.

Scaling seam (used by ``GradScaler.unscale_`` and ``scale_loss``): master gradients are
held *scaled* until a scaler unscales them in place and calls :meth:`note_unscaled`;
gradients that arrive after that (accumulation across several ``scale_loss`` calls) are
multiplied by the recorded inverse scale as they are added, so the masters always hold
one consistent sum.
"""

from __future__ import annotations

import types
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

_ATTR = "_ampkit_master_weights"
# id(model param) -> (weak ref to it, its master, weak ref to the MasterWeights owning it):
# lets convert.py's state_dict hooks save and load the fp32 masters in place of the half
# params (checkpoints resume bitwise), and a later initialize release an earlier one's hooks.
_REGISTRY: dict[int, tuple[weakref.ref, Tensor, weakref.ref]] = {}


def master_of(param: Tensor) -> Optional[Tensor]:
    """The fp32 master of a half model parameter, or None when it has none."""
    entry = _REGISTRY.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]


def release_masters(params: Iterable[Tensor]) -> int:
    """Detach the gradient hooks of every MasterWeights that adopted one of ``params``.

    ``initialize`` calls it before giving a model new masters, so an earlier call's hooks
    stop taking the gradients. Returns how many MasterWeights were released.
    """
    owners: dict[int, MasterWeights] = {}
    for param in params:
        entry = _REGISTRY.get(id(param))
        owner = entry[2]() if entry is not None and entry[0]() is param else None
        if owner is not None:
            owners[id(owner)] = owner
    for owner in owners.values():
        owner.remove()
    return len(owners)


def _register(param: Tensor, master: Tensor, owner: "MasterWeights") -> None:
    key = id(param)
    _REGISTRY[key] = (weakref.ref(param, lambda _ref: _REGISTRY.pop(key, None)), master,
                      weakref.ref(owner))


def _grads_reduced_after_backward() -> bool:
    """True in a distributed run, where DDP-style wrappers read ``param.grad`` after it is
    accumulated (and write the all-reduced gradient back later): there the half gradient
    must stay in place until backward ends, so the move to the masters waits for
    :meth:`MasterWeights.sync_grads` (which scale_loss, GradScaler.unscale_ and step call).
    """
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


class MasterWeights:
    """The model/master parameter pairs of one optimizer, and the moves between them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer_ref = weakref.ref(optimizer)
        self.model_params: list[Tensor] = []
        self.master_params: list[Tensor] = []
        self._master_of: dict[int, Tensor] = {}
        self._hooks: list[Any] = []
        self._inv_scale: Optional[Tensor] = None
        # (model params, masters) per (device, dtype), built once for the foreach copies.
        self._copy_groups: Optional[list[tuple[list[Tensor], list[Tensor]]]] = None

    # --- building -----------------------------------------------------------------------
    def adopt_param_groups(self, param_groups: Iterable[dict]) -> None:
        """Replace each half parameter in ``param_groups`` by an fp32 master, in place."""
        for group in param_groups:
            group["params"] = [self._adopt(p) for p in group["params"]]

    def _adopt(self, param: Tensor) -> Tensor:
        if param.dtype not in (torch.float16, torch.bfloat16):
            return param  # already fp32 (e.g. a batch-norm kept in fp32): steps as itself
        if id(param) in self._master_of:
            return self._master_of[id(param)]
        master = torch.nn.Parameter(param.detach().clone().float(), requires_grad=param.requires_grad)
        self.model_params.append(param)
        self.master_params.append(master)
        self._master_of[id(param)] = master
        _register(param, master, self)
        self._copy_groups = None
        if param.requires_grad:
            self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_hook(master)))
        return master

    def _grad_hook(self, master: Tensor) -> Callable[[Tensor], None]:
        def move_grad(param: Tensor) -> None:
            if _grads_reduced_after_backward():
                return  # DDP/FSDP still reduce param.grad: sync_grads moves it afterwards
            self._accumulate(master, param.grad)
            param.grad = None  # the half gradient is freed as soon as it is consumed
        return move_grad

    # --- gradients model -> master --------------------------------------------------------
    def _accumulate(self, master: Tensor, grad: Optional[Tensor]) -> None:
        if grad is None:
            return
        if self._inv_scale is None:  # masters still hold scaled grads: plain sum
            if master.grad is None:
                master.grad = grad.detach().float()
            else:
                master.grad.add_(grad.detach())
            return
        # The masters were unscaled already: bring the new (scaled) grad to their scale.
        # A device tensor multiply, no host sync.
        if grad.is_sparse:  # sparse tensors have no in-place mul_/addcmul_
            scaled = grad.detach().float() * self._inv_scale
            master.grad = scaled if master.grad is None else master.grad + scaled
        elif master.grad is None:
            master.grad = grad.detach().float().mul_(self._inv_scale)
        else:
            master.grad.addcmul_(grad.detach().float(), self._inv_scale)

    def sync_grads(self) -> None:
        """Move any half gradient the hooks did not see (e.g. set by hand) into the masters."""
        for param, master in zip(self.model_params, self.master_params):
            if param.grad is not None:
                self._accumulate(master, param.grad)
                param.grad = None

    def note_unscaled(self, inv_scale: Optional[Tensor]) -> None:
        """Record that the master grads were unscaled in place by ``inv_scale``.

        Called by the scalers after unscaling; ``None`` means the masters hold scaled
        (or never-scaled) gradients again, as after ``zero_grad``.
        """
        self._inv_scale = None if inv_scale is None else inv_scale.detach().clone()

    def master_grads(self) -> list[Tensor]:
        return [m.grad for m in self.master_params if m.grad is not None]

    # --- parameters master -> model -------------------------------------------------------
    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Copy every master into its model parameter: one foreach copy per (device, dtype)."""
        if self._copy_groups is None:
            groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
            for param, master in zip(self.model_params, self.master_params):
                dst, src = groups[(param.device, param.dtype)]
                dst.append(param)
                src.append(master)
            self._copy_groups = list(groups.values())
        for dst, src in self._copy_groups:
            torch._foreach_copy_(dst, src)

    @property
    def grads_unscaled(self) -> bool:
        """True when the master grads were unscaled (``note_unscaled``) since the last clear."""
        return self._inv_scale is not None

    def clear_master_grads(self) -> None:
        """Drop the master gradients (they are consumed by the step, as apex did)."""
        for master in self.master_params:
            master.grad = None
        self._inv_scale = None

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Refresh the masters from the model (after the model's weights were loaded)."""
        for param, master in zip(self.model_params, self.master_params):
            master.copy_(param)

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def remove(self) -> None:
        """Detach the gradient hooks (the optimizer keeps stepping its masters)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for param in self.model_params:
            entry = _REGISTRY.get(id(param))
            if entry is not None and entry[2]() is self:
                del _REGISTRY[id(param)]


def master_weights_of(optimizer: Any) -> Optional[MasterWeights]:
    """The MasterWeights attached to an optimizer by ``initialize``, or None."""
    return getattr(optimizer, _ATTR, None)


def attach_master_weights(optimizer: torch.optim.Optimizer) -> MasterWeights:
    """Give ``optimizer`` fp32 masters for its half parameters and wrap step/zero_grad.

    ``optimizer.step`` then copies the masters back into the model after stepping, and
    ``optimizer.zero_grad`` clears model and master gradients alike.
    """
    if master_weights_of(optimizer) is not None:
        raise RuntimeError(f"optimizer {type(optimizer).__name__} already has ampkit master weights")
    mw = MasterWeights(optimizer)
    mw.adopt_param_groups(optimizer.param_groups)
    _rebind_state(optimizer, mw)
    setattr(optimizer, _ATTR, mw)
    _wrap_methods(optimizer, mw)
    return mw


def _rebind_state(optimizer: torch.optim.Optimizer, mw: MasterWeights) -> None:
    """Move optimizer state that was keyed by a half param onto its master."""
    for param, master in zip(mw.model_params, mw.master_params):
        if param in optimizer.state:
            state = optimizer.state.pop(param)
            optimizer.state[master] = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point()
                                           and v.dim() > 0 else v) for k, v in state.items()}


def _wrap_methods(optimizer: torch.optim.Optimizer, mw: MasterWeights) -> None:
    step = optimizer.step
    zero_grad = optimizer.zero_grad
    add_param_group = optimizer.add_param_group

    def master_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        mw.sync_grads()
        result = step(*args, **kwargs)
        mw.copy_to_model()
        # The masters' grads are consumed: cleared here as apex did, so code that zeroes
        # only the model's grads (model.zero_grad()) does not accumulate into the masters.
        mw.clear_master_grads()
        return result

    def master_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        zero_grad(set_to_none=set_to_none)
        mw.zero_model_grads(set_to_none)
        mw.note_unscaled(None)

    def master_add_param_group(self: torch.optim.Optimizer, group: dict) -> None:
        # torch validates the group (duplicates, non-leaf tensors, ...) and adds it first;
        # only then are its half params swapped for masters, so a refused group changes
        # nothing.
        params = group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        if any(id(p) in mw._master_of for p in params):
            # torch sees only the masters in param_groups, so it cannot catch this one.
            raise ValueError("some parameters appear in more than one parameter group: a "
                             "half parameter given again is already stepped through its fp32 "
                             "master; valid: parameters not yet in this optimizer")
        add_param_group(dict(group, params=params))
        mw.adopt_param_groups(self.param_groups[-1:])

    # Bound methods (not plain functions), as LRScheduler re-wraps ``step.__func__``.
    master_step.__wrapped__ = step  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(master_step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(master_zero_grad, optimizer)  # type: ignore[method-assign]
    optimizer.add_param_group = types.MethodType(  # type: ignore[method-assign]
        master_add_param_group, optimizer)
