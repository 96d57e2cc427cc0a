"""Each entry of ampkit._torch_compat still exists and behaves as ampkit relies on.

Run on every supported torch (benchmarks/check_torch_versions.sh): a failure names the
entry and the installed torch version, i.e. the one line of _torch_compat to revisit.
"""

from __future__ import annotations

import inspect
import io
import platform
import re
import sys
import tokenize
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from ampkit import _dtypes
from ampkit import _torch_compat as tc

TORCH = f"torch {torch.__version__}"


def _check(entry: str, ok: bool, what: str) -> None:
    if not ok:
        pytest.fail(f"_torch_compat.{entry} on {TORCH}: {what}", pytrace=False)


# --- each dotted torch path still resolves -------------------------------------------------
@pytest.mark.parametrize("path", tc.TORCH_PATHS)
def test_every_torch_path_exists(path):
    _check(path, tc.resolve(path) is not None, f"{path} no longer exists")


def test_a_missing_entry_is_a_stub_that_names_it():
    stub = tc._entry("torch._no_such_api_")
    tc.TORCH_PATHS.remove("torch._no_such_api_")
    with pytest.raises(RuntimeError, match=r"ampkit needs torch\._no_such_api_, which torch .* "
                                           r"does not have; valid: torch 2\.5 or newer"):
        stub()


# --- versions -------------------------------------------------------------------------------
@pytest.mark.parametrize("version, expected", [
    ("2.5.1+cu124", (2, 5)), ("2.13.0+cpu", (2, 13)), ("2.6.0a0+git1234", (2, 6)), ("3.0", (3, 0)),
])
def test_parse_version(version, expected):
    assert tc.parse_version(version) == expected


def test_parse_version_refuses_garbage_naming_it():
    with pytest.raises(ValueError, match=r"cannot read a torch version from 'nightly'; valid: "
                                         r"'MAJOR\.MINOR"):
        tc.parse_version("nightly")


def test_a_torch_below_the_floor_is_refused_at_import_naming_both():
    with pytest.raises(ImportError, match=r"ampkit needs torch>=2\.5, but torch 2\.4\.1 is "
                                          r"installed; valid: torch 2\.5 or newer"):
        tc.check_floor("2.4.1")
    tc.check_floor("2.5.0")
    assert tc.TORCH_VERSION >= tc.TORCH_FLOOR


def test_the_floor_is_the_one_pyproject_declares():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    floor = ".".join(map(str, tc.TORCH_FLOOR))
    assert f'"torch>={floor}"' in pyproject.read_text()


# --- behaviour of each entry ------------------------------------------------------------------
def _autocast_switches() -> None:
    device = "cpu"
    saved = (tc.is_autocast_enabled(device), tc.get_autocast_dtype(device), tc.is_autocast_cache_enabled())
    depth = tc.autocast_increment_nesting()
    try:
        tc.set_autocast_enabled(device, True)
        tc.set_autocast_dtype(device, torch.float16)
        tc.set_autocast_cache_enabled(False)
        _check("set_autocast_*", (tc.is_autocast_enabled(device), tc.get_autocast_dtype(device),
                                  tc.is_autocast_cache_enabled()) == (True, torch.float16, False),
               "the device-type switches do not read back what was set")
        _check("set_autocast_enabled", torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.float16,
               "setting the switches no longer turns autocast on for ops")
        _check("autocast_increment_nesting", isinstance(depth, int) and depth >= 1,
               f"returned {depth!r}, not the new nesting depth")
    finally:
        _check("autocast_decrement_nesting", tc.autocast_decrement_nesting() == depth - 1,
               "does not return the depth after leaving")
        tc.clear_autocast_cache()
        tc.set_autocast_enabled(device, saved[0])
        tc.set_autocast_dtype(device, saved[1])
        tc.set_autocast_cache_enabled(saved[2])


def _torch_function_mode() -> None:
    _check("is_torch_function_mode_enabled", tc.is_torch_function_mode_enabled() is False,
           "True outside any torch-function mode")
    with torch.overrides.TorchFunctionMode():
        _check("is_torch_function_mode_enabled", tc.is_torch_function_mode_enabled() is True,
               "False inside a TorchFunctionMode")


def _privateuse1() -> None:
    name = tc.privateuse1_backend_name()
    _check("privateuse1_backend_name", name == torch.autocast("cpu").custom_backend_name,
           f"{name!r} is not what torch.autocast instances carry")


def _resolve_autocast() -> None:
    _check("resolve_autocast", tc.resolve_autocast("cpu", torch.bfloat16, True) == (True, torch.bfloat16),
           "torch.autocast has no _enabled/fast_dtype of its arguments")
    with pytest.warns(UserWarning):  # torch disables itself for a dtype the device lacks
        resolved = tc.resolve_autocast("cpu", torch.float64, True)
    _check("resolve_autocast", resolved == (False, torch.float64),
           f"an unsupported dtype resolves to {resolved}, not (False, torch.float64)")


