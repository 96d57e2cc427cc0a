"""What ampkit.diagnose costs: ``inspect`` against one fp32 training step, ``watch`` per step.

Measured per model, in one run, on the CPU with one thread:

- *step ms*: CPU time of this thread per fp32 training step (forward, backward, SGD
  step, zero_grad), the unit everything else is compared with;
- *watch overhead*: what ``with ampkit.diagnose.watch(model):`` around forward+backward
  adds to that step (a new watch per step: hooks installed and removed every step), in
  ms and in %; *reused*: the same with one Watch object entered every step;
- *ops*, *+ops*: ATen ops that launch a kernel (views and syncs not counted) in one
  plain step, and how many ``watch`` adds (one ``aminmax`` per module output and
  gradient, then a few to fold the flags and find the first non-finite one);
- *syncs*: reads of a device value by the host per watched step
  (``aten._local_scalar_dense``; the plain step has none);
- *inspect ms* and *x step*: the time of one ``ampkit.diagnose.inspect`` call (two
  deep copies, fp32 and policy forward+backward, comparisons, FLOP counting) and its ratio
  to the fp32 step.

The three kinds of step take turns round by round, so drift and load hit all alike; step
ms is the median over rounds of each round's mean per step, and an overhead is the
median over rounds of that round's difference from the plain steps; inspect's is its
fastest call. Thread time, so waiting for a core is not counted; a busy machine still
slows a thread (shared caches, a busy sibling hyperthread): compare within one run.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 benchmarks/bench_diagnose.py [--rounds 30] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ampkit  # noqa: E402
from ampkit._torch_compat import EagerDispatchMode  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp() -> tuple[nn.Module, Batch]:
    """128-256-256-10 MLP with LayerNorm, batch 64 (8 modules)."""
    model = nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 256),
                          nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 10))
    return model, (torch.randn(64, 128), torch.randint(0, 10, (64,)))


def cnn() -> tuple[nn.Module, Batch]:
    """Three conv-BN-ReLU blocks and a linear head on 3x32x32, batch 16 (12 modules)."""
    layers: list[nn.Module] = []
    for c_in, c_out in ((3, 16), (16, 32), (32, 32)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return model, (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))


MODELS: dict[str, Callable[[], tuple[nn.Module, Batch]]] = {"mlp": mlp, "cnn": cnn}
KINDS = ("plain", "watch", "reused")
# Ops that launch no kernel (views, aliases) or are the sync itself: not counted as ops.
NOT_KERNELS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,
               torch.ops.aten.t.default, torch.ops.aten.view.default,
               torch.ops.aten.expand.default, torch.ops.aten._local_scalar_dense.default}


class SyncCounter(EagerDispatchMode):
    """Counts the ATen ops of a step and, among them, host reads of device values."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        self.ops += func not in NOT_KERNELS
        return func(*args, **(kwargs or {}))


def make_step(model: nn.Module, batch: Batch) -> Callable[[str], None]:
    """One SGD step: "plain", "watch" (a new watch(model) per step) or "reused" (one
    Watch object entered every step, as docs/diagnostics.md suggests)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch
    reused = ampkit.diagnose.watch(model)

    def step(kind: str) -> None:
        region = {"plain": contextlib.nullcontext(), "watch": ampkit.diagnose.watch(model),
                  "reused": reused}[kind]
        with region:
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def per_step_ms(fn: Callable[[], Any], steps: int) -> float:
    start = time.thread_time()
    for _ in range(steps):
        fn()
    return (time.thread_time() - start) * 1e3 / steps


def counted(step: Callable[[str], None], kind: str) -> SyncCounter:
    with SyncCounter() as counter:
        step(kind)
    return counter


def measure(name: str, rounds: int, steps: int, policy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    step = make_step(model, batch)
    for kind in KINDS * 3:  # warm-up: allocator, first-call paths
        step(kind)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(rounds):  # interleaved, so drift and load hit all alike
        for kind in KINDS:
            times[kind].append(per_step_ms(lambda: step(kind), steps))
    plain, watched = counted(step, "plain"), counted(step, "watch")
    ampkit.diagnose.inspect(model, *batch, policy=policy)  # warm-up
    inspect_ms = min(per_step_ms(lambda: ampkit.diagnose.inspect(model, *batch, policy=policy), 1)
                     for _ in range(max(3, rounds // 3)))
    step_ms = statistics.median(times["plain"])
    row = {"model": name, "modules": len(list(model.modules())), "step_ms": step_ms,
           "ops": plain.ops, "watch_extra_ops": watched.ops - plain.ops,
           "plain_syncs": plain.syncs, "watch_syncs": watched.syncs, "inspect_policy": policy,
           "inspect_ms": inspect_ms, "inspect_x_step": inspect_ms / step_ms}
    for kind in ("watch", "reused"):
        # Paired: each round's difference from the plain steps of the same round.
        extra = statistics.median(t - p for t, p in zip(times[kind], times["plain"]))
        row[f"{kind}_overhead_ms"], row[f"{kind}_overhead_pct"] = extra, 100 * extra / step_ms
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [measure(name, args.rounds, args.steps, args.policy) for name in MODELS]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds of {args.steps} steps, inspect policy {args.policy}")
    print(f"{'model':6} {'modules':>7} {'step ms':>8} {'ops':>5} {'watch overhead':>18} "
          f"{'reused':>18} {'+ops':>5} {'syncs':>5} {'inspect ms':>10} {'x step':>7}")
    for r in rows:
        print(f"{r['model']:6} {r['modules']:>7} {r['step_ms']:>8.3f} {r['ops']:>5} "
              f"{r['watch_overhead_ms']:>9.3f} ms {r['watch_overhead_pct']:>4.0f}% "
              f"{r['reused_overhead_ms']:>9.3f} ms {r['reused_overhead_pct']:>4.0f}% "
              f"{r['watch_extra_ops']:>5} {r['watch_syncs']:>5} "
              f"{r['inspect_ms']:>10.1f} {r['inspect_x_step']:>7.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
