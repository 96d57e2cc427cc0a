"""Black-box check of DESIGN.md's "Public contract", through the public names only.

Only `import ampkit` and `from ampkit.fp8 import ...` are used here: these are the
promises that code outside this repo relies on. A promise the library does not keep yet
is an `xfail(strict=True)` test whose reason says what is wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import types

import pytest
import torch
from torch import nn

import ampkit
import ampkit as amp
from ampkit.fp8 import Float8Linear, convert_to_fp8

pytestmark = pytest.mark.filterwarnings("ignore:ampkit.fp8. no fp8 tensor cores")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALVES = [F16, BF16]
INF = float("inf")
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
_EMPTY = inspect.Parameter.empty
_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KW = inspect.Parameter.KEYWORD_ONLY


def _net(seed: int = 0, bn: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU(),
                                                                           nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def _x(seed: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).to(device)


def _sgd(model: nn.Module, momentum: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model: nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == snap.keys() and all(
        now[k].dtype == snap[k].dtype and torch.equal(now[k], snap[k]) for k in snap)


def _loss_scale(loss_id: int = 0) -> float:
    return amp.state_dict()[f"loss_scaler{loss_id}"]["loss_scale"]


def _params(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


# --- public names and signatures -------------------------------------------------------------
PUBLIC = ["autocast", "GradScaler", "ScalerStats", "initialize", "scale_loss", "master_params",
          "state_dict", "load_state_dict", "register_half_function", "register_float_function",
          "register_promote_function", "half_function", "float_function", "promote_function",
          "disable_casts", "Policy", "get_policy", "fp8"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_is_exported(name):
    assert hasattr(ampkit, name) and name in ampkit.__all__


SIGNATURES = {
    "autocast": [("device_type", _POS, None), ("dtype", _POS, None), ("enabled", _POS, True),
                 ("cache_enabled", _POS, None)],
    "GradScaler": [("device", _POS, None), ("init_scale", _POS, 2.0**16),
                   ("growth_factor", _POS, 2.0), ("backoff_factor", _POS, 0.5),
                   ("growth_interval", _POS, 2000), ("enabled", _POS, True),
                   ("min_scale", _KW, None), ("max_scale", _KW, None), ("hysteresis", _KW, 1),
                   ("process_group", _KW, None)],
    "initialize": [("models", _POS, _EMPTY), ("optimizers", _POS, None), ("enabled", _POS, True),
                   ("opt_level", _POS, "O1"), ("cast_model_type", _POS, None),
                   ("patch_torch_functions", _POS, None), ("keep_batchnorm_fp32", _POS, None),
                   ("master_weights", _POS, None), ("loss_scale", _POS, None),
                   ("cast_model_outputs", _POS, None), ("num_losses", _POS, 1),
                   ("verbosity", _POS, 1), ("min_loss_scale", _POS, None),
                   ("max_loss_scale", _POS, 2.0**24), ("half_dtype", _KW, None),
                   ("keep_fp32", _KW, None)],
    "scale_loss": [("loss", _POS, _EMPTY), ("optimizers", _POS, _EMPTY), ("loss_id", _POS, 0),
                   ("model", _POS, None), ("delay_unscale", _POS, False),
                   ("delay_overflow_check", _POS, False)],
    "master_params": [("optimizer", _POS, _EMPTY)],
    "register_half_function": [("module", _POS, _EMPTY), ("name", _POS, _EMPTY)],
    "register_float_function": [("module", _POS, _EMPTY), ("name", _POS, _EMPTY)],
    "register_promote_function": [("module", _POS, _EMPTY), ("name", _POS, _EMPTY)],
    "disable_casts": [],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_names_kinds_and_defaults(name):
    assert _params(inspect.signature(getattr(ampkit, name))) == SIGNATURES[name]


def test_convert_to_fp8_signature_is_keyword_only_after_model():
    sig = inspect.signature(convert_to_fp8)
    assert [(p.name, p.kind) for p in sig.parameters.values()] == [
        ("model", _POS), ("recipe", _KW), ("module_filter", _KW)]
    assert sig.parameters["recipe"].default == "tensorwise"
    assert sig.parameters["module_filter"].default is None
    with pytest.raises(TypeError):
        convert_to_fp8(nn.Linear(16, 16), "tensorwise")  # recipe is keyword-only


def test_state_dict_takes_no_required_argument_and_load_state_dict_takes_one():
    assert all(p.default is not _EMPTY for p in inspect.signature(amp.state_dict)
               .parameters.values())
    required = [p for p in inspect.signature(amp.load_state_dict).parameters.values()
                if p.default is _EMPTY]
    assert len(required) == 1 and required[0].kind == _POS


def test_policy_is_a_frozen_dataclass_with_the_three_dtypes():
    assert dataclasses.is_dataclass(ampkit.Policy)
    fields = {f.name for f in dataclasses.fields(ampkit.Policy)}
    assert {"param_dtype", "compute_dtype", "output_dtype"} <= fields
    p = ampkit.get_policy("O1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.param_dtype = F16


def test_float8linear_is_an_nn_linear():
    assert issubclass(Float8Linear, nn.Linear)


# --- initialize: returns what it was given ---------------------------------------------------
def test_initialize_returns_the_model_it_was_given():
    m = _net()
    assert amp.initialize(m, opt_level="O1", verbosity=0) is m


def test_initialize_returns_a_list_for_a_list():
    m = _net()
    out = amp.initialize([m], opt_level="O1", verbosity=0)
    assert isinstance(out, list) and len(out) == 1 and out[0] is m


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_initialize_returns_a_model_optimizer_pair(level):
    m = _net()
    opt = _sgd(m)
    out = amp.initialize(m, opt, opt_level=level, half_dtype=F16, verbosity=0)
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0] is m and out[1] is opt


def test_initialize_mirrors_lists_of_models_and_optimizers():
    m1, m2 = _net(0), _net(1)
    o1, o2 = _sgd(m1), _sgd(m2)
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O2", half_dtype=F16,
                                  verbosity=0)
    assert isinstance(models, list) and isinstance(opts, list)
    assert models[0] is m1 and models[1] is m2 and opts[0] is o1 and opts[1] is o2
    m3 = _net(2)
    models, opt = amp.initialize([m3], _sgd(m3), opt_level="O1", verbosity=0)
    assert isinstance(models, list) and isinstance(opt, torch.optim.Optimizer)


# --- the opt-level table on CPU ---------------------------------------------------------------
HALF = "half"  # stands for the parametrised half dtype
TABLE = [  # level, params, batchnorm, inner linear output, forward output, masters, scale
    ("O0", F32, F32, F32, F32, False, 1.0),
    ("O1", F32, F32, HALF, F32, False, "dynamic"),
    ("O2", HALF, F32, HALF, F32, True, "dynamic"),
    ("O3", HALF, HALF, HALF, HALF, False, 1.0),
]


def _resolve(d, half):
    return half if d == HALF else d


def _capture_first_linear(model: nn.Sequential) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}

    def hook(_mod, args, out):
        seen["in"], seen["out"] = args[0].dtype, out.dtype
    model[0].register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level, params, bn, inner, out, masters, scale", TABLE)
def test_opt_level_table(device, half, level, params, bn, inner, out, masters, scale):
    m = _net().to(device)
    opt = _sgd(m)
    m, opt = amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0)
    for name, p in m.named_parameters():
        want = bn if name.startswith("1.") else params
        assert p.dtype == _resolve(want, half), name
    assert m[1].running_mean.dtype == _resolve(bn, half)
    seen = _capture_first_linear(m)
    y = m(_x(device=device))  # fp32 input, as a user would pass it
    assert seen["in"] == (half if level in ("O2", "O3") else F32)
    assert seen["out"] == _resolve(inner, half)
    assert y.dtype == _resolve(out, half)
    mps = list(amp.master_params(opt))
    model_ps = list(m.parameters())
    assert len(mps) == len(model_ps)
    assert all(mp.dtype == (half if level == "O3" else F32) for mp in mps)
    if masters:
        held = [p for g in opt.param_groups for p in g["params"]]
        assert all(a is b for a, b in zip(held, mps)) and all(p.dtype == F32 for p in held)
        # half params get separate fp32 masters; fp32 (batchnorm) params may be their own
        assert all(mp is not p for mp, p in zip(mps, model_ps) if p.dtype == half)
        assert all(torch.equal(mp.to(p.dtype), p) for mp, p in zip(mps, model_ps))
    else:
        assert all(mp is p for mp, p in zip(mps, model_ps))
    assert all(p.device.type == device for p in model_ps + mps)
    if scale == "dynamic":
        _assert_dynamic_scale(m, opt, device)
    else:
        assert _loss_scale() == scale


def _assert_dynamic_scale(m, opt, device):
    before = _loss_scale()
    assert before > 1.0
    with amp.scale_loss(m(_x(device=device)).float().sum() * INF, opt) as scaled:
        scaled.backward()
    opt.step()
    assert _loss_scale() == before / 2


def test_master_params_of_a_plain_optimizer_are_its_params():
    m = _net()
    opt = _sgd(m)
    assert all(a is b for a, b in zip(amp.master_params(opt), m.parameters()))
    assert len(list(amp.master_params(opt))) == len(list(m.parameters()))


@pytest.mark.parametrize("half", HALVES)
def test_o3_master_params_are_the_half_params_themselves(half):
    m = _net()
    m, opt = amp.initialize(m, _sgd(m), opt_level="O3", half_dtype=half, verbosity=0)
    mps = list(amp.master_params(opt))
    assert all(mp is p for mp, p in zip(mps, m.parameters()))
    assert all(mp.dtype == half for mp in mps)


def test_o3_keep_batchnorm_fp32_keeps_batchnorm_fp32():
    m = _net()
    amp.initialize(m, opt_level="O3", half_dtype=F16, keep_batchnorm_fp32=True, verbosity=0)
    assert m[1].weight.dtype == F32 and m[1].running_mean.dtype == F32
    assert m[0].weight.dtype == F16


def test_half_dtype_none_is_the_device_autocast_default():
    m = _net()
    amp.initialize(m, opt_level="O2", verbosity=0)
    assert m[0].weight.dtype == torch.get_autocast_dtype("cpu")


@pytest.mark.parametrize("half", HALVES)
def test_keywords_override_the_level_defaults(half):
    m = _net()
    m, opt = amp.initialize(m, _sgd(m), opt_level="O2", half_dtype=half, loss_scale=128.0,
                            keep_batchnorm_fp32=False, master_weights=False, verbosity=0)
    assert _loss_scale() == 128.0
    assert m[1].weight.dtype == half
    assert all(mp is p for mp, p in zip(amp.master_params(opt), m.parameters()))
    m2 = _net()
    amp.initialize(m2, opt_level="O1", cast_model_type=half, verbosity=0)
    assert m2[0].weight.dtype == half


# --- O2/O3 checkpoints are fp32 ---------------------------------------------------------------
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_half_model_state_dict_is_fp32_and_loads_into_a_fresh_fp32_model(level, half):
    m = _net()
    m, opt = amp.initialize(m, _sgd(m), opt_level=level, half_dtype=half, verbosity=0)
    w = m[0].weight.detach().clone()
    with amp.scale_loss(m(_x()).float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(m[0].weight, w)  # a real step, so masters and params moved
    sd = m.state_dict()
    for k, v in sd.items():
        if v.is_floating_point():
            assert v.dtype == F32, k
    fresh = _net(seed=7)
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k
    for (k, p) in m.named_parameters():
        assert torch.equal(fresh.state_dict()[k].to(p.dtype), p.detach()), k


# --- amp.state_dict / load_state_dict ---------------------------------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_amp_state_dict_format_is_exactly_apex_s(level):
    m = _net()
    amp.initialize(m, _sgd(m), opt_level=level, half_dtype=F16, verbosity=0)
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0"]
    assert list(sd["loss_scaler0"]) == ["loss_scale", "unskipped"]
    assert type(sd["loss_scaler0"]["loss_scale"]) is float
    assert type(sd["loss_scaler0"]["unskipped"]) is int


def test_amp_state_dict_has_one_entry_per_loss_and_load_restores_it():
    m = _net()
    m, opt = amp.initialize(m, _sgd(m), opt_level="O1", num_losses=2, verbosity=0)
    assert list(amp.state_dict()) == ["loss_scaler0", "loss_scaler1"]
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 3},
                         "loss_scaler1": {"loss_scale": 32.0, "unskipped": 0}})
    sd = amp.state_dict()
    assert sd == {"loss_scaler0": {"loss_scale": 256.0, "unskipped": 3},
                  "loss_scaler1": {"loss_scale": 32.0, "unskipped": 0}}
    loss = m(_x()).sum()
    with amp.scale_loss(loss, opt, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 32.0)


# --- scale_loss ------------------------------------------------------------------------------
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scale_loss_skips_the_next_step_after_an_overflow_then_resumes(level, half):
    m = _net(bn=False)
    opt = _sgd(m, momentum=0.9)
    m, opt = amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0)
    masters = [mp.detach().clone() for mp in amp.master_params(opt)]
    params = [p.detach().clone() for p in m.parameters()]
    scale = _loss_scale()
    opt.zero_grad()
    x = _x()
    x[0, 0] = INF  # inf/NaN gradients in the first layer only
    with amp.scale_loss(m(x).float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    assert _loss_scale() == scale / 2
    assert not any(opt.state[p] for p in amp.master_params(opt))  # no momentum buffer
    opt.zero_grad()
    loss = m(_x()).float().mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled.detach(), loss.detach() * (scale / 2))
        scaled.backward()
    opt.step()
    assert _loss_scale() == scale / 2
    assert not all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scale_loss_leaves_unscaled_fp32_grads(level, half):
    grads = []
    for scale in (2.0**8, 2.0**14):  # both keep fp16 grads normal, neither overflows
        m = _net(bn=False)
        m, opt = amp.initialize(m, _sgd(m), opt_level=level, half_dtype=half, verbosity=0,
                                loss_scale=scale)
        with amp.scale_loss(m(_x()).float().mean(), opt) as scaled:
            scaled.backward()
        grads.append([mp.grad for mp in amp.master_params(opt)])
    assert all(g.dtype == F32 for g in grads[1])
    # power-of-two scales and their inverses are exact: unscaled, both give the same grads
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# --- GradScaler -------------------------------------------------------------------------------
def _scaler_step(scaler, model, opt, overflow=False):
    opt.zero_grad()
    loss = model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).float().sum()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad.fill_(INF)
    scaler.step(opt)
    scaler.update()


def _lin(dtype=F32):
    torch.manual_seed(0)
    m = nn.Linear(4, 4).to(dtype)
    return m, torch.optim.SGD(m.parameters(), lr=0.01)


def test_gradscaler_device_none_infers_the_device():
    scaler = amp.GradScaler()
    assert scaler.is_enabled()
    t = torch.ones(3)
    if not torch.cuda.is_available():
        assert torch.equal(scaler.scale(t), t * 2.0**16)


def test_gradscaler_min_scale_clamps_backoff():
    m, opt = _lin()
    scaler = amp.GradScaler("cpu", init_scale=8.0, min_scale=4.0)
    for _ in range(3):
        _scaler_step(scaler, m, opt, overflow=True)
    assert scaler.get_scale() == 4.0


def test_gradscaler_max_scale_clamps_growth():
    m, opt = _lin()
    scaler = amp.GradScaler("cpu", init_scale=8.0, growth_interval=1, max_scale=32.0)
    for _ in range(4):
        _scaler_step(scaler, m, opt)
    assert scaler.get_scale() == 32.0


def test_gradscaler_hysteresis_backs_off_on_the_nth_consecutive_overflow():
    m, opt = _lin()
    w0 = m.weight.detach().clone()
    scaler = amp.GradScaler("cpu", init_scale=64.0, hysteresis=2)
    _scaler_step(scaler, m, opt, overflow=True)
    assert scaler.get_scale() == 64.0 and torch.equal(m.weight, w0)  # skipped, kept
    _scaler_step(scaler, m, opt)  # a clean step resets the count
    w1 = m.weight.detach().clone()
    assert not torch.equal(w1, w0)
    _scaler_step(scaler, m, opt, overflow=True)
    assert scaler.get_scale() == 64.0 and torch.equal(m.weight, w1)
    _scaler_step(scaler, m, opt, overflow=True)
    assert scaler.get_scale() == 32.0 and torch.equal(m.weight, w1)


def test_gradscaler_stats_fields():
    m, opt = _lin()
    scaler = amp.GradScaler("cpu", init_scale=64.0)
    _scaler_step(scaler, m, opt)
    _scaler_step(scaler, m, opt, overflow=True)
    _scaler_step(scaler, m, opt, overflow=True)
    st = scaler.stats()
    assert isinstance(st, amp.ScalerStats)
    assert [f.name for f in dataclasses.fields(st)] == ["scale", "steps", "skipped_steps",
                                                         "consecutive_skips"]
    assert (st.scale, st.skipped_steps, st.consecutive_skips) == (16.0, 2, 2)
    assert st.steps == 3
    _scaler_step(scaler, m, opt)
    assert scaler.stats().consecutive_skips == 0 and scaler.stats().skipped_steps == 2


@pytest.mark.parametrize("half", HALVES)
def test_gradscaler_accepts_half_gradients_and_unscales_them(half):
    m, opt = _lin(half)
    ref, _ = _lin(half)
    ref(torch.ones(2, 4, dtype=half)).float().sum().backward()
    scaler = amp.GradScaler("cpu", init_scale=1024.0)
    loss = m(torch.ones(2, 4, dtype=half)).float().sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    assert m.weight.grad.dtype == half
    assert torch.equal(m.weight.grad, ref.weight.grad)  # scale 2**10: unscaling is exact
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1024.0


@pytest.mark.parametrize("half", HALVES)
def test_gradscaler_unscales_into_the_fp32_masters_of_an_o2_optimizer(half):
    m = _net(bn=False)
    m, opt = amp.initialize(m, _sgd(m), opt_level="O2", half_dtype=half, verbosity=0)
    ref = _net(bn=False)
    ref(_x()).sum().backward()
    scaler = amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(m(_x()).float().sum()).backward()
    scaler.unscale_(opt)
    for mp, r in zip(amp.master_params(opt), ref.parameters()):
        assert mp.dtype == F32 and mp.grad is not None and mp.grad.dtype == F32
        torch.testing.assert_close(mp.grad, r.grad, atol=5e-2, rtol=5e-2)
    before = [mp.detach().clone() for mp in amp.master_params(opt)]
    scaler.step(opt)
    scaler.update()
    after = list(amp.master_params(opt))
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(mp.to(half), p) for mp, p in zip(after, m.parameters()))


def test_gradscaler_state_dict_loads_into_torch_and_back():
    m, opt = _lin()
    ours = amp.GradScaler("cpu", init_scale=128.0, growth_factor=4.0, backoff_factor=0.25,
                          growth_interval=3)
    _scaler_step(ours, m, opt)
    _scaler_step(ours, m, opt, overflow=True)
    _scaler_step(ours, m, opt)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == ours.get_scale() == 32.0
    assert theirs.get_growth_factor() == 4.0 and theirs.get_backoff_factor() == 0.25
    assert theirs.get_growth_interval() == 3
    assert theirs.state_dict()["_growth_tracker"] == 1
    _scaler_step(theirs, m, opt)
    theirs.update(new_scale=8.0)
    back = amp.GradScaler("cpu")
    back.load_state_dict(theirs.state_dict())
    assert back.get_scale() == 8.0 and back.get_growth_factor() == 4.0
    assert back.get_backoff_factor() == 0.25 and back.get_growth_interval() == 3
    assert back.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]
    assert set(theirs.state_dict()) <= set(ours.state_dict())


def test_gradscaler_has_every_public_method_of_torch_s():
    public = {n for n in dir(torch.amp.GradScaler) if not n.startswith("_")}
    assert public <= set(dir(amp.GradScaler))


def test_gradscaler_is_picklable_and_keeps_its_state():
    m, opt = _lin()
    s = amp.GradScaler("cpu", init_scale=64.0, growth_interval=5, min_scale=2.0, hysteresis=2)
    _scaler_step(s, m, opt)
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.get_scale() == 64.0 and s2.get_growth_interval() == 5
    assert s2.state_dict() == s.state_dict()


def test_gradscaler_keeps_torch_s_call_order_errors():
    m, opt = _lin()
    s = amp.GradScaler("cpu")
    s.scale(m(torch.ones(1, 4)).sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        s.step(opt)


def test_gradscaler_disabled_is_a_no_op():
    s = amp.GradScaler("cpu", enabled=False)
    t = torch.ones(2)
    assert s.scale(t) is t and not s.is_enabled() and s.get_scale() == 1.0


def test_gradscaler_state_dict_round_trip_keeps_the_extras():
    m, opt = _lin()
    s = amp.GradScaler("cpu", init_scale=64.0, min_scale=2.0, max_scale=1024.0, hysteresis=3)
    _scaler_step(s, m, opt, overflow=True)
    s2 = amp.GradScaler("cpu")
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict() and s2.stats() == s.stats()
    _scaler_step(s2, m, opt, overflow=True)
    assert s2.get_scale() == 64.0  # 2nd consecutive overflow of 3: no back-off yet
    _scaler_step(s2, m, opt, overflow=True)
    assert s2.get_scale() == 32.0


def test_gradscaler_getters_setters_and_torch_style_structures():
    s = amp.GradScaler("cpu")
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        3.0, 0.25, 7)
    assert type(s.get_scale()) is float
    out = s.scale([torch.ones(1), (torch.ones(1) * 2, torch.ones(1) * 3)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert [float(out[0]), float(out[1][0]), float(out[1][1])] == [2.0**16, 2.0**17, 3 * 2.0**16]


def test_gradscaler_torch_errors():
    m, opt = _lin()
    s = amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})
    s.scale(m(torch.ones(1, 4)).sum()).backward()
    with pytest.raises(RuntimeError, match="Closure"):
        s.step(opt, closure=lambda: 0.0)
    s.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
        s.unscale_(opt)


@pytest.mark.parametrize("half", HALVES)
def test_gradscaler_skips_an_overflowing_step_of_a_half_model(half):
    m, opt = _lin(half)
    w = m.weight.detach().clone()
    s = amp.GradScaler("cpu", init_scale=8.0)
    _scaler_step(s, m, opt, overflow=True)
    assert torch.equal(m.weight, w) and s.get_scale() == 4.0


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_gradscaler_with_a_process_group_skips_an_overflowing_step():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m, opt = _lin()
        w = m.weight.detach().clone()
        s = amp.GradScaler("cpu", init_scale=8.0, process_group=dist.group.WORLD)
        _scaler_step(s, m, opt, overflow=True)
        assert torch.equal(m.weight, w) and s.get_scale() == 4.0
        _scaler_step(s, m, opt)
        assert not torch.equal(m.weight, w)
    finally:
        dist.destroy_process_group()


def test_gradscaler_bad_process_group_raises_at_construction():
    with pytest.raises((TypeError, ValueError), match="world") as e:
        amp.GradScaler("cpu", process_group="world")
    assert "None" in str(e.value)


# --- autocast ---------------------------------------------------------------------------------
def test_autocast_defaults_without_initialize():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.ones(4, 4, device=device)
    with amp.autocast():
        assert torch.is_autocast_enabled(device)
        assert torch.mm(a, a).dtype == torch.get_autocast_dtype(device)


@pytest.mark.parametrize("half", HALVES)
def test_autocast_follows_the_active_initialize(half):
    m = _net()
    amp.initialize(m, opt_level="O1", half_dtype=half, verbosity=0)
    a = torch.ones(4, 4)
    with amp.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.mm(a, a).dtype == half


@pytest.mark.parametrize("name, dtype", [("fp16", F16), ("float16", F16), ("half", F16),
                                         ("bf16", BF16), ("bfloat16", BF16)])
def test_autocast_dtype_names(name, dtype):
    a = torch.ones(4, 4)
    with amp.autocast("cpu", dtype=name):
        assert torch.mm(a, a).dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALVES)
def test_autocast_matches_torch_bitwise(device, half):
    m = _net(bn=False).to(device)
    x = _x(device=device)
    with torch.autocast(device, dtype=half):
        want = m(x)
        want_sm = torch.softmax(want, -1)
    with amp.autocast(device, dtype=half):
        got = m(x)
        got_sm = torch.softmax(got, -1)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert got_sm.dtype == want_sm.dtype and torch.equal(got_sm, want_sm)


def test_autocast_is_a_decorator_and_restores_state_on_error():
    @amp.autocast("cpu", dtype="bf16")
    def f(a):
        return torch.mm(a, a)
    assert f(torch.ones(2, 2)).dtype == BF16
    with pytest.raises(KeyError):
        with amp.autocast("cpu", dtype=F16):
            raise KeyError("x")
    assert not torch.is_autocast_enabled("cpu")
    with amp.autocast("cpu", enabled=False):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == F32


def test_autocast_cache_enabled_passes_through():
    with amp.autocast("cpu", dtype=BF16, cache_enabled=False):
        assert not torch.is_autocast_cache_enabled()
    with amp.autocast("cpu", dtype=BF16):
        assert torch.is_autocast_cache_enabled()


# --- overrides --------------------------------------------------------------------------------
def _probe_module() -> types.ModuleType:
    ns = types.ModuleType("probe")
    ns.seen = []

    def take(*args):
        ns.seen.append(tuple(a.dtype for a in args))
        return args[0]
    ns.h, ns.f, ns.p = take, take, take
    return ns


@pytest.mark.parametrize("half", HALVES)
def test_registered_functions_cast_only_under_ampkit_autocast(half):
    ns = _probe_module()
    amp.register_half_function(ns, "h")
    amp.register_float_function(ns, "f")
    amp.register_promote_function(ns, "p")
    a32, a16 = torch.ones(2), torch.ones(2, dtype=half)
    with amp.autocast("cpu", dtype=half):
        ns.h(a32)
        ns.f(a16)
        ns.p(a32, a16)
    assert ns.seen == [(half,), (F32,), (F32, F32)]
    ns.seen.clear()
    assert ns.h(a32) is a32 and ns.f(a16) is a16 and ns.p(a32, a16) is a32  # untouched
    assert ns.seen == [(F32,), (half,), (F32, half)]


@pytest.mark.parametrize("half", HALVES)
def test_override_decorators(half):
    seen = []

    @amp.half_function
    def h(x):
        seen.append(x.dtype)

    @amp.float_function
    def f(x):
        seen.append(x.dtype)

    @amp.promote_function
    def p(x, y):
        seen.append((x.dtype, y.dtype))
    a32, a16 = torch.ones(2), torch.ones(2, dtype=half)
    with amp.autocast("cpu", dtype=half):
        h(a32), f(a16), p(a16, a32)
    h(a32), f(a16), p(a16, a32)
    assert seen == [half, F32, (F32, F32), F32, half, (half, F32)]


def test_disable_casts_turns_autocast_off_inside():
    a = torch.ones(2, 2)
    with amp.autocast("cpu", dtype=BF16):
        with amp.disable_casts():
            assert torch.mm(a, a).dtype == F32
        assert torch.mm(a, a).dtype == BF16


@pytest.mark.parametrize("half", HALVES)
def test_overrides_act_under_o1_forward_only(half):
    ns = _probe_module()
    amp.register_float_function(ns, "f")
    amp.register_half_function(ns, "h")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = ns.h(ns.f(self.lin(x)))
            with amp.disable_casts():
                self.inner = self.lin(x).dtype
            return y
    m = amp.initialize(M(), opt_level="O1", half_dtype=half, verbosity=0)
    m(torch.ones(2, 4))
    assert ns.seen == [(F32,), (half,)] and m.inner == F32
    ns.seen.clear()
    ns.f(torch.ones(2, dtype=half))
    ns.h(torch.ones(2))
    assert ns.seen == [(half,), (F32,)]


# --- policies ---------------------------------------------------------------------------------
NAMES = ["O0", "O1", "O2", "O3", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true",
         "fp32", "fp16-mixed", "params=float32,compute=bfloat16,output=float32",
         "p=f32,c=bf16,o=f32", "p=f16,c=f16,o=f16", "params=bfloat16,compute=bfloat16,output=float32"]


@pytest.mark.parametrize("name", NAMES)
def test_get_policy_round_trips_through_str(name):
    p = amp.get_policy(name)
    assert isinstance(p, amp.Policy) and amp.get_policy(str(p)) == p


def test_get_policy_aliases_and_forms():
    assert amp.get_policy("fp32") == amp.get_policy("32-true")
    assert amp.get_policy("fp16-mixed") == amp.get_policy("16-mixed")
    long = amp.get_policy("params=float32,compute=bfloat16,output=float32")
    assert long == amp.get_policy("p=f32,c=bf16,o=f32")
    assert (long.param_dtype, long.compute_dtype, long.output_dtype) == (F32, BF16, F32)
    p = amp.get_policy("p=f16,c=f16,o=f32")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F16, F16, F32)


@pytest.mark.parametrize("name, param, compute", [
    ("O0", F32, F32), ("O1", F32, F16), ("O2", F16, F16), ("O3", F16, F16),
    ("32-true", F32, F32), ("16-mixed", F32, F16), ("bf16-mixed", F32, BF16),
    ("16-true", F16, F16), ("bf16-true", BF16, BF16)])
def test_named_policies_dtypes(name, param, compute):
    p = amp.get_policy(name)
    assert (p.param_dtype, p.compute_dtype) == (param, compute)


def test_get_policy_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="bogus") as e:
        amp.get_policy("bogus")
    for valid in ["O0", "O3", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]:
        assert valid in str(e.value)


@pytest.mark.parametrize("kwargs", [
    {}, {"loss_scale": "dynamic"}, {"loss_scale": 1024.0}, {"keep_batchnorm_fp32": False},
    {"compute_dtype": F16, "autocast": True}, {"param_dtype": BF16, "compute_dtype": BF16,
                                               "master_weights": True, "output_dtype": F16}])
def test_hand_made_policy_round_trips(kwargs):
    fields = {"param_dtype": F32, "compute_dtype": F32, "output_dtype": F32, **kwargs}
    p = amp.Policy(**fields)
    assert amp.get_policy(str(p)) == p


def test_policy_bad_dtype_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match="int8") as e:
        amp.Policy(param_dtype=torch.int8, compute_dtype=F16, output_dtype=F32)
    assert "bfloat16" in str(e.value)
    with pytest.raises(ValueError, match="f64") as e:
        amp.get_policy("p=f64,c=bf16,o=f32")
    assert "bf16" in str(e.value)


# --- fp8 --------------------------------------------------------------------------------------
class _Mixed(nn.Module):
    def __init__(self, dtype=F32):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32, dtype=dtype)
        self.b = nn.Linear(32, 16, bias=False, dtype=dtype)
        self.c = nn.Linear(16, 20, dtype=dtype)  # out not a multiple of 16
        self.d = nn.Linear(20, 16, dtype=dtype)  # in not a multiple of 16

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_convert_to_fp8_swaps_only_multiples_of_16_and_keeps_state_dict(recipe, dtype):
    m = _Mixed(dtype)
    before = _snapshot(m)
    out = convert_to_fp8(m, recipe=recipe)
    assert out is m
    assert type(m.a) is Float8Linear and type(m.b) is Float8Linear
    assert type(m.c) is nn.Linear and type(m.d) is nn.Linear
    assert _same_state(m, before)
    y = m(torch.randn(4, 16, dtype=dtype))
    assert y.shape == (4, 16) and torch.isfinite(y).all()


def test_convert_to_fp8_module_filter():
    m = _Mixed()
    convert_to_fp8(m, module_filter=lambda mod, fqn: fqn != "a")
    assert type(m.a) is nn.Linear and type(m.b) is Float8Linear


def _fp8_round_trip(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor dynamic scaling: amax maps to the format's largest finite value."""
    top = torch.finfo(dtype).max
    scale = top / t.abs().max().float()
    return (t.float() * scale).clamp(-top, top).to(dtype).float() / scale


