"""``ampkit.autocast``: torch.autocast with inferred device and dtype, plus user overrides.

Every op runs through torch's own C++ autocast dispatch, so ops nobody registered cost
exactly what they cost under ``torch.autocast`` (no Python in the per-op path). ampkit
adds only a per-thread frame on enter/exit, which registered overrides consult.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar, Union

import torch
# Bound at import: code that sets ``torch.autocast = ampkit.autocast`` must not send ampkit
# back into itself.
from torch.amp.autocast_mode import autocast as _TorchAutocast

from . import _state, overrides
from ._dtypes import HALF_DTYPES, autocast_default_dtype, check_device_type, resolve_dtype
from ._torch_compat import (
    autocast_decrement_nesting,
    autocast_increment_nesting,
    clear_autocast_cache,
    get_autocast_dtype,
    is_autocast_cache_enabled,
    is_autocast_enabled,
    is_compiling,
    is_torch_function_mode_enabled,
    privateuse1_backend_name,
    resolve_autocast,
    set_autocast_cache_enabled,
    set_autocast_dtype,
    set_autocast_enabled,
)

F = TypeVar("F", bound=Callable[..., Any])
# Every floating dtype is accepted as torch accepts it: one it has no autocast for (fp32,
# fp64, the fp8 and fp4 dtypes) warns and disables the region.
_AUTOCAST_DTYPES = HALF_DTYPES + tuple(dict.fromkeys(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d not in HALF_DTYPES))
_VALID_DTYPES = ("torch.float16 or torch.bfloat16, or a name: fp16, half, bf16, ...; another "
                 "floating dtype (fp32, fp64, fp8) warns and disables the region, as in torch")


# (device_type, dtype, enabled[, CUDA device]) -> (enabled, dtype) as torch.autocast
# resolves them. Resolving once per key keeps torch's validation while construction stays
# cheap. The key holds everything torch's answer depends on: for bf16 on CUDA that is the
# current device too (torch asks it whether it has bf16, and the device can change). Where
# torch disables itself (cuda without a GPU or torch_xla, a dtype the device lacks) it is
# asked again at every construction, so that it warns every time, as for its own, and
# answers anew once that changed (a GPU made visible, torch_xla installed).
_RESOLVED: dict[tuple, tuple[bool, torch.dtype]] = {}
# Device type names checked once. "cpu" and "cuda" are there from the start: a region that
# torch.compile traces first would otherwise fill the cache while tracing, and the graph,
# guarded on the cache's contents, would be compiled again at its next call.
_CHECKED_DEVICES: dict[str, str] = {"cpu": "cpu", "cuda": "cuda"}


def _torch_resolution(device_type: str, dtype: torch.dtype, enabled: bool,
                      compiling: Optional[bool] = None) -> tuple[bool, torch.dtype]:
    if compiling if compiling is not None else is_compiling():
        # Dynamo cannot trace into a torch.autocast object's attributes, nor does it
        # check the switches __enter__ sets, so torch's rule for the dtype is applied
        # here: on a CPU or a GPU, a dtype other than fp16 or bf16 disables the region
        # (an eager construction warns). The cache is not read either: the graph would be
        # guarded on its contents, and compiled again once eager code filled it.
        if enabled and dtype not in HALF_DTYPES and device_type in ("cpu", "cuda"):
            return False, dtype
        return enabled, dtype
    key: tuple = (device_type, dtype, enabled)
    if device_type == "cuda" and dtype is torch.bfloat16 and enabled:
        key = (device_type, dtype, enabled, _cuda_device())
    resolved = _RESOLVED.get(key)
    if resolved is not None and resolved[0] == enabled:
        return resolved
    resolved = _RESOLVED[key] = resolve_autocast(device_type, dtype, enabled)  # warns if it disables
    return resolved


def _cuda_device() -> Optional[int]:
    """The current CUDA device, which torch.autocast asks about bf16; None without CUDA."""
    try:
        return torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # not compiled with CUDA, no GPU: torch disables itself
        return None


def _device_type(device_type: Optional[str]) -> str:
    if device_type is None:
        return _state.inferred_device_type()
    if not isinstance(device_type, str):  # ValueError, as torch.autocast raises
        hint = "; pass device.type" if isinstance(device_type, torch.device) else ""
        raise ValueError(f"device_type must be a str such as 'cpu' or 'cuda', got "
                         f"{device_type!r}{hint}")
    if is_compiling():  # neither read nor written while tracing: no guard on the cache
        return check_device_type(device_type)
    checked = _CHECKED_DEVICES.get(device_type)
    if checked is None:
        checked = _CHECKED_DEVICES[device_type] = check_device_type(device_type)
    return checked


class autocast:  # noqa: N801 - the name mirrors torch.autocast
    """Context manager and decorator: ops run in the precision torch.autocast picks.

    Args:
        device_type: "cpu", "cuda", ...; None: the device of the model given to the
            active ``initialize``, else "cuda" when available, else "cpu".
        dtype: torch.float16 / torch.bfloat16 or a name ("fp16", "bf16", ...); None: the
            active ``initialize``'s half dtype, else torch's default for the device.
        enabled: False makes the region a no-op (ops keep their dtypes).
        cache_enabled: as torch.autocast (None: torch's current setting).

    Example:
        >>> with autocast("cpu", dtype="bf16"):
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.bfloat16
    """

    def __init__(self, device_type: Optional[str] = None,
                 dtype: Optional[Union[torch.dtype, str]] = None, enabled: bool = True,
                 cache_enabled: Optional[bool] = None) -> None:
        # Each check is called only when its quick test fails: a region is built per step.
        if enabled.__class__ is not bool or cache_enabled is not None:
            _check_flags(enabled, cache_enabled)
        # Traced by torch.compile, no cache is read (a guard on its contents would compile
        # the graph again once eager code filled it).
        compiling = is_compiling()
        device = (_CHECKED_DEVICES.get(device_type)
                  if device_type.__class__ is str and not compiling else None)
        if device is None:
            device = _device_type(device_type)
        if dtype.__class__ is not torch.dtype or dtype not in _AUTOCAST_DTYPES:
            dtype = self._resolve_dtype(dtype, device)
        self._setup(device, dtype, enabled, cache_enabled, compiling)

    def _setup(self, device_type: str, dtype: torch.dtype, enabled: bool = True,
               cache_enabled: Optional[bool] = None, compiling: Optional[bool] = None) -> None:
        """The state of a region for checked arguments (torch decides whether it is on)."""
        self.device_type = device_type
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self._enabled, self.fast_dtype = _torch_resolution(device_type, dtype, enabled, compiling)
        self._cache_enabled = (is_autocast_cache_enabled() if cache_enabled is None
                               else cache_enabled)
        self._delegate: Optional[_TorchAutocast] = None
        self._outer: Optional[list] = None  # outer entries' delegates, when entered again

    @staticmethod
    def _resolve_dtype(dtype: Optional[Union[torch.dtype, str]], device_type: str) -> torch.dtype:
        if dtype is not None:
            if isinstance(dtype, torch.dtype) and dtype not in _AUTOCAST_DTYPES:
                raise ValueError(f"autocast dtype {dtype} is not a floating dtype; valid: "
                                 f"{_VALID_DTYPES}")
            return resolve_dtype(dtype, allowed=_AUTOCAST_DTYPES, what="autocast dtype")
        active = _state.get_active()
        if active is not None and active.device_type == device_type and active.half_dtype:
            return active.half_dtype
        return autocast_default_dtype(device_type)

    def __enter__(self) -> "autocast":
        device = self.device_type
        if is_torch_function_mode_enabled():
            # Tracing (torch.export, make_fx): let torch.autocast record the region.
            if self._delegate is not None:  # entered again while open: each exit its own
                if self._outer is None:
                    self._outer = []
                self._outer.append(self._delegate)
            self._delegate = _TorchAutocast(device, self.fast_dtype, self._enabled,
                                            self._cache_enabled)
        else:
            self._prev = (is_autocast_cache_enabled(), is_autocast_enabled(device),
                          get_autocast_dtype(device))
            autocast_increment_nesting()
        try:  # free unless it raises: entering costs what it did
            if self._delegate is None:
                # The same switches torch.autocast.__enter__ sets, without its per-call setup.
                set_autocast_enabled(device, self._enabled)
                set_autocast_dtype(device, self.fast_dtype)
                set_autocast_cache_enabled(self._cache_enabled)
            else:
                self._delegate.__enter__()
            overrides.push_frame(device, self.fast_dtype, self._enabled)
        except BaseException:
            self._restore_torch(None, None, None)  # as before the failed entry, nesting too
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        overrides.pop_frame()
        return self._restore_torch(exc_type, exc, tb)

    def _restore_torch(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._delegate is not None:
            delegate = self._delegate
            self._delegate = self._outer.pop() if self._outer else None  # an outer entry's
            return bool(delegate.__exit__(exc_type, exc, tb))
        # Drop the weight-cast cache when leaving the outermost autocast region, as torch does.
        if autocast_decrement_nesting() == 0:
            clear_autocast_cache()
        cache, enabled, dtype = self._prev
        set_autocast_enabled(self.device_type, enabled)
        set_autocast_dtype(self.device_type, dtype)
        set_autocast_cache_enabled(cache)
        return False

    @property
    def device(self) -> str:
        """The device type, under torch.autocast's name for it."""
        return self.device_type

    @property
    def custom_backend_name(self) -> str:
        """torch's name of the privateuse1 backend (torch.autocast instances carry it)."""
        return privateuse1_backend_name()

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(f"autocast()(func) requires a callable, but got {type(func).__name__}; "
                            "valid: a function or other callable. As a context manager: "
                            "`with ampkit.autocast(...):`")
        # Resolved now, as torch's decorator does: a call neither re-warns nor re-reads the
        # global cache flag.
        args = (self.device_type, self.fast_dtype, self._enabled, self._cache_enabled)

        @functools.wraps(func)
        def decorated(*a: Any, **kw: Any) -> Any:
            # A fresh region per call, so recursive and concurrent calls nest correctly.
            with _Checked(*args):
                return func(*a, **kw)

        return decorated  # type: ignore[return-value]

    def __repr__(self) -> str:
        # getattr: dynamo (torch 2.5) formats its graph-break message with the repr of an
        # instance whose __init__ it never ran; a failing repr turned the break into an error.
        device, dtype, enabled = (getattr(self, name, "?") for name in
                                  ("device_type", "fast_dtype", "enabled"))
        return f"ampkit.autocast(device_type={device!r}, dtype={dtype}, enabled={enabled})"


class _Checked(autocast):
    """``autocast(device_type, dtype, enabled, cache_enabled)`` for arguments checked
    already (see :func:`region_factory`): the same region, without re-validating them."""

    __init__ = autocast._setup  # (device_type, dtype, enabled=True, cache_enabled=None)

    def run(self, func: Callable[..., Any], *args: Any) -> Any:
        """``func(*args)`` inside this region (entered here, left even if it raises).

        While torch.compile traces, the region is a ``with torch.autocast(...)``
        statement: the dynamo of torch 2.5 to 2.11 cannot trace the switches
        ``__enter__`` sets (the graph broke at every call), and every dynamo traces
        torch's own class in a with statement whole. Registered overrides still see the
        region (its per-thread frame is pushed).
        """
        if not is_compiling():
            with self:
                return func(*args)
        with _TorchAutocast(self.device_type, self.fast_dtype, self._enabled,
                            self._cache_enabled):
            overrides.push_frame(self.device_type, self.fast_dtype, self._enabled)
            try:
                return func(*args)
            finally:
                overrides.pop_frame()


def region_factory(device_type: Optional[str] = None,
                   dtype: Optional[Union[torch.dtype, str]] = None) -> Callable[[], autocast]:
    """A factory of fresh regions, each one ``autocast(device_type, dtype)``.

    The arguments are checked and resolved once, here, as ``autocast`` would now (with
    its errors); each region it makes then skips that work, which matters where one is
    entered per forward (O1's converted forward). Whether torch runs the region (with its
    warning where it does not) and the cache flag are still decided per region, as for
    ``autocast``.

    Example:
        >>> make = region_factory("cpu", torch.bfloat16)
        >>> with make():
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.bfloat16
        >>> make().run(torch.mm, torch.ones(2, 2), torch.ones(2, 2)).dtype  # traceable on 2.11
        torch.bfloat16
    """
    device = _device_type(device_type)
    return functools.partial(_Checked, device, autocast._resolve_dtype(dtype, device))


def _check_flags(enabled: Any, cache_enabled: Any) -> None:
    """torch only fails on these when entering; refuse them before anything is switched."""
    if not isinstance(enabled, bool):  # a string "False" must never mean enabled
        raise TypeError(f"enabled must be a bool, got {enabled!r}; valid: True, False")
    if cache_enabled is not None and not isinstance(cache_enabled, bool):
        raise TypeError(f"cache_enabled must be a bool or None, got {cache_enabled!r}; "
                        "valid: True, False, None")
