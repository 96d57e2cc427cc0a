"""ampkit.diagnose: inspect (per-module numerics against fp32), watch (non-finite locator).

Each model is built so the expected numbers are exact: a layer whose every output is
1.2e5 overflows fp16 (max 65504) and not bf16; one whose every output is 4e-9 flushes
to zero in fp16 (smallest subnormal 6e-8) and not in bf16.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

import ampkit
from ampkit._torch_compat import TorchDispatchMode
from ampkit.diagnose import ModuleStats, NonFiniteError, Report, inspect, watch
from ampkit.diagnose.advice import Context, advise


class Scale(nn.Module):
    """Multiplies by a constant (a leaf without parameters)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def constant_linear(n_in: int, n_out: int, value: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    nn.init.constant_(layer.weight, value)
    return layer


def overflow_model() -> nn.Sequential:
    """'0' outputs 4 * 3e4 = 1.2e5 everywhere (inf in fp16); '1' scales it back down."""
    return nn.Sequential(constant_linear(4, 8, 3e4), Scale(1e-5), nn.Linear(8, 2)).train()


def underflow_model() -> nn.Sequential:
    """'0' outputs 4 * 1e-9 everywhere (0 in fp16); the loss is the mean output."""
    return nn.Sequential(constant_linear(4, 8, 1e-9), nn.Tanh())


def stats(report: Report, name: str) -> ModuleStats:
    return next(m for m in report.modules if m.name == name)


X = torch.ones(3, 4)


# --- inspect: numbers ---------------------------------------------------------------------
def test_fp16_overflow_is_found_in_the_layer_that_overflows_and_not_in_bf16():
    fp16 = inspect(overflow_model(), X, policy="16-mixed")
    assert stats(fp16, "0").overflow == 1.0 and stats(fp16, "0").underflow == 0.0
    assert stats(fp16, "0").out_dtype == torch.float16 and stats(fp16, "0").nonfinite
    assert stats(fp16, "0").out_sqnr_db == -math.inf
    assert fp16.first_nonfinite == ("forward", "0")
    assert math.isfinite(fp16.ref_loss) and not math.isfinite(fp16.policy_loss)
    assert any("keep_fp32(model, ['0'])" in s and "'bf16-mixed'" in s for s in fp16.advice)
    bf16 = inspect(overflow_model(), X, policy="bf16-mixed")
    assert stats(bf16, "0").overflow == 0.0 and stats(bf16, "0").underflow == 0.0
    assert bf16.first_nonfinite is None and not any(m.nonfinite for m in bf16.modules)
    assert stats(bf16, "0").out_sqnr_db > 40


def test_fp16_underflow_is_found_and_bf16_keeps_the_values():
    fp16 = inspect(underflow_model(), X, policy="16-mixed")
    tiny = stats(fp16, "0")
    assert tiny.underflow == 1.0 and tiny.overflow == 0.0
    assert tiny.out_sqnr_db == 0.0  # every output became 0: the error is the whole signal
    assert fp16.first_nonfinite is None
    assert any("'0'" in s and "flush to zero" in s for s in fp16.advice)
    bf16 = inspect(underflow_model(), X, policy="bf16-mixed")
    assert stats(bf16, "0").underflow == 0.0 and stats(bf16, "0").out_sqnr_db > 40


def test_gradient_overflow_at_the_initial_loss_scale_advises_a_lower_init_scale():
    model = nn.Sequential(nn.Linear(4, 1))
    # d mean(out) / d weight = 100 (and 1 for the bias): times 2**16 both overflow fp16.
    report = inspect(model, torch.full((2, 4), 100.0), policy="16-mixed")
    layer = stats(report, "0")
    assert report.loss_scale == 2.0**16
    assert layer.grad_overflow == 1.0 and layer.grad_underflow == 0.0
    assert report.first_nonfinite == ("backward", "0")
    assert any("init_scale=512" in s for s in report.advice)  # 65504 / 100 -> 2**9


def test_a_gradient_beyond_fp16_even_unscaled_gets_fp32_or_bf16_advice_not_a_scale():
    model = nn.Sequential(constant_linear(4, 1, 0.0))
    # d mse / d weight = 2 * (0 - 1000) * 300 = -6e5: above 65504 at any scale >= 1.
    report = inspect(model, torch.full((2, 4), 300.0), torch.full((2, 1), 1000.0),
                     policy="16-mixed")
    assert report.first_nonfinite == ("backward", "0")
    assert not any("init_scale=" in s for s in report.advice)
    assert any("keep_fp32(model, ['0'])" in s and "'bf16-mixed'" in s and "6e+05" in s
               for s in report.advice)


def test_every_lower_init_scale_sentence_gives_the_same_smallest_value():
    def row(name: str) -> ModuleStats:
        return ModuleStats(name, "Linear", torch.float16, 60.0, 0.0, 0.0, -math.inf, 0.0, 0.5,
                           True)

    # 65504 / 100 -> 512 for 'a'; 65504 / 50 -> 1024 for 'b': 512 keeps both finite.
    ctx = Context("16-mixed", torch.float16, 2.0**16, "dynamic", "bf16-mixed",
                  ("backward", "b"), True, grad_amax={"a": 100.0, "b": 50.0})
    advice = advise([row("b"), row("a")], ctx)
    assert len(advice) == 2 and all("GradScaler(init_scale=512)" in s for s in advice)


def test_gradient_underflow_without_loss_scaling_advises_dynamic_scaling():
    model = nn.Sequential(nn.Linear(4, 1))
    report = inspect(model, torch.full((2, 4), 1e-9), policy="16-true")
    assert report.loss_scale == 1.0
    assert stats(report, "0").grad_underflow == pytest.approx(0.8)  # the weight's 4 of 5
    assert any("dynamic loss scaling" in s and "'0'" in s for s in report.advice)


def test_pure_fp32_policy_is_identical_to_the_reference():
    # ReLU(inplace=True) overwrites '0''s output after its hook: the reference is a copy.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    report = inspect(model, torch.randn(3, 4), policy="O0")
    for m in report.modules:
        assert m.out_sqnr_db == math.inf and m.underflow == 0.0 and m.overflow == 0.0
    assert report.flops.keys() == {"float32"} and report.low_precision_share == 0.0
    assert report.ref_loss == report.policy_loss


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * math.inf


class InfGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x)