def _tensor_version() -> None:
    grad = torch.zeros(3)
    before = tc.tensor_version(grad)
    _check("tensor_version", isinstance(before, int), f"{type(before).__name__}, not an int")
    grad.add_(1.0)
    _check("tensor_version", tc.tensor_version(grad) > before, "an in-place add left it as it was")
    after = tc.tensor_version(grad)
    grad.float()  # reading (a no-op cast) writes nothing
    _check("tensor_version", tc.tensor_version(grad) == after, "a read changed it")


def _functorch_active() -> None:
    seen = []

    def f(x):
        seen.append(tc.functorch_active())
        return x.sum()

    f(torch.ones(2))
    torch.func.vmap(f)(torch.ones(3, 2))
    torch.func.grad(f)(torch.ones(2))
    _check("functorch_active", seen == [False, True, True],
           f"eager, under vmap, under grad gave {seen}, not [False, True, True]")


def _is_compiling() -> None:
    _check("is_compiling", tc.is_compiling() is False, "True in eager code")
    seen = []

    def f(x):
        seen.append(tc.is_compiling())
        return x + 1

    tc.dynamo_reset()
    torch.compile(f, backend="eager")(torch.ones(1))
    _check("is_compiling", seen == [True], f"saw {seen} while dynamo traced, not [True]")


def _compiled_modules() -> None:
    """uncompiled unwraps torch.compile's module; inside compiled_code_eager a compiled
    function runs as Python."""
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")
    _check("uncompiled", tc.uncompiled(compiled) is model and tc.uncompiled(model) is model,
           "did not unwrap torch.compile(model) to the model")
    def f(x):
        return x * (3 if tc.is_compiling() else 2)  # 3 where traced, 2 where run as Python

    g = torch.compile(f, backend="eager")
    _check("compiled_code_eager", g(torch.ones(1)).item() == 3, "the function did not compile")
    with tc.compiled_code_eager():
        inside = g(torch.ones(1)).item()
    _check("compiled_code_eager", inside == 2, "the compiled function did not run eagerly inside")
    _check("compiled_code_eager", g(torch.ones(1)).item() == 3, "not compiled again after")


