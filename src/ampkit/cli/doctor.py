"""``ampkit doctor``: which module a precision policy hurts, and what to do about it."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..bench.errors import UsageError
from ._common import add_common, check_device, check_output_paths

_DOCTOR_HELP = """\
Run one training step in fp32 and one under a precision policy, from the same weights
on the same batch, and compare them module by module (ampkit.diagnose.inspect): the
modules the policy hurts most come first, then the share of the matmul/convolution
FLOPs that ran below fp32, the first module whose output or gradient went inf/NaN, and
advice that names a module and an action (keep it in fp32, switch fp16 -> bf16, change
the initial loss scale, exclude it from fp8).

Models: as for `ampkit bench`: mlp, cnn, resnet18, gpt (the built-in workloads), or
package.module:function returning (model, (inputs, targets)) or (model, (inputs,
targets), loss_fn); the fp32 model, before any precision is applied.

Policies: the names `ampkit bench` takes: 32-true, 16-mixed, bf16-mixed, 16-true,
bf16-true, O0-O3 (as in bench, an O-level without suffix runs in the device's autocast
dtype: bf16 on a CPU; O2-fp16 for fp16), fp8, fp8-tensorwise, fp8-delayed, fp8-rowwise,
or "p=f32,c=bf16,o=f32". Default: the device's default mixed policy (bf16-mixed on a CPU
and on GPUs with bf16, else 16-mixed).

