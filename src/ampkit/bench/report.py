"""Presenting benchmark and training results: progress, tables, verdicts, JSON, plots.

rich and matplotlib are optional (the ``cli`` extra): without rich the tables are plain
text and the progress is one updating line; without matplotlib ``--plot`` is refused
before anything runs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import IO, Any, Callable, Optional, Sequence

import torch

from .. import __version__
from .._dtypes import capability, fp8_supported, recommend_policy
from .errors import UsageError

OnStep = Callable[[int, int], None]



def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def environment(device: str) -> dict[str, Any]:
    """Versions, device and what it runs natively, as stored in every JSON document."""
    cap = capability(device)
    policy, reason = recommend_policy(device)
    env = {"ampkit": __version__, "torch": torch.__version__, "device": cap.device,
           "device_name": cap.name,
           "native": {"bf16": cap.bf16, "fp16": cap.fp16, "fp8": fp8_supported(device)},
           "recommended_policy": policy, "recommended_reason": reason}
    if torch.device(device).type == "cuda":
        env["fp32_math"] = fp32_math()
    return env


def fp32_math() -> str:
    """How torch runs "fp32" on CUDA right now (its defaults are left as they are).

    torch's defaults: fp32 matmuls in full fp32, but cuDNN convolutions in TF32 — so an
    fp32 CNN row on an Ampere+ GPU already has TF32 convolutions in it.
    """
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    conv_tf32 = conv == "tf32" if conv is not None else bool(torch.backends.cudnn.allow_tf32)
    return (f"matmul precision {torch.get_float32_matmul_precision()!r} (TF32 unless 'highest'), "
            f"cuDNN convolutions {'TF32' if conv_tf32 else 'fp32'}")


def write_json(document: dict[str, Any], path: str) -> None:
    """Write ``document`` to ``path`` ("-": stdout), creating the folder.

    Strict JSON: inf, -inf and NaN (an SQNR, a diverged loss) become the strings "inf",
    "-inf" and "nan" (see :func:`strict_json`), which every JSON reader accepts.
    """
    text = json.dumps(strict_json(document), indent=2, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as out:
        out.write(text + "\n")


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by "inf", "-inf" or "nan".

    Example:
        >>> strict_json({"sqnr": [float("inf"), 3.0], "loss": float("nan")})
        {'sqnr': ['inf', 3.0], 'loss': 'nan'}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


# --- progress ----------------------------------------------------------------------------
class Progress:
    """A progress bar per task (rich when installed, else one updating line on stderr).

    Args:
        enabled: False (``--quiet``, or stdout is not a terminal) shows nothing.
        keep_done: finished bars stay (one per policy); False: each new task replaces
            the previous bar (one per epoch).

    Example:
        >>> with Progress(enabled=False) as progress:
        ...     progress.task("32-true")(1, 10)
    """

    def __init__(self, enabled: bool, keep_done: bool = True) -> None:
        self.enabled = enabled
        self.keep_done = keep_done
        self._rich: Any = None
        self._last: Any = None

    def __enter__(self) -> "Progress":
        if self.enabled and have_rich():
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn)
            # Redrawn twice a second: the drawing thread takes the GIL from the loop that
            # launches the kernels, so it should take it rarely.
            self._rich = RichProgress(TextColumn("{task.description:>18}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                                      refresh_per_second=2)
            self._rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.stop()  # also when the body raised: the terminal is given back
            self._rich = None
        elif self.enabled:
            sys.stderr.write("\n")

    def task(self, label: str) -> OnStep:
        """A callback ``(done, total)`` that advances ``label``'s bar."""
        if not self.enabled:
            return lambda done, total: None
        if self._rich is not None:
            if not self.keep_done and self._last is not None:
                self._rich.remove_task(self._last)
            task_id = self._last = self._rich.add_task(label, total=None)
            return lambda done, total: self._rich.update(task_id, completed=done, total=total)

        def plain(done: int, total: int) -> None:
            sys.stderr.write(f"\r{label:>18}: {done}/{total}")
            sys.stderr.flush()
        return plain


