import math
"""master.py: fp32 masters for half params, grads model->master, params master->model."""

import pytest
import torch
from torch import nn

from ampkit.master import master_of
from ampkit.optim import attach_master_weights, master_weights_of
from conftest import DEVICES, HALF_DTYPES

F32 = torch.float32


def _half_model(dtype, device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
    model[0].to(dtype)
    model[2].to(dtype)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_params_get_fp32_masters_and_fp32_params_step_as_themselves(device, dtype):
    model = _half_model(dtype, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mw = attach_master_weights(opt)
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert [p.dtype for p in stepped] == [F32] * 6
    assert stepped[2] is model[1].weight  # the fp32 batch-norm is not copied
    assert master_of(model[0].weight) is stepped[0] and master_of(model[1].weight) is None
    assert torch.equal(stepped[0], model[0].weight.float())  # exact: half -> fp32 is exact
    assert master_weights_of(opt) is mw and len(mw.master_params) == 4


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_backward_leaves_half_grads_on_the_model_and_the_step_moves_them(dtype):
    """Gradients stay where torch puts them until the optimizer takes them, as in fp32:
    model.zero_grad() (or DDP) sees them there."""
    model = _half_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    attach_master_weights(opt)
    x = torch.randn(6, 4)
    out = model[2](model[1](model[0](x.to(dtype)).float()).to(dtype))
    out.float().sum().backward()
    half_grad = model[0].weight.grad.clone()
    assert half_grad.dtype is dtype
    master = master_of(model[0].weight)
    assert master.grad is None
    before = master.detach().clone()
    opt.step()
    assert model[0].weight.grad is None  # the half gradient was freed by the move
    assert torch.equal(master, before - 0.5 * half_grad.float())


def test_move_grads_unscales_only_the_new_grads_and_adds_them_to_the_masters():
    model = _half_model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mw = attach_master_weights(opt)
    master = master_of(model[0].weight)
    quarter = lambda grads: torch._foreach_mul_(grads, 0.25) if grads else None
    model[0].weight.grad = torch.full_like(model[0].weight, 8.0)
    mw.move_grads(quarter)
    assert torch.equal(master.grad, torch.full_like(master, 2.0))
    model[0].weight.grad = torch.full_like(model[0].weight, 4.0)  # a later, scaled backward
    mw.move_grads(quarter)
    assert torch.equal(master.grad, torch.full_like(master, 2.0 + 1.0))
    assert model[0].weight.grad is None
    opt.zero_grad()
    assert master.grad is None


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_step_updates_masters_and_copies_them_into_the_model(dtype):
    model = _half_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    attach_master_weights(opt)
    master = master_of(model[0].weight)
    master.grad = torch.full_like(master, 1e-3)  # smaller than half's spacing near 1
    before = master.detach().clone()
    opt.step()
    assert torch.equal(master, before - 0.5 * 1e-3)  # the fp32 master keeps the tiny update
    assert torch.equal(model[0].weight, master.to(dtype))  # the model gets it rounded
    assert master.grad is None  # consumed by the step


def test_existing_optimizer_state_moves_onto_the_masters():
    model = _half_model(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    attach_master_weights(opt)
    master = master_of(model[0].weight)
    assert opt.state[master]["momentum_buffer"].dtype is F32
    assert model[0].weight not in opt.state


def test_add_param_group_adopts_half_params():
    model = _half_model(torch.float16)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    attach_master_weights(opt)
    opt.add_param_group({"params": model[2].weight})
    assert opt.param_groups[1]["params"][0] is master_of(model[2].weight)


def test_attaching_twice_is_refused():
    opt = torch.optim.SGD(_half_model(torch.float16).parameters(), lr=0.1)
    attach_master_weights(opt)
    with pytest.raises(RuntimeError, match="SGD was already prepared by ampkit"):
        attach_master_weights(opt)


def test_a_released_master_no_longer_moves_grads_or_writes_the_model():
    """A later initialize gives the model other masters: the old optimizer must not
    overwrite them with its stale ones."""
    model = _half_model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mw = attach_master_weights(opt)
    mw.remove()
    assert master_of(model[0].weight) is None
    model[0](torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    opt.step()
    assert model[0].weight.grad is not None  # not taken
    assert (model[0].weight == 3.0).all()  # not overwritten


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_a_skipped_scaler_step_consumes_the_master_grads(dtype):
    """Loops that zero only the model's grads must not carry an inf into later steps."""
    from ampkit.scaler import GradScaler

    model = nn.Linear(4, 1).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attach_master_weights(opt)
    scaler = GradScaler("cpu", init_scale=2.0**4)
    x, skipped = torch.randn(2, 4), []
    for step in range(4):
        model.zero_grad()
        loss = model(x.to(dtype)).float().sum() * (float("inf") if step == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    assert skipped == [True, False, False, False]
    assert torch.isfinite(model.weight).all()


def test_a_refused_param_group_changes_nothing():
    model = _half_model(torch.float16)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    attach_master_weights(opt)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[2].weight, model[0].weight]})
    assert master_of(model[2].weight) is None and len(opt.param_groups) == 1


def test_sparse_grads_accumulate_across_scale_loss_calls():
    import ampkit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                   verbosity=0)
    idx = torch.tensor([[1, 2], [2, 3]])
    for _ in range(2):  # the second call adds into already-unscaled masters
        with ampkit.scale_loss(model(idx).float().sum(), opt) as scaled:
            scaled.backward()
    grad = master_of(model[0].weight).grad
    assert grad.is_sparse
    dense = grad.to_dense()
    assert torch.equal(dense[[0, 4]], torch.zeros(2, 4)) and dense[2].abs().sum() > 0


def test_lbfgs_under_o2_evaluates_its_closure_at_the_current_masters():
    """LBFGS keeps param_groups[0]['params'] (the list): initialize put a new list of
    masters in the group, so LBFGS stepped the half params, whose grads were gone; and its
    closure, called again inside one step, saw the weights the step began with."""
    import ampkit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level="O2",
                                         half_dtype=torch.float16, verbosity=0)
    assert optimizer._params is optimizer.param_groups[0]["params"]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
    seen = []

    def closure():
        optimizer.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        seen.append(loss.item())
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        return loss
    for _ in range(3):
        optimizer.step(closure)
    assert all(b < a for a, b in zip(seen[:6], seen[1:6]))  # each evaluation saw the new weights
    assert ((model(x).float() - y) ** 2).mean().item() < 1e-3 < seen[0]


