"""Every private or version-dependent torch API ampkit uses, in one place (STYLE rule 14).

A torch release that moves or changes one of these breaks one line here, and
``tests/test_torch_compat.py`` says which entry and on which torch. Each entry carries a
comment: what ampkit uses it for, and the torch release it exists since (or the newest
release known to lack it). Public, stable APIs (``torch.autocast``,
``torch.amp.GradScaler``, ``nn.Module.register_forward_hook``...) have no entry.

Version guards follow Lightning's ``_TORCH_GREATER_EQUAL_2_x``: ``TORCH_GE_2_12`` is True
on torch 2.12 and later. The floor, ``TORCH_FLOOR``, is the oldest torch the suite passes
on (``benchmarks/check_torch_versions.sh`` runs it there); ``pyproject.toml`` declares the
same, and importing ampkit on an older torch fails here with an ImportError that says so.

Entries used on a hot path (the autocast switches) are torch's own functions bound at
import, so calling them through this module costs less than ``torch.<name>`` does.
An entry missing from the installed torch does not break ``import ampkit``: it is
bound to a stub that raises a RuntimeError naming it when called.

Example:
    >>> from ampkit import _torch_compat as tc
    >>> tc.TORCH_VERSION >= tc.TORCH_FLOOR
    True
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import importlib
import re
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.amp.autocast_mode import autocast as _TorchAutocast  # bound once: see autocast.py
from torch.utils.hooks import RemovableHandle

# Version guards and helpers, then the entries: tests/test_torch_compat.py checks each entry.
__all__ = [
    "TORCH_VERSION", "TORCH_FLOOR", "TORCH_GE_2_12", "TORCH_PATHS", "parse_version",
    "check_floor", "resolve",
    # autocast
    "is_autocast_enabled", "set_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype",
    "is_autocast_cache_enabled", "set_autocast_cache_enabled", "autocast_increment_nesting",
    "autocast_decrement_nesting", "clear_autocast_cache", "is_torch_function_mode_enabled",
    "privateuse1_backend_name", "resolve_autocast",
    # compile and dispatch modes
    "is_compiling", "functorch_active", "graph_break", "checkpoint_call", "CheckpointCall", "dynamo_reset", "tensor_version", "import_dynamo", "TorchDispatchMode", "EagerDispatchMode", "seeded_random", "aten_to_copy", "cpu_attention", "cpu_attention_backward", "rnn_layer",
    "rnn_layer_backward", "trilinear",
    "unsafe_view", "uncompiled", "compiled_code_eager", "compile_tracing",
    # tensor subclasses (fp8 all-gather)
    "make_wrapper_subclass", "disabled_torch_function_impl", "tree_map_only", "tree_leaves",
    "op_mutates",
    # loss scaling and optimizers
    "group_tensors_by_device_and_dtype", "amp_foreach_non_finite_check_and_unscale_",
    "amp_update_scale_", "foreach_copy_", "foreach_add_", "foreach_mul_", "unflatten_dense_tensors",
    "sparse_values", "OptState",
    "STEP_SUPPORTS_AMP_SCALING", "register_optimizer_step_pre_hook", "Event",
    "LR_SCHEDULER_MARK", "LR_SCHEDULER_STEP_CALLED", "optimizer_step_function", "ddp_ignore",
    # nn.Module internals
    "register_state_dict_pre_hook", "register_state_dict_post_hook",
    "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
    "swaps_params_on_load", "local_parameters",
    "local_buffers", "local_modules", "move_hooks", "AfterApply", "BatchNormBase",
    # distributed
    "fsdp2",
    # fp8 and hardware
    "scaled_mm", "cpu_capabilities",
]

# --- versions -----------------------------------------------------------------------------


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.5.1+cu124" and "2.6.0a0+git1" give (2, 5), (2, 6)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}; valid: "
                         "'MAJOR.MINOR[.PATCH][+local]', e.g. '2.5.1+cu124'")
    return int(match[1]), int(match[2])


TORCH_VERSION: tuple[int, int] = parse_version(torch.__version__)
# The oldest torch the whole suite passes on (benchmarks/check_torch_versions.sh); the
# state-dict hooks of O2/O3 (register_state_dict_post_hook, ...) are public from 2.5 only.
TORCH_FLOOR: tuple[int, int] = (2, 5)
# torch.autocast(...)(x) raises TypeError for a non-callable x (pytorch#172178); 2.11 does not.
TORCH_GE_2_12: bool = TORCH_VERSION >= (2, 12)


def check_floor(version: str) -> None:
    """Raise ImportError when ``version`` is older than the torch ampkit supports."""
    if parse_version(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"ampkit needs torch>={floor}, but torch {version} is installed; "
                          f"valid: torch {floor} or newer (pip install 'torch>={floor}')")


check_floor(torch.__version__)

# --- resolving entries ----------------------------------------------------------------------
# Every dotted torch path bound below, for the test that each still exists.
TORCH_PATHS: list[str] = []


def _missing(path: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"ampkit needs {path}, which torch {torch.__version__} does not have; "
                           f"valid: torch {'.'.join(map(str, TORCH_FLOOR))} or newer with it "
                           "(tests/test_torch_compat.py names every such entry)")
    stub.__ampkit_missing__ = path  # type: ignore[attr-defined]
    return stub


def resolve(path: str) -> Any:
    """The object at a dotted torch path ("torch._C._foo"), or None when it is not there."""
    module_name, _, rest = path.partition(".")
    obj: Any = importlib.import_module(module_name)
    for part in rest.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not isinstance(obj, types.ModuleType):
                return None
            try:  # a submodule not imported yet (torch.utils._python_dispatch)
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                return None
    return obj


def _entry(path: str) -> Any:
    """torch's object at ``path``, recorded for the test; a raising stub when it is missing."""
    TORCH_PATHS.append(path)
    obj = resolve(path)
    return _missing(path) if obj is None else obj


