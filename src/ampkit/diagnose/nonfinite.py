"""``watch``: which module first produced a non-finite output or gradient.

Cost model: per module output, input gradient and parameter gradient, one reduction
kernel (``aminmax``: both are finite exactly when every element is; of a sparse gradient,
over the values it stores) is launched and its two 0-dim results kept on the device; every
512 of them are folded, in a few kernels (outside any autocast region the caller opened,
so whatever their dtypes), into one int64 per module and phase: the position of its first
non-finite value. What a watch keeps does not grow with the block's length. Nothing is
read back to the host while the block runs; at exit one ``.item()`` reads which module
and phase came first: the one host sync.

Attribution: forward events are module outputs, in the order they were produced (a
child's before its parent's). Backward events are the gradients a module produces: those
of its own parameters and of its floating inputs, in the order autograd computes them.
An input shared by a module and its first child (``Block(x)`` calls ``self.fc(x)``) is
attributed to the innermost module that took it.
"""

from __future__ import annotations

import functools
import threading
from array import array
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .._dtypes import iter_tensors
from .._torch_compat import compiled_code_eager, sparse_values, tensor_version, uncompiled
from ._regions import autocast_off
from .numerics import dense_values

FORWARD, BACKWARD = "forward", "backward"
_PHASES = (FORWARD, BACKWARD)
_FOLD = 512  # 0-dim values kept before they are folded in (bounds the list)
_NONE = torch.iinfo(torch.int64).max  # a code's position while it has seen nothing non-finite
_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
            torch.complex32, torch.complex64, torch.complex128)  # complex: as (re, im) pairs
_NOT_EXITED = "the with block has not exited yet"


class NonFiniteError(RuntimeError):
    """A module's forward output or backward gradient became inf or NaN.

    Attributes:
        phase: "forward" or "backward".
        name: the module's name in ``model.named_modules()`` ("" for the model itself).
    """

    def __init__(self, phase: str, name: str, module_type: str) -> None:
        what = "output" if phase == FORWARD else "gradient (of its parameters or inputs)"
        super().__init__(f"module {name or '<model>'!r} ({module_type}) produced a non-finite "
                         f"{what} in the {phase} pass first; inspect it with "
                         "ampkit.diagnose.inspect(model, inputs, target, policy=...)")
        self.phase = phase
        self.name = name


class _Flags:
    """Where each event code first saw a non-finite value, kept on the device.

    Recorded values wait (with their codes, on the host) until ``_FOLD`` of them are folded
    into ``first``: per code (module index * 2 + phase index), the position of its first
    non-finite value among everything recorded, ``_NONE`` while it has none. What a watch
    keeps is so one integer per code, however long the block runs.
    """

    def __init__(self, codes: int) -> None:
        self._pending: list[Tensor] = []
        self._codes = array("i")  # one per pending value
        self._size = codes
        self._seen = 0  # values folded so far: the position of the next one
        self._first: Optional[Tensor] = None
        # Hooks fire in whichever thread runs the model (DataParallel's replicas share
        # them): the values and their codes change together, and fold, under this lock.
        self._lock = threading.Lock()

    def record(self, code: int, tensor: Tensor) -> None:
        if tensor.dtype not in _CHECKED:
            return
        if tensor.requires_grad:  # an output: no autograd node (it would keep it alive)
            tensor = tensor.detach()
        tensor = _stored_values(tensor)
        if tensor.numel() == 0:
            return
        if tensor.is_complex():  # finite exactly when both parts are (a view, no copy)
            tensor = torch.view_as_real(tensor.resolve_conj())
        # One reduction kernel, no sync: min and max are finite exactly when every element
        # is (NaN propagates, +inf shows in the max, -inf in the min). The inf-norm is one
        # kernel too but ~20x slower on CPU; a sum can overflow from finite values.
        low, high = torch.aminmax(tensor)
        with self._lock:
            self._pending += (low, high)
            self._codes.extend((code, code))
            if len(self._pending) >= _FOLD:
                self._fold()

    def _fold(self) -> None:
        """Under the lock: the pending values into ``first``, a few kernels, no sync."""
        if not self._pending:
            return
        count = len(self._pending)
        # Outside any autocast region: under the caller's bf16 region, stack (an op
        # autocast promotes) refuses an fp16 value; outside, mixed dtypes promote (a
        # widening cast keeps inf and NaN).
        with autocast_off():
            finite = torch.stack(self._pending).isfinite()
            device = finite.device
            codes = _on_device(torch.frombuffer(self._codes, dtype=torch.int32), device)
            at = torch.arange(self._seen, self._seen + count, device=device)
            if self._first is None:
                self._first = torch.full((self._size,), _NONE, dtype=torch.int64, device=device)
            self._first.scatter_reduce_(0, codes, at.masked_fill(finite, _NONE), reduce="amin")
        self._seen += count
        self._pending.clear()
        self._codes = array("i")

    @property
    def count(self) -> int:
        """Values recorded so far (two per event)."""
        return self._seen + len(self._pending)

    def first(self) -> Optional[Tensor]:
        """Per code, the position of its first non-finite value (``_NONE``: none), still on
        the device; None when nothing was recorded."""
        with self._lock:
            self._fold()
            return self._first


