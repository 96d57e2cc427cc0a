"""ampkit.fp8: config validation, scaling numerics, and Float8Linear's three matmuls."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import DEVICES, HALF_DTYPES
from ampkit.fp8 import AmaxComputeAlgo, Float8Config, Float8Linear, Recipe
from ampkit.fp8 import linear as fp8_linear
from ampkit import _warn
import ampkit
from ampkit.fp8.scaling import (E4M3, E5M2, Fp8, amax_to_scale, compute_amax, dequantize,
                                fp8_max, history_amax, quantize, quantize_delayed,
                                saturated_cast, update_history)

RECIPES = ["tensorwise", "delayed", "rowwise"]


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB."""
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - approx).norm()))


def layer_pair(recipe: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               in_f: int = 64, out_f: int = 32, bias: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias, device=device, dtype=dtype)
    fp8 = Float8Linear(in_f, out_f, bias=bias, device=device, dtype=dtype,
                       config=Float8Config(recipe, emulate=device == "cpu" or None))
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def run_one(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Forward and backward once: (output, grad of x, grad of weight)."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(x)
    out.backward(g)
    return out, x.grad, module.weight.grad


def run_both(ref: nn.Module, fp8: nn.Module, x: torch.Tensor, g: torch.Tensor):
    return run_one(ref, x, g), run_one(fp8, x, g)


# --- config ------------------------------------------------------------------------------

def test_config_coerces_strings_to_enums_once():
    cfg = Float8Config("Delayed", amax_history_len=4, amax_compute_algo="most_recent")
    assert cfg.recipe is Recipe.DELAYED and cfg.amax_compute_algo is AmaxComputeAlgo.MOST_RECENT
    assert cfg == Float8Config(Recipe.DELAYED, 4, AmaxComputeAlgo.MOST_RECENT)
    assert hash(cfg) == hash(Float8Config(Recipe.DELAYED, 4, AmaxComputeAlgo.MOST_RECENT))
    assert Float8Config.coerce("rowwise") == Float8Config(Recipe.ROWWISE)
    assert Float8Config.coerce(cfg) is cfg
    assert cfg.short == "delayed(4,most_recent)" and Float8Config().short == "tensorwise"
    with pytest.raises(AttributeError):
        cfg.margin = 1  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"recipe": "blockwise"}, ValueError,
     r"unknown fp8 recipe 'blockwise'; valid: 'tensorwise', 'delayed', 'rowwise'"),
    ({"recipe": 3}, TypeError, r"fp8 recipe must be a str or Recipe, got int 3; valid: 'tensorwise'"),
    ({"amax_history_len": 0}, ValueError, r"amax_history_len=0 is invalid; valid: an int >= 1"),
    ({"amax_history_len": 2.0}, TypeError, r"amax_history_len must be an int >= 1, got float 2.0"),
    ({"margin": -1}, ValueError, r"margin=-1 is invalid; valid: an int from 0 to 14 \(the amax"),
    ({"margin": 20}, ValueError, r"margin=20 is invalid; valid: an int from 0 to 14 \(the amax "
                                 r"lands 20 binades below e4m3's 448; .* from 19 on every value is 0"),
    ({"margin": 2**10}, ValueError, r"margin=1024 is invalid; valid: an int from 0 to 14"),
    ({"margin": True}, TypeError, r"margin must be an int from 0 to 14, got bool True"),
    ({"amax_compute_algo": "mean"}, ValueError,
     r"unknown amax_compute_algo 'mean'; valid: 'max', 'most_recent'"),
    ({"emulate": "yes"}, TypeError, r"emulate must be None, True or False, got 'yes'"),
    ({"output_fast_accum": 1}, TypeError, r"output_fast_accum must be True or False, got 1"),
])
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8Config(**kwargs)


def test_coerce_rejects_other_types():
    with pytest.raises(TypeError, match=r"recipe must be a recipe name, a Recipe or a Float8Config, "
                                        r"got dict \{\}; valid names: 'tensorwise'"):
        Float8Config.coerce({})


# --- scaling -----------------------------------------------------------------------------

