"""Overhead of ampkit.GradScaler against torch.amp.GradScaler, side by side in one run.

Workload (GPU.md): 1000 fp32 parameters of 64K elements, foreach SGD and fused AdamW.
For each optimizer three variants step the same parameters, interleaved in rounds:
``plain`` (optimizer.step() alone), ``torch`` and ``ampkit`` (scaler.step(opt) +
scaler.update(), which unscale, check for inf/NaN and update the scale). Reported: the
median step time, the time each scaler adds to the plain step and the ratio of the two,
and host syncs per step.

Two timings on CUDA: ``idle`` (the GPU idle when the step starts: CUDA events around the
step, so host overhead shows), and ``queued`` (the step issued behind a few ms of GPU
work, as after a backward pass: a scaler without host syncs hides its launches behind
that work, one with a sync waits for it and then exposes its launches).

Host syncs are counted on CUDA with torch.cuda.set_sync_debug_mode("warn") (one warning
per synchronizing call, captured); on CPU, where nothing synchronizes, by patching
Tensor.item/tolist/__bool__/__float__/__int__ (each read of a tensor value by the host).

    PYTHONPATH=src python3 benchmarks/bench_scaler.py [--device cuda] [--json out/bench_scaler.json]
    PYTHONPATH=src python3 benchmarks/bench_scaler.py --quick --device cpu   # smoke test

The JSON is rewritten after each optimizer (one that raises is an error row); an
interrupt (SIGINT/SIGTERM) writes what was measured and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from typing import Callable, Iterator, Optional

import torch

from ampkit._torch_compat import foreach_copy_
from ampkit.scaler import GradScaler
from _incremental import error_fields, free_cuda, interrupted, write_json

VARIANTS = ("plain", "torch", "ampkit")
_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _optimizers(device: str) -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    makers = {"foreach SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
              "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)}
    try:
        makers["fused AdamW"]([torch.zeros(1, device=device, requires_grad=True)])
    except (RuntimeError, ValueError) as err:  # torch builds without fused kernels there
        print(f"skipping fused AdamW on {device}: {err}")
        del makers["fused AdamW"]
    return makers


def _workload(n: int, numel: int, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(numel, device=device, generator=gen).requires_grad_() for _ in range(n)]
    source = [torch.randn(numel, device=device, generator=gen) for _ in range(n)]
    for p in params:
        p.grad = torch.empty_like(p)
    return params, source


def _stepper(variant: str, opt: torch.optim.Optimizer, device: str) -> Callable[[], None]:
    if variant == "plain":
        return opt.step
    scaler = (torch.amp.GradScaler(device) if variant == "torch" else GradScaler(device))
    scaler.scale(torch.ones((), device=device))  # create the scale on the device

    def step() -> None:
        scaler.step(opt)
        scaler.update()
    return step


class _Timer:
    """Milliseconds of one call: CUDA events (median-friendly) or perf_counter on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.sleep_cycles = 0
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], None], queued: bool = False) -> float:
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        if queued:
            torch.cuda._sleep(self.sleep_cycles)  # stands in for the tail of a backward pass
        self.start.record()
        fn()
        self.end.record()
        self.sync()
        return self.start.elapsed_time(self.end)

    def calibrate_sleep(self, ms: float) -> None:
        """Pick torch.cuda._sleep cycles that keep the GPU busy for about ``ms``."""
        cycles = 1_000_000
        self.sync()
        self.start.record()
        torch.cuda._sleep(cycles)
        self.end.record()
        self.sync()
        self.sleep_cycles = int(cycles * ms / max(self.start.elapsed_time(self.end), 1e-3))


@contextlib.contextmanager
def _count_syncs(device: str) -> Iterator[dict]:
    counts = {"n": 0}
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts["n"] = sum("synchroniz" in str(w.message) for w in caught)
        return
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counting(original: Callable) -> Callable:
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            counts["n"] += 1
            return original(self, *args, **kwargs)
        return read
    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _median_times(steps: dict[str, Callable[[], None]], reset: Callable[[], None],
                  timer: _Timer, samples: int, queued: bool) -> dict[str, float]:
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(samples):  # interleaved, so drift hits every variant alike
        for variant, step in steps.items():
            reset()
            times[variant].append(timer(step, queued))
    return {v: statistics.median(t) for v, t in times.items()}


def _summary(ms: dict[str, float]) -> dict[str, float]:
    torch_added, amp_added = ms["torch"] - ms["plain"], ms["ampkit"] - ms["plain"]
    return {**{f"{v}_ms": ms[v] for v in VARIANTS}, "torch_added_ms": torch_added,
            "ampkit_added_ms": amp_added,
            "added_ratio": amp_added / torch_added if torch_added > 0 else float("nan"),
            "step_ratio": ms["ampkit"] / ms["torch"]}


