"""keep.py: keep_fp32 — selected modules run in fp32 under any policy."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import pickle
from copy import deepcopy

import pytest
import torch
from torch import nn

import ampkit
from ampkit.fp8 import Float8Linear, convert_to_fp8

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x):
        h = self.norm(self.body(x))
        return self.head(h)


def _record(model: Net) -> None:
    """model.seen[name] = (input dtype, weight dtype, output dtype, autocast on in forward)."""
    def before(name):
        def fn(module, args):
            model.seen[name] = (args[0].dtype, torch.is_autocast_enabled("cpu"))
        return fn

    def after(name):
        def fn(module, args, output):
            dtype, autocast_on = model.seen[name]
            model.seen[name] = (dtype, module.weight.dtype, output.dtype, autocast_on)
        return fn
    for name in ("body.2", "head"):
        model.get_submodule(name).register_forward_pre_hook(before(name))
        model.get_submodule(name).register_forward_hook(after(name))


def test_a_kept_module_runs_in_fp32_inside_autocast_and_others_do_not():
    model = Net()
    _record(model)
    assert ampkit.keep_fp32(model, ["head"]) is model
    with ampkit.autocast("cpu", dtype=BF16):
        out = model(torch.randn(4, 16))
    assert model.seen["body.2"][2] == BF16
    assert model.seen["head"] == (F32, F32, F32, False)  # fp32 in, fp32 weights, no autocast
    assert out.dtype == F32 and torch.is_autocast_enabled("cpu") is False


def test_the_kept_output_equals_an_fp32_run_of_that_module_bitwise():
    model = Net()
    ampkit.keep_fp32(model, "head")
    x = torch.randn(4, 16)
    with ampkit.autocast("cpu", dtype=BF16):
        h = model.norm(model.body(x))
        out = model.head(h)
    assert torch.equal(out, torch.nn.functional.linear(h.float(), model.head.weight, model.head.bias))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_kept_modules_keep_fp32_params_under_half_policies(level):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=F16, verbosity=0,
                                   keep_fp32=["head", "norm"])
    assert model.body[0].weight.dtype == F16
    assert model.head.weight.dtype == F32 and model.norm.weight.dtype == F32
    out = model(torch.randn(4, 16))  # half body, fp32 norm and head: runs
    assert out.dtype == (F32 if level == "O2" else F16)
    if level == "O2":  # masters only for the half params
        masters = ampkit.master_params(opt)
        assert sum(1 for p in masters if p is model.head.weight) == 1


def test_a_kept_module_in_the_middle_of_a_half_model_hands_half_on():
    model = Net()
    ampkit.keep_fp32(model, "body.2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    _record(model)
    model(torch.randn(4, 16))
    assert model.seen["body.2"] == (F32, F32, BF16, False)  # fp32 inside, half out again


def test_patterns_types_and_callables_select_and_again_replaces():
    model = Net()
    ampkit.keep_fp32(model, "body.*")
    from ampkit.keep import kept_names
    assert kept_names(model) == ["body.0", "body.1", "body.2"]
    ampkit.keep_fp32(model, nn.LayerNorm)
    assert kept_names(model) == ["norm"]
    ampkit.keep_fp32(model, lambda name, m: name == "head")
    assert kept_names(model) == ["head"]
    ampkit.keep_fp32(model, [])
    assert kept_names(model) == [] and not model.head._forward_pre_hooks
    assert not any("forward" in m.__dict__ for m in model.modules())  # the class's again


def test_a_pattern_that_matches_nothing_names_real_modules():
    model = Net()
    with pytest.raises(ValueError, match=r"pattern 'haed' matches no module of Net; valid: .*"
                                         r"'body', 'body.0'"):
        ampkit.keep_fp32(model, ["head", "haed"])
    with pytest.raises(ValueError, match=r"pattern 'lm_head' matches no module"):
        ampkit.initialize(model, opt_level="O2", keep_fp32=["lm_head"])
    assert model.body[0].weight.dtype == F32  # refused before anything changed


def test_bad_selectors_and_late_calls_are_refused():
    model = Net()
    with pytest.raises(TypeError, match=r"3 is not a module selector"):
        ampkit.keep_fp32(model, [3])
    ampkit.initialize(model, opt_level="O3", half_dtype=BF16, verbosity=0)
    with pytest.raises(ValueError, match=r"'head' already has half parameters"):
        ampkit.keep_fp32(model, "head")


def test_keeping_a_module_already_in_fp8_is_refused():
    """It was accepted, and the layer went on computing in fp8 behind fp32 outputs."""
    model = Net()
    convert_to_fp8(model, recipe=ampkit.fp8.Float8Config("tensorwise", emulate=True))
    with pytest.raises(ValueError, match=r"module 'body' already computes in fp8 \('body.0'.*"
                                         r"valid: keep it in fp32 before convert_to_fp8"):
        ampkit.keep_fp32(model, ["head", "body"])
    assert ampkit.keep.kept_names(model) == []  # refused before anything changed
    with pytest.raises(ValueError, match=r"^keep_fp32= argument: module 'head' already "
                                         r"computes in fp8.*valid: keep it in fp32 before"):
        ampkit.initialize(model, opt_level="O2", keep_fp32=["head"], verbosity=0)
    assert model.head.weight.dtype == F32 and ampkit.keep.kept_names(model) == []


def test_convert_to_fp8_skips_kept_modules():
    model = Net()
    ampkit.keep_fp32(model, "head")
    convert_to_fp8(model)
    assert isinstance(model.body[0], Float8Linear) and type(model.head) is nn.Linear


def test_state_dict_round_trip_and_pickling_keep_the_selection():
    model = Net()
    ampkit.keep_fp32(model, "head")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    state = model.state_dict()
    fresh = Net()
    fresh.load_state_dict(state)
    assert all(torch.equal(state[k], v) for k, v in fresh.state_dict().items())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    _record(copy)
    copy(torch.randn(2, 16))
    assert copy.seen["head"][:2] == (F32, F32)


def test_compiled_model_runs_kept_modules_in_fp32():
    model = Net()
    ampkit.keep_fp32(model, "head")
    x = torch.randn(4, 16)
    with ampkit.autocast("cpu", dtype=BF16):
        eager = model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with ampkit.autocast("cpu", dtype=BF16):
        out = compiled(x)
    assert out.dtype == F32 and torch.equal(out, eager)


def _region_inside(model: nn.Module, region: str):
    """``model(x)`` inside an autocast region written in the function (torch's or ampkit's)."""
    make = torch.autocast if region == "torch" else ampkit.autocast

    def step(x):
        with make("cpu", dtype=BF16):
            return model(x)
    return step


def _backward_autocast_off() -> contextlib.AbstractContextManager:
    """The dynamo of torch 2.5 to 2.11 enters a ``with ampkit.autocast`` written inside a
    compiled function eagerly (it cannot trace the switches), so the model compiles as
    under a region outside it, whose backward torch reruns under the forward's autocast
    (pytorch#179804): the kept modules' backward in half. The documented setting turns
    that off; torch 2.13 traces the region and needs none."""
    import torch._functorch.config as functorch_config
    if not hasattr(functorch_config, "backward_pass_autocast"):
        return contextlib.nullcontext()
    return functorch_config.patch(backward_pass_autocast="off")


def _outputs_and_grads(step, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = step(x)
    out.float().pow(2).sum().backward()
    return [out] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("region, fullgraph", [("torch", True), ("torch", False),
                                               ("ampkit", False)])
def test_an_autocast_region_inside_a_compiled_function_runs_kept_modules_as_eagerly(
        region, fullgraph):
    """keep_fp32 switched autocast off in a pre-hook and on again in a forward hook; dynamo
    could not reconcile that split region with a torch.autocast region of the compiled
    function: torch 2.13 raised "Global autocast(cpu)_enabled state changed while dynamo
    tracing" (fullgraph or not), 2.11 could not trace the switches (fullgraph raised)."""
    eager, compiled = Net(), Net()
    for model in (eager, compiled):
        ampkit.keep_fp32(model, ["norm", "head"])
    x = torch.randn(4, 16)
    expected = _outputs_and_grads(_region_inside(eager, region), eager, x)
    torch._dynamo.reset()
    step = torch.compile(_region_inside(compiled, region), backend="aot_eager",
                         fullgraph=fullgraph)
    with _backward_autocast_off() if region == "ampkit" else contextlib.nullcontext():
        got = _outputs_and_grads(step, compiled, x)
    assert got[0].dtype == F32 and all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(step(x), expected[0])  # the cached graph too


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_compiled_model_with_kept_modules_is_one_graph_equal_to_eager(level):
    """O1's forward region is torch.autocast in a with statement while dynamo traces, so
    a compiled O1 model with kept modules failed as a region written inside did (torch
    2.13: "Global autocast state changed while dynamo tracing"; 2.11: no single graph)."""
    model = Net()
    model = ampkit.initialize(model, opt_level=level, half_dtype=BF16, verbosity=0,
                              keep_fp32=["norm", "head"])
    x = torch.randn(4, 16)
    expected = model(x)
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_a_compiled_model_with_kept_modules_compiles_once_when_compiled_first():
    """The kept region made its per-thread stack at the first call, and the first graph,
    guarded on its absence, was compiled again at the second."""
    model = ampkit.initialize(Net(), opt_level="O1", half_dtype=BF16, verbosity=0,
                              keep_fp32=["norm", "head"])
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(3):
        compiled(torch.randn(4, 16)).float().sum().backward()
    assert len(graphs) == 1


class _MatmulHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return torch.mm(x, self.weight)


@pytest.mark.parametrize("region, fullgraph", [("torch", True), ("ampkit", False)])
def test_a_registered_half_function_stays_off_in_a_kept_module_of_a_compiled_region(
        region, fullgraph):
    """The kept region pushed an ampkit frame while dynamo traced: with overrides registered
    and not in place that broke the graph (fullgraph=True raised), and under a region
    written inside the compiled function the kept module's mm came out in half."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _MatmulHead())
    ampkit.keep_fp32(model, ["1"])
    ampkit.register_half_function(torch, "mm")
    step = _region_inside(model, region)
    x = torch.randn(4, 16)
    expected = step(x)
    torch._dynamo.reset()
    out = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x)
    assert expected.dtype == F32 and out.dtype == F32 and torch.equal(out, expected)


@pytest.mark.parametrize("selector", ["", nn.Linear, lambda name, m: name == ""],
                         ids=["name", "type", "callable"])
def test_the_root_can_be_selected_and_runs_in_fp32(selector):
    """named_modules() names the root ''; it was refused by name and silently skipped by
    a type or callable that matched only it."""
    layer = nn.Linear(16, 16)
    ampkit.keep_fp32(layer, selector)
    from ampkit.keep import kept_names
    assert kept_names(layer) == [""]
    x = torch.randn(4, 16)
    with ampkit.autocast("cpu", dtype=BF16):
        out = layer(x)
    assert out.dtype == F32 and torch.equal(out, torch.nn.functional.linear(x, layer.weight,
                                                                           layer.bias))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_kept_root_trains_the_whole_model_in_fp32_under_every_level(level):
    model, reference = Net(), Net()
    ampkit.keep_fp32(model, "")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=F16, verbosity=0)
    x = torch.randn(4, 16)
    assert all(p.dtype == F32 for p in model.parameters())
    out = model(x)
    assert out.dtype == F32 and torch.equal(out, reference(x))
    with pytest.raises(ValueError, match=r"root module \(''\) of a model whose forward"):
        ampkit.keep_fp32(ampkit.initialize(Net(), opt_level="O1", verbosity=0), "")


def test_a_container_whose_children_were_cast_is_refused_unchanged():
    """Only the container's own parameters were checked: its half children then got fp32
    inputs and the next forward raised a dtype mismatch."""
    model = Net()
    model = ampkit.initialize(model, opt_level="O2", half_dtype=BF16, verbosity=0)
    with pytest.raises(ValueError, match=r"module 'body' already has half parameters "
                                         r"\('body.0.weight'"):
        ampkit.keep_fp32(model, "body")
    from ampkit.keep import kept_names
    assert kept_names(model) == [] and model(torch.randn(2, 16)).dtype == F32


@pytest.mark.parametrize("new", [[], ["body.1"]], ids=["cleared", "replaced"])
def test_a_module_kept_fp32_in_a_half_model_cannot_leave_the_selection(new):
    """Its hooks were removed while its parameters stayed fp32: half inputs then met fp32
    weights in the next forward."""
    model = ampkit.initialize(Net(), opt_level="O2", half_dtype=BF16, verbosity=0,
                              keep_fp32=["head"])
    with pytest.raises(ValueError, match=r"module 'head' keeps fp32 parameters in a half "
                                         r"model .* valid: a selection that still holds it"):
        ampkit.keep_fp32(model, new)
    from ampkit.keep import kept_names
    assert kept_names(model) == ["head"] and model(torch.randn(2, 16)).dtype == F32
    ampkit.keep_fp32(model, ["head", "body.1"])  # adding fp32-clean modules stays allowed
    assert kept_names(model) == ["body.1", "head"]


def test_a_module_instance_is_not_taken_for_a_callable_selector():
    model = Net()
    with pytest.raises(TypeError, match=r"Linear\(in_features=32.* is not a module selector"):
        ampkit.keep_fp32(model, model.head)


def test_outside_autocast_a_model_without_half_inputs_runs_as_it_would_unkept():
    """keep_fp32 cast every input to fp32 even with no autocast region and no half input:
    a float64 model failed ("mat1 and mat2 must have the same dtype"), and a meta-device
    model (shape inference) failed asking for an autocast the meta device has not."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = model(x)
    ampkit.keep_fp32(model, "1")
    assert torch.equal(model(x), expected) and model(x).dtype == torch.float64
    meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to("meta")
    ampkit.keep_fp32(meta, "1")
    out = meta(torch.empty(3, 4, device="meta"))
    assert out.shape == (3, 2) and out.device.type == "meta"
    with ampkit.autocast("cpu", dtype=BF16):  # inside a region: the kept module in fp32
        net = Net()
        ampkit.keep_fp32(net, "head")
        assert net(torch.randn(2, 16)).dtype == F32


class _KeywordCaller(nn.Module):
    """Calls its kept block with the half tensor as a keyword (``block(hidden_states=h)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8))

    def forward(self, x):
        return self.block(input=self.lin(x))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_half_input_given_by_keyword_is_cast_for_the_kept_module(level):
    """The no-op path outside autocast looked at positional inputs only: a half input
    given by keyword reached the kept fp32 module uncast (a dtype mismatch)."""
    model = _KeywordCaller()
    ampkit.keep_fp32(model, ["block"])
    ampkit.initialize(model, opt_level=level, half_dtype=F16, verbosity=0)
    assert model.block[0].weight.dtype == F32 and model.lin.weight.dtype == F16
    out = model(torch.randn(2, 8))
    assert out.dtype == (F32 if level == "O2" else F16)  # O2 casts outputs to fp32


def _embedder(nested: bool = False) -> nn.Module:
    """Token ids -> an embedding (in a block of its own when ``nested``) -> a linear."""
    torch.manual_seed(0)
    embed: nn.Module = nn.Embedding(10, 8)
    if nested:
        embed = nn.Sequential(embed, nn.Linear(8, 8))
    return nn.Sequential(embed, nn.Linear(8, 4))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_kept_module_fed_only_token_ids_hands_the_policys_half_dtype_on(level):
    """Its outputs went back to "the half dtype its inputs had": token ids have none, so
    the half linear after a kept fp32 embedding got fp32 ("mat1 and mat2 must have the
    same dtype"). With no floating input, the dtype of the half model around decides."""
    model = _embedder()
    ampkit.keep_fp32(model, ["0"])
    ampkit.initialize(model, opt_level=level, half_dtype=BF16, verbosity=0)
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    assert model[0].weight.dtype == F32 and model[1].weight.dtype == BF16
    expected = model[1](model[0].weight[ids].bfloat16())
    out = model(ids)
    assert out.dtype == (F32 if level == "O2" else BF16)  # O2 casts outputs to fp32
    assert torch.equal(out, expected.to(out.dtype))
    ampkit.keep_fp32(model, ["0"])  # selected again after initialize: still knows the dtype
    assert torch.equal(model(ids), out)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, backend="eager", fullgraph=True)(ids), out)
    for copy in (pickle.loads(pickle.dumps(model)), deepcopy(model)):
        assert torch.equal(copy(ids), out)  # the copies know the dtype around too
    model.float()  # cast again by the user: fp32 around it, so nothing goes back to half
    fp32 = torch.nn.functional.linear(model[0].weight[ids], model[1].weight, model[1].bias)
    assert torch.equal(model(ids), fp32)  # O3's half output cast follows .float() too