def _closure_setup(level, make_optimizer, dtype=torch.float16):
    import ampkit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = make_optimizer(model.parameters())
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=level, half_dtype=dtype,
                                         verbosity=0)
    gen = torch.Generator().manual_seed(1)
    return model, optimizer, torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)


def _overflowing_closure(model, optimizer, x, y):
    """A closure through scale_loss whose loss is inf while ``blow_up[0]``."""
    import ampkit
    blow_up = [False]

    def closure():
        optimizer.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        with ampkit.scale_loss(loss * (float("inf") if blow_up[0] else 1.0), optimizer) as scaled:
            scaled.backward()
        return loss
    return closure, blow_up


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.Adam(params, lr=1e-2),
], ids=["sgd", "adam"])
def test_a_closure_with_a_plain_backward_trains_under_o2_as_a_step_without_one(make_optimizer):
    """The grads a closure's plain backward() left on the half model never reached the
    masters: O2 step(closure) trained nothing, silently."""
    runs = []
    for use_closure in (False, True):
        model, optimizer, x, y = _closure_setup("O2", make_optimizer, torch.bfloat16)
        losses = []

        def closure():
            optimizer.zero_grad()
            loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            return loss
        for _ in range(3):
            if use_closure:
                losses.append(optimizer.step(closure))
            else:
                losses.append(closure())
                optimizer.step()
        runs.append(([loss.item() for loss in losses], [p.detach().clone() for p in model.parameters()]))
    (plain_losses, plain_params), (losses, params) = runs
    assert losses == plain_losses and losses[2] < losses[0]
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda params: torch.optim.Adam(params, lr=1e-2),
    lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
], ids=["sgd", "adam", "fused-adam"])
def test_an_overflow_in_a_closure_skips_that_step_leaving_weights_and_state(level,
                                                                            make_optimizer):
    """The overflow zeroed the grads, and the optimizer stepped anyway: momentum, weight
    decay and Adam's moments still moved the weights (a fused one stepped the inf/NaN
    grads). Now it is a skip, as an overflow before step() without closure is."""
    import ampkit
    model, optimizer, x, y = _closure_setup(level, make_optimizer)
    closure, blow_up = _overflowing_closure(model, optimizer, x, y)
    optimizer.step(closure)  # a clean step first: momentum and moments are not zero
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in ampkit.master_params(optimizer)]
    state = {i: {k: v.clone() for k, v in optimizer.state[p].items()}
             for i, p in enumerate(ampkit.master_params(optimizer))}
    scale = ampkit.state_dict()["loss_scaler0"]["loss_scale"]
    blow_up[0] = True
    loss = optimizer.step(closure)
    assert loss is not None and torch.isfinite(loss)  # the closure's own loss, returned
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(ampkit.master_params(optimizer), masters))
    for i, p in enumerate(ampkit.master_params(optimizer)):
        assert optimizer.state[p].keys() == state[i].keys()
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in state[i].items())
    assert ampkit.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    blow_up[0] = False
    optimizer.step(closure)  # the next one steps
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), params))


