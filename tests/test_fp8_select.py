"""Per-layer fp8 choice (ampkit.fp8.select): which layers, at which shapes, measured how."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampkit.fp8 import Float8Config
from ampkit.fp8.convert import eligible_linears
from ampkit.fp8.select import LayerTiming, faster_fp8_layers, time_fp8_layers

EMU = Float8Config("tensorwise", emulate=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.norm = nn.BatchNorm1d(8)        # training mode: its forward moves running stats
        self.odd = nn.Linear(64, 10)         # 10 is not a multiple of 16: not eligible
        self.unused = nn.Linear(32, 32)      # eligible, never called
        self.drop = nn.Dropout(0.5)          # draws from the RNG

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.drop(self.norm(self.up(x))))


def test_eligible_linears_are_the_layers_convert_would_swap():
    assert [name for name, _ in eligible_linears(Net())] == ["up", "unused"]
    assert [name for name, _ in eligible_linears(Net(), lambda m, fqn: fqn != "up")] == ["unused"]
    bare = nn.Linear(32, 16)
    assert eligible_linears(bare) == [("", bare)]
    assert eligible_linears(nn.Linear(30, 16)) == []


def test_rows_are_what_each_layer_saw_and_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 8, 32)  # 4 x 8 rows reach `up`
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    timings = time_fp8_layers(model, x, recipe=EMU, repeats=1, warmup=0)
    assert [(t.name, t.rows, t.in_features, t.out_features) for t in timings] == [("up", 32, 32, 64)]
    assert all(t.bf16_ms > 0 and t.fp8_ms > 0 for t in timings)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BN stats too
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(type(m) is not nn.Linear or m.weight.dtype == torch.float32 for m in model.modules())


def test_faster_layers_are_those_fp8_beat_by_the_margin():
    timings = [LayerTiming("a", 16, 32, 32, bf16_ms=2.0, fp8_ms=1.0),
               LayerTiming("b", 16, 32, 32, bf16_ms=1.0, fp8_ms=1.0),
               LayerTiming("c", 16, 32, 32, bf16_ms=1.0, fp8_ms=2.0)]
    assert faster_fp8_layers(timings) == ["a"]
    assert faster_fp8_layers(timings, min_speedup=2.0) == []
    assert timings[0].speedup == 2.0 and timings[0].to_dict()["speedup"] == 2.0


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                        (True, TypeError)])
def test_bad_repeats_are_refused_before_running(bad, error):
    with pytest.raises(error, match=f"repeats must be an int >= 1, got .*{bad!r}"):
        time_fp8_layers(Net(), torch.randn(2, 8, 32), recipe=EMU, repeats=bad)