def test_a_kept_module_inside_a_kept_module_stays_fp32_for_it():
    """Inside a kept block the model around is fp32: a kept embedding there must not hand
    the policy's half dtype to the block's fp32 layers."""
    model = _embedder(nested=True)
    ampkit.keep_fp32(model, ["0", "0.0"])
    ampkit.initialize(model, opt_level="O3", half_dtype=BF16, verbosity=0)
    ids = torch.tensor([1, 2, 3])
    expected = model[1](model[0][1](model[0][0].weight[ids]).bfloat16())
    out = model(ids)
    assert out.dtype == BF16 and torch.equal(out, expected)


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _FrozenHidden:
    h: torch.Tensor


class _DataclassNet(nn.Module):
    """A block returning ``kind(h)`` and a head taking it."""

    def __init__(self, kind: type) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.block = nn.Linear(8, 8)
        self.head = _HeadOf()

    def forward(self, x):
        return self.head(self.kind(self.block(x)))


class _HeadOf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, hidden):
        return self.lin(hidden.h)


class _BlockOut(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(8, 8)

    def forward(self, x):
        return self.kind(self.lin(x))


@pytest.mark.parametrize("kind", [_Hidden, _FrozenHidden])
def test_a_dataclass_input_is_cast_to_fp32_inside_autocast(kind):
    """A dataclass holding a bf16 tensor reached the kept fp32 head uncast (a dtype
    mismatch): cast_tree passed dataclass instances through."""
    model = _DataclassNet(kind)
    ampkit.keep_fp32(model, ["head"])
    x = torch.randn(2, 8)
    with ampkit.autocast("cpu", dtype=BF16):
        h = model.block(x)
        out = model(x)
    assert h.dtype == BF16 and out.dtype == F32
    assert torch.equal(out, torch.nn.functional.linear(h.float(), model.head.lin.weight,
                                                       model.head.lin.bias))


@pytest.mark.parametrize("kind", [_Hidden, _FrozenHidden])
def test_a_dataclass_output_goes_back_to_half_under_o2(kind):
    """A kept block's dataclass output stayed fp32 under O2: the half head after it failed."""
    model = nn.Sequential(_BlockOut(kind), _HeadOf())
    ampkit.keep_fp32(model, ["0"])
    ampkit.initialize(model, opt_level="O3", half_dtype=BF16, verbosity=0)
    x = torch.randn(2, 8)
    expected = model[1].lin(model[0].lin(x.bfloat16().float()).bfloat16())
    out = model(x)
    assert out.dtype == BF16 and torch.equal(out, expected)


@pytest.mark.parametrize("dtype, autocast", [(BF16, False), (F16, False), (BF16, True),
                                             (torch.float64, True)])
def test_a_kept_module_cast_since_by_the_user_runs_as_unkept(dtype, autocast):
    """After keep_fp32, model.to(dtype) cast the kept module's parameters but its region
    still cast the inputs to fp32 (a dtype mismatch). Its parameters' dtype is what the
    user asked last: it runs as without keep_fp32, and is kept again once fp32."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    kept = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    kept.load_state_dict(plain.state_dict())
    ampkit.keep_fp32(kept, ["2"])
    x = torch.randn(2, 16)
    with ampkit.autocast("cpu", dtype=BF16, enabled=autocast):
        expected = plain.to(dtype)(x.to(dtype))
        out = kept.to(dtype)(x.to(dtype))
        assert out.dtype == expected.dtype and torch.equal(out, expected)
        if autocast:
            torch._dynamo.reset()
            compiled = torch.compile(kept, backend="eager", fullgraph=True)(x.to(dtype))
            assert torch.equal(compiled, expected)
        kept.float()
        assert kept(x).dtype == F32  # kept again: fp32 out even inside autocast


class _Tied(nn.Module):
    """One module under two names: ``dec`` is ``enc``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 8)
        self.dec = self.enc
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.dec(self.enc(x)))