class _Sam(torch.optim.Optimizer):
    """Sharpness-aware minimisation's step: perturb the weights along the gradient, take
    the gradient there from the closure, step the unperturbed weights with it."""

    def __init__(self, params, lr: float = 0.1, rho: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure):
        eps = []
        for group in self.param_groups:
            for p in group["params"]:
                eps.append(group["rho"] * p.grad / (p.grad.norm() + 1e-12))
                p.add_(eps[-1])
        with torch.enable_grad():
            self.zero_grad()
            loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        for p, e in zip(params, eps):
            p.sub_(e)
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])
        return loss


@pytest.mark.parametrize("level", [None, "O0", "O2"])
def test_an_optimizer_that_works_before_its_closure_trains_as_without_ampkit(level):
    """The closure was evaluated ahead of the optimizer's step (to make an overflow there a
    skip): SAM, which perturbs the weights first, got a stale loss and no gradients."""
    import ampkit
    runs = []
    for use_ampkit in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = _Sam(model.parameters())
        if use_ampkit and level is not None:
            model, optimizer = ampkit.initialize(model, optimizer, opt_level=level,
                                                 half_dtype=torch.bfloat16, verbosity=0)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        seen = []

        def closure():
            seen.append(model[0].weight.detach().clone())
            loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            return loss
        for _ in range(2):
            optimizer.zero_grad()
            closure()
            optimizer.step(closure)
        runs.append((seen, [p.detach().clone() for p in model.parameters()]))
    if level in (None, "O0"):  # fp32 throughout: bitwise what torch does
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert len(runs[1][0]) == 4 and not torch.equal(runs[1][0][0], runs[1][0][1])  # perturbed


class _MySGD(torch.optim.SGD):
    """A subclass that keeps torch's step."""


def test_a_subclass_keeping_a_torch_step_skips_on_a_closure_overflow_as_torch_s_does():
    """The check read the class's module: a subclass of SGD without a step of its own took
    the zero-the-grads path, and momentum and weight decay still moved its weights."""
    import ampkit
    model, optimizer, x, y = _closure_setup(
        "O2", lambda params: _MySGD(params, lr=0.1, momentum=0.9, weight_decay=0.1))
    closure, blow_up = _overflowing_closure(model, optimizer, x, y)
    optimizer.step(closure)
    params = [p.detach().clone() for p in model.parameters()]
    blow_up[0] = True
    optimizer.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert ampkit.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