# --- autocast: the switches torch.autocast.__enter__/__exit__ set ----------------------------
# ampkit.autocast sets them itself (no per-call setup), exactly as torch's __enter__ does.
# Device-type forms (first argument "cpu"/"cuda"/...) since 2.4; the rest since 1.10.
is_autocast_enabled = _entry("torch.is_autocast_enabled")  # (device_type) -> bool; 2.4
set_autocast_enabled = _entry("torch.set_autocast_enabled")  # (device_type, bool); 2.4
get_autocast_dtype = _entry("torch.get_autocast_dtype")  # (device_type) -> dtype; 2.4
set_autocast_dtype = _entry("torch.set_autocast_dtype")  # (device_type, dtype); 2.4
is_autocast_cache_enabled = _entry("torch.is_autocast_cache_enabled")  # weight-cast cache on?; 1.10
set_autocast_cache_enabled = _entry("torch.set_autocast_cache_enabled")  # (bool); 1.10
autocast_increment_nesting = _entry("torch.autocast_increment_nesting")  # -> new depth; 1.10
autocast_decrement_nesting = _entry("torch.autocast_decrement_nesting")  # -> new depth; 1.10
clear_autocast_cache = _entry("torch.clear_autocast_cache")  # drop cached weight casts; 1.10
# Tracing (torch.export non-strict, make_fx) runs under a torch-function mode; ampkit then
# lets torch.autocast record the region. Since 2.0.
is_torch_function_mode_enabled = _entry("torch._C._is_torch_function_mode_enabled")
# The privateuse1 backend's name, which torch.autocast instances carry; since 2.1.
privateuse1_backend_name = _entry("torch._C._get_privateuse1_backend_name")


def resolve_autocast(device_type: str, dtype: torch.dtype, enabled: bool) -> tuple[bool, torch.dtype]:
    """What torch.autocast makes of these arguments: its private ``_enabled`` and ``fast_dtype``.

    torch disables itself (and warns) for CUDA without a GPU or a dtype the device lacks,
    and raises for bf16 on a CUDA device without it. Both attributes since 1.10.
    """
    reference = _TorchAutocast(device_type, dtype=dtype, enabled=enabled)
    return reference._enabled, reference.fast_dtype


