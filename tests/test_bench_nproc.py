"""``ampkit bench --nproc N``: the command under torchrun, its JSON, a dead rank, bad values.

The default tests run the command in this process (its ranks are torchrun's processes),
which saves starting an interpreter; the slow ones run it as a user would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ampkit._torch_compat import TORCH_VERSION
from ampkit.bench.launch import usable_cores
from ampkit.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--steps", "2", "--warmup", "1", "--quiet"]
needs_two_cores = pytest.mark.skipif(usable_cores() < 2, reason="--nproc 2 needs 2 CPU cores")

# Rank 1 fails while building its model; the parent (no RANK) and rank 0 build it fine.
_DYING_MODEL = """\
    import os
    import signal

    import torch


    def make(batch_size=None):
        if os.environ.get("RANK") == "1":
            if os.environ.get("DIE_BY_SIGNAL"):
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank one is out of luck")
        n = batch_size or 8
        return torch.nn.Linear(4, 2), (torch.randn(n, 4), torch.randn(n, 2))
"""


def run_ampkit(*args: str, cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m ampkit.cli ARGS`` in its own session: a timeout kills torchrun's ranks too."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, "-m", "ampkit.cli", *args], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail(f"ampkit {' '.join(args)} did not finish within {timeout:.0f} s")
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt the body after ``seconds``: the command then stops torchrun and its ranks
    (its own Ctrl-C path) and returns 130, which fails the test instead of hanging it."""
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run_in_process(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """``ampkit ARGV`` in this process (no interpreter to start), with a deadline."""
    with deadline(180):
        status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@needs_two_cores
def test_two_ranks_report_global_throughput_and_scaling(tmp_path, capsys):
    path = tmp_path / "bench.json"
    status, out, err = run_in_process(capsys, "bench", "--model", "mlp", "--policies",
                                      "32-true,bf16-mixed", "--nproc", "2", "--json", str(path),
                                      *TINY)
    assert status == 0, err
    doc = json.loads(path.read_text())
    assert doc["nproc"] == 2 and doc["parallel"] == "ddp" and doc["backend"] == "gloo"
    result, half = doc["results"]
    assert result["samples_per_s"] > 0 and result["samples_per_s_1proc"] > 0
    # Per round: one-process round time / the slowest rank's (a median over rounds, with
    # an interval once there are enough of them).
    assert result["scaling_efficiency"] > 0 and "scaling_efficiency_ci" in result
    assert [r["rank"] for r in result["per_rank"]] == [0, 1]
    assert all(r["peak_mem_mib"] >= 0 and r["samples_per_s"] > 0 for r in result["per_rank"])
    # Every rank trains on the same batches, so DDP's averaged gradient is the one-process
    # gradient and the loss curves agree.
    assert result["loss_dev_vs_1proc"] == pytest.approx(0, abs=1e-6)
    assert "scaling efficiency" in out and "2 ranks (DDP, gloo" in out
    # Every policy shared one process per rank: no memory ratio is a finding ("O2: ...,
    # 0.01× its peak memory"), and the JSON says why there is none.
    assert [r["mem_ratio"] for r in doc["results"]] == [None, None]
    assert "not comparable" in half["mem_ratio_reason"]
    assert "its peak memory" not in out and "No memory ratios: every policy ran" in out
    # The sentences describe what the table shows: no interval from 1 round, no memory
    # ratio, and the settings the ranks ran (exactly --steps: no --max-time to raise).
    workload = next(line for line in out.splitlines() if line.startswith("Workload:"))
    assert workload.endswith("; speedup (the median of per-round ratios) relative to 32-true.")
    assert doc["settings"]["max_time"] == 0 and "more --steps (--nproc runs exactly" in out


@needs_two_cores
@pytest.mark.slow  # a second launch of two ranks; CI's slow run keeps it
def test_a_rank_that_fails_is_named_on_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "dying_on_rank1.py").write_text(textwrap.dedent(_DYING_MODEL))
    monkeypatch.chdir(tmp_path)  # where the command (and its ranks) find the model
    monkeypatch.delitem(sys.modules, "dying_on_rank1", raising=False)
    status, out, err = run_in_process(capsys, "bench", "--model", "dying_on_rank1:make",
                                      "--policies", "32-true", "--nproc", "2", *TINY)
    monkeypatch.delitem(sys.modules, "dying_on_rank1", raising=False)
    # The model function raising is bad input, as in one process: exit 2, naming the rank.
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "rank one is out of luck" in lines[0] and lines[0].endswith("(rank 1)")


