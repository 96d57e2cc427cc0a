"""``ampkit train --nproc N``: the same training on N processes under torchrun, with DDP.

The command relaunches itself through ``bench.launch.launch_ranks`` (``python -m
torch.distributed.run --standalone --nproc-per-node N -m ampkit.bench.train_parallel JOB``;
gloo on a CPU, nccl on CUDA with rank r on ``cuda:r``). Each rank builds the run's
``Trainer`` with the model in DDP (the policy applied first, then the wrap) and trains on
its share of each epoch's (seed, epoch) order: DistributedSampler's split (the order
padded with its first samples to a multiple of N, then every N-th sample from the
rank's offset), ``--batch-size`` samples per rank and step. Rank 0 reports each epoch's
record (the train loss averaged over the ranks) to the parent through a file the parent
polls, and writes the log at the end.

Checkpoints are DCP directories (``torch.distributed.checkpoint``): model, optimizer and
GradScaler through ``ampkit.distributed.TrainState``, each rank's RNG state and fp8
delayed-scaling state, and the run record that ``bench.dcp_folder`` writes (settings,
nproc, each rank's threads, which a resume takes, and the history: the epoch, which with
the seed fixes the data order). Each save goes to ``DIR.tmp`` and is renamed to ``DIR``
once every rank has written its part, so a rank that dies mid-save leaves the previous
checkpoint whole.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..fp8 import fp8_state_dict, load_fp8_state_dict
from .data import Dataset, load_data
from .dcp_folder import check_checkpoint_dir, read_meta, replace_folder, write_record
from .errors import UsageError
from .launch import exit_rank, launch_ranks, rank_main
from .parallel import ParallelPlan
from .stepcheck import Warn
from .train import (OnEpoch, Trainer, TrainSettings, check_resume_settings, run_epoch,
                    train_log)

__all__ = ["check_parallel_train", "rank_threads", "run_parallel_train"]

_RESULT, _EVENTS = "log.json", "events.jsonl"


# --- the parent ---------------------------------------------------------------------------------
def run_parallel_train(settings: TrainSettings, plan: ParallelPlan, *,
                       checkpoint: Optional[str] = None, resume: bool = False,
                       on_epoch: Optional[OnEpoch] = None,
                       on_warning: Optional[Warn] = None,
                       on_start: Optional[Callable[[Optional[int]], None]] = None,
                       checked: bool = False, threads: Optional[int] = None) -> dict[str, Any]:
    """Train on ``plan.nproc`` ranks under torchrun; the log :func:`train` would return.
    ``on_start`` is called once every rank has read its data, model and checkpoint,
    before the first epoch (an error a rank finds before then comes without it), with the
    epochs the checkpoint finished when resuming (else None), as :func:`train` calls it.
    ``checked``: the caller has just made :func:`check_parallel_train`'s checks (whose
    digests read the whole checkpoint), which are then not made again. ``threads``: each
    rank's intra-op threads (see :func:`rank_threads`), recorded in the checkpoint.

    Raises:
        UsageError: before launching: ``--resume`` without a checkpoint of this run's
            settings and nproc, another ``threads`` than the checkpoint's, or a checkpoint
            path that cannot be written.
        RankError: a rank failed (the message names the first that did).
    """
    if not checked:
        check_parallel_train(settings, plan, checkpoint=checkpoint, resume=resume,
                             threads=threads)
    count, why = rank_threads(threads, plan, read_meta(str(checkpoint), verify=False)
                              if resume else None)
    with tempfile.TemporaryDirectory(prefix="ampkit-ranks-") as folder:
        job = os.path.join(folder, "job.json")
        with open(job, "w") as out:
            json.dump({"settings": asdict(settings), "backend": plan.backend, "folder": folder,
                       "threads": count, "resume": resume,
                       "checkpoint": os.path.abspath(checkpoint) if checkpoint else None}, out)
        events = _EventReader(os.path.join(folder, _EVENTS), on_epoch, on_warning, on_start)
        result = os.path.join(folder, _RESULT)
        launch_ranks(__name__, job, plan.nproc, count, folder, result, poll=events.poll)
        with open(result) as src:
            return dict(json.load(src), threads=count, threads_reason=why)


def check_parallel_train(settings: TrainSettings, plan: ParallelPlan, *,
                         checkpoint: Optional[str] = None, resume: bool = False,
                         threads: Optional[int] = None) -> None:
    """The checks :func:`run_parallel_train` makes before it launches, alone (UsageError):
    a writable checkpoint folder, and to resume, an intact one (its digests) of these
    settings, nproc and threads."""
    if resume and not checkpoint:
        raise UsageError("--resume needs --checkpoint DIR (the checkpoint to continue)")
    if checkpoint:
        check_checkpoint_dir(checkpoint, resume)
    if resume and checkpoint:
        meta = read_meta(checkpoint)
        _check_resume(meta, settings, plan.nproc, checkpoint)
        rank_threads(threads, plan, meta)


def rank_threads(requested: Optional[int], plan: ParallelPlan,
                 meta: Optional[dict[str, Any]]) -> tuple[int, str]:
    """Each rank's intra-op threads and why: a resumed run's are its checkpoint's (a CPU's
    sums round by the thread count, so another would not continue exactly; a checkpoint
    written before they were recorded has none; a ``requested`` cap below them is refused);
    else ``requested``, at most the rank's share of the cores (as ``ampkit bench --nproc``
    takes it); else that share."""
    saved = None if meta is None else meta.get("threads")
    if saved is not None and (type(saved) is not int or saved < 1):
        raise UsageError(f"--resume: its run record's 'threads' entry is {saved!r}; valid: "
                         "an int >= 1, as ampkit train --nproc writes it")
    # --threads with --nproc is a cap: one at or above the checkpoint's count (the cap that
    # wrote it, on any machine) takes it; one below it cannot continue exactly.
    if saved is not None and requested is not None and requested < saved:
        raise UsageError(f"--threads {requested}: the checkpoint's ranks ran on {saved} "
                         "thread(s) each, and another count rounds a CPU's sums differently, "
                         f"so the resumed run would not continue exactly; valid: --threads "
                         f"{saved} or more (a cap: the run takes {saved}), or leave it out")
    if saved is not None:
        more = (f"; more than this machine's share of {plan.threads}, so slower"
                if saved > plan.threads else "")
        return saved, f"{saved}, the checkpoint's (a resume continues on the same threads{more})"
    share = f"each rank's share of the usable cores ({plan.threads} for {plan.nproc} ranks)"
    if requested is None:
        return plan.threads, f"{plan.threads}: {share}"
    if requested > plan.threads:
        return plan.threads, f"{plan.threads}: --threads {requested} capped at {share}"
    return requested, f"{requested}, as asked (--threads)"


def _check_resume(meta: dict[str, Any], settings: TrainSettings, nproc: int, path: str) -> None:
    try:
        check_resume_settings(meta.get("settings", {}), settings)
    except UsageError as err:
        raise UsageError(f"--resume: checkpoint {path!r}: {err}") from None
    if meta.get("nproc") != nproc:
        raise UsageError(f"--resume: checkpoint {path!r} was written by {meta.get('nproc')} "
                         f"ranks, this run has --nproc {nproc} (each rank's share of the data "
                         f"depends on it); valid: --nproc {meta.get('nproc')}")


class _EventReader:
    """The parent's side of rank 0's events file: epoch records and warnings, as they come."""

    def __init__(self, path: str, on_epoch: Optional[OnEpoch], on_warning: Optional[Warn],
                 on_start: Optional[Callable[[Optional[int]], None]] = None) -> None:
        self.path, self.offset = path, 0
        self.on_epoch, self.on_warning, self.on_start = on_epoch, on_warning, on_start

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as src:
            src.seek(self.offset)
            text = src.read()
        complete = text[:text.rfind("\n") + 1]  # a line still being written waits
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            event = json.loads(line)
            if "start" in event and self.on_start is not None:
                self.on_start(event["start"])
            elif "epoch" in event and self.on_epoch is not None:
                self.on_epoch(event["epoch"])
            elif "warning" in event and self.on_warning is not None:
                self.on_warning(event["warning"])


# --- a rank -------------------------------------------------------------------------------------
class RankTrainer(Trainer):
    """A rank's Trainer: the model in DDP, its share of each epoch, the loss over all ranks."""

    def __init__(self, settings: TrainSettings, data: Dataset, warn: Warn, rank: int,
                 world: int) -> None:
        self.rank, self.world = rank, world
        super().__init__(settings, data, warn, wrap=self._ddp)

    def _ddp(self, model: nn.Module) -> nn.Module:
        device = torch.device(self.settings.device)
        ids = [device] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        order = super().epoch_order(epoch)
        total = math.ceil(len(order) / self.world) * self.world
        order = torch.cat([order, order[:total - len(order)]])  # DistributedSampler's padding
        return order[self.rank:total:self.world]

    def train_epoch(self, epoch: int, on_batch: Optional[Callable[[int, int], None]] = None) -> float:
        """This rank's epoch; the mean loss over all ranks (every share has the same size)."""
        import torch.distributed as dist

        mine = super().train_epoch(epoch, on_batch)
        total = torch.tensor([mine], dtype=torch.float64, device=self.data.train_x.device)
        dist.all_reduce(total)
        return float(total.item()) / self.world