def test_an_optimizer_that_works_before_its_closure_gets_zeroed_grads_on_an_overflow():
    """SAM perturbs the weights before it calls the closure, so its step cannot be
    abandoned: the inf grads are zeroed before it reads them, and no weight goes NaN."""
    import ampkit
    model, optimizer, x, y = _closure_setup("O2", _Sam)
    closure, blow_up = _overflowing_closure(model, optimizer, x, y)
    closure()
    optimizer.step(closure)
    closure()  # grads for SAM's perturbation
    before = [p.detach().clone() for p in ampkit.master_params(optimizer)]
    blow_up[0] = True
    optimizer.step(closure)
    after = list(ampkit.master_params(optimizer))
    assert all(torch.isfinite(p).all() for p in after)
    # eps added, then taken off (rounding apart), and a zero gradient stepped
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(after, before))


def test_an_overflow_in_a_later_lbfgs_evaluation_ends_the_step_with_finite_weights():
    """LBFGS evaluates the closure again after moving the weights: that evaluation's inf
    grads are zeroed before it reads them (its step ends on a zero gradient)."""
    import ampkit
    model, optimizer, x, y = _closure_setup(
        "O2", lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=5))
    closure, blow_up = _overflowing_closure(model, optimizer, x, y)
    calls = [0]

    def second_overflows():
        calls[0] += 1
        blow_up[0] = calls[0] == 2
        return closure()
    optimizer.step(second_overflows)
    assert calls[0] == 2  # the zeroed gradient ended the step
    assert all(torch.isfinite(p).all() for p in ampkit.master_params(optimizer))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_skip_found_in_a_closure_warns_at_the_first_scheduler_step():
    """The closure's skip left the scheduler's wrapper thinking the optimizer stepped, so
    the warning a skipped first step gives without a closure was lost."""
    model, optimizer, x, y = _closure_setup("O1", lambda params: torch.optim.SGD(params, lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    closure, blow_up = _overflowing_closure(model, optimizer, x, y)
    blow_up[0] = True
    optimizer.step(closure)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        scheduler.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_inside_a_closure_reaches_no_weight(level):
    """The closure's scale_loss flagged the overflow for the next step() while the current
    one (LBFGS, inside which the closure ran) stepped the inf/NaN gradients; an overflow in
    the first evaluation now makes that step the skip, and the next one steps."""
    import ampkit
    model, optimizer, x, y = _closure_setup(
        level, lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=5))
    closure, blow_up = _overflowing_closure(model, optimizer, x, y)
    optimizer.step(closure)
    blow_up[0] = True
    optimizer.step(closure)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(m).all() for m in ampkit.master_params(optimizer))
    blow_up[0] = False
    before = ((model(x).float() - y) ** 2).mean().item()
    optimizer.step(closure)  # not skipped: the overflow was this closure's step's
    assert ((model(x).float() - y) ** 2).mean().item() < before


def _channels_last_convnet():
    torch.manual_seed(0)
    layers = []
    for _ in range(5):  # 10 conv params: more than a move casts one by one (_grad_move._FEW)
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 8 * 8, 2)).to(
        memory_format=torch.channels_last)


@pytest.mark.parametrize("path", ["scale_loss", "GradScaler"])
@pytest.mark.parametrize("fused", [False, True])
def test_master_grads_take_their_masters_channels_last_layout(path, fused):
    """The moved fp32 gradients were views of one contiguous buffer while the masters of a
    channels_last model are channels_last: a fused optimizer pairs elements by memory
    position and updated the wrong ones (wrong weights, no error)."""
    import ampkit
    torch.manual_seed(1)
    x = torch.randn(4, 4, 8, 8).to(memory_format=torch.channels_last)
    y = torch.randn(4, 2)
    model = _channels_last_convnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                   verbosity=0)
    scaler = ampkit.GradScaler("cpu")
    # apex's O2 by hand: fp32 masters (channels_last, as the params), the half model's
    # gradients unscaled into them, the same optimizer on the masters.
    ref = _channels_last_convnet()
    masters = [p.detach().clone().requires_grad_() for p in ref.parameters()]
    ref = ref.to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(masters, lr=1e-3, fused=fused)
    for _ in range(2):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if path == "scale_loss":
            scale = ampkit._amp_state.loss_scalers[0].loss_scale()
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        else:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        ((ref(x.to(torch.bfloat16)).float() - y) ** 2).mean().mul(scale).backward()
        for master, param in zip(masters, ref.parameters()):
            master.grad = param.grad.float() * (1.0 / scale)
            param.grad = None
        ref_opt.step()
        with torch.no_grad():
            for master, param in zip(masters, ref.parameters()):
                param.copy_(master)
    got = list(ampkit.master_params(opt))
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(a, b) for a, b in zip(got, masters))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))


