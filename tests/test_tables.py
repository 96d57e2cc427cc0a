"""Buffer tables (``_tables.py``): parameter-free modules whose floating buffers a half cast
changes are cast as apex cast them, with a warning naming the keep_fp32 patterns that keep
them fp32, which the tests here follow too."""

import math
import warnings

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=half,
                                       verbosity=0, **kwargs)
    said = [str(w.message) for w in caught if "without parameters" in str(w.message)]
    return model, said


class ReadsTheTable(nn.Module):
    """Reads its table's buffer directly, never calling its forward (timm's rotary
    embeddings are used through a method)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = Sinusoid()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.pos.table[: x.shape[1]])


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_casting_rotary_frequencies_warns_naming_the_keep_fp32_patterns(level, half):
    """A bf16 inv_freq puts a Llama-style embedding's phase off by up to 5 rad at position
    4096 (benchmarks/rope_phase.py); the cast was silent."""
    model, said = _initialize(RopeNet(), level, half)
    assert model.rotary.inv_freq.dtype == half  # cast, as apex cast it
    assert len(said) == 1 and "'rotary.inv_freq'" in said[0]
    assert "pass keep_fp32=['rotary'] to ampkit.initialize" in said[0]


@pytest.mark.parametrize("half", HALF)
def test_the_advised_keep_fp32_keeps_the_phase_exact_and_hands_half_on(half):
    torch.manual_seed(0)
    model = RopeNet()
    freqs = model.rotary.inv_freq.clone()
    model, said = _initialize(model, "O2", half, keep_fp32=["rotary"])
    assert said == [] and model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, freqs) and model.proj.weight.dtype == half
    positions = torch.arange(8) * 1000
    cos, sin = model.rotary(torch.randn(8, 64).to(half), positions)
    angles = positions[:, None].float() * freqs[None]
    assert torch.equal(cos, angles.cos().to(half)) and torch.equal(sin, angles.sin().to(half))
    assert model(torch.randn(8, 64)).dtype == torch.float32


def test_only_tables_whose_values_change_are_named():
    model, said = _initialize(SinusoidNet(), "O2", torch.float16)
    assert len(said) == 1 and "'pos.table'" in said[0] and "'mask" not in said[0]
    assert model.mask.mask.dtype == torch.float16


def test_a_model_reading_a_table_directly_still_runs_as_under_apex():
    """Keeping tables fp32 unasked broke this model (an fp32 buffer met half activations)."""
    model, said = _initialize(ReadsTheTable(), "O2", torch.bfloat16)
    assert len(said) == 1 and model(torch.randn(2, 5, 8)).dtype == torch.float32


def test_tables_in_a_module_list_are_named_one_by_one_not_their_container():
    model = nn.Sequential(nn.Linear(64, 64), nn.ModuleList([Rotary(), Rotary(dim=32)]))
    _, said = _initialize(model)
    assert len(said) == 1 and "keep_fp32=['*.0', '*.1']" in said[0]
    assert keep.select(model, ['*.0', '*.1']) == ['1.0', '1.1']


def test_batch_norm_fp32_policies_and_kept_modules_are_not_named():
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False))
    bn[1].running_var.fill_(1.1)  # not held exactly by bf16
    assert _initialize(bn, "O3")[1] == []
    assert _initialize(RopeNet(), "O1")[1] == []
    assert _initialize(ampkit.keep_fp32(RopeNet(), ["rotary"]), "O2")[1] == []


def test_a_kept_table_cannot_leave_the_selection_after_initialize():
    model, _ = _initialize(RopeNet(), "O2", keep_fp32=["rotary"])
    with pytest.raises(ValueError, match=r"'rotary' keeps fp32 buffers in a half model"):
        ampkit.keep_fp32(model, [])
    assert keep.kept_names(model) == ["rotary"]


def test_a_kept_table_the_user_casts_since_runs_as_it_would_unkept():
    model, _ = _initialize(RopeNet(), "O2", torch.float16, keep_fp32=["rotary"])
    model.rotary.half()
    x = torch.randn(4, 64, dtype=torch.float16)
    cos, _ = model.rotary(x, torch.arange(4))
    expected = (torch.arange(4)[:, None].float() * model.rotary.inv_freq.float()[None]).cos()
    assert cos.dtype == torch.float16 and torch.equal(cos, expected.half())
