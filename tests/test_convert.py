"""convert.py: model casting, forward input/output casts, autocast region, fp32 state dicts."""

from __future__ import annotations

import collections
import dataclasses
import gc
import inspect
import pickle
import types
import weakref
from typing import NamedTuple, Optional

import pytest
import torch
from torch import nn

from ampkit.convert import (ForwardCasts, cast_floating, cast_model, conversion_of,
                            convert_model, remove_conversion)
from ampkit import initialize
from ampkit.autocast import region_factory
from ampkit.master import master_of
from ampkit.optim import attach_master_weights
from conftest import DEVICES, HALF_DTYPES, ModelOutputLike


class Pair(NamedTuple):
    a: torch.Tensor
    b: object


@dataclasses.dataclass(frozen=True)
class Frozen:
    h: torch.Tensor
    ids: torch.Tensor


def test_the_converted_forward_casts_dataclass_inputs_and_outputs():
    """Dataclass instances passed the forward casts uncast: a half model got fp32 inputs
    and handed half outputs back where fp32 was asked for."""
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, batch: Frozen) -> Frozen:
            return Frozen(self.lin(batch.h), batch.ids)

    torch.manual_seed(0)
    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    convert_model(model, param_dtype=torch.bfloat16,
                  casts=ForwardCasts(torch.bfloat16, torch.float32))
    batch = Frozen(torch.randn(2, 4), torch.arange(2))
    out = model(batch)
    assert type(out) is Frozen and out.h.dtype is torch.float32 and out.ids is batch.ids
    expected = reference.bfloat16()(Frozen(batch.h.bfloat16(), batch.ids)).h.float()
    assert torch.equal(out.h, expected)
    assert batch.h.dtype is torch.float32  # the caller's instance is left as it was


