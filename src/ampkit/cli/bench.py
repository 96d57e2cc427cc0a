"""``ampkit bench``: train one model under each policy and compare speed, memory, loss."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

import torch

from .._dtypes import device_policies
from ._common import add_common, check_device, check_output_paths

_BENCH_HELP = """\
Train one model for a few steps under each precision policy, from the same initial
weights on the same data, the policies taking turns in rounds (so drift and load hit
them alike), and compare: median step time, speedup over the first policy with its 95%
interval, peak memory (CUDA allocator on a GPU; peak RSS of a process of its own per
policy on a CPU) and its ratio, and the largest relative deviation of the loss curve
from the first policy's. Ends with the policy to use here: the fastest whose loss stays
within --max-loss-dev of fp32's and that is not slower than fp32 (autotune's rule).

Built-in models: mlp (10-100-10), cnn (small ResNet-style, batch-norm, 32x32), resnet18
(torchvision, when installed), gpt (decoder-only transformer: d=128, 2 layers on a CPU;
d=1024, 12 layers, seq 1024 on CUDA), or package.module:function returning
(model, (inputs, targets)) or (model, (inputs, targets), loss_fn): inputs a tensor or a
list (model(inputs)), a tuple (model(*inputs)) or a dict (model(**inputs)), targets a
tensor or None.

Policies: 32-true/fp32, 16-mixed, bf16-mixed, 16-true, bf16-true, O0-O3 (half dtype:
the device's autocast default, or a suffix: O2-bf16, O1-fp16), fp8 (fp8-tensorwise,
fp8-delayed, fp8-rowwise: Linear layers in fp8 under bf16 autocast), or explicit
"p=f32,c=bf16,o=f32", or auto (the policies the device runs natively, as autotune's
candidates); a policy named twice (or by another name) runs once. Default: 32-true,bf16-mixed,O2 on a CPU; 32-true,16-mixed,bf16-mixed,O2
(+fp8 where supported) on CUDA.

