"""User op overrides: force a function to run in half, in fp32, or in its widest input dtype.

What torch.amp lacks (pytorch issue 49038) and apex.amp had. A registration replaces
``module.name`` by a casting wrapper only while an ``ampkit.autocast`` region is active
somewhere in the process, and the wrapper casts only in a thread whose innermost
ampkit.autocast region for the arguments' device type is enabled. With no active region
the original function is in place, so an override costs nothing outside autocast.
fp16, bf16 and fp32 tensor arguments (nested in lists, tuples and dicts too) are cast;
fp64 and non-float tensors keep their dtype, as under torch's autocast. torch's own switch
decides too: a ``torch.autocast(enabled=False)`` nested in the region turns the overrides
off, a nested ``torch.autocast(dtype=...)`` sets "half". ``out=`` and in-place methods
write into the caller's tensors. A staticmethod, classmethod or inherited attribute is
put back exactly as it was, and a value someone else set since (``mock.patch``) is kept.

Example:
    >>> import torch, ampkit
    >>> handle = ampkit.register_float_function(torch, "mm")
    >>> with ampkit.autocast("cpu", dtype=torch.bfloat16):
    ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
    torch.float32
    >>> handle.remove()
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar

import torch
from torch.amp.autocast_mode import autocast as _TorchAutocast  # not torch.autocast: see autocast.py

from ._checks import callable_choices
from ._op_calls import check_out, flag_set, inplace_flag, is_in_place, is_torch_op, write_out
from ._dtypes import cast_tree, iter_tensors
from ._torch_compat import get_autocast_dtype, graph_break, is_autocast_enabled, is_compiling

F = TypeVar("F", bound=Callable[..., Any])


class CastKind(str, enum.Enum):
    """How an overridden function's floating tensor arguments are cast."""

    HALF = "half"  # to the active autocast dtype (fp16 or bf16)
    FLOAT = "float"  # to fp32
    PROMOTE = "promote"  # to the widest floating dtype among the arguments


class _Frame(NamedTuple):
    device_type: str
    dtype: torch.dtype
    enabled: bool


class _Local(threading.local):
    def __init__(self) -> None:
        # (device_type, dtype, enabled, counted): counted in _open_regions (entered eagerly
        # and enabled)
        self.frames: list[tuple[str, torch.dtype, bool, bool]] = []


_local = _Local()
# Re-entrant: the garbage collector may run a finalizer that removes a registration (an
# object owning one, in a reference cycle) in a thread that holds it already.
_lock = threading.RLock()
# One entry per ampkit.autocast region open in the whole process. list.append and
# list.pop are atomic under the GIL, so entering costs no lock while nothing is
# registered; with registrations, install/uninstall decisions re-check under _lock.
_open_regions: list[None] = []
_installed = False
_registry: dict[tuple[int, str], "Registration"] = {}


# --- per-thread autocast frames (pushed and popped by ampkit.autocast) -------------------
def push_frame(device_type: str, dtype: torch.dtype, enabled: bool) -> None:
    """Enter an ampkit.autocast region in this thread (the first enabled one installs).

    A disabled region (``enabled=False``; each kept module's forward) only pushes this
    thread's frame: no override acts inside it, so nothing is put in place for it (a
    setattr per registration at every kept module's forward under O2). While
    torch.compile traces, only this thread's frame is pushed: dynamo would replay a write
    to the process-wide ``_open_regions`` after every call of the graph as the whole list
    it traced, erasing other threads' regions meanwhile, and it guards on module
    attributes it read, so nothing may be put in place either. Where registered
    overrides are not in place already (no region is open outside the compiled
    function), the graph breaks here, and the region is entered eagerly.
    """
    if not enabled:
        _local.frames.append((device_type, dtype, False, False))
        return
    if is_compiling():
        if _registry and not _installed:
            graph_break("ampkit.autocast: overrides are registered and must be put in place "
                        "here; enter the ampkit.autocast region outside the compiled function "
                        "to trace it whole (fullgraph=True)")
        _local.frames.append((device_type, dtype, enabled, False))
        return
    _local.frames.append((device_type, dtype, enabled, True))  # a plain tuple: cheapest to build
    _open_regions.append(None)
    if _registry:
        try:
            _sync_installed_locked()
        except BaseException:
            pop_frame()  # an override could not be put in place: this region never opened
            raise