def _on_device(codes: Tensor, device: torch.device) -> Tensor:
    """The host's int32 codes as int64 on ``device``, without a host sync: a CUDA copy
    goes from pinned memory, asynchronously (a pageable one would wait for the stream)."""
    codes = codes.long()  # a copy: the array they view is reused
    if device.type == "cuda":
        return codes.pin_memory().to(device, non_blocking=True)
    return codes.to(device)


class _Hook(functools.partial):
    """One of watch's hooks (a partial of its method). A copy of the model (``deepcopy``,
    pickle: inspect's and autotune's copies) gets a hook that does nothing instead: it
    neither drags the watch along (its lock cannot be copied) nor reports into it."""

    def __deepcopy__(self, memo: dict) -> Any:
        return _ignore

    def __reduce__(self) -> Any:
        return _ignored, ()


def _ignore(*args: Any, **kwargs: Any) -> None:
    """What a copied watch hook does: nothing."""


def _ignored() -> Any:
    return _ignore


class Watch:
    """The context manager :func:`watch` returns; read ``first_nonfinite`` after exit."""

    def __init__(self, model: nn.Module, *, raise_on_nonfinite: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch takes a torch.nn.Module, got {type(model).__name__} {model!r}")
        if not isinstance(raise_on_nonfinite, bool):
            raise TypeError(f"raise_on_nonfinite must be True or False, got {raise_on_nonfinite!r}")
        model = uncompiled(model)  # torch.compile(model): its modules, by their own names
        self._model = model
        self._raise = raise_on_nonfinite
        self._named = list(model.named_modules())
        self._params = _owned_params(self._named)
        self._handles: list[RemovableHandle] = []
        self._flags = _Flags(2 * len(self._named))
        self._cells: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._open = False
        self._first: Any = _NOT_EXITED
        self._eager: Any = None  # compiled_code_eager() while open

    @property
    def first_nonfinite(self) -> Optional[tuple[str, str]]:
        """None, or (phase, name) of the first non-finite event; read after exit."""
        if self._first is _NOT_EXITED:
            raise RuntimeError("watch(...).first_nonfinite is known once the with block has "
                               "exited (it is read from the device then, in one sync)")
        return self._first

    def __enter__(self) -> "Watch":
        if self._open:
            raise RuntimeError("this watch is already open; valid: one with block at a time")
        self._flags = _Flags(2 * len(self._named))
        self._cells, self._first = WeakIdKeyDictionary(), _NOT_EXITED
        # Compiled code would skip hooks added after it compiled: it runs eagerly here.
        self._eager = compiled_code_eager()
        self._eager.__enter__()
        try:
            self._handles = self._install()
        except BaseException:
            self._eager.__exit__(None, None, None)
            raise
        self._open = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._open = False
        try:
            self._eager.__exit__(None, None, None)
            self._first = self._read_first()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
        if self._raise and self._first is not None and exc_type is None:
            phase, name = self._first
            raise NonFiniteError(phase, name, type(self._model.get_submodule(name)).__name__)

    def nonfinite(self) -> list[tuple[str, str]]:
        """Every (phase, name) that saw a non-finite value, in the order of their first
        non-finite values, each once.

        Reads the per-code positions back: one more host sync (diagnostics, not per step).
        """
        first = self._flags.first()
        if first is None:
            return []
        positions = first.tolist()  # host sync
        found = sorted((at, code) for code, at in enumerate(positions) if at != _NONE)
        return [self._event(code) for _, code in found]

    def _read_first(self) -> Optional[tuple[str, str]]:
        first = self._flags.first()
        if first is None:
            return None
        # Positions are unique, so the smallest names one code; -1 when there is none.
        code = torch.where(first.min() != _NONE, first.argmin(), -1)
        index = int(code.item())  # the one host sync
        return None if index < 0 else self._event(index)

    def _event(self, code: int) -> tuple[str, str]:
        return _PHASES[code % 2], self._named[code // 2][0]

    def _install(self) -> list[RemovableHandle]:
        """Register every hook. The callables hold ``self``; only the hook dicts hold them,
        so removing the hooks at exit leaves no reference cycle for the GC to collect."""
        handles = []
        for index, (_, module) in enumerate(self._named):
            handles.append(module.register_forward_pre_hook(
                _Hook(self._on_inputs, index), with_kwargs=True))
            handles.append(module.register_forward_hook(_Hook(self._on_output, index)))
        for param, code in self._params:
            handles.append(param.register_hook(_Hook(self._on_grad, code)))
        return handles

    def _on_output(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        # Also a container returning its child's output: in-place ops in between
        # (``out += identity``) would otherwise go unseen.
        if self._open:
            for tensor in iter_tensors(output):
                self._flags.record(2 * index, tensor)

    def _on_grad(self, code: int, grad: Tensor) -> None:
        if self._open:
            self._flags.record(code, grad)

    def _on_input_grad(self, cell: list[int], grad: Tensor) -> None:
        if self._open:
            self._flags.record(2 * cell[0] + 1, grad)

    def _inside(self, index: int, outer: int) -> bool:
        """Whether module ``index`` is inside module ``outer`` (by name).

        The same tensor reaching a module that is not inside the last one to take it was
        modified in place in between (``ReLU(inplace=True)``): it gets a hook of its own.
        """
        outer_name = self._named[outer][0]
        return outer_name == "" or self._named[index][0].startswith(outer_name + ".")

    def _on_inputs(self, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._open:
            return
        for tensor in iter_tensors((args, kwargs)):
            if not (tensor.requires_grad and tensor.dtype in _CHECKED):
                continue
            cell = self._cells.get(tensor)
            if cell is not None and self._inside(index, cell[0]):
                cell[0] = index  # an outer module took it first: the inner one owns it
                continue
            leaf = tensor.grad_fn is None
            if (cell is not None and cell[0] == index
                    and (leaf or cell[1] == tensor_version(tensor))):
                # The same module takes it again (a learned query passed in every step,
                # the same batch): its hook is there already. A leaf's hook sees every
                # backward; an intermediate changed in place since needs one of its own.
                continue
            cell = [index, tensor_version(tensor)]
            self._cells[tensor] = cell
            hook = tensor.register_hook(_Hook(self._on_input_grad, cell))
            if leaf:  # removed at exit (a leaf input, say the user's x, would keep it)
                self._handles.append(hook)
            # (a hook left on an intermediate's graph node goes with it, a no-op once closed)


def _stored_values(tensor: Tensor) -> Tensor:
    """The values a sparse tensor stores (a sparse gradient: nn.Embedding(sparse=True));
    the tensor itself when it is dense; a nested tensor's values, flat. Its implicit zeros
    are finite."""
    if tensor.is_nested:
        return dense_values(tensor)
    if tensor.layout == torch.strided:
        return tensor
    if tensor.layout == torch.sparse_coo:
        # The stored values even uncoalesced (values() would need a coalesce, a sort
        # and, on CUDA, a host sync); a duplicate index is checked per entry.
        return sparse_values(tensor)
    return tensor.values()  # compressed layouts (CSR, CSC, BSR, BSC)


def _owned_params(named: list[tuple[str, nn.Module]]) -> list[tuple[nn.Parameter, int]]:
    """(parameter, backward event code) for each trainable parameter, owned by the first
    module that has it (a shared one is reported once)."""
    owner: dict[int, tuple[nn.Parameter, int]] = {}
    for index, (_, module) in enumerate(named):
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in owner:
                owner[id(param)] = (param, 2 * index + 1)
    return list(owner.values())


def watch(model: nn.Module, *, raise_on_nonfinite: bool = False) -> Watch:
    """Record, on the device, the first module whose output or gradient becomes non-finite.

    Args:
        model: the model to watch (every submodule, the model itself included).
        raise_on_nonfinite: the exit raises :class:`NonFiniteError` naming the module and
            the phase when one was found (not when the block itself raised).

    Returns:
        A context manager; its ``first_nonfinite`` is None or ("forward"|"backward",
        name), read after exit. Hooks are removed at exit, also when the block raises.
        Inside the block torch.compile'd code runs eagerly (torch 2.6+), so that every
        module's hooks fire; ``watch(torch.compile(model))`` names the model's modules.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> with watch(model) as w:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> w.first_nonfinite is None
        True
    """
    return Watch(model, raise_on_nonfinite=raise_on_nonfinite)
