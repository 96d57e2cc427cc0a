"""``ampkit bench``: train one model under each policy and compare speed, memory, loss."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

import torch

from .._dtypes import capability, fp8_supported
from ._common import add_common, check_device, check_output_paths

_BENCH_HELP = """\
Train one model for a few steps under each precision policy, from the same initial
weights on the same data, and compare: median step time and its spread (IQR),
samples/s, speedup over the first policy, peak memory (CUDA allocator on a GPU; peak
RSS of a fresh process per policy on a CPU) and its ratio, final loss, and the largest
deviation of the loss curve from the first policy's.

Built-in models: mlp (10-100-10), cnn (small ResNet-style, batch-norm, 32x32), resnet18
(torchvision, when installed), gpt (decoder-only transformer: d=128, 2 layers on a CPU;
d=1024, 12 layers, seq 1024 on CUDA), or package.module:function returning
(model, (inputs, targets)) or (model, (inputs, targets), loss_fn).

Policies: 32-true/fp32, 16-mixed, bf16-mixed, 16-true, bf16-true, O0-O3 (half dtype:
the device's autocast default, or a suffix: O2-bf16, O1-fp16), fp8 (fp8-tensorwise,
fp8-delayed, fp8-rowwise: Linear layers in fp8 under bf16 autocast), or explicit
"p=f32,c=bf16,o=f32". Default: 32-true,bf16-mixed,O2 on a CPU; 32-true,16-mixed,
bf16-mixed,O2 (+fp8 where supported) on CUDA.

Reading the table: step ms is the median over the timed steps (IQR ms its spread);
speedup and mem × are relative to the first policy (above 1×: faster; below 1: less
memory); max |Δloss| is the largest difference of the per-step training loss from the
first policy's (warm-up steps included). The lines under the table say the same in
words, including when half precision is slower on this device and why."""


def add_parser(sub: Any) -> None:
    """Register ``bench`` on the subcommand parsers."""
    p = sub.add_parser("bench", help="compare precision policies side by side on one model",
                       description=_BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, "mlp, cnn, resnet18, gpt, or package.module:function", "gpt")
    p.set_defaults(handler=run)
    p.add_argument("--policies", action="append", metavar="LIST",
                   help="comma-separated policies, the first is the reference (repeatable; "
                   "';' also separates)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per policy (default 20)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3 on CPU, 5 on CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model; the "
                   "compile time (the warm-up's excess over its steps) is reported apart from "
                   "the step time; needs --warmup 2 or more")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--plot", metavar="PATH.png", help="PNG: step-time and memory bars, loss "
                   "curves (needs matplotlib)")
    p.add_argument("--isolate", choices=("auto", "always", "never"), default="auto",
                   help="a fresh process per policy: auto = on CPU, where peak RSS only grows "
                   "within a process (default auto)")
    p.add_argument("--nproc", type=int, metavar="N", help="run on N processes under torchrun "
                   "(gloo on CPU, nccl on CUDA, rank r on cuda:r) and report global samples/s "
                   "and scaling efficiency against one process, measured in the same run")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), help="with --nproc: ddp (DistributedDataParallel, "
                   "default) or fsdp (FSDP2 through ampkit.distributed.shard)")



def default_policies(device: str) -> str:
    """What ``ampkit bench`` compares when no --policies is given, for the device."""
    cap = capability(device)
    if torch.device(device).type != "cuda":
        return "32-true,bf16-mixed,O2"  # O2 is bf16 on a CPU (its autocast dtype)
    names = ["32-true", "16-mixed"] + (["bf16-mixed"] if cap.bf16 else []) + ["O2"]
    return ",".join(names + (["fp8"] if fp8_supported(device) else []))


def run(args: argparse.Namespace) -> int:
    """Run the requested policies on one model and print/write the comparison."""
    from ..bench import parallel, report
    from ..bench.runner import BenchSettings, parse_policy_list, run_bench
    from ..bench.workloads import get_workload

    device = check_device(args.device)
    cuda = torch.device(device).type == "cuda"
    specs = [spec for text in (args.policies or [default_policies(device)])
             for spec in parse_policy_list(text, torch.device(device).type)]
    plan = parallel.check_plan(args.nproc, args.parallel, specs, device)  # None: one process
    if args.plot:
        report.require_matplotlib(args.plot)
    check_output_paths(json=args.json, plot=args.plot)
    settings = BenchSettings(model=args.model, device=device, steps=args.steps,
                             warmup=args.warmup if args.warmup is not None else (5 if cuda else 3),
                             batch_size=args.batch_size, compile=args.compile, seed=args.seed,
                             lr=args.lr)
    workload = get_workload(settings.model, device, batch_size=settings.batch_size,
                            seed=settings.seed)  # a bad model fails here, before any run
    # CPU peak RSS only grows within a process: a fresh one per policy keeps it fair.
    isolate = {"always": True, "never": False, "auto": not cuda}[args.isolate]
    out = sys.stderr if args.json == "-" else sys.stdout
    show = not args.quiet and sys.stdout.isatty() and args.json != "-"
    if plan is not None:  # N ranks under torchrun, each with one process for all policies
        isolate, results = False, parallel.run_parallel_bench(specs, settings, plan)
    else:
        with report.Progress(enabled=show) as progress:
            results = run_bench(specs, settings, isolate=isolate, on_policy=progress.task)
    document = _bench_document(results, settings, workload.description, isolate, device)
    report.render_table(f"ampkit bench: {workload.description} on {device}", report.BENCH_HEADERS,
                        report.bench_rows(results), out, report.BENCH_LEFT)
    if plan is not None:
        document.update(plan.fields())
        report.render_table(f"scaling: {plan.nproc} ranks, {plan.parallel.value}",
                            parallel.SCALING_HEADERS, parallel.scaling_rows(results), out)
        document["verdict"].append(parallel.scaling_sentence(plan, results))
    for line in document["verdict"]:
        print(line, file=out)
    if args.json:
        report.write_json(document, args.json)
    if args.plot:
        report.write_bench_plot(document, args.plot)
        print(f"plot: {args.plot}", file=out)
    return 0


def _bench_document(results: list[dict[str, Any]], settings: Any, workload: str,
                    isolate: bool, device: str) -> dict[str, Any]:
    from ..bench.report import bench_verdict, environment

    env = environment(device)
    document = {"command": "bench", "device": env["device"], "torch": env["torch"],
                "ampkit": env["ampkit"], "environment": env, "workload": workload,
                "settings": dict(asdict(settings), process_per_policy=isolate,
                                 policies=[r["policy"] for r in results]),
                "results": results}
    document["verdict"] = bench_verdict(document)
    return document


