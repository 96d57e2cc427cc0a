"""Host-side cost per training step against torch.amp: device ops dispatched and host syncs.

Counted with a TorchDispatchMode over one warmed-up step of the 10-100-10 MLP (bf16,
AdamW foreach and fused), for every ampkit path, with ampkit's logger silent and listening.
Times are a benchmark's business (benchmarks/bench_host.py), not a test's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit

BF16 = torch.bfloat16
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "_local_scalar_dense", "detach",
                "alias", "lift_fresh", "_record_function_enter_new",
                "_record_function_exit"}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            # A host copy of a flag, read after its transfer completed, is no sync.
            self.syncs += not getattr(args[0], "_ampkit_host_copy", False)
        elif not func.is_view and name not in _NOT_KERNELS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _setup(kind: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True}), torch.randn(64, 10)


def _torch_amp(kind, scaler_cls=torch.amp.GradScaler, autocast=torch.autocast):
    model, opt, x = _setup(kind)
    scaler = scaler_cls("cpu")

    def step(overflow: bool) -> None:
        opt.zero_grad()
        with autocast("cpu", dtype=BF16):
            loss = model(x).float().pow(2).mean() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


def _apex(level):
    def build(kind):
        model, opt, x = _setup(kind)
        model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=BF16,
                                       loss_scale="dynamic", verbosity=2)

        def step(overflow: bool) -> None:
            opt.zero_grad()
            loss = model(x).float().pow(2).mean() * (float("inf") if overflow else 1.0)
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return step
    return build


PATHS = {"torch-style": lambda kind: _torch_amp(kind, ampkit.GradScaler, ampkit.autocast),
         "O1": _apex("O1"), "O2": _apex("O2")}


def _count(step, overflow: bool) -> _Count:
    for _ in range(2):
        step(False)  # warm-up: optimizer state, scaler tensors
    with _Count() as count:
        step(overflow)
    return count


@pytest.mark.parametrize("listening", [False, True])
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_no_more_device_ops_or_host_syncs_per_step_than_torch_amp(path, kind, overflow, listening,
                                                                  caplog):
    caplog.set_level(logging.DEBUG if listening else logging.CRITICAL, logger="ampkit")
    reference = _count(_torch_amp(kind), overflow)
    ours = _count(PATHS[path](kind), overflow)
    assert ours.syncs <= reference.syncs
    if not listening:  # a listening logger may cost a copy of the flag to the host
        assert ours.kernels <= reference.kernels
