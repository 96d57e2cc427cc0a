"""frontend.py against what real apex programs and a hostile probe did: apex's private
attributes, exceptions inside scale_loss, leaks, and arguments initialize must refuse."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import ampkit as amp
from ampkit import _state

BF16, F16 = torch.bfloat16, torch.float16


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _init(level="O2", half=BF16, **kw):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)


def _loss(model, scale: float = 1.0):
    return model(torch.randn(4, 4, generator=torch.Generator().manual_seed(1))).float().pow(2).mean() * scale


# --- apex's _amp_state ---------------------------------------------------------------------
def test_amp_state_loss_scalers_read_and_write_the_scale_scale_loss_uses():
    model, opt = _init(num_losses=2)
    scalers = amp._amp_state.loss_scalers
    assert len(scalers) == 2 and scalers[0].loss_scale() == 2.0**16
    assert scalers[0]._loss_scale == 2.0**16 and scalers[0]._unskipped == 0
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**20  # as public training scripts do
    loss = _loss(model)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == loss.item() * 2.0**20
        scaled.backward()
    assert amp._amp_state.loss_scalers[0]._unskipped == 1  # a clean step, counted
    amp._amp_state.loss_scalers[0]._unskipped = 5
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**20, "unskipped": 5}
    assert amp._amp_state.loss_scalers[1]._loss_scale == 2.0**16  # the other loss's own
    with pytest.raises(ValueError, match=r"_loss_scale must be a positive finite number, got -1"):
        amp._amp_state.loss_scalers[0]._loss_scale = -1


@pytest.mark.parametrize("level,kw", [("O0", {}), ("O3", {}), ("O1", {"loss_scale": 128.0}),
                                      ("O2", {"loss_scale": "128"}), ("O2", {"loss_scale": 1.0})])
def test_a_fixed_scale_counts_every_step_as_unskipped_as_apex_did(level, kw):
    """apex's LossScaler added 1 to _unskipped at every exit that updates, fixed scale or
    dynamic; ampkit's stayed 0 under a fixed scale (its growth tracker never moves).
    apex's scale_loss returned before its update for a scale of 1.0 without masters
    (O0, O3): counted there once the scale is another."""
    model, opt = _init(level, **kw)
    if level in ("O0", "O3"):
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()
        assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}
        amp._amp_state.loss_scalers[0]._loss_scale = 128.0
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    for _ in range(3):
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    with amp.scale_loss(_loss(model), opt, delay_unscale=True) as scaled:
        scaled.backward()  # a delayed exit updates nothing, in apex neither
    with amp.scale_loss(_loss(model), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": scale, "unskipped": 3}}
    assert amp._amp_state.loss_scalers[0]._unskipped == 3
    amp._amp_state.loss_scalers[0]._unskipped = 7
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 7
    amp.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 11}})  # a resume
    with amp.scale_loss(_loss(model), opt) as scaled:
        scaled.backward()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": scale, "unskipped": 12}}


def test_amp_state_can_turn_a_fixed_unit_scale_into_a_real_one():
    model, opt = _init("O3", F16)  # loss scale 1.0: scale_loss had nothing to do
    amp._amp_state.loss_scalers[0]._loss_scale = 128.0
    loss = _loss(model)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == loss.item() * 128.0


def test_amp_state_is_empty_before_initialize():
    assert amp._amp_state.loss_scalers == []


def test_amp_state_scale_seq_len_sets_the_clean_steps_the_scale_grows_after():
    """Written after initialize by public scripts (_scale_seq_len = 200): the write went to a
    throw-away view and the scale kept growing every 2000 steps."""
    model, opt = _init("O2", F16)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler._scale_seq_len == 2000 and scaler.dynamic
    scaler._loss_scale = 2.0**10
    scaler._scale_seq_len = 3
    assert amp._amp_state.loss_scalers[0]._scale_seq_len == 3
    scales = []
    for _ in range(7):
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]  # apex's rule
    with pytest.raises(ValueError, match=r"_scale_seq_len .* got 0"):
        scaler._scale_seq_len = 0


def test_amp_state_refuses_what_it_would_silently_drop():
    _init("O1", F16, min_loss_scale=2.0, max_loss_scale=2.0**20)
    scaler = amp._amp_state.loss_scalers[0]
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0, 2.0**20)
    with pytest.raises(AttributeError, match=r"loss_scalers\[0\]\.dynamic is read-only.*"
                                             r"valid writes: _loss_scale, _unskipped, _scale_seq_len"):
        scaler.dynamic = False
    with pytest.raises(AttributeError, match=r"\._growth_interval is not part of it"):
        scaler._growth_interval = 5
    with pytest.raises(AttributeError, match=r"update_scale .*scale_loss unscales the gradients "
                                             r"and updates the scale at its exit.*_scale_seq_len"):
        scaler.update_scale()
    assert not hasattr(scaler, "_has_overflow")


@pytest.mark.parametrize("level, expected", [
    ("O0", dict(cast_model_type=torch.float32, patch_torch_functions=False,
                keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0)),
    ("O1", dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
                master_weights=None, loss_scale="dynamic")),
    ("O2", dict(cast_model_type=F16, patch_torch_functions=False, keep_batchnorm_fp32=True,
                master_weights=True, loss_scale="dynamic")),
    ("O3", dict(cast_model_type=F16, patch_torch_functions=False, keep_batchnorm_fp32=False,
                master_weights=False, loss_scale=1.0))])
def test_amp_state_opt_properties_are_apex_s_for_each_level(level, expected):
    """Scripts read _amp_state.opt_properties.master_weights (to clip or zero the masters)
    and .options["cast_model_type"] (to cast inputs); it did not exist."""
    assert not hasattr(amp._amp_state, "opt_properties")  # before initialize, as in apex
    _init(level, F16)
    props = amp._amp_state.opt_properties
    assert props.options == {"enabled": True, "opt_level": level, **expected}
    assert props.master_weights is expected["master_weights"]
    assert props.options["cast_model_type"] is expected["cast_model_type"]
    with pytest.raises(AttributeError, match=r"opt_properties.master_weights is read-only"):
        props.master_weights = True
    with pytest.raises(AttributeError, match=r"opt_properties.handle is not part of .*opt_level"):
        props.handle
    with pytest.raises(TypeError):
        props.options["master_weights"] = True  # read-only too: a write would be lost


def test_amp_state_opt_properties_after_a_disabled_initialize():
    _init("O2", enabled=False)
    assert amp._amp_state.opt_properties.options == {  # apex's Properties() defaults
        "enabled": False, "opt_level": None, "cast_model_type": None,
        "patch_torch_functions": False, "keep_batchnorm_fp32": None, "master_weights": None,
        "loss_scale": 1.0}


def test_amp_state_loss_scaler_views_copy_and_pickle():
    """With __slots__ and the refusing __setattr__, copy.copy and pickle raised a misleading
    AttributeError (review finding)."""
    import copy
    import pickle
    _init("O1", F16)
    scaler = amp._amp_state.loss_scalers[0]
    for other in (copy.copy(scaler), copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert other.loss_scale() == 2.0**16 and other._scale_seq_len == 2000


def _embedding_row_norms(keep: list[str]) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4, max_norm=1.0), nn.Flatten(), nn.Linear(12, 2))
    with torch.no_grad():
        model[0].weight.mul_(3)  # rows of norm ~3: the forward renormalises the ones it reads
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0, keep_fp32=keep)
    for step in range(3):
        loss = model(torch.tensor([[1, 2, 3]])).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()["0.weight"][1:4].norm(dim=1)


def test_o2_warns_that_an_embedding_s_max_norm_is_undone_and_keep_fp32_mends_it():
    """The renorm of the half weight was overwritten by every step's copy of the masters,
    silently: the saved rows kept norms of 2-3 where torch's stay at max_norm."""
    with pytest.warns(UserWarning, match=r"initialize: 0 \(Embedding, max_norm=1.0\): .*copies "
                                         r"the fp32 master weights over them.*keep_fp32=\['0'\]"):
        undone = _embedding_row_norms([])
    assert (undone > 1.5).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = _embedding_row_norms(["0"])
    assert (kept < 1.05).all()  # renormalised to 1 at each forward, then one small step


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_complex_parameter_trains_under_dynamic_loss_scaling(level):
    """The first scale_loss exit raised torch's NotImplementedError for ComplexFloat."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("spectrum", nn.Parameter(torch.randn(4, dtype=torch.complex64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, half_dtype=F16, verbosity=0)
    before = model.spectrum.detach().clone()
    out = model(torch.randn(2, 4)).float()
    loss = (torch.fft.ifft(torch.fft.fft(out) * model.spectrum).real ** 2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert model.spectrum.dtype == torch.complex64 and not torch.equal(model.spectrum, before)
    assert torch.isfinite(torch.view_as_real(model.spectrum)).all()


def test_the_max_norm_warning_names_every_embedding_of_every_model():
    models = [nn.Sequential(nn.Embedding(8, 4, max_norm=1.0), nn.EmbeddingBag(8, 4, max_norm=2.0)),
              nn.Embedding(8, 4, max_norm=3.0)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    with pytest.warns(UserWarning) as record:
        amp.initialize(models, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    messages = [str(w.message) for w in record if "max_norm" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(
        "ampkit.initialize: models[0].0 (Embedding, max_norm=1.0), models[0].1 (EmbeddingBag, "
        "max_norm=2.0), models[1] (Embedding, max_norm=3.0): ")
    assert messages[0].endswith("ampkit.keep_fp32(model, [...]) on each model with these "
                                "names, before initialize")


def _o2_fp16_large_targets(**kw) -> tuple[list[float], list[str]]:
    """An O2 fp16 regression whose gradients exceed fp16's range at a scale of 1 (targets
    of ~5000 under MSE): the losses, and the floor warnings given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    amp.initialize(model, opt, opt_level="O2", half_dtype=F16, verbosity=0, **kw)
    x, y = torch.randn(64, 4), 5000 + 3000 * torch.randn(64, 1)
    losses = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(40):
            loss = (model(x).float() - y).pow(2).sum()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [str(w.message) for w in record if "at its floor" in str(w.message)]