def test_tensorwise_is_e4m3_forward_and_e5m2_gradients():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 16))
    convert_to_fp8(m, recipe="tensorwise")
    x = torch.randn(8, 32, requires_grad=True)
    w = m[0].weight.detach()
    y = m(x)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    want = _fp8_round_trip(x.detach(), e4m3) @ _fp8_round_trip(w, e4m3).T + m[0].bias
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    g = torch.randn(8, 16)
    y.backward(g)
    want_dx = _fp8_round_trip(g, e5m2) @ _fp8_round_trip(w, e4m3)
    torch.testing.assert_close(x.grad, want_dx, atol=1e-5, rtol=1e-5)
    want_dw = _fp8_round_trip(g, e5m2).T @ _fp8_round_trip(x.detach(), e4m3)
    torch.testing.assert_close(m[0].weight.grad, want_dw, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_fp8_layers_train_keep_their_parameters_and_state_dict_keys(recipe):
    m = _Mixed()
    weight = m.a.weight
    before = {k: v.dtype for k, v in m.state_dict().items()}
    convert_to_fp8(m, recipe=recipe)
    assert m.a.weight is weight  # an optimizer made before the swap keeps working
    m(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert m.a.weight.grad.dtype == F32 and torch.isfinite(m.a.weight.grad).all()
    assert {k: v.dtype for k, v in m.state_dict().items()} == before
    plain = _Mixed()
    plain.load_state_dict(m.state_dict())


# --- errors: message names the bad value and the choices; nothing modified ------------------
@pytest.mark.parametrize("kwargs, bad, choices", [
    ({"opt_level": "O4"}, "O4", ["O0", "O1", "O2", "O3"]),
    ({"opt_level": "O2", "half_dtype": torch.float32}, "float32", ["float16", "bfloat16"]),
    ({"opt_level": "O2", "half_dtype": "fp8"}, "fp8", ["float16", "bfloat16"]),
    ({"opt_level": "O2", "cast_model_type": torch.int8}, "int8", ["float16", "bfloat16"]),
    ({"opt_level": "O1", "loss_scale": "sometimes"}, "sometimes", ["dynamic"]),
    ({"opt_level": "O1", "num_losses": 0}, "0", ["num_losses"]),
])
def test_initialize_bad_argument_raises_before_any_change(kwargs, bad, choices):
    m = _net()
    opt = _sgd(m)
    snap, groups = _snapshot(m), copy.deepcopy(opt.state_dict())
    forward = m.forward
    with pytest.raises((ValueError, TypeError)) as e:
        amp.initialize(m, opt, verbosity=0, **kwargs)
    msg = str(e.value)
    assert bad in msg and all(c in msg for c in choices), msg
    assert _same_state(m, snap) and opt.state_dict() == groups
    assert m.forward == forward and not m._forward_hooks and not m._forward_pre_hooks
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], m.parameters()))


