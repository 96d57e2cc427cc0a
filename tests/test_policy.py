import pytest
import torch

import ampkit
from ampkit.policy import OPT_LEVELS, Policy, get_policy, preset_names

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips_through_str(name):
    p = get_policy(name)
    assert get_policy(str(p)) == p


@pytest.mark.parametrize("name, expected", [
    ("O0", (F32, F32, F32, False, False, 1.0)),
    ("O1", (F32, F16, F32, True, False, "dynamic")),
    ("O2", (F16, F16, F32, False, True, "dynamic")),
    ("O3", (F16, F16, F16, False, False, 1.0)),
    ("32-true", (F32, F32, F32, False, False, 1.0)),
    ("16-mixed", (F32, F16, F32, True, False, "dynamic")),
    ("bf16-mixed", (F32, BF16, F32, True, False, 1.0)),
    ("16-true", (F16, F16, F16, False, False, 1.0)),
    ("bf16-true", (BF16, BF16, BF16, False, False, 1.0)),
])
def test_presets(name, expected):
    p = get_policy(name)
    got = (p.param_dtype, p.compute_dtype, p.output_dtype, p.autocast, p.master_weights, p.loss_scale)
    assert got == expected


def test_batchnorm_kept_fp32_except_pure_half():
    assert get_policy("O2").keep_batchnorm_fp32 is True
    assert get_policy("O3").keep_batchnorm_fp32 is False


def test_aliases():
    assert get_policy("fp32") == get_policy("32-true")
    assert get_policy("fp16-mixed") == get_policy("16-mixed")
    assert str(get_policy("fp32")) == "32-true"


@pytest.mark.parametrize("text", [
    "params=float32,compute=bfloat16,output=float32",
    "p=f32,c=bf16,o=f32",
    "p=float,c=bfloat16,o=fp32",
    " p = f32 , c = bf16 , o=float32 ",
])
def test_explicit_form_long_and_short(text):
    assert get_policy(text) == get_policy("bf16-mixed")


def test_cascading_defaults():
    p = get_policy("p=bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (BF16, BF16, BF16)
    q = get_policy("p=f32,c=f16")
    assert (q.output_dtype, q.autocast, q.loss_scale) == (F16, True, "dynamic")


@pytest.mark.parametrize("text", [
    "p=bf16",
    "p=f16,c=f16,o=f32,master=1,bn=0,scale=128.0",
    "p=f32,c=bf16,o=bf16",
    "p=f16,c=f16,o=f32,master=1,scale=dynamic",
])
def test_explicit_round_trip(text):
    p = get_policy(text)
    assert get_policy(str(p)) == p


def test_opt_levels_with_bf16_round_trip():
    for level in OPT_LEVELS:
        p = get_policy(level).with_half_dtype(torch.bfloat16)
        assert p.half_dtype in (None, BF16)
        assert get_policy(str(p)) == p


def test_policy_is_frozen():
    with pytest.raises(Exception):
        get_policy("O1").param_dtype = F16  # type: ignore[misc]


def test_exported():
    assert ampkit.get_policy is get_policy and ampkit.Policy is Policy


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'O4'.*O0, O1, O2, O3.*bf16-mixed"):
        get_policy("O4")


@pytest.mark.parametrize("text, match", [
    ("p=f8", r"unknown param_dtype 'f8'.*valid names: .*bf16"),
    ("x=f32", r"bad policy item 'x=f32'.*valid keys"),
    ("p=f32,scale=-1", r"loss_scale -1.0 is neither 'dynamic' nor a positive"),
    ("p=f32,scale=abc", r"loss_scale='abc'.*'dynamic' or a positive number"),
    ("p=f32,master=1", r"master_weights=True\) needs half parameters"),
    ("p=f32,c=f32,autocast=yes", r"autocast=True\) needs a half compute_dtype"),
    ("p=f16,autocast=maybe", r"autocast='maybe'.*valid: 1/0"),
])
def test_bad_explicit_forms(text, match):
    with pytest.raises(ValueError, match=match):
        get_policy(text)


def test_bad_types():
    with pytest.raises(TypeError, match="policy must be a name"):
        get_policy(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Policy.param_dtype=torch.int8"):
        Policy(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="loss_scale must be 'dynamic' or a positive number"):
        Policy(loss_scale=True)  # type: ignore[arg-type]


def test_with_half_dtype_rejects_non_half():
    with pytest.raises(ValueError, match="half_dtype.*float32.*valid"):
        get_policy("O2").with_half_dtype(torch.float32)


def test_a_key_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"sets param_dtype twice \(item 'p=bf16'\)"):
        get_policy("p=f32,p=bf16,c=bf16,o=f32")


@pytest.mark.parametrize("field", ["autocast", "master_weights", "keep_batchnorm_fp32"])
@pytest.mark.parametrize("bad", ["yes", "False", 1, None])
def test_bool_fields_must_be_bools(field, bad):
    with pytest.raises(TypeError, match=rf"Policy.{field}={bad!r} must be a bool; valid: True, False"):
        Policy(param_dtype=F16, compute_dtype=F16, **{field: bad})


def test_a_bad_bool_field_is_refused_by_replace_too():
    with pytest.raises(TypeError, match=r"Policy.autocast='yes' must be a bool"):
        get_policy("O1").replace(autocast="yes")
