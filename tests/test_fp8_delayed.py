"""The delayed recipe's state: non-finite values, evaluation, duplicate slots, resume."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit.fp8 import Float8Config, Float8Linear, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

DELAYED = Float8Config("delayed", amax_history_len=4, emulate=True)


def _layer() -> Float8Linear:
    torch.manual_seed(0)
    return Float8Linear(32, 32, config=DELAYED)


def _train_step(layer: nn.Module, step: int, *, inf_grad: bool = False) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
    g = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + step))
    if inf_grad:
        g[0, 0] = float("inf")
    layer.weight.grad = None
    layer(x).backward(g)
    return layer.weight.grad


def test_an_inf_gradient_stays_non_finite_under_a_delayed_scale():
    layer = _layer()
    _train_step(layer, 0)
    assert not torch.isfinite(_train_step(layer, 1, inf_grad=True)).all()  # GradScaler sees it


def test_an_inf_input_gives_a_non_finite_output():
    layer = _layer()
    _train_step(layer, 0)
    x = torch.randn(4, 32)
    x[0, 0] = float("inf")
    assert not torch.isfinite(layer(x)).all()


def test_a_non_finite_amax_does_not_enter_the_history():
    layer = _layer()
    _train_step(layer, 0)
    before = layer.amax_history_grad_output.clone()
    _train_step(layer, 1, inf_grad=True)
    history = layer.amax_history_grad_output
    assert torch.isfinite(history).all()
    assert history[0] == before[0] and torch.equal(history[1:], before[:-1])
    assert torch.isfinite(_train_step(layer, 2)).all()  # the next step is clean again


def test_no_grad_forwards_leave_the_histories_alone():
    layer = _layer()
    _train_step(layer, 0)
    before = fp8_state_dict(nn.Sequential(layer))["0"]
    with torch.no_grad():
        layer(torch.randn(4, 32) * 100)
    after = layer.fp8_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if torch.is_tensor(v))


def test_a_layer_in_two_slots_becomes_one_fp8_layer():
    lin = nn.Linear(32, 32)
    model = convert_to_fp8(nn.Sequential(lin, nn.ReLU(), lin), recipe=DELAYED)
    assert isinstance(model[0], Float8Linear) and model[0] is model[2]
    assert model[0].weight is lin.weight


def test_fp8_state_round_trip_resumes_exactly():
    def make() -> nn.Module:
        torch.manual_seed(0)
        return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)),
                              recipe=DELAYED)

    def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        step(model, opt, i)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), fp8_state_dict(model)))
    expected = [step(model, opt, i) for i in range(3, 6)]
    fresh = make()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh.load_state_dict(saved[0])
    fresh_opt.load_state_dict(saved[1])
    load_fp8_state_dict(fresh, saved[2])
    got = [step(fresh, fresh_opt, i) for i in range(3, 6)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_bad_fp8_state_is_refused_before_anything_loads():
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), recipe=DELAYED)
    state = fp8_state_dict(model)
    with pytest.raises(ValueError, match=r"fp8 state has modules \['0'\]; valid: exactly \['0', '1'\]"):
        load_fp8_state_dict(model, {"0": state["0"]})
    bad = {"0": dict(state["0"], started=True), "1": dict(state["1"], amax_history_input=torch.ones(3))}
    with pytest.raises(ValueError, match=r"fp8 state\['1'\]\['amax_history_input'\] is a torch.float32 "
                                         r"tensor of shape \(3,\); valid: a torch.float32 tensor of "
                                         r"shape \(4,\) \(amax_history_len=4\)"):
        load_fp8_state_dict(model, bad)
    assert model[0]._delayed_started is False  # module 0 was not loaded either


@pytest.mark.parametrize("key, value, error, match", [
    ("amax_history_input", torch.tensor([1.0, 2.0, float("nan"), 0.0]), ValueError,
     r"\['amax_history_input'\] has nan at index 2"),
    ("amax_history_weight", torch.tensor([1.0, float("inf"), 0.0, 0.0]), ValueError,
     r"\['amax_history_weight'\] has inf at index 1"),
    ("amax_history_grad_output", torch.tensor([1.0, 0.0, 0.0, -3.0]), ValueError,
     r"\['amax_history_grad_output'\] has -3.0 at index 3"),
    ("amax_history_input", torch.ones(4, dtype=torch.float16), ValueError,
     r"\['amax_history_input'\] is a torch.float16 tensor of shape \(4,\)"),
    ("amax_history_input", [1.0, 1.0, 1.0, 1.0], TypeError,
     r"\['amax_history_input'\] must be a tensor, got list \[1.0"),
    # torch.nonzero raised NotImplementedError there, naming no entry
    ("amax_history_input", torch.zeros(4, device="meta"), TypeError,
     r"\['amax_history_input'\] is a torch.strided tensor on meta \(no values to load\)"),
    ("started", 1, TypeError, r"\['started'\] must be True or False, got int 1"),
    ("started", torch.tensor(True), TypeError, r"\['started'\] must be True or False, got Tensor"),
])
def test_a_bad_entry_of_the_third_layer_leaves_the_first_two_unloaded(key, value, error, match):
    def make() -> nn.Module:
        torch.manual_seed(0)
        return convert_to_fp8(nn.Sequential(*(nn.Linear(32, 32) for _ in range(3))), recipe=DELAYED)

    trained = make()
    trained(torch.randn(8, 32)).sum().backward()
    state = fp8_state_dict(trained)
    state["2"][key] = value
    model = make()
    before = fp8_state_dict(model)
    with pytest.raises(error, match=r"fp8 state\['2'\]" + match + ".*valid: "):
        load_fp8_state_dict(model, state)
    after = fp8_state_dict(model)
    for name in ("0", "1"):
        assert after[name]["started"] is False and state[name]["started"] is True
        assert torch.equal(after[name]["amax_history_input"], before[name]["amax_history_input"])
        assert not torch.equal(after[name]["amax_history_input"], state[name]["amax_history_input"])


# --- activation checkpointing ---------------------------------------------------------------

_NO_CHECKPOINT_VIEW = pytest.mark.skipif(
    ampkit._torch_compat.TORCH_VERSION < (2, 11),
    reason="torch before 2.11 gives no view of torch.utils.checkpoint's phases")
_ROLES = ("input", "weight", "grad_output")


class _Blocks(nn.Module):
    """Blocks over two layers: ``order`` names each block's layers (a layer may run in
    several blocks, and several times in one)."""

    def __init__(self, order=((0,), (1,), (0,))) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])
        self.order = order
        self.checkpoint: dict | None = None  # torch.utils.checkpoint's keywords, or None

    def block(self, x: torch.Tensor, layers: tuple) -> torch.Tensor:
        for i in layers:
            x = torch.tanh(self.layers[i](x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint as ckpt
        for layers in self.order:
            x = (self.block(x, layers) if self.checkpoint is None
                 else ckpt.checkpoint(self.block, x, layers, **self.checkpoint))
        return x


def _pair(order=((0,), (1,), (0,)), algo="max") -> tuple[nn.Module, nn.Module]:
    plain = convert_to_fp8(_Blocks(order), recipe=Float8Config(
        "delayed", amax_history_len=4, amax_compute_algo=algo, emulate=True))
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint = {"use_reentrant": False}
    return plain, checkpointed


def _same(plain: nn.Module, checkpointed: nn.Module) -> None:
    for p, q in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(plain.layers, checkpointed.layers):
        for role in _ROLES:
            assert torch.equal(getattr(a, f"amax_history_{role}"), getattr(b, f"amax_history_{role}"))


@_NO_CHECKPOINT_VIEW
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("order", [((0,), (1,), (0,)), ((0, 1, 0), (1,))],
                         ids=["a-layer-in-two-blocks", "a-layer-twice-in-one-block"])
def test_non_reentrant_checkpointing_casts_and_records_as_without_it(algo, order):
    """The recomputation in backward cast by the history after the forward had pushed its
    amax, and pushed it again: other gradients, and each amax in the history twice."""
    plain, checkpointed = _pair(order, algo)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        for _ in range(2):  # two micro-batches per step
            x = torch.randn(16, 32, generator=gen) * (1 + step)
            grad = torch.randn(16, 32, generator=gen)
            xs = [x.clone().requires_grad_() for _ in range(2)]
            plain(xs[0]).backward(grad)
            checkpointed(xs[1]).backward(grad)
            assert torch.equal(xs[0].grad, xs[1].grad), step
        _same(plain, checkpointed)
        for p in [*plain.parameters(), *checkpointed.parameters()]:
            p.grad = None


@_NO_CHECKPOINT_VIEW
def test_checkpointed_scales_follow_each_call_and_each_backward():
    """Two outputs whose backwards run in forward order, a second backward of one graph
    (retain_graph), and a forward with no backward: each recomputation casts as its own
    forward did, and the kept scales go with their graphs."""
    import gc
    from ampkit.fp8 import checkpointed as kept_scales
    plain, checkpointed = _pair()
    gen = torch.Generator().manual_seed(2)
    x1, x2 = (torch.randn(16, 32, generator=gen) * s for s in (1.0, 5.0))
    grad = torch.randn(16, 32, generator=gen)
    for model in (plain, checkpointed):
        model(torch.randn(16, 32, generator=torch.Generator().manual_seed(3)))  # no backward
        y1, y2 = model(x1), model(x2)
        y1.backward(grad, retain_graph=True)
        y2.backward(grad)
        y1.backward(grad)
    _same(plain, checkpointed)
    del y1, y2
    gc.collect()
    assert kept_scales.pending_calls() == 0


# --- a model built on the meta device (FSDP2's usual initialisation) --------------------------

def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


def _used_memory(t: torch.Tensor, **kwargs) -> torch.Tensor:
    """What ``torch.empty_like`` may return: memory that held other values (fixed ones here,
    so the test does not depend on the allocator)."""
    return torch.full_like(t, 3e20, **kwargs)


def _meta_built(materialize: str, weights: dict, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    with torch.device("meta"):
        model = convert_to_fp8(_stack(), recipe=DELAYED)
    if materialize == "to_empty":
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty_like", _used_memory)  # what nn.Module.to_empty calls
            model.to_empty(device="cpu")
        model.load_state_dict(weights)
    else:  # torch's set_model_state_dict into a meta model
        model.load_state_dict(weights, assign=True)
    return model


def _sgd_losses(model: nn.Module, steps: int = 4) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)) * (step + 1)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    state, expected = model.state_dict(), reference.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    fp8, fp8_expected = fp8_state_dict(model), fp8_state_dict(reference)
    for name, layer in fp8_expected.items():
        for key, value in layer.items():
            got = fp8[name][key]
            assert (torch.equal(got, value) and got.device == value.device
                    if torch.is_tensor(value) else got == value), (name, key)


@pytest.mark.parametrize("materialize", ["to_empty", "assign"])
def test_a_meta_built_model_trains_bitwise_like_one_built_on_the_cpu(materialize, monkeypatch):
    """to_empty() gave the histories whatever memory it got (scales from it from the second
    step: outputs silently wrong); an assigning load left them on meta (the first forward
    failed on a device mismatch). Both now start from zeros on the weight's device."""
    reference = convert_to_fp8(_stack(), recipe=DELAYED)
    model = _meta_built(materialize, copy.deepcopy(reference.state_dict()), monkeypatch)
    if materialize == "to_empty":  # made at once, before any forward
        assert all(torch.equal(h, torch.zeros(4)) for n, h in model.named_buffers() if "amax" in n)
    assert _sgd_losses(model) == _sgd_losses(reference)
    _assert_same_state(model, reference)