def test_initialize_bad_optimizer_in_a_list_changes_no_model():
    m1, m2 = _net(0), _net(1)
    snaps = _snapshot(m1), _snapshot(m2)
    with pytest.raises(TypeError, match="str"):
        amp.initialize([m1, m2], [_sgd(m1), "adam"], opt_level="O2", half_dtype=F16,
                       verbosity=0)
    assert _same_state(m1, snaps[0]) and _same_state(m2, snaps[1])


def test_scale_loss_bad_loss_id_changes_nothing():
    m = _net()
    m, opt = amp.initialize(m, _sgd(m), opt_level="O1", verbosity=0)
    sd = amp.state_dict()
    loss = m(_x()).sum()
    with pytest.raises(ValueError, match="5") as e:
        with amp.scale_loss(loss, opt, loss_id=5):
            pass
    assert "0" in str(e.value)
    assert amp.state_dict() == sd and all(p.grad is None for p in m.parameters())


def test_amp_load_state_dict_bad_key_changes_nothing():
    m = _net()
    amp.initialize(m, _sgd(m), opt_level="O1", verbosity=0)
    sd = amp.state_dict()
    with pytest.raises((ValueError, KeyError, RuntimeError), match="loss_scaler7") as e:
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0},
                             "loss_scaler7": {"loss_scale": 8.0, "unskipped": 0}})
    assert "loss_scaler0" in str(e.value)
    assert amp.state_dict() == sd


