"""``autotune``: measure the candidate policies on the user's model and choose one.

Each candidate trains its own deep copy of the model from the same weights on the same
batch, fp32 first, all in one run: the candidates take turns step by step (A B C A B C
...), so drift and load hit them alike, and every candidate's step starts from the same
RNG state (the same dropout masks: only precision tells the loss curves apart). The
choice is :func:`choose`: the fastest candidate whose loss curve stays within
``max_loss_dev`` (relative) of fp32's, and never one measured slower than fp32 (then
"32-true"). ``ampkit bench`` recommends by the same rule. The caller's model, its RNG
state and autocast state are left as they were.

fp8 is chosen layer by layer: an fp8 candidate ("fp8", "fp8-tensorwise", "fp8-delayed",
"fp8-rowwise") first times every eligible Linear alone at the shape it sees, bf16 against
fp8 (``ampkit.fp8.select``), and trains with only the layers where fp8 was faster
converted (bf16 autocast around the rest); when no layer was, it is not trained.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ._batch import call_model
from ._dtypes import autocast_default_dtype, default_device_type, map_tensors
from ._loss import default_loss
from ._measure import MemoryMeter, num_threads, synchronize, threads_for, time_steps
from ._reference import copy_model
from .apply import apply_policy, loop_scaler
from .autocast import autocast
from ._rng import RngReplay
from .fp8 import convert_to_fp8
from .fp8.convert import selecting
from .fp8.select import LayerTiming, faster_fp8_layers, time_fp8_layers
from .policy import OPT_LEVELS, get_policy
from .tune_args import FP8_CANDIDATES, check_candidate, check_request, native_candidates
from .tune_result import FP8_COMPUTE, ROW_KEYS, TuneResult, fp8_recipe

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_REFERENCE = "32-true"
_HALF_SUFFIX = {torch.float16: "fp16", torch.bfloat16: "bf16"}
REF_NOT_FINITE = ("the fp32 reference, whose own loss is not finite: precision is not the "
                  "cause and no candidate can be judged; check the model, data and learning rate")


def reference_not_finite(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether fp32's own loss (``rows[0]``'s) was not finite, so that :func:`choose`
    judged nothing: the one test autotune, ``ampkit tune`` and ``ampkit bench`` share."""
    if not rows:
        return False
    dev = rows[0]["max_loss_dev"]
    return dev is None or not math.isfinite(dev)


def choose(rows: Sequence[dict[str, Any]], max_loss_dev: float) -> tuple[str, float]:
    """The recommendation rule: the fastest accepted candidate, never slower than fp32.

    ``rows[0]`` is fp32's. A row is accepted when its ``max_loss_dev`` is within
    ``max_loss_dev``; ``reason`` and ``accepted`` are filled in. Returns (name, speedup).
    """
    reference = rows[0]
    best, best_ms = reference["policy"], reference["step_ms"]
    if reference_not_finite(rows):  # its max_loss_dev: 0.0 against itself, None when not finite
        for row in rows:  # nothing to hold a candidate's loss against
            row["accepted"], row["reason"] = ((True, REF_NOT_FINITE) if row is reference else
                                              (False, "not judged: fp32's own loss is not finite"))
        return best, 1.0
    for row in rows:
        if row is reference:
            row["accepted"], row["reason"] = True, "the fp32 reference"
        elif row["step_ms"] is None:  # not trained (an fp8 candidate with no faster layer)
            row["accepted"] = False
            row["reason"] = row.get("reason") or "not measured"
        elif row["max_loss_dev"] is None or row["max_loss_dev"] > max_loss_dev:
            row["accepted"] = False
            row["reason"] = (f"loss moved {row['max_loss_dev'] * 100:.3g}% from fp32's (more "
                             f"than {max_loss_dev * 100:g}%)" if row["max_loss_dev"] is not None
                             else "loss not finite")
        elif row["step_ms"] >= reference["step_ms"]:
            row["accepted"] = False
            row["reason"] = (f"no faster than fp32 here ({row['step_ms']:.3g} ms vs "
                             f"{reference['step_ms']:.3g} ms)")
        else:
            row["accepted"], row["reason"] = True, "faster than fp32 within the loss tolerance"
            if row["step_ms"] < best_ms:
                best, best_ms = row["policy"], row["step_ms"]
    return best, reference["step_ms"] / best_ms