# --- tables --------------------------------------------------------------------------------
def _fmt(value: Optional[float], spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _sig(value: Optional[float], none: str = "-") -> str:
    """About three significant digits, never in scientific notation above 1."""
    if value is None:
        return none
    size = abs(value)
    spec = ",.0f" if size >= 100 else ".1f" if size >= 10 else ".2f" if size >= 1 else ".3g"
    return format(value, spec)


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                 out: IO[str], left: Sequence[int] = (0,)) -> None:
    """A table: rich's when installed, else plain text; columns in ``left`` left-aligned,
    the others (numbers) right-aligned."""
    if have_rich():
        from rich.console import Console
        from rich.table import Table
        table = Table(title=title)
        for i, head in enumerate(headers):
            table.add_column(head, justify="left" if i in left else "right")
        for row in rows:
            table.add_row(*row)
        # A terminal's own width; files and pipes get one that fits the table unwrapped
        # (each column's widest cell plus rich's 3 characters of border and padding).
        natural = 1 + sum(3 + max([len(h)] + [len(r[i]) for r in rows])
                          for i, h in enumerate(headers))
        width = None if out.isatty() else max(130, len(title), natural)
        Console(file=out, width=width).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out.write(title + "\n")
    for row in [list(headers)] + [list(r) for r in rows]:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.write("  ".join(cells).rstrip() + "\n")


BENCH_HEADERS = ("policy", "step ms", "IQR ms", "samples/s", "speedup", "peak MiB",
                 "mem ×", "final loss", "max |Δloss|", "notes")
BENCH_LEFT = (0, 9)  # policy and notes


def bench_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One table row per policy result."""
    return [[r["policy"], _sig(r["step_ms"]), _sig(r["step_ms_iqr"]),
             _sig(r["samples_per_s"]), _fmt(r["speedup"], ".2f") + "×",
             _sig(r["peak_mem_mib"]), _fmt(r["mem_ratio"], ".2f"),
             _fmt(r["final_loss"], ".4g", "non-finite"), _fmt(r["max_loss_dev"], ".2g", "n/a"),
             _notes(r)] for r in results]


def _notes(r: dict[str, Any]) -> str:
    notes = []
    if r["half_dtype"] is not None:
        notes.append({"float16": "fp16", "bfloat16": "bf16"}[r["half_dtype"]])
    if r["loss_scaling"] != "off":
        notes.append(f"scale {r['loss_scaling']}")
    if r["skipped_steps"]:
        notes.append(f"{r['skipped_steps']} skipped")
    if r["fp8_recipe"] is not None:
        notes.append(f"{r['fp8_layers']} fp8 layers")
    if r["compile_s"] is not None:
        notes.append(f"compile {r['compile_s']:.1f}s")
    return ", ".join(notes)


# --- what the numbers say -------------------------------------------------------------------
def bench_verdict(document: dict[str, Any]) -> list[str]:
    """Plain sentences on what the run measured, including the unflattering parts."""
    env, results = document["environment"], document["results"]
    ref = results[0]
    native = env["native"]
    lines = [f"Device {env['device']} ({env['device_name']}): native bf16 "
             f"{_yes(native['bf16'])}, fp16 {_yes(native['fp16'])}, fp8 {_yes(native['fp8'])}; "
             f"torch {env['torch']}, ampkit {env['ampkit']}.",
             f"Workload: {document['workload']}; {document['settings']['steps']} timed steps after "
             f"{document['settings']['warmup']} warm-up steps; speedup and memory relative to "
             f"{ref['policy']}."]
    if "fp32_math" in env:
        lines.append(f"fp32 on this GPU (torch's settings): {env['fp32_math']}.")
    lines += [_policy_sentence(r, ref) for r in results[1:]]
    # fp8 rows get their own sentence (emulated on a CPU, which is why they are slow there).
    slower = [r["policy"] for r in results[1:]
              if r["half_dtype"] and r["fp8_recipe"] is None and (r["speedup"] or 0) < 1]
    if slower and env["device"] == "cpu":
        lines.append(_cpu_slowdown(slower, native))
    for r in results:
        if r["fp8_recipe"] is not None:
            lines.append(_fp8_sentence(r, native["fp8"]))
        if r["nonfinite_losses"]:
            lines.append(f"{r['policy']}: {r['nonfinite_losses']} of {len(r['losses'])} losses "
                         "were inf/NaN: this policy does not train this model as it is.")
    lines.append(f"Peak memory: {ref['memory_method']}.")
    if env["device"] == "cpu" and not document["settings"].get("process_per_policy", True):
        lines.append("All policies ran in one process: a later policy reuses heap memory an "
                     "earlier one freed, so its peak RSS is understated (--isolate always "
                     "measures each in a fresh process).")
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _policy_sentence(r: dict[str, Any], ref: dict[str, Any]) -> str:
    speed = r["speedup"]
    pace = ("n/a" if speed is None else f"{speed:.2f}× the speed of {ref['policy']} "
            f"({'faster' if speed >= 1 else 'slower'})")
    mem = "" if r["mem_ratio"] is None else f", {r['mem_ratio']:.2f}× its peak memory"
    dev = ("its loss curve went non-finite" if r["max_loss_dev"] is None
           else f"loss curve within {r['max_loss_dev']:.2g} of it")
    return f"{r['policy']}: {pace}{mem}, {dev}."


def _cpu_slowdown(slower: list[str], native: dict[str, bool]) -> str:
    if not (native["bf16"] or native["fp16"]):
        return (f"{', '.join(slower)} ran slower than fp32 because this CPU has no "
                "half-precision arithmetic (no AVX512-BF16/AMX): expected here, and no "
                "guide to a GPU, where half precision is what tensor cores are built for.")
    return (f"{', '.join(slower)} ran slower than fp32 on this CPU although it has native "
            "half-precision instructions: at sizes this small, casts and per-op overheads can "
            "cost more than the faster matmuls save. These are this machine's measured "
            "numbers; a GPU behaves differently.")


def _fp8_sentence(r: dict[str, Any], native_fp8: bool) -> str:
    if not r["fp8_layers"]:
        return (f"{r['policy']}: no Linear layer had in/out features divisible by 16, so nothing "
                "ran in fp8 (the run is bf16-mixed).")
    hardware = ("on fp8 tensor cores" if native_fp8 else
                "emulated (this device has no fp8 matmul): its time says nothing about a GPU")
    return f"{r['policy']}: {r['fp8_layers']} Linear layers in fp8, {hardware}."


# --- plot ----------------------------------------------------------------------------------
def require_matplotlib(path: str) -> None:
    """Refuse ``--plot PATH`` before running when matplotlib is absent or PATH is no PNG."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path!r}: the plot is a PNG; valid: a path ending in .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot {path!r} needs matplotlib, which is not installed; valid: "
                          "pip install 'ampkit[cli]' (or matplotlib), or leave out --plot") from None


