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


# --- O2's memory and its gradient move ------------------------------------------------------
def _peak_bytes_per_param(level: str, kind: str) -> float:
    """Peak bytes of live tensors over initialize and two steps of bench's small GPT
    (activations weigh as in training), per parameter."""
    from ampkit._measure import LiveTensorBytes
    from ampkit.bench.workloads import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab, (16, cfg.seq))
    n = sum(p.numel() for p in model.parameters())
    with LiveTensorBytes() as live:
        for param in model.parameters():
            live.track(param)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{kind: True})
        model, opt = ampkit.initialize(model, opt, opt_level=level, half_dtype=BF16,
                                       loss_scale="dynamic", verbosity=0)
        for _ in range(2):
            opt.zero_grad()
            with ampkit.scale_loss(model(tokens).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    return live.peak / n


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_o2_peak_memory_is_below_o1s(kind):
    o1, o2 = _peak_bytes_per_param("O1", kind), _peak_bytes_per_param("O2", kind)
    assert o2 < o1, (o1, o2)


def _move_cost(model: nn.Module, monkeypatch, accumulate: bool) -> tuple[int, int, int]:
    """(multi-tensor copies, Python calls, fp32 buffers) of one O2 gradient move of ``model``:
    into masters whose grads a step consumed, or (``accumulate``) into masters holding
    an earlier backward's."""
    import gc
    import sys

    from ampkit import _grad_move
    from ampkit.optim import master_weights_of

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    masters = master_weights_of(opt)
    width = model[0].in_features

    def backward() -> None:
        model(torch.randn(4, width)).float().sum().backward()

    backward()
    masters.move_grads()  # builds the bucket plan, once
    if not accumulate:
        masters.clear_master_grads()  # as a step does
    backward()
    copies, calls = [], 0
    copy = _grad_move.foreach_copy_
    monkeypatch.setattr(_grad_move, "foreach_copy_",
                        lambda dst, src: copies.append(len(dst)) or copy(dst, src))

    def profile(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    # No cycle collection inside the count: it runs finalizers (of earlier tests' tensors
    # too), whose calls are not the move's.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        masters.move_grads()
    finally:
        sys.setprofile(None)
        gc.enable()
    monkeypatch.undo()
    assert all(m.grad is not None and m.grad.dtype == torch.float32
               for m in masters.master_params)  # every gradient moved
    buckets = len({m.grad.untyped_storage().data_ptr() for m in masters.master_params})
    return len(copies), calls, buckets


@pytest.mark.parametrize("accumulate", [False, True])
def test_o2_gradient_move_costs_o_buckets_not_o_parameters(monkeypatch, accumulate):
    """4, 40 and 400 parameters: one multi-tensor copy per bucket, and Python calls that
    grow with the buckets (at most 8), not with the parameters."""
    def cost(layers: int) -> tuple[int, int, int]:
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
        return _move_cost(model, monkeypatch, accumulate)

    single, few, many = cost(2), cost(20), cost(200)
    assert single[0] == 0 and single[2] == 4  # one bucket of 4 gradients: a cast each
    assert (few[0], few[2]) == (2, 2)
    assert many[0] == many[2] == 8  # _BUCKETS
    # 360 more parameters and 6 more buckets: a call per parameter would add 360 or more.
    assert many[1] - few[1] < 360 // 4, (single, few, many)