def backward_nonfinite_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), InfGrad(), nn.Linear(4, 2))


@pytest.mark.parametrize("policy", ["O0", "bf16-mixed"])
def test_a_backward_only_nonfinite_is_located_in_the_module_that_made_it(policy):
    report = inspect(backward_nonfinite_model(), X, policy=policy)
    assert report.first_nonfinite == ("backward", "1")
    assert stats(report, "1").nonfinite and not stats(report, "2").nonfinite
    assert stats(report, "0").nonfinite  # its weight gradient is inf downstream of it
    assert math.isfinite(report.policy_loss)


def test_kept_fp32_module_reports_fp32_output_and_fp32_flops():
    batch, n_in, hidden, n_out = 4, 8, 16, 2
    model = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))
    ampkit.keep_fp32(model, ["0"])
    report = inspect(model, torch.randn(batch, n_in), torch.tensor([0, 1, 1, 0]),
                     policy="bf16-mixed")
    kept = stats(report, "0")
    assert kept.out_dtype == torch.float32 and kept.out_sqnr_db == math.inf
    assert stats(report, "2").out_dtype == torch.bfloat16
    # kept: forward and weight gradient (x needs no gradient); head: forward, both grads.
    assert report.flops == {"float32": 2 * 2 * batch * n_in * hidden,
                            "bfloat16": 3 * 2 * batch * hidden * n_out}
    assert not any("keep_fp32(model, ['0'])" in s for s in report.advice)


def test_following_the_keep_fp32_advice_clears_the_overflow():
    model = ampkit.keep_fp32(overflow_model(), ["0"])
    report = inspect(model, X, policy="16-mixed")
    kept = stats(report, "0")
    assert kept.out_dtype == torch.float32 and kept.overflow == 0.0 and not kept.nonfinite
    assert report.first_nonfinite is None and math.isfinite(report.policy_loss)
    assert report.advice == ["No module overflows, underflows or falls below 20 dB SQNR under "
                             "16-mixed: keep the policy '16-mixed'."]


@pytest.mark.parametrize("weight, column", [(3e4, "overflow"), (1e-9, "underflow")])
def test_a_module_computing_in_fp32_after_a_kept_one_neither_overflows_nor_underflows(
        weight, column):
    # The ReLU after kept '0' gets its fp32 output and computes in fp32: nothing is cast.
    def model() -> nn.Sequential:
        return nn.Sequential(constant_linear(4, 8, weight), nn.ReLU(), Scale(1.0),
                             nn.Linear(8, 2))

    report = inspect(ampkit.keep_fp32(model(), ["0"]), X, policy="16-mixed")
    relu = stats(report, "1")
    assert relu.out_dtype == torch.float32 and getattr(relu, column) == 0.0
    assert not any("'1'" in s for s in report.advice)
    # Not kept: the ReLU's output is fp16 and is counted against fp16.
    report = inspect(model(), X, policy="16-mixed")
    assert stats(report, "1").out_dtype == torch.float16
    assert getattr(stats(report, "1"), column) == 1.0


def test_no_overflow_or_underflow_advice_for_an_output_that_is_not_half():
    def row(name: str, dtype: torch.dtype, under: float, over: float) -> ModuleStats:
        return ModuleStats(name, "Mystery", dtype, 60.0, under, over, None, None, None, False)

    ctx = Context("16-mixed", torch.float16, 2.0**16, "dynamic", "bf16-mixed", None, True)
    advice = advise([row("a", torch.float32, 0.5, 0.5), row("b", torch.float16, 0.0, 0.5),
                     row("c", torch.bfloat16, 0.5, 0.0)], ctx)
    assert not any("'a'" in s for s in advice)
    assert any("'b'" in s and "overflow float16" in s for s in advice)
    assert any("'c'" in s and "flush to zero in bfloat16" in s for s in advice)


def test_keep_fp32_advice_keeps_the_current_selection():
    # '0' kept and fine (outputs 4); '2' overflows (8 * 4 * 3e4 = 9.6e5): keep_fp32(model,
    # ['2']) alone would free '0'. (A random '0' let ReLU pass too little, by seed.)
    model = nn.Sequential(constant_linear(4, 8, 1.0), nn.ReLU(), constant_linear(8, 8, 3e4),
                          Scale(1e-5), nn.Linear(8, 2))
    report = inspect(ampkit.keep_fp32(model, ["0"]), X, policy="16-mixed")
    assert report.first_nonfinite == ("forward", "2")
    assert "ampkit.keep_fp32(model, ['0', '2'])" in report.advice[0]


def test_fp8_layers_report_sqnr_and_fp8_flops():
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    report = inspect(model, torch.randn(16, 32), policy="fp8-tensorwise")
    layer = stats(report, "0")
    assert layer.type == "Float8Linear" and 15 < layer.out_sqnr_db < 45
    assert report.flops.keys() == {"float8_e4m3fn", "float8_e5m2"}
    assert report.low_precision_share == 1.0
    assert type(model[0]) is nn.Linear  # the caller's model was not converted


def test_an_fp8_policy_without_an_fp8_layer_says_none_ran_in_fp8():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # not multiples of 16
    report = inspect(model, X, policy="fp8-tensorwise")
    assert report.flops.keys() == {"bfloat16"}
    assert len(report.advice) == 1 and "No layer ran in fp8" in report.advice[0]
    assert "'bf16-mixed'" in report.advice[0] and "keep the policy" not in report.advice[0]


