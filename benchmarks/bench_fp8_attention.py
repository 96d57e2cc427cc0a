"""FP8 attention: ampkit's fp8 kernels against torch's bf16 attention, in one run.

Per shape (causal self-attention, ``(batch, heads, seq, head_dim)``):
- time of the forward alone (no grad) and of forward + backward, for torch's
  ``F.scaled_dot_product_attention`` in bf16 (flash attention on CUDA) and for
  ``ampkit.fp8.scaled_dot_product_attention`` (its Triton kernels on a GPU with fp8
  tensor cores, the emulation elsewhere);
- peak memory of forward + backward above the inputs;
- numerics: SQNR in dB of each output and of the three gradients against fp32 attention
  on the same inputs (bf16 attention's own SQNR, next to fp8's, is the yardstick).
And once: the host cost of the ``fp8_attention()`` region, which routes every torch
function call in it through one Python check: microseconds per op of a chain of small
ops, run alternately with and without the region (medians).

Shapes: ``gpt`` (16 x 16 heads x 1024 x 64: the bench GPT, d=1024), ``long`` (1 x 16 x
8192 x 128), ``gqa`` (as long, 4 key/value heads). ``--quick`` uses one small shape (the
CPU smoke test). Timing: warm-up calls (Triton compiles on the first), then CUDA events
(perf_counter on CPU) around each call, median of ``--iters``.

    PYTHONPATH=src python3 benchmarks/bench_fp8_attention.py --device cuda --json out/a.json
    PYTHONPATH=src python3 benchmarks/bench_fp8_attention.py --quick --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from ampkit import _measure as harness  # noqa: E402
from ampkit.fp8 import attention, fp8_attention, scaled_dot_product_attention  # noqa: E402
from _incremental import error_fields, free_cuda, interrupted, write_json  # noqa: E402

SHAPES = {  # name: (batch, heads, kv_heads, seq, head_dim)
    "gpt": (16, 16, 16, 1024, 64),
    "long": (1, 16, 16, 8192, 128),
    "gqa": (1, 16, 4, 8192, 128),
    "quick": (1, 2, 2, 128, 64),
}


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double()
    noise = (actual.detach().double() - expected).norm()
    return math.inf if noise == 0 else float(20 * torch.log10(expected.norm() / noise))


def inputs(shape: tuple, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    batch, heads, kv_heads, seq, dim = shape
    g = torch.Generator(device).manual_seed(0)
    sizes = ((batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim))
    return [torch.randn(s, generator=g, device=device).to(dtype).requires_grad_() for s in sizes]


def variants(gqa: bool, emulate: Optional[bool]) -> dict[str, Callable]:
    def torch_bf16(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def ampkit_fp8(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                            emulate=emulate)

    return {"torch-bf16": torch_bf16, "ampkit-fp8": ampkit_fp8}


def timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    harness.synchronize(device)
    return statistics.median(harness.time_steps(fn, device, iters))


def peak_bytes(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    harness.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    harness.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def run_shape(name: str, device: torch.device, args: argparse.Namespace) -> list[dict]:
    shape = SHAPES[name]
    gqa = shape[1] != shape[2]
    q, k, v = inputs(shape, device, torch.bfloat16)
    grad = torch.randn(q.shape, generator=torch.Generator(device).manual_seed(1),
                       device=device).to(q.dtype)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=gqa)
    ref_out.backward(grad.float())
    rows = []
    for variant, fn in variants(gqa, args.emulate).items():
        row = {"shape": name, "dims": list(shape), "variant": variant}
        try:
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            out.backward(grad)
            row["sqnr_out_db"] = sqnr(out, ref_out)
            row["sqnr_grads_db"] = [sqnr(t.grad, r.grad) for t, r in zip((q, k, v), ref)]

            def forward():
                with torch.no_grad():
                    fn(q, k, v)

            def train():
                fn(q, k, v).backward(grad)

            row["forward_ms"] = timed(forward, device, args.warmup, args.iters)
            row["train_ms"] = timed(train, device, args.warmup, args.iters)
            row["train_peak_bytes"] = peak_bytes(train, device)
            row["fp8_kernels"] = (variant == "ampkit-fp8" and args.emulate is not True
                                  and attention.kernels_unavailable(device) is None)
        except Exception as err:  # one failing case is an error row, not the end of the run
            row.update(error_fields(err))
            free_cuda()
        rows.append(row)
    base = rows[0]
    for row in rows:
        for key in ("forward_ms", "train_ms"):
            if key in row and key in base:
                row[key.replace("_ms", "_speedup")] = base[key] / row[key]
    return rows


def region_overhead(device: torch.device, ops: int = 2000, iters: int = 31) -> dict:
    """Host microseconds per torch op added by the fp8_attention() region (no attention):
    a chain of small adds, run alternately without and with the region (medians)."""
    x = torch.ones(8, device=device)

    def chain():
        y = x
        for _ in range(ops):
            y = y + 1.0
        return y

    def routed():
        with fp8_attention():
            chain()

    times: dict[str, list[float]] = {"plain": [], "region": []}
    for i in range(iters + 3):
        for name, fn in (("plain", chain), ("region", routed)):
            start = time.perf_counter()
            fn()
            harness.synchronize(device)
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    plain, region = (statistics.median(times[k]) * 1e6 / ops for k in ("plain", "region"))
    return {"ops": ops, "plain_us_per_op": plain, "region_us_per_op": region,
            "added_us_per_op": region - plain}


def print_table(doc: dict) -> None:
    meta = doc["meta"]
    print(f"\nfp8 attention, {meta['device_name']}, torch {meta['torch']}, {meta['date']}")
    print(f"{'shape':6} {'variant':11} {'fwd ms':>9} {'x':>6} {'fwd+bwd ms':>11} {'x':>6} "
          f"{'peak MB':>9} {'SQNR out':>9} {'SQNR dq/dk/dv':>18}")
    for row in doc["rows"]:
        if "error" in row:
            print(f"{row['shape']:6} {row['variant']:11} ERROR {row['error'][:90]}")
            continue
        peak = row["train_peak_bytes"]
        grads = "/".join(f"{g:.1f}" for g in row["sqnr_grads_db"])
        print(f"{row['shape']:6} {row['variant']:11} {row['forward_ms']:9.3f} "
              f"{row.get('forward_speedup', 1):6.2f} {row['train_ms']:11.3f} "
              f"{row.get('train_speedup', 1):6.2f} "
              f"{'-' if peak is None else f'{peak / 2**20:.0f}':>9} {row['sqnr_out_db']:9.1f} "
              f"{grads:>18}")
    o = doc.get("region_overhead")
    if o:
        print(f"fp8_attention() region: {o['plain_us_per_op']:.2f} -> {o['region_us_per_op']:.2f} "
              f"us per op ({o['added_us_per_op']:+.2f})")


def run_meta(device: torch.device, threads: int) -> dict:
    return {"torch": torch.__version__, "device": str(device), "threads": threads,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(), "machine": harness.machine_state(threads),
            "kernels_unavailable": attention.kernels_unavailable(device)}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="gpt,long,gqa")
    parser.add_argument("--quick", action="store_true", help="one small shape (CPU smoke test)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--emulate", choices=("auto", "yes", "no"), default="auto",
                        help="ampkit's emulate=None/True/False")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.emulate = {"auto": None, "yes": True, "no": False}[args.emulate]
    device = torch.device(args.device)
    threads, _ = harness.threads_for(args.threads, device.type, lambda: torch.nn.Linear(1, 1))
    torch.set_num_threads(threads)
    shapes = ["quick"] if args.quick else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; valid: {', '.join(SHAPES)}")
    doc = {"meta": run_meta(device, threads), "rows": []}
    with interrupted(lambda: write_json(args.json, doc), "bench_fp8_attention"):
        for name in shapes:
            doc["rows"].extend(run_shape(name, device, args))
            write_json(args.json, doc)
        doc["region_overhead"] = region_overhead(device)
        write_json(args.json, doc)
    print_table(doc)


if __name__ == "__main__":
    main()