@pytest.mark.parametrize("kwargs, bad, choices", [
    ({"dtype": "fp8"}, "fp8", ["fp16", "bf16"]),
    ({"dtype": torch.int32}, "int32", ["float16", "bfloat16"]),
    ({"device_type": "tpu"}, "tpu", ["cpu", "cuda"]),
])
def test_autocast_bad_argument(kwargs, bad, choices):
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
        with amp.autocast(**kwargs):
            pass
    msg = str(e.value)
    assert bad in msg and all(c in msg for c in choices), msg
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("kwargs, bad, must", [
    ({"device": "tpu"}, "tpu", ["cpu"]),
    ({"hysteresis": 0}, "0", ["hysteresis", "1"]),
    ({"min_scale": 8.0, "max_scale": 2.0}, "8.0", ["min_scale", "max_scale"]),
    ({"growth_factor": 0.5}, "0.5", ["growth_factor", "1.0"]),
    ({"backoff_factor": 1.5}, "1.5", ["backoff_factor", "1.0"]),
])
def test_gradscaler_bad_argument(kwargs, bad, must):
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
        amp.GradScaler(**kwargs)
    msg = str(e.value)
    assert bad in msg and all(word in msg for word in must), msg


def test_register_missing_function_names_it_and_registers_nothing():
    ns = _probe_module()
    with pytest.raises((ValueError, AttributeError, TypeError), match="nope"):
        amp.register_half_function(ns, "nope")
    assert not hasattr(ns, "nope")