def _rank_main(job_path: str) -> int:
    return rank_main(job_path, _run_rank, _RESULT)


def _run_rank(job: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    settings = TrainSettings(**job["settings"])
    torch.set_num_threads(job["threads"])  # (this rank's own process)
    if torch.device(settings.device).type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        settings = dataclasses.replace(settings, device=f"cuda:{local}")
    dist.init_process_group(job["backend"])
    try:
        return _train_rank(settings, job, rank, dist.get_world_size())
    finally:
        gc.collect()  # the DDP reducer goes before the process group
        dist.destroy_process_group()


def _train_rank(settings: TrainSettings, job: dict[str, Any], rank: int,
                world: int) -> dict[str, Any]:
    events = os.path.join(job["folder"], _EVENTS)
    data = load_data(settings.data, settings.data_dir)
    trainer = RankTrainer(settings, data, lambda message: _event(events, rank, "warning", message),
                          rank, world)
    trainer.threads = job["threads"]  # what the checkpoint records
    checkpoint = job["checkpoint"]
    start = _load(trainer, checkpoint) if job["resume"] else 0
    # Every rank has its data, model and checkpoint: DDP's construction (a broadcast from
    # rank 0) and DCP's load wait for all of them. The header.
    _event(events, rank, "start", start if job["resume"] else None)
    for epoch in range(start + 1, settings.epochs + 1):
        record = run_epoch(trainer, epoch, None)
        trainer.history.append(record)
        if checkpoint:
            _save(trainer, checkpoint)
        _event(events, rank, "epoch", record)
    return train_log(trainer, data, start if job["resume"] else None)


def _event(path: str, rank: int, kind: str, value: Any) -> None:
    if rank == 0:  # the ranks agree on the records (the loss is reduced) and on skips
        with open(path, "a") as out:
            out.write(json.dumps({kind: value}) + "\n")


# --- DCP checkpoints ----------------------------------------------------------------------------
def _state(trainer: RankTrainer) -> dict[str, Any]:
    """What DCP saves and loads in place: TrainState, and this rank's own fp8 amax
    histories (each rank keeps those of its data) and RNG state."""
    from ..distributed import TrainState

    return {"train": TrainState(trainer.model, trainer.optimizer, trainer.precision.scaler),
            f"fp8.rank{trainer.rank}": fp8_state_dict(trainer.model.module),
            f"rng.rank{trainer.rank}": torch.get_rng_state()}


def _save(trainer: RankTrainer, path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp = path + ".tmp"
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
    dist.barrier()
    dcp.save(_state(trainer), checkpoint_id=tmp)  # ends once every rank has written
    if trainer.rank == 0:
        write_record(tmp, {"settings": asdict(trainer.settings), "nproc": trainer.world,
                           "threads": trainer.threads, "history": trainer.history})
        replace_folder(tmp, path)
    dist.barrier()


def _shared_fp8_histories(path: str) -> bool:
    """Whether the checkpoint holds one set of fp8 amax histories for every rank (key
    "fp8."), as ampkit wrote them while DDP gave every rank rank 0's; now "fp8.rankN."."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata: load_checkpoint reports it
        return False
    return any(key.startswith("fp8.") and not key.startswith("fp8.rank") for key in keys)


def _load(trainer: RankTrainer, path: str) -> int:
    """Load the checkpoint into a freshly built rank; the number of epochs it holds."""
    from ..distributed import load_checkpoint

    meta = read_meta(path, verify=False)  # the parent checked its digests, settings, nproc
    state = _state(trainer)
    fp8_key = f"fp8.rank{trainer.rank}"
    if _shared_fp8_histories(path):  # written before each rank kept its own: rank 0's
        state["fp8"] = state.pop(fp8_key)
        fp8_key = "fp8"
    try:
        load_checkpoint(state, checkpoint_id=path)  # a damaged one is refused, nothing loaded
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if type(err).__name__ != "CheckpointException":
            raise
        raise UsageError(f"--resume: checkpoint {path!r} cannot be read, it is damaged "
                         f"({_first_failure(err)}); valid: an intact copy, or start again "
                         "without --resume") from None
    load_fp8_state_dict(trainer.model.module, state[fp8_key])
    torch.set_rng_state(state[f"rng.rank{trainer.rank}"])
    trainer.history = list(meta["history"])
    return len(trainer.history)


def _first_failure(err: BaseException) -> str:
    """The first rank's error in a DCP CheckpointException, in a few words."""
    failures = getattr(err, "failures", None) or {}
    first = next(iter(failures.values()), err)
    # DCP wraps each rank's exception: (exception, its stack) in torch 2.13, or .exc
    inner = first[0] if isinstance(first, tuple) and first else getattr(first, "exc", first)
    text = " ".join(str(inner).split())
    return f"{type(inner).__name__}: {text[:160]}" if text else type(inner).__name__


if __name__ == "__main__":
    exit_rank(_rank_main(sys.argv[1]))  # no interpreter teardown: see exit_rank
