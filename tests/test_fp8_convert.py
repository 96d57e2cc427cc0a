"""convert_to_fp8 and Float8Linear inside models: swapping, filters, logging,
state_dict, a short training run against bf16, torch.compile and DDP."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampkit.fp8 import Float8Config, Float8Linear, convert_to_fp8

RECIPES = ["tensorwise", "delayed", "rowwise"]
EMU = {name: Float8Config(name, emulate=True) for name in RECIPES}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class SubLinear(nn.Linear):
    pass


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), Block(), nn.LayerNorm(32), SubLinear(32, 32),
                         nn.Linear(32, 10)).to(dtype)


def test_swaps_eligible_layers_in_place_and_logs_the_rest(caplog):
    model = make_model()
    params = dict(model.named_parameters())
    with caplog.at_level(logging.INFO, logger="ampkit.fp8"):
        out = convert_to_fp8(model, recipe=EMU["tensorwise"])
    assert out is model
    assert [type(m).__name__ for m in (model[0], model[1].up, model[1].down, model[3], model[4])] == [
        "Float8Linear", "Float8Linear", "Float8Linear", "SubLinear", "Linear"]
    assert all(p is params[name] for name, p in model.named_parameters())
    messages = [r.getMessage() for r in caplog.records]
    assert "convert_to_fp8: kept 4 as nn.Linear: in_features=32 and out_features=10 must both " \
           "be positive multiples of 16 for fp8 GEMMs" in messages
    assert "convert_to_fp8: kept 3 as nn.Linear: SubLinear is a subclass of nn.Linear, not " \
           "nn.Linear itself" in messages
    assert messages[-1] == "convert_to_fp8: 3 linear layer(s) now tensorwise fp8, 2 kept"


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
@pytest.mark.parametrize("features", [(32, 0), (0, 32)], ids=["no-out", "no-in"])
def test_a_layer_without_features_is_kept_as_it_trains(recipe, features):
    """0 is a multiple of 16: nn.Linear(32, 0) was swapped, and its forward (tensorwise,
    delayed) or backward (rowwise) raised where nn.Linear gives an empty output."""
    empty = nn.Linear(*features)
    model = (nn.Sequential(nn.Linear(32, 32), empty) if features[1] == 0 else
             nn.Sequential(empty, nn.Linear(32, 32)))
    convert_to_fp8(model, recipe=EMU[recipe])
    assert model[0 if features[0] == 0 else 1] is empty
    assert sum(isinstance(m, Float8Linear) for m in model) == 1
    out = model(torch.randn(4, 32 if features[0] else 0))
    out.sum().backward()
    assert out.shape == (4, 0 if features[1] == 0 else 32)
    with pytest.raises(ValueError, match=rf"in_features={features[0]} and out_features="
                                         rf"{features[1]} must both be positive multiples of 16"):
        Float8Linear(*features)


def test_module_filter_gets_module_and_fqn(caplog):
    model = make_model()
    seen = []

    def keep_block(module: nn.Module, fqn: str) -> bool:
        seen.append((type(module).__name__, fqn))
        return fqn.startswith("1.")
    with caplog.at_level(logging.INFO, logger="ampkit.fp8"):
        convert_to_fp8(model, recipe=EMU["delayed"], module_filter=keep_block)
    assert seen == [("Linear", "0"), ("Linear", "1.up"), ("Linear", "1.down")]
    assert type(model[0]) is nn.Linear and isinstance(model[1].up, Float8Linear)
    assert model[1].up.config.recipe.value == "delayed"
    assert "convert_to_fp8: kept 0 as nn.Linear: refused by module_filter" in caplog.messages


def test_bare_linear_is_returned_converted(caplog):
    linear = nn.Linear(32, 16)
    fp8 = convert_to_fp8(linear, recipe=EMU["rowwise"])
    assert isinstance(fp8, Float8Linear) and fp8.weight is linear.weight
    small = nn.Linear(8, 8)
    with caplog.at_level(logging.INFO, logger="ampkit.fp8"):
        assert convert_to_fp8(small) is small
    assert "kept the model (Linear) as it is" in caplog.text


@pytest.mark.parametrize("kwargs, error, match", [
    ({"recipe": "e3m4"}, ValueError, r"unknown fp8 recipe 'e3m4'; valid: 'tensorwise', 'delayed', 'rowwise'"),
    ({"recipe": Float8Config}, TypeError, r"recipe must be a recipe name, a Recipe or a Float8Config"),
    ({"module_filter": "up"}, TypeError,
     r"module_filter must be a callable \(module, fqn\) -> bool or None, got 'up'"),
    ({"module_filter": lambda fqn: True}, TypeError,  # was Python's raw arity error, mid-plan
     r"module_filter <function .*> cannot be called with \(module, fqn\): too many positional"
     r" arguments; valid: a callable \(module, fqn\) -> bool, or None"),
])
def test_bad_arguments_raise_before_any_swap(kwargs, error, match):
    model = make_model()
    with pytest.raises(error, match=match):
        convert_to_fp8(model, **kwargs)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_a_bare_linear_keeps_its_hooks_and_o2s_fp32_state_dict():
    """The bare-Linear path returned a new layer without the old one's hooks: a user's
    forward hook stopped firing, and after an O2 initialize state_dict() was bf16."""
    import ampkit
    linear = nn.Linear(32, 16)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    ampkit.initialize(linear, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    calls = []
    linear.register_forward_hook(lambda *args: calls.append(1))
    fp8 = convert_to_fp8(linear, recipe=EMU["tensorwise"])
    assert {k: v.dtype for k, v in fp8.state_dict().items()} == {
        "weight": torch.float32, "bias": torch.float32}
    fp8(torch.randn(2, 32, dtype=torch.bfloat16))
    assert calls == [1]


@pytest.mark.parametrize("how", ["prune", "weight_norm", "spectral_norm"])
@pytest.mark.parametrize("bare", [False, True])
def test_a_layer_whose_weight_a_hook_computes_is_left_as_it_is(how, bare, caplog):
    """A pruned (or hook-based weight_norm / spectral_norm) Linear is still exactly
    nn.Linear, with a plain-tensor weight: the swap failed after earlier layers were
    swapped (a half-converted model), and would have dropped the mask."""
    import warnings

    import torch.nn.utils.prune as prune
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation
        if how == "prune":
            prune.l1_unstructured(model[1], "weight", amount=0.5)
        else:
            getattr(torch.nn.utils, how)(model[1])
    params = {name for name, _ in model[1].named_parameters()}
    target = model[1] if bare else model
    with caplog.at_level(logging.INFO, logger="ampkit.fp8"):
        out = convert_to_fp8(target, recipe=EMU["tensorwise"])
    assert out is target and type(model[1]) is nn.Linear
    assert {name for name, _ in model[1].named_parameters()} == params  # weight_orig, ...
    assert "its weight is not a Parameter but computed by a hook" in caplog.text
    assert isinstance(model[0], Float8Linear) != bare
    model(torch.randn(4, 32))


def test_a_filter_splitting_one_layer_between_its_names_is_refused():
    """One layer in two slots, accepted under one name and refused under the other,
    became two layers sharing hook tables (a hook on one fired on the other)."""
    model = nn.Module()
    model.shared = model.alias = nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"one layer is used as 'shared' and 'alias', and "
                                         r"module_filter accepts 'shared' but refuses 'alias'"):
        convert_to_fp8(model, module_filter=lambda module, fqn: fqn != "alias")
    assert type(model.shared) is nn.Linear and model.shared is model.alias
    convert_to_fp8(model, recipe=EMU["tensorwise"])  # every name accepted: one layer
    assert isinstance(model.shared, Float8Linear) and model.shared is model.alias


def test_failing_filter_leaves_model_untouched():
    model = make_model()

    def flaky(module: nn.Module, fqn: str) -> bool:
        if fqn == "1.down":
            raise KeyError("boom")
        return True
    with pytest.raises(KeyError, match="boom"):
        convert_to_fp8(model, module_filter=flaky)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


@pytest.mark.parametrize("bare", [False, True])
def test_emulate_false_without_fp8_hardware_raises_before_any_swap(bare):
    model = nn.Linear(32, 32) if bare else make_model()
    before = list(model.modules())
    with pytest.raises(RuntimeError, match=r"Float8Config\(emulate=False\) needs fp8 tensor cores, "
                                           r"but cpu \(.*\) has none; valid: emulate=None or True "
                                           r"there, or a GPU with fp8 tensor cores \(compute "
                                           r"capability >= 8\.9\)"):
        convert_to_fp8(model, recipe=Float8Config(emulate=False))
    after = list(model.modules())
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before))


def test_emulate_false_on_a_meta_model_waits_for_its_real_device():
    with torch.device("meta"):
        model = make_model()
    convert_to_fp8(model, recipe=Float8Config(emulate=False))  # deferred init: not refused yet
    assert isinstance(model[0], Float8Linear)
    with pytest.raises(RuntimeError, match=r"needs fp8 tensor cores, but cpu"):
        model.to_empty(device="cpu")[0](torch.randn(2, 32))


def test_convert_rejects_non_module():
    with pytest.raises(TypeError, match=r"convert_to_fp8 needs an nn.Module, got list"):
        convert_to_fp8([nn.Linear(16, 16)])


# --- state_dict ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_state_dict_keys_dtypes_and_round_trip(recipe, dtype):
    plain = make_model(dtype=dtype)
    original = {k: (v.dtype, v.shape) for k, v in plain.state_dict().items()}
    fp8 = convert_to_fp8(make_model(seed=1, dtype=dtype), recipe=EMU[recipe])
    fp8(torch.randn(4, 32, dtype=dtype)).float().sum().backward()  # delayed state now non-zero
    saved = fp8.state_dict()
    assert {k: (v.dtype, v.shape) for k, v in saved.items()} == original
    plain.load_state_dict(saved)  # strict: a plain nn.Linear model takes the fp8 checkpoint
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved.items())
    fresh = convert_to_fp8(make_model(seed=2, dtype=dtype), recipe=EMU[recipe])
    fresh.load_state_dict(make_model(seed=3, dtype=dtype).state_dict())  # and the other way
    assert torch.equal(fresh[0].weight, make_model(seed=3, dtype=dtype)[0].weight)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_converting_after_initialize_keeps_fp32_checkpoints_and_loads_into_masters(level):
    """The swapped layers lost initialize's state-dict hooks: state_dict() turned bf16 and a
    loaded checkpoint missed the fp32 masters, so the next step copied the stale ones back."""
    import ampkit
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                   verbosity=0)
    convert_to_fp8(model, recipe=EMU["tensorwise"])
    assert isinstance(model[0], Float8Linear) and model[0].weight.dtype == torch.bfloat16
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}
    checkpoint = make_model(seed=5).state_dict()
    model.load_state_dict(checkpoint)
    with ampkit.scale_loss(model(torch.randn(4, 32)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # lr 0: the loaded values stay
    assert torch.equal(model.state_dict()["0.weight"], checkpoint["0.weight"].bfloat16().float()
                       if level == "O3" else checkpoint["0.weight"])
    assert torch.equal(model[0].weight, checkpoint["0.weight"].bfloat16())


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_initialize_after_converting_keeps_the_amax_histories_fp32(level, half):
    """initialize's cast set the buffers without after_apply: the delayed histories
    became half (an amax of 3.01 stored as 3.0156), and fp8_state_dict of one build order
    would not load into the other."""
    import ampkit
    from ampkit.fp8 import fp8_state_dict, load_fp8_state_dict

    def build(convert_first: bool) -> nn.Module:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if convert_first:
            convert_to_fp8(model, recipe=EMU["delayed"])
        model, _ = ampkit.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
        if not convert_first:
            convert_to_fp8(model, recipe=EMU["delayed"])
        return model

    first, second = build(True), build(False)
    grown = convert_to_fp8(make_model(), recipe=EMU["delayed"])
    history = torch.tensor([3.01, 1e5] + [0.0] * 14)  # 1e5: a gradient's amax under a loss scale
    grown[0].amax_history_grad_output.copy_(history)
    ampkit.initialize(grown, torch.optim.SGD(grown.parameters(), lr=0.1), opt_level=level,
                      half_dtype=half, verbosity=0)
    assert torch.equal(grown[0].amax_history_grad_output, history)  # not 3.0098, inf
    assert torch.equal(grown.half()[0].amax_history_grad_output, history)  # nor by .half()
    for model in (first, second):
        assert model[0].weight.dtype == half
        assert {model[0].amax_history_input.dtype, model[0].amax_history_weight.dtype,
                model[0].amax_history_grad_output.dtype} == {torch.float32}
    x = torch.randn(4, 32) * 3.01
    first(x.to(half)).float().sum().backward()
    assert first[0].amax_history_input[0] == x.to(half).abs().max().float()
    load_fp8_state_dict(second, fp8_state_dict(first))
    assert torch.equal(second[0].amax_history_input, first[0].amax_history_input)


def test_converting_again_same_config_is_a_no_op_another_is_refused():
    """Another recipe was silently ignored: the layers stayed tensorwise."""
    model = convert_to_fp8(make_model(), recipe=EMU["tensorwise"])
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert convert_to_fp8(model, recipe=EMU["tensorwise"]) is model
    assert [m for m in model.modules() if isinstance(m, Float8Linear)] == layers
    with pytest.raises(ValueError, match=r"convert_to_fp8\(recipe=delayed\(16,max\)\): layers "
                                         r"already fp8 with another config would stay so: '0' "
                                         r"\(tensorwise\).*valid: the same"):
        convert_to_fp8(model, recipe=EMU["delayed"])
    assert {m.config for m in model.modules() if isinstance(m, Float8Linear)} == {EMU["tensorwise"]}
    # A filter that leaves them out gives per-layer recipes.
    mixed = convert_to_fp8(make_model(), recipe=EMU["tensorwise"], module_filter=lambda m, n: n == "0")
    convert_to_fp8(mixed, recipe=EMU["delayed"], module_filter=lambda m, n: n != "0")
    assert mixed[0].config == EMU["tensorwise"] and mixed[1].up.config == EMU["delayed"]


def test_a_swapped_layer_keeps_the_hooks_registered_on_it():
    model = make_model()
    seen = []
    handle = model[0].register_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    convert_to_fp8(model, recipe=EMU["tensorwise"])
    model(torch.randn(2, 32))
    assert seen == ["Float8Linear"]
    handle.remove()  # the handle from before the swap still removes it
    model(torch.randn(2, 32))
    assert seen == ["Float8Linear"]


# --- training tracks bf16 -----------------------------------------------------------------------

def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _train(model: nn.Module, steps: int = 24) -> torch.Tensor:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(32, 16, generator=gen)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = (out.float() - torch.tanh(x @ w_true)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.fixture(scope="module")
def bf16_losses() -> torch.Tensor:
    return _train(_mlp())


@pytest.mark.parametrize("recipe", [
    "tensorwise",  # the default recipe; the others train in CI's slow run
    *(pytest.param(r, marks=pytest.mark.slow) for r in RECIPES if r != "tensorwise")])
def test_short_training_run_tracks_bf16(recipe, bf16_losses):
    losses = _train(convert_to_fp8(_mlp(), recipe=EMU[recipe]))
    assert losses[-1] < 0.7 * losses[0]  # it learns
    assert ((losses - bf16_losses).abs() / bf16_losses).max() < 0.02  # like bf16 does


# --- torch.compile and DDP -------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [
    "delayed",  # the recipe with state (amax histories) in the graph
    *(pytest.param(r, marks=pytest.mark.slow) for r in RECIPES if r != "delayed")])
def test_compile_fullgraph_forward_backward(recipe):
    """aot_eager traces forward and backward as inductor does, without the slow codegen,
    so the compiled run must equal eager bitwise."""
    torch._dynamo.reset()
    eager = convert_to_fp8(_mlp(), recipe=EMU[recipe])
    compiled_model = convert_to_fp8(_mlp(), recipe=EMU[recipe])
    # fullgraph=True: any graph break inside Float8Linear (or its autograd.Function) fails.
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for _ in range(3):  # delayed: warm-up step, then a recompile for the history steps
        x = torch.randn(16, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_e, out_c = eager(x), compiled(x)
        assert out_c.dtype == torch.bfloat16 and torch.equal(out_c, out_e)
        out_e.float().square().mean().backward()
        out_c.float().square().mean().backward()
    for p_c, p_e in zip(compiled_model.parameters(), eager.parameters()):
        assert torch.equal(p_c.grad, p_e.grad)
    if recipe == "delayed":
        assert compiled_model[0].amax_history_grad_output[2] > 0
        assert torch.equal(compiled_model[0].amax_history_grad_output,
                           eager[0].amax_history_grad_output)


@pytest.mark.parametrize("recipe", [
    "tensorwise", *(pytest.param(r, marks=pytest.mark.slow) for r in RECIPES if r != "tensorwise")])
def test_compile_with_dynamic_shapes_equals_eager(recipe):
    """Two fp8 layers under torch.compile(dynamic=True) stopped dynamo with an internal
    AssertionError (a module-level float read inside the autograd.Function)."""
    torch._dynamo.reset()
    eager = convert_to_fp8(_mlp(), recipe=EMU[recipe])
    compiled_model = convert_to_fp8(_mlp(), recipe=EMU[recipe])
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=True)
    for batch in (3, 5, 7):
        x = torch.randn(batch, 32)
        out_e, out_c = eager(x), compiled(x)
        assert torch.equal(out_c, out_e)
        out_e.square().mean().backward()
        out_c.square().mean().backward()
    for p_c, p_e in zip(compiled_model.parameters(), eager.parameters()):
        assert torch.equal(p_c.grad, p_e.grad)


@pytest.mark.parametrize("config", [
    Float8Config("delayed", emulate=True, amax_compute_algo="most_recent"),
    Float8Config("delayed", emulate=True, amax_history_len=4)], ids=["most_recent", "len4"])
def test_compile_backward_uses_the_history_read_the_forward_cast_with(config):
    """AOTAutograd recomputed these cheap history reads in the backward, after the forward
    had pushed the new amax: the saved fp8 input and weight were dequantised by other
    scales than they were cast with, and the weight and input gradients were wrong from
    the second step (pytorch/pytorch#197039)."""
    torch._dynamo.reset()

    def layer() -> nn.Sequential:
        torch.manual_seed(0)
        return convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), recipe=config)

    eager, compiled_model = layer(), layer()
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # growing inputs: each step's amax tops the history
        x = torch.randn(16, 32, generator=gen, requires_grad=True)
        x_c = x.detach().clone().requires_grad_()
        grad = torch.randn(16, 16, generator=gen) * (step + 1)
        eager(x * (step + 1)).backward(grad)
        compiled(x_c * (step + 1)).backward(grad)
        assert torch.equal(x_c.grad, x.grad), step
        assert torch.equal(compiled_model[0].weight.grad, eager[0].weight.grad), step


