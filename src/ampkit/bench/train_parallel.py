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
GradScaler through ``ampkit.distributed.TrainState``, each rank's RNG state, the fp8
delayed-scaling state, and ``ampkit-train.json`` (settings, nproc, history: the epoch,
which with the seed fixes the data order). Each save goes to ``DIR.tmp`` and is renamed
to ``DIR`` once every rank has written its part, so a rank that dies mid-save leaves the
previous checkpoint whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
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
from .errors import UsageError
from .paths import check_can_create
from .launch import exit_rank, launch_ranks, rank_main
from .parallel import ParallelPlan
from .stepcheck import Warn
from .train import (OnEpoch, Trainer, TrainSettings, check_resume_settings, run_epoch,
                    train_log)

__all__ = ["META", "check_checkpoint_dir", "check_parallel_train", "read_meta",
           "run_parallel_train"]

META = "ampkit-train.json"  # the run's settings, nproc, history and files' digests
# Format 2 records the sha256 digest of every file DCP wrote; 1 (no digests) is refused.
_FORMAT, _UNSEALED_FORMAT = "ampkit-train-dcp-2", "ampkit-train-dcp-1"
_RESULT, _EVENTS = "log.json", "events.jsonl"


# --- the parent ---------------------------------------------------------------------------------
def check_checkpoint_dir(path: str, resume: bool) -> None:
    """UsageError unless ``path`` can hold a DCP checkpoint (and holds one to resume)."""
    if os.path.isfile(path):
        raise UsageError(f"--checkpoint {path!r} is a file; with --nproc a checkpoint is a "
                         "folder (torch.distributed.checkpoint); valid: a folder path")
    if resume:
        read_meta(path, verify=False)  # the files' digests: once, in check_parallel_train
        return
    for where in (path, path + ".tmp", path + ".old"):  # the run replaces or removes these
        if os.path.islink(where):
            raise UsageError(f"--checkpoint {path!r}: {where!r} is a link, and the run would "
                             "replace or remove it; valid: a real folder path")
        # PATH.tmp is ampkit's scratch: a save killed before its record leaves DCP files
        # there without one. PATH.old always has its record (_remove_checkpoint takes it
        # last), so DCP files there without one are another program's.
        foreign = _foreign_entries(where, record=not where.endswith(".tmp"))
        if foreign:
            raise UsageError(
                f"--checkpoint {path!r}: {where!r} holds {foreign[0]!r}, which is not part of "
                "a checkpoint of ampkit train --nproc, and the run would "
                f"{'replace' if where == path else 'remove'} that folder; "
                "valid: a new or empty folder, or the folder of an earlier ampkit train "
                "--nproc run")
    try:
        check_can_create(path)
    except OSError as err:
        raise UsageError(f"--checkpoint {path!r} cannot be written ({err.strerror or err}); "
                         "valid: a folder path in a folder you can write to") from None


def _foreign_entries(folder: str, record: bool) -> list[str]:
    """What ``folder`` holds besides a DCP checkpoint's files and ampkit's record (a file
    in its place counts as foreign too), sorted; [] when it does not exist or is empty.
    ``record``: DCP files without ampkit's record are foreign too (another program's
    checkpoint; only a save killed before its record, at PATH.tmp, leaves them so)."""
    if not os.path.lexists(folder):
        return []
    if not os.path.isdir(folder):
        return [os.path.basename(folder)]
    names = os.listdir(folder)
    foreign = sorted(name for name in names if not (
        name == META or name.startswith(".metadata") or name.endswith(".distcp")))
    if not foreign and record and names and META not in names:
        return sorted(names)
    return foreign


def read_meta(path: str, *, verify: bool = True) -> dict[str, Any]:
    """The run record of a DCP checkpoint that ``train --nproc`` wrote; ``verify``: also
    check the sha256 digests of the record and of every file (reading all of them)."""
    _finish_replace(path)
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise UsageError(f"--resume: no ampkit train --nproc checkpoint at {path!r} (no {META}); "
                         "valid: the --checkpoint folder of an earlier run with --nproc")
    try:
        with open(meta_path) as src:
            meta = json.load(src)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--resume: {meta_path!r} cannot be read ({type(err).__name__}: "
                         f"{err}), the checkpoint is damaged; valid: an intact copy, or start "
                         "again without --resume") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found == _UNSEALED_FORMAT:
        raise UsageError(f"--resume: checkpoint {path!r} has no sha256 digests (format "
                         f"{found!r}, written by an earlier ampkit), so its content cannot be "
                         f"verified; valid: a checkpoint in format {_FORMAT!r} (start again "
                         "without --resume, or finish that run with the ampkit that wrote it)")
    if found != _FORMAT:
        raise UsageError(f"--resume: {meta_path!r} is not in format {_FORMAT!r}; valid: a "
                         "checkpoint that ampkit train --nproc wrote")
    if verify:
        _check_digests(path, meta)
    return meta


