"""Each policy in a process of its own, stepped round by round by the parent.

``ampkit bench`` on a CPU measures each policy's peak RSS in a process of its own while
the policies take turns. One process (``python -m ampkit.bench.worker JOB``) imports
torch and ampkit once and forks a worker per policy, so N policies cost one import, not
N. The parent talks to each worker over two pipes, one line per message. Commands:
``warmup``, ``run N`` (N timed steps), ``finish``. Answers: ``ready``, ``warm``,
``times [ms, ...]``, ``result {...}``, or ``error MESSAGE`` for a bad setting (the
parent raises it as a UsageError). Only one worker computes at a time; the others block
on their pipe and take no CPU. A worker's stdout and stderr go to a file of its own,
whose last line names what went wrong when it dies.

The fork happens before anything is computed (no OpenMP thread pool, no CUDA context
exists yet), which is what makes it safe; without ``os.fork`` (Windows) the policies run
in the parent's process instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict
from typing import IO, Any, Optional

import torch

from .. import _torch_compat
from .errors import UsageError
from .policies import PolicySpec, parse_policy
from .runner import BenchSettings, PolicyRun

CAN_FORK = hasattr(os, "fork")
_ANSWERS = {"warmup": "warm", "run": "times", "finish": "result"}
_SETTLE_S = 120  # the longest an interrupted parent waits for an owed answer (one round)
_EXIT_WAIT_S = 30  # the forking process exits once its workers have


def _child_env() -> dict[str, str]:
    # The child must import this very ampkit, however the parent found it.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    paths = [package_root, os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class Worker:
    """The parent's handle on one policy's process; it stands in for a ``PolicyRun``."""

    def __init__(self, label: str, commands: int, answers: int, log: IO[str],
                 fallback: IO[str]) -> None:
        self.label = label
        self.round_ms: list[float] = []
        self._pending: Optional[str] = None  # the answer a command sent is still owed
        self._commands = os.fdopen(commands, "w")
        self._answers = os.fdopen(answers, "r")
        self._log, self._fallback = log, fallback

    def ready(self) -> None:
        self._expect("ready")

    def warm_up(self) -> None:
        self._send("warmup")
        self._expect("warm")

    def run(self, steps: int) -> list[float]:
        self._send(f"run {steps}")
        times = json.loads(self._expect("times"))
        self.round_ms.append(statistics.median(times))
        return times

    def finish(self) -> dict[str, Any]:
        self.settle()
        self._send("finish")
        result = json.loads(self._expect("result"))
        result["memory_method"] += ", in a process of its own per policy"
        return result

    def settle(self) -> None:
        """Read the answer still owed when an interrupt stopped the parent waiting for it:
        the worker, in a session of its own, did not get the interrupt and finished the
        command. Its round counts in the worker's result, as every round it completed."""
        if self._pending is None:
            return
        # Owed, unless the interrupt came between the write and the bookkeeping around it
        # (a few bytecodes): a bounded wait, then the worker counts as failed.
        ready, _, _ = select.select([self._answers], [], [], _SETTLE_S)
        if not ready:
            self._pending = None
            self._fail()
        self._expect(self._pending)

    def close(self) -> None:
        for stream in (self._commands, self._answers, self._log):
            with contextlib.suppress(OSError):
                stream.close()

    def _send(self, command: str) -> None:
        self._pending = _ANSWERS[command.partition(" ")[0]]  # before: the write may finish
        try:
            self._commands.write(command + "\n")
            self._commands.flush()
        except OSError:
            self._fail()

    def _expect(self, kind: str) -> str:
        line = self._answers.readline()
        self._pending = None
        got, _, payload = line.rstrip("\n").partition(" ")
        if got == "error":
            raise UsageError(payload.strip())
        if got != kind:
            self._fail()
        return payload

    def _fail(self) -> Any:
        last = _last_line(self._log) or _last_line(self._fallback) or "it exited"
        raise RuntimeError(f"policy {self.label!r} failed in its own process: {last}")


