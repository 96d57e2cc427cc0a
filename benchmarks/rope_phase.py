"""Rotary-embedding phase error when a policy casts the frequency buffer to half.

A Llama-style rotary embedding (head size 128, base 10000, transformers' ``inv_freq``
buffer, fp32 angles computed from it as transformers does) under O2, once cast with the
model (apex's and ``model.to(dtype)``'s behaviour, ampkit's default) and once kept in fp32
with ``keep_fp32``: the largest phase error against fp32 up to a position, in radians,
and the largest error of the cos handed on. Deterministic (no timing): any machine.

    PYTHONPATH=src python3 benchmarks/rope_phase.py [--positions 4096 8192]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import ampkit


class Rotary(nn.Module):
    def __init__(self, dim: int = 128, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq.float()[None]
        return angles.cos().to(x.dtype)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.rotary(x, torch.arange(x.shape[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[512, 4096, 8192])
    args = parser.parse_args()
    top = max(args.positions)
    positions = torch.arange(top)
    reference = Model()
    exact = positions[:, None].float() * reference.rotary.inv_freq[None]
    print(f"torch {torch.__version__}; Llama-style rotary embedding, head size 128, O2")
    print(f"{'half':10} {'frequencies':12} " + " ".join(f"{'pos<' + str(p):>10}" for p in args.positions)
          + f" {'cos err':>9}")
    for half in (torch.bfloat16, torch.float16):
        for kept in (False, True):
            model = Model()
            model.load_state_dict(reference.state_dict())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the buffer-table warning, on purpose
                model, _ = ampkit.initialize(model, optimizer, opt_level="O2", half_dtype=half,
                                             keep_fp32=["rotary"] if kept else None, verbosity=0)
            angles = positions[:, None].float() * model.rotary.inv_freq.float()[None]
            err = (angles - exact).abs()
            cos = model.rotary(torch.zeros(1, dtype=half), positions).float()
            cos_err = (cos - exact.cos()).abs().max().item()
            cells = " ".join(f"{err[:p].max().item():10.4f}" for p in args.positions)
            label = "fp32 (kept)" if kept else str(half).replace("torch.", "")
            print(f"{str(half).replace('torch.', ''):10} {label:12} {cells} {cos_err:9.4f}")


if __name__ == "__main__":
    main()