class _Conv1D(nn.Module):
    """transformers' GPT-2 projection: a matmul that is not an nn.Linear."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_an_fp8_report_says_when_most_matmuls_did_not_run_in_fp8():
    """GPT-2 (Conv1D projections) under fp8 converted only its lm_head: 7% of the FLOPs
    ran in fp8, and the advice was "keep the policy 'fp8-tensorwise'"."""
    model = nn.Sequential(_Conv1D(32, 64), nn.ReLU(), _Conv1D(64, 64), nn.Linear(64, 16))
    report = inspect(model, torch.randn(8, 32), policy="fp8-tensorwise")
    share = sum(n for d, n in report.flops.items() if d.startswith("float8")) / sum(report.flops.values())
    assert 0 < share < 0.5
    assert report.advice == [f"Only {share:.0%} of the matmul and convolution FLOPs ran in fp8 "
                             "under fp8-tensorwise; the rest ran in bf16 or fp32, in modules "
                             "convert_to_fp8 does not take (it takes exactly nn.Linear with in "
                             "and out features multiples of 16; not, e.g., transformers' "
                             "Conv1D), in modules kept in fp32, or in attention and convolutions."]


def test_rowwise_fp8_counts_every_gemm_in_e4m3():
    model = nn.Sequential(nn.Linear(32, 32))
    report = inspect(model, torch.randn(16, 32), policy="fp8-rowwise")
    assert report.flops == {"float8_e4m3fn": 2 * 16 * 32 * 32 * 2}  # forward + weight grad


def test_default_policy_on_cpu_is_bf16_mixed_and_o_level_suffixes_work():
    assert inspect(underflow_model(), X).policy == "bf16-mixed"
    report = inspect(underflow_model(), X, policy="O2-bf16")
    assert stats(report, "0").out_dtype == torch.bfloat16 and report.half_dtype == torch.bfloat16


def test_modules_are_listed_in_execution_order_with_params_or_leaves():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(4, 4)
            self.a = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.b(self.a(x)) * self.gain

    report = inspect(Net(), X, policy="bf16-mixed")
    assert [m.name for m in report.modules] == ["a.0", "a.1", "b", ""]
    assert stats(report, "a.1").grad_sqnr_db is None and stats(report, "").grad_sqnr_db is not None


# --- inspect: the caller's model is left exactly as it was ----------------------------------
def snapshot(model: nn.Module) -> dict:
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "grads": {k: (v.grad, None if v.grad is None else v.grad.clone())
                      for k, v in model.named_parameters()},
            "modes": [m.training for m in model.modules()],
            "hooks": [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
                      for m in model.modules()],
            "param_hooks": [p._backward_hooks for p in model.parameters()],
            "rng": torch.get_rng_state()}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    for kind in ("params", "buffers"):
        assert before[kind].keys() == after[kind].keys()
        for key, value in before[kind].items():
            assert value.dtype == after[kind][key].dtype and torch.equal(value, after[kind][key]), key
    for key, (grad, value) in before["grads"].items():
        assert after["grads"][key][0] is grad, key
        assert grad is None or torch.equal(grad, value), key
    for kind in ("modes", "hooks", "param_hooks"):
        assert after[kind] == before[kind], kind
    assert torch.equal(after["rng"], before["rng"])


@pytest.mark.parametrize("policy", ["O2", "16-mixed", "fp8-delayed"])
def test_the_model_is_left_exactly_as_it_was(policy):
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.2),
                          nn.Linear(32, 16), nn.LayerNorm(16))
    model[4].eval()  # a mix of modes must come back as it was
    model(torch.randn(8, 16)).sum().backward()  # existing .grads
    model[0].register_forward_hook(lambda *a: None)
    model[3].register_forward_pre_hook(lambda *a: None)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    before = snapshot(model)
    inspect(model, x, y, policy=policy)
    assert_unchanged(model, before)


def test_batch_norm_statistics_in_training_mode_are_restored_bitwise():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).train()
    model[1].running_mean.normal_()
    before = [b.clone() for b in model[1].buffers()]
    report = inspect(model, torch.randn(6, 4), torch.tensor([0, 1] * 3), policy="bf16-mixed")
    assert [m.name for m in report.modules] == ["0", "1", "2"]
    for old, new in zip(before, model[1].buffers()):
        assert torch.equal(old, new)
    assert model[1].num_batches_tracked.item() == 0 and model.training


def test_dropout_masks_are_the_same_in_both_passes():
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(64, 64)).train()
    report = inspect(model, torch.randn(32, 64), policy="O0")
    assert stats(report, "0").out_sqnr_db == math.inf  # different masks would be ~0 dB


# --- inspect: output forms and bad input ----------------------------------------------------
def test_to_dict_is_json_with_the_field_names_and_str_is_a_table_worst_first():
    report = inspect(overflow_model(), X, policy="16-mixed")
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data["modules"][0]) == set(ModuleStats.__dataclass_fields__)
    assert data["first_nonfinite"] == ["forward", "0"] and data["modules"][0]["out_dtype"] == "float16"
    assert {"flops", "low_precision_share", "advice", "policy"} <= data.keys()
    lines = str(report).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("module"))
    assert "out SQNR dB" in lines[header] and lines[header + 1].split()[0] == "0"
    assert "Advice:" in lines


@pytest.mark.parametrize("kwargs, error, match", [
    ({"policy": "O9"}, ValueError, r"unknown policy 'O9'.*fp8-tensorwise"),
    ({"policy": "fp8-blockwise"}, ValueError, r"'blockwise'.*tensorwise"),
    ({"policy": 16}, TypeError, r"policy must be a name.*16"),
    ({"loss_fn": "mse"}, TypeError, r"loss_fn must be a callable.*'mse'"),
])
def test_bad_arguments_raise_naming_the_value_and_the_choices(kwargs, error, match):
    with pytest.raises(error, match=match):
        inspect(nn.Linear(4, 2), X, **kwargs)


def test_a_loss_with_many_elements_is_named_by_its_shape_not_printed():
    """The message printed the whole loss tensor (a batch's worth of numbers)."""
    with pytest.raises(ValueError) as info:
        inspect(nn.Linear(4, 2), X, loss_fn=lambda out, target: out * 1000.0)
    message = str(info.value)
    assert message.startswith("the loss must be a tensor with one element, got a tensor of "
                              f"shape {(X.shape[0], 2)}; valid: a scalar loss")
    assert "tensor(" not in message and "1000" not in message


@pytest.mark.parametrize("limit, error, match", [
    (-1, ValueError, r"limit must be an int >= 0, got -1"),
    ("x", TypeError, r"limit must be an int >= 0, got str 'x'"),
    (1.5, TypeError, r"limit must be an int >= 0, got float 1.5"),
])
def test_a_bad_table_limit_is_refused_naming_it(limit, error, match):
    """limit=-1 silently dropped the last module; "x" raised a bare slice TypeError."""
    report = inspect(overflow_model(), X, policy="16-mixed")
    with pytest.raises(error, match=match):
        report.table(limit=limit)
    with pytest.raises(error, match=match):
        report.worst(limit)
    assert len(report.worst(0)) == 0 and len(report.worst(1)) == 1


def test_a_half_or_initialized_model_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"'weight' is torch.float16.*fp32 model"):
        inspect(nn.Linear(4, 2).half(), X)
    model = ampkit.initialize(nn.Linear(4, 2), opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="ampkit.initialize"):
        inspect(model, X)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        inspect(lambda x: x, X)


