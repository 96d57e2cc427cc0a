"""frontend.py: initialize (O0-O3, overrides, re-initialize, bad input), scale_loss, checkpoints."""

from __future__ import annotations

import copy
import gc
import io
import logging
import warnings
import weakref

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampkit import _state
from ampkit.autocast import autocast
from ampkit.convert import cast_model
from ampkit.frontend import initialize, load_state_dict, master_params, scale_loss, state_dict
from ampkit.frontend.state import _amp_state
from ampkit.optim import master_weights_of
from ampkit.overrides import register_float_function
from ampkit.scaler import GradScaler
from conftest import DEVICES, HALF_DTYPES

F32 = torch.float32
HALF = "half"  # stands for the parametrised half dtype in the opt-level table


def _model(device: str = "cpu", seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 4)).to(device)


def _batch(step: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(16, 8, generator=gen).to(device),
            torch.randn(16, 4, generator=gen).to(device))


def _loss(model: nn.Module, step: int, device: str = "cpu") -> torch.Tensor:
    x, y = _batch(step, device)
    return F.mse_loss(model(x).float(), y)


def _step(model, optimizer, step, *, overflow=False, device="cpu", loss_id=0):
    optimizer.zero_grad()
    loss = _loss(model, step, device)
    if overflow:
        loss = loss * float("inf")  # every gradient becomes inf or NaN
    with scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
    optimizer.step()


def _scale(loss_id: int = 0) -> float:
    return state_dict()[f"loss_scaler{loss_id}"]["loss_scale"]


def _untouched(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    return (all(p.dtype == F32 for p in model.parameters()) and not model._forward_hooks
            and not model._forward_pre_hooks and "step" not in optimizer.__dict__
            and master_weights_of(optimizer) is None)


# --- the opt-level table --------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("level, params, bn, out, masters, scale", [
    ("O0", F32, F32, F32, False, 1.0),
    ("O1", F32, F32, F32, False, 2.0**16),
    ("O2", HALF, F32, F32, True, 2.0**16),
    ("O3", HALF, HALF, HALF, False, 1.0),
])
def test_opt_level_table(device, dtype, level, params, bn, out, masters, scale):
    def resolve(d):
        return dtype if d == HALF else d

    model = _model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert initialize(model, optimizer, opt_level=level, half_dtype=dtype) == (model, optimizer)
    assert model[0].weight.dtype == resolve(params) and model[1].weight.dtype == resolve(bn)
    assert model[1].running_mean.dtype == resolve(bn)
    assert model(_batch(0, device)[0]).dtype == resolve(out)
    assert (master_weights_of(optimizer) is not None) == masters
    assert {p.dtype for p in master_params(optimizer)} == ({F32} if masters
                                                          else {resolve(params), resolve(bn)})
    assert state_dict() == {"loss_scaler0": {"loss_scale": scale, "unskipped": 0}}
    assert {k: v.dtype for k, v in model.state_dict().items() if v.is_floating_point()} == {
        k: F32 for k, v in model.state_dict().items() if v.is_floating_point()}
    active = _state.get_active()
    assert (active.device_type, active.half_dtype) == (device, None if level == "O0" else dtype)


def test_half_dtype_defaults_to_the_device_autocast_dtype():
    model = _model()
    initialize(model, opt_level="O2")
    assert model[0].weight.dtype == torch.bfloat16  # CPU's autocast default


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o1_forward_runs_under_ampkit_autocast_with_overrides(dtype):
    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 2))

        def forward(self, x):
            self.seen = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            self.mm_dtype = torch.mm(x, self.w).dtype
            return x @ self.w

    model = Probe()
    initialize(model, opt_level="O1", half_dtype=dtype)
    assert model(torch.ones(1, 2)).dtype == F32  # outputs cast back to fp32
    assert model.seen == (True, dtype) and model.mm_dtype == dtype
    register_float_function(torch, "mm")
    model(torch.ones(1, 2))
    assert model.mm_dtype == F32  # the registered override applied inside O1 forward
    assert not torch.is_autocast_enabled("cpu")


def test_list_of_models_and_optimizers_mirror_the_input():
    models = [_model(seed=0), _model(seed=1)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    out_models, out_opts = initialize(models, optimizers, opt_level="O2")
    assert out_models is models and out_opts is optimizers
    assert all(m[0].weight.dtype == torch.bfloat16 for m in models)
    assert all(master_weights_of(o) is not None for o in optimizers)
    assert initialize(_model(), opt_level="O1") is not None


def test_enabled_false_returns_inputs_untouched():
    initialize(_model(), opt_level="O2")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert initialize(model, optimizer, opt_level="O2", enabled=False) == (model, optimizer)
    assert _untouched(model, optimizer) and not _state.get_active().enabled
    loss = _loss(model, 0)
    with scale_loss(loss, optimizer) as scaled:
        assert scaled is loss
    assert state_dict() == {}


# --- keyword overrides ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_keyword_overrides(dtype):
    model = _model()
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
               half_dtype=dtype, keep_batchnorm_fp32=False, master_weights=False,
               cast_model_outputs=dtype, loss_scale=128.0)
    assert model[1].weight.dtype == dtype and model(_batch(0)[0]).dtype == dtype
    assert _scale() == 128.0 and _state.get_active().policy.master_weights is False
    model = _model()
    initialize(model, opt_level="O3", half_dtype=dtype, keep_batchnorm_fp32="True",
               loss_scale="dynamic")
    assert model[1].weight.dtype == F32 and model[0].weight.dtype == dtype and _scale() == 2.0**16
    model = _model()
    initialize(model, opt_level="O1", half_dtype=dtype, patch_torch_functions=False,
               cast_model_type=torch.float16)
    assert model[0].weight.dtype == torch.float16 and not _state.get_active().policy.autocast
    model = _model()
    initialize(model, opt_level="O2", cast_model_type=torch.float32, loss_scale="64")
    assert model[0].weight.dtype == F32 and _scale() == 64.0
    assert _state.get_active().policy.master_weights is False  # fp32 params are their own masters


def test_min_and_max_loss_scale_bound_the_dynamic_scale():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1", min_loss_scale=40000.0)
    for step in range(2):
        _step(model, optimizer, step, overflow=True)
        assert _scale() == 40000.0
    initialize(_model(), opt_level="O1", max_loss_scale=1024)
    assert _scale() == 1024.0


# --- re-initialize ----------------------------------------------------------------------------
def test_reinitialize_same_model_leaves_no_stale_hooks():
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, first, opt_level="O2")
    counts = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._state_dict_hooks))
              for m in model.modules()]
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, second, opt_level="O2")
    assert counts == [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._state_dict_hooks))
                      for m in model.modules()]
    assert all(not p._post_accumulate_grad_hooks for p in model[0].parameters())  # none at all
    _loss(model, 0).backward()
    half = master_weights_of(second).model_params
    weights = [p.detach().clone() for p in half]
    first.step()  # released: takes no half grads and writes nothing into the half params
    assert all(torch.equal(a, b) for a, b in zip(weights, half))
    assert all(p.grad is not None for p in half)
    assert all(m.grad is None for m in master_weights_of(first).master_params)
    master_weights_of(second).move_grads()
    assert all(m.grad is not None for m in master_weights_of(second).master_params)


def test_reinitialize_keeps_the_fp32_master_values():
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, first, opt_level="O2")
    with torch.no_grad():
        master_weights_of(first).master_params[0].add_(1e-4)  # not representable in bf16
    expected = [m.clone() for m in master_weights_of(first).master_params]
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, second, opt_level="O2")
    assert all(torch.equal(a, b) for a, b in zip(expected, master_weights_of(second).master_params))


def test_reinitialize_with_new_objects_frees_the_old_ones():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16)
    _step(model, optimizer, 0)
    refs = [weakref.ref(model), weakref.ref(optimizer)]
    del model, optimizer
    new = _model()
    initialize(new, torch.optim.Adam(new.parameters()), opt_level="O1", half_dtype=torch.bfloat16)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert (_state.get_active().device_type, _state.get_active().half_dtype) == ("cpu", torch.bfloat16)
    assert _scale() == 2.0**16


def test_already_initialized_optimizer_is_refused_before_any_change():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1")
    other = _model()
    active = _state.get_active()
    with pytest.raises(RuntimeError, match=r"optimizers\[1\] \(SGD\) was already passed through"):
        initialize([other], [torch.optim.SGD(other.parameters(), lr=0.1), optimizer],
                   opt_level="O2")
    assert other[0].weight.dtype == F32 and not other._forward_pre_hooks
    assert _state.get_active() is active


