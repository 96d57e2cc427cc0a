"""``ampkit bench --plot``: the run in one PNG, one colour per policy in every panel.

Panels, left to right: each loss curve minus the reference's (first: the curves
themselves often lie on top of each other), the loss curves (markers, so overlapping
ones stay visible), the median step time with whiskers from the 25th to the 75th
percentile, the speedup with its 95% interval, and peak memory.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from .._measure import percentile

_MARKERS = "os^Dv<>Pp*"


def _curve(losses: Sequence[Optional[float]]) -> list[float]:
    return [float("nan") if v is None else v for v in losses]


def write_bench_plot(document: dict[str, Any], path: str) -> None:
    """Write the five panels of a bench document to ``path`` (a PNG)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    results = document["results"]
    labels = [r["policy"] for r in results]
    colours = [f"C{i % 10}" for i in range(len(results))]
    fig, (ax_dev, ax_loss, ax_time, ax_speed, ax_mem) = plt.subplots(1, 5, figsize=(24, 4.5))
    _loss_panels(ax_dev, ax_loss, results, colours)
    _time_panel(ax_time, results, labels, colours)
    _speed_panel(ax_speed, results, labels, colours)
    ax_mem.bar(labels, [r["peak_mem_mib"] for r in results], color=colours)
    ax_mem.set_ylabel("peak memory (MiB)")
    for ax in (ax_time, ax_speed, ax_mem):
        ax.tick_params(axis="x", rotation=30)
    env = document["environment"]
    fig.suptitle(f"ampkit bench: {document['workload']} on {env['device']} ({env['device_name']})")
    fig.tight_layout()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _loss_panels(ax_dev: Any, ax_loss: Any, results: Sequence[dict[str, Any]],
                 colours: Sequence[str]) -> None:
    ref = _curve(results[0]["losses"])
    every = max(len(ref) // 12, 1)  # a dozen markers per curve
    for i, (r, colour) in enumerate(zip(results, colours)):
        losses = _curve(r["losses"])
        steps = range(1, len(losses) + 1)
        style = dict(color=colour, label=r["policy"], marker=_MARKERS[i % len(_MARKERS)],
                     markevery=(i % every, every), markersize=4, linewidth=1.2)
        ax_dev.plot(steps, [a - b for a, b in zip(losses, ref)], **style)
        ax_loss.plot(steps, losses, **style)
    for ax, label in ((ax_dev, f"loss − {results[0]['policy']}'s loss"), (ax_loss, "training loss")):
        ax.set_xlabel("step (warm-up included)")
        ax.set_ylabel(label)
        ax.legend()


def _time_panel(ax: Any, results: Sequence[dict[str, Any]], labels: Sequence[str],
                colours: Sequence[str]) -> None:
    medians, below, above = [], [], []
    for r in results:
        ordered = sorted(r["step_times_ms"])
        median = percentile(ordered, 0.5)
        medians.append(median)
        below.append(median - percentile(ordered, 0.25))
        above.append(percentile(ordered, 0.75) - median)
    ax.bar(labels, medians, yerr=[below, above], capsize=4, color=colours)
    ax.set_ylabel("median step time (ms), whiskers: 25th–75th pct")


def _speed_panel(ax: Any, results: Sequence[dict[str, Any]], labels: Sequence[str],
                 colours: Sequence[str]) -> None:
    speeds = [r["speedup"] or 0.0 for r in results]
    below = [s - (r["speedup_ci"] or [s, s])[0] for s, r in zip(speeds, results)]
    above = [(r["speedup_ci"] or [s, s])[1] - s for s, r in zip(speeds, results)]
    ax.bar(labels, speeds, yerr=[below, above], capsize=4, color=colours)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel(f"speedup over {labels[0]}, whiskers: 95% interval")