# --- watch -------------------------------------------------------------------------------
def hook_counts(model: nn.Module) -> list[int]:
    return ([len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
            + [len(p._backward_hooks or {}) for p in model.parameters()])


def test_watch_finds_the_first_nonfinite_forward_and_backward_module():
    model = overflow_model().half()
    with watch(model) as w:
        model(X.half()).float().sum().backward()
    assert w.first_nonfinite == ("forward", "0")
    model = backward_nonfinite_model()
    with watch(model) as w:
        model(X).sum().backward()
    assert w.first_nonfinite == ("backward", "1")
    with watch(model) as w:
        model(X)
    assert w.first_nonfinite is None


@dataclasses.dataclass
class _Out:
    h: torch.Tensor


def test_watch_sees_a_nonfinite_tensor_inside_a_dataclass_output():
    """A dataclass output was not walked: its inf went unseen until a later module."""
    class Wrap(nn.Module):
        def forward(self, x):
            return _Out(x / 0)

    class Unwrap(nn.Module):
        def forward(self, out):
            return out.h

    model = nn.Sequential(Wrap(), Unwrap())
    with watch(model) as w:
        model(X)
    assert w.first_nonfinite == ("forward", "0")


def test_watch_blames_the_innermost_module_for_a_shared_input_gradient():
    class Block(nn.Module):  # its input is also its child's input
        def __init__(self) -> None:
            super().__init__()
            self.bad = InfGrad()

        def forward(self, x):
            return self.bad(x)

    model = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 2))
    with watch(model) as w:
        model(X).sum().backward()
    assert w.first_nonfinite == ("backward", "1.bad")


def test_watch_sees_an_in_place_change_of_a_child_output_in_its_parent():
    class Block(nn.Module):  # returns its child's output tensor, changed in place
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            out = self.fc(x)
            out.mul_(math.inf)
            return out

    model = nn.Sequential(Block(), nn.Linear(4, 2))
    with watch(model) as w:
        model(X)
    assert w.first_nonfinite == ("forward", "0")


def test_watch_raises_nonfinite_error_naming_module_and_phase_and_removes_hooks():
    model = backward_nonfinite_model()
    clean = hook_counts(model)
    x = X.clone().requires_grad_()
    with pytest.raises(NonFiniteError, match=r"'1' \(InfGrad\).*backward") as info:
        with watch(model, raise_on_nonfinite=True):
            model(x).sum().backward()
    assert (info.value.phase, info.value.name) == ("backward", "1")
    assert hook_counts(model) == clean and not x._backward_hooks


def test_watch_removes_hooks_when_the_block_raises_and_keeps_that_exception():
    model = overflow_model()
    clean = hook_counts(model)
    with pytest.raises(KeyError, match="from the body"):
        with watch(model, raise_on_nonfinite=True) as w:
            model(X * math.inf)
            assert hook_counts(model) != clean  # installed while open
            raise KeyError("from the body")
    assert hook_counts(model) == clean
    assert w.first_nonfinite == ("forward", "0")  # still recorded


def test_a_watch_object_is_reusable_and_each_block_starts_afresh():
    model = nn.Sequential(nn.Linear(4, 4))
    w = watch(model)
    with w:
        model(X * math.inf)
    with w:
        with pytest.raises(RuntimeError, match="already open"):
            w.__enter__()
        model(X)
    assert w.first_nonfinite is None


def test_watch_keeps_no_activation_alive():
    import weakref

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    outputs = []  # '0''s output: Tanh saves its own result, so autograd frees this one
    model[0].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    with watch(model) as w:
        loss = model(X).sum()
        assert outputs[0]() is None  # the check recorded for it holds no reference
        loss.backward()
    assert w.first_nonfinite is None


def test_watch_first_nonfinite_is_read_after_exit_and_bad_arguments_raise():
    model = nn.Linear(4, 2)
    with watch(model) as w:
        with pytest.raises(RuntimeError, match="exited"):
            w.first_nonfinite
    with pytest.raises(TypeError, match="torch.nn.Module"):
        watch("model")
    with pytest.raises(TypeError, match="raise_on_nonfinite.*'yes'"):
        watch(model, raise_on_nonfinite="yes")


