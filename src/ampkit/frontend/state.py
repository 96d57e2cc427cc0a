"""``master_params``, the amp state dict, and apex's ``_amp_state`` for apex clients."""

from __future__ import annotations

import types
import warnings
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from .. import _state
from .._checks import INT32_MAX, check_int, check_positive
from ..optim import inner_optimizer, stash_of
from ..scaler import GradScaler
from .scale_loss_args import require_initialized

def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The parameters the optimizer steps: the fp32 masters under O2, else the params.

    Example:
        >>> torch.nn.utils.clip_grad_norm_(master_params(optimizer), 1.0)  # doctest: +SKIP
    """
    inner = inner_optimizer(optimizer)
    if inner is None:
        raise TypeError(f"master_params takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__} {optimizer!r}; valid: an optimizer, or a "
                        "wrapper holding one as .optim (apex's LARC)")
    stash = stash_of(inner)
    if stash is not None and stash.masters is not None:
        stash.masters.note_read()  # grads not yet in the masters: their move warns
    return iter([p for group in inner.param_groups for p in group["params"]])


def state_dict(destination: Optional[dict] = None) -> dict[str, dict[str, Any]]:
    """The loss scalers' state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

    Exactly apex's format: ``loss_scale`` and ``unskipped`` (clean steps since the scale
    last changed, the growth tracker; under a fixed scale every step, as apex counted
    them, but for a scale of 1.0 without masters, O0 and O3 as initialized) are the whole of a loss scaler's evolving state, so
    a resumed run continues bitwise; the settings come from ``initialize``. Empty when not
    initialized or disabled. Syncs with the device.

    Example:
        >>> torch.save({"amp": state_dict()}, "ckpt.pt")  # doctest: +SKIP
    """
    result: dict[str, dict[str, Any]] = {} if destination is None else destination
    amp = _state.get_active()
    if amp is None or not amp.enabled:
        return result
    for i, scaler in enumerate(amp.scalers):
        full = scaler.state_dict()
        result[f"loss_scaler{i}"] = {"loss_scale": float(full["scale"]),
                                     "unskipped": _unskipped(amp, i, full)}
    return result


def _unskipped(amp: _state.ActiveAmp, loss_id: int, full: dict[str, Any]) -> int:
    """apex's ``unskipped`` of loss scaler ``loss_id`` (``full``: its state dict): the
    growth tracker of a dynamic scaler, the count of clean steps under a fixed scale."""
    if not amp.fixed_unskipped:
        return int(full["_growth_tracker"])
    return amp.fixed_unskipped[loss_id]


def load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    """Restore the loss scalers from :func:`state_dict` or an apex.amp checkpoint.

    Example:
        >>> load_state_dict(torch.load("ckpt.pt")["amp"])  # doctest: +SKIP
    """
    if _state.get_active() is None and isinstance(state, dict) and not state:
        return  # what state_dict() gives without initialize: nothing to restore
    amp = require_initialized()
    if not amp.enabled:
        return
    expected = [f"loss_scaler{i}" for i in range(len(amp.scalers))]
    if not isinstance(state, dict):
        raise TypeError(f"amp state_dict must be a dict such as ampkit.state_dict() returns, got "
                        f"{type(state).__name__} {state!r}; valid: a dict with keys {expected}")
    keys = _scaler_keys(state, expected)
    if len(keys) != len(expected):
        # apex warned and loaded the entries in order (resuming with another num_losses)
        warnings.warn(f"amp state_dict has {len(keys)} loss scaler(s) {keys}, initialize has "
                      f"num_losses={len(expected)}: loading the first "
                      f"{min(len(keys), len(expected))} in order, as apex did", stacklevel=2)
    pairs = list(zip(keys, amp.scalers))
    full = [_scaler_state(key, state[key], scaler) for key, scaler in pairs]
    for (_, scaler), entry in zip(pairs, full):
        scaler.check_state_dict(entry)  # validates: every entry before any scaler changes
    for i, ((key, scaler), entry) in enumerate(zip(pairs, full)):
        if not amp.dynamic and float(entry["scale"]) != scaler.get_scale():
            # apex loaded it as well; a scale a dynamic run wrote (O1/O2's 65536) then
            # scales every step of this one, with no overflow check to catch what it flushes.
            warnings.warn(f"amp state_dict[{key!r}] sets the loss scale to "
                          f"{float(entry['scale']):g}, where this run's is fixed at "
                          f"{scaler.get_scale():g} and checks no overflow (a fixed scale or "
                          "O0/O3): loading it as apex did. If the checkpoint comes from a "
                          "dynamic run (O1/O2), pass this run's own amp state or none",
                          stacklevel=2)
        scaler.load_state_dict(entry)
        _note_scale(amp, scaler.get_scale())
        if amp.fixed_unskipped:
            amp.fixed_unskipped[i] = int(entry["_growth_tracker"])


def _note_scale(amp: _state.ActiveAmp, scale: float) -> None:
    """A scale other than 1.0 is applied from now on, also where initialize fixed it at 1.0
    (O0, O3): apex's scale_loss always multiplied by its scaler's current scale."""
    if scale != 1.0:
        amp.scaling = True


def _scaler_keys(state: dict, expected: list[str]) -> list[str]:
    """The keys ``loss_scaler0`` .. ``loss_scaler<k-1>`` of an amp state dict, in order;
    any other key (a gap in the numbering too) is refused, naming it."""
    keys = [f"loss_scaler{i}" for i in range(len(state))]
    for key in state:
        if key not in keys:
            raise ValueError(f"amp state_dict has key {key!r} among {sorted(state, key=str)}; "
                             f"valid: 'loss_scaler0' .. 'loss_scaler<k-1>', one per loss, here "
                             f"{expected} (num_losses={len(expected)} in initialize)")
    return keys


def _scaler_state(key: str, entry: Any, scaler: GradScaler) -> dict[str, Any]:
    if not (isinstance(entry, dict) and "loss_scale" in entry and "unskipped" in entry):
        raise ValueError(f"amp state_dict[{key!r}] is {entry!r}; valid: a dict with 'loss_scale' "
                         "and 'unskipped'")
    # Checked under apex's names, naming the entry, as a write to _loss_scale is: a scale
    # of 0 or inf would be applied (O0, O3) clamped to a bound nothing brings back.
    where = f"amp state_dict[{key!r}]"
    check_positive(f"{where}['loss_scale']", entry["loss_scale"])
    check_int(f"{where}['unskipped']", entry["unskipped"], 0, INT32_MAX)  # torch's int32 tracker
    # The scale and the clean-step count; settings (bounds, interval) stay this scaler's.
    return {"scale": entry["loss_scale"], "_growth_tracker": entry["unskipped"],
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval()}


# --- apex's private attributes that public apex clients use -----------------------------
_WRITABLE = ("_loss_scale", "_unskipped", "_scale_seq_len")
_READABLE = ("loss_scale()", "dynamic", "_min_loss_scale", "_max_loss_scale") + _WRITABLE


class _LossScaler:
    """apex's ``LossScaler`` as training scripts use it, over one of ampkit's loss scalers.

    ``loss_scale()`` and ``_loss_scale`` read the current scale, ``_unskipped`` the clean
    steps since it last changed, ``_scale_seq_len`` the clean steps the scale grows after
    (the growth interval); writing one of these sets the scaler (the next ``scale_loss``
    uses it). ``dynamic``, ``_min_loss_scale`` and ``_max_loss_scale`` are read-only. Any
    other attribute, read or written, raises AttributeError naming these: a write to this
    view that nothing reads would be lost silently. Each read or write of the scale or the
    count syncs with the device.
    """

    __slots__ = ("_amp", "_loss_id", "_scaler")

    def __init__(self, amp: _state.ActiveAmp, loss_id: int) -> None:
        object.__setattr__(self, "_amp", amp)
        object.__setattr__(self, "_loss_id", loss_id)
        object.__setattr__(self, "_scaler", amp.scalers[loss_id])

    def loss_scale(self) -> float:
        return self._scaler.get_scale()

    @property
    def dynamic(self) -> bool:
        return self._amp.dynamic

    @property
    def _min_loss_scale(self) -> Optional[float]:
        return self._scaler.min_scale

    @property
    def _max_loss_scale(self) -> Optional[float]:
        return self._scaler.max_scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        scale = check_positive("_loss_scale", value)
        # As written, as in apex: min/max_loss_scale bound the later updates, not this.
        self._scaler.set_scale(scale)
        _note_scale(self._amp, scale)

    @property
    def _unskipped(self) -> int:
        return _unskipped(self._amp, self._loss_id, self._scaler.state_dict())

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        value = int(check_int("_unskipped", value, 0, INT32_MAX))
        self._set(_growth_tracker=value)
        if self._amp.fixed_unskipped:
            self._amp.fixed_unskipped[self._loss_id] = value

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.get_growth_interval()

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        # apex grew the scale when _unskipped reached it: torch's growth interval.
        self._scaler.set_growth_interval(int(check_int("_scale_seq_len", value, 1, INT32_MAX)))

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies and pickles are rebuilt through __init__ (a shallow copy views the same
        # scaler); the slots cannot be set through __setattr__, which refuses them.
        return _LossScaler, (self._amp, self._loss_id)

    def _set(self, **entries: Any) -> None:
        state = self._scaler.state_dict()
        state.update(entries)
        self._scaler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        hint = (" (scale_loss unscales the gradients and updates the scale at its exit)"
                if name in ("update_scale", "unscale", "unscale_with_stashed",
                            "_has_overflow") else "")
        raise AttributeError(f"apex's LossScaler.{name} is not part of ampkit's "
                             f"_amp_state.loss_scalers{hint}; valid: {', '.join(_READABLE)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _WRITABLE:
            read_only = " is read-only" if name in _READABLE else " is not part of it"
            raise AttributeError(f"_amp_state.loss_scalers[{self._loss_id}].{name}{read_only}: "
                                 "a write here would change nothing; valid writes: "
                                 f"{', '.join(_WRITABLE)} (settings: pass them to initialize)")
        object.__setattr__(self, name, value)


class _Properties:
    """apex's ``_amp_state.opt_properties``, read-only: the options ``initialize``
    resolved (``opt_level``, ``cast_model_type``, ``patch_torch_functions``,
    ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale``, ``enabled``), as
    attributes and as the dict ``options``, with apex's values for each level."""

    __slots__ = ("options",)

    def __init__(self, amp: _state.ActiveAmp) -> None:
        object.__setattr__(self, "options", types.MappingProxyType(_options(amp)))

    def __getattr__(self, name: str) -> Any:
        options = object.__getattribute__(self, "options")
        if name in options:
            return options[name]
        raise AttributeError(f"apex's opt_properties.{name} is not part of ampkit's "
                             f"_amp_state.opt_properties; valid: {', '.join(options)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"_amp_state.opt_properties.{name} is read-only: ampkit applied "
                             "the options at initialize; valid: pass them to initialize")


