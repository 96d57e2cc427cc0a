"""Buffer tables (``_tables.py``): parameter-free modules whose floating buffers a half cast
would change stay fp32 under the policies that cast the model, as kept modules."""

import copy
import logging
import math

import pytest
import torch
from torch import nn

import ampkit
from ampkit import keep

HALF = [torch.float16, torch.bfloat16]


class Rotary(nn.Module):
    """transformers' Llama rotary embedding, reduced: positions times fp32 frequencies."""

    def __init__(self, dim: int = 64, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        angles = positions[:, None].float() * self.inv_freq.float()[None]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class Sinusoid(nn.Module):
    """The PyTorch tutorial's positional encoding: a fixed table added to the activations."""

    def __init__(self, dim: int = 8, length: int = 16) -> None:
        super().__init__()
        position = torch.arange(length, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
        table = torch.zeros(length, dim)
        table[:, 0::2] = torch.sin(position * div)
        table[:, 1::2] = torch.cos(position * div)
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[1]]


class Masked(nn.Module):
    """A parameter-free module whose float buffer every half dtype holds exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([0.0, float("-inf"), 0.5, -2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mask


class RopeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x, torch.arange(x.shape[0]) * 1000)
        return self.proj(x[:, :32] * cos + x[:, 32:] * sin)


class SinusoidNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.pos = Sinusoid()
        self.mask = Masked()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mask(self.head(self.pos(self.embed(x))))


def _initialize(model, level="O2", half=torch.bfloat16, **kwargs):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ampkit.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kwargs)


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_rotary_frequencies_stay_fp32_and_the_model_around_stays_half(level, half):
    torch.manual_seed(0)
    model = RopeNet()
    freqs = model.rotary.inv_freq.clone()
    model, _ = _initialize(model, level, half)
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, freqs)
    assert model.proj.weight.dtype == half
    assert keep.kept_names(model) == ["rotary"]
    x = torch.randn(8, 64)
    cos, sin = model.rotary(x.to(half), torch.arange(8) * 1000)
    angles = (torch.arange(8) * 1000)[:, None].float() * freqs[None]
    assert cos.dtype == half and sin.dtype == half
    assert torch.equal(cos, angles.cos().to(half)) and torch.equal(sin, angles.sin().to(half))
    out = model(x)
    assert out.dtype == (torch.float32 if level == "O2" else half)


def test_a_sinusoid_table_added_to_half_activations_stays_fp32_and_hands_half_on():
    torch.manual_seed(0)
    model = SinusoidNet()
    table = model.pos.table.clone()
    model, _ = _initialize(model, "O2", torch.float16)
    assert model.pos.table.dtype == torch.float32 and torch.equal(model.pos.table, table)
    h = torch.randn(2, 5, 8, dtype=torch.float16)
    # Computed in fp32 from the fp32 table, handed on in the half dtype it was given.
    assert torch.equal(model.pos(h), (h.float() + table[:5]).to(torch.float16))
    out = model(torch.randn(2, 5, 4))
    assert out.dtype == torch.float32 and torch.isfinite(out[..., [0, 2, 3]]).all()


def test_a_buffer_every_half_dtype_holds_exactly_is_cast_as_apex_cast_it():
    model, _ = _initialize(SinusoidNet(), "O2", torch.bfloat16)
    assert model.mask.mask.dtype == torch.bfloat16
    assert keep.kept_names(model) == ["pos"]


def test_tables_in_a_module_list_are_kept_one_by_one_not_their_container():
    model = nn.Sequential(nn.Linear(64, 64), nn.ModuleList([Rotary(), Rotary(dim=32)]))
    model, _ = _initialize(model)
    assert keep.kept_names(model) == ["1.0", "1.1"]
    assert all(r.inv_freq.dtype == torch.float32 for r in model[1])


def test_batch_norm_without_affine_parameters_follows_the_batch_norm_rule():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False))
    model[1].running_var.fill_(1.1)  # not held exactly by bf16
    model, _ = _initialize(model, "O3")
    assert model[1].running_var.dtype == torch.bfloat16 and keep.kept_names(model) == []
    model2 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False))
    model2[1].running_var.fill_(1.1)
    model2, _ = _initialize(model2, "O2")
    assert model2[1].running_var.dtype == torch.float32 and keep.kept_names(model2) == []


def test_fp32_policies_keep_nothing_and_the_users_selection_is_kept_beside_the_tables():
    model, _ = _initialize(RopeNet(), "O1")
    assert keep.kept_names(model) == [] and model.rotary.inv_freq.dtype == torch.float32
    model, _ = _initialize(RopeNet(), "O2", keep_fp32=["proj"])
    assert keep.kept_names(model) == ["rotary", "proj"]
    assert model.proj.weight.dtype == torch.float32


def test_a_table_kept_by_initialize_cannot_leave_the_selection():
    model, _ = _initialize(RopeNet())
    with pytest.raises(ValueError, match=r"'rotary' keeps fp32 buffers in a half model \(a buffer table"):
        ampkit.keep_fp32(model, [])
    assert keep.kept_names(model) == ["rotary"]


def test_initialize_again_restores_the_exact_fp32_table():
    torch.manual_seed(0)
    model = RopeNet()
    freqs = model.rotary.inv_freq.clone()
    model, _ = _initialize(model, "O2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = ampkit.initialize(model, opt, opt_level="O1", verbosity=0)
    assert torch.equal(model.rotary.inv_freq, freqs)


def test_a_persistent_table_is_saved_fp32_and_loads_into_an_fp32_model():
    torch.manual_seed(0)
    model = SinusoidNet()
    plain = copy.deepcopy(model)
    model, _ = _initialize(model, "O2")
    state = model.state_dict()
    assert state["pos.table"].dtype == torch.float32
    plain.load_state_dict(state)
    assert torch.equal(plain.pos.table, model.pos.table)


def test_a_table_the_user_casts_since_runs_as_it_would_unkept():
    model, _ = _initialize(RopeNet(), "O2", torch.float16)
    model.rotary.half()
    x = torch.randn(4, 64, dtype=torch.float16)
    cos, _ = model.rotary(x, torch.arange(4))
    expected = (torch.arange(4)[:, None].float() * model.rotary.inv_freq.float()[None]).cos()
    assert cos.dtype == torch.float16 and torch.equal(cos, expected.half())


def test_initialize_logs_the_tables_it_keeps(caplog):
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model = RopeNet()
        ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                          half_dtype=torch.bfloat16, verbosity=1)
    assert any("buffer tables" in r.getMessage() and "'rotary'" in r.getMessage()
               for r in caplog.records)
