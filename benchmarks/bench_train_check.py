"""What ``ampkit train``'s step check costs: epochs with it against plain ``train_step``.

The check (``ampkit.bench.stepcheck``) runs no watch on a healthy step; what remains per
step is, without loss scaling, one host read of the loss (``.item()``), and
with loss scaling one 0-dim copy of the scale (the skip is known from the scaler's own
read of found-inf), plus one read of the epoch's scales at its end.

Measured as ``ampkit train --model mlp`` trains (digits, batch 64, AdamW): per round a
fresh Trainer trains ``--epochs`` epochs whose steps alternate, one checked, one plain
(``train_step`` as it was), so drift and load hit both kinds alike; each step's thread
CPU time (a waiting thread is not counted), the epoch's closing read counted with the
checked steps. Overhead: median checked step / median plain step - 1 (and the same for
the means, which outliers move).

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 benchmarks/bench_train_check.py [--rounds 10] [--policies bf16-mixed,16-mixed,32-true]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from ampkit.bench.data import load_data  # noqa: E402
from ampkit.bench.stepcheck import PlainStep  # noqa: E402
from ampkit.bench.train import Trainer, TrainSettings  # noqa: E402


def measure(policy: str, rounds: int, epochs: int, data: Any) -> dict[str, Any]:
    """Per-step thread time of checked and plain steps, alternating step by step."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        trainer = Trainer(TrainSettings(model="mlp", data="digits", policy=policy,
                                        epochs=epochs), data, warn=print)
        kinds = {True: trainer.check, False: PlainStep(trainer)}
        x, y = trainer.data.train_x, trainer.data.train_y
        size, steps = trainer.settings.batch_size, math.ceil(len(y) / trainer.settings.batch_size)
        for epoch in range(1, epochs + 1):
            trainer.check.begin_epoch(epoch, (epoch - 1) * steps + 1)
            for b in range(steps):
                checked = (b + r) % 2 == 0  # alternate, starting with either kind by round
                start = time.thread_time()
                kinds[checked].step(x[b * size:(b + 1) * size], y[b * size:(b + 1) * size])
                times[checked].append(time.thread_time() - start)
            start = time.thread_time()
            trainer.check.end_epoch()  # its one read of the epoch's scales
            times[True][-1] += time.thread_time() - start
    plain, checked_ms = (1e3 * statistics.median(times[k]) for k in (False, True))
    return {"policy": policy, "steps": len(times[True]) + len(times[False]),
            "plain_step_ms": plain, "checked_step_ms": checked_ms,
            "overhead_pct": 100 * (checked_ms / plain - 1),
            "mean_overhead_pct": 100 * (statistics.mean(times[True]) / statistics.mean(times[False]) - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--policies", default="bf16-mixed,16-mixed,32-true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    data = load_data("digits")
    rows = [measure(p, args.rounds, args.epochs, data) for p in args.policies.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} rounds "
          f"of {args.epochs} epochs (mlp on digits, batch 64)")
    print(f"{'policy':12} {'steps':>6} {'plain ms':>9} {'checked ms':>11} {'overhead':>9} "
          f"{'(means)':>8}")
    for r in rows:
        print(f"{r['policy']:12} {r['steps']:>6} {r['plain_step_ms']:>9.3f} "
              f"{r['checked_step_ms']:>11.3f} {r['overhead_pct']:>8.1f}% "
              f"{r['mean_overhead_pct']:>7.1f}%")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