@pytest.mark.slow
def test_compile_inductor_generates_code_for_fp8_layer():
    """Inductor codegen on CPU: one layer, about 10 s on 2 cores."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)), recipe=EMU["tensorwise"])
    x = torch.randn(16, 32)
    out_e = layer(x)
    out_e.square().mean().backward()
    grad_e = layer[0].weight.grad.clone()
    layer.zero_grad()
    out_c = torch.compile(layer, fullgraph=True, backend="inductor")(x)
    out_c.square().mean().backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer[0].weight.grad, grad_e, rtol=1e-5, atol=1e-5)


def test_ddp_single_process(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = convert_to_fp8(_mlp(), recipe=EMU["delayed"])
        reference = convert_to_fp8(_mlp(), recipe=EMU["delayed"])
        ddp = nn.parallel.DistributedDataParallel(model)
        # The amax histories stay each rank's own: not among the buffers DDP broadcasts.
        histories = {id(b) for n, b in model.named_buffers() if "amax_history" in n}
        assert len(histories) == 9 and not histories & {id(b) for b in ddp.modules_buffers}
        for _ in range(2):
            x = torch.randn(16, 32)
            ddp(x).square().mean().backward()
            reference(x).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
        del ddp  # no DDP reducer may outlive the process group
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_a_layer_in_two_slots_is_counted_once_in_the_log(caplog):
    """The log counted slots: one shared layer and one other read as 3 layers."""
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(32, 32))
    with caplog.at_level(logging.INFO, logger="ampkit.fp8"):
        convert_to_fp8(model, recipe=EMU["tensorwise"])
    assert model[0] is model[2]
    assert caplog.messages[-1] == "convert_to_fp8: 2 linear layer(s) now tensorwise fp8, 0 kept"


class _GPT2StyleConv1D(nn.Module):
    """transformers' Conv1D: a matmul layer that is not an nn.Linear."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)