def write_bench_plot(document: dict[str, Any], path: str) -> None:
    """PNG with four panels: step time (median, IQR bars), peak memory, loss curves, and
    each loss curve minus the first policy's (the curves themselves often overlap)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    results = document["results"]
    labels = [r["policy"] for r in results]
    fig, (ax_time, ax_mem, ax_loss, ax_dev) = plt.subplots(1, 4, figsize=(19, 4.5))
    ax_time.bar(labels, [r["step_ms"] for r in results],
                yerr=[r["step_ms_iqr"] / 2 for r in results], capsize=4)
    ax_time.set_ylabel("median step time (ms), IQR bars")
    ax_mem.bar(labels, [r["peak_mem_mib"] for r in results], color="tab:orange")
    ax_mem.set_ylabel("peak memory (MiB)")
    ref = [float("nan") if v is None else v for v in results[0]["losses"]]
    for r in results:
        losses = [float("nan") if v is None else v for v in r["losses"]]
        steps = range(1, len(losses) + 1)
        ax_loss.plot(steps, losses, label=r["policy"])
        ax_dev.plot(steps, [a - b for a, b in zip(losses, ref)], label=r["policy"])
    for ax, label in ((ax_loss, "training loss"), (ax_dev, f"loss − {labels[0]}'s loss")):
        ax.set_xlabel("step (warm-up included)")
        ax.set_ylabel(label)
        ax.legend()
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", rotation=30)
    env = document["environment"]
    fig.suptitle(f"ampkit bench: {document['workload']} on {env['device']} ({env['device_name']})")
    fig.tight_layout()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