def _torchrun_report(root: tuple[int, int], others: list[tuple[int, int]]) -> str:
    """torchrun's failure report (the layout of torch 2.5-2.13), root cause last."""
    def entry(i: int, rank: int, code: int) -> str:
        return (f"[{i}]:\n  time      : 2026-12-02_04:27:47\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 1)\n"
                f"  error_file: <N/A>\n")
    failures = "".join(entry(i + 1, *f) for i, f in enumerate(others)) or "  <NO_OTHER_FAILURES>\n"
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
            f"====\nampkit.bench.parallel FAILED\n----\nFailures:\n{failures}----\n"
            f"Root Cause (first observed failure):\n{entry(0, *root)}====\n")


@pytest.mark.parametrize("root, others, expected", [
    # rank 1 killed mid-training: rank 0's next collective fails (its error file), then
    # torchrun stops it. The error file is a consequence; rank 1 is the cause.
    ((1, -9), [(0, -15)], "rank 1 died: killed by SIGKILL"),
    # a rank aborted after another's error (NCCL's watchdog): the error is the cause
    ((0, 1), [(1, -6)], "rank 0 failed: RuntimeError: Connection reset by peer"),
    ((1, 3), [(0, 1)], "rank 1 died: exit status 3"),
    # a tie in torchrun's whole-second timestamps: rank 0 aborted as rank 1 raised its own
    # error, and torchrun named rank 0; the error, which is no consequence, is the cause
    ((0, -6), [(1, 1)], "rank 1 failed: ValueError: boom"),
    ((1, 1), [(0, -15)], "rank 0 failed: RuntimeError: Connection reset by peer"),
])
def test_a_rank_dying_mid_training_is_named_not_the_rank_its_death_broke(tmp_path, root,
                                                                           others, expected):
    """A rank killed once collectives had begun was reported as the surviving rank's
    'Connection reset by peer': any error file won over torchrun's report of a death."""
    from ampkit.bench import launch
    if root == (0, -6):  # rank 1's own error, no consequence of another rank's death
        launch.write_rank_error(str(tmp_path), 1, ValueError("boom"))
    else:
        launch.write_rank_error(str(tmp_path), 0, RuntimeError("Connection reset by peer"))
    if root == (1, 1):  # rank 1 raised too (it wrote its file), only later
        launch.write_rank_error(str(tmp_path), 1, ValueError("later"))
    message, usage = launch._failure(str(tmp_path), _torchrun_report(root, others), 1)
    assert (message, usage) == (expected, False)