def test_fp8_max_values():
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    with pytest.raises(ValueError, match=r"fp8 dtype torch.float16 is not supported; valid: "
                                         r"torch.float8_e4m3fn, torch.float8_e5m2"):
        fp8_max(torch.float16)


def test_amax_to_scale_exact_values():
    assert amax_to_scale(torch.tensor(2.0), E4M3).item() == 224.0
    assert amax_to_scale(torch.tensor(2.0), E4M3, margin=1).item() == 112.0
    assert amax_to_scale(torch.tensor(4.0), E5M2).item() == 14336.0
    # Zero amax: scale 1 (zeros are exact under any scale; no inf, no NaN).
    assert amax_to_scale(torch.tensor(0.0), E4M3).item() == 1.0
    tiny = amax_to_scale(torch.tensor(1e-30), E4M3)
    assert torch.isfinite(tiny) and tiny.item() == pytest.approx(448.0 / 1e-12, rel=1e-6)
    rows = amax_to_scale(torch.tensor([[1.0], [0.0], [448.0]]), E4M3)
    assert rows.flatten().tolist() == [448.0, 1.0, 1.0] and rows.dtype == torch.float32


def test_a_non_finite_amax_gives_a_nan_scale_or_zero():
    """NaN gave scale 1 (amax > 0 is False for NaN), a finite scale that cast the tensor's
    other values silently wrong. An inf gives 0, whose inverse makes every product NaN
    (the next test)."""
    scales = amax_to_scale(torch.tensor([2.0, float("nan"), float("inf"), 0.0]), E5M2, margin=1)
    assert scales[0].item() == 14336.0 and scales[1].isnan() and scales[2].item() == 0.0
    assert scales[3].item() == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_non_finite_input_is_never_cast_finite_but_wrong(recipe, bad):
    """Every value that shares a scale with a non-finite one comes out NaN: the whole
    output (tensorwise; delayed in its first step, scaled by the input's own amax), or its
    row (rowwise), whose other rows are exactly those of the batch without it. Before, a
    NaN gave the tensor scale 1 (these small inputs flushed to zero) and an inf scale 0."""
    outputs = []
    for value in (1.0, bad):
        torch.manual_seed(0)
        layer = Float8Linear(32, 32, config=Float8Config(recipe, emulate=True))
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 1e-3
        x[0, 5] = value
        with torch.no_grad():
            outputs.append(layer(x))
    clean, out = outputs
    if recipe == "rowwise":
        assert out[0].isnan().all() and torch.equal(out[1:], clean[1:])
    else:
        assert out.isnan().all()


def test_compute_amax_per_tensor_row_and_column():
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]], dtype=torch.bfloat16)
    assert compute_amax(x).item() == 3.0 and compute_amax(x).dtype == torch.float32
    assert compute_amax(x, dim=-1).tolist() == [[3.0], [2.0]]
    assert compute_amax(x, dim=0).tolist() == [[2.0, 3.0]]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturated_cast_clamps_to_max_instead_of_nan(dtype):
    big = fp8_max(dtype)
    x = torch.tensor([1e9, -1e9, big * 1.5, 1.0, float("nan")])
    out = saturated_cast(x, torch.tensor(1.0), dtype).float()
    assert out[:4].tolist() == [big, -big, big, 1.0]
    assert math.isnan(out[4].item())  # NaN passes through for the GradScaler to see
    assert not torch.isinf(out).any()


def test_saturated_cast_forms_product_in_fp32():
    # 60000 * 2 overflows fp16; formed in fp32 it saturates to e5m2's max instead of inf.
    x = torch.tensor([60000.0], dtype=torch.float16)
    assert saturated_cast(x, torch.tensor(2.0), E5M2).float().item() == 57344.0


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_quantize_all_zero_tensor(dtype):
    q = quantize(torch.zeros(4, 16, dtype=dtype), E4M3)
    assert q.inv_scale.item() == 1.0 and q.data.dtype == E4M3
    assert torch.equal(dequantize(q), torch.zeros(4, 16))
    rows = quantize(torch.zeros(4, 16, dtype=dtype), E4M3, dim=-1)
    assert torch.equal(rows.inv_scale, torch.ones(4, 1))


