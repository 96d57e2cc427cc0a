"""The ``ampkit`` command: ``bench`` compares precisions, ``train`` trains, ``info`` tells.

Every bad value (model, policy, device, data, option) ends the command with exit status
2 and one line on stderr naming it and the valid choices; no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from typing import Any, NoReturn, Optional, Sequence

import torch

from . import __version__
from ._dtypes import autocast_default_dtype, capability, fp8_supported, recommend_policy

class CliError(ValueError):
    """A bad command-line value (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the bad value, the valid ones, a hint)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- devices ---------------------------------------------------------------------------------
def check_device(name: Optional[str]) -> str:
    """The device to run on: ``name`` validated, or "cuda" when available, else "cpu".

    Example: ``check_device(None)`` is "cpu" on a machine without a GPU.
    """
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    valid = _valid_devices()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CliError(f"unknown device {name!r}; valid: {valid}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise CliError(f"device {name!r} is not supported by ampkit's commands; valid: {valid}")
    if not torch.cuda.is_available():
        raise CliError(f"device {name!r} is not available here (torch {torch.__version__}, "
                       f"no CUDA device); valid: {valid}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise CliError(f"device {name!r} does not exist; valid: {valid}")
    return str(device)


def _valid_devices() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return "cpu, cuda, " + ", ".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))


def default_policies(device: str) -> str:
    """What ``ampkit bench`` compares when no --policies is given, for the device."""
    cap = capability(device)
    if torch.device(device).type != "cuda":
        return "32-true,bf16-mixed,O2"  # O2 is bf16 on a CPU (its autocast dtype)
    names = ["32-true", "16-mixed"] + (["bf16-mixed"] if cap.bf16 else []) + ["O2"]
    return ",".join(names + (["fp8"] if fp8_supported(device) else []))


# --- info ------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, the device, what it runs natively and the recommended policy."""
    device = check_device(args.device)
    cap = capability(device)
    policy, reason = recommend_policy(device)
    fp8 = fp8_supported(device)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
    print(f"ampkit {__version__}")
    print(f"torch {torch.__version__} ({build})")
    print(f"device: {cap.device} ({cap.name})")
    print(f"native bf16: {_yes(cap.bf16)}   native fp16: {_yes(cap.fp16)}   "
          f"fp8 matmuls: {'yes' if fp8 else 'no (ampkit emulates them here: same numerics, slower)'}")
    print(f"autocast default dtype here: {str(autocast_default_dtype(torch.device(device).type))[6:]}")
    print(f"recommended policy: {policy} ({reason})")
    return 0


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# --- bench -----------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    """Run the requested policies on one model and print/write the comparison."""
    from .bench import report
    from .bench.runner import BenchSettings, parse_policy_list, run_bench
    from .bench.workloads import get_workload

    device = check_device(args.device)
    cuda = torch.device(device).type == "cuda"
    specs = [spec for text in (args.policies or [default_policies(device)])
             for spec in parse_policy_list(text, torch.device(device).type)]
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
    with report.Progress(enabled=show) as progress:
        results = run_bench(specs, settings, isolate=isolate, on_policy=progress.task)
    document = _bench_document(results, settings, workload.description, isolate, device)
    report.render_table(f"ampkit bench: {workload.description} on {device}", report.BENCH_HEADERS,
                        report.bench_rows(results), out, report.BENCH_LEFT)
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
    from .bench.report import bench_verdict, environment

    env = environment(device)
    document = {"command": "bench", "device": env["device"], "torch": env["torch"],
                "ampkit": env["ampkit"], "environment": env, "workload": workload,
                "settings": dict(asdict(settings), process_per_policy=isolate,
                                 policies=[r["policy"] for r in results]),
                "results": results}
    document["verdict"] = bench_verdict(document)
    return document


def check_output_paths(**paths: Optional[str]) -> None:
    """Fail before a run, not after it, when an output file could not be written.

    Makes the file's folder (the run would make it anyway) and writes a scratch file there.
    """
    for flag, path in paths.items():
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        try:
            if os.path.isdir(path):
                raise OSError(0, "it is a folder")
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as err:
            raise CliError(f"--{flag} {path!r} cannot be written ({err.strerror or err}); "
                           "valid: a file path in a folder you can write to") from None