def test_a_model_made_channels_last_after_initialize_steps_its_contiguous_masters_right():
    """The few-gradient cast kept the gradient's channels_last layout for a contiguous master
    (the model was converted after initialize): a fused step paired the wrong elements."""
    import ampkit

    def convnet():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(256, 2))
    torch.manual_seed(1)
    x, y = torch.randn(4, 4, 8, 8), torch.randn(4, 2)
    runs = []
    for late_channels_last in (False, True):
        model = convnet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                       verbosity=0)
        if late_channels_last:
            model.to(memory_format=torch.channels_last)
            assert model[0].weight.grad is None and master_of(model[0].weight).is_contiguous()
        for _ in range(2):
            opt.zero_grad()
            with ampkit.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        runs.append([m.detach().clone() for m in ampkit.master_params(opt)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_add_param_group_refuses_a_param_another_optimizer_steps_through_its_master():
    """Accepted, it gave the weight a second master: every step the second optimizer copied
    its never-updated master over the first one's update, and the layer stopped training."""
    import ampkit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    back = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, (back, head) = ampkit.initialize(model, [back, head], opt_level="O2",
                                            half_dtype=torch.bfloat16, verbosity=0)
    master = master_of(model[0].weight)
    with pytest.raises(ValueError, match=r"a parameter of shape \(8, 4\) is already stepped by "
                                         r"another optimizer through its fp32 master"):
        head.add_param_group({"params": list(model[0].parameters())})
    assert len(head.param_groups) == 1 and master_of(model[0].weight) is master


def test_a_parameter_resized_after_initialize_is_named_at_the_step():
    """transformers' resize_token_embeddings swaps an embedding's .data for a larger one:
    under O2 the step then failed in torch's "attempting to assign a gradient of size
    '[12, 4]' to a tensor of size '[10, 4]'", naming neither cause nor fix."""
    import ampkit

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level="O2",
                                         half_dtype=torch.bfloat16, verbosity=0)
    with torch.no_grad():  # what resize_token_embeddings does, in small
        model[0].weight.data = torch.cat([model[0].weight, model[0].weight[:2]])
    loss = model(torch.tensor([[11, 3]])).float().sum()
    with pytest.raises(ValueError, match=r"parameter '0.weight' has shape \(12, 4\), its fp32 "
                                         r"master \(10, 4\).*resize before ampkit.initialize"):
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
    # Resized before the first step (the usual place): refused before any gradient moved.
    assert model[0].weight.grad is not None and model[1].weight.grad is not None


def test_a_resized_parameter_of_the_second_model_is_named_with_its_model():
    import ampkit

    models = [nn.Linear(4, 4), nn.Sequential(nn.Embedding(10, 4))]
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    models, optimizer = ampkit.initialize(models, optimizer, opt_level="O2",
                                          half_dtype=torch.bfloat16, verbosity=0)
    with torch.no_grad():
        models[1][0].weight.data = torch.cat([models[1][0].weight, models[1][0].weight[:2]])
    loss = (models[0](models[1](torch.tensor([[11, 3]]))).float().sum())
    with pytest.raises(ValueError, match=r"parameter 'models\[1\].0.weight' has shape \(12, 4\)"):
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_b):
        return self.a(x) + self.b(x) if use_b else self.a(x)


