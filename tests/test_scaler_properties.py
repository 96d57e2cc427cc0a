"""Property test: GradScaler follows a small reference model of its scale rules, step by step."""

import math
import struct
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampkit.scaler import GradScaler

F32_TINY = torch.finfo(torch.float32).tiny
F32_MAX = torch.finfo(torch.float32).max
BAD = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def f32(x: float) -> float:
    """Round a Python float to float32 (nearest-even), inf when out of range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass
class Reference:
    """The documented rules, written plainly: torch's update plus hysteresis and bounds."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    low: float
    high: float
    tracker: int = 0
    consecutive: int = 0
    steps: int = 0
    skipped: int = 0

    def update(self, overflow: bool) -> None:
        self.steps += 1
        if overflow:
            self.skipped += 1
            self.consecutive += 1
            self.tracker = 0
            if self.consecutive >= self.hysteresis:
                self.scale = f32(self.scale * self.backoff_factor)
        else:
            self.consecutive = 0
            self.tracker += 1
            if self.tracker == self.growth_interval:
                grown = f32(self.scale * self.growth_factor)
                self.scale = grown if math.isfinite(grown) else self.scale
                self.tracker = 0
        self.scale = min(max(self.scale, f32(self.low)), f32(self.high))


configs = st.fixed_dictionaries({
    "init_scale": st.one_of(st.integers(-20, 100).map(lambda e: 2.0**e),
                            st.floats(1e-3, 1e6, allow_nan=False)),
    "growth_factor": st.one_of(st.sampled_from([2.0, 4.0]), st.floats(1.01, 8.0)),
    "backoff_factor": st.one_of(st.just(0.5), st.floats(0.01, 0.99)),
    "growth_interval": st.integers(1, 4),
    "hysteresis": st.integers(1, 3),
    "min_scale": st.one_of(st.none(), st.floats(1e-4, 1.0)),
    "max_scale": st.one_of(st.none(), st.floats(2.0**8, 2.0**40)),
})
events = st.lists(st.sampled_from(["clean", "clean", "inf", "-inf", "nan"]), min_size=1, max_size=25)


def _optimizer(kind: str, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    if kind == "fused":  # the device-side skip: found_inf handed to the optimizer
        return torch.optim.AdamW([param], lr=0.01, fused=True)
    return torch.optim.SGD([param], lr=0.01, momentum=0.9)


def _step(scaler, param, opt, event):
    opt.zero_grad()
    x = torch.tensor([0.5, -0.25, 1.0])  # |x| <= 1: a clean scaled gradient stays finite
    scaler.scale((param * x).sum()).backward()
    if event != "clean":
        param.grad[1] = BAD[event]
    scaler.step(opt)
    scaler.update()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, sequence=events, kind=st.sampled_from(["plain", "fused"]))
def test_scaler_follows_the_reference_rules(config, sequence, kind):
    scaler = GradScaler("cpu", **config)
    low = F32_TINY if config["min_scale"] is None else config["min_scale"]
    high = F32_MAX if config["max_scale"] is None else config["max_scale"]
    ref = Reference(f32(min(max(config["init_scale"], low), high)), config["growth_factor"],
                    config["backoff_factor"], config["growth_interval"], config["hysteresis"],
                    low, high)
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = _optimizer(kind, param)
    # With torch's rule (no hysteresis, no bounds) a torch.amp.GradScaler run is a second
    # reference, bitwise, until its scale leaves float32's normal range (ours clamps there).
    twin = None
    if config["hysteresis"] == 1 and config["min_scale"] is None and config["max_scale"] is None:
        twin_param = torch.nn.Parameter(param.detach().clone())
        twin = (torch.amp.GradScaler("cpu", **{k: config[k] for k in (
            "init_scale", "growth_factor", "backoff_factor", "growth_interval")}),
            twin_param, _optimizer(kind, twin_param))
    for event in sequence:
        before = param.detach().clone()
        _step(scaler, param, opt, event)
        overflow = event != "clean"
        ref.update(overflow)
        assert scaler.get_scale() == ref.scale, (event, scaler.get_scale(), ref.scale)
        assert scaler._get_growth_tracker() == ref.tracker
        assert scaler.last_step_skipped == overflow
        assert torch.equal(param, before) == overflow  # skipped exactly when it overflowed
        assert torch.isfinite(param).all()
        assert 0.0 < ref.scale < math.inf
        if twin is not None:
            _step(*twin, event)
            if twin[0].get_scale() < F32_TINY:
                twin = None
            else:
                assert twin[0].get_scale() == ref.scale and torch.equal(twin[1], param)
    stats = scaler.stats()
    assert (stats.scale, stats.steps, stats.skipped_steps, stats.consecutive_skips) == (
        ref.scale, ref.steps, ref.skipped, ref.consecutive)