def _compile_tracing() -> None:
    """False in eager code, also under a user's own FakeTensorMode; True where a tracing
    context is set (torch.compile's stages, its AOT one included)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    _check("compile_tracing", tc.compile_tracing() is False, "True in eager")
    fake = FakeTensorMode()
    with fake:
        _check("compile_tracing", tc.compile_tracing() is False, "True under a FakeTensorMode")
    with tracing(TracingContext(fake)):
        inside = tc.compile_tracing()
    _check("compile_tracing", inside is True, "False under a tracing context")


def _graph_break() -> None:
    """Two graphs around the break, and the eager code between them runs once per call."""
    graphs, between = [], []

    def f(x):
        x = x + 1
        tc.graph_break("a reason")
        between.append(1)
        return x * 2

    def count(gm, inputs):
        graphs.append(gm)
        return gm.forward

    tc.dynamo_reset()
    out = torch.compile(f, backend=count)(torch.ones(1))
    _check("graph_break", len(graphs) == 2 and between == [1] and out.item() == 4.0,
           f"{len(graphs)} graphs, the code between ran {len(between)} times, out {out}")


def _checkpoint_call() -> None:
    """Each phase where torch.utils.checkpoint (non-reentrant) runs the function, with the
    call's own frame, and each backward's id (retain_graph: a second backward, anew)."""
    import torch.utils.checkpoint as ckpt

    seen = []

    def f(x):
        seen.append(tc.checkpoint_call())
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    y = ckpt.checkpoint(f, x, use_reentrant=False)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    ckpt.checkpoint(f, x, use_reentrant=True).sum().backward()
    f(x)
    if tc.TORCH_VERSION < (2, 11):  # 2.5 has no view of the hooks
        _check("checkpoint_call", seen == [None] * 6, f"saw {seen}")
        return
    phases = [None if c is None else c.phase for c in seen]
    _check("checkpoint_call", phases == ["forward", "recompute", "recompute", None, None, None],
           f"saw phases {phases}")
    frames = {id(c.frame) for c in seen[:3]}
    _check("checkpoint_call", len(frames) == 1 and isinstance(seen[0].frame, tc._CHECKPOINT_FRAME),
           "the forward and its recomputations saw other frames")
    backwards = [c.backward for c in seen[:3]]
    _check("checkpoint_call", backwards[0] == -1 and len(set(backwards)) == 3,
           f"backward ids {backwards}")


def _import_dynamo() -> None:
    tc.import_dynamo()
    _check("import_dynamo", "torch._dynamo" in sys.modules, "torch._dynamo not imported")


def _ops_seen(fn) -> list:
    """The aten ops a TorchDispatchMode sees while ``fn`` runs."""
    ops = []

    class Count(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


def _seeded_random() -> None:
    ops = _ops_seen(lambda: torch.nn.functional.dropout(torch.ones(8), 0.5, training=True)
                    + torch.randn(8))
    random = [op for op in ops if tc.seeded_random(op)]
    _check("seeded_random", any("bernoulli" in str(op) or "dropout" in str(op) for op in random)
           and any("randn" in str(op) or "normal" in str(op) for op in random)
           and not tc.seeded_random(torch.ops.aten.mm.default), f"saw {random}")


def _dispatch_mode() -> None:
    ops = _ops_seen(lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2)))
    _check("TorchDispatchMode", torch.ops.aten.mm.default in ops, f"saw {ops}, not aten.mm")


def _eager_dispatch_mode() -> None:
    ops = []

    def dispatch(self, func, types, args=(), kwargs=None):
        ops.append(func)
        return func(*args, **(kwargs or {}))

    eager = type("Eager", (tc.EagerDispatchMode,), {"__torch_dispatch__": dispatch})
    _check("EagerDispatchMode", eager.__dict__["__torch_dispatch__"] is dispatch,
           "torch wrapped __torch_dispatch__ all the same: its _should_skip_dynamo hook is "
           "renamed or gone")
    with eager():
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    _check("EagerDispatchMode", torch.ops.aten.mm.default in ops, f"saw {ops}, not aten.mm")


def _aten_to_copy() -> None:
    ops = _ops_seen(lambda: torch.ones(2).to(torch.float16))
    _check("aten_to_copy", tc.aten_to_copy in ops, f".to(float16) dispatched {ops}")


def _cpu_fused_ops() -> None:
    """The CPU kernels the FLOP counter has formulas for: what attention and an LSTM with
    a backward dispatch on the CPU (packets, with the argument order the formulas read)."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    lstm = torch.nn.LSTM(8, 16)
    x = torch.randn(3, 2, 8)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
        lstm(x)[0].sum().backward()

    packets = {op.overloadpacket for op in _ops_seen(run)}
    for name in ("cpu_attention", "cpu_attention_backward", "rnn_layer", "rnn_layer_backward"):
        _check(name, getattr(tc, name) in packets, f"not dispatched by attention and an LSTM "
               f"on the CPU: {sorted(str(p) for p in packets)}")
    schema = [a.name for a in tc.rnn_layer.default._schema.arguments]
    _check("rnn_layer", schema[:3] == ["input", "weight0", "weight1"], f"takes {schema}")
    schema = [a.name for a in tc.cpu_attention_backward.default._schema.arguments]
    _check("cpu_attention_backward", schema[:4] == ["grad_out", "query", "key", "value"],
           f"takes {schema}")


def _trilinear() -> None:
    layer = torch.nn.Bilinear(3, 4, 5)
    x1, x2 = torch.randn(2, 3), torch.randn(2, 4)
    packets = {op.overloadpacket for op in _ops_seen(lambda: layer(x1, x2).sum().backward())}
    _check("trilinear", tc.trilinear in packets, f"not dispatched by nn.Bilinear: "
           f"{sorted(str(p) for p in packets)}")
    schema = [a.name for a in tc.trilinear.default._schema.arguments]
    _check("trilinear", schema[:7] == ["i1", "i2", "i3", "expand1", "expand2", "expand3",
                                       "sumdim"], f"takes {schema}")


def _unsafe_view() -> None:
    base = torch.arange(6.0)
    out = tc.unsafe_view(base, (2, 3))
    _check("unsafe_view", out.shape == (2, 3) and out.data_ptr() == base.data_ptr(),
           f"shape {tuple(out.shape)}, not (2, 3) over the same storage")
    _check("unsafe_view", not out._is_view(), "its result is a view")


class _Wrapped(torch.Tensor):
    __torch_function__ = tc.disabled_torch_function_impl
    calls: list = []

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "_Wrapped":
        return tc.make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                        storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                        device=inner.device, requires_grad=False)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func)
        leaves = [t for t in tc.tree_leaves((args, kwargs)) if isinstance(t, cls)]
        args, kwargs = tc.tree_map_only(cls, lambda t: t.inner, (args, kwargs or {}))
        return func(*args, **kwargs) if leaves else None