def test_quantize_maps_amax_to_format_max():
    x = torch.randn(8, 32)
    q = quantize(x, E4M3)
    assert q.data.float().abs().max().item() == 448.0
    assert q.inv_scale.item() == pytest.approx(x.abs().max().item() / 448.0, rel=1e-6)
    rows = quantize(x, E4M3, dim=-1)
    assert rows.inv_scale.shape == (8, 1)
    assert torch.equal(rows.data.float().abs().amax(dim=1), torch.full((8,), 448.0))
    cols = quantize(x, E5M2, dim=0, margin=2)
    assert cols.inv_scale.shape == (1, 32) and cols.data.dtype == E5M2
    assert torch.equal(cols.data.float().abs().amax(dim=0), torch.full((32,), 57344.0 / 4))


def test_quantize_with_given_scale_skips_amax():
    x = torch.tensor([1.0, 2.0, 100.0])
    q = quantize(x, E4M3, scale=torch.tensor(8.0))
    assert q.data.float().tolist() == [8.0, 16.0, 448.0] and q.inv_scale.item() == 0.125


def test_fp8_transpose_moves_row_scales_to_columns():
    q = quantize(torch.randn(4, 16), E4M3, dim=-1)
    assert q.t().data.shape == (16, 4) and q.t().inv_scale.shape == (1, 4)
    scalar = quantize(torch.randn(4, 16), E4M3)
    assert scalar.t().inv_scale is scalar.inv_scale


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-2.0 ** 100, 2.0 ** 100, allow_nan=False, width=32), min_size=1, max_size=40),
       st.sampled_from([E4M3, E5M2]))
def test_quantize_is_finite_and_within_half_ulp(values, dtype):
    x = torch.tensor(values, dtype=torch.float32)
    q = quantize(x, dtype)
    back = dequantize(q)
    assert torch.isfinite(back).all()
    amax = x.abs().max().item()
    mantissa_bits = 3 if dtype == E4M3 else 2
    # Relative rounding error of normal numbers is at most 2**-(m+1); values that land
    # in the subnormal range of the scaled format err by at most half its smallest step.
    smallest = torch.finfo(dtype).smallest_normal * 2.0 ** -mantissa_bits
    bound = (x.abs() * 2.0 ** -(mantissa_bits + 1) + smallest / 2 * q.inv_scale) * (1 + 1e-5)
    assert ((back - x).abs() <= bound + amax * 1e-7).all()


def test_update_history_rolls_newest_first():
    history = torch.zeros(3)
    for amax in (1.0, 2.0, 3.0, 4.0):
        update_history(history, torch.tensor(amax))
    assert history.tolist() == [4.0, 3.0, 2.0]
    assert history_amax(history, AmaxComputeAlgo.MAX).item() == 4.0
    update_history(history, torch.tensor(0.5))
    assert history_amax(history, AmaxComputeAlgo.MAX).item() == 4.0
    assert history_amax(history, AmaxComputeAlgo.MOST_RECENT).item() == 0.5


def test_quantize_delayed_uses_history_then_records_amax():
    history = torch.tensor([4.0, 1.0])
    x = torch.tensor([1.0, -8.0])
    q = quantize_delayed(x, E4M3, history, algo=AmaxComputeAlgo.MAX)
    assert torch.equal(q.inv_scale, torch.tensor(112.0).reciprocal())  # scale 448 / 4
    assert q.data.float().tolist() == [112.0, -448.0]  # -8 saturates at the old scale
    assert history.tolist() == [8.0, 4.0]
    warm = torch.zeros(2)
    q = quantize_delayed(x, E4M3, warm, algo=AmaxComputeAlgo.MAX, warmup=True)
    assert q.data.float().tolist() == [56.0, -448.0] and warm.tolist() == [8.0, 0.0]


