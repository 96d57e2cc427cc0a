"""Set-up cost against model size: keep_fp32, convert_to_fp8 and initialize, on the CPU.

One-off work, but paid again at every ``initialize`` of a kept model and in every sweep
that builds models in a loop: it must grow linearly with the model. The model is N blocks
of ``Linear(16, 16)`` and ``LayerNorm(16)``; each call is timed once on a fresh model (wall
ms), and the Python calls it makes are counted with ``sys.setprofile`` (exact: a busy
machine cannot blur them). Linear growth shows as calls per block staying flat.

Then what a kept module costs at every step: the Python calls of one forward and backward
of a 10-block model with every LayerNorm kept, against none kept, under bf16 autocast and
under O2 (bf16), per kept module.

    PYTHONPATH=src OMP_NUM_THREADS=1 python3 benchmarks/bench_setup.py [--blocks 100,200,400,800]
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Callable

import torch
from torch import nn

import ampkit
from ampkit.fp8 import Float8Config, convert_to_fp8
from bench_host import count_python_calls  # the same exact count as the host-cost tables


def _model(blocks: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
                           for _ in range(blocks)])


def _keep_then_o2(model: nn.Module, blocks: int) -> None:
    ampkit.keep_fp32(model, [f"{i}.1" for i in range(blocks)])
    optimizer = torch.optim.AdamW(model.parameters())
    ampkit.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


CASES: dict[str, Callable[[nn.Module, int], object]] = {
    "keep_fp32, one name per block": lambda m, n: ampkit.keep_fp32(m, [f"{i}.1" for i in range(n)]),
    "keep_fp32, a pattern": lambda m, n: ampkit.keep_fp32(m, ["*.1"]),
    "keep_fp32, a type": lambda m, n: ampkit.keep_fp32(m, [nn.LayerNorm]),
    "convert_to_fp8, delayed": lambda m, n: convert_to_fp8(
        m, recipe=Float8Config("delayed", emulate=True)),
    "keep_fp32 by names, then O2 initialize": _keep_then_o2,
}


def _step_calls(keep: bool, level: str, blocks: int = 10) -> int:
    """Python calls of one forward and backward (after a first, untimed one)."""
    torch.manual_seed(0)
    model, x = _model(blocks), torch.randn(4, 16)
    if keep:
        ampkit.keep_fp32(model, [nn.LayerNorm])
    if level == "O2":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ampkit.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                          verbosity=0)

    def step() -> None:
        with ampkit.autocast("cpu", dtype=torch.bfloat16, enabled=level != "O2"):
            model(x).float().sum().backward()
    step()
    return count_python_calls(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="100,200,400,800")
    sizes = [int(n) for n in parser.parse_args().blocks.split(",")]
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, ampkit {ampkit.__version__}, CPU, 1 thread")
    print(f"{'case':40s} {'blocks':>6s} {'ms':>8s} {'calls/block':>12s}")
    for case in CASES.values():  # first-use work (imports, caches) out of the timings
        case(_model(2), 2)
    for name, case in CASES.items():
        for blocks in sizes:
            model = _model(blocks)
            start = time.perf_counter()
            case(model, blocks)
            ms = (time.perf_counter() - start) * 1e3
            calls = count_python_calls(lambda: case(_model(blocks), blocks))
            print(f"{name:40s} {blocks:6d} {ms:8.1f} {calls / blocks:12.0f}")
    print(f"\n{'per step, 10 blocks':24s} {'none kept':>10s} {'10 kept':>8s} {'per kept':>9s}")
    for level in ("autocast", "O2"):
        plain, kept = _step_calls(False, level), _step_calls(True, level)
        print(f"{level:24s} {plain:10d} {kept:8d} {(kept - plain) / 10:9.1f}")


if __name__ == "__main__":
    main()
