"""Runs one training loop under each precision policy, side by side, and compares them.

Every policy starts from the same seeded weights and the same batches (made on the device
before timing); warm-up steps (the first one includes any torch.compile time, reported
apart) are not timed. Then the policies take turns in rounds, a few steps each (A B C,
B C A, C A B, ...: the order rotates), so drift and load hit every row alike, and each
speedup is the median of the per-round ratios with a 95% interval (``measure``). After
``steps`` timed steps, more rounds follow while some interval is wider than ±5%, until
``max_time`` seconds have gone. On a CPU each policy runs in its own process
(``worker``), so its peak RSS is its own; the parent hands out the rounds.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from .._torch_compat import dynamo_reset
from ..diagnose.flops import FlopCounter, low_precision_share
from .compare import compare, no_memory_ratios
from .errors import BenchInterrupted, UsageError
from .._rng import RngReplay
from .._measure import (MemoryMeter, check_threads, StepTimer, half_width, num_threads, paired_speedup,
                      percentile, synchronize, STABLE_HALF_WIDTH)
from .policies import PolicySpec, loss_scaling_label
from .precision import OptimizerFactory, Precision, adam_eps, adamw_factory, train_step
from .guarded import Guarded, failed, guarded  # noqa: F401 - failed: re-exported
from .workloads import Workload, get_workload

__all__ = ["BenchSettings", "PolicyRun", "Setup", "failed", "play_rounds", "process_per_policy",
           "run_bench",
           "run_policy", "stable", "summarise"]

OnStep = Callable[[int, int], None]
# How a run's model and optimizer are made from the policy: Precision.setup by default;
# ``ampkit bench --nproc`` wraps the model for DDP or shards it.
Setup = Callable[[Precision, nn.Module, OptimizerFactory], tuple[nn.Module, torch.optim.Optimizer]]


@dataclass(frozen=True)
class BenchSettings:
    """What every policy of one benchmark shares.

    Args:
        model: a built-in model name or "package.module:function".
        device: "cpu", "cuda", "cuda:1", ...
        steps: timed steps (after the warm-up); more follow while a speedup's interval
            is wider than ±5% and ``max_time`` allows. warmup: untimed steps first.
        batch_size: None: the model's default for the device.
        compile: torch.compile the model (compile time reported apart from step time).
        seed: seeds the initial weights and the synthetic data.
        lr: AdamW's learning rate.
        threads: intra-op threads (None: leave torch's setting as it is).
        max_time: seconds the timed rounds may take in all, to reach stable intervals
            (0: exactly ``steps``).
        round_steps: steps each policy takes per round.

    Example:
        >>> BenchSettings(model="mlp", steps=5).warmup
        3
    """

    model: str = "gpt"
    device: str = "cpu"
    steps: int = 20
    warmup: int = 3
    batch_size: Optional[int] = None
    compile: bool = False
    seed: int = 0
    lr: float = 1e-3
    threads: Optional[int] = None
    max_time: float = 0.0
    round_steps: int = 2

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {self.steps}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.compile and self.warmup < 2:
            # Two: fp8's delayed recipe recompiles once, on its second step.
            raise UsageError(f"--warmup {self.warmup} with --compile would time the "
                             "compilation; valid: --warmup 2 or more")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a positive number, got {self.lr}")
        if self.threads is not None:
            try:
                check_threads("--threads", self.threads)
            except ValueError as err:
                raise UsageError(str(err)) from None
        if not (self.max_time >= 0 and math.isfinite(self.max_time)):
            raise UsageError(f"--max-time must be 0 or more seconds, got {self.max_time}")
        if self.round_steps < 1:
            raise UsageError(f"round_steps must be at least 1, got {self.round_steps}")


def build(spec: PolicySpec, settings: BenchSettings, workload: Workload, device: torch.device,
          setup: Optional[Setup] = None) -> tuple[nn.Module, torch.optim.Optimizer, Precision]:
    """Seeded model, its optimizer, and the policy applied (same weights for every policy)."""
    torch.manual_seed(settings.seed)
    precision = Precision(spec, device)
    make_optimizer = adamw_factory(spec.policy, settings.lr)
    model, optimizer = (precision.setup(workload.build(), make_optimizer) if setup is None
                        else setup(precision, workload.build(), make_optimizer))
    model.train()
    if settings.compile:
        # A fresh dynamo per policy (a process of its own, or one policy after another):
        # an earlier policy's caches for the same forward code would count towards this
        # one's recompile limit and could send it back to eager.
        dynamo_reset()
        model = torch.compile(model)  # type: ignore[assignment]
    return model, optimizer, precision


class PolicyRun:
    """One policy's model, optimizer and measurements in this process, run in stretches.

    Example:
        >>> from ampkit.bench.policies import parse_policy
        >>> run = PolicyRun(parse_policy("32-true", "cpu"), BenchSettings(model="mlp", warmup=1))
        >>> run.warm_up(); len(run.run(2))
        2
        >>> run.finish()["policy"]
        '32-true'
    """

    def __init__(self, spec: PolicySpec, settings: BenchSettings,
                 setup: Optional[Setup] = None) -> None:
        self.label, self.spec, self.settings = spec.label, spec, settings
        self.device = torch.device(settings.device)
        self.workload = get_workload(settings.model, settings.device,
                                     batch_size=settings.batch_size, seed=settings.seed)
        self.memory = MemoryMeter(self.device)
        with self.memory.track():
            self.model, self.optimizer, self.precision = build(spec, settings, self.workload,
                                                               self.device, setup)
            self.batches = self.workload.batches(self.device)
        # Its own random stream from the same start as every policy's (dropout draws the
        # same masks as in a process of its own): policies taking turns in one process drew
        # from one generator, and dropout looked like a loss difference between them.
        self.rng = RngReplay(self.device)
        self.losses: list[Tensor] = []  # on the device until the end: no host sync per step
        self.steps_done = 0
        self.times: list[float] = []
        self.round_ms: list[float] = []
        self.warmup_ms: Optional[float] = None
        self.flops: Optional[dict[str, int]] = None

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        """This run's random stream in place of the process's, for a stretch of steps."""
        outside = RngReplay(self.device)
        self.rng.rewind()
        try:
            yield
        finally:
            self.rng.mark()
            outside.rewind()

    def _step(self) -> None:
        inputs, targets = self.batches[self.steps_done % len(self.batches)]
        loss = train_step(self.model, inputs, targets, self.workload.loss_fn, self.optimizer,
                          self.precision)
        self.steps_done += 1
        # Only the losses summarise compares (the first warmup + steps): rounds added while
        # the timings settle would keep one device tensor per step.
        if len(self.losses) < self.settings.warmup + self.settings.steps:
            self.losses.append(loss)

    def warm_up(self) -> None:
        """The untimed steps, timed together (compilation, lazy initialisation).

        Without --compile the last one also counts the step's matmul/convolution FLOPs by
        the dtype they ran in (``diagnose.flops``): the policy's low-precision share.
        """
        if not self.settings.warmup:
            return
        with self.memory.track(), self._own_rng():
            synchronize(self.device)
            start = time.perf_counter()
            for i in range(self.settings.warmup):
                if i == self.settings.warmup - 1 and not self.settings.compile:
                    with FlopCounter() as counter:
                        self._step()
                    self.flops = counter.flops
                else:
                    self._step()
            synchronize(self.device)
            self.warmup_ms = (time.perf_counter() - start) * 1e3

    def run(self, steps: int) -> list[float]:
        """``steps`` timed steps (one round); their times in ms."""
        timer = StepTimer(self.device, steps)
        with self.memory.track(), self._own_rng():
            for i in range(steps):
                timer.start(i)
                self._step()
                timer.stop(i)
            times = timer.times_ms()
        self.times += times
        self.round_ms.append(statistics.median(times))
        return times

    def finish(self) -> dict[str, Any]:
        """The result (see ``summarise``); frees the model."""
        losses = torch.stack(self.losses).float().cpu().tolist() if self.losses else []
        result = summarise(self.spec, self.settings, self.workload, self.precision, self.times,
                           losses, self.warmup_ms)
        result.update(peak_mem_mib=self.memory.peak_mib(), memory_method=self.memory.method,
                      round_ms=self.round_ms, flops=self.flops,
                      low_precision_share=(None if not self.flops
                                           else low_precision_share(self.flops)))
        del self.model, self.optimizer, self.precision, self.batches, self.losses
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return result


def run_policy(spec: PolicySpec, settings: BenchSettings, on_step: Optional[OnStep] = None,
               *, parallel: Optional[Setup] = None) -> dict[str, Any]:
    """Train ``settings.warmup + settings.steps`` steps under one policy and measure them.

    Args:
        parallel: makes the model and optimizer instead of ``Precision.setup`` (DDP, FSDP).

    Returns:
        The per-policy result (see ``summarise``); comparisons across policies are added
        by ``compare``.
    """
    with num_threads(settings.threads):
        run = PolicyRun(spec, settings, parallel)
        play_rounds([run], settings, [on_step or _quiet])
        return run.finish()


def run_bench(specs: list[PolicySpec], settings: BenchSettings, *, isolate: bool,
              on_policy: Optional[Callable[[str], OnStep]] = None) -> list[dict[str, Any]]:
    """Run every policy, taking turns in rounds, and compare them.

    Args:
        specs: the policies, the first one being the reference.
        settings: what they share.
        isolate: a process of its own per policy (fair peak RSS on CPU; costs an import
            each, in parallel); else all in this one.
        on_policy: called with each policy's label; returns its progress callback.

    Returns:
        One result per policy, with ``speedup`` (and ``speedup_ci``), ``mem_ratio`` (None on
        a CPU when the policies shared this process, ``mem_ratio_reason`` saying why) and
        ``max_loss_dev`` relative to the first. A policy that raised (while building,
        warming up, stepping or finishing) is an error row instead, ``{"policy",
        "resolved", "error", "traceback"}`` (see ``failed``), and the others go on without
        it; the comparisons are then against the first policy that did not fail. A
        ``UsageError`` (a bad setting, the same for every policy) still ends the run, and
        so does every policy failing.
    """
    ticks = [on_policy(spec.label) if on_policy else _quiet for spec in specs]
    with num_threads(settings.threads), contextlib.ExitStack() as stack:
        if settings.compile and not isolate:
            # One after another: each compiles in a fresh dynamo, which would throw away
            # an earlier policy's compiled code if they took turns in one process.
            results = [guarded(spec, lambda s=spec, t=tick: run_policy(s, settings, t))
                       for spec, tick in zip(specs, ticks)]
        else:
            runs = _start(specs, settings, isolate, stack)
            try:
                play_rounds(runs, settings, ticks)
            except KeyboardInterrupt:
                _interrupted(runs, settings, isolate)
            results = [run.finish() for run in runs]
    if not any("error" not in r for r in results):
        raise RuntimeError("every policy failed: " + "; ".join(
            f"{r['policy']}: {r['error']}" for r in results))
    return _compare(results, settings, isolate)


def _compare(results: list[dict[str, Any]], settings: BenchSettings,
             isolate: bool) -> list[dict[str, Any]]:
    if torch.device(settings.device).type == "cpu" and not process_per_policy(isolate):
        # CPU peak RSS only grows within a process (CUDA peaks are reset per policy).
        no_memory_ratios(results, "this one process",
                         " (--isolate always measures each in a process of its own)")
    return compare(results)  # mem_ratio None where mem_ratio_reason says why


def process_per_policy(isolate: bool) -> bool:
    """Whether ``run_bench(..., isolate=isolate)`` runs each policy in a process of its own:
    as asked, where the platform can fork."""
    from . import worker  # the process protocol; it imports this module
    return isolate and worker.CAN_FORK


def _interrupted(runs: list[Any], settings: BenchSettings, isolate: bool) -> None:
    """Raise :class:`BenchInterrupted` with what the rounds measured so far. A process of
    its own per policy is in a session of its own (``worker``): the interrupt reached only
    this one, and each worker still answers ``finish``."""
    results = [run.finish() for run in runs]  # a policy without a timed step: an error row
    if not any("error" not in r for r in results):
        raise KeyboardInterrupt
    raise BenchInterrupted(_compare(results, settings, isolate))


def _start(specs: list[PolicySpec], settings: BenchSettings, isolate: bool,
           stack: contextlib.ExitStack) -> list[Any]:
    if not process_per_policy(isolate):
        return [Guarded(spec, lambda s=spec: PolicyRun(s, settings)) for spec in specs]
    from . import worker
    # A worker that fails to build its model fails start_workers as a whole (a
    # RuntimeError naming it); one that fails later becomes an error row.
    workers = worker.start_workers(specs, settings, stack)
    return [Guarded(spec, lambda w=w: w) for spec, w in zip(specs, workers)]


def _quiet(done: int, total: int) -> None:
    pass


def play_rounds(runs: Sequence[Any], settings: BenchSettings, ticks: Sequence[OnStep]) -> int:
    """Warm every run up, then give them rounds of steps in turn; the rounds played.

    ``runs``: objects with ``warm_up()``, ``run(steps)`` and ``round_ms`` (a
    ``PolicyRun``, or a worker process standing in for one).
    """
    for run, tick in zip(runs, ticks):
        run.warm_up()
        tick(settings.warmup, settings.warmup + settings.steps)
    # A run with an ``error`` (``_Guarded``: a policy that raised) sits out the rounds.
    live = lambda: [run for run in runs if getattr(run, "error", None) is None]  # noqa: E731
    # More rounds follow while the intervals are wide, bounded by --max-time alone (a cap
    # of 5 x --steps stopped fast steps after a fraction of the budget, below the 6 rounds
    # an interval takes, and the verdict then advised a larger budget).
    done, played = 0, 0
    deadline = time.perf_counter() + settings.max_time
    while live() and (done < settings.steps or (time.perf_counter() < deadline and
                                                not stable(live()))):
        steps = min(settings.round_steps, settings.steps - done) if done < settings.steps \
            else settings.round_steps
        first = played % len(runs)  # the order rotates: nobody always goes first
        for i in range(first, first + len(runs)):
            if getattr(runs[i % len(runs)], "error", None) is None:
                runs[i % len(runs)].run(steps)
        done, played = done + steps, played + 1
        for tick in ticks:
            tick(settings.warmup + done, settings.warmup + max(done, settings.steps))
    return played


def stable(runs: Sequence[Any]) -> bool:
    """Every speedup over the first run has a 95% interval within ±5% of it."""
    if not runs:
        return True
    reference = runs[0].round_ms
    return all(half_width(*paired_speedup(reference, run.round_ms)) <= STABLE_HALF_WIDTH
               for run in runs[1:])


def _finite_or_none(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None  # JSON has no NaN/inf


def summarise(spec: PolicySpec, settings: BenchSettings, workload: Workload,
              precision: Precision, times: list[float], losses: list[float],
              first_ms: Optional[float]) -> dict[str, Any]:
    """The per-policy numbers: step time (median, spread), throughput, loss, scaler.

    The losses are those of the first ``warmup + steps`` steps, the same for every run:
    rounds added while the timings settle train on (they are timed), but comparing their
    losses too made Δloss, and so the recommendation, depend on how busy the machine was.
    """
    losses = losses[:settings.warmup + settings.steps]
    ordered = sorted(times)
    median = percentile(ordered, 0.5)
    half = spec.policy.half_dtype
    stats = precision.scaler.stats() if precision.scaler.is_enabled() else None
    return {
        "policy": spec.label, "resolved": spec.resolved, "pure_fp32": spec.is_fp32,
        "half_dtype": None if half is None else str(half).replace("torch.", ""),
        "fp8_recipe": spec.fp8_recipe, "fp8_layers": precision.fp8_layers,
        "loss_scaling": loss_scaling_label(spec.policy),
        "adam_eps": adam_eps(spec.policy),
        "step_ms": median, "step_ms_iqr": percentile(ordered, 0.75) - percentile(ordered, 0.25),
        "step_ms_min": ordered[0], "step_ms_max": ordered[-1], "step_times_ms": times,
        "samples_per_s": workload.batch_size / median * 1e3 if median > 0 else None,
        "warmup_ms": first_ms,
        "compile_s": (None if not settings.compile or first_ms is None
                      else max(first_ms - settings.warmup * median, 0.0) / 1e3),
        "skipped_steps": None if stats is None else stats.skipped_steps,
        "final_scale": None if stats is None else stats.scale,
        "final_loss": _finite_or_none(losses[-1]),
        "nonfinite_losses": sum(not math.isfinite(v) for v in losses),
        "losses": [_finite_or_none(v) for v in losses],
    }
