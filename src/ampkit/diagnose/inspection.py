"""``inspect``: one step in fp32 and one under a policy, compared module by module.

How it runs: a deep copy of the model does one forward+backward in fp32 (the
reference); forward hooks keep a copy of each tracked module's output, and its
parameter gradients are kept when the copy is dropped. A second deep copy, with the
policy applied (``ampkit.apply.apply_policy``; fp8 names also ``convert_to_fp8``),
runs the same batch with the same random numbers (dropout) under a ``watch`` and a
FLOP counter, its loss multiplied by the policy's initial loss scale as a GradScaler
would; each output is compared with its reference as soon as it is produced, which frees
that reference. The caller's model is only read (deep-copied), never run, so its
parameters, buffers, gradients, mode and hooks stay exactly as they were, and its RNG
state is restored. Its inputs and target are only read too (detached: no ``.grad``), and
both passes run with the caller's autocast regions off (``_regions.autocast_off``): the
reference is fp32, the policy pass is in the policy's own region only. Without a
parameter that requires grad the loss has no graph: no backward, a forward-only report.

Memory: one copy of the weights at a time, plus the reference outputs of the tracked
modules and the reference gradients until the policy pass has compared them.
Host syncs: the numbers are summed on the device and read back once at the end (plus
the loss values and the watch's reads): a handful per call, never one per module.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .._batch import call_model
from .._dtypes import fp8_supported, iter_tensors, map_tensors
from .._loss import default_loss
from .._reference import copy_model
from ..apply import apply_policy
from ..autocast import autocast
from ..fp8 import Float8Config, Float8Linear, convert_to_fp8
from ..policy import OPT_LEVELS, Policy
from . import numerics as nx
from .advice import UNDERFLOW, Context, advise
from .exact import fingerprint, signal_underflow
from .flops import FlopCounter, fp8_share
from ._regions import autocast_off
from .._rng import replayable_rng
from .._torch_compat import compiled_code_eager, uncompiled
from .nonfinite import watch
from .report import ModuleStats, Report
from .request import LossFn, Setup, prepare


class _Module:
    """One tracked module's numbers, summed on the device over calls and tensors."""

    def __init__(self, name: str, module_type: str, device: torch.device) -> None:
        self.name, self.type = name, module_type
        zeros = lambda n: torch.zeros(n, dtype=torch.float64, device=device)  # noqa: E731
        self.refs: list[Optional[list[Tensor]]] = []  # per call, until compared
        self.out_counts, self.out_energy = zeros(4), zeros(2)
        self.grad_counts, self.grad_energy, self.grad_amax = zeros(4), zeros(2), zeros(1)
        self.grad_refs: dict[str, Tensor] = {}
        self.out_dtype: Optional[torch.dtype] = None
        self.has_out = self.compared_out = self.compared_grad = False
        self.calls = 0


def inspect(model: nn.Module, inputs: Any, target: Any = None, *,
            policy: Union[str, Policy, None] = None, loss_fn: Optional[LossFn] = None) -> Report:
    """Run one step in fp32 and one under ``policy`` and compare them module by module.

    Args:
        model: an fp32 model (before ``initialize``/``convert_to_fp8``); only read.
        inputs: the batch: a tuple (``model(*inputs)``), a dict (``model(**inputs)``) or
            anything else, a tensor or a list (``model(inputs)``), on the model's device;
            only read (detached).
        target: the loss target (optional; only read).
        policy: any name ``get_policy`` takes (O0-O3, "O2-bf16", "bf16-mixed", ...), a
            Policy, or "fp8-tensorwise"/"fp8-delayed"/"fp8-rowwise" (Linear layers in fp8
            under bf16 autocast, as ``ampkit bench`` runs them); None: the device's default
            mixed policy (bf16-mixed on CPU and on CUDA with bf16, else 16-mixed).
        loss_fn: ``loss_fn(output, target) -> loss``; default cross-entropy for an integer
            target, MSE for a floating one, ``output.float().mean()`` without a target.

    Returns:
        A :class:`Report`.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> report = inspect(model, torch.randn(4, 8), policy="bf16-mixed")
        >>> [m.name for m in report.modules]
        ['0', '1', '2']
    """
    model = uncompiled(model)  # torch.compile(model): its modules, by their own names
    setup = prepare(model, inputs, policy, loss_fn)
    # The caller's tensors are only read: each pass gets its own detached copy (no .grad
    # for them; an in-place model gives both passes the same batch). Both passes run
    # outside the caller's autocast regions, compiled code eagerly (it would skip the hooks
    # that record each module, and compile the FLOP counter).
    with replayable_rng(setup.device) as rng, autocast_off(), compiled_code_eager():
        table, ref_loss, ref_print = _reference_pass(model, _copied(inputs), _copied(target),
                                                     setup)
        rng.rewind()

        def exact(names: list[str]) -> Optional[dict[str, float]]:
            rng.rewind()  # the same dropout masks again
            return signal_underflow(
                model, _copied(inputs), _copied(target),
                lambda out, tgt: _loss(out, tgt, setup), ref_print,
                {n: table[n].grad_refs for n in names}, setup.loss_scale,
                {n: setup.cast_dtype(n) for n in names})
        return _policy_pass(model, _copied(inputs), _copied(target), setup, table, ref_loss,
                            exact)