def test_an_o2_fp16_run_stuck_at_the_floor_is_told_to_lower_it():
    """fp16 gradients floor the scale at 1.0 (as Megatron and DeepSpeed do); gradients that
    overflow fp16 even unscaled then skip every step, and the warning said they were not
    finite whatever the scale, without naming min_loss_scale (convergence probe)."""
    stuck, warned = _o2_fp16_large_targets()
    assert stuck[-1] == stuck[0] and amp.state_dict()["loss_scaler0"]["loss_scale"] == 1.0
    assert warned and "min_loss_scale=2**-8" in warned[0]
    trained, warned = _o2_fp16_large_targets(min_loss_scale=2.0**-8)
    assert trained[-1] < trained[0] / 2 and not warned
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] < 1.0


# --- an exception inside scale_loss ---------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_exception_after_backward_drops_the_scaled_gradients(level):
    model, opt = _init(level)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyError):
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()
            raise KeyError("the body failed after backward")
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in amp.master_params(opt))
    opt.step()  # what the probe did after catching it: nothing may move
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_an_exception_keeps_the_gradients_accumulated_before_it():
    model, opt = _init("O1")
    with amp.scale_loss(_loss(model), opt) as scaled:
        scaled.backward()
    kept = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(KeyError):
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()
            raise KeyError("second micro-batch failed")
    assert all(torch.equal(a, p.grad) for a, p in zip(kept, model.parameters()))


