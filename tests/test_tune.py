"""tune.py: autotune and the recommendation rule bench shares."""

from __future__ import annotations

import math

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


def test_a_non_finite_fp32_reference_judges_no_candidate_and_says_so():
    """fp32's own loss NaN: autotune chose 32-true as "the fp32 reference", silently, and
    bench recommended it as "no other policy was faster"; now both say that nothing can
    be judged and that precision is not the cause."""
    rows = [{"policy": "32-true", "step_ms": 10.0, "max_loss_dev": None},
            {"policy": "bf16-mixed", "step_ms": 6.0, "max_loss_dev": None}]
    assert choose(rows, 0.02) == ("32-true", 1.0)
    assert [r["accepted"] for r in rows] == [True, False]
    assert "own loss is not finite: precision is not the cause" in rows[0]["reason"]
    assert rows[1]["reason"] == "not judged: fp32's own loss is not finite"

    class Nan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x) * float("nan")

    with pytest.warns(UserWarning, match=r"autotune: the fp32 reference, whose own loss"):
        result = ampkit.autotune(Nan(), torch.randn(8, 4), torch.randn(8, 2), steps=3,
                                 candidates=["32-true", "bf16-mixed"])
    assert result.policy == "32-true" and result.rows[1]["accepted"] is False
    from ampkit.bench import verdict
    rec = {"recommended": "32-true", "rows": rows, "max_loss_dev": 0.02}
    assert verdict.recommendation_sentence(rec, []).startswith(
        "Recommendation: none judged (32-true by default): the fp32 reference")


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
    (None, TypeError, r"inputs must be a tensor, a list of them, or a tuple or dict holding "),
    ((), TypeError, r"inputs must be a tensor, .* got tuple \(\)"),
    (torch.empty(0, 16), ValueError, r"inputs hold no samples \(shape \(0, 16\)\)"),
])
def test_empty_inputs_raise_before_training(inputs, error, match):
    with pytest.raises(error, match=match):
        ampkit.autotune(_model(), inputs, None)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every instance the same weights
        self.a, self.b = nn.Linear(16, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


def test_autotune_and_inspect_call_the_model_with_a_batch_by_one_rule():
    """autotune refused a dict batch that inspect took: a tuple is positional, a dict
    keywords, and a list one argument (a detection model's list of images). Any mapping is
    keywords: a UserDict (transformers' BatchEncoding) was passed as one argument."""
    import collections
    from ampkit.diagnose import inspect
    x, z, y = torch.randn(8, 16), torch.randn(8, 8), torch.randint(0, 4, (8,))
    results = [ampkit.autotune(_TwoInputs(), batch, y, steps=3, candidates=["32-true"])
               for batch in ((x, z), {"x": x, "z": z}, collections.UserDict(x=x, z=z))]
    assert [r.policy for r in results] == ["32-true"] * 3
    reports = [inspect(_TwoInputs(), batch, y, policy="bf16-mixed")
               for batch in ((x, z), {"z": z, "x": x}, collections.UserDict(z=z, x=x))]
    assert reports[0].ref_loss == reports[1].ref_loss == reports[2].ref_loss
    assert reports[0].policy_loss == reports[1].policy_loss == reports[2].policy_loss
    listed = inspect(_OneList(), [x, z], y, policy="bf16-mixed")  # one argument, not two
    assert listed.ref_loss == reports[0].ref_loss
    assert ampkit.autotune(_OneList(), [x, z], y, steps=3, candidates=["32-true"]).policy == "32-true"


def test_a_list_batch_for_a_model_of_two_arguments_says_to_pass_a_tuple():
    """A list was unpacked by autotune until the rule became one argument: such a call then
    failed with torch's bare 'missing 1 required positional argument'."""
    from ampkit.diagnose import inspect
    x, z, y = torch.randn(8, 16), torch.randn(8, 8), torch.randint(0, 4, (8,))
    hint = r"missing 1 required positional argument.*\(the batch is a list, which the model " \
           r"gets as one argument; valid: a tuple for positional arguments"
    with pytest.raises(TypeError, match=hint):
        ampkit.autotune(_TwoInputs(), [x, z], y, steps=3, candidates=["32-true"])
    with pytest.raises(TypeError, match=hint):
        inspect(_TwoInputs(), [x, z], y)


class _OneList(_TwoInputs):
    def forward(self, xs: list) -> torch.Tensor:  # type: ignore[override]
        return super().forward(*xs)


# --- fp8, layer by layer -------------------------------------------------------------------
def _fp8_model() -> nn.Module:
    """Both Linears fp8-eligible (features multiples of 16)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _fake_timings(faster: set[str]):
    """time_fp8_layers' answer for _fp8_model(): fp8 twice as fast in ``faster``, half as fast elsewhere."""
    from ampkit.fp8.select import LayerTiming

    def fake(model, inputs, *, recipe):
        return [LayerTiming(name, 32, layer.in_features, layer.out_features,
                            bf16_ms=1.0, fp8_ms=0.5 if name in faster else 2.0)
                for name, layer in (("0", model[0]), ("2", model[2]))]
    return fake


class _SharedProj(nn.Module):
    """A Linear registered under two parents: as ``proj``, and inside ``blk``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 32)
        self.blk = nn.Sequential(self.proj, nn.ReLU())
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blk(x))


def test_an_fp8_layer_reached_under_two_names_is_converted_by_autotune_and_apply(monkeypatch):
    """ampkit's own filters chose layers by name: a Linear also reached as 'blk.0' was
    accepted as 'proj' and refused as 'blk.0', and convert_to_fp8 refused the split, so
    autotune and TuneResult.apply raised on a model the user gave no filter for."""
    from ampkit.fp8.select import LayerTiming
    from ampkit.tune import TuneResult

    def fake(model, inputs, *, recipe):
        return [LayerTiming(name, 32, 16, 32, bf16_ms=1.0, fp8_ms=0.5) for name in ("proj", "out")]
    monkeypatch.setattr("ampkit.tune.time_fp8_layers", fake)
    x = torch.randn(32, 16)
    result = ampkit.autotune(_SharedProj(), x, torch.randn(32, 16), candidates=["fp8"], steps=3)
    assert result.details[1]["fp8_modules"] == ["proj", "out"] and result.rows[1]["step_ms"]
    model = _SharedProj()
    TuneResult("fp8", [], 1.0, fp8_modules=["proj", "out"]).apply(model)
    assert type(model.proj).__name__ == "Float8Linear" and model.blk[0] is model.proj


def test_an_fp8_candidate_without_a_faster_layer_is_not_trained(monkeypatch):
    monkeypatch.setattr("ampkit.tune.time_fp8_layers", _fake_timings(set()))
    x, y = _batch()
    result = ampkit.autotune(_fp8_model(), x, y, candidates=["fp8"], steps=4)
    row, detail = result.rows[1], result.details[1]
    assert row["policy"] == detail["policy"] == "fp8" and row["step_ms"] is None
    assert detail["timed_steps"] == 0
    assert not row["accepted"] and "no layer ran faster in fp8" in row["reason"]
    assert detail["fp8_modules"] == [] and [t["name"] for t in detail["fp8_layers"]] == ["0", "2"]
    assert result.policy == "32-true" and result.fp8_modules == []


def test_an_fp8_candidate_converts_only_the_layers_measured_faster(monkeypatch):
    monkeypatch.setattr("ampkit.tune.time_fp8_layers", _fake_timings({"2"}))
    converted = []
    real = ampkit.tune.convert_to_fp8

    def spy(model, **kwargs):
        out = real(model, **kwargs)
        converted.append([n for n, m in out.named_modules() if type(m).__name__ == "Float8Linear"])
        return out
    monkeypatch.setattr("ampkit.tune.convert_to_fp8", spy)
    x, y = _batch()
    result = ampkit.autotune(_fp8_model(), x, y, candidates=["fp8-delayed"], steps=4)
    row, detail = result.rows[1], result.details[1]
    assert converted == [["2"]]
    assert detail["fp8_modules"] == ["2"] and detail["timed_steps"] == 2 and row["step_ms"] > 0
    assert row["max_loss_dev"] is not None and row["max_loss_dev"] < 0.05  # emulated fp8 trains
    # whatever the machine measured, the rule holds: fp8 only when faster than fp32
    assert (result.policy == "fp8-delayed") == row["accepted"]
    assert result.fp8_modules == (["2"] if row["accepted"] else [])


def test_apply_of_an_fp8_choice_converts_exactly_its_modules():
    from ampkit.fp8 import Float8Linear
    from ampkit.tune import TuneResult

    model = _fp8_model()
    opt = torch.optim.AdamW(model.parameters())
    TuneResult("fp8", rows=[], speedup=1.3, fp8_modules=["2"]).apply(model, opt)
    assert type(model[0]) is nn.Linear and isinstance(model[2], Float8Linear)
    assert model[2].config.recipe.value == "tensorwise"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16-mixed around it


def test_an_fp8_choice_for_a_model_that_is_one_linear_converts_it(monkeypatch):
    """convert_to_fp8 returns a bare Linear converted (it cannot swap the model inside
    itself): autotune trained, and apply returned, the plain Linear while reporting it fp8."""
    from ampkit.fp8 import Float8Linear
    from ampkit.tune import TuneResult

    from ampkit.fp8.select import LayerTiming

    monkeypatch.setattr("ampkit.tune.time_fp8_layers", lambda model, inputs, *, recipe: [
        LayerTiming("", 16, 32, 32, bf16_ms=1.0, fp8_ms=0.5)])
    trained = []
    real = ampkit.tune.convert_to_fp8

    def spy(model, **kwargs):
        out = real(model, **kwargs)
        trained.append(type(out).__name__)
        return out
    monkeypatch.setattr("ampkit.tune.convert_to_fp8", spy)
    torch.manual_seed(0)
    result = ampkit.autotune(nn.Linear(32, 32), torch.randn(16, 32), torch.randn(16, 32),
                             candidates=["fp8"], steps=3)
    assert result.details[1]["fp8_modules"] == [""] and trained == ["Float8Linear"]
    model = nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    converted, same = TuneResult("fp8", rows=[], speedup=1.3, fp8_modules=[""]).apply(model, opt)
    assert isinstance(converted, Float8Linear) and same is opt
    assert converted.weight is model.weight and opt.param_groups[0]["params"][0] is model.weight


def test_choose_skips_rows_that_were_not_trained():
    rows = [{"policy": "32-true", "step_ms": 2.0, "max_loss_dev": 0.0},
            {"policy": "fp8", "step_ms": None, "max_loss_dev": None, "reason": "no layer"},
            {"policy": "bf16-mixed", "step_ms": 1.0, "max_loss_dev": 0.001}]
    assert choose(rows, 0.02) == ("bf16-mixed", 2.0)
    assert rows[1]["accepted"] is False and rows[1]["reason"] == "no layer"


def test_unknown_candidates_name_the_fp8_ones_too():
    x, y = _batch()
    with pytest.raises(ValueError, match="fp8-tensorwise"):
        ampkit.autotune(_model(), x, y, candidates=["fp9"], steps=4)


# --- names, devices and the default loss -------------------------------------------------------
def test_a_single_name_is_one_candidate():
    x, y = _batch()
    result = ampkit.autotune(_model(), x, y, candidates="bf16-mixed", steps=3)
    assert [r["policy"] for r in result.rows] == ["32-true", "bf16-mixed"]


def test_names_of_the_same_policy_are_measured_once_under_the_first_spelling():
    from ampkit.tune import distinct_candidates

    assert distinct_candidates(["32-true", "fp32", "O0", "bf16-mixed", "p=f32,c=bf16,o=f32",
                                "16-mixed", "fp16-mixed", "fp8", "fp8-tensorwise",
                                "fp8-delayed"]) == ["32-true", "bf16-mixed", "16-mixed", "fp8",
                                                    "fp8-delayed"]
    x, y = _batch()
    result = ampkit.autotune(_model(), x, y, candidates=["32-true", "fp32", "bf16-mixed",
                                                         "O2-bf16", " O2-bf16"], steps=3)
    assert [r["policy"] for r in result.rows] == ["32-true", "bf16-mixed", "O2-bf16"]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(device="bogus"), ValueError, r"unknown device 'bogus'; valid: cpu"),
    (dict(device=7), TypeError, r"device must be a device name .* 7; valid: cpu"),
    (dict(candidates=["fp8-"]), ValueError,
     r"unknown candidate 'fp8-'.*fp8, fp8-tensorwise, fp8-delayed, fp8-rowwise"),
    (dict(candidates=3), TypeError,
     r"candidates must be a policy name or a list of them, got int 3"),
])
def test_bad_devices_and_names_raise_before_anything_runs(monkeypatch, kwargs, error, match):
    def no_run(*args, **kw):
        raise AssertionError("a candidate was set up")
    monkeypatch.setattr("ampkit.tune._Run", no_run)
    monkeypatch.setattr("ampkit.tune.native_candidates", no_run)  # the device's defaults too
    x, y = _batch()
    with pytest.raises(error, match=match):
        ampkit.autotune(_model(), x, y, steps=3, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_naming_the_valid_devices(monkeypatch):
    monkeypatch.setattr("ampkit.tune._Run", None)  # nothing may be set up
    x, y = _batch()
    with pytest.raises(ValueError, match=r"device 'cuda' is not available here .*valid: cpu$"):
        ampkit.autotune(_model(), x, y, steps=3, device="cuda")
    with pytest.raises(ValueError, match=r"device 'cuda:1' is not available here"):
        ampkit.autotune(_model(), x, y, steps=3, device=torch.device("cuda:1"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_the_default_loss_takes_integer_targets_of_any_width(dtype):
    from ampkit._loss import default_loss

    out, y = torch.randn(6, 4), torch.tensor([0, 3, 1, 2, 2, 0])
    assert torch.equal(default_loss(out, y.to(dtype)), default_loss(out, y))
    x, _ = _batch()
    result = ampkit.autotune(_model(), x, torch.randint(0, 4, (32,), dtype=dtype),
                             candidates=["bf16-mixed"], steps=3)
    assert result.rows[0]["max_loss_dev"] == 0.0


def test_rows_carry_exactly_the_contract_keys_and_details_the_rest():
    """Rows carried timed_ms/timed_steps (and fp8 timings) beside the contract's six keys."""
    x, y = _batch()
    result = ampkit.autotune(_fp8_model(), x, y, candidates=["bf16-mixed"], steps=3)
    assert [list(row) for row in result.rows] == [list(ampkit.tune.ROW_KEYS)] * 2
    assert [d["policy"] for d in result.details] == [r["policy"] for r in result.rows]
    assert all(d["timed_steps"] == 1 and d["timed_ms"] > 0 for d in result.details)
    assert result.to_dict()["details"] == result.details


def test_an_o_level_without_suffix_runs_in_the_devices_half_dtype():
    """autotune read "O2" as fp16 on a CPU (get_policy's apex default) where bench, train
    and doctor read it as the device's half dtype, bf16."""
    x, y = _batch()
    result = ampkit.autotune(_fp8_model(), x, y, candidates=["O2", "O2-bf16"], steps=3)
    assert [r["policy"] for r in result.rows] == ["32-true", "O2-bf16"]


def test_every_candidate_steps_with_the_same_dropout_masks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    x, y = _batch()
    # fp32 with a static power-of-two loss scale: the same numbers as fp32 exactly, so
    # any gap between the loss curves would be the dropout masks'.
    result = ampkit.autotune(model, x, y, candidates=["p=f32,c=f32,o=f32,scale=1024"],
                             steps=4)
    assert [r["policy"] for r in result.rows] == ["32-true", "p=f32,c=f32,o=f32,scale=1024"]
    assert result.rows[1]["max_loss_dev"] == 0.0


# --- what autotune refuses before anything runs ----------------------------------------------
def _no_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a candidate was set up")
    monkeypatch.setattr(ampkit.tune, "_Run", refuse)
    monkeypatch.setattr(ampkit.tune, "_fp8_layers", refuse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_model_is_refused_since_its_reference_would_not_be_fp32(monkeypatch, dtype):
    _no_runs(monkeypatch)
    model = _model().to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _batch()
    with pytest.raises(ValueError, match=rf"^parameter '0.weight' is {dtype}; the reference pass "
                       r"must be fp32; valid: the fp32 model, before ampkit.initialize"):
        ampkit.autotune(model, x.to(dtype), y, candidates=["bf16-mixed"])
    after = model.state_dict()
    assert all(after[k].dtype == dtype and torch.equal(after[k], v) for k, v in before.items())


def test_a_model_with_fp8_layers_is_refused(monkeypatch):
    _no_runs(monkeypatch)
    model = ampkit.fp8.convert_to_fp8(_fp8_model())
    with pytest.raises(ValueError, match=r"^module '0' is already a Float8Linear; valid: the fp32"):
        ampkit.autotune(model, torch.randn(4, 16), candidates=["bf16-mixed"])


@pytest.mark.parametrize("model, target, error, match", [
    (nn.ReLU(), None, ValueError,
     r"^the model \(ReLU\) has no parameters, .*; valid: a model with at least one parameter "
     r"that requires grad$"),
    (nn.Linear(16, 4).requires_grad_(False), None, ValueError,
     r"^no parameter of the model requires grad \(all 2 frozen, e.g. 'weight'\), .*; valid: "),
    (nn.Linear(16, 4), [0, 1, 1], TypeError,
     r"^the default loss takes a tensor target .* got list \[0, 1, 1\]; valid: a torch.Tensor, "
     r"or pass loss_fn"),
])
def test_models_it_cannot_train_and_targets_it_cannot_read_are_refused_up_front(
        monkeypatch, model, target, error, match):
    _no_runs(monkeypatch)
    with pytest.raises(error, match=match):
        ampkit.autotune(model, torch.randn(3, 16), target, candidates=["bf16-mixed"])


def test_a_list_target_reaches_a_users_loss_fn():
    seen = []

    def loss_fn(output, target):
        seen.append(target)
        return output.float().mean()
    ampkit.autotune(nn.Linear(16, 4), torch.randn(3, 16), [0, 1, 1], loss_fn=loss_fn, steps=3,
                    candidates=["bf16-mixed"])
    assert type(seen[0]) is list and seen[0] == [0, 1, 1]  # as given: the move keeps lists


# --- TuneResult.apply: initialize's seam ------------------------------------------------------
def _apex_loop(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list, list, dict]:
    """Three apex-style steps, the second one's loss 1e4 times larger (fp16 grads overflow)."""
    x, y = _batch()
    losses, scales = [], []
    for step in range(3):
        loss = nn.functional.cross_entropy(model(x).float(), y) * (1e4 if step == 1 else 1.0)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        scales.append(ampkit.state_dict()["loss_scaler0"]["loss_scale"])
    return losses, scales, {k: v.clone() for k, v in model.state_dict().items()}


def _initialized_earlier() -> None:
    """Another model's O3 fp16 initialize, earlier in the process: its state must not linger."""
    other = nn.Linear(4, 4)
    ampkit.initialize(other, torch.optim.SGD(other.parameters(), 0.1), opt_level="O3",
                      half_dtype=torch.float16, verbosity=0)


@pytest.mark.parametrize("policy, fp8_modules, kwargs, scales", [
    ("O2-fp16", [], dict(opt_level="O2", half_dtype=torch.float16), [65536.0, 32768.0, 32768.0]),
    ("16-mixed", [], dict(opt_level="O1", half_dtype=torch.float16), [65536.0, 32768.0, 32768.0]),
    ("bf16-mixed", [], dict(opt_level="O1", half_dtype=BF16, loss_scale=1.0), [1.0, 1.0, 1.0]),
    ("fp8", ["0"], dict(opt_level="O1", half_dtype=BF16, loss_scale=1.0), [1.0, 1.0, 1.0]),
])
def test_apply_trains_the_apex_loop_bitwise_as_initialize_does(policy, fp8_modules, kwargs, scales):
    from ampkit.tune import TuneResult

    _initialized_earlier()
    model = _fp8_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    TuneResult(policy, [], 1.0, fp8_modules=fp8_modules).apply(model, opt)
    applied = _apex_loop(model, opt)

    _initialized_earlier()
    reference = _fp8_model()
    if fp8_modules:
        ampkit.fp8.convert_to_fp8(reference, module_filter=lambda _, fqn: fqn in fp8_modules)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ampkit.initialize(reference, ref_opt, verbosity=0, **kwargs)
    expected = _apex_loop(reference, ref_opt)

    assert applied[1] == expected[1] == scales  # a skipped step for fp16: the scale halved
    assert all(torch.equal(a, b) for a, b in zip(applied[0], expected[0]))
    assert applied[2].keys() == expected[2].keys()
    assert all(torch.equal(applied[2][k], expected[2][k]) for k in expected[2])
    assert [type(m) for m in model] == [type(m) for m in reference]


def test_apply_checks_the_optimizer_before_converting_any_layer():
    from ampkit.tune import TuneResult

    taken = nn.Linear(16, 16)
    taken_opt = torch.optim.SGD(taken.parameters(), 0.1)
    ampkit.initialize(taken, taken_opt, opt_level="O1", verbosity=0)
    model = _fp8_model()
    with pytest.raises(RuntimeError, match=r"already passed through ampkit.initialize"):
        TuneResult("fp8", [], 1.0, fp8_modules=["0"]).apply(model, taken_opt)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


def test_apply_refuses_fp8_modules_the_model_lacks_before_changing_anything():
    from ampkit import _state
    from ampkit.tune import TuneResult

    model = _fp8_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^fp8_modules \['nope'\] name no fp8-eligible Linear "
                       r"of the model outside its kept fp32 modules; valid: '0', '2'$"):
        TuneResult("fp8", [], 1.0, fp8_modules=["0", "nope"]).apply(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert _state.get_active() is None


@pytest.mark.parametrize("own_selection", [False, True])
def test_apply_refuses_an_fp8_module_it_also_keeps_in_fp32(own_selection):
    """A layer both in keep_fp32 and in fp8_modules was converted, then kept: it went on
    computing in fp8 behind fp32 outputs (the keep check ran before the conversion)."""
    from ampkit.tune import TuneResult

    model = _fp8_model()
    if own_selection:  # the model's own earlier keep_fp32 selection
        ampkit.keep_fp32(model, ["2"])
    result = TuneResult("fp8", [], 1.0, keep_fp32=[] if own_selection else ["2"],
                        fp8_modules=["0", "2"])
    with pytest.raises(ValueError, match=r"^fp8_modules \['2'\] name no fp8-eligible Linear of "
                       r"the model outside its kept fp32 modules \('2' is kept in fp32, in '2'\); "
                       r"valid: '0'$"):
        result.apply(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


def test_apply_refuses_what_is_not_a_module_naming_it():
    from ampkit.tune import TuneResult

    with pytest.raises(TypeError, match=r"^TuneResult.apply takes the torch.nn.Module autotune "
                                        r"measured, got dict \{\}$"):
        TuneResult("32-true", [], 1.0).apply({})


@pytest.mark.parametrize("threads, expected", [(None, 1), (2, 2)])
def test_autotune_measures_with_the_threads_bench_chooses(threads, expected):
    """autotune ran on torch's default threads: on a busy machine OpenMP threads waiting
    for each other made fp32 look 8x slower than bf16, and the fake speed-up was chosen.
    A small model now runs on 1 thread, as ampkit bench and tune run it; restored after."""
    seen = []

    def loss_fn(output, target):
        seen.append(torch.get_num_threads())
        return nn.functional.cross_entropy(output, target)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _model()
        x, y = _batch()
        ampkit.autotune(model, x, y, steps=3, candidates=["bf16-mixed"], loss_fn=loss_fn,
                        threads=threads)
        assert set(seen) == {expected} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads, error", [(0, ValueError), (1.5, TypeError), (True, TypeError),
                                            (100_000, ValueError)])
def test_bad_threads_are_refused_before_training(threads, error):
    """(More threads than the CPU has logical cores crashed torch at 100000.)"""
    with pytest.raises(error, match=r"threads must be an int in \[1, \d+\]"):
        ampkit.autotune(_model(), *_batch(), threads=threads)


def test_the_batch_moves_to_the_device_with_its_structure():
    """autotune's move to the device made every list and namedtuple a plain tuple (a list is
    one argument to the model, a tuple several) and left dataclass instances where they were."""
    import collections
    import dataclasses
    from ampkit.tune import _to_device

    Pair = collections.namedtuple("Pair", "a b")
    Holder = dataclasses.make_dataclass("Holder", [("x", torch.Tensor)])
    batch = ([torch.ones(1)], Pair(torch.ones(1), 2), Holder(torch.ones(1)), {"k": torch.ones(1)})
    moved = _to_device(batch, "meta")
    assert [type(v) for v in moved] == [list, Pair, Holder, dict] and moved[1].b == 2
    assert {t.device.type for t in (moved[0][0], moved[1].a, moved[2].x, moved[3]["k"])} == {"meta"}


class _Inverse(nn.Module):
    """torch.linalg.inv has no bf16 kernel on the CPU: trains in fp32 and under bf16-mixed
    (autocast runs it in fp32), fails under O2-bf16 (its input is bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.fc(x).reshape(-1, 4, 4) + 4 * torch.eye(4, dtype=x.dtype if x.is_floating_point() else None)
        return torch.linalg.inv(m).flatten(1)


def test_a_candidate_that_cannot_run_is_rejected_with_its_error_not_a_crash():
    """One failing candidate (no bf16 kernel) raised out of autotune; bench left it out."""
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    result = ampkit.autotune(_Inverse(), x, torch.randn(8, 16), candidates=["O2-bf16"], steps=3)
    row = next(r for r in result.rows if r["policy"] == "O2-bf16")
    assert row["accepted"] is False and row["step_ms"] is None
    assert row["reason"].startswith("failed: RuntimeError:") and "inv" in row["reason"]
    assert result.policy == "32-true"


def test_inside_the_callers_autocast_the_candidates_train_as_outside():
    """The caller's region kept autocast's cast cache across steps: bf16-mixed trained on
    stale half weights (a constant loss), and fp32's backward ran under the region."""
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    torch.manual_seed(0)
    outside = ampkit.autotune(_model(), x, y, candidates=["bf16-mixed"], steps=4, max_loss_dev=1.0)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        inside = ampkit.autotune(_model(), x, y, candidates=["bf16-mixed"], steps=4,
                                 max_loss_dev=1.0)
        assert torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled()  # left as it was
    assert [r["max_loss_dev"] for r in inside.rows] == [r["max_loss_dev"] for r in outside.rows]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"optimizer": lambda params: None}, TypeError, r"optimizer returned NoneType None; valid: "
                                                    r"a callable params -> torch.optim.Optimizer"),
    ({"loss_fn": lambda out, y: 1.5}, TypeError, r"loss_fn returned float 1.5; valid: a "
                                                 r"one-element tensor"),
    ({"loss_fn": lambda out, y: out}, TypeError, r"loss_fn returned Tensor \(16, 4\)"),
])
def test_a_bad_optimizer_factory_or_loss_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        ampkit.autotune(_model(), torch.randn(16, 16), torch.randint(0, 4, (16,)), steps=3,
                        candidates=["bf16-mixed"], **kwargs)