def test_a_trained_model_moved_to_meta_and_back_starts_afresh(monkeypatch):
    """.to("meta") drops the histories' values as building on meta does; to_empty() then
    gave them whatever memory it got (found by review). They start from zeros with a
    fresh warm-up, as a model built from the same weights does."""
    trained = convert_to_fp8(_stack(), recipe=DELAYED)
    _sgd_losses(trained, steps=2)
    weights = copy.deepcopy(trained.state_dict())
    trained.to("meta")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty_like", _used_memory)
        trained.to_empty(device="cpu")
    trained.load_state_dict(weights)
    fresh = convert_to_fp8(_stack(), recipe=DELAYED)
    fresh.load_state_dict(weights)
    assert _sgd_losses(trained) == _sgd_losses(fresh)
    _assert_same_state(trained, fresh)


def test_to_empty_on_a_real_device_starts_the_histories_afresh(monkeypatch):
    """to_empty() of a model on the CPU (re-materialising it, then reset_parameters() or a
    load) left the histories as the memory it got: NaN under deterministic mode (a resumed
    checkpoint refused), else any number (a huge one flushes outputs to zero). They start
    from zeros with a fresh warm-up, as after to_empty() from meta."""
    trained = convert_to_fp8(_stack(), recipe=DELAYED)
    _sgd_losses(trained, steps=2)
    weights = copy.deepcopy(trained.state_dict())
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty_like", _used_memory)
        trained.to_empty(device="cpu")
    assert all(torch.equal(h, torch.zeros(4)) for n, h in trained.named_buffers() if "amax" in n)
    trained.load_state_dict(weights)
    fresh = convert_to_fp8(_stack(), recipe=DELAYED)
    fresh.load_state_dict(weights)
    assert _sgd_losses(trained) == _sgd_losses(fresh)
    _assert_same_state(trained, fresh)