# --- leaks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_models_and_optimizers_are_freed_after_del(level):
    refs = []
    for seed in range(3):
        model = _model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=BF16, verbosity=0)
        with amp.scale_loss(_loss(model), opt) as scaled:
            scaled.backward()
        opt.step()
        refs += [weakref.ref(model), weakref.ref(opt), weakref.ref(next(model.parameters())),
                 weakref.ref(next(amp.master_params(opt)))]
        del model, opt, scaled
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


# --- initialize refuses ----------------------------------------------------------------------
def test_one_parameter_in_two_o2_optimizers_is_refused_before_any_change():
    model = _model()
    opt1 = torch.optim.SGD(model.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"a parameter of shape \(8, 4\) is in optimizers\[0\] "
                                         r"and optimizers\[1\]"):
        amp.initialize(model, [opt1, opt2], opt_level="O2", half_dtype=BF16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not hasattr(opt1, "_amp_stash") and not hasattr(opt2, "_amp_stash")


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = _model(), _model(1)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(SGD\) steps none of the parameters "
                                         "of the models given to initialize"):
        amp.initialize(model, opt, opt_level="O2", half_dtype=BF16)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_an_extra_fp32_parameter_beside_the_models_is_accepted():
    """Multi-task loss weights and the like live outside the model: they step in fp32."""
    model = _model()
    log_vars = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([*model.parameters(), log_vars], lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert any(p is log_vars for p in amp.master_params(opt))


def test_an_empty_param_group_is_refused():
    model = _model()
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": []}], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers\[0\].param_groups\[1\] has no parameters"):
        amp.initialize(model, opt, opt_level="O1")


