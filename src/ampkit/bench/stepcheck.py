"""``ampkit train``'s check on its steps: the loss-scale timeline, the skipped steps, and
a warning naming the module where a non-finite step went wrong.

Cost decides the design. ``diagnose.watch`` on every step adds a reduction per module
output and gradient (half a small MLP's step again), so it never runs on a healthy step;
a non-finite step is detected from what the step already knows, and only then is its
batch run again under ``watch`` to find the module:

- with loss scaling, ``GradScaler.step`` already reads found-inf on the host (the one
  host sync of a plain-optimizer step), so ``last_step_skipped`` costs nothing: a skipped
  step's weights are those it started from, and its batch is run again, forward and
  backward, at the loss scale it used;
- without loss scaling nothing skips a non-finite step (the optimizer writes the inf/NaN
  into the weights), so the loss is checked before the backward, inside the loss
  function: one host read of it per step (its one sync). A non-finite loss runs the
  forward again under ``watch``, on the weights the step started from. A gradient that
  alone goes non-finite is seen at the next step, whose weights then hold it (said so).
- the scale after each step is copied on the device (one 0-dim copy per step) and read
  once, at the end of the epoch: the timeline adds no host sync.

At most one such re-run per epoch (its first non-finite step); it runs on a fork of the
RNG and on copies of the buffers (batch-norm statistics), and clears the gradients it
made, so the run continues as if it had not happened.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..diagnose import watch
from ..keep import kept_names
from .precision import Precision, train_step
from .workloads import classification_loss

LossFn = Callable[[Tensor, Tensor], Tensor]
Warn = Callable[[str], None]


class StepCheck:
    """Runs ``train_step`` and watches it: skipped steps, scale changes, non-finite steps.

    Args:
        model, optimizer, precision: the run's, as ``Trainer`` holds them.
        loss_fn: ``loss_fn(output, target)``.
        policy: the policy's name, for the messages.
        warn: called with one sentence per epoch that had a non-finite step.

    Example:
        >>> from ampkit.bench.policies import parse_policy
        >>> prec = Precision(parse_policy("bf16-mixed", "cpu"), torch.device("cpu"))
        >>> model, opt = prec.setup(nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> check = StepCheck(model, opt, prec, nn.functional.cross_entropy, "bf16-mixed", print)
        >>> check.begin_epoch(1, first_step=1)
        >>> loss = check.step(torch.ones(3, 4), torch.tensor([0, 1, 0]))
        >>> check.end_epoch()["nonfinite_steps"]
        0
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 precision: Precision, loss_fn: LossFn, policy: str, warn: Warn) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        # The re-run goes through the module DDP wraps: a collective in it (DDP's buffer
        # broadcast, its gradient all-reduce) would hang, since a rank whose own loss went
        # non-finite re-runs alone; and names are the model's own ("4", not "module.4").
        self._plain = (model.module if isinstance(model, nn.parallel.DistributedDataParallel)
                       else model)
        self._loss_fn, self._policy, self._warn = loss_fn, policy, warn
        self.scaled = precision.scaler.is_enabled()
        self._epoch = self._step = 0
        self._scales: list[Tensor] = []
        self._start_scale = 1.0
        self._skipped: list[int] = []
        self._bad_losses = 0
        self._found: Optional[dict[str, Any]] = None
        self._batch: Optional[tuple[Tensor, Tensor]] = None

    def begin_epoch(self, epoch: int, first_step: int) -> None:
        """Start counting an epoch whose first step is global step ``first_step`` (from 1)."""
        self._epoch, self._step = epoch, first_step - 1
        self._scales, self._skipped, self._bad_losses, self._found = [], [], 0, None
        # Before the first scale() this is the initial scale, without a sync; later one
        # sync per epoch.
        self._start_scale = self.precision.scaler.get_scale() if self.scaled else 1.0

    def step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One ``train_step`` with the checks; returns its loss, still on the device."""
        self._step += 1
        self._batch = (inputs, targets)
        loss = train_step(self.model, inputs, targets, self._checked_loss, self.optimizer,
                          self.precision)
        if self.scaled:
            scaler = self.precision.scaler
            used = self._scales[-1] if self._scales else self._start_scale
            self._scales.append(scaler.scale_tensor().detach().clone())  # type: ignore[union-attr]
            if scaler.last_step_skipped:  # known on the host already (see the module doc)
                self._skipped.append(self._step)
                if self._found is None:
                    self._locate(backward_scale=used)
        self._batch = None
        return loss

    def _checked_loss(self, output: Tensor, target: Tensor) -> Tensor:
        loss = self._loss_fn(output, target)
        # Unscaled steps only: the one host sync of such a step, before its backward (a
        # plain read: ~20x cheaper on a CPU than an isfinite kernel and its read).
        if not self.scaled and not math.isfinite(loss.item()):
            self._bad_losses += 1
            if self._found is None:
                self._locate(backward_scale=None)
        return loss

    def end_epoch(self) -> dict[str, Any]:
        """The epoch's entries for the log: ``scale_changes`` ([step, scale after it] where
        it changed; epoch 1 starts with [0, initial scale]), ``skipped_at`` (steps), both
        None without loss scaling; ``nonfinite_steps`` and ``nonfinite`` (the warning)."""
        changes: Optional[list[list[float]]] = None
        if self.scaled:
            first = self._step - len(self._scales) + 1
            values = torch.stack(self._scales).tolist() if self._scales else []  # one sync
            changes = [[first - 1, self._start_scale]] if first == 1 else []
            last = self._start_scale
            for offset, value in enumerate(values):
                if value != last:
                    changes.append([first + offset, value])
                    last = value
        self._scales = []
        return {"scale_changes": changes, "skipped_at": list(self._skipped) if self.scaled else None,
                "nonfinite_steps": len(self._skipped) if self.scaled else self._bad_losses,
                "nonfinite": self._found}

    # --- the re-run --------------------------------------------------------------------------
    def _locate(self, backward_scale: Any) -> None:
        """Run the step's batch again under ``watch``; warn naming the first non-finite module.

        ``backward_scale``: the loss scale the step used (a backward runs at it, after the
        step), or None for a forward only (an unscaled step, checked from inside its loss
        function, so before its own backward and in its autocast region).
        """
        assert self._batch is not None
        inputs, targets = self._batch
        # An unscaled step's check runs inside the step's own autocast region, whose one
        # reusable object must not be entered twice.
        region = self.precision.autocast if backward_scale is not None else contextlib.nullcontext()
        with _side_effects_undone(self._plain, self.optimizer), watch(self._plain) as watcher:
            with region, torch.set_grad_enabled(backward_scale is not None):
                loss = self._loss_fn(self._plain(inputs), targets)
            if backward_scale is not None:  # as GradScaler.scale does
                (loss.float() * backward_scale).backward()
        first = watcher.first_nonfinite
        message = self._message(first)
        self._found = {"step": self._step, "phase": first[0] if first else None,
                       "module": first[1] if first else None, "message": message}
        self._warn(message)

    def _message(self, first: Optional[tuple[str, str]]) -> str:
        where = f"step {self._step} (epoch {self._epoch}) under {self._policy}"
        after = ("; the step was skipped and the loss scale lowered" if self.scaled else
                 "; without loss scaling nothing skips the step, so the weights are likely "
                 "non-finite from here on")
        if first is None:
            return (f"{where} went non-finite{after}, but its batch run again under "
                    "ampkit.diagnose.watch stayed finite (a random op such as dropout, or the "
                    "loss function itself); `ampkit doctor` compares every module with fp32")
        phase, name = first
        module = self._plain.get_submodule(name)
        shown = f"{name or '<model>'!r} ({type(module).__name__})"
        if _has_nonfinite_params(module):
            return (f"{where}: module {shown} already holds non-finite parameters, written "
                    "by an earlier step whose gradients were non-finite" + after)
        half = self.precision.spec.policy.half_dtype
        # bf16 is advice only where it changes something: from fp16 (its range is fp32's).
        bf16 = " or train in bf16" if half == torch.float16 else ""
        if phase == "forward":
            # keep_fp32 replaces the model's selection: the call repeats the kept modules.
            names = [*kept_names(self._plain), name]
            fix = (f"keep it in fp32 (ampkit.keep_fp32(model, {names!r})){bf16}"
                   if half is not None else "the policy computes in fp32 throughout, so no "
                   "precision setting is the cause: check the model, its data and the "
                   "learning rate")
            return (f"{where}: the first non-finite value is the output of module {shown} in "
                    f"the forward pass{after}; {fix}; `ampkit doctor` compares every module "
                    "with fp32")
        return (f"{where}: the first non-finite value is a gradient of module {shown} in the "
                f"backward pass{after} (routine while dynamic loss scaling settles; if it "
                f"repeats, lower the initial scale{bf16})")


class PlainStep:
    """StepCheck's interface without the check: ``train_step`` alone (what a Trainer ran
    before the check; benchmarks/bench_train_check.py and the tests compare the two)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def begin_epoch(self, epoch: int, first_step: int) -> None:
        pass

    def step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        t = self.trainer
        return train_step(t.model, inputs, targets, classification_loss, t.optimizer,
                          t.precision)

    def end_epoch(self) -> dict[str, Any]:
        return {}


def _has_nonfinite_params(module: nn.Module) -> bool:
    params = [p.detach() for p in module.parameters(recurse=False) if p.is_floating_point()]
    return bool(params) and not all(bool(torch.isfinite(p).all()) for p in params)


@contextlib.contextmanager
def _side_effects_undone(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The re-run leaves no trace: same RNG, same buffers, no gradients.

    The re-run updates copies of the buffers (batch-norm statistics, fp8 amax histories),
    which are then swapped back for the originals: restoring them in place would bump
    their version, and an unscaled step's own graph, re-run from inside its loss function
    before its backward, has saved them.
    """
    originals = [(module, name, buffer) for module in model.modules()
                 for name, buffer in module.named_buffers(recurse=False)]
    cuda = [t.device for t in model.parameters() if t.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        try:
            for module, name, buffer in originals:
                setattr(module, name, buffer.detach().clone())
            yield
        finally:
            for module, name, buffer in originals:
                setattr(module, name, buffer)
            optimizer.zero_grad(set_to_none=True)