def _last_line(log: IO[str]) -> Optional[str]:
    with contextlib.suppress(OSError, ValueError):
        log.seek(0)
        lines = log.read().strip().splitlines()
        return lines[-1] if lines else None
    return None


def start_workers(specs: list[PolicySpec], settings: BenchSettings,
                  stack: contextlib.ExitStack) -> list[Worker]:
    """A worker per policy (forked from one process); returns once each has built its model."""
    fallback: IO[str] = stack.enter_context(tempfile.TemporaryFile("w+"))
    jobs, workers, theirs = [], [], []
    for spec in specs:
        commands, answers, log = os.pipe(), os.pipe(), tempfile.TemporaryFile("w+")
        jobs.append({"policy": spec.label, "commands": commands[0], "answers": answers[1],
                     "log": log.fileno()})
        workers.append(Worker(spec.label, commands[1], answers[0], log, fallback))
        stack.callback(workers[-1].close)
        theirs += [commands[0], answers[1], log.fileno()]
    job = json.dumps({"settings": asdict(settings), "workers": jobs})
    # Its own session: an interrupt here does not reach the workers half-way through a
    # message; the parent stops the whole group instead.
    forker = subprocess.Popen([sys.executable, "-m", "ampkit.bench.worker", job],
                              pass_fds=theirs, stdin=subprocess.DEVNULL, stdout=fallback,
                              stderr=fallback, env=_child_env(), start_new_session=True)
    stack.callback(_stop, forker)
    for fd in theirs[::3] + theirs[1::3]:  # the workers' ends of the pipes
        os.close(fd)
    for worker in workers:
        worker.ready()
    return workers


def _stop(forker: subprocess.Popen) -> None:
    try:
        forker.wait(timeout=_EXIT_WAIT_S if forker.poll() is None else None)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(forker.pid, signal.SIGKILL)  # workers left behind by an error or interrupt
    forker.wait()


# --- the worker side -----------------------------------------------------------------------------
def _fork_all(job: dict[str, Any]) -> int:
    """Fork a worker per policy (nothing computed yet: safe to fork) and wait for them."""
    # Imported once here, not once per worker: every optimizer's constructor imports
    # dynamo (seconds) through torch's disable-dynamo decorator.
    _torch_compat.import_dynamo()
    pids = []
    for mine in job["workers"]:
        pid = os.fork()
        if pid == 0:
            _worker_process(mine, job)
        pids.append(pid)
    for entry in job["workers"]:
        for key in ("commands", "answers", "log"):
            os.close(entry[key])
    for pid in pids:
        os.waitpid(pid, 0)
    return 0


def _worker_process(mine: dict[str, Any], job: dict[str, Any]) -> None:
    code = 1
    try:
        for entry in job["workers"]:
            for key in ("commands", "answers", "log"):
                if entry is not mine:
                    os.close(entry[key])
        os.dup2(mine["log"], 1)
        os.dup2(mine["log"], 2)
        code = serve(mine["policy"], job["settings"], os.fdopen(mine["commands"], "r"),
                     os.fdopen(mine["answers"], "w"))
    except BaseException:  # noqa: BLE001 - its log's last line is the parent's message
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: it takes seconds and does nothing here


def serve(label: str, settings_dict: dict[str, Any], commands: IO[str], answers: IO[str]) -> int:
    """Build the policy's run, say ready, then obey the commands until ``finish``."""
    def say(kind: str, payload: str = "") -> None:
        answers.write(f"{kind} {payload}".rstrip() + "\n")
        answers.flush()

    try:
        settings = BenchSettings(**settings_dict)
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        run = PolicyRun(parse_policy(label, torch.device(settings.device).type), settings)
        say("ready")
        for line in commands:
            command, _, arg = line.strip().partition(" ")
            if command == "warmup":
                run.warm_up()
                say("warm")
            elif command == "run":
                say("times", json.dumps(run.run(int(arg))))
            elif command == "finish":
                say("result", json.dumps(run.finish()))
                return 0
    except UsageError as err:
        say("error", " ".join(str(err).split()))
        return 2
    return 1  # the parent went away


if __name__ == "__main__":
    sys.exit(_fork_all(json.loads(sys.argv[1])))
