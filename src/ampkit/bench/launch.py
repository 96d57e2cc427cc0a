"""Launching N ranks under torchrun and hearing back from them: ``bench --nproc`` and
``train --nproc`` share it.

The parent runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m
MODULE JOB`` in its own session (a Ctrl-C reaches the parent alone, which stops torchrun,
and torchrun its ranks), with the cores shared out as threads and this very ampkit on the
ranks' path. Each rank runs :func:`rank_main`: a rank that raises writes its error to a
file before it exits, and rank 0 writes the result whole (a temporary file, then a
rename). A failed run becomes one ``RankError`` naming the rank that failed first, from
its file, or from torchrun's report when the rank died without Python's help.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from .errors import UsageError

__all__ = ["RankError", "launch_ranks", "rank_main", "usable_cores", "write_rank_error"]

logger = logging.getLogger("ampkit")

_ERROR = "error-rank{}.json"
_DONE = "done-rank{}"  # a rank's work is over (its part written, its group destroyed)
# What a rank's collective raises when another rank has gone (gloo, NCCL): a consequence.
_PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted|Socket Timeout", re.IGNORECASE)


class RankError(RuntimeError):
    """A rank of a multi-process run failed; the message names it and its error."""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def launch_ranks(module: str, job: str, nproc: int, threads: int, folder: str, result: str,
                 poll: Optional[Callable[[], None]] = None) -> None:
    """``python -m module JOB`` on N ranks under torchrun, until it ends.

    Args:
        module: the ranks' entry point; a rank that fails calls :func:`write_rank_error`
            with ``folder`` before it exits. result: the file rank 0 writes at the end.
        poll: called about twice a second while the ranks run (the parent showing progress).

    Raises:
        RankError: torchrun failed or ``result`` is missing; names the rank that failed first.
    """
    status, log = _launch(module, job, nproc, threads, folder, poll)
    finished = os.path.exists(result) and all(
        os.path.exists(os.path.join(folder, _DONE.format(rank))) for rank in range(nproc))
    if status != 0 and finished:
        # Every rank finished its work and rank 0 wrote the result; a crash while a
        # process exits (a C++ thread torn down with the interpreter: "terminate called
        # without an active exception") changes nothing that was measured or saved.
        message, _ = _failure(folder, log, status)
        logger.warning("ampkit: every rank finished and wrote its part; then, at exit, %s "
                       "(ignored)", message)
        return
    if status != 0 or not os.path.exists(result):
        if os.environ.get("AMPKIT_DEBUG"):
            sys.stderr.write(log)
        message, usage = _failure(folder, log, status)
        raise (UsageError if usage else RankError)(message)


def _launch(module: str, job: str, nproc: int, threads: int, folder: str,
            poll: Optional[Callable[[], None]]) -> tuple[int, str]:
    """torchrun with N ranks; its exit status and everything it and the ranks printed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", module, job]
    env = _rank_env(threads)
    with open(os.path.join(folder, "torchrun.log"), "w+") as log:
        # Its own session, so a Ctrl-C reaches this process alone, which then stops
        # torchrun, and torchrun its ranks.
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        try:
            status = _wait(child, poll)
        except BaseException:
            _stop(child)
            raise
        log.seek(0)
        return status, log.read()


def _wait(child: subprocess.Popen, poll: Optional[Callable[[], None]]) -> int:
    if poll is None:
        return child.wait()
    while True:
        try:
            status = child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            poll()
            continue
        poll()
        return status


def _stop(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGTERM)  # torchrun forwards it to the ranks
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _rank_env(threads: int) -> dict[str, str]:
    # The ranks must import this very ampkit (however the parent found it), and a user
    # model "package.module:function" from the current folder.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    paths = [package_root, os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["OMP_NUM_THREADS"] = str(threads)  # torchrun would set 1 and warn about it
    return env