def _wrapper_subclass() -> None:
    inner = torch.arange(6.0).reshape(2, 3)
    wrapped = _Wrapped(inner)
    _check("make_wrapper_subclass", type(wrapped) is _Wrapped and wrapped.shape == (2, 3)
           and wrapped.dtype == torch.float32, f"made {type(wrapped).__name__} {wrapped.shape}")
    _Wrapped.calls.clear()
    total = torch.add(wrapped, 1.0)  # torch-function disabled: straight to the dispatch
    _check("disabled_torch_function_impl", _Wrapped.calls == [torch.ops.aten.add.Tensor],
           f"the dispatch saw {_Wrapped.calls}")
    _check("tree_map_only", type(total) is torch.Tensor and torch.equal(total, inner + 1.0),
           "the unwrapped op's result is not the inner tensor's")
    aten = torch.ops.aten
    mutates = [tc.op_mutates(op) for op in (aten.add_.Tensor, aten.copy_.default, aten.add.out,
                                             aten.add.Tensor, aten.view.default)]
    _check("op_mutates", mutates == [True, True, True, False, False],
           f"add_, copy_, add.out, add, view -> {mutates}")
    leaves = tc.tree_leaves(((1, [2]), {"k": 3}))
    _check("tree_leaves", leaves == [1, 2, 3], f"{leaves} for ((1, [2]), {{'k': 3}})")
    mapped = tc.tree_map_only(int, lambda v: v * 10, ((1, "a"), {"k": 2}))
    _check("tree_map_only", mapped == ((10, "a"), {"k": 20}), f"{mapped}")


def _group_tensors() -> None:
    a, h, b = torch.ones(2), torch.ones(3, dtype=torch.float16), torch.zeros(2)
    groups = tc.group_tensors_by_device_and_dtype([[a, h, b]], True)
    cpu = torch.device("cpu")
    layout_ok = (set(groups) == {(cpu, torch.float32), (cpu, torch.float16)}
                 and all(isinstance(v, tuple) and len(v) == 2 for v in groups.values()))
    _check("group_tensors_by_device_and_dtype", layout_ok,
           f"not {{(device, dtype): ([[tensors]], indices)}}: {groups!r}")
    (lists, indices) = groups[(cpu, torch.float32)]
    _check("group_tensors_by_device_and_dtype",
           len(lists) == 1 and lists[0][0] is a and lists[0][1] is b and list(indices) == [0, 2],
           f"the fp32 group is {lists!r} with indices {indices!r}, not ([[a, b]], [0, 2])")


def _unscale() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found, inv = torch.zeros(()), torch.full((), 0.5)
    tc.amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    _check("amp_foreach_non_finite_check_and_unscale_",
           grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0] and found.item() == 0,
           f"(grads, found_inf, inv_scale) gave {grads} and found_inf={found.item()}")
    tc.amp_foreach_non_finite_check_and_unscale_([torch.tensor([float("inf")])], found, inv)
    _check("amp_foreach_non_finite_check_and_unscale_", found.item() == 1, "an inf is not flagged")


def _update_scale() -> None:
    scale, tracker = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
    tc.amp_update_scale_(scale, tracker, torch.ones(()), 2.0, 0.5, 2)  # overflow: back off
    _check("amp_update_scale_", (scale.item(), tracker.item()) == (4.0, 0),
           f"an overflow gave scale={scale.item()} tracker={tracker.item()}, not 4.0 and 0")
    for _ in range(2):  # growth_interval clean steps: grow
        tc.amp_update_scale_(scale, tracker, torch.zeros(()), 2.0, 0.5, 2)
    _check("amp_update_scale_", (scale.item(), tracker.item()) == (8.0, 0),
           f"two clean steps (interval 2) gave scale={scale.item()} tracker={tracker.item()}")


def _foreach() -> None:
    dst, src = [torch.zeros(2), torch.zeros(1, dtype=torch.float16)], [torch.ones(2), torch.ones(1)]
    tc.foreach_copy_(dst, src)
    _check("foreach_copy_", dst[0].tolist() == [1.0, 1.0] and dst[1].dtype is torch.float16
           and dst[1].item() == 1.0, f"copied into {dst}")
    tc.foreach_add_(dst, src)
    _check("foreach_add_", dst[0].tolist() == [2.0, 2.0], f"added into {dst}")
    tc.foreach_mul_(dst, torch.tensor(0.5))
    _check("foreach_mul_", dst[0].tolist() == [1.0, 1.0] and dst[1].dtype is torch.float16
           and dst[1].item() == 1.0, f"multiplied by a 0-dim tensor: {dst}")


