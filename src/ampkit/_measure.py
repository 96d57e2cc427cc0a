"""The timing and memory harness (``ampkit bench``, ``ampkit train`` and benchmarks/), the
statistics its numbers get, and the state of the machine they were taken on.

Timing: per-step times from CUDA events on CUDA (one host sync, after a run of steps),
else ``time.perf_counter``. Memory: the peak a run's own allocations reach, tracked over
the stretches in which only that run computes (so several runs can share a process).
Statistics: a speedup is the median of per-round paired ratios, with a distribution-free
95% interval for that median (order statistics of a Binomial(n, 1/2)): no normality
assumed, no random resampling, the same answer every time for the same numbers.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ._checks import check_int
from ._torch_compat import EagerDispatchMode

CONFIDENCE = 0.95
# A speedup counts as stable once its 95% interval is within ±5% of it.
STABLE_HALF_WIDTH = 0.05
# CPU models below this many parameters run on one thread by default: at this size threads
# add more synchronisation than arithmetic, and on a busy machine OpenMP threads spin
# waiting for each other (one small bf16 matmul: 13 ms on 2 threads, 0.024 ms on 1).
SMALL_MODEL_PARAMS = 5_000_000


# --- timing -----------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Per-step times: CUDA events on CUDA (one host sync, at the end), else perf_counter.

    Example:
        >>> timer = StepTimer(torch.device("cpu"), 2)
        >>> for i in range(2):
        ...     timer.start(i); _ = torch.ones(8).sum(); timer.stop(i)
        >>> len(timer.times_ms())
        2
    """

    def __init__(self, device: torch.device, steps: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:  # made up front: creating events inside the loop would cost time there
            self._events = [(torch.cuda.Event(enable_timing=True),
                             torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        self._starts: list[float] = []
        self._ends: list[float] = []

    def start(self, i: int) -> None:
        if self.cuda:
            self._events[i][0].record()
        else:
            self._starts.append(time.perf_counter())

    def stop(self, i: int) -> None:
        if self.cuda:
            self._events[i][1].record()
        else:
            self._ends.append(time.perf_counter())

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()  # the harness's only host sync: after the timed steps
            return [start.elapsed_time(end) for start, end in self._events]
        return [(end - start) * 1e3 for start, end in zip(self._starts, self._ends)]


def time_steps(step: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls of ``step`` (one host sync, at the end)."""
    timer = StepTimer(device, steps)
    for i in range(steps):
        timer.start(i)
        step()
        timer.stop(i)
    return timer.times_ms()


# --- memory -----------------------------------------------------------------------------------
def _proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    # Linux: writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _max_rss_bytes() -> int:
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _rss_bytes() -> int:
    rss = _proc_status_kib("VmRSS")
    return _max_rss_bytes() if rss is None else rss * 1024


class MemoryMeter:
    """Peak memory of one run's own allocations, above what was in use when it started.

    Wrap each stretch in which only this run computes (its build, its warm-up, each of
    its rounds) in ``track()``. The peak of a stretch is the memory the run held when the
    stretch began plus the largest growth during it; what the run still holds after it
    (parameters, optimizer state) carries over to its next stretch. So runs sharing a
    process each get their own peak. CUDA: the caching allocator's counters. CPU: the
    process's resident set (VmRSS; the peak, VmHWM, reset through /proc/self/clear_refs
    where Linux allows it; else the process peak, fair only in a fresh process per run).
    A CPU process reuses heap memory another run freed, so there a fresh process per run
    is the fair measurement.

    Example:
        >>> meter = MemoryMeter(torch.device("cpu"))
        >>> with meter.track():
        ...     x = torch.ones(1 << 20)
        >>> meter.peak_mib() >= 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            self.resettable = True
            self.method = "CUDA allocator peak (max_memory_allocated) above the start of the run"
        else:
            self.resettable = _reset_peak_rss()
            self.method = ("process peak RSS above the RSS at the start of the run"
                           + ("" if self.resettable else " (peak not resettable here)"))
        self._base = self._current()
        self._held = 0  # what the run holds between its stretches
        self._peak = 0

    def _current(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else _rss_bytes()

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()

    def _max(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _max_rss_bytes()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """A stretch in which only this run allocates."""
        if self.resettable:
            self._reset()
        start = self._current()
        try:
            yield
        finally:
            if self.resettable:
                self._peak = max(self._peak, self._held + self._max() - start)
                self._held += self._current() - start
            else:  # the process's peak since it began: only fair in a fresh process
                self._peak = max(self._peak, self._max() - self._base)

    def peak_mib(self) -> float:
        return max(self._peak, 0) / 2**20


class LiveTensorBytes(EagerDispatchMode):
    """Exact bytes of live tensor storages, and their peak, on any device (a CPU too).

    Counts every storage an op creates while the mode is active, plus the tensors passed
    to :meth:`track` (what existed before, e.g. the model's parameters), until each storage
    is freed. Unlike a process's RSS it sees neither the allocator's caching nor other
    runs in the process, so phases and precisions compare byte for byte (a views' storage
    is counted once).

    Example:
        >>> with LiveTensorBytes() as live:
        ...     x = torch.ones(256)  # 1 KiB
        ...     del x
        >>> live.peak, live.now
        (1024, 0)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage from now until it is freed (once per storage)."""
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._live or size == 0:
            return
        self._live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for value in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(value, torch.Tensor):
                    self.track(value)
        return out


# --- statistics -------------------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0..1) of already sorted values."""
    pos = (len(sorted_values) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE
                    ) -> Optional[tuple[float, float]]:
    """A distribution-free ``confidence`` interval for the median of ``values``.

    The k-th smallest and k-th largest values, k the largest rank with
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. None when there are too few values
    for that coverage (fewer than 6 for 95%).

    Example:
        >>> median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
        (2.0, 9.0)
    """
    n, tail, below, k = len(values), (1 - confidence) / 2, 0.0, 0
    # comb(n, k) / 2**n, each from the last (exact integers): math.comb anew per k took
    # O(n^2) big-integer work per call, a second at 4000 values.
    total, comb = 1 << n, 1
    while k < n and below + comb / total <= tail:
        below += comb / total
        comb = comb * (n - k) // (k + 1)
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def paired_speedup(reference_ms: Sequence[float], ms: Sequence[float]
                   ) -> tuple[Optional[float], Optional[tuple[float, float]]]:
    """Speedup over the reference from per-round times taken side by side.

    Each round's ratio (reference time / this time) compares two runs measured moments
    apart, so drift and load that hit the whole round cancel; the speedup is the median
    ratio, with its :func:`median_interval`.
    """
    ratios = [r / m for r, m in zip(reference_ms, ms) if m > 0]
    if not ratios:
        return None, None
    return statistics.median(ratios), median_interval(ratios)


def half_width(value: Optional[float], interval: Optional[Sequence[float]]) -> float:
    """The interval's half width relative to the value (inf when there is no interval)."""
    if value is None or interval is None or value <= 0:
        return math.inf
    return (interval[1] - interval[0]) / 2 / value


# --- the machine -----------------------------------------------------------------------------
def machine_state(threads: Optional[int] = None) -> dict[str, Any]:
    """CPUs, the 1-minute load average, the CPU governor, and whether the machine is busy.

    Busy: more load than CPUs left beside the ``threads`` the benchmark uses, i.e. other
    work competes with the timed steps for a CPU.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    used = threads if threads is not None else torch.get_num_threads()
    return {"cpus": cpus, "loadavg_1m": None if load is None else round(load, 2),
            "busy": load is not None and cpus is not None and load > max(cpus - used, 0) + 0.5,
            "governor": _read_line("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")}


def _read_line(path: str) -> Optional[str]:
    try:
        with open(path) as src:
            return src.readline().strip() or None
    except OSError:
        return None


def max_threads() -> int:
    """The most intra-op threads a command or autotune takes: the CPU's logical cores
    (torch.set_num_threads with a hundred thousand crashed the process)."""
    return os.cpu_count() or 1


def check_threads(name: str, value: Any) -> int:
    """``value`` as a thread count from 1 to :func:`max_threads` (ValueError naming it)."""
    return check_int(name, value, 1, max_threads())


def default_threads(device_type: str, params: int) -> tuple[int, str]:
    """The intra-op threads a benchmark uses when none are given, and why."""
    current = torch.get_num_threads()
    if device_type != "cpu":
        return current, f"{current}, torch's default (the arithmetic runs on the {device_type})"
    size = f"{params / 1e6:.3g}M" if params >= 1e6 else f"{params / 1e3:.3g}K"
    if params < SMALL_MODEL_PARAMS:
        return 1, (f"1: a small model ({size} parameters) gains little from threads, and on "
                   "a busy machine OpenMP threads wait for each other")
    return current, f"{current}, torch's default for a model of {size} parameters"


@contextlib.contextmanager
def num_threads(threads: Optional[int]) -> Iterator[None]:
    """Run the body with ``threads`` intra-op threads (None: as they are), then restore."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def threads_for(requested: Optional[int], device_type: str,
                build: Callable[[], torch.nn.Module]) -> tuple[int, str]:
    """The threads a command runs with: ``requested``, else :func:`default_threads` for
    the model ``build()`` makes (built once, only to count its parameters)."""
    if requested is not None:
        return requested, f"{requested}, as asked (--threads)"
    if device_type != "cpu":
        return default_threads(device_type, 0)
    return default_threads(device_type, sum(p.numel() for p in build().parameters()))