@pytest.mark.parametrize("loop", ["scale_loss", "GradScaler"])
def test_zero_grad_keeping_zeros_steps_a_parameter_the_backward_did_not_reach(loop):
    """O2 freed the half gradients in the move, so zero_grad(set_to_none=False) found none
    to zero: a parameter the next backward skipped had no gradient and did not step, where
    torch (and apex) step it with a zero one (momentum moved it)."""
    import ampkit

    model = _TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level="O2",
                                         half_dtype=torch.bfloat16, verbosity=0)
    scaler = ampkit.GradScaler("cpu")
    torch.manual_seed(1)
    for step in range(3):
        optimizer.zero_grad(set_to_none=False)
        if step == 2:
            assert torch.equal(model.b.weight.grad, torch.zeros_like(model.b.weight))
            master = master_of(model.b.weight)
            buffer = optimizer.state[master]["momentum_buffer"]
            expected = master.detach().add(buffer.mul(0.9), alpha=-0.1)
        loss = model(torch.randn(5, 8), use_b=step < 2).float().pow(2).mean()
        if loop == "scale_loss":
            with ampkit.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert torch.equal(master, expected)
    assert torch.equal(model.b.weight, expected.bfloat16())
    optimizer.zero_grad()  # the default frees them, as before
    assert model.b.weight.grad is None and model.a.weight.grad is None


def test_zero_grad_keeping_zeros_makes_none_for_a_frozen_layer_or_a_group_added_later():
    """(review) Every param that had ever had a gradient got a zero one again: a layer
    frozen since (requires_grad False, its grad dropped) and a head added later with
    add_param_group, never reached, were moved by AdamW's weight decay."""
    import ampkit

    model = _TwoHeads()
    head = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level="O2",
                                         half_dtype=torch.bfloat16, verbosity=0)
    for step in range(4):
        optimizer.zero_grad(set_to_none=False)
        if step == 1:
            model.b.requires_grad_(False)
            for p in model.b.parameters():
                p.grad = None
            optimizer.add_param_group({"params": head.to(torch.bfloat16).parameters()})
            frozen = [p.detach().clone() for p in model.b.parameters()]
            added = [p.detach().clone() for p in head.parameters()]
        loss = model(torch.randn(5, 8), use_b=True).float().pow(2).mean()
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(frozen, model.b.parameters()))
    assert all(torch.equal(a, p) for a, p in zip(added, head.parameters()))
    assert model.a.weight.grad is None  # moved; zero_grad(set_to_none=False) makes it again
    optimizer.zero_grad(set_to_none=False)
    assert torch.equal(model.a.weight.grad, torch.zeros_like(model.a.weight))
    assert model.b.weight.grad is None and head.weight.grad is None


def test_zero_grad_keeping_zeros_after_a_skipped_step_still_steps_an_unreached_param():
    """(review) The skip's own drop of the grads forgot which ones the moves had freed:
    after an overflow, a param the next backward did not reach was not stepped."""
    import ampkit

    model = _TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level="O2",
                                         half_dtype=torch.float16, verbosity=0)
    for step in range(3):
        optimizer.zero_grad(set_to_none=False)
        if step == 2:
            assert torch.equal(model.b.weight.grad, torch.zeros_like(model.b.weight))
            before = master_of(model.b.weight).detach().clone()
        loss = model(torch.randn(5, 8), use_b=step < 2).float().pow(2).mean()
        with ampkit.scale_loss(loss * (math.inf if step == 1 else 1.0), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert not torch.equal(master_of(model.b.weight), before)  # momentum moved it


def test_an_o0_initialize_leaves_o2_with_the_masters_exact_values_and_frees_them():
    """How the docs say to leave O2 (fine-tune in fp32 with another optimizer): the masters
    outlive their optimizer, so model.state_dict() keeps following them after .float()
    alone (lifecycle probe); an O0 initialize gives the model their exact values, releases
    them (their memory goes) and its state dict follows the live parameters again."""
    import gc
    import weakref

    import ampkit as amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                      half_dtype=torch.bfloat16, verbosity=0)
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    exact = [m.detach().clone() for m in amp.master_params(optimizer)]
    refs = [weakref.ref(m) for m in amp.master_params(optimizer)]
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    model, other = amp.initialize(model, other, opt_level="O0", verbosity=0)
    del optimizer, scaled
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4  # released
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 and torch.equal(p, e) for p, e in zip(params, exact))
    for _ in range(3):
        other.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        other.step()
    state = model.state_dict()
    assert all(torch.equal(state[name], p) for name, p in model.named_parameters())
