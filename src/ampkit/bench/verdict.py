"""What ``ampkit bench`` measured, in a table and in words, and which policy to use.

The table fits 80 columns. The sentences say each speedup with its 95% interval (and
"no measurable difference" when that interval includes 1×), flag loss curves that moved
more than the tolerance and optimizer settings that differ between rows, say whether the
timings can be trusted (stable intervals, threads, machine load), and end with the
recommendation: autotune's rule (``tune.choose``) applied to the rows, through
``compare.recommend``.
"""

from __future__ import annotations

from typing import IO, Any, Optional, Sequence

from .._measure import STABLE_HALF_WIDTH, half_width
from .report import console as rich_console, have_rich, render_table
from ..tune import REF_NOT_FINITE, reference_not_finite
from .compare import recommend

BENCH_HEADERS = ("policy", "ms/step", "speedup (95% CI)", "MiB", "mem ×", "Δloss", "notes")
BENCH_LEFT = (0, 6)  # policy and notes
TABLE_WIDTH = 80
_HALF_NAMES = {"float16": "fp16", "bfloat16": "bf16"}


# --- the table --------------------------------------------------------------------------------
def _num(value: Optional[float], none: str = "-") -> str:
    """About three significant digits, never in scientific notation above 1."""
    if value is None:
        return none
    size = abs(value)
    return format(value, ",.0f" if size >= 100 else ".1f" if size >= 10 else ".2f" if size >= 1
                  else ".3g")


def speedup_cell(r: dict[str, Any], reference: bool = False) -> str:
    """"0.54× (0.50–0.58)": the speedup and its 95% interval, when there is one."""
    if r["speedup"] is None:
        return "n/a"
    ci = None if reference else r.get("speedup_ci")
    return f"{r['speedup']:.2f}×" + ("" if ci is None else f" ({interval(ci)})")


def interval(ci: Sequence[float]) -> str:
    """"0.50–0.58": a 95% interval of a speedup, each bound on its own side of 1.00.

    Two decimals, or more where two would round a bound onto 1.00 or across it: an
    interval shown as "0.78–1.00" read as "includes 1" while the verdict said slower.
    """
    return f"{_bound(ci[0])}–{_bound(ci[1])}"


def _bound(value: float) -> str:
    for digits in (2, 3, 4):
        text = f"{value:.{digits}f}"
        if value == 1 or (float(text) > 1) == (value > 1) and (float(text) < 1) == (value < 1):
            return text
    return f"{value:.6f}"


def _percent(value: Optional[float], none: str = "non-finite") -> str:
    return none if value is None else f"{value * 100:.2g}%"


def bench_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One table row per policy result."""
    return [[r["policy"], _num(r["step_ms"]), speedup_cell(r, reference=i == 0),
             _num(r["peak_mem_mib"]), "-" if r["mem_ratio"] is None else f"{r['mem_ratio']:.2f}",
             _percent(r.get("max_loss_rel_dev")), notes(r)] for i, r in enumerate(results)]


def notes(r: dict[str, Any]) -> str:
    """Half dtype, loss scaling, skipped steps, fp8 layers, the share of the matmul and
    convolution FLOPs that ran below fp32, compile time, optimizer eps."""
    out = []
    if r["half_dtype"] is not None:
        out.append(_HALF_NAMES[r["half_dtype"]])
    if r["loss_scaling"] != "off":
        out.append(f"{r['loss_scaling']} scale")
    if r["skipped_steps"]:
        out.append(f"{r['skipped_steps']} skipped")
    if r["fp8_recipe"] is not None:
        out.append(f"{r['fp8_layers']} fp8 layers")
    share = r.get("low_precision_share")
    if share is not None and not r.get("pure_fp32"):
        out.append(f"{share:.0%} of FLOPs <fp32")
    if r["compile_s"] is not None:
        out.append(f"compile {r['compile_s']:.1f}s")
    if r.get("adam_eps", 1e-8) != 1e-8:
        out.append(f"AdamW eps {r['adam_eps']:g}")
    return ", ".join(out)


def render_bench_table(title: str, results: Sequence[dict[str, Any]], out: IO[str]) -> None:
    """The bench table in at most 80 columns (rich wraps the notes and headers to fit),
    with a caption when the intervals did not become stable."""
    render_narrow(title, BENCH_HEADERS, bench_rows(results), out, BENCH_LEFT,
                  caption=table_caption(results))


def table_caption(results: Sequence[dict[str, Any]]) -> Optional[str]:
    """"NOT stable ..." under the table when a speedup's interval is wider than ±5%."""
    stab = stability(results)
    if len(results) < 2 or stab["stable"]:
        return None
    if not stab["interleaved"]:
        return "one policy after another: no intervals (see below)"
    widest = stab["widest_half_width"]
    return ("NOT stable: " + ("too few rounds for 95% intervals" if widest is None else
            f"widest 95% interval ±{widest:.0%}, target ±{stab['target']:.0%}") +
            " (see below)")