def autotune(model: nn.Module, inputs: Any, target: Any = None, *,
             loss_fn: Optional[Callable[..., Tensor]] = None,
             optimizer: Optional[OptimizerFactory] = None,
             candidates: Union[str, Sequence[str], None] = None, max_loss_dev: float = 0.02,
             steps: int = 20, device: Optional[str] = None,
             threads: Optional[int] = None) -> TuneResult:
    """Train a copy of ``model`` under each candidate and choose the fastest accurate one.

    Args:
        model: the model (not modified: each candidate trains a deep copy).
        inputs: the batch, moved to ``device``: a tuple (``model(*inputs)``), a dict
            (``model(**inputs)``) or anything else, a tensor or a list (``model(inputs)``),
            as ``inspect`` takes it.
        target: the loss target; default loss: cross-entropy for an integer target, MSE for
            a floating one, ``output.float().mean()`` without one.
        loss_fn: ``loss_fn(output, target)`` instead of the default.
        optimizer: a callable params -> optimizer (default AdamW, lr 1e-3).
        candidates: policy names, or one name as a str (default:
            :func:`native_candidates`), and the fp8 names "fp8", "fp8-tensorwise",
            "fp8-delayed", "fp8-rowwise" (fp8 layer by layer where measured faster); fp32
            is always measured first as the reference ("32-true"). Names that mean the
            same policy ("fp32" and "32-true", "fp8" and "fp8-tensorwise") are measured
            once, under the first spelling.
        max_loss_dev: the largest relative gap from fp32's loss curve a candidate may show.
        steps: training steps per candidate (the first two are warm-up, not timed).
        device: where to run (default: the model's device); a device this machine lacks
            raises ValueError naming the valid ones, before anything runs.
        threads: intra-op threads while it measures (restored after). Default: as
            ``ampkit bench`` and ``ampkit tune`` choose them, 1 on a CPU for a model under
            5M parameters (on a busy machine OpenMP threads wait for each other, and the
            times then show speed-ups that are not there), else torch's current number.

    Example:
        >>> result = autotune(model, x, y, steps=10)  # doctest: +SKIP
        >>> model, opt = result.apply(model, torch.optim.AdamW(model.parameters()))  # doctest: +SKIP
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("autotune trains each candidate (a backward pass); valid: call it "
                           "outside torch.inference_mode()")
    names = [_REFERENCE] + check_request(
        model, inputs, target, candidates=candidates, max_loss_dev=max_loss_dev, steps=steps,
        optimizer=optimizer, loss_fn=loss_fn, device=device, threads=threads)
    device = (str(device) if device is not None else
              next((p.device.type for p in model.parameters()), default_device_type()))
    names = distinct_candidates([on_device(name, device) for name in names])
    make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    batch = _to_device(inputs, device), _to_device(target, device)
    threads, _ = threads_for(threads, torch.device(device).type, lambda: model)
    # The runs train outside any autocast region and no_grad of the caller's, which are
    # left as they were.
    with num_threads(threads), _untouched_state(), torch.enable_grad(), \
            autocast(device, enabled=False):
        layers = {name: _fp8_layers(model, batch[0], device, name) for name in names
                  if fp8_recipe(name) is not None}
        runs = [_Run(name, model, make_opt, device, layers.get(name)) for name in names]
        rng = RngReplay(torch.device(device))
        for step in range(steps):
            rng.mark()  # each candidate's step draws the same random numbers (dropout)
            for run in runs:  # interleaved: A B C A B C ...
                if run.trains:
                    rng.rewind()
                    run.step(batch, loss_fn, timed=step >= 2)
    measured = [run.row(runs[0].losses) for run in runs]
    rows = [{key: row[key] for key in ROW_KEYS} for row in measured]
    details = [{key: value for key, value in row.items() if key == "policy" or key not in ROW_KEYS}
               for row in measured]
    chosen, speedup = choose(rows, max_loss_dev)
    if reference_not_finite(rows):  # say so; 32-true did not win anything
        warnings.warn(f"autotune: {REF_NOT_FINITE}", UserWarning, stacklevel=2)
    chosen_run = next(run for run in runs if run.name == chosen)
    return TuneResult(chosen, rows, speedup, fp8_modules=list(chosen_run.fp8_modules),
                      details=details)


def _fp8_layers(model: nn.Module, inputs: Any, device: str, name: str) -> list[LayerTiming]:
    """Each eligible Linear timed alone at its shape, bf16 against fp8, on a copy of the model."""
    probe = copy_model(model, "autotune").to(device)
    return time_fp8_layers(probe, inputs, recipe=fp8_recipe(name))


def on_device(name: str, device: str) -> str:
    """An O-level without suffix with the device's half dtype written out ("O2" on a CPU is
    "O2-bf16"), as ``ampkit bench`` and ``doctor`` read it; other names as they are.

    Example:
        >>> on_device("O2", "cpu"), on_device("bf16-mixed", "cpu"), on_device("O0", "cpu")
        ('O2-bf16', 'bf16-mixed', 'O0')
    """
    level = name.strip() if isinstance(name, str) else name
    if level not in OPT_LEVELS or get_policy(level).half_dtype is None:
        return name
    half = autocast_default_dtype(torch.device(device).type)
    return f"{level}-{_HALF_SUFFIX[half]}"


def distinct_candidates(names: Sequence[str]) -> list[str]:
    """``names`` without the ones that mean a policy named earlier ("fp32" after
    "32-true", "fp8" after "fp8-tensorwise"): the first spelling stays, in order.

    Example:
        >>> distinct_candidates(["32-true", "fp32", "bf16-mixed", "O0", "fp8", "fp8-tensorwise"])
        ['32-true', 'bf16-mixed', 'fp8']
    """
    seen: set[Any] = set()
    kept = []
    for name in names:
        recipe = fp8_recipe(name)
        key = ("fp8", recipe) if recipe is not None else get_policy(name)
        if key not in seen:
            seen.add(key)
            kept.append(name)
    return kept


class _Run:
    """One candidate: its own copy of the model, optimizer, scaler; its losses and times."""

    def __init__(self, name: str, model: nn.Module, make_opt: OptimizerFactory, device: str,
                 fp8_layers: Optional[list[LayerTiming]] = None) -> None:
        self.name = name
        self.failed: Optional[str] = None
        recipe = fp8_recipe(name)
        self.fp8_layers = fp8_layers
        self.fp8_modules = faster_fp8_layers(fp8_layers or [])
        self.trains = recipe is None or bool(self.fp8_modules)
        self.policy = get_policy(FP8_COMPUTE if recipe is not None else name)
        self.device = device
        self.losses: list[Tensor] = []
        self.times: list[float] = []
        if not self.trains:
            return  # an fp8 candidate without a layer faster in fp8: nothing to train
        self.cuda = torch.device(device).type == "cuda"
        # CUDA: each candidate's own peak, though all share the process; a CPU's RSS cannot
        # be told apart between candidates in one process, so there it is not reported.
        self.memory = MemoryMeter(torch.device(device)) if self.cuda else None
        with self._tracked(), self._guarded():
            self.model = copy_model(model, "autotune").to(device)
            if recipe is not None:
                self.model = convert_to_fp8(self.model, recipe=recipe,
                                            module_filter=selecting(self.model, self.fp8_modules))
            self.optimizer = make_opt(self.model.parameters())
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer returned {type(self.optimizer).__name__} "
                                f"{self.optimizer!r:.80}; valid: a callable params -> "
                                "torch.optim.Optimizer")
            apply_policy(self.policy, self.model, self.optimizer)
            self.scaler = loop_scaler(self.policy, device)
            self.autocast = autocast(device, dtype=self.policy.compute_dtype
                                     if self.policy.autocast else torch.float32,
                                     enabled=self.policy.autocast)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """A candidate that cannot run (an op without a kernel in its dtype) is rejected
        with its error, as ``ampkit bench`` leaves it out; the fp32 reference's error is
        the caller's (a bad loss_fn, optimizer or model) and is raised."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - any failure of a candidate's own run
            if self.name == _REFERENCE:
                raise
            self.failed = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
            self.trains = False

    def _tracked(self) -> Any:
        return self.memory.track() if self.memory is not None else contextlib.nullcontext()

    def step(self, batch: tuple[Any, Any], loss_fn: Optional[Callable[..., Tensor]],
             timed: bool) -> None:
        # Each step waits for the device before and after (the candidates take turns).
        # Its own copy of the batch, made before the step is timed: a model that changes
        # its input in place must not hand the next candidate another batch.
        batch = map_tensors(batch, torch.Tensor.clone)
        synchronize(torch.device(self.device))
        times: list[float] = []
        with self._tracked(), self._guarded():
            times = time_steps(lambda: self._train(batch, loss_fn), torch.device(self.device), 1)
        if timed and self.failed is None:
            self.times += times

    def _train(self, batch: tuple[Any, Any], loss_fn: Optional[Callable[..., Tensor]]) -> None:
        inputs, target = batch
        with self.autocast:
            output = call_model(self.model, inputs)
            loss = (loss_fn or default_loss)(output, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn returned {type(loss).__name__} "
                            f"{tuple(loss.shape) if isinstance(loss, Tensor) else loss!r}; "
                            "valid: a one-element tensor (the loss to minimize)")
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        # Inside a region of the caller's, autocast's cast cache would outlive the step and
        # hand the next one stale half copies of the weights.
        torch.clear_autocast_cache()
        self.losses.append(loss.detach().float())

    def row(self, reference: list[Tensor]) -> dict[str, Any]:
        extra = {} if self.fp8_layers is None else {
            "fp8_modules": list(self.fp8_modules),
            "fp8_layers": [timing.to_dict() for timing in self.fp8_layers]}
        if self.failed is not None:
            return {"policy": self.name, "step_ms": None, "peak_mib": None,
                    "max_loss_dev": None, "accepted": False, "reason": self.failed,
                    "timed_ms": sum(self.times), "timed_steps": len(self.times), **extra}
        if not self.trains:
            return {"policy": self.name, "step_ms": None, "peak_mib": None,
                    "max_loss_dev": None, "accepted": False,
                    "reason": ("no layer ran faster in fp8 than in bf16 at its shape here"
                               if self.fp8_layers else "no fp8-eligible Linear (in and out "
                               "features multiples of 16) ran in the forward"),
                    "timed_ms": 0.0, "timed_steps": 0, **extra}
        ours = [float(v) for v in self.losses]
        ref = [float(v) for v in reference]
        finite = all(math.isfinite(v) for v in ours)
        dev = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ref)) if finite else None
        peak = self.memory.peak_mib() if self.memory is not None else None
        return {"policy": self.name, "step_ms": statistics.median(self.times),
                "peak_mib": peak, "max_loss_dev": dev, "accepted": False, "reason": "",
                "timed_ms": sum(self.times), "timed_steps": len(self.times), **extra}


def _to_device(value: Any, device: str) -> Any:
    """``value`` with its tensors on ``device``, its structure kept: a list stays a list and
    a namedtuple a namedtuple (``call_model`` tells them apart), dataclasses are walked."""
    return map_tensors(value, lambda tensor: tensor.to(device))


class _untouched_state:  # noqa: N801 - used as a context manager
    """Restore the RNG states around the runs (the copies' training must not move them)."""

    def __enter__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


__all__ = ["autotune", "TuneResult", "FP8_CANDIDATES", "check_candidate", "choose",
           "distinct_candidates", "fp8_recipe", "native_candidates"]