# --- bad input ------------------------------------------------------------------------------
def _ddp() -> nn.Module:
    # A real DDP needs a process group; the type check needs only the type.
    return nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(opt_level="O5"), ValueError, r"unknown opt_level 'O5'; valid: 'O0', 'O1', 'O2', 'O3'"),
    (dict(opt_level="0"), ValueError, r"did you mean 'O0', with the capital letter O\?\); "
                                      r"valid: 'O0'"),
    (dict(opt_level=2), ValueError, r"unknown opt_level 2 .*did you mean 'O2'"),
    (dict(opt_level="02"), ValueError, r"unknown opt_level '02' \(a zero: did you mean 'O2', "
                                       r"with the capital letter O\?\); valid: 'O0'"),
    (dict(opt_level="o2"), ValueError, r"unknown opt_level 'o2' \(a lower-case o: did you mean "
                                       r"'O2', with the capital letter O\?\); valid: 'O0'"),
    (dict(half_dtype=torch.float32), ValueError, r"half_dtype torch.float32 .* valid: .*bf16"),
    (dict(half_dtype="fp8"), ValueError, r"unknown half_dtype 'fp8'; valid names: .*fp16"),
    (dict(loss_scale="big"), ValueError, r"loss_scale 'big' is neither 'dynamic' nor"),
    (dict(loss_scale=-2.0), ValueError, r"loss_scale -2.0 is neither 'dynamic' nor a positive"),
    (dict(loss_scale=0), ValueError, r"loss_scale 0 is neither 'dynamic' nor a positive"),
    (dict(loss_scale=[1]), TypeError, r"loss_scale must be 'dynamic' or a positive number"),
    (dict(num_losses=0), ValueError, r"num_losses must be an int >= 1, got 0"),
    (dict(verbosity=-1), ValueError, r"verbosity must be an int >= 0, got -1"),
    (dict(min_loss_scale=-1.0), ValueError, r"min_loss_scale must be a positive finite number"),
    (dict(max_loss_scale=None), TypeError, r"max_loss_scale must be a positive finite number"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), ValueError, r"min_loss_scale=8.0 is greater"),
    (dict(keep_batchnorm_fp32="yes"), TypeError, r"keep_batchnorm_fp32 must be a bool, got str "
                                                 r"'yes'; valid: True, False, 'True', 'False'"),
    (dict(master_weights=1), TypeError, r"master_weights must be a bool, got int 1"),
    (dict(patch_torch_functions="on"), TypeError, r"patch_torch_functions must be a bool"),
    (dict(cast_model_type=torch.int32), ValueError, r"cast_model_type torch.int32 is not allowed"),
    (dict(cast_model_outputs="int8"), ValueError, r"unknown cast_model_outputs 'int8'"),
    (dict(cast_model_type=True), TypeError, r"cast_model_type must be a torch.dtype"),
    (dict(enabled="yes"), TypeError, r"enabled must be a bool, got str 'yes'; valid: True, False"),
])
def test_bad_keyword_raises_before_any_change(kwargs, error, match):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        initialize(model, optimizer, **kwargs)
    assert _untouched(model, optimizer) and _state.get_active() is None and _state.get_active() is None


@pytest.mark.parametrize("models, optimizers, error, match", [
    (lambda m: [m, "net"], None, TypeError, r"models\[1\] is a str \('net'\), not a torch.nn.Module"),
    (lambda m: 3, None, TypeError, r"models must be a torch.nn.Module or a list of them, got int 3"),
    (lambda m: [], None, ValueError, r"models is an empty list"),
    (lambda m: nn.DataParallel(m), None, TypeError, r"models\[0\] is wrapped in DataParallel; "
                                                     r"pass the bare module"),
    (lambda m: [m, _ddp()], None, TypeError, r"models\[1\] is wrapped in DistributedDataParallel"),
    (lambda m: m, lambda o: [o, "sgd"], TypeError,
     r"optimizers\[1\] is a str \('sgd'\), not a torch.optim.Optimizer"),
    (lambda m: m, lambda o: [o, o], ValueError, r"optimizers\[1\] \(SGD\) is listed twice"),
])
def test_bad_models_or_optimizers_raise_before_any_change(models, optimizers, error, match):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        initialize(models(model), None if optimizers is None else optimizers(optimizer),
                   opt_level="O2")
    assert _untouched(model, optimizer) and _state.get_active() is None


def test_scale_loss_bad_input():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"ampkit.initialize has not been called"):
        with scale_loss(_loss(model, 0), optimizer):
            pass
    initialize(model, optimizer, opt_level="O1", num_losses=2)
    stranger = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(optimizers=[optimizer, stranger]), RuntimeError,
         r"optimizers\[1\] \(SGD\) was not passed through ampkit.initialize"),
        (dict(loss_id=2), ValueError, r"loss_id=2 is out of range; valid: 0..1 \(initialize had "
                                      r"num_losses=2\)"),
        (dict(loss_id=-1), ValueError, r"loss_id=-1 is out of range"),
        (dict(loss=1.5), TypeError, r"loss must be a torch.Tensor, got float 1.5"),
        (dict(optimizers="sgd"), TypeError, r"optimizers must be a torch.optim.Optimizer or a list"),
    ]
    for overrides, error, match in cases:
        kwargs = dict(loss=_loss(model, 0), optimizers=optimizer) | overrides
        with pytest.raises(error, match=match):
            with scale_loss(**kwargs):
                pass
    with pytest.raises(TypeError, match=r"master_params takes a torch.optim.Optimizer, got list"):
        master_params([optimizer])


# --- scale_loss -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_scaled_loss_is_fp32_times_the_scale_and_grads_come_back_unscaled(dtype):
    reference = _model()
    _loss(reference, 0).backward()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O0", loss_scale="dynamic", half_dtype=dtype)
    loss = _loss(model, 0).to(dtype)
    with scale_loss(loss, optimizer) as scaled:
        assert scaled.dtype == F32 and torch.equal(scaled, loss.float() * 2.0**16)
        _loss(model, 0).mul(2.0**16).backward()
    # A power-of-two scale commutes with every rounding: bitwise the unscaled fp32 grads.
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_overflow_skips_the_step_and_halves_the_scale(level, dtype):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    initialize(model, optimizer, opt_level=level, half_dtype=dtype)
    _step(model, optimizer, 0)
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in master_params(optimizer)]
    state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    _step(model, optimizer, 1, overflow=True)
    assert _scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, master_params(optimizer)))
    assert all(torch.equal(v, optimizer.state_dict()["state"][0][k]) for k, v in state.items())
    # No inf/NaN left behind: each gradient dropped or zeroed, as zero_grad leaves them.
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p))
               for p in list(model.parameters()) + list(master_params(optimizer)))
    _step(model, optimizer, 2)  # the next clean step runs
    assert not torch.equal(params[0], model[0].weight)
    assert state_dict()["loss_scaler0"]["unskipped"] == 1