# --- autograd ------------------------------------------------------------------------------
def tensor_version(tensor: Tensor) -> int:
    """``tensor._version``: autograd's count of in-place writes to it (every release)."""
    return tensor._version


# The innermost saved-tensors hooks (pack, unpack), or None; private. Absent in 2.5 (there
# checkpoint_phase answers None), there in 2.11 and 2.13 (taking ignore_is_tracing).
_TOP_HOOKS = resolve("torch._C._autograd._top_saved_tensors_default_hooks")
if TORCH_VERSION >= (2, 11):
    TORCH_PATHS.append("torch._C._autograd._top_saved_tensors_default_hooks")
# torch.utils.checkpoint's hook classes (non-reentrant), named by their pack hooks, the
# object each checkpointed call keeps its state in, and the id of the running backward.
_CHECKPOINT_PHASES = {"_checkpoint_hook": "forward", "_recomputation_hook": "recompute"}
_CHECKPOINT_FRAME = _entry("torch.utils.checkpoint._CheckpointFrame")
_graph_task_id = _entry("torch._C._current_graph_task_id")


class CheckpointCall(NamedTuple):
    """Where code runs inside a non-reentrant ``torch.utils.checkpoint``: ``phase``
    "forward" or "recompute", ``frame`` the checkpointed call's own object (one per
    call, freed with its graph; weak-referenceable) and ``backward`` the id of the
    backward that recomputes (-1 in the forward)."""

    phase: str
    frame: Any
    backward: int


def checkpoint_call() -> Optional[CheckpointCall]:
    """The non-reentrant checkpoint this code runs in, else None (also while compiling,
    under saved-tensors hooks of the code's own inside it, and on torch without a view
    of the hooks). Private torch: the hooks' class names and the frame they close over,
    both checked by the test of this module."""
    if _TOP_HOOKS is None or is_compiling():
        return None
    try:
        hooks = _TOP_HOOKS(False)
    except TypeError:  # before ignore_is_tracing
        hooks = _TOP_HOOKS()
    if hooks is None:
        return None
    phase = _CHECKPOINT_PHASES.get(getattr(hooks[0], "__qualname__", "").split(".")[0])
    frame = None if phase is None else _closed_over_frame(hooks[0], 0)
    if frame is None:
        return None
    return CheckpointCall(phase, frame, _graph_task_id())


def _closed_over_frame(fn: Any, depth: int) -> Any:
    """The ``_CheckpointFrame`` a pack hook closes over (itself or through a weakref),
    looking through wrappers (``torch._dynamo.disable`` wraps the recomputation's)."""
    if isinstance(fn, _CHECKPOINT_FRAME):
        return fn
    if isinstance(fn, weakref.ref):
        target = fn()
        return target if isinstance(target, _CHECKPOINT_FRAME) else None
    if depth > 3 or not isinstance(fn, types.FunctionType):
        return None
    for cell in fn.__closure__ or ():
        try:
            found = _closed_over_frame(cell.cell_contents, depth + 1)
        except ValueError:  # an empty cell
            continue
        if found is not None:
            return found
    wrapped = getattr(fn, "__wrapped__", None)
    return None if wrapped is None else _closed_over_frame(wrapped, depth + 1)


# --- compile -------------------------------------------------------------------------------
# True while dynamo traces (torch.compile, strict torch.export); public since 2.3.
is_compiling = _entry("torch.compiler.is_compiling")
# Whether a torch.func transform (vmap, grad, jacrev, ...) is running; the flag
# autograd.Function reads itself; since 2.0.
functorch_active = _entry("torch._C._are_functorch_transforms_active")
# Forget every compiled graph: each benchmarked policy compiles afresh; since 2.0.
TORCH_PATHS.append("torch._dynamo.reset")