def test_register_missing_function_names_the_valid_choices():
    """The message named the bad value only; it now names the valid ones (all of them for
    a small namespace, the closest of a large one such as torch)."""
    ns = types.SimpleNamespace(mm=torch.mm, bmm=torch.bmm, scale=2.0)
    with pytest.raises(ValueError, match=r"no attribute 'nope' .*; valid: 'bmm', 'mm'$"):
        amp.register_float_function(ns, "nope")
    with pytest.raises(ValueError, match=r"no attribute 'mn' .*callable attributes "
                                         r"\(closest: 'min', "):
        amp.register_half_function(torch, "mn")


def test_convert_to_fp8_bad_recipe_names_choices_and_changes_nothing():
    m = _Mixed()
    snap = _snapshot(m)
    with pytest.raises(ValueError, match="blockwise") as e:
        convert_to_fp8(m, recipe="blockwise")
    for r in ["tensorwise", "delayed", "rowwise"]:
        assert r in str(e.value)
    assert type(m.a) is nn.Linear and type(m.b) is nn.Linear and _same_state(m, snap)


def test_amp_load_state_dict_with_one_bad_entry_loads_none():
    m = _net()
    amp.initialize(m, _sgd(m), opt_level="O1", num_losses=2, verbosity=0)
    sd = amp.state_dict()
    with pytest.raises((ValueError, TypeError), match="big"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1},
                             "loss_scaler1": {"loss_scale": "big", "unskipped": 0}})
    assert amp.state_dict() == sd