Reading the table: ms/step is the median over the timed steps; speedup is the median
over rounds of the first policy's time / this one's, in brackets its 95% interval (an
interval that includes 1.00 means no measurable difference); mem × is relative to the
first policy (below 1: less memory); max Δloss is the largest relative difference of the
per-step training loss from the first policy's (warm-up steps included). The lines
under the table say the same in words, whether the timings can be trusted (stable
intervals, threads, machine load), and end with the recommendation."""


def add_parser(sub: Any) -> None:
    """Register ``bench`` on the subcommand parsers."""
    p = sub.add_parser("bench", help="compare precision policies side by side on one model",
                       description=_BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, "mlp, cnn, resnet18, gpt, or package.module:function", "gpt")
    p.set_defaults(handler=run)
    p.add_argument("--policies", action="append", metavar="LIST",
                   help="comma-separated policies, the first is the reference (repeatable; "
                   "';' also separates)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per policy (default 20); "
                   "more rounds follow while a speedup's 95%% interval is wider than ±5%%, "
                   "within --max-time")
    p.add_argument("--max-time", type=float, default=20.0, metavar="SECONDS", help="time the "
                   "timed rounds may take in all to reach stable intervals (default 20; 0: "
                   "exactly --steps)")
    p.add_argument("--threads", type=int, metavar="N", help="intra-op threads (default: 1 on a "
                   "CPU for models under 5M parameters, else torch's default; recorded in the JSON)")
    p.add_argument("--max-loss-dev", type=float, default=0.02, metavar="X", help="the largest "
                   "relative deviation from fp32's loss curve a recommended policy may show "
                   "(default 0.02)")
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
    return ",".join(device_policies(device).bench)


def run(args: argparse.Namespace) -> int:
    """Run the requested policies on one model and print/write the comparison."""
    from .. import _measure as measure
    from ..bench import parallel, plot, report, verdict
    from ..bench.policies import parse_policy_list
    from ..bench.errors import BenchInterrupted, UsageError
    from ..bench.runner import BenchSettings, failed, process_per_policy, run_bench
    from ..bench.workloads import get_workload

    device = check_device(args.device)
    cuda = torch.device(device).type == "cuda"
    specs = [spec for text in (args.policies or [default_policies(device)])
             for spec in parse_policy_list(text, torch.device(device).type)]
    plan = parallel.check_plan(args.nproc, args.parallel, specs, device)  # None: one process
    if plan is not None and args.isolate == "always":
        raise UsageError("--isolate always with --nproc: each rank runs every policy in one "
                         "process (torchrun's ranks are the processes); valid: leave out "
                         "--isolate, or --isolate never")
    if args.plot:
        report.require_matplotlib(args.plot)
    check_output_paths(json=args.json, plot=args.plot)
    _check_numbers(args)
    workload = get_workload(args.model, device, batch_size=args.batch_size,
                            seed=args.seed)  # a bad model fails here, before any run
    threads, threads_reason = measure.threads_for(args.threads, torch.device(device).type,
                                                  workload.build)
    settings = BenchSettings(model=args.model, device=device, steps=args.steps,
                             warmup=args.warmup if args.warmup is not None else (5 if cuda else 3),
                             batch_size=args.batch_size, compile=args.compile, seed=args.seed,
                             lr=args.lr, threads=threads, max_time=args.max_time)
    if plan is not None:  # what the ranks run, for the JSON and the sentences to say
        settings = parallel.rank_settings(settings, plan)
        threads_reason = threads_reason if settings.threads == threads else None
    machine = measure.machine_state(threads)  # before the run: its own load is not in it
    # CPU peak RSS only grows within a process: a fresh one per policy keeps it fair.
    isolate = {"always": True, "never": False, "auto": not cuda}[args.isolate]
    out = sys.stderr if args.json == "-" else sys.stdout
    show = not args.quiet and sys.stdout.isatty() and args.json != "-"
    interrupted = False
    if plan is not None:  # N ranks under torchrun, each with one process for all policies
        isolate, results = False, parallel.run_parallel_bench(specs, settings, plan)
    else:
        with report.Progress(enabled=show) as progress:
            try:
                results = run_bench(specs, settings, isolate=isolate, on_policy=progress.task)
            except BenchInterrupted as stop:  # the steps run so far: reported, and exit 130
                results, interrupted = stop.results, True
    machine["loadavg_1m_after"] = measure.machine_state(threads)["loadavg_1m"]
    # A policy that raised is an error row (runner.run_bench): the table, the sentences,
    # the plot and the recommendation are about the others; the JSON keeps every row.
    failures = failed(results)
    measured = [r for r in results if "error" not in r]
    document = _bench_document(measured, settings, workload, process_per_policy(isolate),
                               device)
    document["settings"]["threads_reason"] = threads_reason
    document["machine"] = machine
    if plan is not None:
        document.update(plan.fields())
    verdict.complete(document, args.max_loss_dev)
    verdict.render_bench_table(f"ampkit bench: {workload.description} on {device}", measured, out)
    if failures:
        document["results"] = results
        document["settings"]["policies"] = [r["policy"] for r in results]
        document["verdict"] += [f"{r['policy']} FAILED ({r['error']}): left out of the table, "
                                f"the comparisons, the plot and the recommendation."
                                for r in failures]
    if interrupted:
        document["interrupted"] = True
        document["verdict"].append("Interrupted: these figures are from the steps run before "
                                   "the interrupt.")
    if plan is not None:
        report.render_table(f"scaling: {plan.nproc} ranks, {plan.parallel.value}",
                            parallel.SCALING_HEADERS, parallel.scaling_rows(results), out)
        document["verdict"].append(parallel.scaling_sentence(plan, results))
    for line in document["verdict"]:
        print(line, file=out)
    print(document["recommendation"]["sentence"], file=out)  # the last line: what to use
    if args.json:
        report.write_json(document, args.json)
    if args.plot:
        plot.write_bench_plot(dict(document, results=measured), args.plot)
        print(f"plot: {args.plot}", file=out)
    if interrupted:
        print("ampkit bench: interrupted", file=sys.stderr)
        return 130
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    from ..bench.errors import UsageError

    if not (args.max_loss_dev >= 0 and args.max_loss_dev < float("inf")):
        raise UsageError(f"--max-loss-dev must be a number >= 0, got {args.max_loss_dev}; "
                         "valid: e.g. 0.02 (2%)")


def _bench_document(results: list[dict[str, Any]], settings: Any, workload: Any,
                    isolate: bool, device: str) -> dict[str, Any]:
    from ..bench.report import environment

    env = environment(device)
    # batch_size: the one the runs used (the model's default when --batch-size was not
    # given), as tune's JSON has it.
    document = {"command": "bench", "device": env["device"], "torch": env["torch"],
                "ampkit": env["ampkit"], "environment": env, "workload": workload.description,
                "settings": dict(asdict(settings), batch_size=workload.batch_size,
                                 process_per_policy=isolate,
                                 policies=[r["policy"] for r in results]),
                "results": results}
    return document  # verdict.complete adds the verdict and the recommendation