def test_a_meta_device_model_is_refused_and_changes_no_default():
    with torch.device("meta"):
        model = _model()
    with pytest.raises(ValueError, match="parameter '0.weight' on the meta device"):
        amp.initialize(model, opt_level="O1")
    assert _state.get_active() is None
    assert amp.autocast().device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_o2_on_a_lazy_module_is_refused_before_anything_changes():
    """The masters' copy raised torch's error from inside initialize, after the model had
    been cast to half and the amp state replaced."""
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter '0.weight' not yet materialized.*valid: "
                                         r"run one forward"):
        amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert _state.get_active() is None and model[2].weight.dtype == torch.float32
    assert "forward" not in vars(model)
    model(torch.randn(2, 3))  # materialized: now it initializes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    assert model[0].weight.dtype == BF16 and next(amp.master_params(opt)).dtype == torch.float32


@pytest.mark.parametrize("name", ["delay_unscale", "delay_overflow_check"])
def test_scale_loss_flags_must_be_bools(name):
    model, opt = _init("O1")
    with pytest.raises(TypeError, match=f"{name} must be a bool, got str 'no'; valid: True, False"):
        with amp.scale_loss(_loss(model), opt, **{name: "no"}):
            pass


# --- bf16 O3 ---------------------------------------------------------------------------------
def test_bf16_o3_warns_and_names_the_fp16_choice():
    with pytest.warns(UserWarning, match=r"half_dtype=torch.float16"):
        _init("O3", BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init("O3", F16)
        _init("O2", BF16)


# --- the fp16 floor --------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_fp16_o2_scale_floors_at_one_and_warns_on_a_floored_streak(fused):
    """(With a fused optimizer the warning never came.)"""
    model = _model()
    opt = (torch.optim.Adam(model.parameters(), lr=0.1, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=F16, verbosity=0)
    with pytest.warns(RuntimeWarning, match=r"steps in a row overflowed and the loss scale is at "
                                            r"its floor \(1\)"):
        for _ in range(20):
            opt.zero_grad()
            with amp.scale_loss(_loss(model, float("inf")), opt) as scaled:
                scaled.backward()
            opt.step()
    assert amp._amp_state.loss_scalers[0]._loss_scale == 1.0


def test_bf16_o2_and_an_explicit_min_loss_scale_keep_their_floor():
    model, opt = _init("O2", BF16)
    assert _state.get_active().scalers[0].min_scale is None
    model, opt = _init("O2", F16, min_loss_scale=2.0**-4)
    assert _state.get_active().scalers[0].min_scale == 2.0**-4


# --- apex's own tests: cast_model_type=False, master_weights at O0 ----------------------------
class _TwoDtypes(nn.Module):
    """apex's tests/L0/run_amp/test_multiple_models_optimizers_losses.py model: one fp32
    and one fp16 parameter, values every step keeps exact."""

    def __init__(self, unique: float) -> None:
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))

    def forward(self, x):
        return (x * self.weight0.float() * self.weight1.float()).sum()


def _two_models_one_optimizer():
    models = [_TwoDtypes(1.0), _TwoDtypes(2.0)]
    opt = torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25},
                           {"params": models[1].parameters(), "lr": 0.5}], momentum=0.125)
    return models, opt


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_cast_model_type_false_leaves_the_dtypes_and_trains_as_apex_did(level):
    """apex's multi-model tests pass cast_model_type=False ("do not cast the model"):
    ampkit refused it ("must be a torch.dtype"). Now the parameters keep their dtypes, and
    under O2 the fp16 ones still get fp32 masters, as apex made them; both models train
    exactly as the plain loop does, two losses with their own loss scalers."""
    x = torch.ones(2)
    reference, ref_opt = _two_models_one_optimizer()
    for _ in range(2):
        ref_opt.zero_grad()
        for model in reference:
            model(x).backward()
        ref_opt.step()
    models, opt = _two_models_one_optimizer()
    models, opt = amp.initialize(models, opt, opt_level=level, cast_model_type=False,
                                 num_losses=2, half_dtype=F16, verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0  # as apex's test: 2**16 overflows fp16
    amp._amp_state.loss_scalers[1]._loss_scale = 16.0
    assert [p.dtype for p in models[0].parameters()] == [torch.float32, F16]
    masters = list(amp.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32] * 4 if level == "O2" else [
        p.dtype for m in models for p in m.parameters()]
    for _ in range(2):
        opt.zero_grad()
        for loss_id, model in enumerate(models):
            with amp.scale_loss(model(x), opt, loss_id=loss_id) as scaled:
                scaled.backward()
        opt.step()
    for model, ref in zip(models, reference):
        for p, r in zip(model.parameters(), ref.parameters()):
            assert p.dtype == r.dtype and torch.equal(p, r)


def test_o0_with_master_weights_is_accepted_and_trains_in_fp32():
    """apex accepted master_weights=True at O0 (masters of no half parameter); ampkit
    refused it. An fp32 model trains bit for bit as without ampkit."""
    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O0", master_weights=True, verbosity=0)
    for _ in range(3):
        for m, o, amped in ((model, opt, True), (ref, ref_opt, False)):
            o.zero_grad()
            if amped:
                with amp.scale_loss(_loss(m), o) as scaled:
                    scaled.backward()
            else:
                _loss(m).backward()
            o.step()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters()))