def _measure_optimizer(make: Callable, device: str, n: int, numel: int, warmup: int,
                       samples: int, queued_ms: Optional[float], timer: _Timer) -> dict:
    params, source = _workload(n, numel, device)
    grads = [p.grad for p in params]

    def reset() -> None:  # fresh scaled gradients before every step (unscale_ works in place)
        foreach_copy_(grads, source)
    steps = {v: _stepper(v, make(params), device) for v in VARIANTS}
    for _ in range(warmup):
        for step in steps.values():
            reset()
            step()
    result = {"idle": _summary(_median_times(steps, reset, timer, samples, False))}
    if timer.cuda and queued_ms:
        timer.calibrate_sleep(max(queued_ms, 3 * result["idle"]["torch_ms"]))
        result["queued"] = _summary(_median_times(steps, reset, timer, samples, True))
    result["syncs_per_step"] = {}
    for variant, step in steps.items():
        reset()
        timer.sync()
        with _count_syncs(device) as counts:
            step()
        result["syncs_per_step"][variant] = counts["n"]
    return result


def measure(device: str, n: int, numel: int, warmup: int, samples: int,
            queued_ms: Optional[float],
            on_row: Optional[Callable[[str, dict], None]] = None) -> dict:
    """Each optimizer's result; one that raises is an error row; ``on_row`` after each."""
    timer = _Timer(device)
    out = {}
    for name, make in _optimizers(device).items():
        try:
            out[name] = _measure_optimizer(make, device, n, numel, warmup, samples, queued_ms,
                                           timer)
        except Exception as err:  # noqa: BLE001 - a failing optimizer is recorded, not fatal
            out[name] = error_fields(err)
            free_cuda()
        if on_row:
            on_row(name, out[name])
    return out


def _print_table(meta: dict, results: dict) -> None:
    print(f"GradScaler overhead, {meta['device_name']}, torch {meta['torch']}, "
          f"{meta['params']} fp32 grads x {meta['numel']} elements, median of {meta['samples']}")
    print(f"{'optimizer':<13}{'timing':<8}{'plain':>9}{'torch':>9}{'ampkit':>9}"
          f"{'torch +':>9}{'ampkit +':>10}{'ratio':>7}   syncs/step plain/torch/ampkit")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<13}FAILED: {r['error'][:100]}")
            continue
        syncs = "/".join(str(r["syncs_per_step"][v]) for v in VARIANTS)
        for timing in ("idle", "queued"):
            if timing not in r:
                continue
            s = r[timing]
            print(f"{name:<13}{timing:<8}{s['plain_ms']:>9.3f}{s['torch_ms']:>9.3f}"
                  f"{s['ampkit_ms']:>9.3f}{s['torch_added_ms']:>9.3f}{s['ampkit_added_ms']:>10.3f}"
                  f"{s['added_ratio']:>7.2f}   {syncs}")
    print(f"ms per step; '+' = added to the plain step; ratio = ampkit added / torch added. "
          f"Syncs counted by {meta['sync_count_method']}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--numel", type=int, default=64 * 1024)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--queued-ms", type=float, default=5.0,
                        help="GPU work queued before each 'queued' step (CUDA only; 0 = skip)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--json", default="out/bench_scaler.json")
    args = parser.parse_args()
    if args.quick:
        args.params, args.numel, args.samples, args.warmup = 50, 4096, 9, 2
    if args.device == "cpu":
        # One intra-op thread: OpenMP workers stall badly when other processes share the
        # cores, which swamped the ~0.1 ms being measured. CPU figures are a smoke test only.
        torch.set_num_threads(1)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "params": args.params, "numel": args.numel, "samples": args.samples,
            "warmup": args.warmup, "queued_ms": args.queued_ms, "quick": args.quick,
            "threads": torch.get_num_threads(),
            "sync_count_method": ("torch.cuda.set_sync_debug_mode('warn'), warnings counted"
                                  if args.device == "cuda" else
                                  "patched Tensor.item/tolist/__bool__/__float__/__int__")}
    document: dict = {"meta": meta, "results": {}}

    def on_row(name: str, row: dict) -> None:
        document["results"][name] = row
        write_json(args.json, document)
        if "error" in row:
            print(f"{name}: FAILED: {row['error']}", flush=True)
        else:
            ratios = ", ".join(f"{t}: ampkit/torch step {row[t]['step_ratio']:.3f}"
                               for t in ("idle", "queued") if t in row)
            print(f"{name}: done ({ratios})", flush=True)

    def save() -> None:
        document["meta"]["interrupted"] = True
        write_json(args.json, document)

    with interrupted(save, "bench_scaler"):
        measure(args.device, args.params, args.numel, args.warmup, args.samples,
                args.queued_ms, on_row)
    write_json(args.json, document)
    _print_table(meta, document["results"])


if __name__ == "__main__":
    main()
