"""Which Linear layers to run in fp8: measured on the device, layer by layer.

An fp8 GEMM is faster than a bf16 one only where the matmul is large enough to pay for
its casts (on the project's reference H200, fp8 with a per-call cast of both operands
lost to bf16 at a d=1024 GPT's shapes and won at 8192x8192). A global switch picks wrong
at one end or the other. :func:`time_fp8_layers` records the input each eligible
nn.Linear sees in one forward of the model, then times that layer's forward and backward
at that shape in bf16 autocast and as a Float8Linear, interleaved, on the layer's
device; :func:`faster_fp8_layers` keeps the layers where fp8 was faster. ``autotune``
builds its fp8 candidate from them.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from .._batch import call_model
from .._checks import check_int
from ..autocast import autocast
from .config import Float8Config, Recipe
from .convert import ModuleFilter, eligible_linears
from .linear import Float8Linear


@dataclass(frozen=True)
class LayerTiming:
    """One layer's forward+backward time at the shape it sees, in bf16 and in fp8.

    Attributes:
        name: the layer's name in ``model.named_modules()``.
        rows: input rows per call (batch x sequence, as the layer saw them).
        in_features, out_features: the layer's shape.
        bf16_ms, fp8_ms: median time of one forward+backward of the layer alone.
    """

    name: str
    rows: int
    in_features: int
    out_features: int
    bf16_ms: float
    fp8_ms: float

    @property
    def speedup(self) -> float:
        """bf16's time over fp8's (above 1: fp8 is faster)."""
        return self.bf16_ms / self.fp8_ms

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "in_features": self.in_features,
                "out_features": self.out_features, "bf16_ms": self.bf16_ms,
                "fp8_ms": self.fp8_ms, "speedup": self.speedup}


def time_fp8_layers(model: nn.Module, inputs: Any, *,
                    recipe: Union[str, Recipe, Float8Config] = Recipe.TENSORWISE,
                    module_filter: Optional[ModuleFilter] = None, repeats: int = 10,
                    warmup: int = 3) -> list[LayerTiming]:
    """Time each fp8-eligible Linear of ``model`` alone, in bf16 and in fp8.

    One forward of the model on ``inputs`` under bf16 autocast and ``torch.no_grad`` records
    the rows each layer receives; the model's parameters, buffers (batch-norm statistics)
    and RNG state are left as they were. Each layer is then timed on copies of its
    weights: a random input of that shape, forward and backward, ``warmup`` untimed then
    ``repeats`` timed calls, bf16 and fp8 alternating.

    Args:
        model: the model (not modified).
        inputs: its input: a tuple of positional arguments (``model(*inputs)``), a dict
            of keyword ones (``model(**inputs)``), or one argument (``model(inputs)``).
        recipe: the fp8 recipe timed (as ``convert_to_fp8`` takes it).
        module_filter: as in ``convert_to_fp8``: False leaves a layer out.
        repeats, warmup: timed and untimed calls per layer and dtype.

    Returns:
        One LayerTiming per eligible layer that ran in the forward, in module order.
    """
    config = Float8Config.coerce(recipe)
    check_int("repeats", repeats, 1)
    check_int("warmup", warmup, 0)
    layers = eligible_linears(model, module_filter)
    rows = _rows_seen(model, inputs, layers)
    out = []
    for name, layer in layers:
        if name not in rows:
            continue  # not called in this forward
        bf16_ms, fp8_ms = _time_layer(layer, rows[name], config, repeats, warmup)
        out.append(LayerTiming(name, rows[name], layer.in_features, layer.out_features,
                               bf16_ms, fp8_ms))
    return out


def faster_fp8_layers(timings: list[LayerTiming], min_speedup: float = 1.0) -> list[str]:
    """The names of the layers whose fp8 time beat bf16's by more than ``min_speedup``."""
    return [t.name for t in timings if t.speedup > min_speedup]


def _rows_seen(model: nn.Module, inputs: Any, layers: list[tuple[str, nn.Linear]]) -> dict[str, int]:
    rows: dict[str, int] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, Tensor) and name not in rows:
                rows[name] = x.numel() // module.in_features
        return hook

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    handles = [layer.register_forward_pre_hook(record(name)) for name, layer in layers]
    try:
        with torch.no_grad(), autocast(device.type, dtype=torch.bfloat16):
            call_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return rows


def _time_layer(layer: nn.Linear, rows: int, config: Float8Config, repeats: int,
                warmup: int) -> tuple[float, float]:
    device = layer.weight.device
    bf16 = copy.deepcopy(layer).float().requires_grad_(True)
    fp8 = Float8Linear.from_linear(copy.deepcopy(bf16), config)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, layer.in_features, device=device, dtype=torch.bfloat16,
                    generator=gen).requires_grad_(True)
    grad = torch.randn(rows, layer.out_features, device=device, dtype=torch.bfloat16,
                       generator=gen)

    def call(module: nn.Module) -> None:
        with autocast(device.type, dtype=torch.bfloat16):
            y = module(x)
        y.backward(grad)
        module.zero_grad(set_to_none=True)
        x.grad = None

    times: dict[str, list[float]] = {"bf16": [], "fp8": []}
    for i in range(warmup + repeats):
        for key, module in (("bf16", bf16), ("fp8", fp8)):
            elapsed = _timed(call, module, device)
            if i >= warmup:
                times[key].append(elapsed)
    return statistics.median(times["bf16"]), statistics.median(times["fp8"])


def _timed(fn: Callable[[nn.Module], None], module: nn.Module, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(module)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    fn(module)
    return (time.perf_counter() - began) * 1e3


__all__ = ["LayerTiming", "faster_fp8_layers", "time_fp8_layers"]