# --- apex's LARC wrapper ----------------------------------------------------------------------
class _Larc:
    """The shape of apex.parallel.LARC: not an Optimizer; holds one as ``.optim``, scales
    each gradient by a trust ratio in its own ``step``, then steps the optimizer."""

    def __init__(self, optimizer, trust: float = 0.02) -> None:
        self.optim, self.trust = optimizer, trust

    @property
    def param_groups(self):
        return self.optim.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def step(self) -> None:
        with torch.no_grad():
            for group in self.optim.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        ratio = self.trust * p.norm() / (p.grad.norm() + 1e-8)
                        p.grad.mul_(torch.clamp(ratio / group["lr"], max=1.0))
        self.optim.step()


def _larc_run(wrap_first: bool, inf_at: int = 1):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrap_first:  # apex's way: initialize(model, LARC(...)), scale_loss(loss, larc)
        larc = _Larc(inner)
        model, returned = amp.initialize(model, larc, opt_level="O2", half_dtype=F16, verbosity=0)
        assert returned is larc
        target = larc
    else:  # initialize the optimizer, wrap it afterwards
        model, inner = amp.initialize(model, inner, opt_level="O2", half_dtype=F16, verbosity=0)
        larc = target = _Larc(inner)
        target = inner
    for i in range(3):
        larc.zero_grad()
        with amp.scale_loss(_loss(model, float("inf") if i == inf_at else 1.0), target) as scaled:
            scaled.backward()
        before = [m.clone() for m in amp.master_params(larc)]
        larc.step()
        if i == inf_at:  # the overflow's step changed nothing
            assert all(torch.equal(m, b) for m, b in zip(amp.master_params(larc), before))
    return [m.clone() for m in amp.master_params(larc)], [p.clone() for p in model.parameters()]


def test_apexs_larc_wrapper_is_taken_by_initialize_scale_loss_and_master_params():
    """initialize, scale_loss and master_params refused apex's LARC (not an Optimizer),
    which apex took everywhere. Now ampkit prepares the optimizer it holds: training
    equals initializing that optimizer and wrapping it afterwards, and the overflow's step
    is skipped."""
    (masters, params), (ref_masters, ref_params) = _larc_run(True), _larc_run(False)
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == 4
    assert all(torch.equal(a, b) for a, b in zip(masters + params, ref_masters + ref_params))
    assert not torch.equal(masters[0], _model()[0].weight)  # the clean steps trained
    with pytest.raises(TypeError, match=r"optimizers\[1\] is a int \(3\), not a torch.optim"):
        amp.initialize(_model(), [torch.optim.SGD(_model().parameters(), lr=0.1), 3])


def test_scale_loss_refuses_an_optimizer_listed_twice_before_the_backward():
    """Its grads were unscaled twice (65536x too small), silently."""
    model, opt = _init("O1")
    with pytest.raises(ValueError, match=r"optimizers\[1\] \(SGD\) is listed twice; valid: "
                                         r"each optimizer once"):
        with amp.scale_loss(_loss(model), [opt, opt]):
            pass


def test_a_dynamic_runs_scale_loaded_into_a_fixed_scale_run_warns():
    """(probe) An O2 checkpoint's 65536 loaded into O3 made every step scale by it with no
    overflow check, silently; it still loads, as in apex, but says so."""
    _init("O3", F16)
    with pytest.warns(UserWarning, match=r"sets the loss scale to 65536, where this run's is "
                                         r"fixed at 1 and checks no overflow"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 3}})
    assert amp._amp_state.loss_scalers[0]._loss_scale == 65536.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict(amp.state_dict())  # its own scale: nothing to say
        _init("O2", F16)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}})