def test_scale_loss_with_an_optimizer_initialize_never_saw():
    m = _net()
    amp.initialize(m, _sgd(m), opt_level="O1", verbosity=0)
    other = _net(1)
    with pytest.raises(RuntimeError, match="SGD") as e:
        with amp.scale_loss(other(_x()).sum(), _sgd(other)):
            pass
    assert "initialize" in str(e.value)


def test_initialize_non_module_in_the_list_changes_no_model():
    m = _net()
    snap = _snapshot(m)
    with pytest.raises(TypeError, match="str") as e:
        amp.initialize([m, "x"], opt_level="O2", half_dtype=F16, verbosity=0)
    assert "nn.Module" in str(e.value) and _same_state(m, snap)


def test_gradscaler_bad_loaded_state_changes_nothing():
    s = amp.GradScaler("cpu", init_scale=64.0)
    before = s.state_dict()
    bad = {**before, "growth_factor": "x"}
    with pytest.raises((TypeError, ValueError), match="'x'"):
        s.load_state_dict(bad)
    assert s.state_dict() == before


def test_a_failed_initialize_leaves_the_earlier_one_active():
    m = nn.Linear(4, 4)
    m, opt = amp.initialize(m, _sgd(m), opt_level="O1", half_dtype=F16, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}})
    sd = amp.state_dict()
    other = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="O9"):
        amp.initialize(other, _sgd(other), opt_level="O9", verbosity=0)
    assert amp.state_dict() == sd
    with amp.autocast():
        assert torch.get_autocast_dtype("cpu") == F16
    loss = m(torch.ones(1, 4)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss * 8.0)
