"""A report as a picture: per-module SQNR and under/overflow along the network.

Used by ``ampkit doctor --plot``; matplotlib is imported only here, when a plot is drawn
(the ``cli`` extra installs it).

Reading it: the x axis is the modules in execution order (the report's order). Top: the
output SQNR (and the parameter-gradient SQNR) against fp32 in dB, higher is better; a
module identical to fp32 (inf dB) is drawn at a cap above the others as a triangle, a
non-finite one at a floor as a red cross; the dashed line is where the advice starts
(20 dB). Bottom: the share of values that flush to zero (underflow) or become inf
(overflow) in the half dtype, outputs and gradients; a marker is drawn only where the
share is not zero, and the axis reaches at least the 1% where underflow advice starts. A red vertical line marks the first non-finite module.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

from .advice import LOW_SQNR_DB, UNDERFLOW
from .report import Report

_NAMES_UP_TO = 40  # tick labels are the module names up to this many modules, else indices
_FRACTIONS = (("underflow", "output underflow", "tab:blue", "o"),
              ("overflow", "output overflow", "tab:red", "o"),
              ("grad_underflow", "gradient underflow", "tab:cyan", "s"),
              ("grad_overflow", "gradient overflow", "tab:orange", "s"))


def sqnr_limits(values: Sequence[Optional[float]]) -> tuple[float, float]:
    """(floor, cap): where -inf and inf SQNRs are drawn, 10 dB outside the finite ones.

    Example:
        >>> sqnr_limits([40.0, float("inf"), 60.0, None])
        (10.0, 70.0)
    """
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return 0.0, 2 * LOW_SQNR_DB
    finite.append(LOW_SQNR_DB)  # the advice line stays in view
    return min(finite) - 10.0, max(finite) + 10.0


def save_plot(report: Report, path: str, title: str = "") -> None:
    """Draw ``report`` into the PNG ``path`` (folders made as needed)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    n = len(report.modules)
    fig, (ax_sqnr, ax_frac) = plt.subplots(2, 1, sharex=True,
                                           figsize=(max(8.0, min(0.28 * n + 4, 30.0)), 8))
    _draw_sqnr(ax_sqnr, report)
    _draw_fractions(ax_frac, report)
    _mark_first_nonfinite((ax_sqnr, ax_frac), report)
    # Sequential's names are bare indices: the class says more.
    names = [f"{m.name} {m.type}" if m.name.isdigit() else m.name or "<model>"
             for m in report.modules]
    if n <= _NAMES_UP_TO:
        ax_frac.set_xticks(range(n))
        ax_frac.set_xticklabels(names, rotation=90, fontsize=8)
    ax_frac.set_xlabel("module, in execution order" if n <= _NAMES_UP_TO
                       else "module index, in execution order (names in the table / --json)")
    fig.suptitle(title or f"ampkit doctor: {report.policy}")
    fig.tight_layout()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_sqnr(ax: Any, report: Report) -> None:
    series = (("out_sqnr_db", "output SQNR", "tab:blue", "-"),
              ("grad_sqnr_db", "gradient SQNR", "tab:orange", ":"))
    floor, cap = sqnr_limits([getattr(m, f) for m in report.modules for f, *_ in series])
    labelled = False  # one legend entry for the non-finite crosses of both series
    for field, label, color, style in series:
        values = [getattr(m, field) for m in report.modules]
        xs = [i for i, v in enumerate(values) if v is not None]
        ys = [min(max(values[i], floor), cap) for i in xs]  # type: ignore[type-var]
        ax.plot(xs, ys, linestyle=style, marker=".", color=color, label=label)
        top = [i for i in xs if values[i] == math.inf]
        bottom = [i for i in xs if values[i] == -math.inf]
        ax.scatter(top, [cap] * len(top), marker="^", s=60, color=color, zorder=3,
                   label=f"{label}: identical to fp32 (inf, drawn at {cap:.0f})" if top else None)
        ax.scatter(bottom, [floor] * len(bottom), marker="x", s=70, color="red", zorder=3,
                   label=None if labelled or not bottom else
                   f"non-finite (-inf, drawn at {floor:.0f})")
        labelled = labelled or bool(bottom)
    ax.axhline(LOW_SQNR_DB, color="grey", linestyle="--", linewidth=1,
               label=f"{LOW_SQNR_DB:g} dB: below it, advice")
    ax.set_ylim(floor - 5, cap + 5)
    ax.set_ylabel("SQNR against fp32 (dB), higher is better")
    ax.legend(fontsize=8, loc="best")


def _draw_fractions(ax: Any, report: Report) -> None:
    peak = 0.0
    for field, label, color, marker in _FRACTIONS:
        values = [getattr(m, field) for m in report.modules]
        hits = [(i, 100 * v) for i, v in enumerate(values) if v]
        if hits:
            peak = max([peak] + [v for v in values if v])
            ax.plot([i for i, _ in hits], [v for _, v in hits], marker=marker, color=color,
                    linestyle="none", markersize=7, label=label)
            ax.vlines([i for i, _ in hits], 0, [v for _, v in hits], color=color, alpha=0.4)
    half = report.to_dict()["half_dtype"] or "the half dtype"
    if not peak:
        ax.text(0.5, 0.5, f"no value underflows or overflows {half}", ha="center",
                va="center", transform=ax.transAxes)
    # At least up to the underflow advice threshold, so that a tiny share looks tiny.
    ax.axhline(100 * UNDERFLOW, color="grey", linestyle="--", linewidth=1,
               label=f"{UNDERFLOW:.0%}: underflow above it, advice (any overflow: advice)")
    ax.legend(fontsize=8, loc="best")
    ax.set_ylim(0, max(150 * UNDERFLOW, 110 * peak))
    ax.set_ylabel(f"% of values that flush to 0 / overflow in {half}")


def _mark_first_nonfinite(axes: Sequence[Any], report: Report) -> None:
    if report.first_nonfinite is None:
        return
    phase, name = report.first_nonfinite
    index = next((i for i, m in enumerate(report.modules) if m.name == name), None)
    if index is None:
        return
    for ax in axes:
        ax.axvline(index, color="red", linewidth=1.5, alpha=0.6)
    axes[0].annotate(f"first non-finite: {name or '<model>'} ({phase})", (index, 1.0),
                     xycoords=("data", "axes fraction"), xytext=(4, -12),
                     textcoords="offset points", color="red", fontsize=9)