class SyncCounter(TorchDispatchMode):
    """Counts the ops that read a device value back to the host."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._dynamo import (seconds) for an eager counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.SYNCS
        return func(*args, **(kwargs or {}))


def test_watch_syncs_with_the_host_once_per_block(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    listed = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: listed.append(1) or [])
    with SyncCounter() as counter:
        for _ in range(3):
            with watch(model) as w:
                model(torch.randn(5, 4)).sum().backward()
        body_only = counter.count
        with watch(model):
            model(torch.randn(5, 4)).sum().item()  # the body's own sync is seen too
    assert w.first_nonfinite is None
    assert body_only == 3 and counter.count == 5 and not listed


def test_watch_folds_long_blocks_and_still_finds_the_first_event():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with watch(model) as w:
        for _ in range(400):  # 1200 forward events: folded on the device twice
            model(X)
        model(X * math.nan)
    assert w.first_nonfinite == ("forward", "0")


def test_watch_keeps_the_same_memory_however_long_it_runs():
    """It kept two codes (8 bytes) and two flags per event until exit: 2 GB over a million
    steps of a 50-layer model, for a watch the docs say may stay on for a whole run."""
    import tracemalloc

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with watch(model) as w:
        for _ in range(200):
            model(X)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(4000):  # 12000 events, 24000 values: 96 KB of codes before
            model(X)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        model(X * math.nan)
        model[1](X * math.inf)
    assert w.first_nonfinite == ("forward", "0")
    assert w.nonfinite() == [("forward", "0"), ("forward", "1"), ("forward", "")]
    assert grown < 64_000, grown  # the 512 values waiting to be folded, 80 B each


# --- inside the caller's autocast region ------------------------------------------------------
def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def outer_regions():
    return [lambda: torch.autocast("cpu", dtype=torch.bfloat16),
            lambda: ampkit.autocast("cpu", dtype=torch.bfloat16)]


@pytest.mark.parametrize("region", outer_regions(), ids=["torch.autocast", "ampkit.autocast"])
@pytest.mark.parametrize("policy", ["32-true", "bf16-mixed", "16-mixed"])
def test_inspect_inside_a_callers_autocast_region_is_the_report_outside_it(region, policy):
    x = torch.randn(4, 8)
    outside = inspect(mlp(), x, policy=policy)
    with region():
        inside = inspect(mlp(), x, policy=policy)
        assert torch.is_autocast_enabled("cpu")  # the caller's region is back
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert inside.to_dict() == outside.to_dict()
    if policy == "32-true":  # the reference is fp32, not the caller's bf16
        assert [m.out_dtype for m in inside.modules] == [torch.float32] * 3
        assert inside.flops.keys() == {"float32"}
        assert all(m.out_sqnr_db == math.inf for m in inside.modules)
    if policy == "16-mixed":  # the policy's own region only
        assert [m.out_dtype for m in inside.modules] == [torch.float16] * 3


class ToHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()


@pytest.mark.parametrize("region", outer_regions(), ids=["torch.autocast", "ampkit.autocast"])
def test_watch_folds_fp16_flags_inside_a_bf16_region_with_one_sync(region):
    model = nn.Sequential(nn.Linear(4, 4), ToHalf())  # an fp16 output under bf16 autocast
    with region(), SyncCounter() as counter:
        with watch(model) as w:
            for _ in range(300):  # 600 events: a fold inside the block, one at exit
                model(X)
            model(X * math.nan).float().sum().backward()
    assert w.first_nonfinite == ("forward", "0") and counter.count == 1
    with region():
        with watch(model) as w:
            model(X).float().sum().backward()
    assert w.first_nonfinite is None


# --- models without trainable parameters ------------------------------------------------------
@pytest.mark.parametrize("model", [nn.Linear(3, 3).requires_grad_(False), nn.ReLU()],
                         ids=["frozen Linear", "ReLU"])
def test_a_model_without_trainable_parameters_gets_a_forward_only_report(model):
    x = torch.randn(2, 3)
    report = inspect(model, x, policy="bf16-mixed")
    (row,) = report.modules
    assert row.name == "" and row.out_sqnr_db is not None and row.underflow == 0.0
    assert (row.grad_sqnr_db, row.grad_underflow, row.grad_overflow) == (None, None, None)
    assert report.first_nonfinite is None and math.isfinite(report.policy_loss)
    linear = isinstance(model, nn.Linear)
    assert report.flops == ({"bfloat16": 2 * 2 * 3 * 3} if linear else {})  # forward only
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    nan = inspect(model, x * math.nan, policy="bf16-mixed")
    assert nan.first_nonfinite == ("forward", "")


# --- sparse gradients ---------------------------------------------------------------------------
class Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e = nn.Embedding(10, 4, sparse=sparse)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.e(ids))


IDS = torch.tensor([1, 2, 1, 7])


def test_watch_checks_a_sparse_gradient_inside_the_users_backward():
    model = Bag(sparse=True)
    with watch(model) as w:
        model(IDS).sum().backward()
    assert w.first_nonfinite is None and model.e.weight.grad.is_sparse  # the step went on
    model.zero_grad()
    with watch(model) as w:
        (model.e(IDS) * math.inf).sum().backward()  # only the embedding's gradient is inf
    assert w.first_nonfinite == ("backward", "e")


def test_inspect_compares_a_sparse_gradient_by_its_values():
    sparse = stats(inspect(Bag(sparse=True), IDS, policy="bf16-mixed"), "e")
    dense = stats(inspect(Bag(sparse=False), IDS, policy="bf16-mixed"), "e")
    # the same rows, the same numbers; the sparse one has no implicit zeros to count
    assert 20 < sparse.grad_sqnr_db < math.inf
    assert sparse.grad_sqnr_db == pytest.approx(dense.grad_sqnr_db, rel=1e-9)
    assert sparse.grad_underflow == dense.grad_underflow == 0.0
    assert sparse.grad_overflow == 0.0 and not sparse.nonfinite
    # d sum / d row = how often the batch takes it (1 or 2); times 2**16 > 65504: all of
    # the 3 rows' stored values overflow, and none of the 7 rows the batch did not touch.
    def overflow(sparse: bool) -> float:
        table = nn.Sequential(nn.Embedding(10, 4, sparse=sparse))
        report = inspect(table, IDS, policy="16-mixed", loss_fn=lambda out, _: out.sum())
        return stats(report, "0").grad_overflow

    assert overflow(sparse=True) == 1.0 and overflow(sparse=False) == 0.3


# --- the caller's inputs are only read; the default loss; fp8 names -----------------------------
def test_inputs_and_target_that_require_grad_get_no_grad():
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 2, requires_grad=True)
    report = inspect(mlp(), x, y, policy="16-mixed")
    assert x.grad is None and y.grad is None
    assert report.to_dict() == inspect(mlp(), x.detach(), y.detach(), policy="16-mixed").to_dict()
    pair = (torch.randn(4, 8, requires_grad=True),)
    inspect(mlp(), pair, policy="bf16-mixed")
    assert pair[0].grad is None


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_an_integer_target_of_any_width_is_class_indices(dtype):
    x, y = torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0])
    model = nn.Linear(4, 3)
    assert inspect(model, x, y.to(dtype), policy="32-true").ref_loss == \
        inspect(model, x, y, policy="32-true").ref_loss


def test_fp8_dash_without_a_recipe_is_refused():
    with pytest.raises(ValueError, match=r"'fp8-'.*fp8-tensorwise, fp8-delayed, fp8-rowwise"):
        inspect(nn.Linear(4, 2), X, policy="fp8-")
    assert inspect(nn.Linear(16, 16), torch.randn(16, 16), policy=" fp8 ").policy == "fp8"


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


def test_a_dataclass_input_that_requires_grad_gets_no_grad():
    """inspect detached tensors in tuples, lists and dicts only: a dataclass batch's tensor
    got the backward's .grad."""
    class Unwrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, batch: _Batch) -> torch.Tensor:
            return self.lin(batch.x)

    batch = _Batch(torch.randn(4, 8, requires_grad=True))
    inspect(Unwrap(), batch, policy="bf16-mixed")
    assert batch.x.grad is None


