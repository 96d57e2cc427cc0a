"""optim.py: the one optimizer wrapper, optimizer._amp_stash, and copies that lost it."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import ampkit as amp

BF16 = torch.bfloat16


def _setup(level: str = "O2"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0)


def _train_step(model, opt):
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(4, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_amp_stash_exists_after_initialize_as_apex_clients_test(level):
    """mmengine's ApexOptimWrapper calls initialize again unless hasattr(opt, '_amp_stash')."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not hasattr(opt, "_amp_stash")
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0)
    assert hasattr(opt, "_amp_stash")
    with pytest.raises(RuntimeError, match="already passed through ampkit.initialize"):
        amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_an_o2_optimizer_is_refused_at_its_first_step(how):
    model, opt = _setup()
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        buffer = io.BytesIO()
        torch.save((model, opt), buffer)
        buffer.seek(0)
        model2, opt2 = torch.load(buffer, weights_only=False)
    model2(torch.randn(4, 4)).float().sum().backward()
    before = [m.detach().clone() for m in amp.master_params(opt2)]
    with pytest.raises(RuntimeError, match="copy.deepcopy the model and optimizer before "
                                           "ampkit.initialize"):
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt2)))
    with pytest.raises(RuntimeError, match=r"optimizers\[0\]: SGD steps copies of ampkit"):
        with amp.scale_loss(model2(torch.randn(4, 4)).float().sum(), opt2):
            pass
    _train_step(model, opt)  # the original trains on


def test_a_deepcopy_before_initialize_trains_its_own_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model2, opt2 = copy.deepcopy((model, opt))
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    model2, opt2 = amp.initialize(model2, opt2, opt_level="O2", half_dtype=BF16, verbosity=0)
    before = model2.weight.detach().clone()
    _train_step(model2, opt2)
    assert not torch.equal(before, model2.weight)


def test_a_plain_optimizer_is_not_taken_for_a_copy():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _setup()  # registers ampkit's global step hook
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # no error: its params are not ampkit masters


def _o2_fp16_steps(backward, steps=2, **kwargs):
    """Two O2 fp16 steps on a small model, each backward done by ``backward(loss, opt)``;
    the warnings they gave."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0, **kwargs)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = model(torch.randn(8, 4).half()).float().pow(2).mean()
            backward(loss, opt)
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in record]


def _scaled(loss, opt):
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()


def test_a_plain_backward_under_o2_fp16_with_loss_scaling_warns_once():
    """A forgotten scale_loss under O2 fp16 trained without loss scaling, silently: its
    small gradients flushed to zero (apex's step ignored such grads, also silently)."""
    messages = _o2_fp16_steps(lambda loss, opt: loss.backward())
    assert len(messages) == 1, messages  # once per optimizer, not per step
    assert messages[0].startswith("opt_level O2: a plain loss.backward() under fp16, which "
                                  "no loss scaling scaled")
    assert "amp.scale_loss(loss, optimizer)" in messages[0] and "loss_scale=1.0" in messages[0]
    # Through scale_loss, or with a loss scale of 1 (unscaled on purpose): no warning.
    assert _o2_fp16_steps(_scaled) == []
    assert _o2_fp16_steps(lambda loss, opt: loss.backward(), loss_scale=1.0) == []


def test_zeros_zero_grad_left_are_not_taken_for_unscaled_gradients():
    """zero_grad(set_to_none=False) before step(closure): the step moved the zero half
    grads zero_grad had put back before the closure ran, and warned that no loss scaling
    had scaled them, though every backward was in scale_loss (review)."""
    def closure_steps(model, opt):
        x = torch.randn(8, 4).half()

        def closure():
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            return 0.0
        opt.zero_grad(set_to_none=False)
        opt.step(closure)

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            closure_steps(model, opt)


def test_a_plain_backward_in_a_closure_under_o2_fp16_warns_too():
    """The step(closure) path moved a closure's plain-backward grads without the
    unscaled-fp16 warning a step without a closure gives (new-behaviour probe)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    x = torch.randn(8, 4).half()

    def closure():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss
    with pytest.warns(UserWarning, match="no loss scaling scaled"):
        opt.step(closure)


def test_the_torch_style_o2_fp16_loop_with_a_grad_scaler_does_not_warn():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    scaler = amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with amp.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4).half()).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


class _Branchy(nn.Module):
    """A model whose branch ``b`` (Linear + BatchNorm) a forward may leave out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.bn, self.c = (nn.Linear(8, 8), nn.Linear(8, 8),
                                           nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x, use_b=True):
        h = torch.relu(self.a(x))
        return self.c(h + self.bn(self.b(h)) if use_b else h)


def _branchy_steps(level, zero_grad):
    """Three steps with SGD momentum and weight decay: the second overflows (skipped), the
    third leaves branch b out; the model after them, and how far the third step moved
    branch b's parameters."""
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if level == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    else:
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.float16,
                                    verbosity=0)
    g = torch.Generator().manual_seed(3)
    names = ("b.weight", "bn.weight", "bn.bias")
    for i in range(3):
        before = [model.get_parameter(n).detach().float().clone() for n in names]
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        (model if zero_grad == "model" else opt).zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.float16, enabled=level == "torch"):
            out = model(x, use_b=i != 2)
        loss = nn.functional.cross_entropy(out.float(), y) * (float("inf") if i == 1 else 1.0)
        if level == "torch":
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            if i == 1:  # the skip left no inf/NaN behind, and kept a gradient to zero
                assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p))
                           for p in amp.master_params(opt))
    moved = {n: (model.get_parameter(n).float() - b).abs().max().item()
             for n, b in zip(names, before)}
    return model, moved