def test_a_module_used_under_two_names_is_selected_by_either():
    """named_modules() lists a shared module once, so keep_fp32(model, ["dec"]) said
    "matches no module"; each name now selects it, recorded once under its first name."""
    from ampkit.keep import kept_names
    model = _Tied()
    assert kept_names(ampkit.keep_fp32(model, ["dec"])) == ["enc"]
    assert kept_names(ampkit.keep_fp32(model, ["enc", "dec"])) == ["enc"]
    assert kept_names(ampkit.keep_fp32(model, "*c")) == ["enc"]
    assert len(model.enc._forward_pre_hooks) == 1
    x = torch.randn(2, 8)
    with ampkit.autocast("cpu", dtype=BF16):
        h = model.enc(x)
        out = model(x)
    assert h.dtype == F32 and out.dtype == BF16
    with pytest.raises(ValueError, match=r"pattern 'decoder' matches no module.*'enc', 'dec'"):
        ampkit.keep_fp32(model, ["decoder"])


class _TiedLM(nn.Module):
    """GPT-2's layout: the output layer's weight is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.ln = nn.Embedding(16, 8), nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(self.wte(ids)))


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("kept, other", [(["lm_head"], "wte"), (["wte"], "lm_head")])
@pytest.mark.parametrize("when", ["initialize", "before"])
def test_keeping_one_side_of_a_tied_weight_is_refused_under_a_half_cast(level, kept, other,
                                                                        when):
    """The shared weight got one dtype, and the other module met the wrong one: GPT-2 with
    lm_head kept crashed at its first forward (mat1 and mat2 dtypes), and with wte kept
    ran with the module asked to stay fp32 in bf16, without a word."""
    model = _TiedLM()
    optimizer = torch.optim.AdamW(model.parameters())
    if when == "before":
        ampkit.keep_fp32(model, kept)
    with pytest.raises(ValueError, match=rf"^keep_fp32: '{kept[0]}' is kept in fp32, but its "
                                         rf"parameter '{kept[0]}.weight' is also "
                                         rf"'{other}.weight', outside the selection, which the "
                                         rf"policy casts to torch.bfloat16; .* valid: keep both "
                                         rf"'{kept[0]}' and '{other}' in fp32, or neither$"):
        ampkit.initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16,
                          keep_fp32=kept if when == "initialize" else None, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    both = ampkit.initialize(_TiedLM(), opt_level=level, half_dtype=torch.bfloat16,
                             keep_fp32=["wte", "lm_head"], verbosity=0)
    out = both(torch.tensor([[1, 2]]))  # kept together: it runs (O3 casts no output)
    assert out.dtype == (torch.float32 if level == "O2" else torch.bfloat16)


# --- transformers' declared fp32 modules -------------------------------------------------------
class _DenseActDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))


class _T5Like(nn.Module):
    """transformers' T5 declares its feed-forward output layers fp32 (they overflow fp16)."""
    _keep_in_fp32_modules = ["wo"]

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleList([_DenseActDense() for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.block:
            x = x + block(x)
        return self.head(x)


def _declared_warnings(model, **kwargs):
    import warnings
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ampkit.initialize(model, opt, verbosity=0, **kwargs)
    return [str(w.message) for w in record if "declares" in str(w.message)]


def test_a_model_declaring_fp32_modules_warns_when_o2_fp16_would_cast_them():
    """T5 under O2 fp16 cast its `wo` layers to fp16 without a word, where transformers
    itself keeps them fp32; the warning gives the keep_fp32 that does."""
    model = _T5Like()
    assert _declared_warnings(model, opt_level="O2", half_dtype=torch.float16) == [
        "ampkit: _T5Like declares _keep_in_fp32_modules=['wo']: transformers keeps those fp32 "
        "when it loads the model in torch.float16 (they can overflow or lose precision there), "
        "but this policy casts 4 of them ('block.0.wo.weight', ...) to torch.float16; to keep "
        "them fp32 (with the rest of the modules holding them), pass keep_fp32=['*.wo'] to "
        "ampkit.initialize (or call ampkit.keep_fp32(model, ['*.wo']) first)"]
    assert model.block[0].wo.weight.dtype == torch.float16  # a warning: the cast is apex's


def test_declared_fp32_modules_kept_bf16_or_fp32_params_do_not_warn():
    assert _declared_warnings(_T5Like(), opt_level="O2", half_dtype=torch.float16,
                              keep_fp32=["*.wo"]) == []
    assert _declared_warnings(_T5Like(), opt_level="O2", half_dtype=torch.bfloat16) == []
    assert _declared_warnings(_T5Like(), opt_level="O1", half_dtype=torch.float16) == []


def test_strictly_declared_fp32_modules_warn_under_bf16_too():
    model = _T5Like()
    model._keep_in_fp32_modules, model._keep_in_fp32_modules_strict = None, ["head"]
    warned = _declared_warnings(model, opt_level="O3", half_dtype=torch.bfloat16)
    assert len(warned) == 1 and "_keep_in_fp32_modules_strict=['head']" in warned[0]
    assert "keep_fp32=['head']" in warned[0]


def test_a_dotted_declared_module_is_matched_by_its_whole_name():
    model = nn.Sequential(collections.OrderedDict(
        tower=nn.Sequential(collections.OrderedDict(proj=nn.Linear(4, 4))),
        proj=nn.Linear(4, 4)))
    model._keep_in_fp32_modules_strict = ["tower.proj"]
    warned = _declared_warnings(model, opt_level="O2", half_dtype=torch.bfloat16)
    assert len(warned) == 1 and "casts 2 of them ('tower.proj.weight', ...)" in warned[0]
    assert "keep_fp32=['*.proj']" in warned[0]  # exactly tower.proj: the root's proj is 'proj'


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(4))  # DeepSeek-V3's


def test_a_declared_parameter_is_matched_by_its_name_and_its_module_suggested():
    """transformers matches entries against parameter names: DeepSeek-V3 declares its
    router's bias, which a match over module names missed (no warning under bf16)."""
    model = nn.Sequential(collections.OrderedDict(
        layers=nn.ModuleList([nn.ModuleDict({"gate": _Router(), "up": nn.Linear(8, 8)})
                              for _ in range(2)])))
    model._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    warned = _declared_warnings(model, opt_level="O2", half_dtype=torch.bfloat16)
    assert len(warned) == 1
    assert "casts 2 of them ('layers.0.gate.e_score_correction_bias', ...)" in warned[0]
    assert "keep_fp32=['*.gate']" in warned[0]
    kept = nn.Sequential(collections.OrderedDict(layers=nn.ModuleList(
        [nn.ModuleDict({"gate": _Router(), "up": nn.Linear(8, 8)}) for _ in range(2)])))
    kept._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    assert _declared_warnings(kept, opt_level="O2", half_dtype=torch.bfloat16,
                              keep_fp32=["*.gate"]) == []
    assert kept.layers[0].gate.e_score_correction_bias.dtype == torch.float32


def test_a_declared_parameter_of_the_model_itself_says_only_the_whole_model_keeps_it():
    model = _T5Like()
    model._keep_in_fp32_modules = ["query_tokens"]  # Blip-2's, on the model itself
    model.query_tokens = nn.Parameter(torch.zeros(2, 8))
    warned = _declared_warnings(model, opt_level="O2", half_dtype=torch.float16)
    assert len(warned) == 1 and warned[0].endswith(
        "casts 1 of them ('query_tokens', ...) to torch.float16; ['query_tokens'] belongs to "
        "the declaring model itself, and keep_fp32 keeps whole modules: only keeping the whole "
        "model ('') would keep it")


def test_declared_parameters_of_the_model_itself_are_named_beside_the_modules_advised():
    """Blip-2 declares its qformer and its own query_tokens: the advice kept the qformer
    and the warning said nothing more of query_tokens, which stayed half."""
    model = _T5Like()
    model._keep_in_fp32_modules = ["wo", "query_tokens"]
    model.query_tokens = nn.Parameter(torch.zeros(2, 8))
    warned = _declared_warnings(model, opt_level="O2", half_dtype=torch.float16)
    assert len(warned) == 1 and "pass keep_fp32=['*.wo']" in warned[0]
    assert warned[0].endswith("; ['query_tokens'] belongs to the declaring model itself, and "
                              "keep_fp32 keeps whole modules: only keeping the whole model "
                              "('') would keep it")
    wrapper = nn.Sequential(collections.OrderedDict(backbone=model))  # the review's case
    model._keep_in_fp32_modules = {"query_tokens", "wo"}  # a set, as transformers makes it
    warned = _declared_warnings(wrapper, opt_level="O2", half_dtype=torch.float16)
    assert "declares _keep_in_fp32_modules=['query_tokens', 'wo']" in warned[0]
    assert "pass keep_fp32=['*.wo']" in warned[0]
    assert warned[0].endswith("['backbone.query_tokens'] belongs to the declaring model itself, "
                              "and keep_fp32 keeps whole modules: only keeping the whole of "
                              "'backbone' would keep it")


def test_both_declarations_and_a_declaring_model_inside_a_wrapper_are_warned_about():
    """The second list of a model declaring both got no warning (one warn-once key for
    both), and a transformers model inside a wrapper module none at all."""
    t5 = _T5Like()
    t5._keep_in_fp32_modules_strict = ["head"]
    wrapper = nn.Sequential(collections.OrderedDict(backbone=t5, task=nn.Linear(2, 2)))
    warned = _declared_warnings(wrapper, opt_level="O2", half_dtype=torch.float16)
    assert len(warned) == 1
    assert warned[0].startswith(
        "ampkit: Sequential's 'backbone' (_T5Like) declares _keep_in_fp32_modules=['wo'] and "
        "Sequential's 'backbone' (_T5Like) declares _keep_in_fp32_modules_strict=['head']: ")
    assert "casts 6 of them ('backbone.block.0.wo.weight', ...)" in warned[0]
    assert "pass keep_fp32=['*.head', '*.wo']" in warned[0]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("selector", [["attn.out_proj"], nn.Linear, ["attn.*"]])
def test_the_out_proj_of_multihead_attention_alone_is_refused(selector):
    """MultiheadAttention reads out_proj.weight without calling its forward: keeping it did
    nothing under autocast, and under O2 the first forward met fp32 weights among bf16."""
    model = _Attention()
    with pytest.raises(ValueError, match=r"'attn.out_proj' is the out_proj of "
                                         r"nn.MultiheadAttention 'attn'.*valid: keep the whole"):
        ampkit.keep_fp32(model, selector)
    assert ampkit.keep.kept_names(model) == []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="is the out_proj of nn.MultiheadAttention"):
        ampkit.initialize(model, opt, opt_level="O2", half_dtype=BF16, keep_fp32=selector,
                          verbosity=0)
    assert model.head.weight.dtype == torch.float32