def _net(device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(device)


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_hooks)
               + len(m._load_state_dict_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_cast_floating_nested_structures(dtype):
    x, i = torch.ones(2), torch.ones(2, dtype=torch.int64)
    tree = {"list": [x, (x.double(), i)], "pair": Pair(x, "s"), 3: None,
            "od": collections.OrderedDict(y=x)}
    out = cast_floating(tree, dtype)
    assert out["list"][0].dtype == dtype and out["list"][1][0].dtype == dtype
    assert out["list"][1][1] is i  # integer tensors pass through
    assert isinstance(out["list"][1], tuple) and isinstance(out["pair"], Pair)
    assert out["pair"].a.dtype == dtype and out["pair"].b == "s" and out[3] is None
    assert type(out["od"]) is collections.OrderedDict and out["od"]["y"].dtype == dtype
    same = torch.ones(2, dtype=dtype)
    assert cast_floating(same, dtype) is same  # no copy when already in dtype


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_cast_model_keeps_batchnorm_fp32_and_param_identity(dtype):
    model = _net()
    params = list(model.parameters())
    model[0].weight.grad = torch.ones(4, 4)
    assert cast_model(model, dtype) is model
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    assert model[0].weight.dtype == dtype and model[0].weight.grad.dtype == dtype
    assert model[2].bias.dtype == dtype
    bn = model[1]
    assert bn.weight.dtype == bn.running_mean.dtype == bn.running_var.dtype == torch.float32
    assert bn.num_batches_tracked.dtype == torch.int64
    cast_model(model, dtype, keep_fp32=())
    assert bn.weight.dtype == bn.running_var.dtype == dtype
    assert bn.num_batches_tracked.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_forward_casts_inputs_and_outputs(device, dtype):
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.seen: list[torch.dtype] = []

        def forward(self, xs, *, extra):
            self.seen = [xs[0].dtype, extra["z"].dtype]
            return {"out": self.lin(xs[0]) + extra["z"], "n": xs[1]}

    model = TwoInputs().to(device)
    handle = convert_model(model, param_dtype=dtype, casts=ForwardCasts(dtype, torch.float32))
    x, n = torch.randn(2, 3, device=device), torch.arange(2, device=device)
    out = model([x, n], extra={"z": torch.randn(2, 3, device=device)})
    assert model.seen == [dtype, dtype]
    assert out["out"].dtype == torch.float32 and out["n"] is n
    # One converted forward, no forward hooks: torch calls the model on its fast path.
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert model.forward.__self__ is model
    handle.remove()
    assert _hook_count(model) == 0 and conversion_of(model) is None
    assert "forward" not in model.__dict__
    assert model([x.to(dtype), n], extra={"z": x.to(dtype)})["out"].dtype == dtype


def test_converted_forward_keeps_the_signature_a_forward_it_wrapped_and_a_later_wrapper():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, mask=None):
            return self.lin(x)

    model = Model()
    calls: list[str] = []

    def theirs(x, mask=None):  # someone's wrapper, set before the conversion
        calls.append("theirs")
        return Model.forward(model, x, mask)

    model.forward = theirs
    casts = ForwardCasts(output_dtype=torch.float64,
                         autocast=region_factory("cpu", torch.bfloat16))
    handle = convert_model(model, casts=casts)
    assert list(inspect.signature(model.forward).parameters) == ["x", "mask"]
    assert model(torch.ones(1, 2)).dtype == torch.float64 and calls == ["theirs"]
    assert model.forward(torch.ones(1, 2)).dtype == torch.float64  # a direct call too
    handle.remove()  # theirs is back
    assert model.forward is theirs and model(torch.ones(1, 2)).dtype == torch.float32
    # Wrapping model.forward.__func__ again and binding it (as accelerate does) keeps the casts.
    handle = convert_model(model, casts=casts)
    func = model.forward.__func__
    model.forward = types.MethodType(lambda self, *a, **k: func(self, *a, **k), model)
    assert model(torch.ones(1, 2)).dtype == torch.float64
    handle.remove()  # under a later wrapper ours stays, and passes calls through unconverted
    assert model(torch.ones(1, 2)).dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_autocast_region_entered_and_left_even_when_forward_raises(dtype):
    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.fail = False
            self.inner: list[object] = []

        def forward(self, x):
            y = self.lin(x)
            self.inner = [torch.is_autocast_enabled("cpu"), y.dtype]
            if self.fail:
                raise RuntimeError("boom")
            return y

    model = Probe()
    convert_model(model, casts=ForwardCasts(output_dtype=torch.float32,
                                            autocast=region_factory("cpu", dtype)))
    out = model(torch.ones(1, 2))
    assert model.inner == [True, dtype] and out.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(1, 2))
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_region_nests_in_recursive_calls():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner)
    region = ForwardCasts(autocast=region_factory("cpu", torch.bfloat16))
    convert_model(inner, casts=region)
    convert_model(outer, casts=region)
    assert outer(torch.ones(1, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_converting_again_replaces_the_earlier_hooks():
    model = _net()
    casts = ForwardCasts(torch.bfloat16, torch.float32,
                         autocast=region_factory("cpu", torch.bfloat16))
    first = convert_model(model, param_dtype=torch.bfloat16, casts=casts)
    count = _hook_count(model)
    second = convert_model(model, param_dtype=torch.bfloat16, casts=casts)
    assert _hook_count(model) == count and first.handles == [] and conversion_of(model) is second
    remove_conversion(model)
    assert _hook_count(model) == 0
    remove_conversion(model)  # a no-op without a conversion


def test_fp32_model_gets_no_state_dict_hooks():
    model = _net()
    convert_model(model, param_dtype=torch.float32)
    assert _hook_count(model) == 0
    assert model[0].weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_state_dict_is_fp32_for_a_half_model(dtype):
    model = _net()
    convert_model(model, param_dtype=dtype, keep_fp32=())
    state = model.state_dict()
    assert {k: v.dtype for k, v in state.items()} == {
        k: (torch.int64 if k.endswith("num_batches_tracked") else torch.float32) for k in state}
    assert torch.equal(state["0.weight"], model[0].weight.float())
    assert model[0].state_dict()["weight"].dtype == torch.float32  # a submodule's too
    fresh = _net()
    fresh.load_state_dict(state)  # loads into an fp32 model
    assert torch.equal(fresh[0].weight, model[0].weight.float())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one parameter under two names


def test_a_tied_half_parameter_is_one_fp32_tensor_in_the_state_dict():
    """Without masters (O3) each name got its own fp32 copy: torch.save and
    save_pretrained wrote the tied weight twice, and the two keys were no longer one."""
    model = _Tied()
    convert_model(model, param_dtype=torch.float16, keep_fp32=())
    state = model.state_dict()
    assert state["embed.weight"].dtype == torch.float32
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()
    again = model.state_dict()["head.weight"]  # another state dict: its own copy
    assert again.data_ptr() != state["head.weight"].data_ptr()
    with torch.no_grad():
        model.embed.weight.add_(1)
    model.state_dict(destination=state)  # written again: the values of now
    assert torch.equal(state["head.weight"], model.embed.weight.float())
    model.embed.weight.data.mul_(2)  # a change autograd's version count does not see
    model.state_dict(destination=state)
    assert torch.equal(state["head.weight"], model.embed.weight.float())
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_state_dict_saves_and_loads_the_fp32_masters(dtype):
    model = _net()
    convert_model(model, param_dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = attach_master_weights(optimizer)
    with torch.no_grad():
        masters.master_params[0].add_(1e-4)  # a value the half param cannot hold exactly
    state = model.state_dict()
    assert torch.equal(state["0.weight"], masters.master_params[0])
    assert not torch.equal(state["0.weight"], model[0].weight.float())
    loaded = {k: v.clone() + (0.5 if v.is_floating_point() else 0) for k, v in state.items()}
    model.load_state_dict(loaded)
    for key, master in (("0.weight", masters.master_params[0]), ("2.bias", masters.master_params[-1])):
        assert torch.equal(master, loaded[key])
    assert torch.equal(model[0].weight, loaded["0.weight"].to(dtype))
    assert torch.equal(model[1].weight, loaded["1.weight"])  # kept fp32: no master


def _o2_net():
    model = _net()
    convert_model(model, param_dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, attach_master_weights(optimizer)


def _snapshot(model, masters):
    return ([(p, p.detach().clone()) for p in model.parameters()],
            [m.detach().clone() for m in masters.master_params])


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_load_state_dict_with_assign_is_refused_before_anything_is_loaded(where):
    """assign=True put new tensors in place of the half params whose masters the
    optimizer steps: accepted silently, and training no longer reached the model."""
    model, optimizer, masters = _o2_net()
    target = model if where == "model" else model[2]
    loaded = {k: v + 1 if v.is_floating_point() else v for k, v in target.state_dict().items()}
    params, master_values = _snapshot(model, masters)
    with pytest.raises(ValueError, match=r"assign=True\) .* fp32 masters .*valid: assign=False"):
        target.load_state_dict(loaded, assign=True)
    assert all(p is q and torch.equal(q, v) for (p, v), q in zip(params, model.parameters()))
    assert all(torch.equal(m, v) for m, v in zip(masters.master_params, master_values))
    target.load_state_dict(loaded)  # without assign: copied into the masters
    assert torch.equal(masters.master_params[-1], loaded["bias"] if where == "submodule"
                       else loaded["2.bias"])


def test_load_state_dict_in_torchs_swap_mode_loads_the_masters():
    """torch's swap mode (load_state_dict swaps each param with swap_tensors) raised
    "Cannot swap t1 because it has weakref associated with it" for every param with a
    master, after the masters and params had taken the new values."""
    model, optimizer, masters = _o2_net()
    loaded = {k: v + 0.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    params = list(model.parameters())
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(loaded)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert all(p is q for p, q in zip(params, model.parameters()))  # swapped in place
    assert torch.equal(masters.master_params[0], loaded["0.weight"])
    assert torch.equal(model[0].weight, loaded["0.weight"].to(torch.bfloat16))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in loaded.items())  # the masters, still linked
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    masters.move_grads()
    optimizer.step()
    masters.copy_to_model()
    trained = masters.master_params[-2]  # the last layer's weight (its grad is never 0 here)
    assert trained is master_of(model[2].weight)
    assert torch.equal(model[2].weight, trained.to(torch.bfloat16))
    assert not torch.equal(trained, loaded["2.weight"])  # it trained


def test_swap_mode_works_while_a_state_dict_of_a_half_model_without_masters_lives():
    """A state dict of a half model without masters (O3) kept weak references to the
    parameters it copied: while it lived, swap-mode load_state_dict, .float() and .to()
    raised "Cannot swap t1 because it has weakref associated with it" (new-behaviour
    probe)."""
    model = _net()
    convert_model(model, param_dtype=torch.bfloat16)
    state = model.state_dict()  # alive through the swaps
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(state)
        model.float()
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert all(torch.equal(model.state_dict()[k].float(), v) for k, v in state.items()
               if v.is_floating_point())


def test_a_swap_mode_load_that_raises_leaves_every_master_linked():
    """A load that raised after a module's pre-hook had set its params' masters aside
    (for swap_tensors) left them unlinked: state_dict then saved the half params cast up
    instead of the fp32 masters. They stay linked, and the next load puts them back."""
    model, optimizer, masters = _o2_net()
    with torch.no_grad():
        masters.master_params[0].add_(1e-4)  # a value the half param cannot hold
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def refuse(*args):
        raise RuntimeError("a hook of another library")

    handle = model[2].register_load_state_dict_pre_hook(refuse)  # after 0's params
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="another library"):
            model.load_state_dict(saved)
        assert [master_of(p) for p in (model[0].weight, model[2].weight)] == [
            masters.master_params[0], masters.master_params[2]]
        assert torch.equal(model.state_dict()["0.weight"], masters.master_params[0])
        handle.remove()
        model.load_state_dict(saved)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    masters.move_grads()
    optimizer.step()
    masters.copy_to_model()
    assert torch.equal(model.state_dict()["2.weight"], masters.master_params[2])


@pytest.mark.parametrize("masters", [True, False], ids=["O2", "O3"])
def test_keep_vars_gives_variables_that_say_they_train_in_fp32(masters):
    """state_dict(keep_vars=True) gave detached masters (requires_grad False): the idiom
    that saves only the trained entries, ``{k: v ... if v.requires_grad}``, dropped every
    half parameter's. Now: the master itself (the variable the optimizer steps), or
    without masters an fp32 copy that trains as its parameter does."""
    model = _net()
    convert_model(model, param_dtype=torch.bfloat16)
    model[2].bias.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    found = attach_master_weights(optimizer).master_params if masters else []
    state = model.state_dict(keep_vars=True)
    trained = {k for k, v in state.items() if v.requires_grad}
    assert trained == {k for k, p in model.named_parameters() if p.requires_grad}
    assert "2.bias" not in trained and {v.dtype for k, v in state.items()
                                        if "num_batches" not in k} == {torch.float32}
    if masters:
        assert state["0.weight"] is found[0]
    assert model[1].weight is state["1.weight"]  # kept fp32: the Parameter, as torch gives
    assert all(not v.requires_grad for v in model.state_dict().values())  # detached as before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_half_model_cast_again_takes_inputs_in_its_new_dtype(dtype):
    """model.float() after O2 (to evaluate or export in fp32) failed: the converted
    forward went on casting inputs to half ("mat1 and mat2 must have the same dtype")."""
    model = _net()
    casts = ForwardCasts(input_dtype=torch.float16, output_dtype=torch.float32)
    convert_model(model, param_dtype=torch.float16, casts=casts)
    x = torch.randn(3, 4)
    half_out = model.eval()(x)
    model.to(dtype)
    expected = _net().to(dtype).eval()
    expected.load_state_dict(model.state_dict())
    out = model(x.to(dtype))
    assert out.dtype == torch.float32 and torch.equal(out, expected(x.to(dtype)).float())
    assert not torch.equal(out, half_out)
    copy = pickle.loads(pickle.dumps(model))  # the copy knows it was cast too
    assert torch.equal(copy(x.to(dtype)), out)


def test_a_wrapper_around_the_converted_forward_survives_converting_again():
    """accelerate-style: wrap model.forward.__func__ after one conversion, convert again:
    the casts run once and nothing recurses."""
    model = nn.Linear(2, 2)
    casts = ForwardCasts(output_dtype=torch.float64)
    convert_model(model, casts=casts)
    func = model.forward.__func__
    model.forward = types.MethodType(lambda self, *a, **k: func(self, *a, **k), model)
    convert_model(model, casts=casts)
    assert model(torch.ones(1, 2)).dtype == torch.float64


def test_a_converted_model_is_freed_without_the_cycle_collector():
    model = nn.Linear(2, 2)
    convert_model(model, param_dtype=torch.bfloat16,
                  casts=ForwardCasts(torch.bfloat16, torch.float32))
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None  # no reference cycle through model.forward
    finally:
        gc.enable()


def test_a_converted_model_exports():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    convert_model(model, casts=ForwardCasts(output_dtype=torch.float64,
                                            autocast=region_factory("cpu", torch.bfloat16)))
    x = torch.randn(2, 4)
    exported = torch.export.export(model, (x,), strict=False)  # (strict: test_autocast.py)
    assert exported.module()(x).dtype == torch.float64
    if torch.__version__ >= "2.11":  # earlier non-strict exports leave autocast regions out
        assert torch.equal(exported.module()(x), model(x))


@dataclasses.dataclass
class _WithAux:
    logits: torch.Tensor
    aux_loss: torch.Tensor = dataclasses.field(init=False, default=None)


def test_the_converted_forward_keeps_a_dataclass_field_set_after_construction():
    """An output whose init=False field the forward set after building it lost that field
    (None): the cast rebuilt it with dataclasses.replace, from its init fields only."""
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> _WithAux:
            out = _WithAux(self.lin(x))
            out.aux_loss = out.logits.pow(2).mean()
            return out

    torch.manual_seed(0)
    model = Model()
    convert_model(model, param_dtype=torch.bfloat16,
                  casts=ForwardCasts(torch.bfloat16, torch.float32))
    x = torch.randn(2, 4)
    out = model(x)
    logits = model.lin(x.bfloat16())
    assert out.logits.dtype is torch.float32 and out.aux_loss.dtype is torch.float32
    assert torch.equal(out.aux_loss, logits.pow(2).mean().float())


@dataclasses.dataclass
class _EncoderOutput(ModelOutputLike):
    last_hidden_state: Optional[torch.Tensor] = None


@dataclasses.dataclass
class _LMOutput(ModelOutputLike):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class _HFStyle(nn.Module):
    """transformers' habits: a ModelOutput out, and an earlier one in (T5's encoder_outputs),
    read by index."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, encoder_outputs: Optional[_EncoderOutput] = None):
        hidden = encoder_outputs[0] if encoder_outputs is not None else x
        logits = self.proj(hidden)
        return _LMOutput(loss=logits.float().pow(2).mean(), logits=logits)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_transformers_model_output_stays_one_in_and_out(level):
    """The casts made transformers' outputs plain dicts: out.loss, out[0], generate() and
    T5's encoder_outputs[0] failed under O1-O3, for nearly every HF model."""
    model = initialize(_HFStyle(), opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 8)
    out = model(x, encoder_outputs=_EncoderOutput(last_hidden_state=x))
    assert type(out) is _LMOutput and out[0] is out.loss and out["logits"] is out.logits
    expected = torch.float32 if level != "O3" else torch.bfloat16  # O3 casts no output
    assert out.logits.dtype is expected
    out.loss.backward()


class _PositionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4, 8))  # a position table
        self.fc = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.tensor(1.0))  # 0-dim

    def forward(self, x):
        return self.fc(x + self.pos) * self.gain