def _options(amp: _state.ActiveAmp) -> dict[str, Any]:
    # apex's Properties() defaults: what initialize(enabled=False) leaves.
    options: dict[str, Any] = {"enabled": False, "opt_level": None, "cast_model_type": None,
                               "patch_torch_functions": False, "keep_batchnorm_fp32": None,
                               "master_weights": None, "loss_scale": 1.0}
    policy = amp.policy
    if not amp.enabled or policy is None:
        return options
    half_params = policy.param_dtype != torch.float32
    autocast_only = policy.autocast and not half_params  # O1's kind: nothing cast
    options.update(
        enabled=True, opt_level=amp.opt_level,
        # O1 casts no model (None); O0 names fp32, O2/O3 the half dtype.
        cast_model_type=None if autocast_only else policy.param_dtype,
        patch_torch_functions=policy.autocast,
        keep_batchnorm_fp32=policy.keep_batchnorm_fp32 if half_params else None,
        master_weights=None if autocast_only and not policy.master_weights
        else policy.master_weights,  # O1: None, as apex's
        loss_scale=policy.loss_scale)  # as given: "dynamic", or the fixed scale
    return options


class _AmpStateView:
    """``ampkit._amp_state``: apex's process-wide state, the parts apex clients read.

    ``loss_scalers[i]`` follows the active ``initialize`` (empty before it or when it was
    disabled), so a script that writes ``_amp_state.loss_scalers[0]._loss_scale`` after
    initialize sets the scale its next ``scale_loss`` uses. ``opt_properties`` exists
    once ``initialize`` ran, as in apex.
    """

    @property
    def loss_scalers(self) -> list[_LossScaler]:
        amp = _state.get_active()
        if amp is None or not amp.enabled:
            return []
        return [_LossScaler(amp, i) for i in range(len(amp.scalers))]

    @property
    def opt_properties(self) -> _Properties:
        amp = _state.get_active()
        if amp is None:
            raise AttributeError("_amp_state.opt_properties exists once ampkit.initialize ran, "
                                 "as in apex; valid: call initialize first")
        return _Properties(amp)


_amp_state = _AmpStateView()
