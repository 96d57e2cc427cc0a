"""A sharded run's state for ``torch.distributed.checkpoint`` (DCP): model, optimizer, scaler.

DCP saves and loads objects with ``state_dict``/``load_state_dict`` (its ``Stateful``
protocol) in place, each rank writing and reading its own shards. ``TrainState`` gathers
what an exact resume needs: the model's and the optimizer's sharded state (through
torch's ``get_state_dict``/``set_state_dict``, which key the optimizer state by
parameter name, so it loads into a freshly built optimizer) and the GradScaler's scale
and counters (Python numbers, the same on every rank).

An optimizer with ampkit's fp32 masters (O2) steps the masters, not the model's
parameters, which torch's ``get_state_dict`` cannot map to names; for it TrainState keys
the optimizer state by the model's parameter names itself (master -> model parameter
through ``MasterWeights``), and saves the model's fp32 state dict (the masters' values).
That path serves unsharded models (plain or DDP, whose replicas every rank holds whole);
``shard`` needs no masters (FSDP2's fp32 shards are the masters).

Loading: DCP reads into the tensors ``state_dict`` returned, and for the FSDP2 and DDP
(O0/O1/O3) paths those are the live parameters and optimizer state (copies would double
the memory of every save), so a checkpoint whose shard file is damaged (truncated, a
corrupted zip header) makes plain ``dcp.load`` raise with part of the model possibly
overwritten already. :func:`load_checkpoint` reads into copies and loads them only once every
rank has read everything: a damaged checkpoint is refused with the live state unchanged.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import nn

from .._sharding import is_sharded
from ..master import MasterWeights
from ..optim import master_weights_of, stash_of
from ..scaler import GradScaler

# The key of a TrainState's state that says its optimizer had no state yet when saved.
FRESH_KEY = "fresh_optimizer"


class TrainState:
    """Model, optimizer and GradScaler as one DCP ``Stateful``, for save and exact resume.

    Args:
        model: the (sharded) model.
        optimizer: its optimizer, or None to save the model alone.
        scaler: the GradScaler, or None (also leave it out when it is disabled: a disabled
            scaler has no state).

    Saving with ``torch.distributed.checkpoint.save(state, ...)`` copies nothing: DCP
    writes the live shards. Load with :func:`load_checkpoint` (the same arguments as
    ``dcp.load``): it reads into copies, so a checkpoint that fails to read (a truncated
    or corrupted shard file, on any rank) raises with the model, optimizer and scaler
    unchanged on every rank. Plain ``dcp.load(state, ...)`` loads a good checkpoint the
    same way, but in place: for FSDP2 and DDP at O0/O1/O3 DCP reads straight into the live
    parameters and optimizer state (under O2 into copies), so when a shard file fails to
    read it raises with part of them possibly overwritten already (the scaler unchanged).
    Neither detects bytes flipped inside tensor data: DCP keeps no digest, so such a
    checkpoint loads. A checkpoint written before TrainState saved ``"fresh_optimizer"``
    loads through :func:`load_checkpoint` only (plain ``dcp.load`` asks for that key and
    raises, changing nothing).

    Example:
        >>> state = {"train": TrainState(model, optimizer, scaler), "step": step}  # doctest: +SKIP
        >>> torch.distributed.checkpoint.save(state, checkpoint_id="ckpt/step100")  # doctest: +SKIP
        >>> load_checkpoint(state, checkpoint_id="ckpt/step100")  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 scaler: Optional[GradScaler] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"TrainState: model must be a torch.nn.Module, got {model!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainState: optimizer must be a torch.optim.Optimizer or None, "
                            f"got {optimizer!r}")
        if scaler is not None and not hasattr(scaler, "load_state_dict"):
            raise TypeError(f"TrainState: scaler must be a GradScaler or None, got {scaler!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler

    def state_dict(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ..., "fresh_optimizer": ..., "scaler": ...}: sharded
        tensors and plain values.

        An optimizer without state yet (no step taken, or only steps the scaler skipped)
        is saved with the state its first step would make at learning rate 0 (DCP needs
        tensors to write, and a fresh optimizer to load into makes the same ones), and
        ``"fresh_optimizer": True``, which a load reads to make the optimizer fresh
        again; the saving optimizer itself is left fresh, its gradients untouched.
        """
        from torch.distributed.checkpoint import state_dict as dcp_state

        masters = self._masters()
        if self.optimizer is None:
            state: dict[str, Any] = {"model": dcp_state.get_model_state_dict(self.model)}
        else:
            optimizer = self.optimizer
            if masters is not None:
                def take() -> dict[str, Any]:
                    return _master_state(self.model, optimizer, masters)
            else:
                def take() -> dict[str, Any]:
                    model_sd, optim_sd = dcp_state.get_state_dict(self.model, optimizer)
                    return {"model": model_sd, "optimizer": optim_sd}
            fresh = not optimizer.state
            state = _with_initial_state(optimizer, take) if fresh else take()
            state[FRESH_KEY] = fresh
        if self.scaler is not None and self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()  # reads the scale: one host sync
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved, in place (DCP calls it after reading)."""
        from torch.distributed.checkpoint import state_dict as dcp_state

        masters = self._masters()
        if self.optimizer is None:
            dcp_state.set_model_state_dict(self.model, state["model"])
        elif masters is not None:
            _load_master_state(self.model, self.optimizer, masters, state)
        else:
            dcp_state.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                     optim_state_dict=state["optimizer"])
        if self.optimizer is not None and state.get(FRESH_KEY) is True:
            self.optimizer.state.clear()  # saved fresh: fresh again (its param groups loaded)
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])

    def _load_target(self) -> dict[str, Any]:
        """What :func:`load_checkpoint` has DCP read into: :meth:`state_dict`, with copies
        of the tensors that alias the live ones (the O2 path's are copies already)."""
        return _clone(self.state_dict(), tensors=self._masters() is None)

    def _masters(self) -> Optional[MasterWeights]:
        if self.optimizer is None or is_sharded(self.model):
            return None
        return master_weights_of(self.optimizer)