def _failure(folder: str, log: str, status: int) -> tuple[str, bool]:
    """One line: the rank that failed first and its error, from its file or torchrun's log;
    and whether that error was a UsageError (bad input: the parent exits 2 with it)."""
    errors = []
    for name in os.listdir(folder):
        if name.startswith("error-rank"):
            with open(os.path.join(folder, name)) as src:
                errors.append(json.load(src))
    # A rank that died without Python's help (a signal, os._exit, the OOM killer) leaves no
    # file, while the ranks it left behind fail in their next collective ("Connection reset
    # by peer") and do leave one. Where torchrun saw that death first (its Root Cause) and
    # every error file is such a consequence, it is the cause; a death after another rank's
    # own error (a watchdog's abort: torchrun's timestamps are whole seconds, so a tie goes
    # to whichever rank it checked first) or torchrun's SIGTERM to the ranks left is not.
    failures = _torchrun_failures(log)
    written = {int(error["rank"]) for error in errors}
    consequences = all(_PEER_GONE.search(error["error"]) for error in errors)
    if (failures and failures[0][0] not in written and failures[0][1] != -signal.SIGTERM
            and consequences):
        rank, code = failures[0]
        return f"rank {rank} died: {_exit_reason(code)}", False
    if errors:
        first = min(errors, key=lambda e: e["time"])  # the others failed because it did
        if first.get("usage"):
            return f"{first['message']} (rank {first['rank']})", True
        return f"rank {first['rank']} failed: {first['error']}", False
    if failures:
        rank, code = failures[0]
        return f"rank {rank} died: {_exit_reason(code)}", False
    last = (log.strip().splitlines() or ["no output"])[-1]
    return f"torchrun exited with status {status}: {' '.join(last.split())}", False


def _torchrun_failures(log: str) -> list[tuple[int, int]]:
    """(rank, exit code) of each failed rank in torchrun's report, its "Root Cause" (the
    first failure it observed) first."""
    failures = re.findall(r"\brank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)",
                          log[log.find("Failures:"):] if "Failures:" in log else "", re.DOTALL)
    root = log.find("Root Cause")
    ranked = [(int(rank), int(code)) for rank, code in failures]
    if root >= 0:
        cause = re.search(r"\brank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log[root:], re.DOTALL)
        if cause:
            first = (int(cause.group(1)), int(cause.group(2)))
            ranked = [first] + [f for f in ranked if f != first]
    return ranked


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def rank_main(job_path: str, run: Callable[[dict[str, Any], int], Any], result_name: str) -> int:
    """A rank's whole life under torchrun: read the job, ``run(job, rank)``, and report.

    A rank that raises leaves its error for the parent (``write_rank_error``), which names
    it on one line; rank 0 writes what ``run`` returned as ``result_name`` in the job's
    folder, never half-written.
    """
    with open(job_path) as src:
        job = json.load(src)
    rank = int(os.environ["RANK"])
    try:
        result = run(job, rank)
    except BaseException as err:
        write_rank_error(job["folder"], rank, err)
        raise
    if rank == 0:
        tmp = os.path.join(job["folder"], result_name + ".tmp")
        with open(tmp, "w") as out:
            json.dump(result, out)
        os.replace(tmp, os.path.join(job["folder"], result_name))
    with open(os.path.join(job["folder"], _DONE.format(rank)), "w"):
        pass  # finished: what follows is the process's exit alone
    return 0


def exit_rank(code: int) -> None:
    """End a rank that has finished (its result and done marker written) without the
    interpreter's teardown: there a C++ thread of torch's was sometimes destroyed while
    still joinable ("terminate called without an active exception", SIGABRT; torch 2.11's
    CUDA build on a CPU, 3 runs in 5), and torchrun then killed rank 0 before it wrote the
    result. Nothing of the rank's is left to tear down: its process group is destroyed,
    its files are closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def write_rank_error(folder: str, rank: int, err: BaseException) -> None:
    """Record a rank's error in ``folder``, for the parent's one line naming the rank."""
    message = " ".join(str(err).split())
    text = f"{type(err).__name__}: {message}" if message else type(err).__name__
    with open(os.path.join(folder, _ERROR.format(rank)), "w") as out:
        json.dump({"rank": rank, "error": text, "time": time.time(), "message": message,
                   "usage": isinstance(err, UsageError)}, out)