def test_overflow_skips_only_the_optimizers_of_that_loss():
    models = [_model(seed=0), _model(seed=1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    initialize(models, opts, opt_level="O2", num_losses=2)
    before = [m[0].weight.detach().clone() for m in models]
    for opt in opts:
        opt.zero_grad()
    for i, (model, opt) in enumerate(zip(models, opts)):
        loss = _loss(model, i) * (float("inf") if i == 0 else 1.0)
        with scale_loss(loss, opt, loss_id=i) as scaled:
            scaled.backward()
    for opt in opts:
        opt.step()
    assert torch.equal(models[0][0].weight, before[0])
    assert not torch.equal(models[1][0].weight, before[1])
    assert (_scale(0), _scale(1)) == (2.0**15, 2.0**16)


@pytest.mark.parametrize("verbosity, level", [(0, logging.DEBUG), (1, logging.INFO),
                                              (2, logging.WARNING)])
def test_overflow_is_logged_at_the_verbosity_level_and_never_printed(verbosity, level, caplog,
                                                                      capsys):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1", verbosity=verbosity)
    caplog.set_level(logging.DEBUG, logger="ampkit")
    caplog.clear()
    _step(model, optimizer, 0, overflow=True)
    records = [r for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert [r.levelno for r in records] == [level]
    assert "skipping the next step() of SGD; loss scaler 0 now at 32768" in records[0].getMessage()
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_accumulation_with_and_without_delay_unscale_agree_bitwise(level, dtype):
    grads = []
    for delay in (True, False):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        initialize(model, optimizer, opt_level=level, half_dtype=dtype)
        optimizer.zero_grad()
        for micro in range(3):
            with scale_loss(_loss(model, micro), optimizer,
                            delay_unscale=delay and micro < 2) as scaled:
                scaled.backward()
        grads.append([p.grad.clone() for p in master_params(optimizer)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_masters_accumulate_the_fp32_sum_of_the_half_grads(dtype):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O2", half_dtype=dtype)
    reference = cast_model(_model(), dtype)  # the same half model, by hand
    expected = None
    for micro in range(2):
        reference.zero_grad()
        x, y = _batch(micro)
        (F.mse_loss(reference(x.to(dtype)).float(), y) * 2.0**16).backward()
        half = [p.grad.float() for p in reference[0].parameters()]
        expected = half if expected is None else [a + b for a, b in zip(expected, half)]
        with scale_loss(_loss(model, micro), optimizer, delay_unscale=micro == 0) as scaled:
            scaled.backward()
    masters = master_weights_of(optimizer).master_params[:2]
    assert all(torch.equal(m.grad, e * 2.0**-16) for m, e in zip(masters, expected))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_two_losses_with_different_scales_accumulate_into_one_optimizer(level, dtype):
    grads = []
    for second_scale in (2.0**16, 2.0**10):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        initialize(model, optimizer, opt_level=level, half_dtype=dtype, num_losses=2)
        load_state_dict({"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": second_scale, "unskipped": 0}})
        optimizer.zero_grad()
        for loss_id in range(2):
            with scale_loss(_loss(model, loss_id), optimizer, loss_id=loss_id) as scaled:
                scaled.backward()
        grads.append([p.grad.clone() for p in master_params(optimizer)])
    # Each loss is unscaled by its own scale; only half rounding of the grads differs.
    assert all(torch.allclose(a, b, rtol=2e-2, atol=1e-5) for a, b in zip(*grads))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("delays", [(True, False), (False, True, False), (True, True, False)])
def test_delay_unscale_across_losses_with_other_scales_matches_no_delay(level, delays):
    """One process: grads a delayed exit left scaled by loss 0's scale were added to loss
    1's and unscaled by loss 1's scale (a gradient off by their ratio, 64x here, silently:
    O1, and O2's fp32 batch-norm params, which the optimizer steps itself). Now every
    exit first brings the held grads to its own scale: bitwise what no delay gives."""
    scales = [2.0**16, 2.0**10, 2.0**13]
    grads = []
    for use_delay in (True, False):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, eps=1e-4)
        initialize(model, optimizer, opt_level=level, half_dtype=torch.float16,
                   num_losses=len(delays), verbosity=0)
        load_state_dict({f"loss_scaler{i}": {"loss_scale": scales[i], "unskipped": 0}
                         for i in range(len(delays))})
        optimizer.zero_grad()
        for loss_id, delay in enumerate(delays):
            with scale_loss(_loss(model, loss_id), optimizer, loss_id=loss_id,
                            delay_unscale=use_delay and delay) as scaled:
                scaled.backward()
        grads.append([p.grad.clone() for p in master_params(optimizer)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _scales_through(level: str, exits: list[tuple[int, bool, bool]], num_losses: int = 1):
    """Each loss scaler's scale after each exit of one iteration: (loss_id, delay, an inf
    planted in that exit's backward)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"loss_scale": "dynamic"} if level == "O3" else {}
    initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16,
               num_losses=num_losses, verbosity=0, **extra)
    scalers = _state.get_active().scalers
    x = torch.randn(5, 4)
    optimizer.zero_grad()
    seen = []
    for loss_id, delay, plant in exits:
        with scale_loss(model(x).float().pow(2).mean(), optimizer, loss_id=loss_id,
                        delay_unscale=delay) as scaled:
            scaled.backward()
            if plant:
                model.weight.grad[0, 0] = float("inf")
        seen.append([s.get_scale() for s in scalers])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped
    return seen


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("clean_first", [False, True])
def test_one_overflow_backs_the_scale_off_once_across_a_delayed_exit(level, clean_first):
    """A delayed exit scaled the grads an earlier exit had unscaled (and flagged) back up,
    and the next exit that did not delay flagged them again: 65536 -> 32768 -> 16384 for
    one overflow (torch's rule on the flags [inf, clean]: 32768, then 32768). Also when a
    clean exit came between the overflow and the delayed one. (O1 and O3; O2's masters
    hold the grads apart and never counted twice: a guard there.)"""
    exits = [(0, False, True)] + [(0, False, False)] * clean_first + [(0, True, False),
                                                                      (0, False, False)]
    seen = _scales_through(level, exits)
    assert [s[0] for s in seen] == [2.0**15] * len(exits)


def test_another_losss_overflow_does_not_back_off_a_clean_loss_across_a_delayed_exit():
    seen = _scales_through("O1", [(0, False, True), (1, True, False), (1, False, False)],
                           num_losses=2)
    assert seen[-1] == [2.0**15, 2.0**16]


def test_an_overflow_in_a_delayed_exit_after_a_counted_one_is_counted_too():
    """From the delayed exit on, each delayed exit's own grads are checked as it ends: an
    overflow there is its update's, though the held grads' earlier one is not counted again."""
    seen = _scales_through("O1", [(0, False, True), (0, True, True), (0, False, False)])
    assert [s[0] for s in seen] == [2.0**15, 2.0**15, 2.0**14]


@pytest.mark.parametrize("earlier_overflow", [False, True])
def test_an_overflow_counted_before_the_last_step_never_hides_a_new_one(earlier_overflow):
    """The flags an exit counted must not outlive the step they skipped: a stale one
    marked held fp16 grads that a delayed exit scaled past fp16's range as counted, and
    their inf reached the weights (O3 fp16, two losses; the review of the fix above)."""
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O3", half_dtype=torch.float16,
                            loss_scale="dynamic", num_losses=2, verbosity=0)
    x = torch.ones(1, 1, dtype=torch.float16)

    def exit_(loss_id, delay, k, plant=False):
        with scale_loss(model(x).float().sum() * k, opt, loss_id=loss_id,
                        delay_unscale=delay) as scaled:
            scaled.backward()
            if plant:
                model.bias.grad.fill_(float("inf"))

    opt.zero_grad()
    if earlier_overflow:  # counted, and its step skipped
        exit_(0, False, 1.0, plant=True)
    else:
        _amp_state.loss_scalers[0]._loss_scale = 32768.0
        exit_(0, False, 0.0)
    opt.step()
    before = model.bias.detach().clone()
    opt.zero_grad()
    exit_(0, True, 0.0)
    exit_(0, False, 1.5)  # bias grad 1.5, unscaled
    exit_(1, True, 0.0)   # loss 1's scale, 65536: 1.5 * 65536 is past fp16's range
    exit_(1, False, 0.0)
    opt.step()
    assert torch.equal(model.bias, before)  # skipped: the overflow was counted


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grads_a_fused_step_skipped_on_the_device_are_checked_again_without_zero_grad(level):
    """A fused step skips on the device and keeps its inf grads; the next scale_loss,
    without zero_grad, added them back after its check, and the step applied them."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    model, opt = initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                            verbosity=0)
    x = torch.ones(1, 2)

    def exit_(plant):
        with scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
            if plant:
                model.weight.grad[0, 0] = float("inf")

    opt.zero_grad()
    exit_(True)
    opt.step()  # skipped by the fused kernel
    assert model.weight.isfinite().all()
    exit_(False)  # onto the kept grads: no zero_grad in between
    opt.step()
    assert model.weight.isfinite().all()


def test_a_delay_overflow_check_exits_flag_is_not_taken_as_counted():
    """Its flag neither updates the scale nor skips a step: held grads holding its inf,
    scaled back up by a delayed exit, must still count at the next exit."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.ones(1, 2)
    before = model.weight.detach().clone()
    opt.zero_grad()
    with scale_loss(model(x).float().sum(), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
        model.weight.grad[0, 0] = float("inf")
    for delay in (True, False):
        with scale_loss(model(x).float().sum(), opt, delay_unscale=delay) as scaled:
            scaled.backward()
    opt.step()
    assert torch.equal(model.weight, before)
    assert _state.get_active().scalers[0].get_scale() == 2.0**15


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_with_model_zero_grad_does_not_accumulate_into_the_masters(dtype):
    params = []
    for zero in ("optimizer", "model"):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        initialize(model, optimizer, opt_level="O2", half_dtype=dtype)
        for step in range(3):
            (optimizer if zero == "optimizer" else model).zero_grad()
            with scale_loss(_loss(model, step), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        params.append([p.detach().clone() for p in master_params(optimizer)])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_delay_overflow_check_neither_updates_nor_skips():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1")
    optimizer.zero_grad()
    with scale_loss(_loss(model, 0) * float("inf"), optimizer, delay_overflow_check=True) as s:
        s.backward()
    optimizer.step()
    assert _scale() == 2.0**16 and not torch.isfinite(model[0].weight).all()


def test_static_loss_scale_unscales_and_never_changes():
    reference = _model()
    _loss(reference, 0).backward()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O0", loss_scale=128)
    with scale_loss(_loss(model, 0), optimizer) as scaled:
        scaled.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    _step(model, optimizer, 1, overflow=True)
    assert _scale() == 128.0 and not torch.isfinite(model[0].weight).all()  # as apex: no skip


def test_exception_in_the_body_restores_the_earlier_grads():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1")
    optimizer.zero_grad()
    with scale_loss(_loss(model, 0), optimizer) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="inside"):
        with scale_loss(_loss(model, 1), optimizer):
            raise ValueError("inside")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert _scale() == 2.0**16


# --- O2 with the optimizer's own API and the torch-style loop -------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_torch_style_loop_with_gradscaler_steps_the_masters(dtype):
    def run(torch_style: bool) -> list[torch.Tensor]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        initialize(model, optimizer, opt_level="O2", half_dtype=dtype)
        scaler = GradScaler()
        for step in range(3):
            optimizer.zero_grad()
            if torch_style:
                with autocast():
                    loss = _loss(model, step)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                _step(model, optimizer, step)
        masters = master_weights_of(optimizer)
        assert all(torch.equal(p, m.to(dtype)) for p, m in zip(masters.model_params,
                                                               masters.master_params))
        return [p.detach().clone() for p in master_params(optimizer)]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_o2_add_param_group_and_lr_scheduler():
    model = _model()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O2")
    optimizer.add_param_group({"params": model[3].parameters(), "lr": 0.2})
    masters = optimizer.param_groups[1]["params"]
    assert [m.dtype for m in masters] == [F32, F32] and masters[0] is not model[3].weight
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        _step(model, optimizer, 0)
        scheduler.step()
    assert torch.equal(model[3].weight, masters[0].to(torch.bfloat16))
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.1]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_lr_scheduler_built_before_initialize_gives_no_override_warning(level):
    """torch warned "optimizer.step() has been overridden after learning rate scheduler
    initialization" at the first scheduler step when the scheduler was built before
    initialize (apex's O1 did not replace step): ampkit's step now carries the mark of
    the scheduler's wrapper, which it calls, and the rates follow the schedule."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    initialize(model, optimizer, opt_level=level, verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(2):
            _step(model, optimizer, i)
            scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.025]
    assert getattr(optimizer, "_opt_called", False)  # the scheduler saw the steps
    model = _model()  # a scheduler built after initialize wraps ampkit's (unmarked) step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level=level, verbosity=0)
    assert not hasattr(optimizer.step, "_wrapped_by_lr_sched")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, optimizer, 0)
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.05]


@pytest.mark.parametrize("built_before", [False, True], ids=["scheduler-after", "before"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skipped_first_step_warns_at_the_first_scheduler_step_as_apex_did(level,
                                                                           built_before):
    """The scheduler's wrapper counted ampkit's skipped step as a step, so torch's warning
    that the schedule ran ahead of the optimizer was lost; apex (whose skip replaced step)
    and torch's GradScaler (which does not call step) both give it. Later skips do not."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if built_before:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    initialize(model, optimizer, opt_level=level, half_dtype=torch.float16, verbosity=0)
    if not built_before:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _step(model, optimizer, 0, overflow=True)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        scheduler.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(1, 3):
            _step(model, optimizer, i, overflow=i == 2)
            scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.0125]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skip_after_a_step_does_not_warn_at_the_first_scheduler_step(level):
    """A skip set the scheduler's flag back to "no step called" even after real steps: a
    per-epoch scheduler whose epoch ended on a skipped step (or a SequentialLR switching
    after one) warned "lr_scheduler.step() before optimizer.step()", where torch's
    GradScaler and apex do not (training probe)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level=level, half_dtype=torch.float16, verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):  # one epoch: two steps, then a skip
            _step(model, optimizer, i, overflow=i == 2)
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.05]


# --- checkpoints ------------------------------------------------------------------------------
def _fresh(level: str, dtype: torch.dtype, seed: int):
    model = _model(seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    return (*initialize(model, optimizer, opt_level=level, half_dtype=dtype), )


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_checkpoint_resumes_bitwise(level, dtype):
    model, optimizer = _fresh(level, dtype, seed=0)
    dynamic = level in ("O1", "O2")
    for step in range(3):
        _step(model, optimizer, step, overflow=dynamic and step == 1)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": state_dict()}, buffer)
    for step in range(3, 5):
        _step(model, optimizer, step)
    expected = ([p.clone() for p in model.state_dict().values()],
                [p.clone() for p in master_params(optimizer)], state_dict())

    model, optimizer = _fresh(level, dtype, seed=1)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    load_state_dict(checkpoint["amp"])
    for step in range(3, 5):
        _step(model, optimizer, step)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], model.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], master_params(optimizer)))
    assert state_dict() == expected[2]
    if dynamic:
        assert expected[2]["loss_scaler0"]["loss_scale"] == 2.0**15


def test_load_state_dict_accepts_apex_entries_and_rejects_bad_ones():
    initialize(_model(), opt_level="O1", num_losses=2)
    load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7},
                     "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    assert [(v["loss_scale"], v["unskipped"]) for v in state_dict().values()] == [(1024.0, 7),
                                                                                 (8.0, 0)]
    with pytest.raises(ValueError, match=r"state_dict\['loss_scaler1'\] is 3; valid: a dict"):
        load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": 3})
    # Named by the checkpoint's own keys and entry (it said "scale=-1.0", "_growth_tracker").
    for entry, error, words in [
            ({"loss_scale": -1.0, "unskipped": 0}, ValueError,
             r"\['loss_scale'\] must be a positive finite number, got -1.0"),
            ({"loss_scale": float("nan"), "unskipped": 0}, ValueError, r"\['loss_scale'\].*got nan"),
            ({"loss_scale": 0.0, "unskipped": 0}, ValueError, r"\['loss_scale'\].*got 0.0"),
            ({"loss_scale": float("inf"), "unskipped": 0}, ValueError, r"\['loss_scale'\].*got inf"),
            ({"loss_scale": "8", "unskipped": 0}, TypeError, r"\['loss_scale'\].*got str '8'"),
            ({"loss_scale": 8.0, "unskipped": -1}, ValueError, r"\['unskipped'\] must be an int"),
            ({"loss_scale": 8.0, "unskipped": 1.5}, TypeError, r"\['unskipped'\] must be an int"),
            # torch's growth tracker is int32: it raised after the scale had been loaded
            ({"loss_scale": 8.0, "unskipped": 2**31}, ValueError,
             r"\['unskipped'\] must be an int in \[0, 2147483647\], got 2147483648")]:
        with pytest.raises(error, match=r"amp state_dict\['loss_scaler1'\]" + words):
            load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
                             "loss_scaler1": entry})
    assert _scale(0) == 1024.0  # nothing loaded from the rejected dicts


