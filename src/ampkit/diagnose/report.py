"""What :func:`ampkit.diagnose.inspect` returns: per-module numbers, FLOPs, advice.

``Report.to_dict()`` is JSON-serialisable (dtypes become their names; an SQNR of inf
or -inf stays a float, which ``json.dumps`` writes as ``Infinity``; ``ampkit doctor
--json`` writes strict JSON, the strings "inf", "-inf", "nan"); ``str(report)`` and
``report.table(limit)`` are the readable form, worst modules first.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .._checks import check_int
from .flops import low_precision_share


@dataclass(frozen=True)
class ModuleStats:
    """One module's numerics under the policy, against the fp32 reference.

    Attributes:
        name: dotted name, as in ``model.named_modules()`` ("" for the model itself).
        type: the module's class name under the policy (``Float8Linear`` for fp8 layers).
        out_dtype: dtype of its (first floating) output under the policy; None if none.
        out_sqnr_db: 10*log10(sum(ref**2) / sum((out - ref)**2)) over its floating
            outputs and calls; inf when identical, -inf when non-finite.
        underflow: fraction of the nonzero elements of the reference output that become
            0 when cast to the policy's half dtype, the dtype the output has under the
            policy (0.0 for an output that is fp32 under the policy: a pure-fp32 policy,
            modules ``ampkit.keep_fp32`` selected, an activation after one); None when
            it produced no floating output under the policy.
        overflow: fraction of the finite elements of the reference output that become
            inf when cast to that dtype.
        grad_sqnr_db, grad_underflow, grad_overflow: the same for the gradients of its own
            parameters (the reference gradient times the policy's initial loss scale is
            what is cast); None without parameters that received a gradient.
        nonfinite: some output or gradient of it was inf or NaN under the policy.
    """

    name: str
    type: str
    out_dtype: Optional[torch.dtype]
    out_sqnr_db: Optional[float]
    underflow: Optional[float]
    overflow: Optional[float]
    grad_sqnr_db: Optional[float]
    grad_underflow: Optional[float]
    grad_overflow: Optional[float]
    nonfinite: bool

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["out_dtype"] = dtype_name(self.out_dtype)
        return out


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """"float16" for torch.float16 (None stays None)."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def severity(stats: ModuleStats) -> tuple:
    """Sort key, worst first: non-finite, then overflow, then underflow, then low SQNR."""
    overflow = (stats.overflow or 0.0) + (stats.grad_overflow or 0.0)
    underflow = (stats.underflow or 0.0) + (stats.grad_underflow or 0.0)
    sqnr = min((s for s in (stats.out_sqnr_db, stats.grad_sqnr_db) if s is not None),
               default=math.inf)
    return (not stats.nonfinite, -overflow, -underflow, sqnr)


@dataclass(frozen=True)
class Report:
    """The result of :func:`ampkit.diagnose.inspect`.

    Attributes:
        policy: the policy's name.
        modules: one :class:`ModuleStats` per module with parameters of its own or
            without children, in the order their outputs were produced.
        first_nonfinite: None, or ("forward"|"backward", module name): the first module
            whose output (forward) or parameter/input gradient (backward) was non-finite.
        flops: {dtype name: FLOPs} of the matmuls and convolutions that ran under the
            policy, forward and backward.
        advice: sentences, each naming a module or a setting and what to do.
        loss_scale: the policy's initial loss scale (1.0 without loss scaling).
        ref_loss, policy_loss: the fp32 loss and the loss under the policy.
    """

    policy: str
    modules: list[ModuleStats]
    first_nonfinite: Optional[tuple[str, str]]
    flops: dict[str, int]
    advice: list[str]
    loss_scale: float = 1.0
    ref_loss: float = math.nan
    policy_loss: float = math.nan
    half_dtype: Optional[torch.dtype] = field(default=None, repr=False)

    @property
    def low_precision_share(self) -> float:
        """The fraction of :attr:`flops` that ran in a dtype narrower than fp32."""
        return low_precision_share(self.flops)

    def to_dict(self) -> dict[str, Any]:
        """Every field under its own name; dtypes as names, (phase, name) as a list."""
        return {"policy": self.policy, "half_dtype": dtype_name(self.half_dtype),
                "loss_scale": self.loss_scale, "ref_loss": self.ref_loss,
                "policy_loss": self.policy_loss,
                "first_nonfinite": None if self.first_nonfinite is None else list(self.first_nonfinite),
                "flops": dict(self.flops), "low_precision_share": self.low_precision_share,
                "advice": list(self.advice), "modules": [m.to_dict() for m in self.modules]}

    def worst(self, limit: Optional[int] = None) -> list[ModuleStats]:
        """The modules sorted worst first (see :func:`severity`), at most ``limit`` (an
        int >= 0; None: all)."""
        limit = None if limit is None else check_int("limit", limit, 0)
        ranked = sorted(self.modules, key=severity)
        return ranked if limit is None else ranked[:limit]

    def table(self, limit: Optional[int] = None) -> str:
        """The report as text: a summary, the module table (worst first), the advice."""
        worst = self.worst(limit)  # checks limit first
        lines = _summary(self) + _module_table(worst)
        if limit is not None and limit < len(self.modules):
            lines.append(f"(+{len(self.modules) - limit} more in to_dict())")
        lines += ["", "Advice:"] + [f"- {sentence}" for sentence in self.advice]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _summary(report: Report) -> list[str]:
    flops = ", ".join(f"{name} {format_count(n)}" for name, n in
                      sorted(report.flops.items(), key=lambda kv: -kv[1])) or "none counted"
    first = ("none" if report.first_nonfinite is None
             else f"{report.first_nonfinite[1] or '<model>'!r} ({report.first_nonfinite[0]})")
    return [f"policy {report.policy} (half dtype {dtype_name(report.half_dtype) or 'none'}, "
            f"initial loss scale {report.loss_scale:g})",
            f"loss: fp32 {report.ref_loss:.6g}, policy {report.policy_loss:.6g}",
            f"first non-finite: {first}",
            f"FLOPs: {flops}; {report.low_precision_share:.0%} below fp32", ""]


COLUMNS = ("module", "type", "out dtype", "out SQNR dB", "underflow", "overflow",
           "grad SQNR dB", "grad uflow", "grad oflow", "non-finite")


def module_cells(m: ModuleStats) -> tuple[str, ...]:
    """The table cells of one module, under :data:`COLUMNS` (``ampkit doctor`` shows these)."""
    return (m.name or "<model>", m.type, dtype_name(m.out_dtype) or "-",
            _db(m.out_sqnr_db), _pct(m.underflow), _pct(m.overflow),
            _db(m.grad_sqnr_db), _pct(m.grad_underflow), _pct(m.grad_overflow),
            "yes" if m.nonfinite else "")


def _module_table(modules: list[ModuleStats]) -> list[str]:
    rows = [COLUMNS] + [module_cells(m) for m in modules]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return ["  ".join(cell.ljust(w) if i < 3 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _db(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "inf" if value == math.inf else "-inf" if value == -math.inf else f"{value:.1f}"


def _pct(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.2%}" if value >= 1e-4 else f"{value:.1e}"


def format_count(n: int) -> str:
    """A count in three significant digits with a k/M/G/T suffix ("647k")."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
