"""Runs one training loop under each precision policy and measures it honestly.

One loop serves every policy because the pieces a policy does not use are no-ops
(nanoGPT's habit): ``ampkit.apply.apply_policy`` (the seam ``initialize`` uses) converts
the model and optimizer as the policy says, ``autocast`` is entered with
``enabled=policy.autocast``, and the ``GradScaler`` (``apply.loop_scaler``) is disabled
unless the policy scales the loss. fp8 is ``convert_to_fp8``
plus bf16 autocast.

Measurement rules: every policy starts from the same seeded weights and the same
batches (made on the device before timing); warm-up steps (the first one includes any
torch.compile time, reported separately) are not timed; on CUDA each timed step sits
between two CUDA events and the host synchronises once, after the loop; losses stay on
the device until then, so the harness adds no host sync of its own inside the loop.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from .._dtypes import HALF_DTYPES, autocast_default_dtype, fp8_supported, resolve_dtype
from .._torch_compat import dynamo_reset
from ..autocast import autocast
from ..fp8 import Float8Config, Float8Linear, Recipe, convert_to_fp8
from ..apply import apply_policy, loop_scaler
from ..policy import OPT_LEVELS, Policy, get_policy, preset_names
from .errors import UsageError
from .workloads import Workload, get_workload

FP8_RECIPES = tuple(recipe.value for recipe in Recipe)
_F32, _F16 = torch.float32, torch.float16
OnStep = Callable[[int, int], None]



def valid_policies() -> str:
    """The policy names ``--policies`` accepts, for error messages and help."""
    return (", ".join(preset_names()) + "; O-levels take a half-dtype suffix (O2-bf16, "
            f"O1-fp16); fp8[-{'|-'.join(FP8_RECIPES)}]; or 'p=f32,c=bf16,o=f32'")


@dataclass(frozen=True)
class PolicySpec:
    """A policy as named on the command line, resolved for one device.

    Args:
        label: the name as the user wrote it ("O2", "bf16-mixed", "fp8").
        policy: the resolved Policy (O-levels get the device's half dtype unless suffixed).
        fp8_recipe: the convert_to_fp8 recipe, or None when the policy is not fp8.

    Example:
        >>> parse_policy("O2", "cpu").policy.param_dtype
        torch.bfloat16
    """

    label: str
    policy: Policy
    fp8_recipe: Optional[str] = None


def parse_policy(name: str, device_type: str) -> PolicySpec:
    """Resolve one policy name for a device type; UsageError names the valid ones."""
    label = name.strip()
    base, _, suffix = label.partition("-")
    if base == "fp8":
        recipe = suffix or "tensorwise"
        if recipe not in FP8_RECIPES:
            raise UsageError(f"unknown fp8 recipe {recipe!r} in policy {label!r}; valid: "
                             f"{', '.join(FP8_RECIPES)}")
        return PolicySpec(label, get_policy("bf16-mixed"), recipe)
    if base in OPT_LEVELS:
        return PolicySpec(label, _opt_level(base, suffix, label, device_type))
    try:
        policy = get_policy(label)
    except (ValueError, TypeError) as err:
        if "=" in label:  # an explicit policy: the parser's message names the bad part
            raise UsageError(f"bad policy {label!r}: {err}") from None
        raise UsageError(f"unknown policy {label!r}; valid: {valid_policies()}") from None
    _check_runnable(label, policy)
    return PolicySpec(label, policy)


def _opt_level(level: str, suffix: str, label: str, device_type: str) -> Policy:
    policy = get_policy(level)
    if policy.half_dtype is None:
        if suffix:
            raise UsageError(f"policy {label!r}: {level} is pure fp32 and takes no half dtype; "
                             f"valid: {level}")
        return policy
    try:
        half = (resolve_dtype(suffix, allowed=HALF_DTYPES, what=f"half dtype in {label!r}")
                if suffix else autocast_default_dtype(device_type))
    except ValueError as err:
        raise UsageError(str(err)) from None
    return policy.with_half_dtype(half)


def _check_runnable(label: str, p: Policy) -> None:
    # The loop runs half parameters through initialize (which computes in the parameters'
    # dtype) and fp32 parameters through autocast; other combinations have no meaning there.
    if p.param_dtype in HALF_DTYPES and p.compute_dtype != p.param_dtype:
        raise UsageError(f"policy {label!r} keeps {p.param_dtype} parameters but computes in "
                         f"{p.compute_dtype}; valid: compute dtype equal to a half param dtype")
    if p.param_dtype == _F32 and p.compute_dtype != _F32 and not p.autocast:
        raise UsageError(f"policy {label!r} computes in {p.compute_dtype} on fp32 parameters "
                         "without autocast; valid: autocast=1 for fp32 parameters")


def parse_policy_list(text: str, device_type: str) -> list[PolicySpec]:
    """Parse a --policies value: names separated by commas (or by ';').

    Explicit "p=..,c=..,o=.." policies contain commas themselves: an item with "=" joins
    the explicit policy before it unless it repeats one of its keys.

    Example:
        >>> [s.label for s in parse_policy_list("32-true,p=f32,c=bf16,fp8", "cpu")]
        ['32-true', 'p=f32,c=bf16', 'fp8']
    """
    items = text.split(";") if ";" in text else _join_explicit(text.split(","))
    specs = [parse_policy(item, device_type) for item in items if item.strip()]
    if not specs:
        raise UsageError(f"no policy given in {text!r}; valid: {valid_policies()}")
    return specs


def _join_explicit(items: list[str]) -> list[str]:
    out: list[str] = []
    keys: set[str] = set()
    for item in (i.strip() for i in items):
        key = item.partition("=")[0].strip().lower()
        if "=" in item and out and "=" in out[-1] and key not in keys:
            out[-1] += "," + item
            keys.add(key)
        else:
            out.append(item)
            keys = {key} if "=" in item else set()
    return out


# --- applying a policy: through ampkit.apply, the seam initialize uses too ----------------
def loss_scaling_label(policy: Policy) -> str:
    """How the policy scales the loss, for reports: "off", "dynamic" or "static <scale>"."""
    scaling = policy.loss_scaling
    return "off" if scaling.kind == "none" else str(scaling)


class Precision:
    """What one training loop needs from a policy; pieces it does not use are no-ops.

    Args:
        spec: the resolved policy.
        device: where the model runs.

    Example:
        >>> prec = Precision(parse_policy("bf16-mixed", "cpu"), torch.device("cpu"))
        >>> model, opt = prec.setup(nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> with prec.autocast:
        ...     model(torch.ones(2, 4)).dtype
        torch.bfloat16
    """

    def __init__(self, spec: PolicySpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        policy = spec.policy
        # Built once: entering the same region every step costs no per-step setup.
        self.autocast = autocast(device.type, dtype=policy.compute_dtype if policy.autocast
                                 else _F32, enabled=policy.autocast)
        self.scaler = loop_scaler(policy, device.type)
        self.fp8_layers = 0

    def setup(self, model: nn.Module, make_optimizer: Callable[[Iterable[nn.Parameter]],
              torch.optim.Optimizer]) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model, convert it (fp8, half), and build its optimizer."""
        model = model.to(self.device)
        if self.spec.fp8_recipe is not None:
            # Emulation asked for explicitly where there is no fp8 hardware: the report
            # says so, so the library's one-time warning would only repeat it.
            emulate = None if fp8_supported(str(self.device)) else True
            model = convert_to_fp8(model, recipe=Float8Config(self.spec.fp8_recipe, emulate=emulate))
            self.fp8_layers = sum(isinstance(m, Float8Linear) for m in model.modules())
        optimizer = make_optimizer(model.parameters())
        apply_policy(self.spec.policy, model, optimizer)
        return model, optimizer


def adam_eps(policy: Policy) -> float:
    """AdamW's eps for a policy: 1e-8, or 1e-4 when AdamW steps fp16 parameters itself.

    In fp16 (no fp32 masters) the second moment of small gradients underflows to zero
    while the first moment does not, so the update is m / eps; 1e-8 (itself below fp16's
    smallest subnormal) lets it explode, 1e-4 bounds it. bf16 has fp32's range: 1e-8.
    """
    return 1e-4 if policy.param_dtype == _F16 and not policy.master_weights else 1e-8


def adamw_factory(policy: Policy, lr: float) -> Callable[[Iterable[nn.Parameter]],
                                                          torch.optim.Optimizer]:
    """The optimizer every run uses: AdamW with ``lr`` and the policy's ``adam_eps``."""
    return lambda params: torch.optim.AdamW(params, lr=lr, eps=adam_eps(policy))


def train_step(model: nn.Module, inputs: Tensor, targets: Tensor,
               loss_fn: Callable[[Tensor, Tensor], Tensor], optimizer: torch.optim.Optimizer,
               precision: Precision) -> Tensor:
    """One optimisation step under a precision; returns the loss, still on the device."""
    with precision.autocast:
        loss = loss_fn(model(inputs), targets)
    scaler = precision.scaler
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # a no-op step when the gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


# --- measuring -----------------------------------------------------------------------------
class StepTimer:
    """Per-step times: CUDA events on CUDA (one host sync, at the end), else perf_counter."""

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
            torch.cuda.synchronize()  # the harness's only host sync: after the timed loop
            return [start.elapsed_time(end) for start, end in self._events]
        return [(end - start) * 1e3 for start, end in zip(self._starts, self._ends)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


class MemoryMeter:
    """Peak memory of one policy's run, above what was in use when it started.

    CUDA: the caching allocator's peak (``max_memory_allocated`` after a reset). CPU: the
    process's peak resident set (VmHWM, reset through /proc/self/clear_refs where Linux
    allows; else ru_maxrss, which only grows, so only a fresh process per policy is fair).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
            self.method = "CUDA allocator peak (max_memory_allocated) above the start of the run"
        else:
            resettable = _reset_peak_rss()
            self._base = self._peak_rss_kib() * 1024
            self.method = ("process peak RSS above the RSS at the start of the run"
                           + ("" if resettable else " (peak not resettable here)"))

    def _peak_rss_kib(self) -> int:
        hwm = _proc_status_kib("VmHWM")
        if hwm is not None:
            return hwm
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss // 1024 if sys.platform == "darwin" else rss  # bytes on macOS, KiB on Linux

    def peak_mib(self) -> float:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = self._peak_rss_kib() * 1024
        return max(peak - self._base, 0) / 2**20


# --- one policy's run ----------------------------------------------------------------------
@dataclass(frozen=True)
class BenchSettings:
    """What every policy of one benchmark shares.

    Args:
        model: a built-in model name or "package.module:function".
        device: "cpu", "cuda", "cuda:1", ...
        steps: timed steps (after the warm-up). warmup: untimed steps first.
        batch_size: None: the model's default for the device.
        compile: torch.compile the model (compile time reported apart from step time).
        seed: seeds the initial weights and the synthetic data.
        lr: AdamW's learning rate.

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


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# How each rank of a multi-process bench sets a model up in place of Precision.setup (the
# policy applied, then a DDP wrap; or FSDP2's shard): see bench/parallel.py.
ParallelSetup = Callable[[Precision, nn.Module, OptimizerFactory],
                         tuple[nn.Module, torch.optim.Optimizer]]


def build(spec: PolicySpec, settings: BenchSettings, workload: Workload,
          device: torch.device, parallel: Optional[ParallelSetup] = None,
          ) -> tuple[nn.Module, torch.optim.Optimizer, Precision]:
    """Seeded model, its optimizer, and the policy applied (same weights for every policy).

    ``parallel``: replaces ``Precision.setup`` on each rank of a multi-process bench.
    """
    torch.manual_seed(settings.seed)
    precision = Precision(spec, device)
    setup = precision.setup if parallel is None else partial(parallel, precision)
    model, optimizer = setup(workload.build(), adamw_factory(spec.policy, settings.lr))
    model.train()
    if settings.compile:
        # Each policy compiles afresh: dynamo's caches from an earlier policy's model (same
        # forward code) would count towards its recompile limit and could fall back to eager.
        dynamo_reset()
        model = torch.compile(model)  # type: ignore[assignment]
    return model, optimizer, precision


def run_policy(spec: PolicySpec, settings: BenchSettings,
               on_step: Optional[OnStep] = None, *,
               parallel: Optional[ParallelSetup] = None) -> dict[str, Any]:
    """Train ``settings.warmup + settings.steps`` steps under one policy and measure them.

    ``parallel``: how this rank of a multi-process bench sets the model up (see ``build``).

    Returns:
        The per-policy result (see ``summarise``); comparisons across policies are added
        by ``compare``.
    """
    device = torch.device(settings.device)
    workload = get_workload(settings.model, settings.device, batch_size=settings.batch_size,
                            seed=settings.seed)
    meter = MemoryMeter(device)
    model, optimizer, precision = build(spec, settings, workload, device, parallel)
    batches = workload.batches(device)
    losses, times, first_ms = _timed_loop(model, optimizer, precision, workload, batches,
                                          settings, on_step)
    result = summarise(spec, settings, workload, precision, times, losses, first_ms)
    result.update(peak_mem_mib=meter.peak_mib(), memory_method=meter.method)
    del model, optimizer, precision, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _timed_loop(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                workload: Workload, batches: list, settings: BenchSettings,
                on_step: Optional[OnStep]) -> tuple[list[float], list[float], Optional[float]]:
    device = precision.device
    total = settings.warmup + settings.steps
    timer = StepTimer(device, settings.steps)
    losses: list[Tensor] = []
    first_ms: Optional[float] = None
    for i in range(total):
        inputs, targets = batches[i % len(batches)]
        timed = i - settings.warmup
        if timed < 0 and i == 0:  # the warm-up (compilation, lazy init): timed apart
            synchronize(device)
            start = time.perf_counter()
        elif timed >= 0:
            timer.start(timed)
        losses.append(train_step(model, inputs, targets, workload.loss_fn, optimizer, precision))
        if timed >= 0:
            timer.stop(timed)
        elif timed == -1:
            # The whole warm-up, not just its first step: a recompile in a later warm-up
            # step (fp8's delayed recipe recompiles once after its first step) counts too.
            synchronize(device)
            first_ms = (time.perf_counter() - start) * 1e3
        if on_step is not None:
            on_step(i + 1, total)
    times = timer.times_ms()
    return torch.stack(losses).float().cpu().tolist(), times, first_ms


def _percentile(sorted_values: list[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def _finite_or_none(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None  # JSON has no NaN/inf


def summarise(spec: PolicySpec, settings: BenchSettings, workload: Workload,
              precision: Precision, times: list[float], losses: list[float],
              first_ms: Optional[float]) -> dict[str, Any]:
    """The per-policy numbers: step time (median, spread), throughput, loss, scaler."""
    ordered = sorted(times)
    median = _percentile(ordered, 0.5)
    half = spec.policy.half_dtype
    stats = precision.scaler.stats() if precision.scaler.is_enabled() else None
    return {
        "policy": spec.label, "resolved": str(spec.policy),
        "half_dtype": None if half is None else str(half).replace("torch.", ""),
        "fp8_recipe": spec.fp8_recipe, "fp8_layers": precision.fp8_layers,
        "loss_scaling": loss_scaling_label(spec.policy),
        "adam_eps": adam_eps(spec.policy),
        "step_ms": median, "step_ms_iqr": _percentile(ordered, 0.75) - _percentile(ordered, 0.25),
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


# --- a fresh process per policy (fair peak RSS on CPU) ---------------------------------------
_PREFIX = "@ampkit "  # marks the child's protocol lines among anything user code prints


def _child_env() -> dict[str, str]:
    # The child must import this very ampkit, however the parent found it.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    paths = [package_root, os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def run_policy_isolated(label: str, settings: BenchSettings,
                        on_step: Optional[OnStep] = None) -> dict[str, Any]:
    """``run_policy`` in a fresh Python process, so its peak RSS is its own.

    Raises:
        UsageError: the child rejected a setting (its one-line message).
        RuntimeError: the child failed in any other way (the last line of its stderr).
    """
    job = json.dumps({"policy": label, "settings": asdict(settings)})
    cmd = [sys.executable, "-m", "ampkit.bench.runner", job]
    # stderr goes to a file: a pipe nobody reads while the loop reads stdout could fill up
    # (warnings, user prints) and stall the child.
    with tempfile.TemporaryFile("w+") as errors, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=_child_env()) as child:
        result = _read_child(child.stdout, on_step)  # type: ignore[arg-type]
        child.wait()
        errors.seek(0)
        stderr = errors.read()
    if isinstance(result, UsageError):
        raise result
    if child.returncode != 0 or result is None:
        last = (stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        raise RuntimeError(f"policy {label!r} failed in its own process: {last}")
    result["memory_method"] += ", in a fresh process per policy"
    return result


def _read_child(stdout: Iterable[str], on_step: Optional[OnStep]) -> Any:
    """The child's result dict, a UsageError it reported, or None when it said neither."""
    result: Any = None
    for line in stdout:
        if not line.startswith(_PREFIX):
            continue
        kind, _, payload = line[len(_PREFIX):].partition(" ")
        if kind == "step" and on_step is not None:
            done, total = payload.split()
            on_step(int(done), int(total))
        elif kind == "result":
            result = json.loads(payload)
        elif kind == "error":
            result = UsageError(payload.strip())
    return result


def _child_main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    try:
        settings = BenchSettings(**job["settings"])
        spec = parse_policy(job["policy"], torch.device(settings.device).type)
    except UsageError as err:
        print(_PREFIX + "error " + str(err), flush=True)
        return 2

    def report_step(done: int, total: int) -> None:
        print(f"{_PREFIX}step {done} {total}", flush=True)

    try:
        result = run_policy(spec, settings, report_step)
    except UsageError as err:
        print(_PREFIX + "error " + str(err).replace("\n", " "), flush=True)
        return 2
    print(_PREFIX + "result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))


# --- all policies --------------------------------------------------------------------------
def run_bench(specs: list[PolicySpec], settings: BenchSettings, *, isolate: bool,
              on_policy: Optional[Callable[[str], OnStep]] = None) -> list[dict[str, Any]]:
    """Run every policy (each in its own process when ``isolate``) and compare them.

    Args:
        specs: the policies, the first one being the reference.
        settings: what they share.
        isolate: a fresh process per policy (fair peak RSS on CPU; costs an import each).
        on_policy: called with each policy's label; returns its per-step progress callback.

    Returns:
        One result per policy, with ``speedup``, ``mem_ratio`` and ``max_loss_dev``
        relative to the first.
    """
    results = []
    for spec in specs:
        on_step = on_policy(spec.label) if on_policy is not None else None
        if isolate:
            results.append(run_policy_isolated(spec.label, settings, on_step))
        else:
            results.append(run_policy(spec, settings, on_step))
    return compare(results)


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or not den else num / den


def max_loss_deviation(losses: list[Optional[float]], ref: list[Optional[float]]) -> Optional[float]:
    """Largest |loss - reference loss| over the steps; None when either went non-finite."""
    pairs = list(zip(losses, ref))
    if any(a is None or b is None for a, b in pairs):
        return None
    return max((abs(a - b) for a, b in pairs), default=0.0)  # type: ignore[operator]


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add speedup, memory ratio and loss-curve deviation relative to the first result."""
    ref = results[0]
    for res in results:
        res["speedup"] = _ratio(ref["step_ms"], res["step_ms"])
        res["mem_ratio"] = _ratio(res["peak_mem_mib"], ref["peak_mem_mib"])
        res["max_loss_dev"] = max_loss_deviation(res["losses"], ref["losses"])
    return results