def test_a_static_scale_checkpoint_resumed_with_a_dynamic_scale_grows_again():
    """A static run's 'unskipped' counts every step (5000 here); loaded into a dynamic
    scaler (interval 2000) the scale never grew again before an overflow (apex's rule,
    unskipped == interval, stalls the same way)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = initialize(model, optimizer, opt_level="O1", loss_scale="dynamic",
                                  verbosity=0)
    load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 5000}})
    assert state_dict()["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 1999}
    x, y = _batch(0)
    with scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert state_dict()["loss_scaler0"] == {"loss_scale": 256.0, "unskipped": 0}


def test_load_state_dict_with_another_loss_count_warns_and_loads_in_order_as_apex():
    """It was refused: apex warned and loaded the entries it had scalers for, so a run
    resumed with another num_losses kept going."""
    initialize(_model(), opt_level="O1", num_losses=2)
    with pytest.warns(UserWarning, match=r"1 loss scaler\(s\) \['loss_scaler0'\], initialize "
                                         r"has num_losses=2: loading the first 1 in order"):
        load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 5}})
    assert [(v["loss_scale"], v["unskipped"]) for v in state_dict().values()] == [
        (2.0, 5), (65536.0, 0)]
    with pytest.warns(UserWarning, match=r"loading the first 2 in order"):
        load_state_dict({f"loss_scaler{i}": {"loss_scale": 4.0 * (i + 1), "unskipped": i}
                         for i in range(3)})
    assert [(v["loss_scale"], v["unskipped"]) for v in state_dict().values()] == [
        (4.0, 0), (8.0, 1)]
    with pytest.raises(ValueError, match=r"key 'loss_scaler2' among .*valid: 'loss_scaler0' "
                                         r"\.\. 'loss_scaler<k-1>'"):
        load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
                         "loss_scaler2": {"loss_scale": 2.0, "unskipped": 0}})
    assert _scale(0) == 4.0


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_fused_optimizer_skips_an_overflow_on_the_device_without_a_host_sync(level, dtype,
                                                                             monkeypatch):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    initialize(model, optimizer, opt_level=level, half_dtype=dtype)
    _step(model, optimizer, 0)
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in master_params(optimizer)]
    state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    _step(model, optimizer, 1, overflow=True)
    monkeypatch.undo()
    assert reads == []
    assert _scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, master_params(optimizer)))
    assert all(torch.equal(v, optimizer.state_dict()["state"][0][k]) for k, v in state.items())
    _step(model, optimizer, 2)  # the next clean step runs, and counts as the second step
    assert not torch.equal(params[0], model[0].weight)
    assert optimizer.state_dict()["state"][0]["step"].item() == 2.0
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")


def test_fused_overflow_is_logged_later_without_a_host_sync(caplog, monkeypatch):
    """A listening logger must not bring back the per-step sync that fused optimizers avoid:
    the overflow is logged by the next scale_loss, from a copy already on the host."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    initialize(model, optimizer, opt_level="O1", verbosity=2)
    caplog.set_level(logging.WARNING, logger="ampkit")
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    _step(model, optimizer, 0, overflow=True)
    monkeypatch.undo()
    assert reads == []
    assert not any("Gradient overflow" in r.getMessage() for r in caplog.records)
    _step(model, optimizer, 1)
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert messages == ["Gradient overflow: the step of AdamW was skipped on the device; loss "
                        "scaler 0 backed off"]


def test_load_state_dict_of_a_non_dict_is_a_type_error():
    model = _model()
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    with pytest.raises(TypeError, match=r"amp state_dict must be a dict .* got list \[1\]; "
                                        r"valid: a dict with keys \['loss_scaler0'\]"):
        load_state_dict([1])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_masters_start_from_the_unrounded_fp32_weights(dtype):
    model = _model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O2", half_dtype=dtype)
    assert model[0].weight.dtype == dtype
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in original.items())  # not rounded to half


@pytest.mark.parametrize("first", ["O2", "O3"])
@pytest.mark.parametrize("then", ["O0", "O1"])
def test_initialize_again_at_an_fp32_level_gives_the_fp32_model_back(first, then):
    model = _model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=first,
               half_dtype=torch.bfloat16)
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=then)
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == {F32}
    assert all(p.dtype == F32 for p in model.parameters())
    if first == "O2":  # the masters held the exact fp32 values
        assert all(torch.equal(model.state_dict()[k], v) for k, v in original.items())
    assert model(_batch(0)[0]).dtype == F32


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_compiled_model_trains_as_the_eager_one(level):
    def losses(compiled: bool) -> list[float]:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        out = []
        for step in range(3):
            optimizer.zero_grad()
            x, y = _batch(step)
            loss = F.mse_loss(run(x).float(), y)
            with scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            out.append(loss.item())
        return out

    torch._dynamo.reset()
    assert losses(compiled=True) == losses(compiled=False)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_compiled_model_is_one_graph_on_every_supported_torch(level):
    """O1's forward runs in an autocast region. torch 2.11's dynamo cannot trace the
    switches ampkit.autocast sets, so the graph broke at every forward (fullgraph=True
    raised); the converted forward enters torch's own autocast while dynamo traces."""
    model = _model()
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level,
               half_dtype=torch.bfloat16)
    x = _batch(0)[0]
    eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        got = compiled(x)
        assert got.dtype is eager.dtype and torch.equal(got, eager)
    assert not torch.is_autocast_enabled("cpu")