def pop_frame() -> None:
    """Leave the innermost ampkit.autocast region of this thread."""
    if not _local.frames.pop()[3]:
        return  # disabled, or entered while dynamo traced: never counted
    _open_regions.pop()
    if _registry and not _open_regions:
        _sync_installed_locked()


def _sync_installed_locked() -> None:
    """_sync_installed under _lock: a concurrent last-region exit may be uninstalling.

    Left while dynamo traces (a region entered eagerly, before a graph break): taking the
    overrides out cannot be traced either (see :func:`push_frame`), so the graph breaks.
    """
    if is_compiling():
        if bool(_open_regions) != _installed:
            graph_break("ampkit.autocast: overrides are registered and must be taken out here")
        return
    with _lock:
        _sync_installed()


def _sync_installed() -> None:
    """Under _lock: overrides are in place exactly while some region is open."""
    global _installed
    want = bool(_open_regions)
    if want == _installed:
        return
    done: list[Registration] = []
    try:
        for reg in list(_registry.values()):  # a finalizer may remove one meanwhile
            if reg.registered():
                reg.put_in_place(want)
                if reg.registered():
                    done.append(reg)
                else:  # removed while it was being put in place: put back what it found
                    reg.put_in_place(False)
    except BaseException:
        for reg in done:  # all or none: never leave some overrides installed
            if reg.registered():
                reg.put_in_place(not want)
        raise
    _installed = want and bool(_registry)


def active_frame(device_type: Optional[str] = None) -> Optional[_Frame]:
    """This thread's innermost ampkit.autocast frame for ``device_type``, if it is enabled.

    Autocast state is per device type, as in torch: a region for another device type
    does not hide this one's. ``None``: the innermost frame of any device type.
    """
    frames = _local.frames
    if device_type is None:
        top = frames[-1] if frames else None
    else:
        top = next((f for f in reversed(frames) if f[0] == device_type), None)
    return _Frame(*top[:3]) if top is not None and top[2] else None


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the block without autocast or overrides: ops take their inputs' dtypes.

    Acts on every device type with an enabled ampkit.autocast region in this thread;
    elsewhere it does nothing.
    """
    devices = [d for d in dict.fromkeys(f[0] for f in _local.frames) if active_frame(d)]
    with contextlib.ExitStack() as stack:
        for device_type in devices:
            push_frame(device_type, _local.frames[-1][1], enabled=False)
            stack.callback(pop_frame)
            stack.enter_context(_TorchAutocast(device_type, enabled=False))
        yield


def open_frames() -> list[tuple[str, torch.dtype, bool]]:
    """This thread's ampkit.autocast frames, outermost first: (device type, dtype, enabled)."""
    return [frame[:3] for frame in _local.frames]


# --- casting --------------------------------------------------------------------------
# Only these are cast: float64 (and non-float) tensors keep their dtype, as under torch
# autocast, which leaves fp64 ops alone.
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return cast_tree(value, dtype, sources=_CASTABLE)