@pytest.mark.slow
@needs_two_cores
def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    (tmp_path / "dying.py").write_text(textwrap.dedent(_DYING_MODEL))
    proc = run_ampkit("bench", "--model", "dying:make", "--policies", "32-true", "--nproc", "2",
                      *TINY, cwd=tmp_path, env={"DIE_BY_SIGNAL": "1"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 1 died: killed by SIGKILL" in lines[0], proc.stderr


@pytest.mark.slow
@needs_two_cores
@pytest.mark.skipif(TORCH_VERSION < (2, 6) and not torch.cuda.is_available(),
                    reason="FSDP2 on the CPU needs torch 2.6 or later")
def test_fsdp_ranks_shard_the_gpt(tmp_path):
    path = tmp_path / "bench.json"
    proc = run_ampkit("bench", "--model", "gpt", "--batch-size", "4", "--policies",
                      "32-true,bf16-mixed,O2,fp8", "--nproc", "2", "--parallel", "fsdp",
                      "--json", str(path), *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(path.read_text())
    assert doc["nproc"] == 2 and doc["parallel"] == "fsdp"
    assert [r["policy"] for r in doc["results"]] == ["32-true", "bf16-mixed", "O2", "fp8"]
    for result in doc["results"]:
        assert result["samples_per_s"] > 0 and result["scaling_efficiency"] > 0
        assert result["final_loss"] is not None


def _usage_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main(["bench", "--model", "mlp", "--quiet", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "0"], ["--nproc 0", "valid: 1 to"]),
    (["--nproc", "-3"], ["--nproc -3", "valid: 1 to"]),
    (["--nproc", str(usable_cores() + 1)], [f"--nproc {usable_cores() + 1}", "CPU cores"]),
    (["--parallel", "ddp"], ["--parallel ddp needs --nproc"]),
    (["--nproc", "1", "--parallel", "zero"], ["'zero'", "ddp", "fsdp"]),
    (["--nproc", "two"], ["'two'", "int"]),
    (["--nproc", "1", "--compile", "--warmup", "2"], ["--compile with --nproc"]),
    # It was ignored: each rank runs every policy in one process.
    (["--nproc", "1", "--isolate", "always"], ["--isolate always", "--nproc", "valid:"]),
])
def test_bad_values_exit_2_before_launching(capsys, monkeypatch, argv, words):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched torchrun for a bad value")
    monkeypatch.setattr(subprocess, "Popen", no_launch)
    line = _usage_error(capsys, *argv)
    for word in words:
        assert word in line, (word, line)


_ABORTING_RANK = """\
    import os
    import sys
    import time

    from ampkit.bench.launch import _DONE as DONE, rank_main

    def run(job, rank):
        if job["abort"] == "during" and rank == 1:
            os.abort()
        return {"rank": rank}

    if __name__ == "__main__":
        status = rank_main(sys.argv[1], run, "result.json")
        if int(os.environ["RANK"]) == 1:
            # At exit, once every rank has finished (rank 0's done marker is there): a
            # crash in the interpreter's teardown ("terminate called without an active
            # exception"), which ampkit's own ranks now skip (launch.exit_rank).
            folder = os.path.dirname(sys.argv[1])
            for _ in range(600):
                if os.path.exists(os.path.join(folder, DONE.format(0))):
                    break
                time.sleep(0.05)
            os.abort()
        sys.exit(status)
"""


@pytest.mark.slow  # two launches of two ranks
@needs_two_cores
def test_a_rank_crashing_at_exit_after_its_work_is_no_failure_but_before_it_is(
        tmp_path, monkeypatch, caplog):
    """A rank aborted while its process exited (a C++ thread torn down with the
    interpreter), after every rank had finished and rank 0 had written the result, failed
    the whole bench about one full suite in three: the work it measured was complete."""
    import logging
    from ampkit.bench import launch
    (tmp_path / "aborting_rank.py").write_text(textwrap.dedent(_ABORTING_RANK))
    monkeypatch.chdir(tmp_path)  # the ranks import the module from the current folder
    for when in ("at_exit", "during"):
        folder = tmp_path / when
        folder.mkdir()
        job = folder / "job.json"
        job.write_text(json.dumps({"folder": str(folder), "abort": when}))
        args = ("aborting_rank", str(job), 2, 1, str(folder), str(folder / "result.json"))
        if when == "at_exit":
            with caplog.at_level(logging.WARNING, logger="ampkit"):
                launch.launch_ranks(*args)
            assert json.loads((folder / "result.json").read_text()) == {"rank": 0}
            assert "every rank finished and wrote its part; then, at exit, rank 1 died: " \
                   "killed by SIGABRT (ignored)" in caplog.text
        else:
            with pytest.raises(launch.RankError, match=r"^rank 1 died: killed by SIGABRT$"):
                launch.launch_ranks(*args)