@pytest.mark.parametrize("zero_grad", ["optimizer", "model"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skip_keeps_zero_grads_so_an_unreached_branch_still_steps(level, zero_grad):
    """A skipped step dropped every gradient to None: after zero_grad(set_to_none=False), a
    parameter the next backward did not reach (a branch not taken) kept None and took no
    momentum or weight-decay step, where torch's skip leaves its gradient to be zeroed
    (O1 all of them, O2 its fp32 BatchNorm; training probe)."""
    (model, moved), (reference, torch_moved) = (_branchy_steps(level, zero_grad),
                                                _branchy_steps("torch", zero_grad))
    if level == "O2" and zero_grad == "model":  # the model's half grads moved into the
        del torch_moved["b.weight"]  # masters: model.zero_grad cannot zero them (documented)
    for name, distance in torch_moved.items():
        assert distance > 1e-3, name  # torch stepped it at the third step
        assert moved[name] == pytest.approx(distance, rel=0.05), name
        if level == "O1":  # the same arithmetic as torch.amp: equal bitwise
            assert torch.equal(model.get_parameter(name), reference.get_parameter(name)), name


def _o2_bf16(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0, **kwargs)


def test_a_disabled_grad_scalers_unscale_moves_o2_grads_for_the_clip():
    """GradScaler(enabled=use_fp16) is disabled in a bf16 run: its unscale_ did nothing, the
    half grads stayed on the model until step(), so a clip through amp.master_params saw no
    gradient (norm 0) and the step applied the unclipped one (training probe: 4.26 instead
    of 0.001)."""
    model, opt = _o2_bf16()
    scaler = amp.GradScaler("cpu", enabled=False)
    x = torch.randn(16, 4)
    scaler.scale(model(x.to(BF16)).float().pow(2).sum() * 100).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.01)
    assert norm > 1.0 and all(p.grad is not None for p in amp.master_params(opt))
    assert all(p.grad is None for p in model.parameters())  # moved, not copied
    before = [p.detach().clone() for p in amp.master_params(opt)]
    scaler.step(opt)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(amp.master_params(opt), before)])
    assert moved.norm().item() == pytest.approx(0.1 * 0.01, rel=1e-3)  # lr times the clip


def test_master_params_read_before_the_grads_moved_warns_at_their_move():
    """Clipping through amp.master_params before the grads joined the masters (a
    GradScaler loop without unscale_, a plain backward) clipped nothing, silently."""
    model, opt = _o2_bf16()
    scaler = amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        list(amp.master_params(opt))  # before any backward: nothing to say
        for _ in range(2):
            scaler.scale(model(torch.randn(4, 4).to(BF16)).float().sum()).backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)  # too early
            scaler.step(opt)  # unscale_ moves the grads the clip did not see: it warns
            scaler.update()
            opt.zero_grad()
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages  # once per optimizer
    assert messages[0].startswith("amp.master_params(optimizer) was read while gradients "
                                  "were still on the half model")
    assert "scaler.unscale_(optimizer)" in messages[0]


def test_master_params_read_in_legitimate_loops_does_not_warn():
    """The warning's false positives (new-behaviour probe): the zeros zero_grad(False)
    puts back read for an EMA of the masters, and a GAN's discriminator read for logging
    while it holds the generator loss's gradients, which netD.zero_grad() then drops."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = _o2_bf16()
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            ema = [p.detach().clone() for p in amp.master_params(opt)]  # weights, not grads
            with amp.scale_loss(model(torch.randn(4, 4).to(BF16)).float().sum(), opt) as s:
                s.backward()
            opt.step()
        torch.manual_seed(0)
        netG, netD = nn.Linear(4, 4), nn.Linear(4, 1)
        optG = torch.optim.SGD(netG.parameters(), lr=0.1)
        optD = torch.optim.SGD(netD.parameters(), lr=0.1)
        (netG, netD), (optG, optD) = amp.initialize([netG, netD], [optG, optD], opt_level="O2",
                                                    half_dtype=BF16, num_losses=2, verbosity=0)
        for _ in range(2):
            optG.zero_grad()
            with amp.scale_loss(netD(netG(torch.randn(4, 4).to(BF16))).float().mean(), optG,
                                loss_id=0) as s:
                s.backward()  # leaves gradients on netD too
            optG.step()
            norm = sum(p.norm() for p in amp.master_params(optD))  # logging D's weights
            netD.zero_grad()
            with amp.scale_loss(netD(torch.randn(4, 4).to(BF16)).float().mean(), optD,
                                loss_id=1) as s:
                s.backward()
            optD.step()
    assert ema and norm > 0


def test_frozen_params_left_out_of_the_optimizer_warn_when_added_later():
    """Parameters no optimizer stepped at initialize (a frozen backbone) were cast to half
    with no fp32 copy, and a group adding them later built masters from the rounded values,
    silently (training probe). It warns; the recipe, every parameter in the optimizer from
    the start, keeps them exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)  # the head only
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    assert not torch.equal(model.state_dict()["0.weight"], pretrained["0.weight"])  # rounded
    model[0].requires_grad_(True)
    with pytest.warns(UserWarning, match=r"add_param_group: 2 half parameter\(s\) join this "
                      "optimizer without an fp32 master"):
        opt.add_param_group({"params": model[0].parameters(), "lr": 0.01})
    with warnings.catch_warnings():  # the recipe: frozen params in the optimizer from the start
        warnings.simplefilter("error")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        model[0].requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                    verbosity=0)
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in pretrained.items())
        with amp.scale_loss(model(torch.randn(4, 64).half()).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert torch.equal(model.state_dict()["0.weight"], pretrained["0.weight"])  # no step