# --- Float8Linear numerics -----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_sqnr_of_output_and_both_gradients(recipe, device):
    ref, fp8 = layer_pair(recipe, device, in_f=128, out_f=64)
    torch.manual_seed(1)
    for _ in range(3):  # delayed: step 1 warms the histories up, later steps use them
        x, g = torch.randn(96, 128, device=device), torch.randn(96, 64, device=device)
        (out, gx, gw), (out8, gx8, gw8) = run_both(ref, fp8, x, g)
        assert sqnr(out, out8) >= 25.0
        assert sqnr(gx, gx8) >= 18.0 and sqnr(gw, gw8) >= 18.0
        assert out8.dtype == gx8.dtype == gw8.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_half_layers_keep_their_dtype(recipe, dtype, device):
    ref, fp8 = layer_pair(recipe, device, dtype)
    x, g = torch.randn(32, 64, device=device, dtype=dtype), torch.randn(32, 32, device=device, dtype=dtype)
    out, gx, gw = run_one(ref.float(), x.float(), g.float())
    out8, gx8, gw8 = run_one(fp8, x, g)
    assert out8.dtype == gx8.dtype == gw8.dtype == fp8.bias.grad.dtype == dtype
    assert sqnr(out, out8) >= 22.0
    assert sqnr(gx, gx8) >= 16.0 and sqnr(gw, gw8) >= 16.0


def _manual(x, w, g, fwd_dtype=E4M3, grad_dtype=E5M2):
    """Tensorwise reference written out: the three matmuls on fp8 values."""
    xq, wq, gq = quantize(x, fwd_dtype), quantize(w, fwd_dtype), quantize(g, grad_dtype)

    def mm(a: Fp8, b: Fp8) -> torch.Tensor:
        return torch.mm(a.data.float(), b.data.float()) * (a.inv_scale * b.inv_scale)
    return mm(xq, wq.t()), mm(gq, wq), mm(gq.t(), xq)


def test_tensorwise_matches_the_written_out_fp8_math_bitwise():
    _, fp8 = layer_pair("tensorwise", bias=False)
    x = torch.randn(24, 64, requires_grad=True)
    g = torch.randn(24, 32)
    out = fp8(x)
    out.backward(g)
    ref_out, ref_gx, ref_gw = _manual(x.detach(), fp8.weight.detach(), g)
    assert torch.equal(out, ref_out)
    assert torch.equal(x.grad, ref_gx) and torch.equal(fp8.weight.grad, ref_gw)


def test_bias_adds_after_the_fp8_matmul_and_gets_exact_gradient():
    _, fp8 = layer_pair("tensorwise")
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    out = fp8(x)
    out.backward(g)
    ref_out, _, _ = _manual(x, fp8.weight.detach(), g)
    assert torch.equal(out, ref_out + fp8.bias.detach())
    assert torch.equal(fp8.bias.grad, g.sum(0))


@pytest.mark.parametrize("recipe", RECIPES)
def test_3d_input_equals_flattened(recipe):
    (_, a), (_, b) = layer_pair(recipe), layer_pair(recipe)  # fresh delayed histories each
    x = torch.randn(2, 8, 64, requires_grad=True)
    x2 = x.detach().reshape(16, 64).requires_grad_()
    out, out2 = a(x), b(x2)
    assert out.shape == (2, 8, 32)
    assert torch.equal(out, out2.reshape(2, 8, 32))
    out.sum().backward()
    out2.sum().backward()
    assert x.grad.shape == (2, 8, 64) and torch.equal(x.grad.reshape(16, 64), x2.grad)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(16, 64), (2, 8, 64)])
def test_the_output_is_not_a_view_like_nn_linears(shape, bias):
    # FSDP2 hooks a module's output for its backward; an in-place op on a view of it drops
    # the hook (torch 2.13 warns "returned a view tensor"). Bias-free layers returned a
    # reshape of the matmul's result.
    fp8 = Float8Linear(64, 32, bias=bias, config=Float8Config("tensorwise", emulate=True))
    x = torch.randn(*shape, requires_grad=True)
    out = fp8(x)
    assert not out._is_view() and out.shape == (*shape[:-1], 32)
    out.sum().backward()
    assert x.grad.shape == shape