def dynamo_reset() -> None:
    """``torch._dynamo.reset()``, imported on first use: importing dynamo takes seconds."""
    import torch._dynamo

    torch._dynamo.reset()


# Force a graph break (2.0). Its msg= argument: checked in 2.11 and 2.13, absent in 2.5;
# the releases between are not checked, so they get no message (the calling line shows).
TORCH_PATHS.append("torch._dynamo.graph_break")
_GRAPH_BREAK_TAKES_MSG = TORCH_VERSION >= (2, 11)


def graph_break(reason: str) -> None:
    """Break dynamo's graph here; called only while it traces, so dynamo is imported.

    The reason shows in the error under ``fullgraph=True`` (torch >= 2.11 takes it; 2.5's
    ``graph_break`` takes no message, and the error shows the calling line instead).
    """
    if _GRAPH_BREAK_TAKES_MSG:
        torch._dynamo.graph_break(msg=reason)
    else:
        torch._dynamo.graph_break()


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now rather than in the first optimizer's constructor, which
    imports it (seconds) through torch's disable-dynamo decorator: bench workers forked
    after this share the import."""
    importlib.import_module("torch._dynamo")


def compile_tracing() -> bool:
    """Whether torch.compile is tracing here, its AOT stage included (a tracing context is
    set), where torch calls a checkpoint's ``context_fn`` again with ``is_compiling()``
    False on torch 2.11; not a user's own FakeTensorMode in eager code.
    ``torch._guards.TracingContext.try_get``, since 2.1."""
    guards = sys.modules.get("torch._guards")
    context = getattr(guards, "TracingContext", None)
    return context is not None and context.try_get() is not None


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` wrapped (its ``_orig_mod``), or ``module``.

    Without torch._dynamo imported nothing was compiled: it is not imported for this."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    while wrapper is not None and isinstance(module, wrapper):
        module = module._orig_mod
    return module


class _EagerStance:
    """The process-wide "force_eager" stance, held while any compiled_code_eager region is
    open (in any thread): the stance is process-wide, so regions that close out of order
    (two threads, two watches) must not restore each other's saved stance."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.held: Any = None  # the set_stance object whose exit restores the stance before

    def enter(self, set_stance: Callable[..., Any]) -> None:
        with self.lock:
            if self.depth == 0:
                self.held = set_stance("force_eager")  # sets it now; its exit restores
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                held, self.held = self.held, None
                held.__exit__(None, None, None)


_eager_stance = _EagerStance()


@contextlib.contextmanager
def compiled_code_eager() -> Iterator[None]:
    """torch.compile'd code runs eagerly inside (``set_stance("force_eager")``, torch 2.6+),
    in every thread of the process while any such region is open: hooks registered after
    it compiled fire (dynamo does not recompile for them), and nothing compiles. Nothing to
    do where torch._dynamo was never imported, nor on torch 2.5, which has no stance (its
    compiled code skips later hooks)."""
    dynamo = sys.modules.get("torch._dynamo")
    set_stance = getattr(dynamo, "set_stance", None)
    if set_stance is None or is_compiling():
        yield
        return
    _eager_stance.enter(set_stance)
    try:
        yield
    finally:
        _eager_stance.leave()


# Base class of the op counters in tests and benchmarks/bench_host.py; since 2.0.
TorchDispatchMode = _entry("torch.utils._python_dispatch.TorchDispatchMode")


