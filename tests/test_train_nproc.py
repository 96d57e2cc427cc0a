"""``ampkit train --nproc N``: DDP under torchrun, DCP checkpoints, exact resume, a dead rank.

The bad values run in this process and must exit 2 before torchrun starts. The 2-rank
runs (each 15-20 s on two busy cores, most of it starting torchrun and its ranks) run
the command in this process too (its ranks are torchrun's processes) and are marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from unittest import mock
from pathlib import Path

import pytest
import torch

import ampkit.cli.train as cli_train
from ampkit.bench.launch import usable_cores
from ampkit.bench.dcp_folder import META, read_meta
from ampkit.cli import main

needs_two_cores = pytest.mark.skipif(usable_cores() < 2, reason="--nproc 2 needs 2 CPU cores")
RUN = ["train", "--model", "mlp", "--data", "synthetic", "--opt-level", "O2", "--quiet"]

# Rank 1 kills itself at its 25th forward (epoch 2: an epoch is 16 steps per rank here, and
# evaluation adds one forward); rank 0 and the parent never do.
_DYING_MODEL = """\
    import os
    import signal

    import torch


    class Dying(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if os.environ.get("RANK") == "1" and self.calls == 25:
                os.kill(os.getpid(), signal.SIGKILL)
            return self.body(x)


    def make():
        return Dying()
"""


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("launched torchrun for a bad value")
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _usage_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main([*RUN, *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "0"], ["--nproc 0", "valid: 1 to"]),
    (["--nproc", "-1"], ["--nproc -1", "valid: 1 to"]),
    (["--nproc", str(usable_cores() + 1)], [f"--nproc {usable_cores() + 1}", "CPU cores"]),
    (["--nproc", "two"], ["'two'", "int"]),
    (["--nproc", "1", "--resume"], ["--resume needs --checkpoint"]),
])
def test_bad_values_exit_2_before_launching(capsys, no_launch, argv, words):
    line = _usage_error(capsys, *argv)
    for word in words:
        assert word in line, (word, line)


def test_a_device_index_with_nproc_exits_2(capsys, no_launch, monkeypatch):
    monkeypatch.setattr(cli_train, "check_device", lambda device: "cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = _usage_error(capsys, "--nproc", "2", "--device", "cuda:1")
    assert "--device cuda:1 with --nproc" in line and "valid: --device cuda" in line


def _two_rank_record(tmp_path: Path, nproc: int = 2, **fields: object) -> Path:
    """A checkpoint folder holding only the run record of a 2-rank O2 run at lr 1e-3
    (``nproc`` ranks, other record ``fields`` added)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    settings = {"model": "mlp", "data": "synthetic", "policy": "O2", "batch_size": 64,
                "lr": 1e-3, "seed": 0}
    from ampkit.bench.dcp_folder import record_digest

    meta = {"format": "ampkit-train-dcp-2", "nproc": nproc, "settings": settings, "history": [],
            "sha256": {}, **fields}
    (folder / META).write_text(json.dumps(dict(meta, record_sha256=record_digest(meta))))
    return folder


def test_a_dcp_checkpoint_whose_files_changed_is_refused_by_their_digests(tmp_path):
    """DCP checks no sums: a flipped bit in a shard resumed silently, with other weights,
    although --help promised a sha256 check."""
    import torch.distributed.checkpoint as dcp

    from ampkit.bench.errors import UsageError
    from ampkit.bench.dcp_folder import digests, record_digest

    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(folder))
    (tmp_path / "x").mkdir()
    meta = json.loads((_two_rank_record(tmp_path / "x") / META).read_text())
    del meta["record_sha256"]
    meta = dict(meta, sha256=digests(str(folder)))
    (folder / META).write_text(json.dumps(dict(meta, record_sha256=record_digest(meta))))
    assert read_meta(str(folder))["nproc"] == 2 and ".metadata" in digests(str(folder))
    (folder / META).write_text(json.dumps(dict(meta, nproc=3, record_sha256=record_digest(meta))))
    with pytest.raises(UsageError, match=r"'ampkit-train.json' does not match the sha256 digest "
                                         r"recorded in it"):
        read_meta(str(folder))
    (folder / META).write_text(json.dumps(dict(meta, record_sha256=record_digest(meta))))
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=rf"is corrupted: '{shard.name}' does not match the "
                                         r"sha256 digest recorded when it was written"):
        read_meta(str(folder))
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    (folder / "extra.distcp").write_bytes(b"")
    with pytest.raises(UsageError, match=r"'extra.distcp' was not written with it"):
        read_meta(str(folder))
    (folder / "extra.distcp").unlink()
    shard.unlink()
    with pytest.raises(UsageError, match=rf"'{shard.name}' is missing"):
        read_meta(str(folder))
    (folder / META).write_text(json.dumps(dict(meta, format="ampkit-train-dcp-1")))
    with pytest.raises(UsageError, match=r"has no sha256 digests \(format 'ampkit-train-dcp-1'"):
        read_meta(str(folder))


