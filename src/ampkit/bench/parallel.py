"""``ampkit bench --nproc N``: the same policies on N processes under torchrun (DDP or FSDP2).

The command relaunches itself: ``python -m torch.distributed.run --standalone
--nproc-per-node N -m ampkit.bench.parallel JOB`` starts N ranks (gloo on a CPU, nccl on
CUDA, rank r on ``cuda:r``), each with the usable cores divided among them as threads.
For each policy, every rank builds the model in DDP (the policy applied first, as
``initialize`` wants) or sharded by ``ampkit.distributed.shard`` (FSDP2), and rank 0 also
builds a plain one-process copy: the baseline, with the threads a rank has. All of these
runs take turns in rounds of a few steps (the bench's ``play_rounds``, its order
rotating): the N ranks train together, or rank 0 trains alone while the others wait at a
barrier. Rank 0 gathers the per-rank numbers and writes the results for the parent,
which renders them like any bench (speedups between policies from the slowest rank's
round times).

Numbers: global samples/s = N × batch / the slowest rank's median step time (every step
waits for the gradient reduction, so the ranks keep the slowest one's pace); scaling
efficiency = global samples/s / (N × one-process samples/s), taken per round (the
one-process round time over the slowest rank's) and reported as the median over rounds
with a 95% interval, so load that comes and goes hits both sides alike. Every rank
trains on the same synthetic batches: the throughput is what is measured, and under DDP
the loss curve then equals the one-process curve, which the result reports as a check.

A rank that fails writes its error to a file before it exits; torchrun then stops the
others, and the parent raises ``RankError`` naming the rank that failed first (the
launcher, shared with ``ampkit train --nproc``, is ``bench.launch``).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .._torch_compat import TORCH_VERSION
from .._measure import paired_speedup
from .errors import UsageError
from .launch import exit_rank, launch_ranks, rank_main, usable_cores
from .policies import PolicySpec, parse_policy
from .precision import OptimizerFactory, Precision
from .compare import compare, max_loss_deviation, no_memory_ratios
from .runner import BenchSettings, PolicyRun, Setup, play_rounds

__all__ = ["Parallel", "ParallelPlan", "check_plan", "rank_settings", "run_parallel_bench",
           "scaling_rows", "scaling_sentence", "SCALING_HEADERS"]

_PG_TIMEOUT = datetime.timedelta(minutes=60)  # the baseline runs while the others wait
_RESULTS = "results.json"


class Parallel(str, enum.Enum):
    """How the ranks share the model: DDP replicas or FSDP2 shards."""

    DDP = "ddp"
    FSDP = "fsdp"


@dataclass(frozen=True)
class ParallelPlan:
    """What a multi-process bench launches, checked before anything starts.

    Args:
        nproc: ranks (processes) on this machine.
        parallel: DDP or FSDP2 (``ampkit.distributed.shard``).
        backend: "gloo" on a CPU, "nccl" on CUDA.
        threads: intra-op threads a rank may use: the usable cores divided among the
            ranks (at least 1); ``--threads`` may ask for fewer.

    Example:
        >>> check_plan(1, None, [], "cpu").backend
        'gloo'
    """

    nproc: int
    parallel: Parallel
    backend: str
    threads: int

    def fields(self) -> dict[str, Any]:
        """The JSON document's top-level entries for this plan."""
        return {"nproc": self.nproc, "parallel": self.parallel.value, "backend": self.backend}