def test_an_o1_model_pickled_by_an_earlier_version_still_runs():
    """tests/data/o1_bf16_model_343cdb7.pt: torch.save of an O1 (bf16) model by ampkit at
    commit 343cdb7, whose converted forward stored a factory of autocast regions. A
    change of that field's meaning made every forward of such a model raise TypeError."""
    path = Path(__file__).parent / "data" / "o1_bf16_model_343cdb7.pt"
    loaded = torch.load(path, weights_only=False)
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    initialize(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), opt_level="O1",
               half_dtype=torch.bfloat16)
    x = torch.arange(8.0).reshape(2, 4) / 8
    got, want = loaded(x), fresh(x)
    assert got.dtype is want.dtype is F32 and torch.equal(got, want)


def test_an_o2_model_pickled_by_an_earlier_version_saves_loads_and_reinitializes():
    """tests/data/o2_bf16_model_c472f34.pt: torch.save of an O2 (bf16) model by ampkit at
    commit c472f34, whose state-dict hooks lived in ampkit.convert and whose conversion
    remembered its parameter itself: moving the hooks made it unloadable."""
    path = Path(__file__).parent / "data" / "o2_bf16_model_c472f34.pt"
    loaded = torch.load(path, weights_only=False)
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    initialize(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), opt_level="O2",
               half_dtype=torch.bfloat16, verbosity=0)
    x = torch.arange(8.0).reshape(2, 4) / 8
    assert torch.equal(loaded(x), fresh(x)) and loaded(x).dtype is F32
    state = loaded.state_dict()
    assert {v.dtype for v in state.values()} == {F32}
    loaded.load_state_dict(state)
    loaded.float()
    assert loaded(x).dtype is F32 and loaded[0].weight.dtype is F32
    initialize(loaded, torch.optim.SGD(loaded.parameters(), lr=0.1), opt_level="O2",
               half_dtype=torch.bfloat16, verbosity=0)
    assert loaded[0].weight.dtype is torch.bfloat16 and loaded.state_dict()["0.weight"].dtype is F32


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_an_initialized_model_pickles_like_a_plain_one(level):
    model = _model()
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level,
               half_dtype=torch.bfloat16)
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    x = _batch(0)[0]
    assert torch.equal(copy(x), model(x)) and copy(x).dtype == model(x).dtype
    assert {k: v.dtype for k, v in copy.state_dict().items()} == {
        k: v.dtype for k, v in model.state_dict().items()}


def test_amp_state_round_trips_without_initialize():
    _state.set_active(None)
    assert state_dict() == {}
    load_state_dict(state_dict())  # a plain run that saves and reloads amp state
    with pytest.raises(RuntimeError, match="initialize"):
        load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


# --- found by running apex programs against the contract (2026-12-01) -------------------------

def _accumulated_master_grads(level: str, zero: str) -> list[torch.Tensor]:
    """Three identical windows of two micro-batches (the first delayed), lr 0: the grads
    each step sees, flattened."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16)
    seen = []
    for _ in range(3):
        for micro in range(2):
            with scale_loss(_loss(model, 0), optimizer, delay_unscale=micro == 0) as scaled:
                scaled.backward()
        seen.append(torch.cat([p.grad.flatten() for p in master_params(optimizer)]))
        optimizer.step()
        model.zero_grad() if zero == "model" else optimizer.zero_grad()
    return seen


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_delayed_accumulation_with_model_zero_grad_unscales_every_window(level):
    """A stale 'grads are unscaled' flag (reset only by the optimizer's zero_grad) made the
    second window add its delayed micro-batch still scaled: grads 3e4 times too large."""
    seen = _accumulated_master_grads(level, "model")
    assert torch.equal(seen[1], seen[0]) and torch.equal(seen[2], seen[0])
    assert all(torch.equal(a, b) for a, b in zip(seen, _accumulated_master_grads(level, "opt")))


@pytest.mark.parametrize("overflowing", [(0, 1), (0,)], ids=["both", "delayed-only"])
def test_fused_o2_accumulation_skips_an_overflow_in_any_micro_batch(overflowing):
    """Two overflow flags were summed to 2.0, and fused kernels skip only on 1.0: the step
    ran and wrote inf/NaN into the params and Adam's state."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in master_params(optimizer)]
    optimizer.zero_grad()
    for micro in range(2):
        loss = _loss(model, micro) * (float("inf") if micro in overflowing else 1.0)
        with scale_loss(loss, optimizer, delay_unscale=micro == 0) as scaled:
            scaled.backward()
    optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(a, m) for a, m in zip(masters, master_params(optimizer)))
    assert all(not s or s["step"].item() == 0 for s in optimizer.state.values())