def _unflatten() -> None:
    flat = torch.arange(10.0)
    views = tc.unflatten_dense_tensors(flat, [torch.zeros(2, 3, dtype=torch.bfloat16),
                                              torch.zeros(4, dtype=torch.bfloat16)])
    _check("unflatten_dense_tensors",
           [(tuple(v.shape), v.dtype) for v in views] == [((2, 3), torch.float32), ((4,), torch.float32)]
           and views[1].tolist() == [6.0, 7.0, 8.0, 9.0]
           and views[0].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(),
           f"views {views} of {flat} are not flat's, shaped like the tensors, back to back")


def _sparse_values() -> None:
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (2,),
                                   check_invariants=True)
    values = tc.sparse_values(grad)
    values.mul_(2)  # an uncoalesced gradient, unscaled in place through its values
    _check("sparse_values", not grad.is_coalesced() and grad.coalesce().to_dense().tolist() == [6.0, 0.0],
           f"the values {values} of an uncoalesced sparse tensor do not share its storage")


def _opt_state() -> None:
    names = {m.name for m in tc.OptState}
    _check("OptState", {"READY", "UNSCALED", "STEPPED"} <= names, f"members are {names}")


def _step_supports() -> None:
    fused = torch.optim.Adam([nn.Parameter(torch.ones(2))], fused=True)
    plain = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    _check("STEP_SUPPORTS_AMP_SCALING", getattr(fused, tc.STEP_SUPPORTS_AMP_SCALING, False) is True
           and not getattr(plain, tc.STEP_SUPPORTS_AMP_SCALING, False),
           "a fused Adam no longer marks itself with this attribute (or a plain SGD does)")


def _lr_scheduler_mark() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    _check("LR_SCHEDULER_MARK", getattr(optimizer.step, tc.LR_SCHEDULER_MARK, False) is True,
           "an LR scheduler no longer marks the optimizer.step it wrapped with this attribute")
    optimizer.step()
    _check("LR_SCHEDULER_STEP_CALLED",
           getattr(optimizer, tc.LR_SCHEDULER_STEP_CALLED, None) is True,
           "the scheduler's wrapper of optimizer.step no longer sets this attribute to True")


def _optimizer_step_function() -> None:
    class Kept(torch.optim.SGD):
        pass

    class Own(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)
    params = [nn.Parameter(torch.ones(1))]
    kept, own = Kept(params, lr=0.1), Own(params, lr=0.1)
    _check("optimizer_step_function",
           tc.optimizer_step_function(kept).__module__ == "torch.optim.sgd"
           and tc.optimizer_step_function(own).__module__ == __name__,
           "torch's wrapper around Optimizer.step no longer leads to the function it wraps")


def _step_pre_hook() -> None:
    seen = []
    param = nn.Parameter(torch.ones(1))
    param.grad = torch.ones(1)
    opt = torch.optim.SGD([param], lr=0.1)
    handle = tc.register_optimizer_step_pre_hook(lambda o, args, kwargs: seen.append(o))
    try:
        opt.step()
    finally:
        handle.remove()
    opt.step()
    _check("register_optimizer_step_pre_hook", seen == [opt],
           f"hook(optimizer, args, kwargs) saw {seen}; its handle must remove it")


def _event() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    event = tc.Event(device=device)
    _check("Event", hasattr(event, "record") and hasattr(event, "query"),
           f"torch.Event(device={device!r}) has no record()/query()")