def test_empty_batch():
    _, fp8 = layer_pair("delayed")
    x = torch.zeros(0, 3, 64, requires_grad=True)
    out = fp8(x)
    assert out.shape == (0, 3, 32) and out.dtype == torch.float32
    out.sum().backward()
    assert x.grad.shape == (0, 3, 64) and torch.equal(fp8.weight.grad, torch.zeros(32, 64))
    assert fp8.amax_history_input.sum() == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_frozen_weight_gets_no_gradient(recipe):
    (_, a), (_, b) = layer_pair(recipe), layer_pair(recipe)
    a.weight.requires_grad_(False)
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    _, gx_a, gw_a = run_one(a, x, g)
    _, gx_b, _ = run_one(b, x, g)
    assert gw_a is None and torch.equal(gx_a, gx_b)


@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_func_transforms_raise_naming_the_layer_and_the_way_out(recipe):
    """vmap and grad failed with torch's message about autograd.Function.setup_context."""
    _, fp8 = layer_pair(recipe)
    x = torch.randn(3, 4, 64)
    match = (r"Float8Linear does not run under torch.func transforms \(vmap, grad, .*valid: "
             r"keep this layer out of fp8 \(convert_to_fp8\(..., module_filter=...\)\)")
    with pytest.raises(RuntimeError, match=match):
        torch.func.vmap(fp8)(x)
    params = dict(fp8.named_parameters())
    with pytest.raises(RuntimeError, match=match):
        torch.func.grad(lambda p: torch.func.functional_call(fp8, p, (x,)).sum())(params)
    assert torch.func.functional_call(fp8, params, (x,)).shape == (3, 4, 32)  # no transform


def test_torch_func_transforms_of_a_compiled_layer_raise_naming_it_too():
    """Under torch.compile the refusal was skipped: dynamo's InternalTorchDynamoError about
    vmap over ApplyTemplate named neither the layer nor the way out (review finding)."""
    _, fp8 = layer_pair("tensorwise")
    x = torch.randn(3, 4, 64)
    for call in (torch.compile(torch.func.vmap(fp8), backend="aot_eager"),
                 torch.func.vmap(torch.compile(fp8, backend="aot_eager"))):
        with pytest.raises(RuntimeError, match=r"Float8Linear does not run under torch.func"):
            call(x)
    compiled = torch.compile(fp8, backend="aot_eager", fullgraph=True)  # no transform: whole
    assert torch.equal(compiled(x), fp8(x))