# --- compiled models -------------------------------------------------------------------------
def _overflowing_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(3e5)  # layer 0's outputs overflow fp16 (> 65504)
    return model


def _compiled_after_a_step(model, x, y):
    compiled = torch.compile(model, backend="aot_eager")
    (compiled(x) - y).pow(2).mean().backward()  # compiled before any ampkit hook exists
    model.zero_grad(set_to_none=True)
    return compiled


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch 2.6+: set_stance")
def test_inspect_of_a_compiled_model_reports_its_modules_as_for_the_model_itself():
    """Compiled code skipped the hooks inspect adds (dynamo does not recompile for them):
    the report had no modules and advised keeping a policy that overflows."""
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    model = _overflowing_mlp()
    eager = inspect(model, x, y, policy="16-mixed")
    compiled = _compiled_after_a_step(model, x, y)
    report = inspect(compiled, x, y, policy="16-mixed")
    assert [m.name for m in report.modules] == [m.name for m in eager.modules] == ["0", "1", "2"]
    assert report.first_nonfinite == eager.first_nonfinite == ("forward", "0")
    assert json.dumps(report.to_dict()) == json.dumps(eager.to_dict())  # NaN losses: by text
    assert torch.compiler.is_compiling() is False and model[0].weight.grad is None


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch 2.6+: set_stance")
@pytest.mark.parametrize("watched", ["model", "compiled"])
def test_watch_on_a_compiled_model_finds_the_first_nonfinite_module(watched):
    """It named the wrong phase (watching the model) or the whole model ('', watching the
    compiled one): the compiled code ran without its hooks."""
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = _compiled_after_a_step(model, x, y)
    with watch(model if watched == "model" else compiled) as w:
        compiled(x * float("inf")).sum().backward()
    assert w.first_nonfinite == ("forward", "0")
    compiled(x).sum().backward()  # compiled again outside the block: no recompile needed


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch 2.6+: set_stance")
def test_watches_closed_out_of_order_leave_compiled_code_compiling():
    """The eager stance is process-wide: the second watch to close restored the stance the
    first had saved on entry, and torch.compile compiled nothing for the rest of the run."""
    from ampkit._torch_compat import is_compiling

    def f(x):
        return x * (3 if is_compiling() else 2)  # 3 where compiled, 2 where run eagerly

    g = torch.compile(f, backend="eager")
    a, b = watch(nn.Linear(2, 2)), watch(nn.Linear(2, 2))
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert g(torch.ones(1)).item() == 2  # b still open: eager
    b.__exit__(None, None, None)
    assert g(torch.ones(1)).item() == 3


def test_watch_of_a_model_run_by_several_threads_finds_the_first_nonfinite_module():
    """The hooks fire in every thread running the model (DataParallel's replicas share
    them): flags and their module codes were appended apart and folded by any thread, so
    the exit raised IndexError or named the wrong module."""
    import threading

    class Bad(nn.Module):
        def forward(self, x):
            return x * float("inf") if x.shape[0] == 1 else x

    model = nn.Sequential(collections.OrderedDict(
        first=nn.Linear(8, 8), bad=Bad(), last=nn.Linear(8, 2)))
    start = threading.Barrier(4)

    def work():
        start.wait()
        for _ in range(40):
            model(torch.randn(4, 8))

    with torch.no_grad(), watch(model) as w:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        model(torch.randn(1, 8))  # the one non-finite output, after all the others
    assert w.first_nonfinite == ("forward", "bad")
    assert w.nonfinite() == [("forward", "bad"), ("forward", "last"), ("forward", "")]


class _FrozenEncoderProbe(nn.Module):
    """An eval-mode, frozen TransformerEncoder with a padding mask returns a nested tensor
    inside (torch's fast path), and a trainable head (linear probing)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                         enable_nested_tensor=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x, src_key_padding_mask=mask).mean(1))


def _probe_batch():
    torch.manual_seed(0)
    model = _FrozenEncoderProbe()
    model.enc.eval().requires_grad_(False)
    x = torch.randn(2, 6, 16)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 3:] = True
    return model, x, mask


def test_watch_and_inspect_take_nested_tensor_outputs():
    """aminmax and the cast counts have no nested-tensor kernel: watch and inspect raised
    NotImplementedError on a model that runs without them."""
    model, x, mask = _probe_batch()
    with torch.no_grad(), watch(model) as w:
        model(x, mask)
    assert w.first_nonfinite is None
    with watch(model) as w:
        model(x, mask).sum().backward()
    assert w.first_nonfinite is None
    report = inspect(model, (x, mask), torch.tensor([0, 1]), policy="32-true")
    assert all(m.out_sqnr_db == math.inf for m in report.modules if m.out_sqnr_db is not None)


def test_a_loss_of_shape_1_is_taken_as_a_scalar():
    """It passed the one-element check, then failed reading the losses (nested lists)."""
    model = nn.Linear(4, 2)
    report = inspect(model, torch.randn(3, 4), torch.randn(3, 2), policy="bf16-mixed",
                     loss_fn=lambda out, y: ((out - y) ** 2).mean().reshape(1))
    assert json.dumps(report.to_dict())


def test_advice_names_the_model_itself_as_model_not_empty_quotes():
    """The gradient overflow and underflow rules printed the root's name as ''."""
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))
            self.lin = nn.Linear(16, 4)

        def forward(self, x):
            return self.lin(x * self.scale)

    torch.manual_seed(0)
    for batch, policy in (((torch.randn(8, 16) * 300, torch.randn(8, 4)), "16-mixed"),
                          ((torch.randn(8, 16) * 1e-4, torch.randn(8, 4) * 1e-6), "O3")):
        advice = inspect(Root(), *batch, policy=policy).advice
        assert any(sentence.startswith("'<model>' has") for sentence in advice), advice
        assert not any(sentence.startswith("'' ") for sentence in advice)


