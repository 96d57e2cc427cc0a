"""optim.py: the one optimizer wrapper, optimizer._amp_stash, and copies that lost it."""

from __future__ import annotations

import copy
import io

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