def test_a_load_pre_hook_registered_after_o2_reaches_the_masters():
    """The masters took their values in ampkit's own pre-hook, before a user's hook
    registered later had renamed or resized them: the next step (even at lr=0) copied the
    stale masters back over the loaded weights."""
    torch.manual_seed(0)
    model = _PositionNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)

    def rename(module, state_dict, prefix, *_):  # an old checkpoint's key
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")

    def resize(module, state_dict, prefix, *_):  # a 2-row table, interpolated to 4 rows
        table = state_dict[prefix + "pos"]
        state_dict[prefix + "pos"] = table.repeat_interleave(2, dim=0)

    model.fc.register_load_state_dict_pre_hook(rename)
    model.register_load_state_dict_pre_hook(resize)
    model.load_state_dict({"pos": torch.full((2, 8), 0.5), "fc.w": torch.full((8, 8), 0.25),
                           "fc.bias": torch.full((8,), 0.125),
                           "gain": torch.tensor([3.0])})  # (1,) into 0-dim, as torch allows
    opt.step()
    state = model.state_dict()
    assert torch.equal(state["fc.weight"], torch.full((8, 8), 0.25))
    assert torch.equal(state["pos"], torch.full((4, 8), 0.5))
    assert state["gain"].item() == 3.0 and state["gain"].shape == ()
    assert torch.equal(model.fc.weight, torch.full((8, 8), 0.25, dtype=torch.float16))
    assert model.gain.item() == 3.0


