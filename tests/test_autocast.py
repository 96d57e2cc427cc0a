import contextlib
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit import _state, overrides
from ampkit._torch_compat import TORCH_GE_2_12
from ampkit.autocast import autocast
from conftest import DEVICES, HALF_DTYPES


def _inputs(device):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    return {
        "a": r(8, 16), "b": r(16, 8), "w": r(8, 16), "bias": r(8), "img": r(2, 3, 8, 8),
        "k": r(4, 3, 3, 3), "x3": r(2, 8, 16), "y3": r(2, 16, 4), "t": torch.tensor([1, 0, 3, 2]).to(device),
        "h": r(8, 16).to(torch.float16), "n": r(4, 16),
    }


OPS = {
    "mm": lambda i: torch.mm(i["a"], i["b"]),
    "matmul": lambda i: torch.matmul(i["x3"], i["y3"]),
    "linear": lambda i: F.linear(i["a"], i["w"], i["bias"]),
    "conv2d": lambda i: F.conv2d(i["img"], i["k"], padding=1),
    "bmm": lambda i: torch.bmm(i["x3"], i["y3"]),
    "softmax": lambda i: torch.softmax(torch.mm(i["a"], i["b"]), dim=-1),
    "log_softmax": lambda i: F.log_softmax(torch.mm(i["a"], i["b"]), dim=-1),
    "layer_norm": lambda i: F.layer_norm(torch.mm(i["a"], i["b"]), (8,)),
    "cross_entropy": lambda i: F.cross_entropy(torch.mm(i["n"], i["b"]), i["t"]),
    "sum": lambda i: torch.mm(i["a"], i["b"]).sum(),
    "cat": lambda i: torch.cat([torch.mm(i["a"], i["b"]), i["a"][:, :8]]),
    "add_mixed": lambda i: torch.mm(i["a"], i["b"]) + i["a"][:, :8],
    "add_half_float": lambda i: i["h"] + i["a"],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("op", sorted(OPS))
def test_ops_match_torch_autocast_bitwise(device, dtype, op):
    inputs = _inputs(device)
    with torch.autocast(device, dtype=dtype):
        expected = OPS[op](inputs)
    with autocast(device, dtype=dtype):
        got = OPS[op](inputs)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("float16", torch.float16),
                                         ("half", torch.float16), ("bfloat16", torch.bfloat16)])
def test_dtype_names(name, dtype):
    with autocast("cpu", dtype=name) as ctx:
        assert ctx.fast_dtype is dtype
        assert torch.get_autocast_dtype("cpu") is dtype
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype is dtype


def test_device_and_dtype_inferred():
    ctx = autocast()
    assert ctx.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert ctx.fast_dtype is torch.get_autocast_dtype(ctx.device_type)


def test_inferred_from_active_initialize():
    _state.set_active(_state.ActiveAmp("cpu", torch.float16))
    ctx = autocast()
    assert (ctx.device_type, ctx.fast_dtype) == ("cpu", torch.float16)
    assert autocast("cpu", dtype="bf16").fast_dtype is torch.bfloat16


def test_state_restored_and_nesting():
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with autocast("cpu", dtype=torch.float16):
        with autocast("cpu", dtype=torch.bfloat16):
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.bfloat16
            with autocast("cpu", enabled=False):
                assert not torch.is_autocast_enabled("cpu")
                assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.float32
            assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is torch.float16
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before


def test_exception_inside_restores_state():
    with pytest.raises(KeyError):
        with autocast("cpu", dtype=torch.bfloat16):
            raise KeyError("boom")
    assert not torch.is_autocast_enabled("cpu")
    assert torch.get_autocast_dtype("cpu") is torch.bfloat16
    assert overrides.active_frame() is None and overrides._open_regions == []


def test_cache_enabled_is_passed_through():
    with autocast("cpu", cache_enabled=False):
        assert not torch.is_autocast_cache_enabled()
    with autocast("cpu", cache_enabled=True):
        assert torch.is_autocast_cache_enabled()


