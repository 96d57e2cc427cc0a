"""fp32 master weights for half models (apex O2).

The optimizer steps fp32 copies ("masters") of the model's half parameters. Backward
leaves its gradients where torch puts them, on the half parameters, exactly as for an
fp32 model: ``model.zero_grad()`` discards them, DDP all-reduces them, and a gradient
that reaches a model during another model's backward (a GAN's generator loss flowing
through the discriminator) stays on that model until its own ``zero_grad``, as it would
in fp32. They move into the masters only when the optimizer that owns them unscales
(``scale_loss``, ``GradScaler.unscale_``) or steps: :meth:`MasterWeights.move_grads`
converts them bucket by bucket (at most 8 per device) into fp32 (``_grad_move``), each
bucket with one foreach copy into one buffer (a cast per gradient in a bucket of a few),
frees each bucket's half gradients as it goes, and the unscale kernel then reads the new fp32
gradients as one tensor list. After each optimizer step the masters are copied back into
the model with one foreach copy per dtype.

Masters hold *unscaled* gradients (a caller passes ``unscale`` to :meth:`move_grads`
when the model's gradients are scaled), so several unscaled backwards before one step
add up in fp32.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

from ._dtypes import HALF_DTYPES
from . import _grad_move
from ._torch_compat import foreach_add_, foreach_copy_, tensor_version
from ._warn import warn

# Set on each master tensor (a plain tensor, whose attributes survive copy.deepcopy and
# pickling, unlike an nn.Parameter's): an optimizer that steps tensors carrying it but
# has lost ampkit's wrapper is a copy that would never update its model (ampkit.optim).
MASTER_MARK = "_ampkit_master"
# id(model param) -> (weak ref to it, its master, weak ref to the MasterWeights owning it):
# lets convert.py's state_dict hooks save and load the fp32 masters in place of the half
# params (checkpoints resume bitwise), and a later initialize release an earlier one's pairs.
_REGISTRY: dict[int, tuple[weakref.ref, Tensor, weakref.ref]] = {}


# The rule initialize (apply.check_params) and add_param_group (optim) enforce, in their
# refusals' words: a second master of one weight would undo the first one's updates.
ONE_MASTER_RULE = ("with master weights each half parameter has one fp32 master that one "
                   "optimizer steps")


def master_of(param: Tensor) -> Optional[Tensor]:
    """The fp32 master of a half model parameter, or None when it has none."""
    entry = _REGISTRY.get(id(param))
    if entry is None or entry[0]() is not param:
        return _suspended(param)[0] if _SUSPENDED else None
    return entry[1]


def release_masters(params: Iterable[Tensor]) -> int:
    """Unlink every MasterWeights that adopted one of ``params`` from its model.

    ``initialize`` calls it before giving a model new masters: the earlier optimizer then
    neither takes the model's gradients nor writes its stale masters into the model.
    Returns how many MasterWeights were released.
    """
    owners: dict[int, MasterWeights] = {}
    for param in params:
        owner = owner_of(param)
        if owner is not None:
            owners[id(owner)] = owner
    for owner in owners.values():
        owner.remove()
    return len(owners)


def owner_of(param: Tensor) -> Optional["MasterWeights"]:
    """The MasterWeights whose master ``param`` has, or None."""
    entry = _REGISTRY.get(id(param))
    owner_ref = entry[2] if entry is not None and entry[0]() is param else _suspended(param)[1]
    return owner_ref() if owner_ref is not None else None


def _register(param: Tensor, master: Tensor, owner: "MasterWeights") -> None:
    key = id(param)
    _REGISTRY[key] = (weakref.ref(param, lambda _ref: _REGISTRY.pop(key, None)), master,
                      weakref.ref(owner))


# Entries taken out of _REGISTRY while torch swaps their params (see suspend_for_swap):
# id(param) -> (the param, its master, weak ref to the MasterWeights owning it). They are
# still the params' masters (master_of, release_masters): a load that raised between a
# module's pre-hook and the post-hooks leaves them here until the next load resumes them.
_SUSPENDED: dict[int, tuple[Tensor, Tensor, weakref.ref]] = {}


def _suspended(param: Tensor) -> tuple[Optional[Tensor], Optional[weakref.ref]]:
    """(master, owner ref) of a suspended ``param``; (None, None) when it is not."""
    entry = _SUSPENDED.get(id(param))
    if entry is None or entry[0] is not param:
        return None, None
    return entry[1], entry[2]


def suspend_for_swap(params: Iterable[Tensor]) -> None:
    """Drop the weak references to ``params`` (their masters kept aside) until
    :func:`resume_after_swap`: torch.utils.swap_tensors, which load_state_dict uses in
    torch's swap mode, refuses a tensor that has weak references. A swap keeps the
    Python object, so each param's master is its master again afterwards."""
    for param in params:
        entry = _REGISTRY.get(id(param))
        if entry is not None and entry[0]() is param:
            del _REGISTRY[id(param)]  # the only reference to the weakref: it goes with it
            _SUSPENDED[id(param)] = (param, entry[1], entry[2])