def _state_dict_hooks() -> None:
    model = nn.Linear(2, 2)
    seen = []

    def post(module, state_dict, prefix, local_metadata):
        seen.append(("post", module, prefix))
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].double()

    def pre(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        seen.append(("pre", module, prefix))

    def after(module, incompatible_keys):
        seen.append(("after", module, list(incompatible_keys.missing_keys)))

    def before(module, prefix, keep_vars):
        seen.append(("before", module, prefix, keep_vars))

    handles = [tc.register_state_dict_pre_hook(model, before),
               tc.register_state_dict_post_hook(model, post),
               tc.register_load_state_dict_pre_hook(model, pre),
               tc.register_load_state_dict_post_hook(model, after)]
    saved = model.state_dict()
    model.load_state_dict({k: v.float() for k, v in saved.items()})
    for handle in handles:
        handle.remove()
    model.load_state_dict(model.state_dict())
    _check("register_load_state_dict_post_hook", seen[-1] == ("after", model, []),
           f"hook(module, incompatible_keys) after the load: {seen}")
    seen.remove(seen[-1])
    _check("register_state_dict_pre_hook", seen[0] == ("before", model, "", False),
           f"hook(module, prefix, keep_vars) first of the save: {seen}")
    seen.remove(seen[0])
    _check("register_state_dict_post_hook", ("post", model, "") in seen and saved["weight"].dtype
           is torch.float64, "hook(module, state_dict, prefix, local_metadata) did not edit the dict")
    _check("register_load_state_dict_pre_hook", ("pre", model, "") in seen and len(seen) == 2,
           f"hook(module, state_dict, prefix, ...) calls: {seen}; its handle must remove it")


def _swap_mode() -> None:
    previous = tc.swaps_params_on_load()
    torch.__future__.set_swap_module_params_on_conversion(not previous)
    try:
        flipped = tc.swaps_params_on_load()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    _check("swaps_params_on_load", isinstance(previous, bool) and flipped is (not previous),
           "torch.__future__.get_swap_module_params_on_conversion() does not read the setting")


def _local_slots() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.a, model.b = shared, shared
    model.register_parameter("w", nn.Parameter(torch.ones(1)))
    model.register_parameter("none", None)
    model.register_buffer("buf", torch.ones(1))
    _check("local_modules", list(tc.local_modules(model)) == ["a", "b"]
           and tc.local_modules(model)["b"] is shared, "a child in two slots is not listed twice")
    _check("local_parameters", list(tc.local_parameters(model)) == ["w", "none"]
           and tc.local_parameters(model)["none"] is None, "None slots are not kept")
    tc.local_buffers(model)["buf"] = torch.zeros(1)
    _check("local_buffers", model.buf.item() == 0, "writing a buffer slot does not set the buffer")


def _move_hooks() -> None:
    seen = []
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    handles = [old.register_forward_pre_hook(lambda m, a: seen.append(("pre", m))),
               old.register_forward_hook(lambda m, a, o: seen.append(("fwd", m)),
                                         always_call=True),
               old.register_full_backward_hook(lambda m, gi, go: seen.append(("bwd", m))),
               tc.register_state_dict_post_hook(old, lambda m, sd, p, meta: seen.append(("sd", m))),
               tc.register_load_state_dict_pre_hook(old, lambda m, *rest: seen.append(("load", m)))]
    tc.move_hooks(old, new)
    del old  # torch holds a load hook's module weakly: it must now be new
    new(torch.ones(1, 2, requires_grad=True)).sum().backward()
    new.load_state_dict(new.state_dict())
    _check("move_hooks", [kind for kind, m in seen if m is new] == ["pre", "fwd", "bwd", "sd", "load"],
           f"hooks seen on the new module: {seen}")
    for handle in handles:
        handle.remove()
    seen.clear()
    new(torch.ones(1, 2, requires_grad=True)).sum().backward()
    new.load_state_dict(new.state_dict())
    _check("move_hooks", not seen, f"the old handles did not remove the moved hooks: {seen}")


def _after_apply() -> None:
    params = tuple(inspect.signature(nn.Module._apply).parameters)[1:]
    _check("AfterApply", params == ("fn", "recurse"), f"nn.Module._apply takes {params}, not "
           "(fn, recurse)")
    seen = []

    class Probe(tc.AfterApply, nn.Linear):
        def after_apply(self, *, emptied: bool = False) -> None:
            seen.append((self.weight.dtype, emptied))

    nn.Sequential(Probe(2, 2)).to(torch.float64).half().to_empty(device="cpu")
    _check("AfterApply", seen == [(torch.float64, False), (torch.float16, False),
                                  (torch.float16, True)],
           f".to(float64)/.half()/.to_empty() of a parent gave after_apply calls seeing {seen}")


def _batch_norm_base() -> None:
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    others = (nn.InstanceNorm2d, nn.LayerNorm, nn.GroupNorm)
    _check("BatchNormBase", all(issubclass(t, tc.BatchNormBase) for t in norms)
           and not any(issubclass(t, tc.BatchNormBase) for t in others),
           "not the base of exactly the batch norms (BatchNorm1d/2d/3d, SyncBatchNorm)")


def _fsdp2() -> None:
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    module = tc.fsdp2()
    expected = "torch.distributed.fsdp" if tc.TORCH_VERSION >= (2, 6) else "torch.distributed._composable.fsdp"
    _check("fsdp2", module.__name__ == expected and all(
           hasattr(module, name) for name in ("fully_shard", "MixedPrecisionPolicy", "FSDPModule")),
           f"FSDP2 found in {module.__name__}, not {expected}")


def _ddp_ignore() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()) or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no group open")
    module = nn.Linear(2, 2)
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("sent", torch.zeros(1))
    tc.ddp_ignore(module, ["kept"])
    tc.ddp_ignore(module, ["kept"])  # merged, once
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(module)
        broadcast = {id(b) for b in ddp.modules_buffers}
        ok = id(module.kept) not in broadcast and id(module.sent) in broadcast
        del ddp
    finally:
        dist.destroy_process_group()
    _check("ddp_ignore", ok, "DDP no longer leaves the named buffers out of its broadcast")


