"""``ampkit train``: train a classifier under one policy, one line per epoch."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .._dtypes import recommend_policy
from .._measure import check_threads
from ._common import UsageError, add_common, check_device, check_distinct, check_output_paths

if TYPE_CHECKING:
    from ..bench.parallel import ParallelPlan

_TRAIN_HELP = """\
Train a classifier with any policy or opt level, with test accuracy per epoch.
Data: digits (scikit-learn's 8x8 digits, the default), cifar10 (local files via
torchvision, never downloaded), synthetic. --checkpoint writes model, optimizer,
GradScaler and amp state after every epoch, with a sha256 digest of its content (with
--nproc, of every file of its DCP folder); --resume continues exactly where it stopped, and
refuses a checkpoint whose digest does not match (corrupted) or that has none (formats
ampkit-train-1 and ampkit-train-dcp-1, from before digests).
--model package.module:function: a function with no arguments that returns the classifier
(a torch.nn.Module, or a tuple whose first item is one); it takes a batch of images, N x 1
x 8 x 8 for digits and synthetic, N x 3 x 32 x 32 for cifar10, and returns N x 10 logits."""


def add_parser(sub: Any) -> None:
    """Register ``train`` on the subcommand parsers."""
    from ..bench.data import DATASETS

    p = sub.add_parser("train", help="train a classifier with a policy or opt level",
                       description=_TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, "mlp, cnn, resnet18, or package.module:function", "mlp")
    p.set_defaults(handler=run, batch_size=64)
    p.add_argument("--data", default="digits", choices=DATASETS, help="dataset (default digits)")
    p.add_argument("--data-dir", metavar="DIR", help="folder holding cifar-10-batches-py")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--policy", metavar="NAME", help="a policy as bench takes it (default: "
                       "the one `ampkit info` recommends)")
    which.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3"), help="an apex opt level")
    p.add_argument("--epochs", type=int, default=10, help="total epochs (default 10)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--checkpoint", metavar="PATH", help="write a checkpoint after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint (its "
                   "sha256 digest is checked; a checkpoint without one, written before "
                   "digests, is refused)")
    p.add_argument("--threads", type=int, metavar="N", help="intra-op threads (default: 1 on a "
                   "CPU for models under 5M parameters, else torch's default; recorded in the "
                   "JSON); with --nproc each rank's, at most its share of the cores (the default "
                   "there); a resume takes the checkpoint's")
    p.add_argument("--nproc", type=int, metavar="N", help="train on N processes under torchrun "
                   "with DDP, each on its share of the data (gloo on a CPU, nccl on GPUs); the "
                   "checkpoint is then a torch.distributed.checkpoint folder")



def run(args: argparse.Namespace) -> int:
    """Train a classifier under one policy, printing one line per epoch."""
    from ..bench import report
    from ..bench.policies import parse_policy
    from ..bench.train import TrainSettings, check_train_model

    device = check_device(args.device)
    policy = args.opt_level or args.policy or recommend_policy(device)[0]
    spec = parse_policy(policy, torch.device(device).type)  # a bad name fails before loading data
    check_train_model(args.model)
    plan = _check_nproc(args.nproc, device)
    _check_threads(args.threads)
    if plan is None:
        _check_not_parallel_checkpoint(args.checkpoint)
    check_output_paths(json=args.json, checkpoint=None if plan else args.checkpoint)
    check_distinct(json=args.json, checkpoint=args.checkpoint)  # (also one being resumed)
    if plan is None and args.checkpoint and not args.resume:
        from ..bench.checkpoint_file import check_replaceable

        check_replaceable(args.checkpoint)  # a file of the user's is never overwritten
    settings = TrainSettings(model=args.model, data=args.data, data_dir=args.data_dir,
                             policy=policy, epochs=args.epochs, batch_size=args.batch_size,
                             lr=args.lr, seed=args.seed, device=device)
    if plan is not None:  # before the header: a refused resume starts nothing
        from ..bench.train_parallel import check_parallel_train

        check_parallel_train(settings, plan, checkpoint=args.checkpoint, resume=args.resume,
                             threads=args.threads)
    out = sys.stderr if args.json == "-" else sys.stdout
    ranks = f", {plan.nproc} rank{'s' if plan.nproc != 1 else ''} (DDP, {plan.backend})" \
        if plan else ""
    # The policy a name resolved to, where it says more than the name ("O2" on a CPU).
    resolved = "" if spec.resolved == policy else f" ({spec.resolved})"
    header = (f"ampkit train: {settings.model} on {settings.data} with {policy}{resolved} "
              f"on {device}{ranks}")

    def on_start(resumed_from: Optional[int]) -> None:
        print(header, file=out, flush=True)
        if resumed_from is not None:
            print(f"resumed after epoch {resumed_from} of the checkpoint", file=out, flush=True)

    log = _train(args, settings, plan, out, on_start)
    _print_train_summary(log, out)
    if args.json:
        report.write_json(dict({"command": "train", "environment": report.environment(device)},
                               **log), args.json)
    return 0


def _train(args: argparse.Namespace, settings: Any, plan: Optional[ParallelPlan],
           out: Any, on_start: Callable[[Optional[int]], None]) -> dict[str, Any]:
    """The run's log: in this process, or on ``plan.nproc`` ranks under torchrun;
    ``on_start`` prints the header (and the epoch a resumed run continues after) once
    nothing more is refused before training (in this process: data and model loaded; with
    ranks: once every rank has its data, model and checkpoint)."""
    from ..bench import report
    from ..bench.train import train

    def on_epoch(record: dict[str, Any]) -> None:
        print(_epoch_line(record, settings.epochs), file=out, flush=True)

    def on_warning(message: str) -> None:
        print(f"ampkit train: warning: {message}", file=sys.stderr)

    if plan is not None:
        from ..bench.train_parallel import run_parallel_train

        return dict(run_parallel_train(settings, plan, checkpoint=args.checkpoint,
                                       resume=args.resume, on_epoch=on_epoch,
                                       on_warning=on_warning, on_start=on_start,
                                       checked=True,  # run() checked it before the header
                                       threads=args.threads),
                    **plan.fields())
    show = not args.quiet and sys.stdout.isatty() and args.json != "-"
    with report.Progress(enabled=show, keep_done=False) as progress:
        return train(settings, checkpoint=args.checkpoint, resume=args.resume,
                     on_epoch=on_epoch, on_batch=progress.task, on_warning=on_warning,
                     on_start=on_start, threads=args.threads)


def _check_not_parallel_checkpoint(path: Optional[str]) -> None:
    """Name a folder ``train --nproc`` wrote for what it is, without --nproc (it would be
    refused as a file path that "cannot be written")."""
    from ..bench.dcp_folder import META

    meta = os.path.join(path, META) if path else ""
    if path and os.path.isdir(path) and os.path.isfile(meta):
        try:
            with open(meta) as src:
                nproc = json.load(src).get("nproc")
        except (OSError, ValueError, AttributeError):
            nproc = None
        again = f"--nproc {nproc}" if isinstance(nproc, int) else "the --nproc it was written with"
        raise UsageError(f"--checkpoint {path!r} is a checkpoint folder of ampkit train --nproc "
                         f"(torch.distributed.checkpoint); valid: {again} to use it, or a file "
                         "path for a run in this process")


def _check_threads(threads: Optional[int]) -> None:
    """--threads: 1 to the CPU's logical cores (exit 2)."""
    if threads is None:
        return
    try:
        check_threads("--threads", threads)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _check_nproc(nproc: Optional[int], device: str) -> Optional[ParallelPlan]:
    """The --nproc plan (None without it), checked before anything starts (exit 2)."""
    from ..bench.parallel import check_plan

    return check_plan(nproc, None, [], device)


def _epoch_line(record: dict[str, Any], epochs: int) -> str:
    scale = "" if record["loss_scale"] is None else (
        f"  scale {record['loss_scale']:g} ({record['skipped_steps']} skipped so far)")
    return (f"epoch {record['epoch']:>3}/{epochs}  train loss {record['train_loss']:.4f}  "
            f"test loss {record['test_loss']:.4f}  test acc {record['test_acc']:.2%}  "
            f"{record['time_s']:.1f}s{scale}")


def _print_train_summary(log: dict[str, Any], out: Any) -> None:
    final = log["final"]
    if final is None:
        print("nothing was trained (epochs 0)", file=out)
        return
    print(f"final: epoch {final['epoch']}, test accuracy {final['test_acc']:.2%}, "
          f"test loss {final['test_loss']:.4f} ({log['data']})", file=out)


