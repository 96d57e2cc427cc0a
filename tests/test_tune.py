"""tune.py: autotune and the recommendation rule bench shares."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit.tune import choose, native_candidates

BF16 = torch.bfloat16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def test_autotune_measures_every_candidate_and_never_picks_one_slower_than_fp32():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    x, y = _batch()
    result = ampkit.autotune(model, x, y, candidates=["bf16-mixed", "O2-bf16"], steps=6)
    assert [r["policy"] for r in result.rows] == ["32-true", "bf16-mixed", "O2-bf16"]
    assert all(set(r) >= {"policy", "step_ms", "peak_mib", "max_loss_dev", "accepted", "reason"}
               for r in result.rows)
    fp32 = result.rows[0]
    assert fp32["max_loss_dev"] == 0.0 and fp32["accepted"]
    chosen = next(r for r in result.rows if r["policy"] == result.policy)
    assert chosen["step_ms"] <= fp32["step_ms"] and chosen["max_loss_dev"] <= 0.02
    assert result.speedup == pytest.approx(fp32["step_ms"] / chosen["step_ms"])
    # the caller's model and RNG are untouched
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(rng, torch.get_rng_state())
    assert result.to_dict()["policy"] == result.policy


def test_choose_is_the_rule_whatever_the_machine_measured():
    rows = [{"policy": "32-true", "step_ms": 10.0, "max_loss_dev": 0.0},
            {"policy": "bf16-mixed", "step_ms": 6.0, "max_loss_dev": 0.05},  # too far
            {"policy": "O2-bf16", "step_ms": 8.0, "max_loss_dev": 0.01},      # chosen
            {"policy": "16-mixed", "step_ms": 12.0, "max_loss_dev": 0.0},     # slower
            {"policy": "O2-fp16", "step_ms": 5.0, "max_loss_dev": None}]      # non-finite
    assert choose(rows, 0.02) == ("O2-bf16", 10.0 / 8.0)
    assert [r["accepted"] for r in rows] == [True, False, True, False, False]
    assert "no faster than fp32" in rows[3]["reason"] and "not finite" in rows[4]["reason"]
    slower = [dict(rows[0]), {"policy": "bf16-mixed", "step_ms": 11.0, "max_loss_dev": 0.0}]
    assert choose(slower, 0.02) == ("32-true", 1.0)


def test_apply_configures_the_users_model_as_chosen():
    model = _model()
    result = ampkit.tune.TuneResult("O2-bf16", rows=[], speedup=1.2)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = result.apply(model, opt)
    assert model[0].weight.dtype == BF16 and hasattr(opt, "_amp_stash")


def test_native_candidates_start_with_fp32():
    assert native_candidates("cpu")[0] == "32-true"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(candidates=["bf17-mixed"]), ValueError, r"unknown candidate 'bf17-mixed'"),
    (dict(candidates=[]), ValueError, r"candidates is empty"),
    (dict(optimizer="adam"), TypeError, r"optimizer must be a callable params -> optimizer"),
    (dict(steps=2), ValueError, r"steps must be an int >= 3"),
    (dict(max_loss_dev=-1), ValueError, r"max_loss_dev must be a number >= 0"),
])
def test_bad_arguments_raise_before_training(kwargs, error, match):
    model = _model()
    x, y = _batch()
    with pytest.raises(error, match=match):
        ampkit.autotune(model, x, y, **kwargs)


@pytest.mark.parametrize("inputs, error, match", [
    (None, TypeError, r"inputs must be a tensor or a tuple holding tensors"),
    ((), TypeError, r"inputs must be a tensor .* got tuple \(\)"),
    (torch.empty(0, 16), ValueError, r"inputs hold no samples \(shape \(0, 16\)\)"),
])
def test_empty_inputs_raise_before_training(inputs, error, match):
    with pytest.raises(error, match=match):
        ampkit.autotune(_model(), inputs, None)