def test_a_model_without_linear_layers_warns_that_nothing_runs_in_fp8():
    """It only logged "0 linear layer(s) now tensorwise fp8, 0 kept" at INFO: a GPT-2
    (Conv1D) user trained in full precision believing fp8 was on."""
    model = nn.Sequential(_GPT2StyleConv1D(32, 32), nn.ReLU(), _GPT2StyleConv1D(32, 32))
    with pytest.warns(UserWarning) as record:
        convert_to_fp8(model, recipe=EMU["tensorwise"])
    assert [str(w.message) for w in record] == [
        "convert_to_fp8: Sequential has no nn.Linear layer, so nothing in it runs in fp8; only "
        "nn.Linear layers are swapped (transformers' Conv1D, for one, is not an nn.Linear)"]


def test_a_model_whose_every_linear_is_kept_warns_with_the_first_reason():
    model = nn.Sequential(nn.Linear(30, 32), nn.Linear(32, 10))
    with pytest.warns(UserWarning) as record:
        convert_to_fp8(model, recipe=EMU["tensorwise"])
    assert [str(w.message) for w in record] == [
        "convert_to_fp8: none of the 2 nn.Linear layer(s) of Sequential could be swapped, so "
        "nothing in it runs in fp8; '0' was kept: in_features=30 and out_features=32 must both "
        "be positive multiples of 16 for fp8 GEMMs"]
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


def test_a_filter_that_refuses_every_layer_is_the_users_choice_and_does_not_warn(recwarn):
    model = make_model()
    convert_to_fp8(model, recipe=EMU["tensorwise"], module_filter=lambda m, fqn: False)
    assert not [w for w in recwarn if "convert_to_fp8" in str(w.message)]
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_converting_a_converted_model_again_does_not_warn(recwarn):
    model = make_model()
    convert_to_fp8(model, recipe=EMU["tensorwise"])
    convert_to_fp8(model, recipe=EMU["tensorwise"])
    assert not [w for w in recwarn if "convert_to_fp8" in str(w.message)]


def test_a_bare_linear_that_cannot_be_swapped_warns_too():
    with pytest.warns(UserWarning) as record:
        layer = convert_to_fp8(nn.Linear(30, 32), recipe=EMU["tensorwise"])
    assert type(layer) is nn.Linear
    assert [str(w.message) for w in record] == [
        "convert_to_fp8: none of the 1 nn.Linear layer(s) of Linear could be swapped, so "
        "nothing in it runs in fp8; it was kept as it is: in_features=30 and out_features=32 "
        "must both be positive multiples of 16 for fp8 GEMMs"]