def _every_exit_unscales(level: str, zero: str, fused: bool):
    """Four windows of two micro-batches whose exits do not delay (timm's ApexScaler, the
    Hugging Face apex scripts); window 2's first micro-batch overflows. The scale after
    each exit, the params after each step."""
    model = _model()
    optimizer = (torch.optim.Adam(model.parameters(), lr=1e-2, fused=True) if fused else
                 torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    initialize(model, optimizer, opt_level=level, half_dtype=torch.float16)
    scales, params = [], []
    for window in range(4):
        for micro in range(2):
            loss = _loss(model, micro) * (float("inf") if (window, micro) == (2, 0) else 1.0)
            with scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            scales.append(_scale())
        optimizer.step()
        model.zero_grad() if zero == "model" else optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return scales, params


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_an_overflow_is_counted_once_when_model_zero_grad_clears_the_grads(level, fused):
    """After a step and model.zero_grad() (the optimizer's leaves a flag set), every later
    exit before the next step checked the grads an earlier exit had checked: one overflow
    backed the scale off once per micro-batch (65536 -> 16384 here, -> 256 over eight)."""
    scales, params = _every_exit_unscales(level, "model", fused)
    assert scales == [65536.0] * 4 + [32768.0] * 4
    assert all(torch.equal(a, b) for a, b in zip(params[1], params[2]))  # window 2 skipped
    assert not all(torch.equal(a, b) for a, b in zip(params[2], params[3]))
    scales_opt, params_opt = _every_exit_unscales(level, "opt", fused)
    assert scales_opt == scales
    assert all(torch.equal(a, b) for window, other in zip(params, params_opt)
               for a, b in zip(window, other))


@pytest.mark.parametrize("first", ["delay_overflow_check", "plain"])
def test_grads_a_fused_step_skipped_are_checked_by_an_exit_whose_flag_counts(first):
    """An overflowing fused step keeps its inf grads (no zero_grad after it); an exit with
    delay_overflow_check re-checked them into a flag nothing reads, then marked them
    checked: the next exit did not flag them and the step wrote NaN (review finding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    x = torch.randn(8, 4)
    with scale_loss(model(x).float().mean() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped on the device; the inf grads stay
    before = [p.detach().clone() for p in model.parameters()]
    with scale_loss(model(x).float().mean(), opt,
                    delay_overflow_check=first == "delay_overflow_check") as scaled:
        scaled.backward()
    with scale_loss(model(x).float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_gan_losses_overflow_backs_off_its_own_scaler_only():
    """apex's DCGAN example (num_losses=3, netD.zero_grad()): the overflow of loss 0 was
    counted again by loss 1's exit into the same optimizer, halving scaler 1 too."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4)
    initialize([disc, gen], [opt_d, opt_g], opt_level="O1", num_losses=3,
               half_dtype=torch.float16)
    for step in range(3):
        disc.zero_grad()
        # (the losses are quartered: a bias grad of 1/8 x 8 x 65536 overflows fp16 itself)
        real = disc(torch.randn(8, 8)).float().mean() * (float("inf") if step == 1 else 0.25)
        with scale_loss(real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        fake = gen(torch.randn(8, 4))
        with scale_loss(disc(fake.detach()).float().mean() / 4, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()
        gen.zero_grad()
        with scale_loss(-disc(fake).float().mean() / 4, opt_g, loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()
    assert state_dict() == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 1},
                            "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 3},
                            "loss_scaler2": {"loss_scale": 65536.0, "unskipped": 3}}


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o3_recasts_the_state_an_optimizer_already_has(dtype):
    """A resumed fp32 Adam state stayed fp32 beside half params; apex reloaded the state
    dict to recast it, and step() raised a dtype mismatch here."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    initialize(model, optimizer, opt_level="O3", half_dtype=dtype)
    state = optimizer.state[model.weight]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, state["step"].dtype) == (
        dtype, dtype, torch.float32)
    optimizer.zero_grad()
    with scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert state["step"].item() == 2 and model.weight.dtype == dtype


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_a_loaded_loss_scale_is_applied_where_initialize_fixed_it_at_one(level):
    """The loaded scale was reported but scale_loss kept multiplying by 1.0: a run that
    had set _loss_scale (apex's pattern) resumed differently, its state saying otherwise."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level=level, half_dtype=torch.float16)
    load_state_dict({"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 0}})
    loss = _loss(model, 0)
    with scale_loss(loss, optimizer) as scaled:
        assert torch.equal(scaled, loss.float() * 4096.0)
        scaled.backward()
    assert state_dict()["loss_scaler0"]["loss_scale"] == 4096.0


def test_a_written_loss_scale_is_used_as_written_outside_the_bounds():
    """Writes were clamped into [min, max] (and the fp16 floor of 1): apex's _loss_scale
    is a plain attribute, the value written is the one scale_loss uses."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16)
    for value in (2.0**30, 0.25):
        _amp_state.loss_scalers[0]._loss_scale = value
        loss = _loss(model, 0)
        with scale_loss(loss, optimizer) as scaled:
            assert _amp_state.loss_scalers[0]._loss_scale == value
            assert torch.equal(scaled, loss.float() * value)
            scaled.backward()
        optimizer.zero_grad()


# --- grads held in place (a run of several processes: DDP's no_sync) -------------------------
@pytest.fixture
def several_processes(monkeypatch):
    """scale_loss as in one of several processes, without spawning them."""
    import importlib
    module = importlib.import_module("ampkit.frontend.scale_loss")  # the module, not the function
    monkeypatch.setattr(module, "_several_processes", lambda: True)


def _two_micro_batches(level: str, delay_first: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16)
    optimizer.zero_grad()
    for micro in range(2):
        with scale_loss(_loss(model, micro), optimizer, delay_unscale=delay_first and micro == 0) as s:
            s.backward()
    return model, optimizer


@pytest.mark.parametrize("delay_first", [False, True])
def test_grads_held_in_place_accumulate_like_grads_set_aside(several_processes, delay_first,
                                                             monkeypatch):
    model, optimizer = _two_micro_batches("O1", delay_first)
    in_place = [p.grad.clone() for p in master_params(optimizer)]
    monkeypatch.undo()  # one process: the grads are set aside
    _state.set_active(None)
    model, optimizer = _two_micro_batches("O1", delay_first)
    assert all(torch.equal(a, p.grad) for a, p in zip(in_place, master_params(optimizer)))


def test_o2_exits_leave_the_half_grads_on_the_model_for_ddp(several_processes):
    """DDP's no_sync() accumulation is in the half grads; each exit copies it, unscaled,
    into the masters (replacing the last copy), and the step does not move it again."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16)
    optimizer.zero_grad()
    with scale_loss(_loss(model, 0), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.bfloat16
    assert all(m.grad is None for m in master_params(optimizer) if m.dim() == 2)
    for micro in (1, 2):
        with scale_loss(_loss(model, micro), optimizer) as scaled:
            scaled.backward()
        half = model[0].weight.grad  # the whole accumulation, still scaled
        assert half is not None and half.dtype == torch.bfloat16
        master = master_params(optimizer)
        weight = next(m for m in master if m.shape == model[0].weight.shape)
        assert weight.grad.dtype == torch.float32
        assert torch.equal(weight.grad, half.float() / 2.0**16)
    before = [m.detach().clone() for m in master_params(optimizer)]
    grads = [m.grad.clone() for m in master_params(optimizer)]
    optimizer.step()
    assert all(torch.equal(m, b - g) for m, b, g in zip(master_params(optimizer), before, grads))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_several_processes_update_the_scale_once_per_window_when_the_step_begins(
        several_processes, level):
    """A window's exits: no update until the step; then its clean exits, then one update
    with its flag. Rank 1 overflowing in the micro-batch inside no_sync() and rank 0 at the
    synchronizing one (where the inf arrives) back off alike, once."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level=level, half_dtype=torch.float16,
               min_loss_scale=None)
    scaler = _amp_state.loss_scalers[0]
    for overflow_at in ([], [0], [1], [0, 1]):  # micro-batches that find an inf
        optimizer.zero_grad()
        scale, clean = scaler.loss_scale(), scaler._unskipped
        for micro in range(3):
            loss = _loss(model, micro)
            if micro in overflow_at:
                loss = loss * float("inf")
            with scale_loss(loss, optimizer) as scaled:
                assert torch.equal(scaled, loss.float() * scale)  # one scale per window
                scaled.backward()
            assert (scaler.loss_scale(), scaler._unskipped) == (scale, clean)
        weights = [p.detach().clone() for p in master_params(optimizer)]
        optimizer.step()
        if overflow_at:
            assert (scaler.loss_scale(), scaler._unskipped) == (scale / 2, 0)
            assert all(torch.equal(p, w) for p, w in zip(master_params(optimizer), weights))
        else:
            assert (scaler.loss_scale(), scaler._unskipped) == (scale, clean + 3)
            assert not all(torch.equal(p, w) for p, w in zip(master_params(optimizer), weights))


def test_several_processes_a_window_waits_for_its_own_optimizers_step(several_processes):
    """Another optimizer's scale_loss on the same loss closed the window at its enter,
    mid-accumulation, with this rank's unreduced flag (the ranks could part again); and
    so did a zero_grad without a step, in one case of two."""
    model, other = _model(), _model(seed=1)
    opt, opt2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, other))
    [model, other], [opt, opt2] = initialize([model, other], [opt, opt2], opt_level="O1",
                                             half_dtype=torch.float16)
    scaler = _amp_state.loss_scalers[0]
    with scale_loss(_loss(model, 0) * float("inf"), opt) as scaled:
        scaled.backward()
    with scale_loss(_loss(other, 0), opt2) as scaled:  # holds no grads: it closed opt's window
        assert scaler.loss_scale() == 2.0**16
        scaled.backward()
    opt.zero_grad()  # without a step: the window goes on
    with scale_loss(_loss(model, 1), opt) as scaled:
        assert scaler.loss_scale() == 2.0**16
        scaled.backward()
    opt.step()  # the window's three exits, one of them overflowing: one backoff
    assert scaler.loss_scale() == 2.0**15 and scaler._unskipped == 0


def test_several_processes_o2_step_moves_grads_a_plain_backward_made_after_a_step(
        several_processes):
    """The keeping move's "already copied" flag outlived the step: after model.zero_grad()
    and a plain backward (a fixed scale of 1), the next step trained on nothing."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, loss_scale=1.0)
    with scale_loss(_loss(model, 0), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    model.zero_grad()
    _loss(model, 1).backward()
    before = [m.detach().clone() for m in master_params(optimizer)]
    optimizer.step()
    assert not any(torch.equal(m, b) for m, b in zip(master_params(optimizer), before))


def test_several_processes_o2_body_raising_after_backward_drops_the_masters_copies(
        several_processes):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O2", half_dtype=torch.float16)
    with scale_loss(_loss(model, 0), optimizer) as scaled:
        scaled.backward()
    assert all(m.grad is not None for m in master_params(optimizer))
    with pytest.raises(ValueError, match="after"):
        with scale_loss(_loss(model, 1), optimizer) as scaled:
            scaled.backward()
            raise ValueError("after backward")
    assert all(m.grad is None for m in master_params(optimizer))  # no partial copy stepped
    assert all(p.grad is None for p in model.parameters())


def test_several_processes_an_optimizer_never_stepped_keeps_no_closed_windows(
        several_processes):
    model, other = _model(), _model(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen = torch.optim.SGD(other.parameters(), lr=0.1)
    [model, other], [optimizer, frozen] = initialize([model, other], [optimizer, frozen],
                                                     opt_level="O1")
    for step in range(5):
        optimizer.zero_grad()
        with scale_loss(_loss(model, step) + _loss(other, step), [optimizer, frozen]) as scaled:
            scaled.backward()
        optimizer.step()  # closes the window; frozen never steps
    assert len(frozen._amp_stash.before_step) == 1


def _two_losses_one_optimizer(level: str, scale1: float) -> list[torch.Tensor]:
    """Loss 0 then loss 1 (at another scale) accumulate into one optimizer's grads."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level=level, num_losses=2, half_dtype=torch.float16)
    for step in range(2):  # the first step makes both scales; the second accumulates at two
        if step:
            _amp_state.loss_scalers[1]._loss_scale = scale1
        optimizer.zero_grad()
        for loss_id in (0, 1):
            with scale_loss(_loss(model, loss_id), optimizer, loss_id=loss_id) as scaled:
                scaled.backward()
        if not step:
            optimizer.step()
    return [p.grad.clone() for p in master_params(optimizer)]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_several_processes_two_losses_at_two_scales_feed_one_optimizer(monkeypatch, level):
    """O1 raised TypeError (the second loss's scale did not exist yet when the held grads
    were scaled up); O2 unscaled loss 0's half grads, left on the model, by loss 1's
    scale (here 64x too large)."""
    one = _two_losses_one_optimizer(level, 2.0**10)
    _state.set_active(None)
    import importlib
    module = importlib.import_module("ampkit.frontend.scale_loss")
    monkeypatch.setattr(module, "_several_processes", lambda: True)
    several = _two_losses_one_optimizer(level, 2.0**10)
    # fp16 sums on the model against fp32 sums in the masters (the first bias, before a
    # batch norm, has a gradient of rounding noise alone: compared as part of the whole)
    a, b = (torch.cat([g.reshape(-1) for g in grads]) for grads in (one, several))
    assert (b - a).norm() <= 2e-3 * a.norm()


def _sgd_first_step_overflows(level: str, **sgd) -> torch.optim.Optimizer:
    """Three scale_loss steps with SGD(momentum=0.9, **sgd), the first overflowing."""
    _state.set_active(None)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **sgd)
    model, optimizer = initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16)
    for step in range(3):
        optimizer.zero_grad()
        loss = _loss(model, step) * (float("inf") if step == 0 else 1.0)
        with scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_sgd_after_a_skipped_first_step_under_scale_loss(level):
    """The fused step after scale_loss's overflow left torch's uninitialised momentum;
    the skip now leaves zeros, from which plain SGD steps the same (dampening 0)."""
    fused = _sgd_first_step_overflows(level, fused=True)
    buffers = [fused.state[p]["momentum_buffer"] for p in master_params(fused)]
    assert all(torch.isfinite(b).all() for b in buffers)
    fused_params = [p.detach().clone() for p in master_params(fused)]
    plain = _sgd_first_step_overflows(level, foreach=False)
    for a, b in zip(fused_params, master_params(plain)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_several_processes_fp16_grads_held_in_place_are_not_scaled_past_their_own_scale(
        several_processes):
    """O3 fp16, two losses into one optimizer: loss 1's enter scaled loss 0's unscaled fp16
    grads (made at scale 1) up by its own 2**16 and overflowed them, a skip one process
    does not take. Loss 1's body now runs at most at the held grads' scale."""
    model = _model().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O3", half_dtype=torch.float16, num_losses=2,
               loss_scale="dynamic", verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 1.0
    optimizer.zero_grad()
    for loss_id in (0, 1):
        with scale_loss(_loss(model, loss_id) * 8, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()
    assert not optimizer._amp_stash.skip_next
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [1.0, 2.0**16]


def test_a_body_raising_before_its_backward_leaves_grads_held_in_place_as_they_were(
        several_processes):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1")
    optimizer.zero_grad()
    with scale_loss(_loss(model, 0), optimizer) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="before"):
        with scale_loss(_loss(model, 1), optimizer):  # scales the held grads up in place
            raise ValueError("before backward")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_body_raising_after_its_backward_drops_the_grads_held_in_place(several_processes):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1")
    optimizer.zero_grad()
    with scale_loss(_loss(model, 0), optimizer) as scaled:
        scaled.backward()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="after"):
        with scale_loss(_loss(model, 1), optimizer) as scaled:
            scaled.backward()  # adds scaled grads to the held ones: no longer separable
            raise ValueError("after backward")
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()  # nothing scaled or partial is stepped
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_a_model_cast_to_half_before_an_fp32_level_is_warned_about(level):
    """It trained in pure fp16 without masters, silently; apex warned ("you do not need to
    call .half() on your model before passing it")."""
    model = _model().half()
    with pytest.warns(UserWarning, match=r"parameter '0.weight' is torch.float16, but opt_level "
                                         rf"{level} trains fp32 parameters"):
        initialize(model, opt_level=level)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        initialize(_model().half(), opt_level="O2", half_dtype=torch.float16)  # masters: fine
        initialize(_model(), opt_level=level)


def test_a_model_an_earlier_initialize_cast_is_not_warned_about():
    """initialize warned that O3's half params "stay float16" under O1, then cast them back
    to fp32; and initialize(enabled=False), which applies no level, warned as well."""
    model = _model()
    initialize(model, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        initialize(model, opt_level="O1", verbosity=0)
        assert model[0].weight.dtype == torch.float32  # what the warning denied
        initialize(model, opt_level="O2", half_dtype=torch.float16, verbosity=0)
        initialize(model, enabled=False, verbosity=0)
    assert model[0].weight.dtype == torch.float16  # enabled=False: untouched, as apex


# --- O3 fp16 and an optimizer's eps ----------------------------------------------------------

def _o3_adamw(eps: float, **kwargs):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = initialize(model, opt, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    return model, opt, [str(w.message) for w in caught if "rounds to 0 in fp16" in str(w.message)]


def _o3_step(model, opt) -> torch.Tensor:
    x, y = _batch(0)
    loss = F.mse_loss(model(x.half()).float(), y)
    opt.zero_grad()
    with scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def test_o3_fp16_warns_when_adams_eps_rounds_to_zero_and_says_why():
    """torch's default eps=1e-8 is below fp16's smallest subnormal: the foreach step
    divides by zero where a small gradient's square underflowed, and the first step writes
    NaN into the weights (no loss scale can catch it): initialize says so, once."""
    model, opt, said = _o3_adamw(1e-8)
    assert len(said) == 1 and "AdamW" in said[0] and "eps=1e-08" in said[0] and "eps=1e-4" in said[0]
    assert not _o3_step(model, opt).isfinite().all()  # what the warning foretells
    for eps, kwargs in [(1e-4, {}), (1e-8, {"fused": True})]:  # fused: fp32 inside the step
        model, opt, said = _o3_adamw(eps, **kwargs)
        assert said == [] and _o3_step(model, opt).isfinite().all()


def test_a_group_added_later_with_an_eps_fp16_rounds_to_zero_is_warned_about_too():
    """The check ran at initialize only: a group added later with eps=1e-8 wrote NaN into
    its weights at the first step, unwarned."""
    model, opt, said = _o3_adamw(1e-4)
    extra = nn.Linear(4, 4).half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.add_param_group({"params": list(extra.parameters())})  # the defaults: eps 1e-4
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3, dtype=torch.float16))],
                             "eps": 1e-8})
    said += [str(w.message) for w in caught if "rounds to 0 in fp16" in str(w.message)]
    assert len(said) == 1 and "eps=1e-08" in said[0]
    assert len(opt.param_groups) == 3 and opt.param_groups[2]["eps"] == 1e-8  # added all the same


def test_o3_fp16_fused_adagrad_with_an_eps_fp16_rounds_to_zero_is_warned_about():
    """Fused groups were spared as 'computing in fp32', but torch's CPU fused Adagrad writes
    NaN for a zero gradient of 16 elements or more: unwarned NaN weights."""
    model = nn.Linear(16, 16)
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2, fused=True)  # eps=1e-10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = initialize(model, opt, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    said = [str(w.message) for w in caught if "rounds to 0 in fp16" in str(w.message)]
    assert len(said) == 1 and "Adagrad" in said[0] and "fused Adagrad does not" in said[0]


@pytest.mark.parametrize("level, half", [("O2", torch.float16), ("O3", torch.bfloat16)])
def test_masters_or_bf16_give_no_eps_warning(level, half):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), eps=1e-8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    assert not [w for w in caught if "rounds to 0 in fp16" in str(w.message)]


def test_scale_loss_with_an_optimizer_of_a_replaced_initialize_warns():
    """Two runs in one process each called initialize: the first run's scale_loss silently
    used the second's loss scalers (apex's one amp state), so the runs shared a scale."""
    import warnings as _warnings
    first = _model()
    opt_a = torch.optim.SGD(first.parameters(), lr=0.1)
    first, opt_a = initialize(first, opt_a, opt_level="O1", half_dtype=torch.float16,
                              verbosity=0)
    second = _model()
    opt_b = torch.optim.SGD(second.parameters(), lr=0.1)
    second, opt_b = initialize(second, opt_b, opt_level="O1", half_dtype=torch.float16,
                               verbosity=0)
    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        with scale_loss(second(torch.randn(2, 8)).float().sum(), opt_b) as scaled:
            scaled.backward()
        assert not record  # the active initialize's own optimizer
        with scale_loss(first(torch.randn(2, 8)).float().sum(), opt_a) as scaled:
            scaled.backward()
    assert [str(w.message) for w in record] == [
        "ampkit.scale_loss: optimizers[0] (SGD) was prepared by an earlier ampkit.initialize, "
        "and a later initialize of other models (or TuneResult.apply) replaced its amp state: "
        "this scale_loss uses the later one's loss scalers and settings (one amp state per "
        "process, as in apex), so the two runs share a loss scale; valid: one initialize for "
        "every model and optimizer (lists of each, num_losses=N for N losses)"]
    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        with scale_loss(first(torch.randn(2, 8)).float().sum(), opt_a) as scaled:
            scaled.backward()
    assert not record  # once per replaced initialize
    initialize(_model(seed=1), opt_level="O1", enabled=False)  # no scaling at all now
    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        with scale_loss(second(torch.randn(2, 8)).float().sum(), opt_b) as scaled:
            scaled.backward()
    assert len(record) == 1 and "was prepared by an earlier" in str(record[0].message)


def test_each_replaced_initialize_is_warned_about_with_no_key_left_behind():
    """The warning was keyed by id() of the replaced state in the process-wide set: a key
    per replaced initialize stayed, and a new state given a freed one's id was never
    warned about (103 of 500 sweeps silent; leak-and-scaling probe)."""
    import warnings as _warnings
    from ampkit import _warn
    keys = len(_warn._given)
    warned = 0
    for _ in range(12):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
        initialize(_model(seed=1), opt_level="O1", half_dtype=torch.float16, verbosity=0)
        with _warnings.catch_warnings(record=True) as record:
            _warnings.simplefilter("always")
            with scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as scaled:
                scaled.backward()
        warned += sum("was prepared by an earlier" in str(w.message) for w in record)
    assert warned == 12 and len(_warn._given) == keys


def _accumulate_then_step(level: str, close: bool, overflow: bool, fused: bool):
    _state.set_active(None)
    model = _model()
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.1, fused=True) if fused
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, optimizer = initialize(model, optimizer, opt_level=level, half_dtype=torch.float16)
    optimizer.zero_grad()
    for micro in range(2):
        loss = _loss(model, micro) * (float("inf") if overflow and micro == 0 else 1.0)
        with scale_loss(loss, optimizer, delay_unscale=not (close and micro == 1)) as scaled:
            scaled.backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()], _scale()


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "overflow"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_after_delayed_exits_only_unscales_and_checks_them_first(level, overflow, fused):
    """An epoch whose last micro-batch delays: step() stepped the still-scaled gradients
    (65536 times too large under O1) and an overflow the delayed exits had found reached
    the weights. Now it does what an exit that does not delay would have done first."""
    start = [p.detach().clone() for p in _model().parameters()]
    closed, closed_scale = _accumulate_then_step(level, True, overflow, fused)
    with pytest.warns(RuntimeWarning, match=r"step\(\) came after scale_loss\(\.\.\., "
                                            r"delay_unscale=True\) with no scale_loss since"):
        stepped, stepped_scale = _accumulate_then_step(level, False, overflow, fused)
    assert all(torch.equal(a, b) for a, b in zip(closed, stepped)) and stepped_scale == closed_scale
    assert all(torch.isfinite(p).all() for p in stepped)
    moved = not all(torch.equal(a.to(b.dtype), b) for a, b in zip(start, stepped))
    assert moved is not overflow and stepped_scale == (2.0**15 if overflow else 2.0**16)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "overflow"])