def _digests(folder: str) -> dict[str, str]:
    """The sha256 digest of every file under ``folder`` but the run record, by relative path."""
    digests = {}
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, folder)
            if relative == META:
                continue
            digest = hashlib.sha256()
            with open(full, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
            digests[relative] = digest.hexdigest()
    return dict(sorted(digests.items()))


def _record_digest(meta: dict[str, Any]) -> str:
    """The sha256 digest of the run record itself (its settings, history and file digests)."""
    record = {key: value for key, value in meta.items() if key != "record_sha256"}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _check_digests(path: str, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose record or files are not exactly those written (DCP checks
    no sums)."""
    expected = meta.get("sha256")
    if not isinstance(expected, dict):
        why = "its record holds no digests"
    elif meta.get("record_sha256") != _record_digest(meta):
        why = f"{META!r} does not match the sha256 digest recorded in it"
    else:
        found = _digests(path)
        if found == expected:
            return
        name = next(n for n in sorted(set(found) | set(expected))
                    if found.get(n) != expected.get(n))
        why = (f"{name!r} is missing" if name not in found else
               f"{name!r} was not written with it" if name not in expected else
               f"{name!r} does not match the sha256 digest recorded when it was written")
    raise UsageError(f"--resume: checkpoint {path!r} is corrupted: {why}; valid: an intact "
                     "copy, or start again without --resume")


def run_parallel_train(settings: TrainSettings, plan: ParallelPlan, *,
                       checkpoint: Optional[str] = None, resume: bool = False,
                       on_epoch: Optional[OnEpoch] = None,
                       on_warning: Optional[Warn] = None,
                       on_start: Optional[Callable[[Optional[int]], None]] = None,
                       checked: bool = False) -> dict[str, Any]:
    """Train on ``plan.nproc`` ranks under torchrun; the log :func:`train` would return.
    ``on_start`` is called once every rank has read its data, model and checkpoint,
    before the first epoch (an error a rank finds before then comes without it), with the
    epochs the checkpoint finished when resuming (else None), as :func:`train` calls it.
    ``checked``: the caller has just made :func:`check_parallel_train`'s checks (whose
    digests read the whole checkpoint), which are then not made again.

    Raises:
        UsageError: before launching: ``--resume`` without a checkpoint of this run's
            settings and nproc, or a checkpoint path that cannot be written.
        RankError: a rank failed (the message names the first that did).
    """
    if not checked:
        check_parallel_train(settings, plan, checkpoint=checkpoint, resume=resume)
    with tempfile.TemporaryDirectory(prefix="ampkit-ranks-") as folder:
        job = os.path.join(folder, "job.json")
        with open(job, "w") as out:
            json.dump({"settings": asdict(settings), "backend": plan.backend, "folder": folder,
                       "threads": plan.threads, "resume": resume,
                       "checkpoint": os.path.abspath(checkpoint) if checkpoint else None}, out)
        events = _EventReader(os.path.join(folder, _EVENTS), on_epoch, on_warning, on_start)
        result = os.path.join(folder, _RESULT)
        launch_ranks(__name__, job, plan.nproc, plan.threads, folder, result, poll=events.poll)
        with open(result) as src:
            return json.load(src)


def check_parallel_train(settings: TrainSettings, plan: ParallelPlan, *,
                         checkpoint: Optional[str] = None, resume: bool = False) -> None:
    """The checks :func:`run_parallel_train` makes before it launches, alone (UsageError):
    a writable checkpoint folder, and to resume, an intact one (its digests) of these
    settings and nproc."""
    if resume and not checkpoint:
        raise UsageError("--resume needs --checkpoint DIR (the checkpoint to continue)")
    if checkpoint:
        check_checkpoint_dir(checkpoint, resume)
    if resume and checkpoint:
        _check_resume(read_meta(checkpoint), settings, plan.nproc, checkpoint)


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
    torch.set_num_threads(job["threads"])
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
        meta = {"format": _FORMAT, "settings": asdict(trainer.settings), "nproc": trainer.world,
                "history": trainer.history, "sha256": _digests(tmp)}
        meta["record_sha256"] = _record_digest(meta)
        with open(os.path.join(tmp, META), "w") as out:
            json.dump(meta, out)
        _replace(tmp, path)
    dist.barrier()


def _replace(tmp: str, path: str) -> None:
    """Put the folder ``tmp`` at ``path``; the previous checkpoint goes only once it is there."""
    old = path + ".old"
    _remove_checkpoint(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _remove_checkpoint(old)


def _remove_checkpoint(folder: str) -> None:
    """Remove a checkpoint folder, its run record last: one that a kill interrupted still
    has its record, so the next run knows it for ampkit's (and removes it)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name != META:
            entry = os.path.join(folder, name)
            if os.path.isdir(entry) and not os.path.islink(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(entry)
    shutil.rmtree(folder, ignore_errors=True)


def _shared_fp8_histories(path: str) -> bool:
    """Whether the checkpoint holds one set of fp8 amax histories for every rank (key
    "fp8."), as ampkit wrote them while DDP gave every rank rank 0's; now "fp8.rankN."."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata: load_checkpoint reports it
        return False
    return any(key.startswith("fp8.") and not key.startswith("fp8.rank") for key in keys)


def _finish_replace(path: str) -> None:
    # A save killed between _replace's two renames left the previous checkpoint at .old.
    if not os.path.exists(path) and os.path.isdir(path + ".old"):
        os.replace(path + ".old", path)


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