Columns: out SQNR dB is the signal-to-error ratio of the module's output against fp32
(inf: identical; -inf: non-finite; bf16 rounding alone gives about 50, fp16 65, fp8
25-30); underflow/overflow are the shares of the fp32 output that flush to zero or
become inf when cast to the half dtype; grad columns are the same for the module's own
parameter gradients at the policy's initial loss scale. --json writes the whole report;
non-finite numbers there are the strings "inf", "-inf", "nan" (strict JSON)."""

_MODELS = "mlp, cnn, resnet18, gpt, or package.module:function"
_HALF_SUFFIX = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_FLOP_HEADERS = ("dtype", "FLOPs", "share")


def add_parser(sub: Any) -> None:
    """Register ``doctor`` on the subcommand parsers."""
    p = sub.add_parser("doctor", help="which module a policy hurts (SQNR, under/overflow, "
                       "first inf/NaN) and what to do", description=_DOCTOR_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, _MODELS, "gpt")
    p.set_defaults(handler=run)
    p.add_argument("--policy", metavar="NAME", help="the policy to diagnose (default: the "
                   "device's default mixed policy)")
    p.add_argument("--plot", metavar="PATH.png", help="PNG: per-module SQNR and under/overflow "
                   "along the network (needs matplotlib)")
    p.add_argument("--top", type=int, default=20, metavar="N", help="modules shown in the "
                   "table, worst first (default 20; 0: all)")


def resolve_policy_name(name: Optional[str], device: str) -> str:
    """The policy name to give ``inspect``: ``name`` as ``ampkit bench`` reads it.

    An O-level without suffix gets the device's half dtype written out ("O2" on a CPU is
    "O2-bf16"), so the report names the policy that ran. UsageError for a bad name.

    Example:
        >>> resolve_policy_name("O2", "cpu"), resolve_policy_name(None, "cpu")
        ('O2-bf16', 'bf16-mixed')
    """
    from ..bench.policies import parse_policy
    from ..diagnose.request import default_policy
    from ..policy import OPT_LEVELS

    device_type = torch.device(device).type
    if name is None:
        return default_policy(device_type)
    if name.strip() == "auto":  # bench's "every native policy": a list, not one policy
        raise UsageError("--policy auto: doctor diagnoses one policy at a time; valid: a policy "
                         "name such as bf16-mixed, 16-mixed, O2, fp8 (see ampkit doctor --help)")
    spec = parse_policy(name, device_type)  # one policy: its error does not offer auto
    if spec.fp8_recipe is not None:
        return f"fp8-{spec.fp8_recipe}"
    level = spec.label.partition("-")[0]
    half = spec.policy.half_dtype
    if level in OPT_LEVELS and half is not None:
        return f"{level}-{_HALF_SUFFIX[half]}"
    return spec.label


def run(args: argparse.Namespace) -> int:
    """Inspect one step of the model under the policy; print (and write) the report."""
    from ..bench import report as out_report
    from ..bench.workloads import get_workload

    device = check_device(args.device)
    policy = resolve_policy_name(args.policy, device)
    if args.top < 0:
        raise UsageError(f"--top must be 0 (all) or more, got {args.top}")
    if args.plot:
        out_report.require_matplotlib(args.plot)
    check_output_paths(json=args.json, plot=args.plot)
    # Seeded before get_workload: a package.module:function model is made there.
    torch.manual_seed(args.seed)
    workload = get_workload(args.model, device, batch_size=args.batch_size, seed=args.seed)
    out = sys.stderr if args.json == "-" else sys.stdout
    show = not args.quiet and sys.stdout.isatty() and args.json != "-"
    torch.manual_seed(args.seed)
    # The modes the model was built with (a user function's eval-mode frozen backbone
    # stays in eval mode, as inspect keeps the modes it is given).
    model = workload.build().to(device)
    inputs, targets = workload.batches(torch.device(device))[0]
    with out_report.Progress(enabled=show) as progress:
        result = _inspect(model, inputs, targets, workload.loss_fn, policy,
                          progress.task(f"doctor {policy}"))
    title = f"ampkit doctor: {workload.description}, {policy} on {device}"
    _print_report(result, title, args.top, out)
    if args.json:
        out_report.write_json(_document(result, args, workload, policy, device), args.json)
    if args.plot:
        from ..diagnose.plot import save_plot
        save_plot(result, args.plot, title)
        print(f"plot: {args.plot}", file=out)
    return 0


def _inspect(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, policy: str,
             on_step: Callable[[int, int], None]) -> Any:
    """``diagnose.inspect`` with progress: one tick per module forward, in both passes.

    A model inspect refuses before running (half, already converted) is a usage error
    (exit 2); an error the model raises while it runs is a failure (exit 1).
    The forward hooks go on our own model (inspect deep-copies it with them, both times)."""
    from ..diagnose import inspect
    from ..diagnose.request import check_request

    try:
        check_request(model, inputs, policy=policy, loss_fn=loss_fn)
    except (ValueError, TypeError) as err:
        raise UsageError(f"cannot inspect this model: {err}") from None
    modules = list(model.modules())
    total, done = 2 * len(modules), [0]

    def tick(*_: Any) -> None:
        done[0] += 1
        on_step(done[0], max(total, done[0]))

    handles = [m.register_forward_hook(tick) for m in modules]
    try:
        return inspect(model, inputs, targets, policy=policy, loss_fn=loss_fn)
    finally:
        for handle in handles:
            handle.remove()


def _print_report(result: Any, title: str, top: int, out: Any) -> None:
    from ..bench.report import render_table
    from ..diagnose.report import COLUMNS, dtype_name, format_count, module_cells

    half = dtype_name(result.half_dtype) or "none (fp32)"
    print(f"{title}\npolicy {result.policy}: half dtype {half}, initial loss scale "
          f"{result.loss_scale:g}; loss fp32 {result.ref_loss:.6g}, under the policy "
          f"{result.policy_loss:.6g}", file=out)
    index = {id(m): i for i, m in enumerate(result.modules)}
    worst = result.worst(top or None)
    rows = [[str(index[id(m)]), *module_cells(m)] for m in worst]
    render_table(f"modules, worst first ({len(worst)} of {len(result.modules)}; "
                 "# = execution order)", ("#", *COLUMNS), rows, out, left=(1, 2, 3))
    if len(worst) < len(result.modules):
        print(f"(+{len(result.modules) - len(worst)} more: --top 0 shows all, --json has all)",
              file=out)
    total = sum(result.flops.values())
    # No share when every matmul was empty (a batch of 0 samples): total is 0.
    flop_rows = [[name, format_count(n), f"{n / total:.1%}" if total else "-"]
                 for name, n in sorted(result.flops.items(), key=lambda kv: -kv[1])]
    render_table("FLOPs by dtype", _FLOP_HEADERS, flop_rows, out)
    print(f"low-precision share: {result.low_precision_share:.1%} of the FLOPs ran below fp32"
          if total else "low-precision share: no matmul or convolution ran", file=out)
    print(f"first non-finite: {_first(result.first_nonfinite)}", file=out)
    print("advice:", file=out)
    for i, sentence in enumerate(result.advice, 1):
        print(f"  {i}. {sentence}", file=out)


def _first(first: Optional[tuple[str, str]]) -> str:
    if first is None:
        return "none (every output and gradient stayed finite)"
    phase, name = first
    what = "output" if phase == "forward" else "gradient"
    return f"module {name or '<model>'!r}, its {what} in the {phase} pass"


def _document(result: Any, args: argparse.Namespace, workload: Any, policy: str,
              device: str) -> dict[str, Any]:
    from ..bench.report import environment

    env = environment(device)
    # batch_size: the one inspected (the model's default when --batch-size was not given).
    return dict(result.to_dict(), command="doctor", device=env["device"], torch=env["torch"],
                ampkit=env["ampkit"], environment=env, workload=workload.description,
                settings={"model": args.model, "policy": args.policy, "resolved_policy": policy,
                          "batch_size": workload.batch_size, "seed": args.seed,
                          "device": device})