@pytest.mark.parametrize("recipe", RECIPES)
def test_double_backward_raises_instead_of_dropping_the_weights_path(recipe):
    """A gradient penalty (create_graph=True) got gradients built from detached fp8
    copies: silently without every path through the weight (or torch's unrelated
    "does not require grad" for a lone layer)."""
    _, fp8 = layer_pair(recipe)
    model = nn.Sequential(fp8, nn.Tanh(), Float8Linear(32, 16, config=fp8.config))
    x = torch.randn(8, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Float8Linear has no double backward.*"
                                           r"create_graph=True.*valid: keep the layers"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
    gx, = torch.autograd.grad(model(x).sum(), x)  # a plain backward still works
    assert gx.shape == x.shape and gx.isfinite().all()


def test_input_without_grad_skips_grad_input():
    _, fp8 = layer_pair("tensorwise")
    fp8(torch.randn(8, 64)).sum().backward()
    assert fp8.weight.grad is not None and fp8.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_all_zero_input_and_gradient_give_no_nan(recipe):
    _, fp8 = layer_pair(recipe)
    x = torch.zeros(16, 64, requires_grad=True)
    out = fp8(x)
    assert torch.equal(out, fp8.bias.detach().expand(16, 32))
    out.backward(torch.zeros(16, 32))
    assert torch.equal(x.grad, torch.zeros(16, 64))
    assert torch.equal(fp8.weight.grad, torch.zeros(32, 64))


def test_huge_activations_saturate_instead_of_overflowing():
    _, fp8 = layer_pair("delayed", bias=False)
    fp8(torch.randn(16, 64)).sum().backward()  # warm-up step: histories hold amax ~ 3
    out = fp8(torch.randn(16, 64) * 1e6)  # far above the history's amax: clamps to +-448
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_autocast_output_dtype(recipe, dtype, device):
    _, fp8 = layer_pair(recipe, device)
    x = torch.randn(2, 16, 64, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        out = fp8(x)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32
    assert fp8(x.detach()).dtype == torch.float32  # autocast state did not leak


@pytest.mark.parametrize("region", [torch.autocast, ampkit.autocast], ids=["torch", "ampkit"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_float64_layer_stays_float64_under_autocast_as_torch_s(recipe, region):
    """Autocast casts no fp64 tensor, so nn.Linear in fp64 returns fp64 in a bf16 region;
    Float8Linear returned the region's dtype."""
    plain, fp8 = (layer.double() for layer in layer_pair(recipe))
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    with region("cpu", dtype=torch.bfloat16):
        expected, out = plain(x), fp8(x)
    assert out.dtype == expected.dtype == torch.float64
    out.sum().backward()
    assert x.grad.dtype == fp8.weight.grad.dtype == torch.float64


def test_emulated_matmul_ignores_surrounding_autocast():
    _, fp8 = layer_pair("tensorwise", bias=False)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8(x)
    assert torch.equal(out, _manual(x, fp8.weight.detach(), x[:, :32])[0].to(torch.bfloat16))


# --- delayed recipe state ----------------------------------------------------------------------

def test_delayed_histories_warm_up_then_roll():
    _, fp8 = layer_pair("delayed", bias=False)
    fp8.config = Float8Config("delayed", amax_history_len=3, emulate=True)
    fp8._reset_fp8_state()
    x1, g1 = torch.randn(16, 64), torch.randn(16, 32)
    fp8(x1).backward(g1)
    assert fp8.amax_history_input.tolist() == [compute_amax(x1).item(), 0.0, 0.0]
    assert fp8.amax_history_weight[0].item() == compute_amax(fp8.weight.detach()).item()
    assert fp8.amax_history_grad_output.tolist() == [compute_amax(g1).item(), 0.0, 0.0]
    x2 = torch.randn(16, 64) * 0.1
    out = fp8(x2)
    # Step 2 scales x2 by step 1's amax (the history), not by its own.
    scale = amax_to_scale(compute_amax(x1), E4M3)
    w_scale = amax_to_scale(compute_amax(fp8.weight.detach()), E4M3)
    xq = quantize(x2, E4M3, scale=scale)
    wq = quantize(fp8.weight.detach(), E4M3, scale=w_scale)
    expected = torch.mm(xq.data.float(), wq.data.float().t()) * (xq.inv_scale * wq.inv_scale)
    assert torch.equal(out, expected)
    assert fp8.amax_history_input[:2].tolist() == [compute_amax(x2).item(), compute_amax(x1).item()]


def test_delayed_warmup_waits_for_a_training_step():
    _, fp8 = layer_pair("delayed")
    with torch.no_grad():
        fp8(torch.randn(4, 64))
    assert fp8._delayed_started is False and fp8.amax_history_grad_output.sum() == 0
    fp8(torch.randn(4, 64)).sum().backward()
    assert fp8._delayed_started is True and fp8.amax_history_grad_output[0] > 0


def test_delayed_histories_stay_fp32_and_out_of_state_dict():
    _, fp8 = layer_pair("delayed")
    fp8 = fp8.to(torch.bfloat16)
    assert fp8.weight.dtype == torch.bfloat16 and fp8.amax_history_input.dtype == torch.float32
    assert list(fp8.state_dict()) == ["weight", "bias"]
    assert fp8.amax_history_input.shape == (16,)


# --- the native path (torch._scaled_mm) checked on CPU against cuBLASLt's rules ---------------

_REAL_SCALED_MM = torch._scaled_mm


def _strict_scaled_mm(tuple_result: bool):
    """torch._scaled_mm with the CUDA kernels' requirements enforced (CPU's is lenient)."""
    calls = []

    def fake(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False, bias=None):
        assert a.dtype in (E4M3, E5M2) and b.dtype in (E4M3, E5M2)
        assert not (a.dtype == b.dtype == E5M2), "e5m2 x e5m2 is not supported"
        assert a.is_contiguous(), "A must be row-major"
        assert b.t().is_contiguous(), "B must be column-major"
        assert a.shape[1] == b.shape[0] and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float32
        if scale_a.numel() == 1:
            assert scale_b.numel() == 1
        else:
            assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
            assert out_dtype == torch.bfloat16 and a.dtype == b.dtype == E4M3
        calls.append((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, use_fast_accum))
        try:
            out = _REAL_SCALED_MM(a, b, scale_a, scale_b, out_dtype=out_dtype)
        except NotImplementedError:  # torch 2.5: no CPU kernel at all; the same math in fp32
            out = (torch.mm(a.float(), b.float()) * (scale_a * scale_b)).to(out_dtype)
        except RuntimeError:  # older CPU _scaled_mm: per-tensor scales only; same math in fp32
            assert scale_a.numel() > 1
            out = (torch.mm(a.float(), b.float()) * (scale_a * scale_b)).to(out_dtype)
        return (out, torch.tensor(0.0)) if tuple_result else out
    return fake, calls


def test_strict_fake_rejects_a_wrong_layout():
    fake, _ = _strict_scaled_mm(False)
    a = torch.randn(16, 16).to(E4M3)
    with pytest.raises(AssertionError, match="B must be column-major"):
        fake(a, a, scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.float32)


@pytest.mark.parametrize("tuple_result", [False, True], ids=["tensor", "tuple(torch<=2.4)"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_native_path_meets_scaled_mm_rules_and_matches_emulation(recipe, tuple_result, monkeypatch):
    emu_ref, emu = layer_pair(recipe, bias=True)
    fake, calls = _strict_scaled_mm(tuple_result)
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    monkeypatch.setattr(fp8_linear, "fp8_supported", lambda device=None: True)
    native = Float8Linear.from_linear(emu_ref, Float8Config(recipe, output_fast_accum=True))
    assert native._native is True and emu._native is False
    for _ in range(2):
        x, g = torch.randn(24, 64), torch.randn(24, 32)  # 24 rows: grad-weight pads K to 32
        (out, gx, gw), (out8, gx8, gw8) = run_both(native, emu, x, g)
        tol = {"rtol": 1e-2, "atol": 1e-2} if recipe == "rowwise" else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(out, out8, **tol)
        torch.testing.assert_close(gx, gx8, **tol)
        torch.testing.assert_close(gw, gw8, **tol)
    shapes = {(c[0], c[1]) for c in calls}
    assert ((24, 64), (64, 32)) in shapes and ((24, 32), (32, 64)) in shapes
    assert ((32, 32), (32, 64)) in shapes  # grad-weight with K padded from 24 to 32
    assert [c[4] for c in calls[:1]] == [True]  # fast accumulation on the forward only
    assert not any(c[4] for c in calls[1:3])
    if recipe != "rowwise":
        assert {(c[2], c[3]) for c in calls[1:3]} == {(E5M2, E4M3)}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_linear.fp8_supported("cuda")),
                    reason="needs a GPU with fp8 tensor cores")
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_scaled_mm_matches_emulation(recipe):
    ref, native = layer_pair(recipe, "cuda", in_f=256, out_f=128)
    emulated = Float8Linear.from_linear(ref, Float8Config(recipe, emulate=True))
    assert native._native is True and emulated._native is False
    x, g = torch.randn(200, 256, device="cuda"), torch.randn(200, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (out, gx, gw), (out8, gx8, gw8) = run_both(emulated, native, x, g.bfloat16())
    for a, b in ((out, out8), (gx, gx8), (gw, gw8)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# --- module behaviour ----------------------------------------------------------------------

def test_extra_repr_names_recipe_and_formats():
    assert repr(Float8Linear(32, 16, config=Float8Config(emulate=True))) == (
        "Float8Linear(in_features=32, out_features=16, bias=True, recipe=tensorwise, "
        "x/w=e4m3, grad=e5m2)")
    assert Float8Linear(32, 16, bias=False, config=Float8Config("delayed", emulate=True)
                        ).extra_repr().endswith("bias=False, recipe=delayed(16,max), x/w=e4m3, grad=e5m2")
    assert Float8Linear(32, 16, config=Float8Config("rowwise", emulate=True)
                        ).extra_repr().endswith("recipe=rowwise, x/w=e4m3, grad=e4m3")


def test_from_linear_shares_parameters():
    linear = nn.Linear(32, 16).eval()
    fp8 = Float8Linear.from_linear(linear, Float8Config("rowwise", emulate=True))
    assert fp8.weight is linear.weight and fp8.bias is linear.bias and not fp8.training
    no_bias = Float8Linear.from_linear(nn.Linear(32, 16, bias=False), Float8Config(emulate=True))
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]


def test_emulation_warns_once_per_device_type():
    _warn.forget()
    with pytest.warns(UserWarning, match=r"no fp8 tensor cores on 'cpu'; Float8Linear emulates") as rec:
        Float8Linear(32, 16)(torch.randn(2, 32))
        Float8Linear(32, 16)(torch.randn(2, 32))
    assert len([w for w in rec if "fp8 tensor cores" in str(w.message)]) == 1
    _warn.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Float8Linear(32, 16, config=Float8Config(emulate=True))(torch.randn(2, 32))


def test_the_emulation_warning_suggests_the_layers_own_recipe():
    """It always suggested Float8Config("tensorwise", emulate=True): following it turned a
    delayed (or rowwise) model into a tensorwise one."""
    _warn.forget()
    for recipe in ("delayed", "rowwise"):
        with pytest.warns(UserWarning) as rec:
            Float8Linear(32, 16, config=Float8Config(recipe))(torch.randn(2, 32))
        assert [str(w.message).split("Pass ")[1] for w in rec] == [
            f"convert_to_fp8(model, recipe=Float8Config('{recipe}', emulate=True)) (with any "
            "other settings of yours) to silence this."]
    _warn.forget()


def test_emulate_false_without_fp8_hardware_raises():
    layer = Float8Linear(32, 16, config=Float8Config(emulate=False))
    with pytest.raises(RuntimeError, match=r"Float8Config\(emulate=False\) needs fp8 tensor cores, "
                                           r"but cpu \(.*\) has none; valid: emulate=None or True"):
        layer(torch.randn(2, 32))


@pytest.mark.parametrize("make, error, match", [
    (lambda: Float8Linear.from_linear(nn.Conv1d(16, 16, 1)), TypeError,
     r"Float8Linear.from_linear needs an nn.Linear, got Conv1d; valid: torch.nn.Linear"),
    (lambda: Float8Linear.from_linear(nn.Linear(32, 16), "fp4"), ValueError,
     r"unknown fp8 recipe 'fp4'; valid: 'tensorwise', 'delayed', 'rowwise'"),
    (lambda: Float8Linear.from_linear(nn.Linear(30, 16)), ValueError,
     r"Float8Linear\(30, 16\): in_features=30 and out_features=16 must both be positive multiples of 16"),
    (lambda: Float8Linear(32, 10), ValueError, r"out_features=10 must both be positive multiples of 16"),
    (lambda: Float8Linear(32, 16, config=Float8Config("delayed", amax_history_len=0)), ValueError,
     r"amax_history_len=0 is invalid; valid: an int >= 1"),
    (lambda: Float8Linear(32, 16, config=Float8Config(margin=-2)), ValueError,
     r"margin=-2 is invalid; valid: an int from 0 to 14"),
])
def test_bad_input_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_forward_rejects_wrong_feature_size():
    layer = Float8Linear(32, 16, config=Float8Config(emulate=True))
    with pytest.raises(ValueError, match=r"expected inputs with last dimension 32, got shape \(4, 31\)"):
        layer(torch.randn(4, 31))
