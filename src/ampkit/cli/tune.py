"""``ampkit tune``: autotune on one model; the candidates' table and the policy chosen."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import torch

from .._dtypes import device_policies
from ._common import UsageError, add_common, check_device, check_output_paths

_TUNE_HELP = """\
Train a copy of one model under each candidate policy, from the same weights on the same
batch, fp32 first, the candidates taking turns step by step (ampkit.autotune), and choose
the fastest whose loss curve stays within --max-loss-dev (relative) of fp32's; never one
measured slower than fp32 (then 32-true). Prints one row per candidate (median step time,
speedup over fp32, peak memory on CUDA, largest loss deviation, accepted or why not) and
the choice; --json writes the same with TuneResult.to_dict().

Built-in models: mlp, cnn, resnet18, gpt (as ampkit bench builds them), or
package.module:function returning (model, (inputs, targets)) or (model, (inputs,
targets), loss_fn). --candidates: comma-separated names ampkit.get_policy takes
(32-true, bf16-mixed, 16-mixed, O1-O3 (plain O2 takes the device's half dtype, as
initialize does: O2-bf16 on a CPU) or with a half-dtype suffix such as O2-fp16,
bf16-true, 16-true), fp8, fp8-tensorwise, fp8-delayed, fp8-rowwise; separated by ';'
instead when one is an explicit policy such as "p=f32,c=bf16,o=f32" (its own commas);
default: the policies the device runs natively."""

TUNE_HEADERS = ("policy", "ms/step", "speedup", "MiB", "Δloss", "accepted: why")
_LEFT = (0, 5)


def add_parser(sub: Any) -> None:
    """Register ``tune`` on the subcommand parsers."""
    p = sub.add_parser("tune", help="measure the policies on one model and choose one (autotune)",
                       description=_TUNE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, "mlp, cnn, resnet18, gpt, or package.module:function", "gpt")
    p.set_defaults(handler=run)
    p.add_argument("--candidates", metavar="LIST", help="comma-separated policy names ("
                   "';' when one is an explicit p=,c=,o= policy; default, or 'auto': the "
                   "policies the device runs natively)")
    p.add_argument("--steps", type=int, default=20, help="training steps per candidate, the "
                   "first two untimed (default 20; at least 3)")
    p.add_argument("--max-loss-dev", type=float, default=0.02, metavar="X", help="the largest "
                   "relative deviation from fp32's loss curve a chosen policy may show "
                   "(default 0.02)")
    p.add_argument("--threads", type=int, metavar="N", help="intra-op threads (default: 1 on a "
                   "CPU for models under 5M parameters, else torch's default)")


def check_candidates(text: Optional[str], device: str) -> list[str]:
    """The candidate names, each one autotune takes; UsageError before any training."""
    from ..bench.policies import split_policy_list
    from ..policy import preset_names
    from ..tune import FP8_CANDIDATES, check_candidate

    if text is None or text.strip() == "auto":  # "auto" as bench's --policies takes it
        return list(device_policies(device).candidates)
    names = split_policy_list(text)  # as bench reads --policies: "p=f32,c=bf16,o=f32" is one
    valid = (f"{', '.join(preset_names())}, O1-O3 with -bf16/-fp16, "
             f"{', '.join(FP8_CANDIDATES)}, or 'p=f32,c=bf16,o=f32'")
    if not names:
        raise UsageError(f"--candidates {text!r} names no policy; valid: {valid}")
    for name in names:
        try:
            check_candidate(name)
        except ValueError:
            raise UsageError(f"unknown candidate {name!r} in --candidates; valid: {valid}") from None
    return names


def _check_numbers(args: argparse.Namespace) -> None:
    from .._measure import check_threads
    from ..tune_args import check_max_loss_dev

    if args.steps < 3:
        raise UsageError(f"--steps must be at least 3 (2 warm-up steps, then timed ones), "
                         f"got {args.steps}")
    try:
        check_max_loss_dev(args.max_loss_dev, "--max-loss-dev")  # the API's rule
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.threads is not None:
        try:
            check_threads("--threads", args.threads)
        except ValueError as err:
            raise UsageError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    """Tune the model, print the table and the choice, write the JSON."""
    from .. import autotune
    from .. import _measure as measure
    from ..bench import report, verdict
    from ..bench.workloads import get_workload
    from ..tune_args import check_request

    device = check_device(args.device)
    candidates = check_candidates(args.candidates, device)
    _check_numbers(args)
    check_output_paths(json=args.json)
    # Seeded before get_workload: a package.module:function model is made there.
    torch.manual_seed(args.seed)
    workload = get_workload(args.model, device, batch_size=args.batch_size, seed=args.seed)
    threads, threads_reason = measure.threads_for(args.threads, torch.device(device).type,
                                                  workload.build)
    machine = measure.machine_state(threads)
    torch.manual_seed(args.seed)
    model = workload.build()
    inputs, target = workload.batches(torch.device(device))[0]
    try:  # what autotune refuses before any work is a usage error, as doctor's
        check_request(model, inputs, target, candidates=candidates,
                      max_loss_dev=args.max_loss_dev, steps=args.steps,
                      loss_fn=workload.loss_fn, device=device, threads=threads)
    except (ValueError, TypeError) as err:
        raise UsageError(f"cannot tune this model: {err}") from None
    out = sys.stderr if args.json == "-" else sys.stdout
    if not args.quiet and args.json != "-":
        print(f"tuning {len(candidates)} candidates x {args.steps} steps on "
              f"{workload.description} ({device}, {threads} thread{'s' if threads != 1 else ''})"
              "...", file=sys.stderr)
    result = autotune(model, inputs, target, loss_fn=workload.loss_fn, candidates=candidates,
                      max_loss_dev=args.max_loss_dev, steps=args.steps, device=device,
                      threads=threads)
    verdict.render_narrow(f"ampkit tune: {workload.description} on {device}", TUNE_HEADERS,
                          tune_rows(result), out, _LEFT)
    print(choice_sentence(result, args.max_loss_dev), file=out)
    if args.json:
        env = report.environment(device)
        report.write_json({"command": "tune", "device": env["device"], "torch": env["torch"],
                           "ampkit": env["ampkit"], "environment": env, "machine": machine,
                           "workload": workload.description,
                           "settings": {"model": args.model, "device": device, "steps": args.steps,
                                        "max_loss_dev": args.max_loss_dev, "seed": args.seed,
                                        "batch_size": workload.batch_size, "threads": threads,
                                        "threads_reason": threads_reason,
                                        "candidates": candidates},
                           "result": result.to_dict(), "recommended": result.policy}, args.json)
    return 0


def tune_rows(result: Any) -> list[list[str]]:
    """One table row per candidate of a TuneResult."""
    reference = result.rows[0]["step_ms"]
    return [[r["policy"], "-" if r["step_ms"] is None else f"{r['step_ms']:.3g}",
             "-" if r["step_ms"] is None else f"{reference / r['step_ms']:.2f}×",
             "-" if r["peak_mib"] is None else f"{r['peak_mib']:.3g}",
             "-" if r["step_ms"] is None else "non-finite" if r["max_loss_dev"] is None
             else f"{r['max_loss_dev'] * 100:.2g}%",
             ("chosen: " if r["policy"] == result.policy else "yes: " if r["accepted"] else "no: ")
             + r["reason"]] for r in result.rows]


def choice_sentence(result: Any, max_loss_dev: float) -> str:
    """What ``ampkit tune`` ends with: the policy chosen and why."""
    from ..tune import REF_NOT_FINITE, reference_not_finite

    tolerance = f"{max_loss_dev * 100:g}%"
    if reference_not_finite(result.rows):
        return (f"Chosen: none judged ({result.policy} by default): {REF_NOT_FINITE}.")
    if result.policy == result.rows[0]["policy"]:
        return (f"Chosen: {result.policy}: no candidate was faster than fp32 within the "
                f"{tolerance} loss tolerance on this device; train in plain fp32.")
    row = next(r for r in result.rows if r["policy"] == result.policy)
    layers = (f" (fp8 in {len(result.fp8_modules)} layer(s) measured faster there: "
              f"{', '.join(result.fp8_modules[:4])}{', ...' if len(result.fp8_modules) > 4 else ''})"
              if result.fp8_modules else "")
    return (f"Chosen: {result.policy}{layers}: {result.speedup:.2f}× the speed of fp32, loss within "
            f"{row['max_loss_dev'] * 100:.2g}% of fp32's (tolerance {tolerance}); in code: "
            f"ampkit.autotune(...).apply(model, optimizer).")