def test_a_model_changing_its_input_in_place_sees_the_same_batch_in_both_passes():
    """Both passes shared the caller's storage: the reference pass's x.mul_(2) gave the
    policy pass another batch (SQNR 0 dB under 32-true) and changed the caller's tensor."""
    class Doubles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x.mul_(2))

    x = torch.randn(3, 4)
    before = x.clone()
    report = inspect(Doubles(), x, torch.randn(3, 2), policy="32-true")
    assert all(m.out_sqnr_db == math.inf for m in report.modules)
    assert torch.equal(x, before)


def test_watch_over_many_steps_keeps_one_hook_on_a_leaf_passed_in_every_step():
    """A learned query passed to a child module every step got one more tensor hook per
    step, and every backward fired all of them (quadratic: 9M events by step 3000)."""
    class Query(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Parameter(torch.randn(4))
            self.attend = nn.Linear(4, 4)

        def forward(self, x):
            return self.attend(self.query) * x

    model = Query()
    with watch(model) as w:
        model(torch.randn(4)).sum().backward()
        first = len(model.query._backward_hooks or {})  # its own (a parameter's) and one input's
        for _ in range(19):
            model(torch.randn(4)).sum().backward()
        hooks = len(model.query._backward_hooks or {})
        events = w._flags.count
    assert hooks == first == 2
    with watch(model) as w1:
        model(torch.randn(4)).sum().backward()
    assert events == 20 * w1._flags.count  # as many events each step
    assert w.first_nonfinite is None and not model.query._backward_hooks


def test_flops_count_cpu_attention_and_oneDNN_rnn_layers():
    """torch's FLOP formulas have none for the CPU's flash attention or oneDNN's RNN layer:
    an LSTM reported no FLOPs, and attention only its projections."""
    from ampkit.diagnose.flops import FlopCounter

    q = torch.randn(2, 4, 16, 8)
    with FlopCounter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert counter.flops == {"float32": 2 * (2 * 2 * 4 * 16 * 16 * 8)}  # QK^T and AV
    lstm, x = nn.LSTM(8, 16), torch.randn(5, 3, 8)
    with FlopCounter() as counter:
        lstm(x)
    assert counter.flops == {"float32": 2 * 5 * 3 * (4 * 16 * 8 + 4 * 16 * 16)}

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 16)
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    report = inspect(Seq(), x, policy="bf16-mixed")
    assert report.flops.get("bfloat16", 0) > 0 and report.low_precision_share > 0.9


class _Encoding(collections.UserDict):
    """transformers' BatchEncoding in small: a UserDict the model takes as keywords."""


def test_a_userdict_batch_is_passed_as_keywords_and_the_callers_tensors_are_not_touched():
    """A UserDict batch was passed as one argument, and inspect's passes shared the
    caller's tensors: a float input with requires_grad got a .grad from them."""
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, scale):
            return self.fc(x) * scale

    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    report = inspect(Keywords(), _Encoding(x=x, scale=torch.tensor(2.0)), torch.randn(3, 2),
                     policy="32-true")
    assert [m.name for m in report.modules] == ["fc"]
    assert report.modules[0].out_sqnr_db == math.inf
    assert x.grad is None


class _Attention(nn.Module):
    """One head of self-attention: the key's bias has a zero gradient in exact arithmetic
    (softmax ignores a per-query constant), which fp32 computes as rounding noise."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        scores = self.query(x) @ self.key(x).transpose(-1, -2) / 4.0
        return scores.softmax(-1) @ self.value(x)


def test_rounding_noise_flushing_to_zero_does_not_ask_to_raise_the_loss_scale():
    """Every BERT attention key got "has 1.5% of its nonzero gradients flush to zero ...:
    raise init_scale": the flushing elements were its bias's fp32 rounding noise. The
    column keeps counting them (the contract's definition); the advice, checked against
    one float64 step, does not. A gradient that small for real still gets the advice."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    report = inspect(_Attention(), x, policy="16-mixed",
                     loss_fn=lambda out, _: out.float().mean() * 1e-4)
    key = stats(report, "key")
    assert key.grad_underflow >= 0.01  # the bias's noise flushes in fp16 at 65536
    assert not any("'key'" in sentence for sentence in report.advice), report.advice
    tiny = inspect(nn.Sequential(nn.Linear(4, 1)), torch.full((2, 4), 1e-9), policy="16-mixed",
                   loss_fn=lambda out, _: out.float().mean() * 1e-9)
    assert any("'0' has" in s and "raise init_scale" in s for s in tiny.advice), tiny.advice


class _Bias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return x + self.bias


class _AttentionKeyBias(_Attention):
    """The key's bias a module of its own: every element of its gradient is noise."""

    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(16, 16, bias=False)
        self.key_bias = _Bias()

    def forward(self, x):
        scores = self.query(x) @ self.key_bias(self.key(x)).transpose(-1, -2) / 4.0
        return nn.functional.dropout(scores.softmax(-1), 0.1) @ self.value(x)


def test_a_module_all_of_whose_gradient_is_noise_gets_no_underflow_advice_with_dropout():
    """A module whose whole gradient was rounding noise was left out of the float64 check
    and judged by its column (100%: "raise init_scale"); under dropout the float64 step
    draws the same masks as the reference."""
    torch.manual_seed(0)
    report = inspect(_AttentionKeyBias(), torch.randn(4, 8, 16), policy="16-mixed",
                     loss_fn=lambda out, _: out.float().mean() * 1e-4)
    assert stats(report, "key_bias").grad_underflow >= 0.5
    assert not any("'key_bias'" in sentence for sentence in report.advice), report.advice


class _NoisyInput(nn.Module):
    """Adds Gaussian noise to its input (a VAE's reparameterisation, diffusion), which
    float64 draws differently from fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1032, 1)

    def forward(self, x):
        return self.fc(x + 1e-8 * torch.randn_like(x))


def test_a_float64_step_that_draws_other_random_numbers_does_not_hide_real_underflow():
    """randn in float64 draws other numbers than in fp32: the elements that depend on them
    were taken for noise and real underflow advice (3.1% of the weight) disappeared."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4, 1000), torch.randn(4, 32) * 1e-9], dim=1)
    report = inspect(_NoisyInput(), x, policy="16-mixed",
                     loss_fn=lambda out, _: out.float().mean() * 1e-4)
    assert stats(report, "fc").grad_underflow >= 0.01
    assert any("'fc' has" in s and "raise init_scale" in s for s in report.advice), report.advice