def test_checkpoint_folders_are_checked_before_launching(capsys, no_launch, tmp_path):
    a_file = tmp_path / "ckpt.pt"
    a_file.write_text("")
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(a_file))
    assert "is a file" in line and "valid: a folder path" in line
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(tmp_path / "none"), "--resume")
    assert f"no ampkit train --nproc checkpoint at {str(tmp_path / 'none')!r}" in line
    # A checkpoint of 2 ranks, or of another learning rate, is refused before launching.
    folder = _two_rank_record(tmp_path)
    assert read_meta(str(folder))["nproc"] == 2
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(folder), "--resume")
    assert "written by 2 ranks" in line and "valid: --nproc 2" in line
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(folder), "--resume",
                        "--lr", "0.01")
    assert "lr=0.001" in line and "lr=0.01" in line


def test_a_refused_resume_prints_nothing_and_a_dcp_folder_is_named_without_nproc(
        capsys, no_launch, tmp_path):
    """A refused --resume printed the run's header first ("..., 1 ranks (DDP, gloo)"), as
    if it had started; without --nproc a train --nproc folder was refused as a file path
    that "cannot be written (it is a folder)"."""
    folder = _two_rank_record(tmp_path)
    assert main([*RUN, "--nproc", "1", "--checkpoint", str(folder), "--resume"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "written by 2 ranks" in captured.err
    line = _usage_error(capsys, "--checkpoint", str(folder), "--resume")
    assert "is a checkpoint folder of ampkit train --nproc" in line and "valid: --nproc 2" in line


def test_each_ranks_threads_are_asked_for_capped_or_the_checkpoints(capsys, no_launch,
                                                                   tmp_path):
    """--threads with --nproc was refused, where bench --nproc takes it as each rank's cap;
    and a resume ran on the share of the cores of the machine it ran on, which rounds a
    CPU's sums differently from the checkpoint's where the two differ (not exact)."""
    from ampkit.bench.errors import UsageError
    from ampkit.bench.parallel import Parallel, ParallelPlan
    from ampkit.bench.train_parallel import rank_threads

    plan = ParallelPlan(2, Parallel.DDP, "gloo", 3)
    assert rank_threads(None, plan, None) == (
        3, "3: each rank's share of the usable cores (3 for 2 ranks)")
    assert rank_threads(2, plan, None) == (2, "2, as asked (--threads)")
    assert rank_threads(8, plan, None) == (
        3, "3: --threads 8 capped at each rank's share of the usable cores (3 for 2 ranks)")
    assert rank_threads(None, plan, {"nproc": 2}) == rank_threads(None, plan, None)  # older
    assert rank_threads(None, plan, {"threads": 5}) == (
        5, "5, the checkpoint's (a resume continues on the same threads; more than this "
        "machine's share of 3, so slower)")
    assert rank_threads(None, plan, {"threads": 2})[1] == (
        "2, the checkpoint's (a resume continues on the same threads)")
    assert rank_threads(5, plan, {"threads": 5})[0] == 5
    # The command that wrote it, again: its --threads 8 was capped at 3, which it records;
    # on a machine whose share is smaller now too (review).
    assert rank_threads(8, plan, {"threads": 3})[0] == 3
    assert rank_threads(8, ParallelPlan(2, Parallel.DDP, "gloo", 2), {"threads": 3})[0] == 3
    with pytest.raises(UsageError, match=r"--threads 2: the checkpoint's ranks ran on 5 "
                       r"thread\(s\) each.*valid: --threads 5 or more"):
        rank_threads(2, plan, {"threads": 5})
    for bad in (True, 0, "2"):
        with pytest.raises(UsageError, match=f"'threads' entry is {bad!r}; valid: an int >= 1"):
            rank_threads(None, plan, {"threads": bad})
    # Through the command: refused before launching, nothing printed on stdout.
    folder = _two_rank_record(tmp_path, nproc=1, threads=2)
    assert main([*RUN, "--nproc", "1", "--checkpoint", str(folder), "--resume",
                 "--threads", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--threads 1: the checkpoint's ranks ran on 2" in captured.err
    assert "valid: --threads 2 or more" in captured.err


# --- two ranks -----------------------------------------------------------------------------------
def _train(tmp_path: Path, name: str, *argv: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main([*RUN, "--nproc", "2", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def _losses(log: dict) -> list[float]:
    return [e["train_loss"] for e in log["epochs"]]


@pytest.mark.slow
@needs_two_cores
def test_two_ranks_save_and_resume_bitwise(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    saved = _train(tmp_path, "saved", "--epochs", "2", "--checkpoint", ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "saved.json"]  # no .tmp left
    assert len(read_meta(ckpt)["history"]) == 2
    assert saved["nproc"] == 2 and saved["backend"] == "gloo" and len(saved["epochs"]) == 2
    share = max(1, usable_cores() // 2)  # each rank's share of the cores: its threads
    assert read_meta(ckpt)["threads"] == saved["threads"] == share
    assert saved["threads_reason"].startswith(f"{share}: each rank's share of the usable cores")
    out = capsys.readouterr().out
    assert "2 ranks (DDP, gloo)" in out and "epoch   2/2  train loss" in out
    resumed = _train(tmp_path, "resumed", "--epochs", "3", "--checkpoint", ckpt, "--resume")
    assert resumed["resumed_from_epoch"] == 2
    assert resumed["threads_reason"] == f"{share}, the checkpoint's (a resume continues on " \
        "the same threads)"
    lines = capsys.readouterr().out.splitlines()  # said before the epochs, not after them
    assert lines[1:3] == ["resumed after epoch 2 of the checkpoint", lines[2]]
    assert lines[2].startswith("epoch   3/3  train loss")
    unbroken = _train(tmp_path, "unbroken", "--epochs", "3")
    assert _losses(resumed) == _losses(unbroken)  # bitwise: floats compare exactly
    assert resumed["final"]["test_loss"] == unbroken["final"]["test_loss"]
    # A damaged checkpoint (rank 1's shard gone) is refused with one line, exit 2; it was
    # exit 1 with rank 1's whole remote traceback on one line.
    capsys.readouterr()
    (Path(ckpt) / "__1_0.distcp").unlink()
    left = sorted(p.name for p in Path(ckpt).iterdir())
    error = _usage_error(capsys, "--nproc", "2", "--epochs", "4", "--checkpoint", ckpt, "--resume")
    assert "is corrupted: '__1_0.distcp' is missing" in error  # before launching the ranks
    assert sorted(p.name for p in Path(ckpt).iterdir()) == left


@pytest.mark.slow
@needs_two_cores
def test_a_dead_rank_is_named_and_leaves_the_last_checkpoint_whole(tmp_path, capsys, monkeypatch):
    (tmp_path / "dying_model.py").write_text(textwrap.dedent(_DYING_MODEL))
    monkeypatch.chdir(tmp_path)  # the ranks import the model from the current folder
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = str(tmp_path / "ckpt")
    argv = ["train", "--model", "dying_model:make", "--data", "synthetic", "--quiet",
            "--nproc", "2", "--epochs", "3", "--batch-size", "64", "--checkpoint", ckpt]
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["ampkit: rank 1 died: killed by SIGKILL"] or (
        len(lines) == 1 and "rank 1 died" in lines[0]), lines
    assert len(read_meta(ckpt)["history"]) == 1  # epoch 1's checkpoint, whole


_FAILING_IN_RANKS = """\
    import os
    import time

    import torch


    def make():
        if os.environ.get("RANK") == "1":  # rank 1 only: the parent's checks, rank 0 pass
            time.sleep(3)  # rank 0 is ready long before
            raise ValueError("no weights for this rank")
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
"""


@pytest.mark.slow
@needs_two_cores
def test_an_error_inside_the_ranks_before_training_prints_no_header(tmp_path, capsys,
                                                                      monkeypatch):
    """The header ("ampkit train: ... 2 ranks (DDP, gloo)") was printed before the ranks
    launched, so a model a rank could not build printed a run that never started; it
    now comes once every rank has its data, model and checkpoint."""
    (tmp_path / "rank_model.py").write_text(textwrap.dedent(_FAILING_IN_RANKS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["train", "--model", "rank_model:make", "--data", "synthetic", "--quiet",
            "--nproc", "2", "--epochs", "1", "--batch-size", "64"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    lines = captured.err.strip().splitlines()
    assert lines == ["ampkit train: error: model 'rank_model:make': calling it raised "
                     "ValueError: no weights for this rank (rank 1)"], lines


def test_fp8_histories_written_for_every_rank_at_once_are_told_apart(tmp_path):
    """Checkpoints written while DDP gave every rank rank 0's histories hold them once
    ("fp8."); now each rank's are its own ("fp8.rankN."): a resume reads either."""
    import torch.distributed.checkpoint as dcp

    from ampkit.bench.train_parallel import _shared_fp8_histories

    history = {"0": {"amax_history_input": torch.ones(4)}}
    dcp.save({"fp8": history}, checkpoint_id=str(tmp_path / "old"))
    dcp.save({"fp8.rank0": history, "fp8.rank1": history}, checkpoint_id=str(tmp_path / "new"))
    assert _shared_fp8_histories(str(tmp_path / "old"))
    assert not _shared_fp8_histories(str(tmp_path / "new"))
    assert not _shared_fp8_histories(str(tmp_path / "none"))


@pytest.mark.parametrize("where", ["", ".old", ".tmp"])
def test_a_folder_of_the_users_is_never_replaced_by_a_checkpoint(capsys, no_launch, tmp_path,
                                                                 where):
    """A new run moved --checkpoint's folder aside and deleted it (and PATH.old, PATH.tmp):
    `--checkpoint .` wiped the user's working folder."""
    target = tmp_path / "run"
    (tmp_path / f"run{where}").mkdir()
    mine = tmp_path / f"run{where}" / "train_mine.py"
    mine.write_text("code")
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(target))
    assert "holds 'train_mine.py'" in line and "valid: a new or empty folder" in line
    assert mine.read_text() == "code"


def test_an_empty_folder_or_a_checkpoint_folder_may_be_written(capsys, no_launch, tmp_path):
    from ampkit.bench.dcp_folder import check_checkpoint_dir

    (tmp_path / "empty").mkdir()
    check_checkpoint_dir(str(tmp_path / "empty"), resume=False)
    folder = _two_rank_record(tmp_path)  # a run record and DCP's files
    (folder / ".metadata").write_bytes(b"")
    (folder / "__0_0.distcp").write_bytes(b"")
    check_checkpoint_dir(str(folder), resume=False)


def test_another_programs_dcp_checkpoint_is_not_replaced(capsys, no_launch, tmp_path):
    """docs/distributed.md saved its FSDP example to /tmp/ckpt, then ran train --nproc
    with --checkpoint /tmp/ckpt: the example's checkpoint was replaced."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"x")
    (folder / "__0_0.distcp").write_bytes(b"x")
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(folder))
    assert "holds '.metadata'" in line and "not part of a checkpoint of ampkit train" in line
    from ampkit.bench.dcp_folder import check_checkpoint_dir, remove_checkpoint

    # What a save killed before its record leaves at PATH.tmp: ampkit's scratch, removed.
    (tmp_path / "run.tmp").mkdir()
    (tmp_path / "run.tmp" / "__0_0.distcp").write_bytes(b"x")
    check_checkpoint_dir(str(tmp_path / "run"), resume=False)
    # PATH.old without a record is another program's: its record goes last when ampkit
    # removes its own (a kill midway leaves the record), so the run refuses it.
    (tmp_path / "run.old").mkdir()
    (tmp_path / "run.old" / "__0_0.distcp").write_bytes(b"x")
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(tmp_path / "run"))
    assert "run.old' holds '__0_0.distcp'" in line and "would remove that folder" in line
    (tmp_path / "run.old" / META).write_text("{}")
    check_checkpoint_dir(str(tmp_path / "run"), resume=False)
    removed = []
    real_remove = os.remove
    with mock.patch("os.remove", side_effect=lambda p: removed.append(os.path.basename(p))
                    or real_remove(p)):
        remove_checkpoint(str(tmp_path / "run.old"))
    assert removed == ["__0_0.distcp"] and not (tmp_path / "run.old").exists()


def test_a_linked_checkpoint_folder_is_named_as_a_link(capsys, no_launch, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real")
    line = _usage_error(capsys, "--nproc", "1", "--checkpoint", str(tmp_path / "run"))
    assert f"{str(tmp_path / 'run')!r} is a link" in line and "valid: a real folder path" in line
