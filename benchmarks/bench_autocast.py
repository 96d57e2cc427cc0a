"""Cost of ampkit.autocast against torch.autocast, measured side by side in one run.

Two numbers per device: the host time to enter plus leave a region (with no op inside),
and the time of a small op inside a region (unregistered op: must equal torch's).
Interleaves the two contexts in rounds and takes medians, so drift hits both alike.

    PYTHONPATH=src python3 benchmarks/bench_autocast.py [--device cpu] [--json out/autocast.json]

The JSON is rewritten after each case (a case that raises is an error row); an
interrupt (SIGINT/SIGTERM) writes what was measured and exits 130.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

import torch

import ampkit
from _incremental import error_fields, interrupted, write_json


def _time_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6  # microseconds


def _enter_exit(ctx_factory: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with ctx_factory():
            pass
    return run


def _op_inside(ctx_factory: Callable[[], object], a: torch.Tensor, b: torch.Tensor,
               sync: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with ctx_factory():
            for _ in range(20):
                torch.mm(a, b)
        sync()
    return run


def measure(device: str, dtype: torch.dtype, rounds: int, calls: int,
            on_row: Optional[Callable[[str, dict], None]] = None) -> dict:
    torch_ctx = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
    amp_ctx = lambda: ampkit.autocast(device, dtype=dtype)  # noqa: E731
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a = torch.randn(64, 64, device=device)
    b = torch.randn(64, 64, device=device)
    cases = {"enter_exit": (_enter_exit(torch_ctx), _enter_exit(amp_ctx), calls),
             "20 mm 64x64 inside": (_op_inside(torch_ctx, a, b, sync), _op_inside(amp_ctx, a, b, sync),
                                    max(calls // 50, 20))}
    out = {}
    for name, (torch_fn, amp_fn, n) in cases.items():
        try:
            torch_fn(), amp_fn()  # warm up
            t_us, a_us = [], []
            for _ in range(rounds):
                t_us.append(_time_per_call(torch_fn, n))
                a_us.append(_time_per_call(amp_fn, n))
            t, a_ = statistics.median(t_us), statistics.median(a_us)
            out[name] = {"torch_us": t, "ampkit_us": a_, "ratio": a_ / t}
        except Exception as err:  # noqa: BLE001 - a failing case is recorded, not fatal
            out[name] = error_fields(err)
        if on_row:
            on_row(name, out[name])
    return out


def _row_text(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<22}  FAILED: {r['error'][:100]}"
    return f"{name:<22}{r['torch_us']:>13.2f} us{r['ampkit_us']:>14.2f} us{r['ratio']:>8.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test")
    parser.add_argument("--json", default="out/bench_autocast.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 2000
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": args.dtype, "rounds": args.rounds, "calls": args.calls}
    document: dict = {"meta": meta, "results": {}}
    print(f"autocast cost, {meta['device_name']}, torch {meta['torch']}, {args.dtype}")
    print(f"{'case':<22}{'torch.autocast':>16}{'ampkit.autocast':>17}{'ratio':>8}", flush=True)

    def on_row(name: str, row: dict) -> None:
        document["results"][name] = row
        write_json(args.json, document)
        print(_row_text(name, row), flush=True)

    def save() -> None:
        document["meta"]["interrupted"] = True
        write_json(args.json, document)

    with interrupted(save, "bench_autocast"):
        measure(args.device, dtype, args.rounds, args.calls, on_row)
    write_json(args.json, document)
    print(f"full results: {args.json}")


if __name__ == "__main__":
    main()