def test_multihead_attention_kept_whole_runs_in_fp32_in_a_half_model():
    model = ampkit.keep_fp32(_Attention(), ["attn"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert model.attn.out_proj.weight.dtype == torch.float32 and model.head.weight.dtype == BF16
    assert model(torch.randn(2, 3, 8)).dtype == torch.float32


def _walks_to_keep(blocks: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """How often keep_fp32 of every block's norm, then an O2 initialize, walk the model."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(blocks)])
    walks = collections.Counter()
    for method in ("named_modules", "modules"):
        original = getattr(nn.Module, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            walks[_method] += self is model  # the root's walks, not the children's recursion
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(nn.Module, method, counting)
    ampkit.keep_fp32(model, [f"{i}.1" for i in range(blocks)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampkit.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    monkeypatch.undo()
    return sum(walks.values())


def test_selecting_many_modules_walks_the_model_a_fixed_number_of_times(monkeypatch):
    """Each name walked the whole model twice, and each kept module every other kept
    module's subtree: keep_fp32 of 800 names took 2.9 s (46 ms now; leak-and-scaling probe)."""
    _walks_to_keep(2, monkeypatch)  # first-use work (imports, caches) out of the count
    assert _walks_to_keep(8, monkeypatch) == _walks_to_keep(64, monkeypatch)
