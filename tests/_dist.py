"""Helpers for tests that spawn gloo processes on 127.0.0.1 (not a test module)."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Callable

import pytest
import torch.multiprocessing as mp


def free_ports(count: int) -> list[int]:
    """Ports free now, all bound at once so that they differ."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def spawn(fn: Callable, args: tuple, nprocs: int, timeout_s: float) -> None:
    """mp.spawn with a deadline: a hung collective fails the test instead of the suite.

    ``fn(rank, *args)`` runs in each of ``nprocs`` fresh processes; a worker that raises
    fails the test with its traceback.
    """
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):  # raises if a worker failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} workers did not finish within {timeout_s:.0f} s")