def test_a_refused_load_leaves_the_masters_as_the_parameters():
    """A value torch refuses (wrong shape) reaches neither the parameter nor its master."""
    torch.manual_seed(0)
    model = _PositionNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch for pos"):
        model.load_state_dict(dict(before, pos=torch.ones(2, 8)))
    assert torch.equal(model.state_dict()["pos"], before["pos"])


def test_a_load_that_raises_midway_leaves_the_masters_with_the_parameters():
    """With the masters written in the post-hook only, a child's hook that raised after
    torch had loaded the parent's parameters left the parent's masters old, and the next
    step copied them back over the loaded values."""
    torch.manual_seed(0)
    model = _PositionNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)

    def boom(*_):
        raise KeyError("a child's hook failed")

    handle = model.fc.register_load_state_dict_pre_hook(boom)
    with pytest.raises(KeyError, match="a child's hook failed"):
        model.load_state_dict({"pos": torch.full((4, 8), 0.5)}, strict=False)
    handle.remove()
    opt.step()
    assert torch.equal(model.pos, torch.full((4, 8), 0.5, dtype=torch.float16))
    assert torch.equal(master_of(model.pos), torch.full((4, 8), 0.5))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_head_added_after_initialize_saves_and_loads_fp32(level):
    """The state-dict hooks were installed once, on the modules initialize saw: a half head
    added since saved its half values, and under O2 a load never reached the master
    add_param_group gave it, so the next step wrote the old value back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    head = nn.Linear(4, 3).to(torch.bfloat16)
    model.append(head)
    opt.add_param_group({"params": head.parameters()})
    state = model.state_dict()
    assert {v.dtype for v in state.values()} == {torch.float32}
    if level == "O2":
        assert torch.equal(state["2.weight"], master_of(head.weight))
    state["2.weight"] = torch.full((3, 4), 0.3)  # not a bf16 value
    model.load_state_dict(state)
    model(torch.randn(2, 4)).float().sum().backward()
    opt.step()
    expected = torch.full((3, 4), 0.3)
    assert torch.equal(head.weight, expected.to(torch.bfloat16))
    assert torch.equal(model.state_dict()["2.weight"],
                       expected if level == "O2" else expected.to(torch.bfloat16).float())


def test_a_parametrization_added_after_o2_saves_its_master():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    weight = model[0].weight
    nn.utils.parametrizations.spectral_norm(model[0])  # moves the parameter, same object
    assert model[0].parametrizations.weight.original is weight
    with torch.no_grad():
        master_of(weight).add_(1e-3)  # a value bf16 cannot hold
    state = model.state_dict()
    assert torch.equal(state["0.parametrizations.weight.original"], master_of(weight))
    assert state["0.parametrizations.weight.original"].dtype == torch.float32


def test_hooks_for_added_modules_survive_pickling_and_a_second_initialize_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    model.append(nn.Linear(4, 4).to(torch.bfloat16))
    model.state_dict()
    count = _hook_count(model)
    copy = pickle.loads(pickle.dumps(model))
    copy.state_dict()
    copy.load_state_dict(copy.state_dict())
    assert _hook_count(copy) == count  # the copy's modules are marked as hooked already
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, opt2, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    model.state_dict()
    assert _hook_count(model) == count


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_functional_call_with_the_fp32_state_dict_runs_the_model_in_fp32(level):
    """The input cast followed the half parameter the conversion remembered, not the
    tensors functional_call put in its place: a dtype mismatch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    state = model.state_dict()
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain.load_state_dict(state)
    x = torch.randn(3, 4)
    out = torch.func.functional_call(model, state, (x,))
    assert out.dtype == torch.float32 and torch.equal(out, plain(x))
    assert model(x).dtype == (torch.float32 if level == "O2" else torch.bfloat16)