def _widest(args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    """torch's type promotion over the floating arguments (fp16 with bf16 gives fp32)."""
    widest = None
    for t in iter_tensors((args, kwargs)):
        if t.is_floating_point():
            widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    return widest


def _target_dtype(kind: CastKind, frame: _Frame, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    if kind is CastKind.HALF:
        return frame.dtype
    if kind is CastKind.FLOAT:
        return torch.float32
    return _widest(args, kwargs)


def _casting_wrapper(fn: F, kind: CastKind) -> F:
    in_place = is_in_place(fn)
    # F.relu(x, inplace=True) writes into x too (or F.relu(input=x, inplace=True)).
    inplace_at, target = inplace_flag(fn)
    # A half Python function of yours (a block, as apex's decorators wrapped) keeps
    # autocast on inside, so fp32 tensors it did not receive (its layers' weights) are
    # cast per op; a torch op (torch's own Python functions too: F.mse_loss), or anything
    # run in fp32 or promoted, runs with autocast off, so torch's own per-op cast cannot
    # undo the override.
    autocast_inside = kind is CastKind.HALF and not is_torch_op(fn)
    name = getattr(fn, "__name__", "function")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _local.frames:  # no region in this thread: the arguments are not even read
            return fn(*args, **kwargs)
        first = next(iter_tensors((args, kwargs)), None)
        frame = active_frame(None if first is None else first.device.type)
        # torch's own switch too: torch.autocast(enabled=False) nested inside an ampkit
        # region turns the overrides off as it does torch's casts.
        if frame is None or not is_autocast_enabled(frame.device_type):
            return fn(*args, **kwargs)
        if kind is CastKind.HALF:  # a nested torch.autocast(dtype=...) decides, as for ops
            frame = frame._replace(dtype=get_autocast_dtype(frame.device_type))
        out = kwargs.pop("out", None)
        dtype = _target_dtype(kind, frame, args, kwargs)
        if dtype is not None:
            # An in-place op writes into its own tensor, in that tensor's dtype.
            into = in_place or (inplace_at is not None and flag_set(args, kwargs, inplace_at))
            if into and args:
                args, kwargs = args[:1] + _cast(args[1:], dtype), _cast(kwargs, dtype)
            elif into and target in kwargs:
                kept = kwargs.pop(target)
                args, kwargs = _cast(args, dtype), {**_cast(kwargs, dtype), target: kept}
            else:
                args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
        if autocast_inside:
            result = fn(*args, **kwargs)
        else:
            with _TorchAutocast(frame.device_type, enabled=False):
                result = fn(*args, **kwargs)
        if out is None:
            return result
        check_out(name, result)
        return write_out(out, result)

    wrapper.__ampkit_original__ = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


# --- registration -----------------------------------------------------------------------
_MISSING = object()  # an attribute the module inherits: none of its own


def _own(module: Any, name: str) -> Any:
    """``module``'s own value of ``name`` (a staticmethod object, not its function), or
    _MISSING when the value is inherited (or the object keeps no ``__dict__``)."""
    try:
        return vars(module).get(name, _MISSING)
    except TypeError:  # no __dict__ (slots, builtins)
        return _MISSING


@dataclass
class Registration:
    """A registered override; ``remove()`` undoes it (tests use this to avoid leaks).

    ``raw``: the module's own attribute when registered (a staticmethod or classmethod
    object as it is; _MISSING when inherited), which ``remove()`` and every region exit
    put back exactly; ``original``: the function that runs; ``installed``: what a region
    puts in its place (the wrapper, as a staticmethod or classmethod where ``raw`` was).
    """

    module: Any
    name: str
    kind: CastKind
    original: Callable[..., Any]
    wrapper: Callable[..., Any]
    raw: Any = _MISSING
    installed: Any = None

    @classmethod
    def of(cls, module: Any, name: str, kind: CastKind) -> "Registration":
        raw = _own(module, name)
        if isinstance(raw, (staticmethod, classmethod)):
            original = raw.__func__
            wrapper = _casting_wrapper(original, kind)
            installed: Any = type(raw)(wrapper)
        else:
            original = raw if raw is not _MISSING else getattr(module, name)
            wrapper = installed = _casting_wrapper(original, kind)
        return cls(module, name, kind, original, wrapper, raw, installed)

    def put_in_place(self, installed: bool) -> None:
        """Set ``module.name`` to the wrapper (``installed``) or back to what it was.

        Someone else's value found there (a ``mock.patch`` made since) is respected: it
        is what the next region wraps, and a region's exit leaves a value it did not put.
        """
        current = _own(self.module, self.name)
        if installed:
            if current is not self.raw and current is not self.installed:
                self._rebase(current)
            setattr(self.module, self.name, self.installed)
        elif current is self.installed or (current is _MISSING and
                                           getattr(self.module, self.name, None) is self.wrapper):
            if self.raw is _MISSING:
                delattr(self.module, self.name)  # inherited again, as before
            else:
                setattr(self.module, self.name, self.raw)

    def _rebase(self, current: Any) -> None:
        fresh = Registration.of(self.module, self.name, self.kind)
        assert fresh.raw is current or current is _MISSING
        self.original, self.wrapper = fresh.original, fresh.wrapper
        self.raw, self.installed = fresh.raw, fresh.installed

    def registered(self) -> bool:
        """Whether this registration is in force (not removed, nor replaced)."""
        return _registry.get((id(self.module), self.name)) is self

    def remove(self) -> None:
        global _installed
        with _lock:
            if self.registered():
                del _registry[(id(self.module), self.name)]
                self.put_in_place(False)
            if not _registry:
                _installed = False  # nothing left in place; the next registration re-syncs


def _register(module: Any, name: str, kind: CastKind) -> Registration:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str naming a function of {module!r}, got {name!r}; "
                        "valid: the name of a callable attribute, e.g. 'mm' with torch")
    original = getattr(module, name, None)
    if original is None:
        raise ValueError(f"{_module_name(module)} has no attribute {name!r} to register as a "
                         f"{kind.value} function; {callable_choices(module, name, _module_name(module))}")
    if not callable(original):
        raise ValueError(f"{_module_name(module)}.{name} is not callable (a {type(original).__name__})")
    key = (id(module), name)
    with _lock:
        previous = _registry.get(key)
        if previous is not None:
            if previous.kind is kind:
                return previous  # the same registration again (setup run twice): as apex
            raise ValueError(f"{_module_name(module)}.{name} is already registered as a "
                             f"{previous.kind.value} function; call .remove() on that "
                             "registration (or ampkit.overrides.clear()) first")
        reg = Registration.of(module, name, kind)
        _check_installable(reg)
        _registry[key] = reg
        if _installed:
            reg.put_in_place(True)
        else:
            _sync_installed()
    return reg


def _check_installable(reg: Registration) -> None:
    """Put the wrapper in place and back, so that entering a region cannot fail on it."""
    cause: Optional[Exception] = None
    try:
        reg.put_in_place(True)
        took = getattr(reg.module, reg.name, None) in (reg.wrapper, reg.installed) or (
            isinstance(reg.installed, classmethod)
            and getattr(getattr(reg.module, reg.name, None), "__func__", None) is reg.wrapper)
        reg.put_in_place(False)
    except Exception as err:  # noqa: BLE001 - any refusal to be set (read-only, frozen, ...)
        took, cause = False, err
    if not took:
        why = f" ({cause})" if cause else " (the new value does not read back)"
        raise ValueError(f"cannot override {_module_name(reg.module)}.{reg.name}: its attribute "
                         f"{reg.name!r} cannot be reassigned{why}; valid: a module, class or "
                         "object whose attribute can be set, e.g. torch, torch.nn.functional"
                         ) from cause


def _module_name(module: Any) -> str:
    return getattr(module, "__name__", type(module).__name__)


def register_half_function(module: Any, name: str) -> Registration:
    """Run ``module.name`` in the active half dtype under ampkit.autocast."""
    return _register(module, name, CastKind.HALF)


def register_float_function(module: Any, name: str) -> Registration:
    """Run ``module.name`` in fp32 under ampkit.autocast."""
    return _register(module, name, CastKind.FLOAT)


def register_promote_function(module: Any, name: str) -> Registration:
    """Run ``module.name`` in the widest floating dtype of its arguments under ampkit.autocast."""
    return _register(module, name, CastKind.PROMOTE)


def registrations() -> list[Registration]:
    """Every override registered now."""
    with _lock:
        return list(_registry.values())


def clear() -> None:
    """Undo every registration."""
    for reg in registrations():
        reg.remove()


def half_function(fn: F) -> F:
    """Decorator: the function runs in the active half dtype under ampkit.autocast."""
    return _decorate(fn, CastKind.HALF, "half_function")


def float_function(fn: F) -> F:
    """Decorator: the function runs in fp32 under ampkit.autocast."""
    return _decorate(fn, CastKind.FLOAT, "float_function")


def promote_function(fn: F) -> F:
    """Decorator: the function runs in its arguments' widest floating dtype under ampkit.autocast."""
    return _decorate(fn, CastKind.PROMOTE, "promote_function")


def _decorate(fn: F, kind: CastKind, decorator: str) -> F:
    if isinstance(fn, staticmethod):  # above @staticmethod: decorate its function
        return staticmethod(_decorate(fn.__func__, kind, decorator))  # type: ignore[return-value]
    if not callable(fn):
        raise TypeError(f"{decorator}() needs a callable, got {type(fn).__name__} {fn!r}; "
                        f"valid: a function or other callable (@ampkit.{decorator} on a def)")
    return _casting_wrapper(fn, kind)