def test_a_loss_that_is_rounding_noise_still_lets_the_float64_step_judge():
    """The mean of a batch-norm output is zero in exact arithmetic: fp32 gives 1e-10,
    float64 1e-17, so a 0.1% loss check refused the float64 step and every gradient of
    the model (all noise) got "raise init_scale"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32)).train()
    report = inspect(model, torch.randn(16, 32), policy="16-mixed")
    assert stats(report, "0").grad_underflow > 0.01
    assert not any("init_scale" in sentence for sentence in report.advice), report.advice


class _SparseAndDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.randn(50, 8))
        self.pos = nn.Parameter(torch.randn(4, 8))

    def forward(self, ids):
        return nn.functional.embedding(ids, self.tok, sparse=True) + self.pos * 1e4


def test_a_sparse_gradient_beside_a_dense_one_counts_in_the_advice():
    """The float64 check skipped the sparse gradient and judged the module by its dense
    one alone: real underflow (4.3% in the column) was advised with sparse=False only.
    The sentence gives the share the rule decided on."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (6, 4))
    report = inspect(nn.Sequential(_SparseAndDense()), ids, policy="16-mixed",
                     loss_fn=lambda out, _: out.float().mean() * 1e-11)
    share = stats(report, "0").grad_underflow
    assert share >= 0.01
    hit = [s for s in report.advice if s.startswith("'0' has")]
    assert hit and f"{share:.2%} of its nonzero gradients (fp32 rounding noise" in hit[0], hit


class _OtherInFloat64(nn.Module):
    """Computes something else in float64: the float64 step is not the reference's."""

    def forward(self, x):
        return x * 1.01 if x.dtype == torch.float64 else x


def test_a_float64_step_whose_output_differs_is_not_used():
    """Its output was held to a tolerance of 1e-4 of the norm product, which a 1%
    different output passed: the step judged noise with another step's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), _OtherInFloat64()).train()
    report = inspect(model, torch.randn(64, 256), policy="16-mixed")  # 16384 outputs
    hit = [s for s in report.advice if s.startswith("'0' has")]
    assert hit and "rounding noise not counted" not in hit[0], report.advice  # the column's


@pytest.mark.parametrize("policy", ["16-mixed", "O2-fp16"])
def test_a_root_with_parameters_is_reported_before_the_policys_output_cast(policy):
    """The root's hook saw its output after the cast of the model's output to fp32: a
    bare Linear that overflows fp16 read overflow 0 and out_dtype float32, where the same
    layer inside a Sequential read the truth."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    x = torch.randn(8, 64) * 1e5
    bare = inspect(layer, x, policy=policy).modules[0]
    wrapped = inspect(nn.Sequential(layer), x, policy=policy).modules[0]
    assert bare.out_dtype is wrapped.out_dtype is torch.float16
    assert bare.overflow == wrapped.overflow > 0.1 and bare.nonfinite and wrapped.nonfinite
    assert bare.out_sqnr_db == wrapped.out_sqnr_db


def test_an_fp8_policy_on_a_model_that_is_one_linear_runs_it_in_fp8():
    """convert_to_fp8 returns a bare Linear converted: inspect dropped it, ran bf16 only
    and advised that no Linear qualifies."""
    report = inspect(nn.Linear(32, 32), torch.randn(16, 32), policy="fp8-tensorwise")
    assert report.modules[0].type == "Float8Linear"
    assert {"float8_e4m3fn", "float8_e5m2"} <= report.flops.keys()
    assert not any("qualifies" in sentence for sentence in report.advice)


def test_flops_count_matrix_vector_products_and_bilinear_layers():
    """torch's formulas have none for mv, addmv, dot or nn.Bilinear's _trilinear: a scoring
    head `h @ query` in bf16 reported no FLOPs and a low-precision share of 0."""
    from ampkit.diagnose.flops import FlopCounter

    h, v = torch.randn(6, 4), torch.randn(4)
    with FlopCounter() as counter:
        h @ v  # mv
        torch.addmv(torch.randn(6), h, v)
        v @ v  # dot
        torch.vdot(v, v)
    assert counter.flops == {"float32": 2 * (2 * 6 * 4) + 2 * (2 * 4)}
    bilinear, x1, x2 = nn.Bilinear(3, 5, 7), torch.randn(2, 3), torch.randn(2, 5)
    with FlopCounter() as counter:
        bilinear(x1, x2)
    assert counter.flops == {"float32": 2 * 2 * 7 * 3 * 5}

    class Score(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return x @ self.query

    report = inspect(Score(), torch.randn(8, 16), policy="bf16-mixed")
    assert report.flops == {"bfloat16": 2 * (2 * 8 * 16)}  # forward, and the query's gradient
    assert report.low_precision_share == 1.0


class Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(5, dtype=torch.complex64))

    def forward(self, x):
        return torch.fft.rfft(x) * self.w / 0.0  # inf and NaN in a complex output


def test_watch_checks_complex_outputs():
    """Complex tensors were not checked: the next module got the blame, or none did."""
    model = nn.Sequential(_Spectral(), Lambda(lambda z: z.real))
    with watch(model) as w:
        model(torch.randn(2, 8))
    alone = nn.Sequential(_Spectral())
    with watch(alone) as w2:
        alone(torch.randn(2, 8))
    assert w.first_nonfinite == w2.first_nonfinite == ("forward", "0")
    finite = nn.Sequential(nn.Linear(8, 8), Lambda(lambda x: torch.fft.rfft(x).conj()))
    with watch(finite) as w3:  # a conjugate view is read too
        finite(torch.randn(2, 8)).real.sum().backward()
    assert w3.first_nonfinite is None


def test_inspect_and_autotune_run_while_a_watch_on_the_model_is_open():
    """Their copies of the model deep-copied watch's hooks, and with them the watch (its
    lock cannot be copied): both raised "copy.deepcopy failed"."""
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    with watch(model) as w:
        inspect(model, x, y, policy="bf16-mixed")
        ampkit.autotune(model, x, y, candidates=["bf16-mixed"], steps=3)
        twin = copy.deepcopy(model)
        pickle.loads(pickle.dumps(model))
        twin(x * math.nan)  # a copy's hooks report nothing into this watch
        model(x).sum().backward()
    assert w.first_nonfinite is None
