"""ampkit train checkpoints: stale temp files, corrupted bytes, inconsistent content.

One tiny 1-epoch run writes the checkpoint; each test damages a copy of it and resumes
through the command (exit 2 with one line) or through ``train``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ampkit.bench.train import TrainSettings, train
from ampkit.cli import main

SETTINGS = TrainSettings(data="synthetic", policy="32-true", epochs=1, batch_size=256)
RESUME = ["train", "--data", "synthetic", "--policy", "32-true", "--batch-size", "256",
          "--epochs", "2", "--quiet", "--resume", "--checkpoint"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("written") / "run.pt"
    train(SETTINGS, checkpoint=str(path))
    return path


@pytest.fixture
def ckpt(tmp_path: Path, written: Path) -> Path:
    return Path(shutil.copy(written, tmp_path / "run.pt"))


def resume_error(capsys: pytest.CaptureFixture, path: Path) -> str:
    """Resume through the command; assert exit 2 with one stderr line; return it."""
    assert main([*RESUME, str(path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("resume", [False, True])
def test_save_and_resume_remove_stale_temp_files_of_that_checkpoint_only(tmp_path, ckpt, resume):
    dead = _dead_pid()
    stale = tmp_path / f"run.pt.tmp{dead}"
    kept = [tmp_path / f"run.pt.tmp{os.getppid()}",  # its writer still runs
            tmp_path / f"other.pt.tmp{dead}", tmp_path / f"run.pt.tmp{dead}.bak"]
    for path in (stale, *kept):
        path.write_bytes(b"half a checkpoint")
    if resume:  # the checkpoint has epoch 1 already: nothing is trained or saved
        train(SETTINGS, checkpoint=str(ckpt), resume=True)
    else:
        train(SETTINGS, checkpoint=str(ckpt))
    assert not stale.exists()
    assert all(path.exists() for path in kept)