def check_plan(nproc: Optional[int], parallel: Optional[str], specs: list[PolicySpec],
               device: str) -> Optional[ParallelPlan]:
    """Validate ``--nproc``/``--parallel`` for the policies and device; None without --nproc.

    Raises:
        UsageError: nproc below 1 or above what the machine runs side by side (its CPU
            cores, or its GPUs), ``--parallel`` without ``--nproc``, a device index with
            ``--nproc``, or a policy FSDP2 cannot run under ``--parallel fsdp``.
    """
    if nproc is None:
        if parallel is not None:
            raise UsageError(f"--parallel {parallel} needs --nproc N; valid: --nproc 1 or more "
                             "with --parallel ddp|fsdp")
        return None
    mode = _parallel(parallel)
    cuda = torch.device(device).type == "cuda"
    limit, what = (torch.cuda.device_count(), "GPUs") if cuda else (usable_cores(), "CPU cores")
    if not 1 <= nproc <= limit:
        raise UsageError(f"--nproc {nproc}: this machine runs 1 to {limit} ranks side by side "
                         f"({limit} {what}); valid: 1 to {limit}")
    if cuda and torch.device(device).index is not None:
        raise UsageError(f"--device {device} with --nproc: rank r runs on cuda:r; valid: "
                         "--device cuda")
    if mode is Parallel.FSDP:
        _check_fsdp(cuda)
    return ParallelPlan(nproc, mode, "nccl" if cuda else "gloo", max(1, usable_cores() // nproc))


def _parallel(name: Optional[str]) -> Parallel:
    try:
        return Parallel(name or Parallel.DDP.value)
    except ValueError:
        raise UsageError(f"unknown --parallel {name!r}; valid: "
                         f"{', '.join(p.value for p in Parallel)}") from None


def _check_fsdp(cuda: bool) -> None:
    if TORCH_VERSION < (2, 6) and not cuda:
        raise UsageError(f"--parallel fsdp on a CPU needs torch 2.6 or later (FSDP2 in torch "
                         f"{torch.__version__} needs CUDA streams); valid: --parallel ddp")


# --- the parent: launch torchrun, read what rank 0 wrote ---------------------------------------
def run_parallel_bench(specs: list[PolicySpec], settings: BenchSettings,
                       plan: ParallelPlan) -> list[dict[str, Any]]:
    """Run every policy on ``plan.nproc`` ranks under torchrun; the results, compared.

    Each result is the bench's per-policy result with the global ``samples_per_s``,
    ``scaling_efficiency``, ``samples_per_s_1proc``, ``per_rank`` numbers (step time,
    samples/s, peak memory) and ``peak_mem_mib`` the largest rank's; on a CPU, where the
    policies share a process per rank, ``mem_ratio`` is None and ``mem_ratio_reason`` says why.

    Raises:
        UsageError: ``settings.compile`` (before anything starts).
        RankError: a rank failed (the message names the first that did, and its error).
    """
    if settings.compile:
        # Each compiled run starts from a fresh dynamo (runner.build), which would throw
        # away the compiled code of the runs it takes turns with in the same rank.
        raise UsageError("--compile with --nproc: the runs that take turns on a rank would "
                         "recompile each other; valid: --nproc without --compile")
    settings = rank_settings(settings, plan)
    threads = settings.threads or plan.threads
    with tempfile.TemporaryDirectory(prefix="ampkit-ranks-") as folder:
        job = os.path.join(folder, "job.json")
        with open(job, "w") as out:
            json.dump({"policies": [s.label for s in specs], "settings": asdict(settings),
                       "parallel": plan.parallel.value, "backend": plan.backend,
                       "folder": folder}, out)
        launch_ranks(__name__, job, plan.nproc, threads, folder, os.path.join(folder, _RESULTS))
        with open(os.path.join(folder, _RESULTS)) as src:
            results = json.load(src)
    if torch.device(settings.device).type == "cpu":
        no_memory_ratios(results, "the same process on each rank")
    return compare(results)  # mem_ratio None where mem_ratio_reason says why


def rank_settings(settings: BenchSettings, plan: ParallelPlan) -> BenchSettings:
    """The settings each rank runs: the cores shared out among the ranks as threads (fewer
    when --threads asks for fewer), and exactly --steps steps (``max_time`` 0): more rounds
    "until stable" would be each rank's own decision, and the ranks must take the same steps.
    """
    threads = min(settings.threads or plan.threads, plan.threads)
    return dataclasses.replace(settings, threads=threads, max_time=0.0)


# --- the table and the sentence -----------------------------------------------------------
SCALING_HEADERS = ("policy", "samples/s 1 proc", "samples/s N procs", "efficiency",
                   "peak MiB per rank", "Δloss vs 1 proc")


def scaling_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per policy: one-process and global throughput, efficiency, per-rank memory."""
    def num(value: Optional[float], spec: str) -> str:
        return "-" if value is None else format(value, spec)
    return [[r["policy"], num(r["samples_per_s_1proc"], ",.1f"), num(r["samples_per_s"], ",.1f"),
             num(r["scaling_efficiency"], ".2f") + _interval(r.get("scaling_efficiency_ci")),
             " / ".join(num(p["peak_mem_mib"], ",.0f") for p in r["per_rank"]),
             num(r["loss_dev_vs_1proc"], ".2g")] for r in results]


def _interval(ci: Optional[list[float]]) -> str:
    return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def scaling_sentence(plan: ParallelPlan, results: list[dict[str, Any]]) -> str:
    """What the scaling numbers mean, in words."""
    effs = ", ".join(f"{r['policy']} {r['scaling_efficiency']:.2f}" for r in results
                     if r["scaling_efficiency"] is not None)
    threads = results[0].get("threads_per_rank", plan.threads) if results else plan.threads
    return (f"{plan.nproc} ranks ({plan.parallel.value.upper()}, {plan.backend}, {threads} "
            f"thread(s) each): global samples/s = {plan.nproc} × batch / the slowest rank's "
            f"median step; scaling efficiency = global / ({plan.nproc} × one process with the "
            f"same threads), the median over rounds in which the two took turns: "
            f"{effs or 'n/a'}.")


# --- a rank ----------------------------------------------------------------------------------
def _rank_main(job_path: str) -> int:
    return rank_main(job_path, _run_rank, _RESULTS)


def _run_rank(job: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    settings = BenchSettings(**job["settings"])
    torch.set_num_threads(settings.threads)
    if torch.device(settings.device).type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        settings = dataclasses.replace(settings, device=f"cuda:{local}")
    dist.init_process_group(job["backend"], timeout=_PG_TIMEOUT)
    try:
        device_type = torch.device(settings.device).type
        specs = [parse_policy(label, device_type) for label in job["policies"]]
        setup: Setup = _ddp_setup if job["parallel"] == Parallel.DDP.value else _fsdp_setup
        return _run_policies(specs, settings, setup, rank)
    finally:
        dist.destroy_process_group()


def _run_policies(specs: list[PolicySpec], settings: BenchSettings, setup: Setup,
                  rank: int) -> list[dict[str, Any]]:
    """Every policy on N ranks and, on rank 0, alone: all of them taking turns in rounds.

    ``play_rounds`` (as the single-process bench does) rotates the order each round, so
    load and drift hit every run alike; the other ranks wait at a barrier while rank 0
    runs alone. Every rank plays the same rounds: they are fixed by the settings alone.
    """
    import torch.distributed as dist

    together = [PolicyRun(spec, settings, setup) for spec in specs]
    alone = [_Alone(PolicyRun(spec, settings) if rank == 0 else None) for spec in specs]
    runs: list[Any] = [run for pair in zip(together, alone) for run in pair]
    play_rounds(runs, settings, [_quiet] * len(runs))
    results = []
    for run, baseline in zip(together, alone):
        mine = run.finish()
        numbers = {"rank": rank, "step_ms": mine["step_ms"], "peak_mem_mib": mine["peak_mem_mib"],
                   "samples_per_s": mine["samples_per_s"], "round_ms": mine["round_ms"]}
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, numbers)
        one = baseline.finish()
        results.append(mine if one is None else _merge(mine, one, per_rank))
    return results


class _Alone:
    """Rank 0's one-process run as one of ``play_rounds``' runs; other ranks wait for it."""

    def __init__(self, run: Optional[PolicyRun]) -> None:
        self.run_ = run
        self.round_ms: list[float] = [] if run is None else run.round_ms

    def warm_up(self) -> None:
        self._alone(lambda run: run.warm_up())

    def run(self, steps: int) -> None:
        self._alone(lambda run: run.run(steps))

    def finish(self) -> Optional[dict[str, Any]]:
        return None if self.run_ is None else self.run_.finish()

    def _alone(self, work: Callable[[PolicyRun], Any]) -> None:
        import torch.distributed as dist

        if self.run_ is not None:
            work(self.run_)
        dist.barrier()  # a wait in a socket: it takes no CPU from rank 0


def _quiet(done: int, total: int) -> None:
    pass


def _merge(mine: dict[str, Any], baseline: dict[str, Any],
           per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's result with the global throughput, the scaling and the per-rank numbers."""
    nproc = len(per_rank)
    slowest = max(p["step_ms"] for p in per_rank)
    batch = round(mine["samples_per_s"] * mine["step_ms"] / 1e3) if mine["samples_per_s"] else 0
    # Each round's efficiency: the one-process round time over the N-rank round time of
    # the slowest rank (global samples/s over N x one-process samples/s, for that round).
    together_ms = [max(rounds) for rounds in zip(*(p.pop("round_ms") for p in per_rank))]
    efficiency, interval = paired_speedup(baseline["round_ms"], together_ms)
    # round_ms: the slowest rank's, so the speedups between policies compare global rates.
    return dict(mine, step_ms=slowest, threads_per_rank=torch.get_num_threads(),
                round_ms=together_ms, interleaved=True,
                samples_per_s=nproc * batch / slowest * 1e3 if slowest > 0 else None,
                peak_mem_mib=max(p["peak_mem_mib"] for p in per_rank),
                memory_method=mine["memory_method"] + ", per rank (the largest shown)",
                per_rank=per_rank, samples_per_s_1proc=baseline["samples_per_s"],
                step_ms_1proc=baseline["step_ms"], peak_mem_mib_1proc=baseline["peak_mem_mib"],
                scaling_efficiency=efficiency,
                scaling_efficiency_ci=None if interval is None else list(interval),
                loss_dev_vs_1proc=max_loss_deviation(mine["losses"], baseline["losses"]))


def _ddp_setup(precision: Precision, model: nn.Module,
               make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
    # The policy first (initialize refuses a DDP-wrapped model; under O2 DDP must see the
    # half parameters), then the wrap; DDP broadcasts rank 0's weights to the others.
    model, optimizer = precision.setup(model, make_optimizer)
    cuda = precision.device.type == "cuda"
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[precision.device] if cuda else None)
    return ddp, optimizer


def _fsdp_setup(precision: Precision, model: nn.Module,
                make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
    # shard replaces initialize: FSDP2 casts at its groups' boundaries, the fp32 shards are
    # the masters. A model without a ModuleList of blocks is one group at the root.
    from ..distributed import shard

    # fp8 policies: Float8Linear layers before sharding; tensorwise weights gather in fp8.
    model = precision.place(model)
    has_blocks = any(isinstance(m, nn.ModuleList) and len(m) for m in model.modules())
    shard(model, precision.spec.policy, modules=None if has_blocks else [])
    return model, make_optimizer(model.parameters())  # the optimizer over the shards


if __name__ == "__main__":
    exit_rank(_rank_main(sys.argv[1]))  # no interpreter teardown: see exit_rank