def test_a_step_after_delayed_exits_only_in_a_run_of_several_processes(several_processes,
                                                                       level, overflow):
    """The same where the grads stay on the model (DDP): the exit step() runs joins the
    loss scaler's window, which closes in the same step."""
    closed, closed_scale = _accumulate_then_step(level, True, overflow, False)
    with pytest.warns(RuntimeWarning, match=r"delay_unscale=True\) with no scale_loss since"):
        stepped, stepped_scale = _accumulate_then_step(level, False, overflow, False)
    assert all(torch.equal(a, b) for a, b in zip(closed, stepped)) and stepped_scale == closed_scale
    assert stepped_scale == (2.0**15 if overflow else 2.0**16)


def _two_optimizers_delayed(close: bool, overflow: bool):
    _state.set_active(None)
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    o1 = torch.optim.SGD(a.parameters(), lr=0.1)
    o2 = torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [o1, o2] = initialize([a, b], [o1, o2], opt_level="O1", half_dtype=torch.float16)
    x = torch.randn(2, 4)
    loss = (a(x).float().sum() + b(x).float().sum()) * (float("inf") if overflow else 1e-3)
    with scale_loss(loss, [o1, o2], delay_unscale=True) as scaled:
        scaled.backward()
    if close:
        with scale_loss(torch.zeros(()), [o1, o2]):
            pass
    o1.step()
    o2.step()
    return (_state.get_active().scalers[0].stats(), [p.detach().clone() for p in a.parameters()],
            [p.detach().clone() for p in b.parameters()])