class EagerDispatchMode(TorchDispatchMode):  # type: ignore[misc,valid-type]
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` torch leaves unwrapped.

    torch 2.11+ wraps a subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``
    unless its private classmethod ``_should_skip_dynamo()`` says False; the wrapper
    imports torch._dynamo on first use (seconds, once per process). For modes that only
    see eager code (diagnose.FlopCounter). torch 2.5 has no such hook and wraps nothing.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def seeded_random(func: Any) -> bool:
    """Whether an aten op draws from a random-number generator (its ``nondeterministic_seeded``
    tag: ``bernoulli_``, ``randn``, ``normal_``, ``native_dropout``...); torch 2.0 and later."""
    return torch.Tag.nondeterministic_seeded in func.tags


# The aten op ``.to(dtype)`` dispatches to (a dispatch mode sees fp8 widened to fp32); 1.10.
aten_to_copy = _entry("torch.ops.aten._to_copy.default")
# CPU kernels torch's flop_registry has no formula for (torch 2.13): flash attention on the
# CPU and oneDNN's RNN layer, forward and backward. Private ops; in every supported release.
cpu_attention = _entry("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu")
cpu_attention_backward = _entry(
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward")
rnn_layer = _entry("torch.ops.aten.mkldnn_rnn_layer")
rnn_layer_backward = _entry("torch.ops.aten.mkldnn_rnn_layer_backward")
# nn.Bilinear's kernel (F.bilinear, forward and backward), with no flop_registry formula
# either: (i1, i2, i3, expand1, expand2, expand3, sumdim, ...); private, in every release.
trilinear = _entry("torch.ops.aten._trilinear")
# (tensor, shape): a reshape whose result is not a view, as torch's linear and matmul return
# theirs (Float8Linear's output: FSDP2 hooks module outputs, which views would lose); 1.0.
unsafe_view = _entry("torch.ops.aten._unsafe_view.default")

# --- tensor subclasses: fp8/allgather.py's FSDP2 all-gather extension --------------------------
# (cls, size, strides=, storage_offset=, dtype=, layout=, device=, requires_grad=): a tensor
# of ``cls`` with that metadata and no storage of its own; the base of every wrapper
# subclass (torchao's, DTensor's); since 1.12.
make_wrapper_subclass = _entry("torch.Tensor._make_wrapper_subclass")
# A subclass's ``__torch_function__`` that turns torch-function dispatch off, so every op
# goes straight to its ``__torch_dispatch__``; since 1.7.
disabled_torch_function_impl = _entry("torch._C._disabled_torch_function_impl")
# (type, fn, tree) / (tree): map the leaves of one type / list the leaves of nested
# args and kwargs; what every __torch_dispatch__ uses to unwrap; since 2.0.
tree_map_only = _entry("torch.utils._pytree.tree_map_only")
tree_leaves = _entry("torch.utils._pytree.tree_leaves")


def op_mutates(op: Any) -> bool:
    """Whether an aten OpOverload writes into one of its arguments (``add_``, ``copy_``,
    ``out=`` forms): ``op._schema.is_mutable``, since 1.13."""
    return bool(op._schema.is_mutable)

# --- loss scaling and optimizers (scaler.py, _unscale.py, master.py, frontend/) ---------------
# {(device, dtype): ([[tensors]], indices)} in one C++ pass over a list of tensor lists; 2.1.
group_tensors_by_device_and_dtype = _entry("torch._C._group_tensors_by_device_and_dtype")
# (grads, found_inf, inv_scale): unscale in place, flag inf/NaN; one kernel per list; 1.6.
amp_foreach_non_finite_check_and_unscale_ = _entry("torch._amp_foreach_non_finite_check_and_unscale_")
# (scale, growth_tracker, found_inf, growth, backoff, interval): the scale rule on device; 1.9.
amp_update_scale_ = _entry("torch._amp_update_scale_")
# Multi-tensor copy: masters <-> half params, grads into one flat buffer; since 2.1.
foreach_copy_ = _entry("torch._foreach_copy_")
# Multi-tensor add: put set-aside gradients back (scale_loss); since 1.7.
foreach_add_ = _entry("torch._foreach_add_")
# tensors *= a 0-dim tensor (scale_loss scales held unscaled grads back up); the Tensor
# overload since 2.1.
foreach_mul_ = _entry("torch._foreach_mul_")
# (flat, tensors) -> views of ``flat`` shaped like ``tensors``, back to back, in one C++ call
# (DDP's and apex's bucket views); the O2 move's fp32 gradient views; since 1.0.
unflatten_dense_tensors = _entry("torch._C._nn.unflatten_dense_tensors")
# Tensor._values(t): a sparse COO tensor's values, coalesced or not (the public .values()
# refuses an uncoalesced one), sharing its storage: unscaled in place; since 1.0.
sparse_values = _entry("torch.Tensor._values")
# READY/UNSCALED/STEPPED: the per-optimizer stage enum of torch.amp's GradScaler; since 2.3.
OptState = _entry("torch.amp.grad_scaler.OptState")
# The attribute a fused optimizer sets to unscale itself from ``grad_scale``/``found_inf``
# (Adam(fused=True), ...); read with getattr(optimizer, name, False). Since 1.13.
STEP_SUPPORTS_AMP_SCALING = "_step_supports_amp_scaling"
# A global hook run before every optimizer.step(): ampkit refuses orphaned optimizers; 2.0.
register_optimizer_step_pre_hook = _entry("torch.optim.optimizer.register_optimizer_step_pre_hook")
# The mark an LR scheduler puts on the optimizer.step it wrapped (to tell that step ran);
# without it on the current step the scheduler warns the step was "overridden after
# learning rate scheduler initialization". A private attribute name, 2.2 onwards.
LR_SCHEDULER_MARK = "_wrapped_by_lr_sched"
# The scheduler's wrapper sets this optimizer attribute to True when step() is called; its
# first step() warns "lr_scheduler.step() before optimizer.step()" while it is not (2.2 on).
LR_SCHEDULER_STEP_CALLED = "_opt_called"


def optimizer_step_function(optimizer: Any) -> Any:
    """The ``step`` an optimizer's class defines (or inherits), under the wrapper torch's
    ``Optimizer`` puts around it (profiling, step hooks; it keeps the wrapped function in
    ``__wrapped__``, functools.wraps, 2.0 on)."""
    return inspect.unwrap(type(optimizer).step)

# A device-generic event: a fused step's overflow flag is read once it reached the host; 2.4.
Event = _entry("torch.Event")

# DDP leaves the parameters and buffers named in this attribute of the module it wraps
# out of everything it does, its broadcast of rank 0's buffers before each forward too
# (torch's own setter, DistributedDataParallel._set_params_and_buffers_to_ignore_for_model,
# is private as well); read once, when DDP wraps the module. Since 1.x, still in 2.13.
_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


def ddp_ignore(module: nn.Module, names: Iterable[str]) -> None:
    """Add ``names`` (relative to ``module``) to what a DDP wrapping ``module`` leaves alone."""
    names = list(names)
    if names:
        known = list(getattr(module, _DDP_IGNORE, ()))
        setattr(module, _DDP_IGNORE, known + [n for n in names if n not in known])


# --- nn.Module internals ---------------------------------------------------------------------
# hook(module, state_dict, prefix, local_metadata) after state_dict(): O2/O3 save fp32;
# public since 2.5 (before: the private _register_state_dict_hook).
_STATE_DICT_POST_HOOK = _entry("torch.nn.Module.register_state_dict_post_hook")
# hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
# before load_state_dict(): O2 loads into the fp32 masters; public since 2.5.
_LOAD_STATE_DICT_PRE_HOOK = _entry("torch.nn.Module.register_load_state_dict_pre_hook")


# hook(module, prefix, keep_vars) before state_dict(): modules added since a conversion
# get its hooks; public since 2.0.
_STATE_DICT_PRE_HOOK = _entry("torch.nn.Module.register_state_dict_pre_hook")


def register_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    """``module.register_state_dict_pre_hook(hook)``; hook(module, prefix, keep_vars)."""
    return _STATE_DICT_PRE_HOOK(module, hook)


def register_state_dict_post_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    """``module.register_state_dict_post_hook(hook)``; hook(module, state_dict, prefix, local_metadata)."""
    return _STATE_DICT_POST_HOOK(module, hook)


def register_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    """``module.register_load_state_dict_pre_hook(hook)``; hook(module, state_dict, prefix, ...)."""
    return _LOAD_STATE_DICT_PRE_HOOK(module, hook)


# hook(module, incompatible_keys) after the module's load_state_dict (its children's too);
# public since 2.0.
_LOAD_STATE_DICT_POST_HOOK = _entry("torch.nn.Module.register_load_state_dict_post_hook")


def register_load_state_dict_post_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    """``module.register_load_state_dict_post_hook(hook)``; hook(module, incompatible_keys)."""
    return _LOAD_STATE_DICT_POST_HOOK(module, hook)


# Whether load_state_dict and _apply swap parameters (torch.utils.swap_tensors) rather
# than copy into them: torch.__future__.set_swap_module_params_on_conversion (2.3).
swaps_params_on_load = _entry("torch.__future__.get_swap_module_params_on_conversion")


def local_parameters(module: nn.Module) -> dict[str, Optional[nn.Parameter]]:
    """``module._parameters``: its own parameters by attribute name, None slots included.

    Unlike ``named_parameters(recurse=False)`` nothing is deduplicated, so a tensor in two
    slots is seen in both (as ``state_dict`` sees it). Stable since 1.0.
    """
    return module._parameters  # type: ignore[return-value]


def local_buffers(module: nn.Module) -> dict[str, Optional[Tensor]]:
    """``module._buffers``: its own buffers by attribute name (writable), None slots included."""
    return module._buffers


def local_modules(module: nn.Module) -> dict[str, Optional[nn.Module]]:
    """``module._modules``: its children by attribute name, a child in two slots twice.

    ``named_children()`` skips the second slot of a shared child. Stable since 1.0.
    """
    return module._modules


# Every per-module hook table of nn.Module (torch 2.5-2.13); a table a torch lacks is skipped.
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
                "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the hooks registered on ``old``, which it replaces.

    ``new`` takes ``old``'s hook tables themselves (not copies), so the handles
    returned when they were registered still remove them. The tables are private
    attributes of nn.Module (stable since 2.0; ``_forward_hooks_always_called`` since 2.1).
    A hook torch registered with its module (load-state-dict pre-hooks: torch's private
    ``_WrappedHook``, holding the module weakly) is bound to ``new`` instead.
    """
    for table in _HOOK_TABLES:
        if table not in old.__dict__:
            continue
        hooks = old.__dict__[table]
        setattr(new, table, hooks)
        for hook in hooks.values() if isinstance(hooks, dict) else ():
            owner = getattr(hook, "module", None)
            if getattr(hook, "with_module", False) and callable(owner) and owner() is old:
                hook.module = weakref.ref(new)


class AfterApply(nn.Module):
    """Mixin whose ``after_apply()`` runs after every ``.to()``/``.cuda()``/``.half()``/``.float()``.

    Those all end in the private ``nn.Module._apply(fn, recurse)`` (``recurse`` since
    2.0, so also on 2.5), which this overrides. List it first: ``class L(AfterApply,
    nn.Linear)``; Float8Linear re-decides its backend there after a move.

    ``FP32_BUFFERS``: the names of buffers that stay fp32 whatever the module is cast
    to; a cast moves them to the new device with their values exact (a cast to half and
    back would round them, and turn values above 65504 into inf). ``cast_model`` leaves
    them alone too.
    """

    FP32_BUFFERS: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        kept = {name: buf for name in self.FP32_BUFFERS
                if (buf := getattr(self, name, None)) is not None}
        result = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = getattr(self, name)
            if after.dtype != torch.float32:
                setattr(self, name, before.to(device=after.device, dtype=torch.float32))
        self.after_apply(emptied=_is_to_empty(fn))
        return result

    def after_apply(self, *, emptied: bool = False) -> None:
        """Called with the module's own tensors already moved or cast; ``emptied``: by
        ``Module.to_empty()``, which leaves their values uninitialised memory."""


def _is_to_empty(fn: Any) -> bool:
    """Whether an ``_apply`` function is ``Module.to_empty``'s (a lambda defined there
    since 2.0: ``torch.empty_like(t, device=device)``)."""
    return getattr(fn, "__qualname__", "").startswith("Module.to_empty.")


# The base class of BatchNorm1d/2d/3d and SyncBatchNorm (not of the instance norms);
# private since 1.0, no public equivalent.
BatchNormBase = _entry("torch.nn.modules.batchnorm._BatchNorm")

# --- distributed -----------------------------------------------------------------------------
_FSDP2_PUBLIC = "torch.distributed.fsdp"  # since 2.6
_FSDP2_COMPOSABLE = "torch.distributed._composable.fsdp"  # 2.5 (still there in 2.13)
_FSDP2_NAMES = ("fully_shard", "MixedPrecisionPolicy", "FSDPModule")


def fsdp2() -> types.ModuleType:
    """The module holding FSDP2's ``fully_shard``, ``MixedPrecisionPolicy`` and ``FSDPModule``.

    ``torch.distributed.fsdp`` exports them since torch 2.6; torch 2.5 has them in the
    private ``torch.distributed._composable.fsdp``. Imported on first call: importing
    either costs about a second, so ``import ampkit`` does not.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("ampkit.distributed needs torch.distributed, which this torch build "
                           "lacks; valid: a torch build with distributed support (the pip wheels)")
    for path in (_FSDP2_PUBLIC, _FSDP2_COMPOSABLE):
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        if all(hasattr(module, name) for name in _FSDP2_NAMES):
            return module
    raise RuntimeError(f"ampkit.distributed needs FSDP2 ({', '.join(_FSDP2_NAMES)}) from "
                       f"{_FSDP2_PUBLIC} or {_FSDP2_COMPOSABLE}, which this torch lacks; "
                       "valid: torch 2.5 or newer")

# --- fp8 -----------------------------------------------------------------------------------
# Looked up per call, not bound: tests swap torch._scaled_mm for a strict fake.
TORCH_PATHS.append("torch._scaled_mm")


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
              use_fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm``: an fp8 GEMM on tensor cores, scaled in its epilogue (since 2.1).

    Returns the product alone: torch <= 2.4 returned ``(out, amax)``, later a tensor
    (a fake with the old layout is still accepted).
    """
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                           use_fast_accum=use_fast_accum)
    return out[0] if isinstance(out, tuple) else out


# --- hardware --------------------------------------------------------------------------------
# The CPU's instruction-set flags, from whichever source this torch has (resolved, not
# entries: each is absent from some supported torch). 2.11 has both dict sources; 2.5 has
# neither, only the per-flag functions, which 2.11 dropped.
_CPU_CAPABILITIES = resolve("torch.cpu.get_capabilities")  # public, {flag: value}; in 2.11
_CPU_CAPABILITY_DICT = resolve("torch._C._cpu._get_cpu_capability")  # the same dict; in 2.11
_AVX512_BF16 = resolve("torch._C._cpu._is_avx512_bf16_supported")  # in 2.5; gone by 2.11
_AMX_TILE = resolve("torch._C._cpu._is_amx_tile_supported")  # in 2.5; gone by 2.11


@functools.lru_cache(maxsize=None)
def cpu_capabilities() -> dict[str, Any]:
    """The CPU's instruction-set flags ("avx512_bf16", "amx_bf16", ...; {} when torch cannot say).

    On torch without ``torch.cpu.get_capabilities`` only the bf16 flags are known: AMX
    tiles stand for AMX-BF16 there (every AMX CPU has both).
    """
    for source in (_CPU_CAPABILITIES, _CPU_CAPABILITY_DICT):
        if source is not None:
            flags = source()
            return dict(flags) if hasattr(flags, "items") else {}
    flags = {}
    if _AVX512_BF16 is not None:
        flags["avx512_bf16"] = bool(_AVX512_BF16())
    if _AMX_TILE is not None:
        flags["amx_bf16"] = bool(_AMX_TILE())
    return flags
