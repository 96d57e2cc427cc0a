"""Comparing the policies a bench ran: each against the reference (speedup with its
interval, memory ratio, loss deviations: :func:`compare`), and the recommendation by
autotune's rule (:func:`recommend`, ``tune.choose``)."""

from __future__ import annotations

import math
from typing import Any, Optional

from .._measure import paired_speedup
from ..tune import choose

def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or not den else num / den


def no_memory_ratios(results: list[dict[str, Any]], where: str, remedy: str = "") -> None:
    """Mark ``results`` as measured by CPU peak RSS in one shared process (``where``): it
    only grows within a process, so their memory ratios are None, with this reason."""
    reason = (f"every policy ran in {where}, where a later one reuses heap memory an earlier "
              f"one freed, so one policy's peak RSS is not comparable with another's{remedy}")
    for result in results:
        result["mem_ratio_reason"] = reason


def _mem_ratio(result: dict[str, Any], ref: dict[str, Any]) -> Optional[float]:
    """Peak memory relative to the reference's; None where a result's ``mem_ratio_reason``
    says the peaks are not comparable (``ampkit bench --nproc`` on a CPU)."""
    if result.get("mem_ratio_reason") or ref.get("mem_ratio_reason"):
        return None
    return _ratio(result["peak_mem_mib"], ref["peak_mem_mib"])


def max_loss_deviation(losses: list[Optional[float]], ref: list[Optional[float]]) -> Optional[float]:
    """Largest |loss - reference loss| over the steps; None when either went non-finite."""
    pairs = list(zip(losses, ref))
    if any(a is None or b is None for a, b in pairs):
        return None
    return max((abs(a - b) for a, b in pairs), default=0.0)  # type: ignore[operator]


def relative_loss_deviation(losses: list[Optional[float]],
                            ref: list[Optional[float]]) -> Optional[float]:
    """Largest |loss - reference| / |reference| over the steps (autotune's measure)."""
    pairs = list(zip(losses, ref))
    if any(a is None or b is None for a, b in pairs):
        return None
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=0.0)  # type: ignore


def speedup_over(result: dict[str, Any], ref: dict[str, Any]
                 ) -> tuple[Optional[float], Optional[list[float]]]:
    """``result``'s speedup over ``ref`` and its 95% interval (None unless they took turns).

    Runs that took turns in rounds: the median of the per-round ratios; runs made one
    after another: the ratio of their median step times, with no interval.
    """
    if result.get("interleaved") and ref.get("interleaved"):
        speedup, interval = paired_speedup(ref["round_ms"], result["round_ms"])
        return speedup, None if interval is None else list(interval)
    return _ratio(ref["step_ms"], result["step_ms"]), None


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add speedup (and its interval), memory ratio and loss deviations against the first
    (error rows, see ``run_bench``, are left as they are, and the reference is the first
    row that is not one)."""
    ok = [res for res in results if "error" not in res]
    if not ok:
        return results
    ref = ok[0]
    for res in ok:
        res["speedup"], res["speedup_ci"] = speedup_over(res, ref)
        res["mem_ratio"] = _mem_ratio(res, ref)
        res["max_loss_dev"] = max_loss_deviation(res["losses"], ref["losses"])
        res["max_loss_rel_dev"] = relative_loss_deviation(res["losses"], ref["losses"])
    return results


def recommend(results: list[dict[str, Any]], max_loss_dev: float = 0.02) -> dict[str, Any]:
    """The policy autotune's rule (``tune.choose``) picks from a bench's results.

    The rule compares with fp32: the reference is the first pure-fp32 row (32-true, O0,
    p=f32), wherever it is in the list; without one there is no recommendation.

    Returns:
        {"recommended": name or None, "reason", "max_loss_dev", "speedup", "speedup_ci",
        "rows": the rule's rows (policy, step_ms, max_loss_dev, speedup, speedup_ci,
        accepted, reason), fp32's first}.
    """
    results = [r for r in results if "error" not in r]  # policies that failed: no candidates
    ref = next((r for r in results if r.get("pure_fp32")), None)
    if ref is None:
        return {"recommended": None, "max_loss_dev": max_loss_dev, "rows": [],
                "speedup": None, "speedup_ci": None,
                "reason": "no pure-fp32 policy (32-true) was run, and the rule accepts a "
                          "policy only against fp32's speed and loss: add 32-true to --policies"}
    rows = [_rule_row(r, ref) for r in [ref] + [r for r in results if r is not ref]]
    chosen, _ = choose(rows, max_loss_dev)
    row = next(r for r in rows if r["policy"] == chosen)
    return {"recommended": chosen, "max_loss_dev": max_loss_dev, "rows": rows,
            "speedup": row["speedup"], "speedup_ci": row["speedup_ci"], "reason": row["reason"]}


def _rule_row(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    speedup, interval = speedup_over(result, ref)
    # fp32's step time over the speedup: the rule's "faster" is the paired speedup, but
    # never against the policy's own median step time: one outlier round could make the
    # pairs say faster where the run measured it slower (the JSON would contradict itself).
    step_ms = ref["step_ms"] / speedup if speedup else math.inf
    if result["step_ms"] >= ref["step_ms"] and result["step_ms"] > step_ms:
        # Overruled: the row says what decided (its speedup from its own median, no interval).
        step_ms = result["step_ms"]
        speedup, interval = ref["step_ms"] / step_ms, None
    return {"policy": result["policy"],
            "step_ms": step_ms,
            "max_loss_dev": relative_loss_deviation(result["losses"], ref["losses"]),
            "speedup": speedup, "speedup_ci": interval,
            "peak_mib": result["peak_mem_mib"],
            "mem_ratio": _mem_ratio(result, ref)}

