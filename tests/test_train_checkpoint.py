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

from ampkit.bench.train import TrainSettings, load_checkpoint, save_checkpoint, train
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


def test_a_resumed_run_says_where_it_continues_before_its_epochs(capsys, ckpt):
    """"resumed after epoch 1" came after the epochs trained, in the closing summary."""
    assert main([*RESUME, str(ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ampkit train: mlp on synthetic with 32-true")
    assert lines[1] == "resumed after epoch 1 of the checkpoint"
    assert lines[2].startswith("epoch   2/2  train loss") and lines[3].startswith("final: epoch 2")
    assert len(lines) == 4


@pytest.mark.skipif(os.name != "posix", reason="stale means its writer is gone: a POSIX check")
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


def test_flipped_bytes_in_the_tensor_data_are_refused(capsys, ckpt):
    data = bytearray(ckpt.read_bytes())
    middle = len(data) // 2  # inside the tensor data, which is most of the file
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    ckpt.write_bytes(bytes(data))
    torch.load(ckpt, weights_only=True)  # torch reads it without a complaint
    line = resume_error(capsys, ckpt)
    assert f"checkpoint {str(ckpt)!r} is corrupted" in line and "sha256" in line


def test_a_checkpoint_without_a_digest_is_refused(capsys, ckpt):
    state = load_checkpoint(str(ckpt))
    torch.save(dict(state, format="ampkit-train-1"), ckpt)  # as ampkit wrote it before digests
    line = resume_error(capsys, ckpt)
    assert "has no sha256 digest (format 'ampkit-train-1', written by an earlier ampkit)" in line
    assert "valid: a checkpoint in format 'ampkit-train-2'" in line


@pytest.mark.parametrize("content, words", [
    ([1, 2], "is not an ampkit train checkpoint (format 'list')"),
    ({"format": "ampkit-train-2", "sha256": "0" * 64}, "is corrupted"),  # no payload
])
def test_a_foreign_file_is_refused(capsys, tmp_path, content, words):
    path = tmp_path / "other.pt"
    torch.save(content, path)
    assert words in resume_error(capsys, path)


def _set(section: str, key: object, value: object):
    return lambda state: state[section].__setitem__(key, value)


@pytest.mark.parametrize("damage, words", [
    pytest.param(lambda state: state.pop("scaler"),
                 ["its 'scaler' entry is missing; valid: dict"], id="no scaler"),
    pytest.param(lambda state: state.__setitem__("history", 3),
                 ["its 'history' entry has type int; valid: list"], id="history not a list"),
    pytest.param(lambda state: state["model"].pop("3.weight"),
                 ["its model state lacks ['3.weight']", "valid: the state of this --model"],
                 id="model key missing"),
    pytest.param(_set("model", "7.weight", torch.zeros(2)),
                 ["its model state has unexpected keys ['7.weight']"], id="another model"),
    pytest.param(_set("model", "1.weight", torch.zeros(128, 32)),
                 ["its model state '1.weight' has shape (128, 32); valid: shape (128, 64)"],
                 id="wrong shape"),
    pytest.param(_set("fp8", "1", {}),
                 ["its 'fp8' entry does not fit this run", "fp8 state has modules ['1']"],
                 id="another policy's fp8 state"),
    pytest.param(lambda state: state["optimizer"].pop("state"),
                 ["its 'optimizer' entry does not fit this run (KeyError: 'state')"],
                 id="optimizer key missing"),
    pytest.param(lambda state: state["optimizer"]["param_groups"][0].__setitem__("params", [0]),
                 ["its 'optimizer' entry does not fit this run (ValueError:"],
                 id="another model's optimizer"),
])
def test_an_inconsistent_checkpoint_is_refused_with_one_line(capsys, ckpt, damage, words):
    state = load_checkpoint(str(ckpt))
    damage(state)
    save_checkpoint(state, str(ckpt))
    line = resume_error(capsys, ckpt)
    assert line.startswith(f"ampkit train: error: --resume: checkpoint {str(ckpt)!r}: ")
    for word in words:
        assert word in line, (word, line)


def test_a_model_with_dropout_resumes_bitwise(tmp_path, monkeypatch):
    """The one-process checkpoint held no random-number state: a resumed run with
    Dropout drew other masks than the run that never stopped."""
    (tmp_path / "dropmodels.py").write_text(
        "from torch import nn\n"
        "def drop():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3),\n"
        "                         nn.Linear(32, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = TrainSettings(data="synthetic", model="dropmodels:drop", policy="32-true",
                             epochs=2, batch_size=256)
    straight = train(settings)
    path = str(tmp_path / "d.pt")
    train(TrainSettings(**{**settings.__dict__, "epochs": 1}), checkpoint=path)
    torch.manual_seed(1234)  # whatever the process did in between
    resumed = train(settings, checkpoint=path, resume=True)
    def measured(record):
        return {k: v for k, v in record.items() if k != "time_s"}
    assert measured(resumed["epochs"][1]) == measured(straight["epochs"][1])
    assert resumed["epochs"][1]["train_loss"] == straight["epochs"][1]["train_loss"]


def test_a_strided_payload_is_refused_not_a_crash(capsys, tmp_path, ckpt):
    """A flipped bit in the zip header made the payload strided: hashing it raised
    ValueError (exit 1) instead of the refusal."""
    record = torch.load(ckpt, weights_only=False)
    payload = record["payload"]
    record["payload"] = torch.stack([payload, payload], dim=1)[:, 0]  # same bytes, strided
    torch.save(record, ckpt)
    assert "is corrupted" in resume_error(capsys, ckpt)


@pytest.mark.parametrize("text", ["", '{"format": "ampkit-tr'])
def test_a_damaged_run_record_of_an_nproc_checkpoint_is_refused(tmp_path, text):
    """A truncated or empty ampkit-train.json raised JSONDecodeError (exit 1)."""
    from ampkit.bench.errors import UsageError
    from ampkit.bench.dcp_folder import META, read_meta
    (tmp_path / META).write_text(text)
    with pytest.raises(UsageError, match=r"cannot be read \(JSONDecodeError: .*\), the checkpoint "
                                         r"is damaged; valid: an intact copy"):
        read_meta(str(tmp_path))


def test_a_file_of_the_users_is_never_overwritten_by_a_checkpoint(capsys, tmp_path, ckpt):
    """--checkpoint notes.txt replaced the user's file with a checkpoint, without a word."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    weights = tmp_path / "pretrained.pt"
    torch.save({"weight": torch.ones(2)}, weights)
    lookalike = tmp_path / "trainer.pt"  # a format name that only starts like ampkit's
    torch.save({"format": "ampkit-trainer-notes"}, lookalike)
    for path in (notes, weights, lookalike):
        assert main(RESUME[:-2] + ["--epochs", "1", "--checkpoint", str(path)]) == 2
        line = capsys.readouterr().err.strip()
        assert f"--checkpoint {str(path)!r} exists and is not a checkpoint of ampkit train" in line
    assert notes.read_text() == "mine" and torch.load(weights)["weight"].sum() == 2
    # A checkpoint of ampkit train is replaced, as a run that saves every epoch does.
    assert main(RESUME[:-2] + ["--epochs", "1", "--checkpoint", str(ckpt)]) == 0


def test_an_empty_checkpoint_file_says_so(capsys, tmp_path):
    """The reason was empty: "cannot read checkpoint 'ck.pt' (EOFError: )"."""
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    line = resume_error(capsys, empty)
    assert "(the file is empty); valid: the --checkpoint file of an earlier run" in line


def test_a_truncated_checkpoint_file_says_so(capsys, tmp_path, ckpt):
    """Cut short, it said "(OSError: [Errno 22] Invalid argument)" (or a zip reader's
    message), not that the file was truncated."""
    data = ckpt.read_bytes()
    for size in (len(data) - 10, len(data) // 2):
        cut = tmp_path / f"cut{size}.pt"
        cut.write_bytes(data[:size])
        line = resume_error(capsys, cut)
        assert "(not a whole torch file: truncated or damaged; " in line, line


def test_another_name_of_the_same_policy_resumes_and_another_policy_is_refused(capsys, ckpt):
    """The policies were compared as strings: --policy fp32 could not resume a 32-true
    checkpoint (nor fp16-mixed a 16-mixed one)."""
    argv = [*RESUME, str(ckpt)]
    at = argv.index("32-true")
    assert main(argv[:at] + ["bf16-mixed"] + argv[at + 1:]) == 2
    line = capsys.readouterr().err.strip()
    assert "written with policy='32-true', this run has policy='bf16-mixed'" in line
    assert main(argv[:at] + ["fp32"] + argv[at + 1:]) == 0, capsys.readouterr().err


def test_a_policy_name_is_resolved_on_the_device_the_checkpoint_was_written_on():
    """"O2" written on CUDA is fp16: it was resolved on this run's CPU (bf16) and taken for
    O2-bf16."""
    from ampkit.bench.train import check_resume_settings
    from ampkit.bench.errors import UsageError
    saved = {**SETTINGS.__dict__, "policy": "O2", "device": "cuda"}
    settings = TrainSettings(**{**SETTINGS.__dict__, "policy": "O2-bf16"})
    with pytest.raises(UsageError, match="written with policy='O2', this run has policy='O2-bf16'"):
        check_resume_settings(saved, settings)
    check_resume_settings({**saved, "policy": "O2-fp16"}, TrainSettings(
        **{**SETTINGS.__dict__, "policy": "O2", "device": "cuda"}))  # the same on CUDA


def test_a_user_model_that_is_not_fp32_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """train stepped a .half() model under "bf16-mixed", reported loss nan and exited 0;
    bench refused the same model."""
    (tmp_path / "halfmodels.py").write_text(
        "from torch import nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).half()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--data", "synthetic", "--model", "halfmodels:make", "--epochs", "1",
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parameter '1.weight' is torch.float16" in err[0]