def test_an_o3_model_cast_back_with_float_returns_fp32_outputs():
    """The inputs followed .float(), but O3's half output cast stayed: outputs were rounded
    to bf16 where the docs promise an fp32 model for evaluation and export."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = initialize(model, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    model.float()
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    assert model(x).dtype == torch.float32 and torch.equal(model(x), plain(x))
    model.half()
    assert model(x).dtype == torch.float16


def test_keep_vars_masters_say_whether_their_parameter_trains_now():
    """A backbone frozen (or unfrozen) after initialize kept its master's flag from then: a
    'save only what trains' checkpoint (PEFT style) kept frozen weights or lost trained ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    model[0].requires_grad_(False)
    model[1].requires_grad_(True)
    trained = {k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad}
    assert trained == {"1.weight", "1.bias"}
    assert model.state_dict(keep_vars=True)["1.weight"] is master_of(model[1].weight)


def test_a_parametrization_added_since_is_not_evaluated_again_at_each_forward():
    """The converted forward read the remembered parameter with getattr: a parametrization
    added since ran once more per forward (spectral_norm: an extra power iteration)."""
    calls = []

    class Count(nn.Module):
        def forward(self, weight):
            calls.append(1)
            return weight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    nn.utils.parametrize.register_parametrization(model[0], "weight", Count())
    calls.clear()
    assert model(torch.randn(2, 4)).dtype == torch.float32
    assert len(calls) == 1
    model.float()  # the inputs still follow the parameter, through the parametrization
    assert model(torch.randn(2, 4)).dtype == torch.float32


def test_a_module_shared_by_two_converted_models_keeps_one_set_of_hooks_each():
    """The module's mark named one conversion: the other re-hooked it at every save."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    opt = torch.optim.SGD(list(a.parameters()) + list(b[1].parameters()), lr=0.1)
    initialize([a, b], opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    count = _hook_count(shared)
    for _ in range(3):
        a.load_state_dict(a.state_dict())
        b.load_state_dict(b.state_dict())
    assert _hook_count(shared) == count


def test_a_submodule_saved_alone_carries_no_other_module():
    """Its hooks held the conversion, whose handles and remembered parameter reached every
    module: torch.save of a 2x1000 head wrote the 1000x1000 layer too (2 MB)."""
    import io
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    out = io.BytesIO()
    torch.save(model[2], out)
    assert len(out.getvalue()) < 50_000  # the head's own 2,002 bf16 values, and pickle
    copy = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 1000)
    assert torch.equal(copy(x), model(x))
    copy.float()  # the copy finds the parameter its inputs follow by its path
    assert copy(x).dtype == torch.float32 and copy[0].weight.dtype == torch.float32