def load_checkpoint(state_dict: dict[str, Any], *, checkpoint_id: Any = None,
                    **dcp_kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` that changes nothing unless the read succeeds.

    The same arguments as ``dcp.load`` (``storage_reader=``, ``planner=``,
    ``process_group=`` pass through) and the same result on success: each ``Stateful``
    value (a :class:`TrainState`, a module, an optimizer) gets ``load_state_dict`` with
    what was read, tensors in other values are loaded in place and the other values
    replaced (``state["step"]``). But DCP reads into copies first, so when it fails on any
    rank (a truncated or corrupted shard file, a missing one, bad ``.metadata``, a
    checkpoint of another model) every rank raises DCP's ``CheckpointException`` (a
    ``BaseException``) with ``state_dict`` and the model, optimizer and scaler behind it
    unchanged (a freshly built optimizer, whose state the read has to create, is left
    without state again).

    The copies cost one more copy of this rank's shards (model and optimizer state) for
    the duration of the load; saves copy nothing. Bytes flipped inside tensor data are
    not detected: DCP keeps no digest, so such a checkpoint loads.

    Example:
        >>> state = {"train": TrainState(model, optimizer, scaler), "step": 0}  # doctest: +SKIP
        >>> load_checkpoint(state, checkpoint_id="ckpt/step100")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    if not isinstance(state_dict, dict):
        raise TypeError(f"load_checkpoint: state_dict must be a dict of what to load (as for "
                        f"dcp.load), got {type(state_dict).__name__}")
    fresh = [opt for value in state_dict.values() if isinstance(value, TrainState)
             for opt in [value.optimizer] if opt is not None and not opt.state]
    try:
        targets: dict[str, Any] = {}
        for key, value in state_dict.items():
            if isinstance(value, TrainState):
                targets[key] = value._load_target()
            elif isinstance(value, Stateful):
                targets[key] = _clone(value.state_dict())
            else:
                targets[key] = _clone(value)
        # The model state a TrainState loads must be the whole of the checkpoint's: DCP
        # itself ignores the tensors it was not asked for. (Optimizer state beyond this
        # run's, of parameters frozen since, is dropped, as torch's set_state_dict does.)
        whole = tuple(f"{key}.model." for key, value in state_dict.items()
                      if isinstance(value, TrainState) and "model" in targets[key])
        saved = _saved_metadata(checkpoint_id, dcp_kwargs.get("storage_reader"))
        for key, value in state_dict.items():  # saved before TrainState wrote the key
            if (isinstance(value, TrainState) and saved is not None
                    and f"{key}.{FRESH_KEY}" not in saved):
                targets[key].pop(FRESH_KEY, None)
        _check_shapes(targets, saved, whole)
        _warn_narrowing(targets, saved)
        # A dict of plain values: DCP fills them (in place) and calls no load_state_dict.
        dcp.load(targets, checkpoint_id=checkpoint_id, **dcp_kwargs)
        for key in sorted(state_dict):  # DCP's order
            value = state_dict[key]
            if isinstance(value, Stateful):
                value.load_state_dict(targets[key])
            else:
                state_dict[key] = _write_back(value, targets[key])
    except BaseException:
        for optimizer in fresh:  # state_dict() gave it zero state to load into: drop it
            optimizer.state.clear()
        raise


def _saved_metadata(checkpoint_id: Any, reader: Any) -> Optional[dict[str, Any]]:
    """The checkpoint's entries (DCP's flattened keys -> their metadata), or None where
    they cannot be read (DCP's own load then says why)."""
    import torch.distributed.checkpoint as dcp

    if reader is None:
        if checkpoint_id is None:
            return None
        reader = dcp.FileSystemReader(checkpoint_id)
    try:
        return reader.read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata: DCP's own load reports it
        return None


def _check_shapes(targets: dict[str, Any], saved: Optional[dict[str, Any]],
                  whole: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint whose tensors have other shapes than the ones to load into,
    before anything is read: torch 2.5's DCP read a larger saved tensor into a smaller
    one silently, in part. (Newer torch refuses it too, inside the read.) Under the key
    prefixes ``whole``, a saved tensor this run does not load (another model's layer) is
    refused too."""
    if saved is None:
        return
    wanted = _flat_tensors(targets)
    for key, tensor in wanted:
        size = getattr(saved.get(key), "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise ValueError(f"load_checkpoint: the checkpoint's {key!r} has shape "
                             f"{tuple(size)}, this run's has {tuple(tensor.shape)}; valid: a "
                             "checkpoint of this model (nothing was loaded)")
    keys = {key for key, _ in wanted}
    extra = [key for key, meta in saved.items() if whole and key.startswith(whole)
             and hasattr(meta, "size") and key not in keys]
    if extra:
        raise ValueError(f"load_checkpoint: the checkpoint has {len(extra)} tensor(s) this "
                         f"run has no place for, e.g. {extra[:3]}: it is another model's; "
                         "valid: a checkpoint of this model (nothing was loaded)")


def _warn_narrowing(targets: dict[str, Any], saved: Optional[dict[str, Any]]) -> None:
    """Warn where fp32 tensors of the checkpoint load into half ones of this run (a
    16-mixed or O2 run resumed as O3 or bf16-true): DCP rounds them silently."""
    if saved is None:
        return
    narrowed = []
    for key, tensor in _flat_tensors(targets):
        dtype = getattr(getattr(saved.get(key), "properties", None), "dtype", None)
        if (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                and tensor.is_floating_point() and tensor.dtype.itemsize < dtype.itemsize):
            narrowed.append((key, dtype, tensor.dtype))
    if narrowed:
        key, wide, narrow = narrowed[0]
        warnings.warn(f"load_checkpoint: {len(narrowed)} tensor(s) of the checkpoint load "
                      f"into narrower ones of this run, e.g. {key!r}: {wide} into {narrow}; "
                      "they are rounded, so training does not continue as it would have. "
                      "Resume with the policy that saved it (its parameter dtype) to continue "
                      "exactly", stacklevel=3)


def _flat_tensors(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(key, tensor) pairs under DCP's flattened keys ("train.model.0.weight")."""
    if torch.is_tensor(value):
        return [(prefix, value)]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    return [pair for k, v in items for pair in _flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))]


def _clone(value: Any, tensors: bool = True) -> Any:
    """``value`` with new dicts and lists and (with ``tensors``) copies of its tensors."""
    if isinstance(value, dict):
        items = [(k, _clone(v, tensors)) for k, v in value.items()]
        return type(value)(items) if type(value) in (dict, OrderedDict) else dict(items)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_clone(v, tensors) for v in value)
    return _copy(value) if tensors else value


def _write_back(old: Any, new: Any) -> Any:
    """What DCP's in-place load makes of ``old``: its tensors (and those in its dicts and
    lists) get ``new``'s values in place; anything else is replaced by ``new``."""
    if torch.is_tensor(old) and torch.is_tensor(new):
        if old is not new:
            with torch.no_grad():
                old.copy_(new)
        return old
    if isinstance(old, dict) and isinstance(new, dict):
        for k, v in new.items():
            old[k] = _write_back(old.get(k), v)
        return old
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        old[:] = [_write_back(a, b) for a, b in zip(old, new)]
        return old
    return new


# --- optimizers that step fp32 masters (O2) ----------------------------------------------------
def _unwrap(model: nn.Module) -> nn.Module:
    """The module DDP (or DataParallel) wraps: its names carry no ``module.`` prefix."""
    wrapped = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrapped) else model


def _copy(value: Any) -> Any:
    # DCP loads into the tensors state_dict() returned, in place: copies keep the live
    # model and optimizer unchanged until load_state_dict has checked everything.
    return value.detach().clone() if torch.is_tensor(value) else value


def _names(module: nn.Module, optimizer: torch.optim.Optimizer,
           masters: MasterWeights) -> list[str]:
    """The model parameter name of each parameter the optimizer steps, in its order."""
    model_param = {id(m): p for p, m in zip(masters.model_params, masters.master_params)}
    name_of = {id(p): name for name, p in module.named_parameters()}
    names = []
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        name = name_of.get(id(model_param.get(id(p), p)))
        if name is None:
            raise ValueError(f"TrainState: the optimizer steps a parameter of shape "
                             f"{tuple(p.shape)} that is not one of the model's (nor the master "
                             "of one); valid: an optimizer over this model's parameters")
        names.append(name)
    return names


def _with_initial_state(optimizer: torch.optim.Optimizer, take: Any) -> Any:
    """``take()`` while a fresh optimizer holds the state its first step would make (a step
    with zero gradients at learning rate 0, the gradients it holds set aside: a skipped
    step leaves them); after it, the optimizer is fresh again and has its gradients back.
    What ``take`` returned keeps the state's tensors alive."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        _init_optimizer_state(optimizer)
        return take()
    finally:
        optimizer.state.clear()
        for p, grad in zip(params, grads):
            p.grad = grad


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (a step with zero grads at lr 0), so DCP has
    tensors to load into; torch's get_state_dict does the same for its optimizers."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    try:
        stash = stash_of(optimizer)
        # The masters' own step: ampkit's wrapper would copy masters -> model (a no-op
        # here, but a step of the model's parameters all the same).
        (stash.inner_step if stash is not None else optimizer.step)()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None


def _master_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                  masters: MasterWeights) -> dict[str, Any]:
    """{"model": fp32 state dict, "optimizer": {"state", "param_groups"} keyed by name}."""
    module = _unwrap(model)
    names = _names(module, optimizer, masters)
    osd = optimizer.state_dict()  # state keyed by the params' positions in param_groups
    state = {names[i]: {k: _copy(v) for k, v in entry.items()} for i, entry in osd["state"].items()}
    groups = [dict(group, params=[names[i] for i in group["params"]]) for group in osd["param_groups"]]
    return {"model": {k: _copy(v) for k, v in module.state_dict().items()},
            "optimizer": {"state": state, "param_groups": groups}}


def _load_master_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                       masters: MasterWeights, state: dict[str, Any]) -> None:
    """Load what :func:`_master_state` saved, once every entry has been checked."""
    module = _unwrap(model)
    names = _names(module, optimizer, masters)
    expected = _master_state_keys(module, optimizer, names)
    saved = state["optimizer"]
    _check_keys("model state", list(state["model"]), expected[0])
    _check_keys("optimizer state", list(saved["state"]), expected[1])
    groups = [group["params"] for group in saved["param_groups"]]
    mine = [group["params"] for group in optimizer.state_dict()["param_groups"]]
    if groups != [[names[i] for i in g] for g in mine]:
        raise ValueError(f"TrainState: the checkpoint's optimizer param groups {groups} are not "
                         f"this optimizer's; valid: {[[names[i] for i in g] for g in mine]}")
    position = {name: i for i, name in enumerate(names)}
    module.load_state_dict(state["model"])  # the fp32 values, into the masters too
    optimizer.load_state_dict({
        "state": {position[name]: entry for name, entry in saved["state"].items()},
        "param_groups": [dict(group, params=[position[n] for n in group["params"]])
                         for group in saved["param_groups"]]})


def _master_state_keys(module: nn.Module, optimizer: torch.optim.Optimizer,
                       names: list[str]) -> tuple[list[str], list[str]]:
    """The model state's keys and the names of the params the optimizer holds state for."""
    _init_optimizer_state(optimizer)
    return list(module.state_dict()), [names[i] for i in optimizer.state_dict()["state"]]


def _check_keys(what: str, found: list[str], expected: list[str]) -> None:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if missing or unexpected:
        problem = " and ".join(([f"lacks {missing[:3]}"] if missing else []) +
                               ([f"has unexpected keys {unexpected[:3]}"] if unexpected else []))
        raise ValueError(f"TrainState: the checkpoint's {what} {problem}; valid: the "
                         f"{len(expected)} keys of this run's ({', '.join(expected[:3])}, ...)")