def render_narrow(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                  out: IO[str], left: Sequence[int], caption: Optional[str] = None) -> None:
    """A table in at most 80 columns: every column keeps its width but the last of
    ``left`` (free text), which wraps; ``caption`` under it. Plain text without rich."""
    if not have_rich():
        render_table(title, headers, rows, out, left)
        if caption:
            out.write(caption + "\n")
        return
    from rich import box
    from rich.table import Table
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption=caption)
    for i, head in enumerate(headers):
        table.add_column(head, justify="left" if i in left else "right", no_wrap=i != left[-1],
                         min_width=max(len(row[i]) for row in rows) if i == 0 else None)
    for row in rows:
        table.add_row(*row)
    console = rich_console(out, None if out.isatty() else TABLE_WIDTH)
    console.width = min(console.width, TABLE_WIDTH)
    console.print(table)


# --- the words --------------------------------------------------------------------------------
def stability(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Whether every speedup's 95% interval is within ±5%: the widest half width, rounds."""
    widths = [half_width(r["speedup"], r.get("speedup_ci")) for r in results[1:]]
    widest = max(widths, default=0.0)
    rounds = len(results[0].get("round_ms") or [])
    interleaved = bool(results[0].get("interleaved"))
    return {"stable": interleaved and widest <= STABLE_HALF_WIDTH, "target": STABLE_HALF_WIDTH,
            "widest_half_width": None if widest == float("inf") else widest,
            "rounds": rounds if interleaved else 0, "interleaved": interleaved}


def complete(document: dict[str, Any], max_loss_dev: float) -> dict[str, Any]:
    """Add "stability", "recommended", "recommendation" and "verdict" to a bench document.

    ``document`` has "environment", "workload", "settings", "results" and, optionally,
    "machine" (``measure.machine_state``, before and after the run).
    """
    results = document["results"]
    document["stability"] = stability(results)
    rec = recommend(results, max_loss_dev)
    doubts = _doubts(document)
    rec.update(trustworthy=not doubts, doubts=doubts)
    rec["sentence"] = recommendation_sentence(rec, results)
    document["recommended"] = rec["recommended"]
    document["recommendation"] = rec
    document["verdict"] = bench_verdict(document)
    return document


def _doubts(document: dict[str, Any]) -> list[str]:
    """Why the timings should not be trusted, as short phrases (none: trustworthy)."""
    doubts = []
    stab, machine = document["stability"], document.get("machine") or {}
    if len(document["results"]) > 1 and not stab["stable"]:
        doubts.append("the timings were not stable" if stab["interleaved"] else
                      "the policies ran one after another, with no interval")
    if machine.get("busy"):
        doubts.append("the machine was busy")
    return doubts


def bench_verdict(document: dict[str, Any]) -> list[str]:
    """Plain sentences on what the run measured, including the unflattering parts."""
    env, results, settings = document["environment"], document["results"], document["settings"]
    ref = results[0]
    native = env["native"]
    lines = [f"Device {env['device']} ({env['device_name']}): native bf16 "
             f"{_yes(native['bf16'])}, fp16 {_yes(native['fp16'])}, fp8 {_yes(native['fp8'])}; "
             f"torch {env['torch']}, ampkit {env['ampkit']}.", _workload_sentence(document)]
    lines += _machine_sentences(document)
    if "fp32_math" in env:
        lines.append(f"fp32 on this GPU (torch's settings): {env['fp32_math']}.")
    tolerance = (document.get("recommendation") or {}).get("max_loss_dev", 0.02)
    lines += [_policy_sentence(r, ref, tolerance) for r in results[1:]]
    slower = [(r["policy"], r["half_dtype"]) for r in results[1:]
              if r["half_dtype"] and r["fp8_recipe"] is None and _measurably(r) == "slower"]
    if slower and env["device"] == "cpu":
        lines.append(_cpu_slowdown(slower, native, settings, document.get("machine") or {}))
    lines += _row_sentences(results, native)
    lines.append(f"Peak memory: {ref['memory_method']}.")
    if ref.get("mem_ratio_reason"):
        lines.append(f"No memory ratios: {ref['mem_ratio_reason']}.")
    if "stability" in document:
        lines.append(_stability_sentence(document))
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _workload_sentence(document: dict[str, Any]) -> str:
    """What ran and what the table's speedup and mem × columns are relative to (only what
    the table shows: no interval where none was measured, no memory ratio where none is)."""
    settings, results = document["settings"], document["results"]
    ref = results[0]
    steps = len(ref.get("step_times_ms") or []) or settings["steps"]
    rounds = (document.get("stability") or {}).get("rounds")
    intervals = any(r.get("speedup_ci") is not None for r in results[1:])
    how, speedup = ((f"taking turns in {rounds} rounds", "the median of per-round ratios"
                     + (", with its 95% interval" if intervals else "")) if rounds else
                    ("one policy after another", "the ratio of median step times"))
    memory = "" if ref.get("mem_ratio_reason") else " and memory"
    return (f"Workload: {document['workload']}; {steps} timed steps per policy, {how}, after "
            f"{settings['warmup']} warm-up steps; speedup ({speedup}){memory} relative to "
            f"{ref['policy']}.")


def _machine_sentences(document: dict[str, Any]) -> list[str]:
    settings, machine = document["settings"], document.get("machine") or {}
    threads = settings.get("threads")
    out = []
    if threads is not None:
        why = settings.get("threads_reason")
        out.append(f"Threads: {why if why else threads} (--threads N to change).")
    if machine.get("loadavg_1m") is not None:
        governor = f", CPU governor {machine['governor']}" if machine.get("governor") else ""
        state = "busy" if machine["busy"] else "quiet enough"
        out.append(f"Machine: 1-minute load average {machine['loadavg_1m']:.2f} on "
                   f"{machine['cpus']} CPUs before the run ({state}){governor}.")
    return out


def _measurably(r: dict[str, Any]) -> str:
    """"faster", "slower", "no measurable difference", or "" (no interval)."""
    ci = r.get("speedup_ci")
    if ci is None:
        return ""
    return "faster" if ci[0] > 1 else "slower" if ci[1] < 1 else "no measurable difference"


def _policy_sentence(r: dict[str, Any], ref: dict[str, Any], tolerance: float) -> str:
    speed, ci = r["speedup"], r.get("speedup_ci")
    if speed is None:
        pace = "n/a"
    elif ci is None:
        # Without an interval a ratio is no measurement of faster or slower.
        pace = (f"{speed:.2f}× the speed of {ref['policy']} (no interval: too few rounds to "
                "tell faster from slower)")
    else:
        pace = (f"{speed:.2f}× the speed of {ref['policy']} (95% interval {interval(ci)}: "
                f"{_measurably(r)})")
    mem = "" if r["mem_ratio"] is None else f", {r['mem_ratio']:.2f}× its peak memory"
    dev = r.get("max_loss_rel_dev")
    if dev is None:
        loss = "its loss curve went non-finite"
    elif dev > tolerance:
        loss = (f"its loss curve moved up to {dev * 100:.2g}% from {ref['policy']}'s, more than "
                f"the {tolerance * 100:g}% tolerance: check the accuracy it reaches before using it")
    else:
        loss = f"loss curve within {dev * 100:.2g}% of it"
    return f"{r['policy']}: {pace}{mem}, {loss}."


def _cpu_slowdown(slower: list[tuple[str, str]], native: dict[str, bool],
                  settings: dict[str, Any], machine: dict[str, Any]) -> str:
    """Why half-precision policies (name, half dtype name) ran slower than fp32 on a CPU;
    "native" is judged per policy's own half dtype (bf16 and fp16 differ on a CPU): one
    sentence for those without native arithmetic, one for those with it."""
    threads = settings.get("threads") or 1
    if threads > 1 and machine.get("busy"):
        names = ", ".join(name for name, _ in slower)
        return (f"{names} ran slower than fp32 with {threads} threads on a busy machine: OpenMP "
                "threads that wait for a CPU distort small models' timings many times over; "
                "rerun with --threads 1 before reading anything into it.")
    lacking = [(name, _HALF_NAMES[dtype]) for name, dtype in slower
               if not native.get(_HALF_NAMES[dtype], False)]
    having = [name for name, dtype in slower if native.get(_HALF_NAMES[dtype], False)]
    sentences = []
    if lacking:
        kinds = sorted({kind for _, kind in lacking})
        names = ", ".join(name for name, _ in lacking)
        instructions = {"bf16": "AVX512-BF16/AMX", "fp16": "AVX512-FP16/AMX-FP16"}
        sentences.append(
            f"{names} ran slower than fp32 because this CPU has no native {'/'.join(kinds)} "
            f"arithmetic (no {' or '.join(instructions[k] for k in kinds)}): expected here, "
            "and no guide to a GPU, where half precision is what tensor cores are built for.")
    if having:
        sentences.append(
            f"{', '.join(having)} ran slower than fp32 on this CPU although it has native "
            "instructions for that half precision: at sizes this small, casts and per-op "
            "overheads can cost more than the faster matmuls save. These are this machine's "
            "measured numbers; a GPU behaves differently.")
    return " ".join(sentences)


def _row_sentences(results: Sequence[dict[str, Any]], native: dict[str, bool]) -> list[str]:
    out = []
    for r in results:
        if r["fp8_recipe"] is not None:
            out.append(_fp8_sentence(r, native["fp8"]))
        if r["nonfinite_losses"]:
            out.append(f"{r['policy']}: {r['nonfinite_losses']} of {len(r['losses'])} losses "
                       "were inf/NaN: this policy does not train this model as it is.")
        if r.get("adam_eps", 1e-8) != 1e-8:
            out.append(f"{r['policy']}: AdamW eps {r['adam_eps']:g} instead of 1e-8 (the other "
                       "rows): fp16 parameters without fp32 masters underflow the second "
                       "moment, and 1e-8 would let the update explode.")
    return out


def _fp8_sentence(r: dict[str, Any], native_fp8: bool) -> str:
    if not r["fp8_layers"]:
        return (f"{r['policy']}: no Linear layer had in/out features divisible by 16, so nothing "
                "ran in fp8 (the run is bf16-mixed).")
    hardware = ("on fp8 tensor cores" if native_fp8 else
                "emulated (this device has no fp8 matmul): its time says nothing about a GPU")
    return f"{r['policy']}: {r['fp8_layers']} Linear layers in fp8, {hardware}."


def _stability_sentence(document: dict[str, Any]) -> str:
    stab, settings = document["stability"], document["settings"]
    if len(document["results"]) < 2:
        return "Only one policy ran: nothing to compare."
    if not stab["interleaved"]:
        return ("The policies ran one after another (--compile in one process: each compiles "
                "afresh), so the speedups have no interval; --isolate always lets them take turns.")
    if stab["stable"]:
        return (f"Timings stable: every speedup's 95% interval is within ±{stab['target']:.0%} "
                f"of it after {stab['rounds']} rounds.")
    widest, rounds = stab["widest_half_width"], stab["rounds"]
    reach = (f"{rounds} round{' is' if rounds == 1 else 's are'} too few for a 95% interval, "
             "which takes 6" if widest is None else f"after {rounds} rounds the widest 95% "
             f"interval is ±{widest:.0%}, wider than the ±{stab['target']:.0%} target")
    budget = settings.get("max_time") or 0
    more = ("more --steps (--nproc runs exactly --steps)" if document.get("nproc") else
            f"more --steps or --max-time (was {budget:g} s)" if budget else
            "--max-time 20 (more rounds until the intervals are stable)")
    hints = ["--threads 1" if (settings.get("threads") or 1) > 1 else None,
             "a quieter machine", more]
    return (f"Timings NOT stable: {reach}; small differences mean nothing here. Try "
            f"{', '.join(h for h in hints if h)}.")


def _rejected(row: dict[str, Any]) -> str:
    if row["max_loss_dev"] is None:
        return f"{row['policy']}: loss not finite"
    speed = "n/a" if row["speedup"] is None else f"{row['speedup']:.2f}×"
    if row["reason"].startswith("loss moved"):
        return f"{row['policy']}: {speed}, but loss moved {row['max_loss_dev'] * 100:.2g}%"
    return f"{row['policy']}: {speed}"


def recommendation_sentence(rec: dict[str, Any], results: Sequence[dict[str, Any]]) -> str:
    """The last line of ``ampkit bench``: which policy to use here and why."""
    if rec["recommended"] is None:
        return f"Recommendation: none. {rec['reason'][0].upper()}{rec['reason'][1:]}."
    rows = rec["rows"]
    ref, chosen = rows[0], next(r for r in rows if r["policy"] == rec["recommended"])
    tolerance = f"{rec['max_loss_dev'] * 100:g}%"
    if chosen is ref and reference_not_finite(rows):
        return f"Recommendation: none judged ({ref['policy']} by default): {REF_NOT_FINITE}."
    if chosen is ref:
        others = ", ".join(_rejected(r) for r in rows[1:])
        why = (f"no other policy was faster than fp32 within the {tolerance} loss tolerance"
               + (f" ({others})" if others else ""))
    else:
        ci = chosen["speedup_ci"]
        shown = "" if ci is None else f" (95% interval {interval(ci)})"
        mem = ("" if chosen["mem_ratio"] is None else
               f", {chosen['mem_ratio']:.2f}× its peak memory")
        why = (f"the fastest within the {tolerance} loss tolerance: {chosen['speedup']:.2f}× the "
               f"speed of {ref['policy']}{shown}{mem}, loss within "
               f"{chosen['max_loss_dev'] * 100:.2g}% of fp32's")
        if ci is not None and ci[0] <= 1:
            why += (f"; but its interval includes 1×: no measurable difference from "
                    f"{ref['policy']}, either will do")
    line = f"Recommendation: {rec['recommended']} here: {why}."
    if rec.get("doubts"):
        line += (f" Provisional: {' and '.join(rec['doubts'])}; rerun on a quieter machine "
                 "before relying on it.")
    return line