def test_decorator():
    @autocast("cpu", dtype="bf16")
    def f(a, b):
        return torch.mm(a, b)

    assert f(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert f.__name__ == "f"


def test_other_threads_unaffected():
    seen = {}

    def worker():
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        seen["dtype"] = torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype

    with autocast("cpu", dtype="bf16"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == {"enabled": False, "dtype": torch.float32}


def test_compiled_function_called_inside():
    def f(a, b):
        return torch.mm(a, b).relu()

    compiled = torch.compile(f, backend="eager")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = f(a, b)
    with autocast("cpu", dtype=torch.bfloat16):
        got = compiled(a, b)
    assert got.dtype is torch.bfloat16 and torch.equal(got, expected)


def test_backward_through_autocast_gives_fp32_grads():
    w = torch.randn(4, 4, requires_grad=True)
    with autocast("cpu", dtype="bf16"):
        out = torch.mm(torch.randn(2, 4), w)
    out.float().sum().backward()
    assert out.dtype is torch.bfloat16 and w.grad.dtype is torch.float32


def test_exported():
    assert ampkit.autocast is autocast


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"device_type": "gpu"}, ValueError, r"unknown device type 'gpu'; valid: 'cpu', 'cuda'"),
    ({"dtype": "fp8"}, ValueError, r"unknown autocast dtype 'fp8'; valid names: .*bf16"),
    ({"dtype": torch.int8}, ValueError, r"autocast dtype torch.int8 is not a floating dtype"),
    ({"enabled": "yes"}, TypeError, r"enabled must be a bool, got 'yes'"),
    ({"enabled": "False"}, TypeError, r"enabled must be a bool, got 'False'; valid: True, False"),
    ({"enabled": 0}, TypeError, r"enabled must be a bool, got 0; valid: True, False"),
    ({"cache_enabled": "yes"}, TypeError,
     r"cache_enabled must be a bool or None, got 'yes'; valid: True, False, None"),
    ({"device_type": torch.device("cpu")}, ValueError,
     r"device_type must be a str such as 'cpu' or 'cuda', got device\(type='cpu'\).*device.type"),
    ({"device_type": 0}, ValueError, r"device_type must be a str such as 'cpu' or 'cuda', got 0"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        autocast(**kwargs)


def test_region_inside_a_compiled_function_even_when_first_seen_there(monkeypatch):
    """Also compiled once: tracing filled the device-name cache, or an eager region filled
    the resolution cache, the graph was guarded on their contents, and the next call
    compiled again."""
    module = sys.modules["ampkit.autocast"]
    monkeypatch.setattr(module, "_RESOLVED", {})  # nothing resolved eagerly before
    monkeypatch.setattr(module, "_CHECKED_DEVICES", {})  # no device name checked before
    graphs = []

    def counting(gm, example_inputs):  # a backend: one call per graph compiled
        graphs.append(gm)
        return gm.forward

    def f(a, b):
        with autocast("cpu", dtype=torch.bfloat16):
            return torch.mm(a, b).relu()

    torch._dynamo.reset()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    compiled = torch.compile(f, backend=counting)
    got = compiled(a, b)
    assert torch.equal(compiled(a, b), got)
    with autocast("cpu", dtype=torch.bfloat16):  # an eager region fills the caches
        torch.mm(a, b)
    assert torch.equal(compiled(a, b), got)
    assert len(graphs) <= 1  # one graph (torch 2.13); none where the region breaks it (2.11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.mm(a, b).relu()
    assert got.dtype is torch.bfloat16 and torch.equal(got, expected)
    assert not torch.is_autocast_enabled("cpu")


def _error_torch_raises(kwargs):
    """The type of error torch.autocast raises for kwargs; torch's state is put back after."""
    state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
             torch.is_autocast_cache_enabled(), torch.autocast_increment_nesting() - 1)
    try:
        with torch.autocast(**kwargs):
            pass
    except Exception as err:  # noqa: BLE001 - the type is what is compared
        return type(err)
    finally:  # torch leaves autocast on, and nested, for some of these
        torch.set_autocast_enabled("cpu", state[0])
        torch.set_autocast_dtype("cpu", state[1])
        torch.set_autocast_cache_enabled(state[2])
        while torch.autocast_decrement_nesting() > state[3]:
            pass
    raise AssertionError(f"torch.autocast accepted {kwargs}")


@pytest.mark.parametrize("kwargs", [{"device_type": torch.device("cpu")}, {"device_type": "gpu"},
                                    {"device_type": "cpu", "enabled": "False"},
                                    {"device_type": "cpu", "cache_enabled": "yes"}])
def test_bad_arguments_raise_what_torch_raises_before_anything_changes(kwargs):
    """Code written for torch.amp catches the same error types; autocast stays off."""
    expected = _error_torch_raises(kwargs)
    with pytest.raises(expected):
        autocast(**kwargs)
    assert not torch.is_autocast_enabled("cpu")


