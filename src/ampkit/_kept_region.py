"""The fp32 region of one kept module (``keep_fp32``) and the forward installed on it.

Eagerly, a forward pre-hook turns autocast off and a forward hook turns it back on. While
torch.compile traces, that split region is a ``with torch.autocast(device, enabled=False)``
statement around the module's forward instead (``module.forward``, a wrapper installed
with the hooks, which passes calls straight through eagerly): dynamo cannot reconcile
switches set in one hook and undone in another with a ``torch.autocast`` region of the
compiled function (torch 2.13: "Global autocast state changed while dynamo tracing"; 2.11:
the switches are untraceable, so fullgraph=True raised and every call broke the graph),
and every dynamo traces torch's own class in a with statement.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
# Bound at import: code that sets ``torch.autocast = ampkit.autocast`` must not send the
# compiled region back into ampkit's switches (see autocast.py).
from torch.amp.autocast_mode import autocast as _TorchAutocast

from ._dtypes import HALF_DTYPES, cast_tensor, cast_tree, has_autocast, iter_tensors
from ._torch_compat import is_compiling
from .autocast import autocast
from .convert import BoundForward


class _Stacks(threading.local):
    """Per thread: the open fp32 regions of one kept module (recursive calls nest)."""

    def __init__(self) -> None:
        self.stack: list[tuple[Any, Optional[torch.dtype]]] = []


class Fp32Region:
    """Autocast off for one module's forward, fp32 inputs; per-thread stack (recursion).

    ``traced_by_forward``: while dynamo traces, the module's :class:`KeptForward` is the
    region (False for a model pickled before it had one: the hooks stay the region).
    ``around``: a parameter of the model around the module that a policy cast to half
    (None: none), whose dtype outputs computed from no floating input go back to
    (:func:`ampkit.keep.follow_conversion`).
    """

    def __init__(self, traced_by_forward: bool = False,
                 around: Optional[torch.Tensor] = None) -> None:
        self._local = _Stacks()
        self.traced_by_forward = traced_by_forward
        self.around = around

    def __getstate__(self) -> dict:
        # Open regions belong to this process's threads.
        return {"traced_by_forward": self.traced_by_forward, "around": self.around}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("traced_by_forward", False),  # type: ignore[misc]
                      state.get("around"))

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        device = _device_type(module, args)
        # Made with the thread's local (no hasattr: a graph guarded on its absence at the
        # first call compiled again at the second).
        stack = self._local.stack
        autocasting = has_autocast(device) and torch.is_autocast_enabled(device)
        # Outside autocast (a half O2/O3 model), the outputs go back to the half dtype
        # around the module (see _restore_dtype).
        restore = None if autocasting else self._restore_dtype((args, kwargs))
        if not _runs_fp32(module) or (not autocasting and restore is None):
            # Cast since keep_fp32 (model.to(dtype), .half()), or no region and no half
            # around (an fp32 or fp64 model, the meta device): the module's forward runs
            # as it would without keep_fp32.
            stack.append((None, None))
            return args, kwargs
        region = None
        if not (self.traced_by_forward and is_compiling()):
            region = autocast(device, enabled=False)
            region.__enter__()
        stack.append((region, restore))
        return _fp32(args), (cast_tree(kwargs, torch.float32) if kwargs else kwargs)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._local.stack
        if not stack:
            return output
        region, restore = stack.pop()
        if region is not None:
            region.__exit__(None, None, None)
        return output if restore is None else cast_tree(output, restore)

    def _restore_dtype(self, inputs: Any) -> Optional[torch.dtype]:
        """The half dtype outputs go back to outside autocast: the first half input's (one
        given by keyword counts: ``block(hidden_states=h)``); with no floating input at all
        (token ids into a kept embedding), the dtype of the half model around; else none."""
        floating = False
        for tensor in iter_tensors(inputs):
            if tensor.dtype in HALF_DTYPES:
                return tensor.dtype
            floating = floating or tensor.is_floating_point()
        around = None if floating or self.around is None else self.around.dtype
        return around if around in HALF_DTYPES else None


class KeptForward(BoundForward):
    """``module.forward`` of a kept module: the forward it had, called as is eagerly (the
    hooks of :class:`Fp32Region` are the region); while dynamo traces, inside ``with
    torch.autocast(device, enabled=False)`` where autocast is on (see the module docstring).

    Shaped like a bound method (:class:`ampkit.convert.BoundForward`), as ampkit's
    converted forward is.
    It holds the module weakly (no reference cycle) and pickles and deep-copies with it.
    """

    def __init__(self, module: nn.Module, inner: Optional[Callable[..., Any]]) -> None:
        self._module = weakref.ref(module)
        self.inner = inner  # the module's own ``forward`` attribute before (None: its class's)
        self.active = True  # False once removed while someone's wrapper holds it

    def __getstate__(self) -> dict:
        return {"module": self._module(), "inner": self.inner, "active": self.active}

    def __setstate__(self, state: dict) -> None:
        self._module = weakref.ref(state["module"])
        self.inner, self.active = state["inner"], state["active"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if is_compiling() and self.active:
            return _traced_forward(self, module, args, kwargs)
        return _inner_forward(self, module, args, kwargs)  # eagerly the hooks are the region

    def remove(self) -> None:
        """Put back the forward the module had, unless someone wrapped this one since
        (then it stays inside theirs and passes calls through)."""
        self.active = False
        module = self._module()
        if module is None or module.__dict__.get("forward") is not self:
            return
        if self.inner is None:
            del module.__dict__["forward"]
        else:
            module.forward = self.inner  # type: ignore[method-assign]

    def _inner(self) -> Optional[Callable[..., Any]]:
        return self.inner

    @property
    def __func__(self) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _kept_forward(self, module, args, kwargs)
        return forward

    def __repr__(self) -> str:
        return f"<ampkit keep_fp32 forward of {type(self.__self__).__name__}>"


def _kept_forward(kept: KeptForward, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """What ``kept`` does for ``module`` (``kept.__func__``; ``kept()`` inlines it)."""
    if is_compiling() and kept.active:
        return _traced_forward(kept, module, args, kwargs)
    return _inner_forward(kept, module, args, kwargs)


def _inner_forward(kept: KeptForward, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    if kept.inner is not None:
        return kept.inner(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _traced_forward(kept: KeptForward, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The forward while dynamo traces: autocast off in a with statement where it is on
    (the pre-hook already cast the inputs), with the dtype the eager region sets.

    No ampkit frame is pushed: registered overrides follow torch's switch (off here, as in
    the eager region), and pushing one where overrides are registered but not in place
    would break the graph (overrides.push_frame).
    """
    device = _device_type(module, args)
    if not (has_autocast(device) and torch.is_autocast_enabled(device) and _runs_fp32(module)):
        return _inner_forward(kept, module, args, kwargs)
    dtype = autocast(device, enabled=False).fast_dtype  # what the eager region sets
    with _TorchAutocast(device, dtype, enabled=False):
        return _inner_forward(kept, module, args, kwargs)


def _fp32(args: tuple) -> tuple:
    """``args`` with its floating tensors fp32 (``cast_tree``; tensor-only calls, the
    usual ones, without its walk)."""
    if all(arg.__class__ is torch.Tensor for arg in args):
        return tuple(cast_tensor(arg, torch.float32) if arg.is_floating_point()
                     and arg.dtype != torch.float32 else arg for arg in args)
    return cast_tree(args, torch.float32)


def _device_type(module: nn.Module, args: tuple) -> str:
    for tensor in iter_tensors(args):
        return tensor.device.type
    for param in module.parameters():
        return param.device.type
    return "cpu"


def _runs_fp32(module: nn.Module) -> bool:
    """Whether a kept module's region applies: its floating parameters are fp32 (or it has
    none). Cast since keep_fp32 (``model.to(dtype)``, ``.half()``, ``.double()``, the last
    thing the user asked for), it runs as it would without keep_fp32; ``.float()`` makes
    it kept again. Its first floating parameter decides (those casts and ``initialize``
    cast all of them); without one, its first floating buffer (a buffer table)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype == torch.float32
    return True
