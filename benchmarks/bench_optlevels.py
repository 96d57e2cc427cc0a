"""apex-style opt levels side by side with fp32 and torch.amp, in one run.

Workloads (GPU.md): the GPT (d=1024, 12 layers, seq 1024, vocab 32768, batch 16) and
torchvision's ResNet-50 (224x224, batch 128, channels-last; skipped with a note when
torchvision is missing). Modes, all with AdamW (fused where torch has the kernel):

  fp32          plain fp32 training
  torch.amp O1  torch.autocast + torch.amp.GradScaler (the reference for the ratios)
  ampkit O1     ampkit.initialize(opt_level="O1") + scale_loss
  ampkit O2     half model, fp32 masters (the fused AdamW steps the masters) + scale_loss
  ampkit O3     pure half model and optimizer, no loss scaling (may diverge in fp16)

Each mode starts from the same weights and cycles through the same synthetic batches for
--train-steps steps (AdamW, lr 3e-4). Reported per mode: median step time (after
--warmup steps; CUDA events around each of --steps steps), peak memory
(torch.cuda.max_memory_allocated after a reset; CUDA only), the mean loss of the last 5
steps, and each as a ratio to torch.amp O1. Timings of one run are compared as ratios.

    PYTHONPATH=src python3 benchmarks/bench_optlevels.py [--json out/bench_optlevels.json]
    PYTHONPATH=src python3 benchmarks/bench_optlevels.py --quick --device cpu   # smoke test

The JSON is rewritten after each mode; a mode that raises (out of memory or anything
else) is an error row and the next one runs; an interrupt (SIGINT/SIGTERM) writes what
was measured and exits 130.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ampkit import frontend
from ampkit._dtypes import autocast_default_dtype, resolve_dtype
from ampkit import _measure as harness
from ampkit.bench.report import environment
from ampkit.bench.workloads import Batch, Workload, classification_loss, get_workload
from _incremental import error_fields, free_cuda, interrupted, write_json

MODES = ("fp32", "torch.amp O1", "ampkit O1", "ampkit O2", "ampkit O3")
REFERENCE = "torch.amp O1"
_LAST = 5  # the loss reported is the mean over this many final steps
_LR = 3e-4


# --- workloads --------------------------------------------------------------------------------
def gpt(device: str, quick: bool) -> Workload:
    return get_workload("gpt", device, batch_size=4 if quick else 16)


def resnet50(device: str, quick: bool) -> Workload:
    import torchvision  # optional: the caller reports the ImportError as a skip

    batch, size = (2, 32) if quick else (128, 224)

    def batches(dev: torch.device) -> list[Batch]:
        gen = torch.Generator().manual_seed(0)
        out = []
        for _ in range(4):
            x = torch.randn(batch, 3, size, size, generator=gen)
            y = torch.randint(0, 1000, (batch,), generator=gen)
            out.append((x.to(dev, memory_format=torch.channels_last), y.to(dev)))
        return out

    def build() -> nn.Module:
        return torchvision.models.resnet50().to(memory_format=torch.channels_last)

    return Workload("resnet50", build, batches, classification_loss, batch,
                    f"torchvision ResNet-50, {size}x{size}, batch {batch}, channels-last")


WORKLOADS: dict[str, Callable[[str, bool], Workload]] = {"gpt": gpt, "resnet50": resnet50}


# --- one mode -------------------------------------------------------------------------------
def _adamw(params: Any, device: str) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=_LR, fused=True)
    except (RuntimeError, ValueError):  # no fused kernel for this device in this build
        return torch.optim.AdamW(params, lr=_LR, foreach=True)


def _stepper(mode: str, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable,
             device_type: str, half: torch.dtype) -> Callable[[Batch], Tensor]:
    if mode == "fp32":
        def fp32_step(batch: Batch) -> Tensor:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            return loss
        return fp32_step
    if mode == REFERENCE:
        scaler = torch.amp.GradScaler(device_type)

        def torch_amp_step(batch: Batch) -> Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=half):
                loss = loss_fn(model(batch[0]), batch[1])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss
        return torch_amp_step

    def ampkit_step(batch: Batch) -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch[0]), batch[1])
        with frontend.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss
    return ampkit_step


def measure(workload: Workload, mode: str, device: str, half: torch.dtype, warmup: int,
            steps: int, total: int) -> dict[str, Any]:
    """Train ``total`` steps in one mode, timing steps ``warmup .. warmup + steps``."""
    device_type = torch.device(device).type
    batches = workload.batches(torch.device(device))
    torch.manual_seed(0)
    model = workload.build().to(device)
    opt = _adamw(model.parameters(), device)
    if mode.startswith("ampkit"):
        model, opt = frontend.initialize(model, opt, opt_level=mode.split()[1], half_dtype=half,
                                         verbosity=0)
    step = _stepper(mode, model, opt, workload.loss_fn, device_type, half)
    if device_type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # ampkit's bench harness: CUDA events per step and one host sync, after the loop.
    timer, losses = harness.StepTimer(torch.device(device), steps), []
    for i in range(max(total, warmup + steps)):
        batch = batches[i % len(batches)]
        if warmup <= i < warmup + steps:
            timer.start(i - warmup)
            loss = step(batch)
            timer.stop(i - warmup)
        else:
            loss = step(batch)
        losses.append(loss.detach())  # read once at the end: no host sync per step here
    times = timer.times_ms()
    values = torch.stack(losses).float().tolist()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device_type == "cuda" else None
    return {"mode": mode, "step_ms": statistics.median(times), "peak_gib": peak,
            "loss": statistics.fmean(values[-_LAST:]), "first_loss": values[0],
            "steps_trained": len(values), "finite": all(math.isfinite(v) for v in values)}


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ref = next((r for r in rows if r["mode"] == REFERENCE and "error" not in r), None)
    for row in rows:
        if ref is None or "error" in row:
            continue
        row["speedup_vs_torch_amp"] = ref["step_ms"] / row["step_ms"]
        if row["peak_gib"] is not None:
            row["memory_vs_torch_amp"] = row["peak_gib"] / ref["peak_gib"]
        if math.isfinite(row["loss"]):
            row["loss_vs_torch_amp"] = row["loss"] / ref["loss"]
    return rows


def run_workload(name: str, args: argparse.Namespace, half: torch.dtype,
                 block: Optional[dict[str, Any]] = None,
                 on_row: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Every mode on one workload, into ``block`` (its "results" grow row by row);
    ``on_row(row)`` after each mode."""
    block = {"workload": name} if block is None else block
    try:
        workload = WORKLOADS[name](args.device, args.quick)
    except ImportError as err:
        block["skipped"] = f"{err} (pip install torchvision to run it)"
        return block
    block.update(description=workload.description, results=[])
    rows = block["results"]
    for mode in args.modes:
        try:
            row = measure(workload, mode, args.device, half, args.warmup, args.steps,
                          args.train_steps)
        except torch.OutOfMemoryError as err:
            row = {"mode": mode, "error": f"out of memory: {str(err).splitlines()[0]}"}
        except Exception as err:  # noqa: BLE001 - a failing mode is recorded, not fatal
            row = {"mode": mode, **error_fields(err)}
        free_cuda()
        rows.append(row)
        _with_ratios(rows)
        if on_row:
            on_row(row)
    return block