def test_a_policy_object_and_a_torch_device_are_taken_by_their_names():
    result = ampkit.autotune(_model(), torch.randn(16, 16), torch.randint(0, 4, (16,)), steps=3,
                             candidates=[ampkit.get_policy("bf16-mixed")],
                             device=torch.device("cpu"))
    assert [r["policy"] for r in result.rows] == ["32-true", "bf16-mixed"]
    import json
    json.dumps(result.to_dict())


def test_autotune_under_inference_mode_is_refused():
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside torch.inference_mode"):
        ampkit.autotune(_model(), torch.randn(16, 16), torch.randint(0, 4, (16,)), steps=3)


def test_a_model_changing_its_input_in_place_trains_every_candidate_on_the_same_batch():
    """The one batch tensor was reused: x.mul_(1.5) left the caller's x scaled 11x after
    three candidates of three steps, and each candidate saw another batch."""
    class Scales(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(x.mul_(1.5))

    torch.manual_seed(0)
    x = torch.randn(16, 16)
    before = x.clone()
    result = ampkit.autotune(Scales(), x, torch.randint(0, 4, (16,)), steps=3,
                             candidates=["bf16-mixed"], max_loss_dev=1.0)
    assert torch.equal(x, before)
    # bf16-mixed saw fp32's batches: only its rounding separates the loss curves
    assert result.rows[0]["max_loss_dev"] == 0.0 and result.rows[1]["max_loss_dev"] < 0.05


def test_max_loss_dev_is_one_rule_for_the_api_and_the_cli(capsys):
    """The API took inf (which the CLI refused) and refused numpy's float32."""
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"max_loss_dev must be a number >= 0 \(finite\), got inf"):
        ampkit.autotune(_model(), *_batch(), max_loss_dev=float("inf"), steps=3)
    result = ampkit.autotune(_model(), *_batch(), max_loss_dev=np.float32(0.5), steps=3,
                             candidates=["bf16-mixed"])
    assert result.rows[0]["policy"] == "32-true"
    from ampkit.cli import main

    assert main(["tune", "--model", "mlp", "--steps", "3", "--max-loss-dev", "inf"]) == 2
    assert "--max-loss-dev must be a number >= 0 (finite), got inf" in capsys.readouterr().err