def test_a_meta_built_model_loads_its_fp8_state_before_a_first_forward(monkeypatch):
    """Histories made at the first forward would overwrite a resumed state with zeros."""
    reference = convert_to_fp8(_stack(), recipe=DELAYED)
    _sgd_losses(reference, steps=2)
    model = _meta_built("assign", copy.deepcopy(reference.state_dict()), monkeypatch)
    load_fp8_state_dict(model, fp8_state_dict(reference))
    assert _sgd_losses(model, steps=2) == _sgd_losses(reference, steps=2)
    _assert_same_state(model, reference)


@pytest.mark.slow  # two compiles: 10 s; CI's slow run keeps it
def test_a_meta_built_model_after_an_assigning_load_compiles(monkeypatch):
    """The histories are made in eager code (one graph break, in the first call only);
    with fullgraph=True the error says why and what to do."""
    torch._dynamo.reset()
    reference = convert_to_fp8(_stack(), recipe=DELAYED)
    weights = copy.deepcopy(reference.state_dict())
    model = _meta_built("assign", weights, monkeypatch)
    with pytest.raises(Exception, match=r"histories of this meta-built layer .* valid: one eager "
                                        r"forward first"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(torch.randn(8, 32))
    torch._dynamo.reset()
    model = _meta_built("assign", weights, monkeypatch)
    compiled = torch.compile(model, backend="aot_eager")
    assert _sgd_losses(compiled) == _sgd_losses(reference)
    _assert_same_state(model, reference)


def test_a_non_finite_input_after_warm_up_leaves_the_other_rows_and_the_history_alone():
    """A delayed scale comes from the history, not from this step's amax: only the values
    that meet the NaN become NaN, and the NaN's amax does not enter the history (the
    newest finite entry is repeated, so the next scales are those it would have had)."""
    clean, layer = _layer(), _layer()
    _train_step(clean, 0)
    _train_step(layer, 0)
    before = layer.amax_history_input.clone()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    want = clean(x)
    x[0, 5] = float("nan")
    out = layer(x)
    assert out[0].isnan().all() and torch.equal(out[1:], want[1:])
    history = layer.amax_history_input
    assert history[0] == before[0] and torch.equal(history[1:], before[:-1])
    out.nan_to_num().sum().backward()
    assert torch.isfinite(_train_step(layer, 2)).all()


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return (10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean())).item()


@pytest.mark.parametrize("first", ["forward without backward", "overflowing step"])
def test_a_backward_whose_history_has_seen_nothing_scales_by_its_own_amax(first):
    """The gradient history was all zeros at the first backward after a grad-enabled
    forward without one (a validation pass outside no_grad), or after a first step whose
    gradient held an inf (not recorded): scale 1 then flushed every |g| < 1.5e-5 in e5m2,
    so a mean-reduced loss's gradients (1e-6) all became zero (0 dB)."""
    torch.manual_seed(0)
    ref = nn.Linear(64, 64)
    x, g = torch.randn(32, 64), torch.randn(32, 64) * 1e-6
    layer = convert_to_fp8(copy.deepcopy(ref), recipe=DELAYED)
    ref(x).backward(g)
    if first == "forward without backward":
        layer(x)
    else:
        bad = g.clone()
        bad[0, 0] = float("inf")
        layer(x).backward(bad)
        layer.weight.grad = None
        assert not layer.amax_history_grad_output.any()  # the inf was not recorded
    layer(x).backward(g)
    assert _sqnr_db(layer.weight.grad, ref.weight.grad) > 20
    assert layer.amax_history_grad_output[0] == g.abs().max()