def resume_after_swap() -> None:
    """Put back everything :func:`suspend_for_swap` took out. Called by every load
    post-hook: by then each suspended param's module has loaded (its own params are
    swapped before its children load, its post-hooks run after them), and entries left
    by a load that raised come back too."""
    if not _SUSPENDED:
        return  # every load but one in swap mode
    entries = list(_SUSPENDED.values())
    _SUSPENDED.clear()
    for param, master, owner_ref in entries:
        owner = owner_ref()
        if owner is not None and not owner.released:
            _register(param, master, owner)


def new_master(param: Tensor) -> Tensor:
    """An fp32 copy of a half parameter, marked as an ampkit master."""
    master = param.detach().clone().float().requires_grad_(param.requires_grad)
    setattr(master, MASTER_MARK, True)
    return master


class MasterWeights:
    """The model/master parameter pairs of one optimizer, and the moves between them."""

    def __init__(self) -> None:
        self.model_params: list[Tensor] = []
        self.master_params: list[Tensor] = []
        self._master_of: dict[int, Tensor] = {}
        self.released = False
        # (model params, masters) per (device, dtype), built once for the foreach copies.
        self._copy_groups: Optional[list[tuple[list[Tensor], list[Tensor]]]] = None
        # The move's buckets when every model param has a dense gradient (the usual step),
        # built once: a step's move then costs O(buckets) host work, not O(params).
        self._full_plan: Optional[_grad_move.Plan] = None
        # What ``move_grads(keep=True)`` copied into the masters: (param, its half grad, that
        # grad's version). While the model's grads are still exactly these, unchanged, the
        # step must not move them again.
        self._mirror: Optional[list[tuple[Tensor, Tensor, int]]] = None
        # Model params' names (by id; model_params holds them, so no id is reused), for
        # errors only: a param added later (add_param_group) is named by its index.
        self._names: dict[int, str] = {}
        # Which model params' (dense) gradients a move freed since the last zero_grad that
        # set them to None: torch would still hold them, so zero_grad(set_to_none=False)
        # gives them zero ones again. The first ``_freed_upto`` params (a move that found
        # every param with a grad: no set built per step), and ``_freed`` by id.
        self._freed_upto = 0
        self._freed: set[int] = set()
        self._full_count = 0  # the params the full plan covers
        # The half grads (by id: the tensor, its version) that ``amp.master_params`` saw
        # on the model before they moved (see :meth:`note_read`), and the zeros the last
        # ``zero_grad(set_to_none=False)`` left there (no gradient yet: not counted).
        self._read_early: dict[int, tuple[Tensor, int]] = {}
        self._zeroed: dict[int, tuple[Tensor, int]] = {}
        self._read_warned = False

    # --- building -----------------------------------------------------------------------
    def adopt_param_groups(self, param_groups: Iterable[dict]) -> None:
        """Replace each half parameter in ``param_groups`` by an fp32 master, in place.

        The group's list itself is filled anew, not replaced: an optimizer may hold it
        (LBFGS keeps ``param_groups[0]["params"]`` as ``self._params``)."""
        for group in param_groups:
            group["params"][:] = [self._adopt(p) for p in group["params"]]

    def _adopt(self, param: Tensor) -> Tensor:
        if param.dtype not in HALF_DTYPES:
            return param  # already fp32 (e.g. a batch-norm kept in fp32): steps as itself
        if id(param) in self._master_of:
            return self._master_of[id(param)]
        master = new_master(param)
        self.model_params.append(param)
        self.master_params.append(master)
        self._master_of[id(param)] = master
        _register(param, master, self)
        self._copy_groups = self._full_plan = None
        return master

    def name_params(self, names: dict[int, str]) -> None:
        """Record the model's names of the params (``id(param) -> name``), for errors."""
        self._names = {id(p): names[id(p)] for p in self.model_params if id(p) in names}

    def owns(self, param: Tensor) -> bool:
        """Whether ``param`` is one of this optimizer's half model parameters."""
        return id(param) in self._master_of

    # --- gradients model -> master --------------------------------------------------------
    def move_grads(self, unscale: Optional[Callable[[list[Tensor]], None]] = None, *,
                   keep: bool = False) -> bool:
        """Move the model's half gradients into the masters (fp32) and free them; whether a
        backward wrote any of them (not only the zeros a ``zero_grad(set_to_none=False)`` left).

        ``unscale`` receives the new fp32 gradients (still scaled) before they join the
        masters' own, which are unscaled already; without it they join as they are.
        Once released, the model's gradients are not its to take (``unscale`` still runs,
        on none).

        ``keep=True`` copies instead: the half gradients stay on the model, where they keep
        accumulating, and each master's gradient becomes its fp32 copy (replaced, not added
        to; None where the model param has none). A later move without ``keep`` (the
        step's) then finds nothing to move until the half gradients change (another
        gradient object, or an in-place add: autograd's version count).
        """
        if self._mirror is not None and unscale is None and not keep and self._mirrored():
            return False  # the step after a keeping move: these half grads are in the masters
        self._mirror = None
        pending = [] if self.released else [
            (param, master) for param, master in zip(self.model_params, self.master_params)
            if param.grad is not None]
        if not pending and unscale is None:
            return False  # e.g. the step after scale_loss moved them
        params = [param for param, _ in pending]
        if self._read_early:
            self._warn_if_read_early(params)
        # What a backward wrote: not only the zeros the last zero_grad(False) left.
        fresh = not self._zeroed or not all(self._still_zeroed(p.grad) for p in params)
        if not keep:
            self._zeroed = {}  # (their tensors are freed below: not held here either)
        plan = None
        if len(params) == len(self.model_params) and not [p for p in params if p.grad.is_sparse]:
            masters = self.master_params  # every param has a grad: the pairs are all of them
            if self._full_plan is None:  # once: a parameter resized since initialize is
                resized = self._resized()  # named before any gradient is freed
                if resized is not None:
                    raise ValueError(resized)
                self._full_plan = _grad_move.plan(params, masters)
                self._full_count = len(params)
            plan = self._full_plan
            if not keep:
                self._freed_upto = self._full_count
        else:
            masters = [master for _, master in pending]
            if not keep:
                self._freed.update(id(p) for p in params if not p.grad.is_sparse)
        try:  # free when nothing raises (one frame, no call)
            new = _grad_move.to_fp32(params, masters, plan, free=not keep)
            if unscale is not None:
                unscale(new)
            pairs = [(master, grad) for (_, master), grad in zip(pending, new)]
            if keep:  # every master mirrors its model param: a param without a grad, none
                for master in self.master_params:
                    master.grad = None
                for master, grad in pairs:
                    master.grad = grad
                self._mirror = [(p, p.grad, tensor_version(p.grad)) for p in params]
                return fresh
            adding = [(master, grad) for master, grad in pairs if master.grad is not None]
            for master, grad in pairs:
                if master.grad is None:
                    master.grad = grad  # the usual case: the last step consumed the masters' grads
            if adding:  # several moves before one step (accumulation): one multi-tensor add
                dense = [(m.grad, g) for m, g in adding if not (g.is_sparse or m.grad.is_sparse)]
                with torch.no_grad():
                    if dense:
                        foreach_add_([total for total, _ in dense], [grad for _, grad in dense])
                    for master, grad in adding:
                        if grad.is_sparse or master.grad.is_sparse:
                            master.grad = master.grad + grad  # sparse tensors have no in-place add_
        except RuntimeError as err:
            resized = self._resized()
            if resized is None:
                raise
            raise ValueError(resized) from err
        return fresh

    def _resized(self) -> Optional[str]:
        """Why a model parameter no longer fits its master (None when all fit)."""
        for i, (param, master) in enumerate(zip(self.model_params, self.master_params)):
            if param.shape != master.shape:
                name = self._names.get(id(param))
                what = f"model parameter {i}" if name is None else f"parameter {name!r}"
                return (f"{what} has shape {tuple(param.shape)}, its fp32 master "
                        f"{tuple(master.shape)}: it was resized or replaced after "
                        "ampkit.initialize (transformers' resize_token_embeddings, say), so its "
                        "gradients cannot reach the master; valid: resize before "
                        "ampkit.initialize")
        return None

    # --- parameters master -> model -------------------------------------------------------
    def copy_to_model(self) -> None:
        """Copy every master into its model parameter: one foreach copy per (device, dtype)."""
        if self.released:
            return  # a later initialize gave the model other masters: never overwrite them
        if self._copy_groups is None:
            groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
            for param, master in zip(self.model_params, self.master_params):
                dst, src = groups[(param.device, param.dtype)]
                dst.append(param)
                src.append(master)
            self._copy_groups = list(groups.values())
        grad_mode = torch.is_grad_enabled()  # off, as under torch.no_grad(), at half its cost
        torch.set_grad_enabled(False)
        try:
            for dst, src in self._copy_groups:
                foreach_copy_(dst, src)
        finally:
            torch.set_grad_enabled(grad_mode)

    def clear_master_grads(self) -> None:
        """Drop the master gradients (they are consumed by the step, as apex did)."""
        for master in self.master_params:
            master.grad = None

    def _mirrored(self) -> bool:
        """Whether the model's half grads are exactly those the last keeping move copied."""
        mirror = self._mirror
        if mirror is None or len([p for p in self.model_params
                                  if p.grad is not None]) != len(mirror):
            return False
        return all(p.grad is grad and tensor_version(grad) == version
                   for p, grad, version in mirror)

    def note_read(self) -> None:
        """``amp.master_params`` returns the masters: the half grads still on the model
        (not zeros a ``zero_grad`` left) are noted, and a move that takes one of them
        unchanged warns that a clip or norm through the masters saw none of them."""
        if self.released or self._read_warned:
            return
        self._read_early = {id(grad): (grad, tensor_version(grad)) for param in self.model_params
                            if (grad := param.grad) is not None and not self._still_zeroed(grad)}

    def _still_zeroed(self, grad: Tensor) -> bool:
        """Whether ``grad`` is a zero the last ``zero_grad(set_to_none=False)`` left, unchanged."""
        entry = self._zeroed.get(id(grad))
        return entry is not None and entry[0] is grad and entry[1] == tensor_version(grad)

    def _warn_if_read_early(self, params: list[Tensor]) -> None:
        early, self._read_early = self._read_early, {}
        for param in params:
            entry = early.get(id(param.grad))
            if entry is not None and entry[0] is param.grad and \
                    tensor_version(param.grad) == entry[1]:
                self._read_warned = True
                warn("amp.master_params(optimizer) was read while gradients were still on "
                     "the half model, before they moved into the fp32 masters it returns "
                     "(at a scale_loss exit, GradScaler.unscale_ or step()): a clip or a norm "
                     "through them saw none of those gradients. Read it after the `with "
                     "amp.scale_loss(...)` block, or after scaler.unscale_(optimizer) in a "
                     "GradScaler loop. Said once per optimizer")
                return

    def freed(self) -> tuple[int, set[int]]:
        """Which half grads moves freed (see :meth:`zero_model_grads`), to put back."""
        return self._freed_upto, set(self._freed)

    def refreed(self, freed: tuple[int, set[int]]) -> None:
        """Put back what :meth:`freed` returned (a skipped step drops the model's grads,
        not this record of them)."""
        self._freed_upto, self._freed = freed

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad`` on the model's half params.

        ``set_to_none=False`` leaves every param whose gradient a move freed since the last
        ``set_to_none=True`` with a zero one, as torch keeps a zeroed gradient: a param the
        next backward does not reach still steps (momentum, Adam's moments and weight decay
        still move it). Not a param that no longer requires grad (a frozen layer: under
        torch its gradient is usually dropped with it, which ampkit cannot see), nor a
        sparse one (a zero sparse gradient changes nothing in torch's sparse optimizers).
        """
        self._mirror = None
        self._read_early, self._zeroed = {}, {}
        if set_to_none:
            self._freed_upto, self._freed = 0, set()
        for i, param in enumerate(self.model_params):
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
            elif not set_to_none and param.requires_grad and not self.released and (
                    i < self._freed_upto or id(param) in self._freed):
                param.grad = torch.zeros_like(param)
            if not set_to_none and param.grad is not None:
                self._zeroed[id(param.grad)] = (param.grad, tensor_version(param.grad))

    def remove(self) -> None:
        """Unlink from the model: no more gradient moves or copies into it."""
        self.released = True
        for param in self.model_params:
            entry = _REGISTRY.get(id(param))
            if entry is not None and entry[2]() is self:
                del _REGISTRY[id(param)]
            if _SUSPENDED and _suspended(param)[1] is not None:
                del _SUSPENDED[id(param)]