def _pruned() -> nn.Module:
    from torch.nn.utils import prune
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    prune.l1_unstructured(model[0], "weight", amount=0.5)  # weight = weight_orig * mask
    return model


def test_a_pruned_model_is_tuned_and_inspected_on_a_copy_that_keeps_its_mask():
    """copy.deepcopy refused the pruned layer's computed weight (a non-leaf tensor): autotune
    crashed with torch's deepcopy error, inspect refused the model."""
    from ampkit.diagnose import inspect
    model = _pruned()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    result = ampkit.autotune(model, x, y, steps=3, candidates=["32-true", "bf16-mixed"])
    assert [row["policy"] for row in result.rows] == ["32-true", "bf16-mixed"]
    assert all(math.isfinite(row["step_ms"]) for row in result.rows)
    report = inspect(model, x, y, policy="32-true")
    assert report.ref_loss == report.policy_loss
    ref = nn.functional.mse_loss(model(x), y)  # the pruned model's own loss: the mask held
    assert report.ref_loss == ref.item()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_unmaterialized_lazy_model_is_refused_saying_to_run_a_forward_first():
    """autotune failed in torch's numel() with "Attempted to use an uninitialized
    parameter"; inspect failed elsewhere."""
    from ampkit.diagnose import inspect
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    for call in (lambda: ampkit.autotune(lazy, x, y, steps=3, candidates=["32-true"]),
                 lambda: inspect(lazy, x, y, policy="bf16-mixed")):
        with pytest.raises(ValueError, match=r"parameter '0.weight' is not materialized.*"
                                             r"one forward"):
            call()
    lazy(x)  # materialized: taken
    assert ampkit.autotune(lazy, x, y, steps=3, candidates=["32-true"]).policy == "32-true"