# --- the two passes ----------------------------------------------------------------------------
def _copy(model: nn.Module) -> nn.Module:
    """A deep copy (nn.Parameter's deepcopy leaves .grad behind: no gradients copied)."""
    return copy_model(model, "inspect")


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it a detached copy (no autograd history, storage of
    its own), its containers and dataclass instances rebuilt as :func:`map_tensors` does."""
    return map_tensors(value, lambda tensor: tensor.detach().clone())


def _loss(output: Any, target: Any, setup: Setup) -> Tensor:
    loss = (setup.loss_fn or default_loss)(output, target)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else
               f"{type(loss).__name__} {reprlib.repr(loss)}")
        raise ValueError(f"the loss must be a tensor with one element, got {got}; valid: "
                         "a scalar loss (reduce it, e.g. .mean())")
    return loss.reshape(())  # a (1,) loss too: its value is read as a number


def _backward(loss: Tensor, scale: float = 1.0) -> None:
    """The step's backward; none when no parameter of the model requires grad (the
    inputs are detached): a forward-only report, its gradient columns None."""
    if loss.requires_grad:
        (loss * scale if scale != 1.0 else loss).backward()


def _reference_pass(model: nn.Module, inputs: Any, target: Any,
                    setup: Setup) -> tuple[dict[str, _Module], Tensor, Tensor]:
    """fp32 forward+backward on a copy; keeps reference outputs and gradients only, and
    the output's fingerprint (for the float64 step, ``exact.signal_underflow``)."""
    work = _copy(model)
    table: dict[str, _Module] = {}
    handles = _install(work, table, setup, reference=True)
    try:
        with torch.enable_grad():
            output = call_model(work, inputs)
            ref_print = fingerprint(output)
            loss = _loss(output, target, setup)
            del output
            _backward(loss)
    finally:
        for handle in handles:
            handle.remove()
    _keep_reference_grads(work, table, setup)
    return table, loss.detach(), ref_print