# --- report ---------------------------------------------------------------------------------
def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(document: dict[str, Any]) -> None:
    env = document["environment"]
    print(f"\nampkit opt levels vs torch.amp O1 on {env['device_name']} ({env['device']}), "
          f"torch {env['torch']}, half dtype {document['half_dtype']}")
    header = f"{'workload':9} {'mode':13} {'step ms':>9} {'speedup':>8} {'peak GiB':>9} " \
             f"{'mem ratio':>9} {'loss':>9} {'loss ratio':>10}"
    print(header)
    print("-" * len(header))
    for block in document["workloads"]:
        if "skipped" in block:
            print(f"{block['workload']:9} skipped: {block['skipped']}")
            continue
        for r in block["results"]:
            if "error" in r:
                print(f"{block['workload']:9} {r['mode']:13} {r['error']}")
                continue
            print(f"{block['workload']:9} {r['mode']:13} {r['step_ms']:9.2f} "
                  f"{_fmt(r.get('speedup_vs_torch_amp'), '8.3f')} {_fmt(r['peak_gib'], '9.2f'):>9} "
                  f"{_fmt(r.get('memory_vs_torch_amp'), '9.3f'):>9} {r['loss']:9.4f} "
                  f"{_fmt(r.get('loss_vs_torch_amp'), '10.4f'):>10}")


def _row_text(workload: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{workload:9} {r['mode']:13} FAILED: {r['error'][:100]}"
    return (f"{workload:9} {r['mode']:13} {r['step_ms']:9.2f} ms  peak "
            f"{_fmt(r['peak_gib'], '.2f')} GiB  loss {r['loss']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="fp16 or bf16 (default: the device's "
                        "autocast default, fp16 on CUDA)")
    parser.add_argument("--workloads", default="gpt,resnet50")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=100,
                        help="steps trained in all (the loss is the mean of the last 5)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps")
    parser.add_argument("--json", default="out/bench_optlevels.json")
    args = parser.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in args.modes if m not in MODES] + [
        w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        parser.error(f"unknown mode/workload {bad}; valid modes: {', '.join(MODES)}; "
                     f"valid workloads: {', '.join(WORKLOADS)}")
    if args.quick:
        args.warmup, args.steps, args.train_steps = 2, 5, 10
    device_type = torch.device(args.device).type
    half = (autocast_default_dtype(device_type) if args.dtype is None
            else resolve_dtype(args.dtype, allowed=(torch.float16, torch.bfloat16), what="--dtype"))
    # Diverged losses are written as "nan"/"inf" (_incremental.json_safe), not invalid JSON.
    document = {"benchmark": "bench_optlevels", "date": time.strftime("%Y-%m-%d"),
                "environment": environment(args.device), "half_dtype": str(half),
                "quick": args.quick, "warmup": args.warmup, "steps": args.steps,
                "workloads": []}

    def save() -> None:
        document["interrupted"] = True
        write_json(args.json, document)

    with interrupted(save, "bench_optlevels"):
        for name in args.workloads.split(","):
            block: dict[str, Any] = {"workload": name}
            document["workloads"].append(block)
            run_workload(name, args, half, block, lambda row, name=name: (
                write_json(args.json, document), print(_row_text(name, row), flush=True)))
            write_json(args.json, document)
            if "skipped" in block:
                print(f"{name:9} skipped: {block['skipped']}", flush=True)
    write_json(args.json, document)
    print_table(document)
    print(f"\nfull results: {args.json}")


if __name__ == "__main__":
    main()