def _scaled_mm() -> None:
    schema = torch.ops.aten._scaled_mm.default._schema
    args = [a.name for a in schema.arguments]
    _check("scaled_mm", args[:4] == ["self", "mat2", "scale_a", "scale_b"]
           and {"out_dtype", "use_fast_accum"} <= set(args),
           f"aten::_scaled_mm takes {args}")
    _check("scaled_mm", len(schema.returns) == 1, f"aten::_scaled_mm returns {schema.returns}, "
           "not one tensor")


def _cpu_capabilities() -> None:
    flags = tc.cpu_capabilities()
    _check("cpu_capabilities", isinstance(flags, dict), f"returned {type(flags).__name__}")
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() in ("x86_64", "AMD64") and cpuinfo.exists():
        has = " avx512_bf16" in cpuinfo.read_text()
        _check("cpu_capabilities", bool(flags.get("avx512_bf16")) == has,
               f"avx512_bf16={flags.get('avx512_bf16')!r} but /proc/cpuinfo says {has}")


CHECKS: dict[str, Callable[[], None]] = {
    "is_autocast_enabled": _autocast_switches, "set_autocast_enabled": _autocast_switches,
    "get_autocast_dtype": _autocast_switches, "set_autocast_dtype": _autocast_switches,
    "is_autocast_cache_enabled": _autocast_switches, "set_autocast_cache_enabled": _autocast_switches,
    "autocast_increment_nesting": _autocast_switches, "autocast_decrement_nesting": _autocast_switches,
    "clear_autocast_cache": _autocast_switches,
    "is_torch_function_mode_enabled": _torch_function_mode,
    "privateuse1_backend_name": _privateuse1, "resolve_autocast": _resolve_autocast,
    "is_compiling": _is_compiling, "functorch_active": _functorch_active,
    "dynamo_reset": _is_compiling, "graph_break": _graph_break,
    "uncompiled": _compiled_modules, "compiled_code_eager": _compiled_modules,
    "compile_tracing": _compile_tracing,
    "checkpoint_call": _checkpoint_call, "CheckpointCall": _checkpoint_call, "import_dynamo": _import_dynamo,
    "tensor_version": _tensor_version,
    "TorchDispatchMode": _dispatch_mode,
    "seeded_random": _seeded_random,
    "EagerDispatchMode": _eager_dispatch_mode, "aten_to_copy": _aten_to_copy,
    "cpu_attention": _cpu_fused_ops, "cpu_attention_backward": _cpu_fused_ops,
    "rnn_layer": _cpu_fused_ops, "rnn_layer_backward": _cpu_fused_ops, "trilinear": _trilinear,
    "unsafe_view": _unsafe_view, "make_wrapper_subclass": _wrapper_subclass,
    "disabled_torch_function_impl": _wrapper_subclass, "tree_map_only": _wrapper_subclass,
    "tree_leaves": _wrapper_subclass, "op_mutates": _wrapper_subclass,
    "group_tensors_by_device_and_dtype": _group_tensors,
    "amp_foreach_non_finite_check_and_unscale_": _unscale, "amp_update_scale_": _update_scale,
    "foreach_copy_": _foreach, "foreach_add_": _foreach, "foreach_mul_": _foreach, "sparse_values": _sparse_values,
    "unflatten_dense_tensors": _unflatten,
    "OptState": _opt_state,
    "STEP_SUPPORTS_AMP_SCALING": _step_supports, "LR_SCHEDULER_MARK": _lr_scheduler_mark,
    "LR_SCHEDULER_STEP_CALLED": _lr_scheduler_mark,
    "optimizer_step_function": _optimizer_step_function,
    "register_optimizer_step_pre_hook": _step_pre_hook, "Event": _event,
    "register_state_dict_pre_hook": _state_dict_hooks,
    "register_state_dict_post_hook": _state_dict_hooks,
    "register_load_state_dict_pre_hook": _state_dict_hooks,
    "register_load_state_dict_post_hook": _state_dict_hooks, "swaps_params_on_load": _swap_mode,
    "local_parameters": _local_slots, "local_buffers": _local_slots, "local_modules": _local_slots,
    "move_hooks": _move_hooks, "AfterApply": _after_apply, "BatchNormBase": _batch_norm_base, "fsdp2": _fsdp2,
    "scaled_mm": _scaled_mm, "ddp_ignore": _ddp_ignore,
    "cpu_capabilities": _cpu_capabilities,
}
_HELPERS = {"TORCH_VERSION", "TORCH_FLOOR", "TORCH_GE_2_12", "TORCH_PATHS", "parse_version",
            "check_floor", "resolve"}


def test_every_entry_has_a_behaviour_check():
    assert set(tc.__all__) - _HELPERS == set(CHECKS), "an entry without a check here, or a stale check"


@pytest.mark.parametrize("check", sorted(set(CHECKS.values()), key=lambda f: f.__name__),
                         ids=lambda f: f.__name__.lstrip("_"))