def _policy_pass(model: nn.Module, inputs: Any, target: Any, setup: Setup,
                 table: dict[str, _Module], ref_loss: Tensor,
                 exact: Callable[[list[str]], Optional[dict[str, float]]]) -> Report:
    """The same step under the policy, compared as it runs; builds the report. ``exact``
    checks the gradient underflow the advice would name against a float64 step."""
    work = _fp8(_copy(model), setup)  # a bare Linear comes back a new module
    # The root's output as it computed it, before the policy's cast of the model's output
    # (fp32 under O2 and the mixed policies, which would hide its half-precision overflow).
    _observe_root(work, table, setup)
    apply_policy(setup.policy, work)
    fp8_layers = frozenset(name for name, m in work.named_modules() if isinstance(m, Float8Linear))
    handles = _install(work, table, setup, reference=False, root=False)
    counter = FlopCounter()
    try:
        with watch(work) as watcher, counter, torch.enable_grad():
            loss = _loss(call_model(work, inputs), target, setup)
            # As GradScaler.scale does; the gradient comparison divides the scale out.
            _backward(loss, setup.loss_scale)
    finally:
        for handle in handles:
            handle.remove()
    _compare_grads(work, table, setup)
    nonfinite = {name for _, name in watcher.nonfinite()}
    first_nonfinite, loss = watcher.first_nonfinite, loss.detach()
    del work, watcher  # the policy copy (its graph too) goes before a float64 one is made
    stats, grad_amax = _finish(table, nonfinite)
    losses = torch.stack([ref_loss.double(), loss.double()]).tolist()  # host sync
    flagged = {m.name for m in stats if (m.grad_underflow or 0) >= UNDERFLOW}
    for name, entry in table.items():
        if name not in flagged:
            entry.grad_refs = {}
    signal = (exact(sorted(flagged)) if flagged and setup.policy.half_dtype
              is not None else None) or {}
    for entry in table.values():
        entry.grad_refs = {}
    ctx = Context(setup.name, setup.policy.half_dtype, setup.loss_scale,
                  setup.policy.loss_scaling.kind, _bf16_name(setup), first_nonfinite,
                  ref_finite=math.isfinite(losses[0]),
                  kept=setup.kept, selection=setup.selection, fp8_layers=fp8_layers,
                  fp8=setup.fp8_recipe is not None, grad_amax=grad_amax,
                  grad_signal_underflow=signal,
                  fp8_share=fp8_share(counter.flops))
    return Report(setup.name, stats, first_nonfinite, counter.flops, advise(stats, ctx),
                  setup.loss_scale, losses[0], losses[1], setup.policy.half_dtype)


def _fp8(work: nn.Module, setup: Setup) -> nn.Module:
    """The copy with its Linear layers in fp8 under an fp8 policy (a bare Linear: a new
    module), else the copy itself."""
    if setup.fp8_recipe is None:
        return work
    # Emulated where there are no fp8 tensor cores: the same numerics, which is what a
    # report is about (so no emulation warning).
    emulate = None if fp8_supported(str(setup.device)) else True
    return convert_to_fp8(work, recipe=Float8Config(setup.fp8_recipe, emulate=emulate))


def _observe_root(work: nn.Module, table: dict[str, _Module], setup: Setup) -> None:
    """Compare the root's output inside its forward, where a policy applied afterwards
    keeps this forward inside its own casts (``convert`` wraps an instance's forward)."""
    if not any(name == "" for name, _ in tracked(work)):
        return
    inner = work.__dict__.get("forward")
    cls_forward = type(work).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        output = inner(*args, **kwargs) if inner is not None else cls_forward(work, *args, **kwargs)
        _compare_output("", work, output, table, setup)
        return output

    work.forward = forward  # type: ignore[method-assign]  # (the copy is dropped after)


def _bf16_name(setup: Setup) -> Optional[str]:
    """The same policy in bf16, for advice (None when the policy is not fp16)."""
    if setup.policy.half_dtype != torch.float16:
        return None
    level = setup.name.partition("-")[0]
    if level in OPT_LEVELS:
        return f"{level}-bf16"
    # bf16 needs no loss scaling (fp32's exponent range): the bf16 presets have none.
    presets = {"16-mixed": "bf16-mixed", "fp16-mixed": "bf16-mixed", "16-true": "bf16-true"}
    return presets.get(setup.name, str(setup.policy.with_half_dtype(torch.bfloat16)))


