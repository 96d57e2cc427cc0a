"""What ``ampkit.autotune`` costs beyond the steps it times.

For each model, ``autotune(model, x, y, steps=S)`` is timed whole (wall clock) and
compared with the sum of its candidates' timed steps (``TuneResult.details[i]["timed_ms"]``:
S - 2 steps each, the fp32 reference included). The difference is autotune's overhead:
deep copies, applying each policy, building the optimizers, the two untimed warm-up steps
per candidate (the first of which pays lazy initialisation), the device syncs around each
step, reading the losses back. Target: overhead <= 20% of the timed steps. Each model is
tuned ``--repeats`` times; the table shows the median overhead and its range.

    PYTHONPATH=src python3 benchmarks/bench_tune.py [--models mlp,gpt,cnn] [--steps 20]
        [--repeats 3] [--threads 1] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from typing import Any

import torch

import ampkit
from ampkit import _measure as measure
from ampkit.bench.report import environment
from ampkit.bench.workloads import get_workload

TARGET = 0.20


def tune_once(name: str, device: str, steps: int, seed: int) -> dict[str, Any]:
    """One autotune call on a built-in workload: its wall time and its timed steps."""
    workload = get_workload(name, device, seed=seed)
    torch.manual_seed(seed)
    model = workload.build()
    inputs, target = workload.batches(torch.device(device))[0]
    measure.synchronize(torch.device(device))
    start = time.perf_counter()
    result = ampkit.autotune(model, inputs, target, loss_fn=workload.loss_fn, steps=steps,
                             device=device)
    wall_ms = (time.perf_counter() - start) * 1e3
    timed_ms = sum(d["timed_ms"] for d in result.details)
    return {"wall_ms": wall_ms, "timed_ms": timed_ms, "overhead": wall_ms / timed_ms - 1,
            "candidates": [r["policy"] for r in result.rows], "chosen": result.policy}


def bench_model(name: str, device: str, steps: int, repeats: int) -> dict[str, Any]:
    tune_once(name, device, 3, seed=0)  # the process's own first-use costs, not autotune's
    runs = [tune_once(name, device, steps, seed=0) for _ in range(repeats)]
    overheads = [r["overhead"] for r in runs]
    return {"model": name, "steps": steps, "runs": runs,
            "overhead_median": statistics.median(overheads), "overhead_min": min(overheads),
            "overhead_max": max(overheads), "candidates": runs[0]["candidates"],
            "within_target": statistics.median(overheads) <= TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt,cnn")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.device)
    rows = [bench_model(m, args.device, args.steps, args.repeats) for m in args.models.split(",")]
    print(f"autotune overhead, {env['device']} ({env['device_name']}), torch {env['torch']}, "
          f"{args.threads} thread(s), {args.steps} steps per candidate, {args.repeats} repeats")
    print(f"{'model':6} {'candidates':34} {'timed ms':>9} {'wall ms':>9} {'overhead':>9} "
          f"{'range':>13}")
    for row in rows:
        run = row["runs"][len(row["runs"]) // 2]
        print(f"{row['model']:6} {','.join(row['candidates']):34} {run['timed_ms']:9.0f} "
              f"{run['wall_ms']:9.0f} {row['overhead_median']:9.1%} "
              f"{row['overhead_min']:6.1%}-{row['overhead_max']:.1%}")
    ok = all(r["within_target"] for r in rows)
    print(f"target: overhead <= {TARGET:.0%} of the timed steps: {'met' if ok else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"date": datetime.date.today().isoformat(), "environment": env,
                       "threads": args.threads, "loadavg_1m": measure.machine_state(args.threads)
                       ["loadavg_1m"], "target": TARGET, "models": rows}, out, indent=2)


if __name__ == "__main__":
    main()