def test_unknown_device_is_both_a_value_error_and_a_runtime_error():
    for expected in (ValueError, RuntimeError):
        with pytest.raises(expected, match=r"unknown device type 'gpu'; valid: 'cpu', 'cuda'"):
            autocast("gpu")


def test_calling_with_a_non_callable_raises_at_once_as_torch_does():
    if TORCH_GE_2_12:  # torch checks it since 2.12; ampkit on every supported torch
        with pytest.raises(TypeError, match=r"requires a callable, but got Tensor"):
            torch.autocast("cpu")(torch.ones(2))
    with pytest.raises(TypeError, match=r"autocast\(\)\(func\) requires a callable, but got Tensor"):
        autocast("cpu")(torch.ones(2))


@pytest.mark.parametrize("kwargs", [{}, {"dtype": torch.float16, "cache_enabled": False},
                                    {"enabled": False}, {"dtype": torch.bfloat16}])
def test_instance_attributes_are_torchs(kwargs):
    reference = torch.autocast("cpu", **kwargs)
    ours = autocast("cpu", **kwargs)
    assert {k: getattr(ours, k) for k in vars(reference)} == vars(reference)


def _no_lookup(*args, **kwargs):
    raise AssertionError("ampkit looked up torch.autocast at call time")


@pytest.mark.parametrize("replacement", [autocast, _no_lookup])
def test_ampkit_never_looks_up_torch_autocast(monkeypatch, replacement):
    """`torch.autocast = ampkit.autocast` (a common monkeypatch) must not recurse."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        expected = torch.mm(a, b)
    ampkit.register_float_function(F, "softmax")
    monkeypatch.setattr(sys.modules["ampkit.autocast"], "_RESOLVED", {})  # torch's class is asked again
    monkeypatch.setattr(torch, "autocast", replacement)
    region = torch.autocast if replacement is autocast else autocast

    @region("cpu", dtype=torch.float16)
    def f(x, y):
        return torch.mm(x, y), F.softmax(x.half(), dim=-1), ampkit.float_function(torch.mm)(x, y)

    with region("cpu", dtype=torch.float16):
        got = torch.mm(a, b)
        with ampkit.disable_casts():
            assert torch.mm(a, b).dtype is torch.float32
    mm, softmax, forced = f(a, b)
    assert torch.equal(got, expected) and torch.equal(mm, expected)
    assert softmax.dtype is torch.float32 and forced.dtype is torch.float32
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float8_e4m3fn],
                         ids=str)
def test_a_dtype_the_device_lacks_warns_and_disables_as_torch_does(dtype):
    """(An fp8 dtype raised ValueError, where torch warns and disables.)"""
    with pytest.warns(UserWarning, match="Disabling autocast") as expected:
        torch.autocast("cpu", dtype=dtype)
    for _ in range(2):  # every construction warns, as torch's does
        with pytest.warns(UserWarning, match="Disabling autocast") as got:
            region = autocast("cpu", dtype=dtype)
        assert [w.category for w in got] == [w.category for w in expected]
    with region:
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.float32
    assert (region.fast_dtype, region._enabled) == (dtype, False)


@pytest.mark.parametrize("dtype, operand", [(torch.float64, torch.float32),
                                            (torch.float32, torch.bfloat16)], ids=str)
def test_a_dtype_the_device_lacks_disables_the_region_under_compile_too(dtype, operand):
    """Traced by torch.compile, the region skipped torch's check and switched autocast on
    in that dtype: an fp32 mm came out fp64, a bf16 one fp32."""
    import torch._dynamo

    def f(a, b):
        with autocast("cpu", dtype=dtype):
            return torch.mm(a, b)
    a = torch.randn(4, 4, dtype=operand)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager construction's "Disabling autocast"
        assert f(a, a).dtype is operand
        assert torch.compile(f, backend="eager")(a, a).dtype is operand
    assert not torch.is_autocast_enabled("cpu")


def test_a_non_floating_dtype_is_refused_naming_what_is_valid():
    with pytest.raises(ValueError, match=r"autocast dtype torch.int8 is not a floating dtype; "
                                         r"valid: torch.float16 or torch.bfloat16.*fp8\) warns"):
        autocast("cpu", dtype=torch.int8)


def test_an_instance_entered_again_while_open_under_a_function_mode_exits_cleanly():
    """Under a TorchFunctionMode (`with torch.device(...)`) the outer exit raised
    AttributeError and left autocast on; each entry now has its own torch.autocast, so
    both exits put back what was there (torch's own instance leaves autocast on, as
    ampkit's does without a mode)."""
    results = []
    for make in (torch.autocast, autocast):
        torch.set_autocast_enabled("cpu", False)
        region = make("cpu", dtype=torch.float16)
        with torch.device("cpu"):
            with region:
                with region:
                    inner = torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
                middle = torch.is_autocast_enabled("cpu")
        results.append((inner, middle, torch.is_autocast_enabled("cpu")))
    torch.set_autocast_enabled("cpu", False)
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    assert results[1][:2] == results[0][:2] == (torch.float16, True)
    assert results[1][2] is False


def test_one_instance_entered_by_several_threads_at_once():
    """A region kept on a module that DataParallel's replicas share: entering it from
    several threads at once must never fail (an attempt at nesting support raised
    "cannot unpack non-iterable NoneType")."""
    region = autocast("cpu", dtype=torch.bfloat16)
    errors = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often, as on a busy machine

    def work():
        try:
            for _ in range(5000):
                with region:
                    pass
        except Exception as err:  # noqa: BLE001 - any failure is the finding
            errors.append(err)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.setswitchinterval(interval)
    assert errors == []


def test_a_decorated_function_warns_once_at_decoration_not_per_call():
    with pytest.warns(UserWarning, match="Disabling autocast"):
        f = autocast("cpu", dtype=torch.float64)(torch.mm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.float32


class _ExportedRegion(torch.nn.Module):
    def __init__(self, region):
        super().__init__()
        self.region = region

    def forward(self, a, b):
        with self.region("cpu", dtype=torch.bfloat16):
            return torch.mm(a, b)


def test_torch_export_records_the_region_as_it_records_torchs():
    """Non-strict export traces under a torch-function mode, where torch.autocast records it.

    torch 2.5's non-strict export drops torch.autocast's own region too (fp32 out).
    """
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ours = torch.export.export(_ExportedRegion(autocast), (a, b), strict=False).module()(a, b)
    theirs = torch.export.export(_ExportedRegion(torch.autocast), (a, b), strict=False).module()(a, b)
    assert ours.dtype is theirs.dtype and torch.equal(ours, theirs)
    if theirs.dtype is torch.bfloat16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(ours, torch.mm(a, b))
    assert not torch.is_autocast_enabled("cpu") and overrides._local.frames == []


@pytest.mark.xfail(strict=True, reason="dynamo cannot trace ampkit.autocast's switches into a "
                   "strict export: torch 2.5 and 2.11 raise Unsupported, 2.13 drops the region")
def test_strict_torch_export_records_the_region():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    exported = torch.export.export(_ExportedRegion(autocast), (a, b), strict=True)
    assert exported.module()(a, b).dtype is torch.bfloat16


def test_repr_survives_an_instance_whose_init_never_ran():
    """dynamo (torch 2.5) builds one to word a graph break; a raising repr made it an error."""
    assert repr(autocast.__new__(autocast)) == "ampkit.autocast(device_type='?', dtype=?, enabled=?)"


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.autocast's view of CUDA made up: GPUs 0 and 1, only 0 has bf16; yields the current."""
    import torch.cuda.amp.common as cuda_amp

    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_amp, "amp_definitely_not_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: current[0] == 0)
    return current


def test_cuda_bf16_is_resolved_anew_after_the_current_device_changed(fake_cuda):
    """torch asks the current device whether it has bf16: a cached answer must not outlive it."""
    assert autocast("cuda", dtype=torch.bfloat16)._enabled is True
    fake_cuda[0] = 1  # torch.cuda.set_device(1): a GPU without bf16
    with pytest.raises(RuntimeError, match="does not support bfloat16"):
        torch.autocast("cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not support bfloat16"):
        autocast("cuda", dtype=torch.bfloat16)
    assert autocast("cuda", dtype=torch.float16)._enabled is True  # fp16 does not ask the device
    fake_cuda[0] = 0
    assert autocast("cuda", dtype=torch.bfloat16)._enabled is True


def test_cuda_is_resolved_anew_once_torch_xla_makes_amp_available(monkeypatch):
    """Without a GPU torch disables CUDA autocast unless torch_xla is importable; that can change."""
    import torch.cuda.amp.common as cuda_amp

    available = [False]
    monkeypatch.setattr(cuda_amp, "amp_definitely_not_available", lambda: not available[0])
    with pytest.warns(UserWarning, match="Disabling"):  # torch's wording differs by release
        assert autocast("cuda", dtype=torch.float16)._enabled is False
    available[0] = True  # torch_xla installed since
    assert autocast("cuda", dtype=torch.float16)._enabled is True