# --- hooks: reference outputs, then comparisons --------------------------------------------
def tracked(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a report has a row for: those with parameters of their own, and leaves."""
    return [(name, m) for name, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None
            or next(m.children(), None) is None]


def _install(model: nn.Module, table: dict[str, _Module], setup: Setup,
             reference: bool, root: bool = True) -> list[RemovableHandle]:
    hook = _record_reference if reference else _compare_output
    return [module.register_forward_hook(
        lambda mod, args, out, name=name: hook(name, mod, out, table, setup))
        for name, module in tracked(model) if root or name != ""]


def _floats(output: Any) -> list[Tensor]:
    return [nx.dense_values(t) for t in iter_tensors(output) if t.is_floating_point()]


def _record_reference(name: str, module: nn.Module, output: Any,
                      table: dict[str, _Module], setup: Setup) -> None:
    if name not in table:  # first call: its place in execution order
        table[name] = _Module(name, type(module).__name__, setup.device)
    entry, values = table[name], _floats(output)
    # A copy: a later in-place op (ReLU(inplace=True)) would change the output itself.
    entry.refs.append([v.detach().clone() for v in values])


def _compare_output(name: str, module: nn.Module, output: Any,
                    table: dict[str, _Module], setup: Setup) -> None:
    entry = table.get(name)
    if entry is None:  # did not run in the reference pass
        return
    entry.type = type(module).__name__
    call, entry.calls = entry.calls, entry.calls + 1
    refs = entry.refs[call] if call < len(entry.refs) else None
    if refs is None:
        return
    entry.refs[call] = None  # compared: free the reference copy
    values = _floats(output)
    entry.out_dtype = entry.out_dtype or nx.first_floating(values)
    entry.has_out = entry.has_out or bool(values)
    with torch.no_grad(), autocast(setup.device.type, enabled=False):
        for value, ref in zip(values, refs):
            # Counted against the dtype the output has under the policy: a module after
            # a kept one (or outside autocast's cast list) computes in fp32 and cannot
            # overflow the half dtype, whatever its name.
            entry.out_counts += nx.cast_counts(ref, nx.stored_dtype(value.dtype))
            if value.shape == ref.shape:
                entry.out_energy += nx.error_energy(value, ref)
                entry.compared_out = True


@torch.no_grad()
def _keep_reference_grads(work: nn.Module, table: dict[str, _Module], setup: Setup) -> None:
    for name, module in tracked(work):
        entry = table.get(name)
        if entry is None:
            continue
        entry.grad_refs = nx.own_grads(module)
        for grad in map(nx.grad_values, entry.grad_refs.values()):
            # What the policy's backward holds: the gradient times the loss scale, cast.
            entry.grad_counts += nx.cast_counts(grad * setup.loss_scale, setup.cast_dtype(name))
            if grad.numel():
                entry.grad_amax = torch.maximum(entry.grad_amax, grad.abs().amax().double())


@torch.no_grad()
def _compare_grads(work: nn.Module, table: dict[str, _Module], setup: Setup) -> None:
    for name, module in tracked(work):
        entry = table.get(name)
        if entry is None:
            continue
        grads = nx.own_grads(module)
        for pname, ref in entry.grad_refs.items():
            pair = None if pname not in grads else nx.comparable(grads[pname], ref)
            if pair is not None:
                entry.grad_energy += nx.error_energy(pair[0].double() / setup.loss_scale, pair[1])
                entry.compared_grad = True


def _finish(table: dict[str, _Module],
            nonfinite: set[str]) -> tuple[list[ModuleStats], dict[str, float]]:
    """Read every module's sums back in one transfer and turn them into ModuleStats."""
    entries = list(table.values())
    if not entries:
        return [], {}
    rows = torch.stack([torch.cat([e.out_counts, e.out_energy, e.grad_counts, e.grad_energy,
                                   e.grad_amax]) for e in entries]).tolist()  # host sync
    stats = [_stats(e, row, e.name in nonfinite) for e, row in zip(entries, rows)]
    return stats, {e.name: row[12] for e, row in zip(entries, rows)}


def _stats(e: _Module, row: list[float], nonfinite: bool) -> ModuleStats:
    nonzero, under, finite, over, signal, noise = row[0:6]
    g_nonzero, g_under, g_finite, g_over, g_signal, g_noise = row[6:12]
    has_grad = g_nonzero + g_finite > 0 or e.compared_grad
    return ModuleStats(
        name=e.name, type=e.type, out_dtype=e.out_dtype,
        out_sqnr_db=nx.sqnr_db(signal, noise) if e.compared_out else None,
        underflow=nx.fraction(under, nonzero) if e.has_out else None,
        overflow=nx.fraction(over, finite) if e.has_out else None,
        grad_sqnr_db=nx.sqnr_db(g_signal, g_noise) if e.compared_grad else None,
        grad_underflow=nx.fraction(g_under, g_nonzero) if has_grad else None,
        grad_overflow=nx.fraction(g_over, g_finite) if has_grad else None,
        nonfinite=nonfinite)