@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "overflow"])
def test_one_delayed_exit_over_two_optimizers_is_closed_once(overflow):
    """(review) Each optimizer's step ran its own closing exit: the scaler counted two
    updates, and backed off twice for one overflow."""
    expected = _two_optimizers_delayed(True, overflow)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _two_optimizers_delayed(False, overflow)
    assert got[0] == expected[0] and got[0].steps == 1
    assert all(torch.equal(x, y) for x, y in zip(got[1] + got[2], expected[1] + expected[2]))


def _delayed_then_step(replace: bool, overflow: bool) -> list[torch.Tensor]:
    _state.set_active(None)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initialize(model, optimizer, opt_level="O1", half_dtype=torch.float16, num_losses=2)
    loss = _loss(model, 0) * (float("inf") if overflow else 1.0)
    with scale_loss(loss, optimizer, loss_id=1, delay_unscale=True) as scaled:
        scaled.backward()
    if replace:
        other = _model(seed=1)
        initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level="O1",
                   half_dtype=torch.bfloat16)
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "overflow"])
def test_a_delayed_exit_of_a_replaced_initialize_is_closed_by_its_own(overflow):
    """(review) The closer indexed the new initialize's loss scalers (IndexError), and then,
    skipped for a replaced initialize, stepped the still-scaled grads (65536x; inf after an
    overflow). It closes with the initialize that delayed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _delayed_then_step(False, overflow)
        got = _delayed_then_step(True, overflow)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.isfinite(p).all() for p in got)


def test_swapped_arguments_are_named_on_one_short_line():
    """initialize(optimizer, model) printed the optimizer's whole multi-line repr (new-user
    probe)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as caught:
        initialize(optimizer, model)
    message = str(caught.value)
    assert message.startswith("models must be a torch.nn.Module or a list of them, got SGD SGD (")
    assert "\n" not in message and len(message) < 160


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O2", torch.float16),
                                          ("O2", torch.bfloat16)])
def test_a_plain_backward_before_scale_loss_joins_unscaled(level, dtype):
    """An auxiliary loss's plain backward() before the scale_loss block of the same step
    was taken for a body's scaled gradients and divided by the loss scale (65536): lost,
    silently (new-behaviour probe). apex added such grads back unscaled. Under fp16 the
    unscaled-gradient warning says so."""
    x = torch.randn(16, 4)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def last_bias_grad(plain: bool, scaled: bool) -> tuple[float, list[str]]:
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, optimizer = initialize(model, optimizer, opt_level=level, half_dtype=dtype,
                                      verbosity=0)
        before = list(master_params(optimizer))[3].detach().clone()
        optimizer.zero_grad()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            if plain:
                model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
            if scaled:
                with scale_loss(0.25 * model(x.to(next(model.parameters()).dtype)).float()
                                .mean(), optimizer) as loss:
                    loss.backward()
            optimizer.step()
        return (before - list(master_params(optimizer))[3]).item(), [
            str(w.message) for w in record]

    both, messages = last_bias_grad(True, True)
    aux, _ = last_bias_grad(True, False)
    main, _ = last_bias_grad(False, True)
    assert aux != 0 and both == pytest.approx(aux + main, rel=1e-2, abs=2e-3)
    unscaled = [m for m in messages if "no loss scaling scaled" in m]
    assert len(unscaled) == (1 if dtype is torch.float16 else 0), messages


def test_a_gan_generators_gradients_left_on_the_discriminator_stay_scaled():
    """The other held gradients a body can meet: another body's (the generator's loss
    flowing through the discriminator, not zeroed), still scaled by its loss scale."""
    torch.manual_seed(0)
    netG, netD = nn.Linear(4, 4), nn.Linear(4, 1)
    optG = torch.optim.SGD(netG.parameters(), lr=0.1)
    optD = torch.optim.SGD(netD.parameters(), lr=0.1)
    (netG, netD), (optG, optD) = initialize([netG, netD], [optG, optD], opt_level="O1",
                                            half_dtype=torch.float16, verbosity=0)
    x = torch.randn(8, 4)
    optD.zero_grad()
    optG.zero_grad()
    with scale_loss(netD(netG(x)).float().mean(), optG) as loss:
        loss.backward()  # leaves netD.weight.grad scaled by 65536
    leaked = netD.weight.grad.clone()
    with scale_loss(netD(x).float().mean(), optD) as loss:
        loss.backward()
    own = torch.autograd.grad(netD(x).float().mean(), netD.weight)[0]
    assert torch.allclose(netD.weight.grad, leaked / 65536 + own, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_zeros_held_at_a_blocks_start_are_not_a_plain_backward(level):
    """zero_grad(set_to_none=False), or a skip, leaves zeros: held at the next block's
    start with no body since, they were taken for a plain backward's gradients and warned
    about under fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = initialize(model, optimizer, opt_level=level, half_dtype=torch.float16,
                                  verbosity=0)
    dtype = next(model.parameters()).dtype
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(4):
            optimizer.zero_grad(set_to_none=False)
            loss = model(torch.randn(8, 4).to(dtype)).float().mean()
            with scale_loss(loss * (float("inf") if i == 1 else 1.0), optimizer) as scaled:
                scaled.backward()
            optimizer.step()


def _grads_against_fp32(level, dtype, steps):
    """Run ``steps(model, optimizer, x)`` on an initialized copy of a Linear(4, 4); its
    (master) weight gradient, the fp32 copy made before, and ``x``."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 4)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = initialize(model, optimizer, opt_level=level, half_dtype=dtype,
                                  verbosity=0)
    optimizer.zero_grad()
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unscaled-fp16 warning, tested elsewhere
        steps(model, optimizer, x)
    return next(iter(master_params(optimizer))).grad.clone(), reference, x


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O2", torch.float16),
                                          ("O2", torch.bfloat16)])
def test_a_plain_backward_between_two_blocks_joins_unscaled(level, dtype):
    """Under O2 the half grads of a plain backward between two blocks were added to the
    second block's before its unscale: divided by the loss scale (0.083 of the fp32
    gradient; review)."""
    def steps(model, optimizer, x):
        cast = x.to(next(model.parameters()).dtype)
        with scale_loss(model(cast).float().pow(2).mean(), optimizer) as loss:
            loss.backward()
        model(cast).float().sum().backward()  # plain auxiliary loss
        with scale_loss(model(cast).float().abs().mean(), optimizer) as loss:
            loss.backward()
    grad, reference, x = _grads_against_fp32(level, dtype, steps)
    (reference(x).pow(2).mean() + reference(x).sum() + reference(x).abs().mean()).backward()
    assert (grad.norm() / reference.weight.grad.norm()).item() == pytest.approx(1, abs=0.01)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_plain_backward_survives_a_block_that_raised(level):
    """A block that raised after a plain backward put the plain grads back, but the
    retried block took them for another block's scaled ones (0.03 of the fp32 gradient
    under O1; review)."""
    def steps(model, optimizer, x):
        cast = x.to(next(model.parameters()).dtype)
        model(cast).float().sum().backward()  # plain auxiliary loss
        with pytest.raises(RuntimeError, match="bad batch"):
            with scale_loss(model(cast).float().pow(2).mean(), optimizer):
                raise RuntimeError("bad batch")
        with scale_loss(model(cast).float().abs().mean(), optimizer) as loss:
            loss.backward()
    grad, reference, x = _grads_against_fp32(level, torch.float16, steps)
    (reference(x).sum() + reference(x).abs().mean()).backward()
    assert (grad.norm() / reference.weight.grad.norm()).item() == pytest.approx(1, abs=0.01)