# --- train -----------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    """Train a classifier under one policy, printing one line per epoch."""
    from .bench import report
    from .bench.runner import parse_policy
    from .bench.train import TrainSettings, train

    device = check_device(args.device)
    policy = args.opt_level or args.policy or recommend_policy(device)[0]
    spec = parse_policy(policy, torch.device(device).type)  # a bad name fails before loading data
    check_output_paths(json=args.json, checkpoint=args.checkpoint)
    settings = TrainSettings(model=args.model, data=args.data, data_dir=args.data_dir,
                             policy=policy, epochs=args.epochs, batch_size=args.batch_size,
                             lr=args.lr, seed=args.seed, device=device)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"ampkit train: {settings.model} on {settings.data} with {policy} "
          f"({spec.policy}) on {device}", file=out)
    show = not args.quiet and sys.stdout.isatty() and args.json != "-"
    with report.Progress(enabled=show, keep_done=False) as progress:
        log = train(settings, checkpoint=args.checkpoint, resume=args.resume,
                    on_epoch=lambda record: print(_epoch_line(record, settings.epochs), file=out),
                    on_batch=progress.task)
    _print_train_summary(log, out)
    if args.json:
        report.write_json(dict({"command": "train", "environment": report.environment(device)},
                               **log), args.json)
    return 0


def _epoch_line(record: dict[str, Any], epochs: int) -> str:
    scale = "" if record["loss_scale"] is None else (
        f"  scale {record['loss_scale']:g} ({record['skipped_steps']} skipped)")
    return (f"epoch {record['epoch']:>3}/{epochs}  train loss {record['train_loss']:.4f}  "
            f"test loss {record['test_loss']:.4f}  test acc {record['test_acc']:.2%}  "
            f"{record['time_s']:.1f}s{scale}")


def _print_train_summary(log: dict[str, Any], out: Any) -> None:
    if log["resumed_from_epoch"] is not None:
        print(f"resumed after epoch {log['resumed_from_epoch']} of the checkpoint", file=out)
    final = log["final"]
    if final is None:
        print("nothing was trained (epochs 0)", file=out)
        return
    print(f"final: epoch {final['epoch']}, test accuracy {final['test_acc']:.2%}, "
          f"test loss {final['test_loss']:.4f} ({log['data']})", file=out)


# --- parser and entry point ------------------------------------------------------------------
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

_TRAIN_HELP = """\
Train a classifier with any policy or opt level, with test accuracy per epoch.
Data: digits (scikit-learn's 8x8 digits, the default), cifar10 (local files via
torchvision, never downloaded), synthetic. --checkpoint writes model, optimizer,
GradScaler and amp state after every epoch, with a sha256 digest of its content; --resume
continues exactly where it stopped, and refuses a checkpoint whose digest does not match
(corrupted) or that has none (format ampkit-train-1, from before digests)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``ampkit`` argument parser with its subcommands."""
    parser = _Parser(prog="ampkit", description="Automatic mixed precision for PyTorch: "
                     "compare precisions (bench), train with one (train), see what this "
                     "machine runs natively (info).")
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{bench,train,info}",
                                parser_class=_Parser)
    info = sub.add_parser("info", help="versions, device, native half/fp8 support, "
                          "recommended policy", description="Print ampkit's and torch's "
                          "versions, the device, which half dtypes and fp8 it runs natively, "
                          "and the policy ampkit recommends there, with the reason.")
    info.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when available)")
    info.set_defaults(handler=cmd_info)
    _add_bench(sub)
    _add_train(sub)
    return parser


def _common(p: argparse.ArgumentParser, models: str, model_default: str) -> None:
    p.add_argument("--model", default=model_default, metavar="NAME",
                   help=f"{models} (default: {model_default})")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples per step (default: "
                   "the model's for the device)" if model_default == "gpt" else
                   "samples per step (default 64)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': to "
                   "stdout, and the human-readable output to stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (also off when "
                   "stdout is not a terminal)")


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare precision policies side by side on one model",
                       description=_BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, "mlp, cnn, resnet18, gpt, or package.module:function", "gpt")
    p.set_defaults(handler=cmd_bench)
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


def _add_train(sub: Any) -> None:
    from .bench.data import DATASETS

    p = sub.add_parser("train", help="train a classifier with a policy or opt level",
                       description=_TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, "mlp, cnn, resnet18, or package.module:function", "mlp")
    p.set_defaults(handler=cmd_train, batch_size=64)
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


def _usage_errors() -> tuple[type[Exception], ...]:
    from .bench.data import DataError
    from .bench.report import ReportError
    from .bench.runner import BenchError
    from .bench.train import TrainError
    from .bench.workloads import WorkloadError
    return (CliError, BenchError, WorkloadError, ReportError, DataError, TrainError)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ampkit`` with ``argv`` (default: sys.argv[1:]); returns the exit status.

    Example: ``main(["info"])`` prints the device report and returns 0.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version (0) and usage errors (2)
        return stop.code if isinstance(stop.code, int) else 0
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args))
    except _usage_errors() as err:
        print(f"ampkit {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one line for users; AMPKIT_DEBUG=1 for the rest
        if os.environ.get("AMPKIT_DEBUG"):
            raise
        print(f"ampkit {args.command}: failed: {type(err).__name__}: {_one_line(err)} "
              "(AMPKIT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


if __name__ == "__main__":
    sys.exit(main())