def test_entry_behaves(check):
    check()


def test_native_bf16_cpus_are_seen_as_such():
    """On torch 2.5 capability() read no flags at all: bf16 hardware recommended fp32."""
    _dtypes.capability.cache_clear()
    try:
        flags = tc.cpu_capabilities()
        expected = bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))
        assert _dtypes.capability("cpu").bf16 is expected
        cpuinfo = Path("/proc/cpuinfo")
        if platform.machine() == "x86_64" and cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text():
            assert _dtypes.capability("cpu").bf16 is True
    finally:
        _dtypes.capability.cache_clear()


def test_autocast_call_checks_callables_from_2_12():
    """ampkit.autocast()(x) refuses a non-callable on every torch; torch itself from 2.12."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.autocast("cpu")(torch.ones(1))
            raised = False
        except TypeError:
            raised = True
    _check("TORCH_GE_2_12", raised is tc.TORCH_GE_2_12,
           f"torch.autocast()(tensor) {'raises' if raised else 'does not raise'} TypeError")


# --- one place: no private torch API outside _torch_compat ----------------------------------
_SRC = Path(__file__).resolve().parents[1] / "src" / "ampkit"
# In code (comments and docstrings left out): a private name on a torch path (torch._x,
# torch.nn.modules.batchnorm._BatchNorm, torch.ops.aten._to_copy, from torch.x import _y),
# ._C, nn.Module's private slots, a sparse tensor's _values()/_indices(), overrides of
# torch's private methods (super()._apply, _should_skip_dynamo), and the private names
# imported from public modules, read by attribute name, or imported by dotted-path string.
_PRIVATE = re.compile(r"\b(?:torch|nn|aten)(?:\.\w+)*\._(?!_)\w+|\bfrom torch(?:\.\w+)* import _(?!_)\w+"
                      r"|\._C\b|\._(?:parameters|buffers|modules)\b|\._(?:values|indices)(?= \()"
                      r"|\bsuper \( \)\._(?!_)\w+|\bdef _should_skip_dynamo\b"
                      r"|\bgrad_scaler import OptState\b|\boptimizer import register_optimizer_step_pre_hook\b"
                      r"|\btorch\.Event\b")
_PRIVATE_STRINGS = {"'_step_supports_amp_scaling'", '"_step_supports_amp_scaling"'}
_PRIVATE_PATH_STRING = re.compile(r"""^[rRbBuU]?(["'])torch(?:\.\w+)*\._(?!_)\w+[\w.]*\1$""")


def _private_uses(source: str) -> list[str]:
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    code = " ".join(t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING))
    found = set(_PRIVATE.findall(code.replace(" . ", ".")))
    found |= {t.string for t in tokens if t.type == tokenize.STRING
              and (t.string in _PRIVATE_STRINGS or _PRIVATE_PATH_STRING.match(t.string))}
    return sorted(found)


@pytest.mark.parametrize("line", [
    "torch._foreach_copy_(a, b)", "torch._C._group_tensors_by_device_and_dtype([g], False)",
    "x = nn.modules.batchnorm._BatchNorm", "f = torch.ops.aten._to_copy.default",
    "from torch.utils._python_dispatch import TorchDispatchMode", "from torch.utils import _pytree",
    "from torch.amp.grad_scaler import OptState", "e = torch.Event(device=d)", "v = grad._values()",
    "for k in module._buffers: pass", "getattr(opt, '_step_supports_amp_scaling', False)",
    "m = importlib.import_module('torch.distributed._composable.fsdp')",
    "class M(nn.Linear):\n    def _apply(self, fn, recurse=True):\n        return super()._apply(fn, recurse)",
    "class M(TorchDispatchMode):\n    @classmethod\n    def _should_skip_dynamo(cls):\n        return False",
    "from torch.optim.optimizer import register_optimizer_step_pre_hook",
])
def test_the_scan_sees_each_private_form(line):
    assert _private_uses(line + "\n"), f"the scan misses: {line}"


@pytest.mark.parametrize("line", [
    "import torch", "print(torch.__version__)", "x = torch.float16", "def _apply(p): pass",
    "self._values = {}", '"""Calls torch._scaled_mm (a docstring)."""', "# torch._foreach_add_",
])
def test_the_scan_leaves_public_and_own_names(line):
    assert not _private_uses(line + "\n")


@pytest.mark.parametrize("path", sorted(p.relative_to(_SRC).as_posix() for p in _SRC.rglob("*.py")
                                        if p.name != "_torch_compat.py"))
def test_private_torch_apis_only_in_torch_compat(path):
    found = _private_uses((_SRC / path).read_text())
    assert not found, f"{path} uses {found} directly; add an entry to _torch_compat and use it"
