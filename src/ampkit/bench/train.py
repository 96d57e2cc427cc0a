"""``ampkit train``: train a classifier under any policy, with checkpoints that resume exactly.

The step is the benchmark's ``train_step`` under the same ``Precision``, so what
``ampkit bench`` measures is what ``ampkit train`` runs; ``bench.stepcheck`` watches it
(a warning naming the module of a non-finite step, the loss-scale timeline).

Exact resumption: the initial weights come from the seed, each epoch's shuffle from
(seed, epoch) alone, and a checkpoint holds the model (fp32, the masters under O2), the
optimizer, the GradScaler and the amp state, written at the end of every epoch with the
sha256 digest of its bytes, which a resume checks (torch.load verifies no checksum).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .._measure import num_threads, threads_for
from .._reference import check_fp32_model
from ..fp8 import fp8_state_dict, load_fp8_state_dict
from .data import DATASETS, Dataset, load_data
from .policies import PolicySpec, loss_scaling_label, parse_policy
from .precision import Precision, adam_eps, adamw_factory
from .stepcheck import StepCheck, Warn
from .checkpoint_file import FORMAT, load_checkpoint, save_checkpoint  # noqa: F401 - re-exported
from .errors import UsageError
from .workloads import (call_user_function, classification_loss, make_cnn,
                        make_mlp, make_resnet18)

TRAIN_MODELS = "mlp, cnn, resnet18, or package.module:function"
# The entries of a checkpoint's state and the types they have.
_ENTRIES: dict[str, tuple[type, ...]] = {
    "settings": (dict,), "model": (dict,), "optimizer": (dict,), "scaler": (dict,),
    "amp": (dict, type(None)), "fp8": (dict,), "history": (list,)}
# Settings a resumed run must share with the checkpoint (epochs may grow).
_RESUME_KEYS = ("model", "data", "policy", "batch_size", "lr", "seed")
OnEpoch = Callable[[dict[str, Any]], None]
OnBatchFactory = Callable[[str], Callable[[int, int], None]]


@dataclass(frozen=True)
class TrainSettings:
    """Everything that defines a training run.

    Args:
        model: "mlp", "cnn", "resnet18" or "package.module:function" returning a model.
        data: "digits", "cifar10" or "synthetic". data_dir: CIFAR-10's folder.
        policy: a policy name as ``ampkit bench --policies`` takes it (O-levels too).
        epochs: total epochs (a resumed run continues up to this number).
        batch_size, lr (AdamW), seed (weights and shuffles), device.

    Example:
        >>> TrainSettings(data="synthetic", epochs=1).policy
        '32-true'
    """

    model: str = "mlp"
    data: str = "digits"
    data_dir: Optional[str] = None
    policy: str = "32-true"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {self.epochs}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a positive number, got {self.lr}")
        if self.data not in DATASETS:
            raise UsageError(f"unknown dataset {self.data!r}; valid: {', '.join(DATASETS)}")
        if self.data_dir is not None and self.data != "cifar10":
            raise UsageError(f"--data-dir {self.data_dir!r} is read only with --data cifar10, "
                             f"not --data {self.data}; valid: --data cifar10 --data-dir DIR, or "
                             "no --data-dir")


def build_classifier(name: str, data: Dataset) -> nn.Module:
    """A fresh fp32 classifier for the dataset's input shape (the caller seeds first)."""
    channels = data.input_shape[0]
    if name == "mlp":
        return make_mlp(math.prod(data.input_shape), 128, data.num_classes, layers=2)
    if name == "cnn":
        return make_cnn(channels, data.num_classes)
    if name == "resnet18":
        if channels != 3:
            raise UsageError(f"model 'resnet18' needs 3-channel images, {data.name} has "
                             f"{channels}; valid: --data cifar10, or --model mlp / cnn")
        return make_resnet18(data.num_classes)
    if ":" in name:
        return _user_classifier(name)
    raise UsageError(f"unknown model {name!r} for training; valid: {TRAIN_MODELS}")


_BUILT_IN = ("mlp", "cnn", "resnet18")  # build_classifier's own models


def check_train_model(name: str) -> None:
    """UsageError unless ``name`` is one of train's models or a package.module:function
    (checked before anything runs; what the function returns is checked when it runs)."""
    if name not in _BUILT_IN and ":" not in name:
        raise UsageError(f"unknown model {name!r} for training; valid: {TRAIN_MODELS}")


def _user_classifier(spec: str) -> nn.Module:
    result = call_user_function(spec, None, TRAIN_MODELS)
    model = result[0] if isinstance(result, (tuple, list)) and result else result
    if not isinstance(model, nn.Module):
        raise UsageError(f"model {spec!r} returned {type(result).__name__}; expected a "
                            "torch.nn.Module (or a tuple whose first item is one)")
    try:  # the policy casts an fp32 model, as bench's user models must be
        check_fp32_model(model, "ampkit train")
    except ValueError as err:
        raise UsageError(f"model {spec!r} returned a model whose {err}") from None
    return model


class Trainer:
    """Model, optimizer and precision of one run, with epoch, evaluation and checkpoints.

    Args:
        settings: the run's settings.
        data: the dataset (moved to the device once).
        warn: called with a sentence naming the module when a step goes non-finite (at
            most once per epoch; see ``bench.stepcheck``); default ``warnings.warn``.

    Example:
        >>> trainer = Trainer(TrainSettings(data="synthetic", epochs=1), load_data("synthetic"))
        >>> 0.0 <= trainer.evaluate()[1] <= 1.0
        True
    """

    def __init__(self, settings: TrainSettings, data: Dataset, warn: Optional[Warn] = None,
                 wrap: Optional[Callable[[nn.Module], nn.Module]] = None) -> None:
        self.settings = settings
        device = torch.device(settings.device)
        self.spec: PolicySpec = parse_policy(settings.policy, device.type)
        torch.manual_seed(settings.seed)  # same initial weights for every policy
        self.precision = Precision(self.spec, device)
        self.model, self.optimizer = self.precision.setup(
            build_classifier(settings.model, data), adamw_factory(self.spec.policy, settings.lr))
        if wrap is not None:  # after the policy (e.g. DDP, which must see O2's half params)
            self.model = wrap(self.model)
        self.data = Dataset(data.name, *(t.to(device) for t in (data.train_x, data.train_y,
                            data.test_x, data.test_y)), num_classes=data.num_classes)
        self.history: list[dict[str, Any]] = []
        # train() sets the epochs' threads; a resume takes them (CPU sums round by them)
        self.threads: Optional[int] = None
        self.check = StepCheck(self.model, self.optimizer, self.precision, classification_loss,
                               settings.policy, warn or _warn)
        self.epoch_steps: dict[str, Any] = {}  # the last epoch's StepCheck.end_epoch()

    def train_epoch(self, epoch: int, on_batch: Optional[Callable[[int, int], None]] = None) -> float:
        """One pass over the training set in the (seed, epoch) order; the mean loss."""
        self.model.train()
        x, y = self.data.train_x, self.data.train_y
        order = self.epoch_order(epoch).to(x.device)
        size = self.settings.batch_size
        # Summed on the device; one host sync per epoch, not per step.
        total = torch.zeros((), device=x.device)
        batches = math.ceil(len(order) / size)
        self.check.begin_epoch(epoch, first_step=(epoch - 1) * batches + 1)
        for b in range(batches):
            idx = order[b * size:(b + 1) * size]
            loss = self.check.step(x[idx], y[idx])  # train_step, watched (bench.stepcheck)
            total += loss.float() * len(idx)
            if on_batch is not None:
                on_batch(b + 1, batches)
        self.epoch_steps = self.check.end_epoch()
        return float(total.item()) / len(order)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The indices of the training samples this process trains on, in the (seed,
        epoch) order: all of them here (a rank of ``train --nproc`` takes its share)."""
        # Modulo 2**64, which torch takes whole (a negative seed wraps there alike).
        gen = torch.Generator().manual_seed((self.settings.seed * 1_000_003 + epoch) % 2**64)
        return torch.randperm(len(self.data.train_y), generator=gen)

    @torch.no_grad()
    def evaluate(self, chunk: int = 1024) -> tuple[float, float]:
        """Test loss and accuracy (a fraction) under the run's precision, in eval mode."""
        self.model.eval()
        x, y = self.data.test_x, self.data.test_y
        loss_sum = torch.zeros((), device=x.device)
        correct = torch.zeros((), dtype=torch.int64, device=x.device)
        for start in range(0, len(y), chunk):
            xs, ys = x[start:start + chunk], y[start:start + chunk]
            with self.precision.autocast:
                logits = self.model(xs)
            loss_sum += classification_loss(logits, ys) * len(ys)
            correct += (logits.argmax(dim=-1) == ys).sum()
        self.model.train()
        return float(loss_sum.item()) / len(y), int(correct.item()) / len(y)

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bitwise where this one stopped."""
        state = {"format": FORMAT, "settings": asdict(self.settings),
                 "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.precision.scaler.state_dict(), "amp": None,
                 "fp8": fp8_state_dict(self.model), "history": list(self.history),
                 "rng": _rng_state(), "threads": self.threads}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint written by a run with the same settings (epochs may differ).

        A checkpoint that does not fit raises UsageError. Its format, entries, settings,
        model keys and shapes and fp8 state are checked before anything loads; the
        optimizer's, scaler's and amp's own loaders check theirs as they load, so after an
        error the trainer is to be discarded (``train`` does).
        """
        _check_checkpoint(state, self.settings)
        _check_model_state(state["model"], self.model.state_dict())
        with _loading("fp8"):  # delayed-recipe amax histories, all checked before any loads
            load_fp8_state_dict(self.model, state["fp8"])
        with _loading("model"):  # fp32 values; under O2 into the masters too
            self.model.load_state_dict(state["model"])
        with _loading("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        with _loading("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
        self.history = list(state["history"])
        if state.get("rng") is not None:  # (checkpoints of an earlier ampkit have none)
            _set_rng_state(state["rng"])

    def save(self, path: str) -> None:
        """Write the checkpoint (see :func:`save_checkpoint`)."""
        save_checkpoint(self.state_dict(), path)


@contextlib.contextmanager
def _loading(entry: str) -> Iterator[None]:
    """Turn a loader's complaint about a checkpoint entry into a UsageError naming it."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise UsageError(f"its {entry!r} entry does not fit this run ({type(err).__name__}: "
                         f"{err}); valid: a checkpoint of this --model and --policy") from None


def _check_checkpoint(state: Any, settings: TrainSettings) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"not an ampkit train checkpoint (format {FORMAT!r} expected)")
    for entry, types in _ENTRIES.items():
        if not isinstance(state.get(entry), types):
            found = ("is missing" if entry not in state
                     else f"has type {type(state[entry]).__name__}")
            valid = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise UsageError(f"its {entry!r} entry {found}; valid: {valid}, as ampkit train "
                             "--checkpoint writes it")
    threads = state.get("threads")
    if threads is not None and (type(threads) is not int or threads < 1):
        raise UsageError(f"its 'threads' entry is {threads!r}; valid: None or an int >= 1, as "
                         "ampkit train --checkpoint writes it")
    rng = state.get("rng")
    if rng is not None and not _valid_rng(rng):
        raise UsageError("its 'rng' entry is not the random-number state ampkit train writes; "
                         "valid: {'cpu': a uint8 tensor, 'cuda': None or a list of them}")
    check_resume_settings(state["settings"], settings)
    done = len(state["history"])
    if done > settings.epochs:  # it would train nothing and report the checkpoint's epochs
        raise UsageError(f"it holds {done} finished epochs, more than --epochs "
                         f"{settings.epochs}; valid: --epochs {done} or more (a resumed run "
                         "continues up to --epochs)")


def _rng_state() -> dict[str, Any]:
    """The global generators' state: dropout and other random ops continue exactly."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _valid_rng(rng: Any) -> bool:
    def byte_state(t: Any) -> bool:
        return torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1
    return (isinstance(rng, dict) and byte_state(rng.get("cpu")) and
            (rng.get("cuda") is None or (isinstance(rng["cuda"], list)
                                         and all(byte_state(t) for t in rng["cuda"]))))


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def check_resume_settings(saved: dict[str, Any], settings: TrainSettings) -> None:
    """UsageError unless a checkpoint's settings match this run's (epochs may grow); a
    policy may be given by another name of the same policy ("fp32" for "32-true")."""
    for key in _RESUME_KEYS:
        if key == "policy" and _same_policy(saved, settings):
            continue
        if saved.get(key) != getattr(settings, key):
            raise UsageError(f"the checkpoint was written with {key}={saved.get(key)!r}, this run "
                             f"has {key}={getattr(settings, key)!r}; valid: the checkpoint's "
                             "settings, or leave out --resume")


def _same_policy(saved: dict[str, Any], settings: TrainSettings) -> bool:
    """Whether the checkpoint's policy, resolved on the device it was written on (an "O2"
    is fp16 on CUDA, bf16 on a CPU), is this run's policy on this run's device (the same
    Policy and fp8 recipe)."""
    try:
        old = parse_policy(saved.get("policy"), torch.device(saved.get("device")).type)
        new = parse_policy(settings.policy, torch.device(settings.device).type)
    except (UsageError, TypeError, ValueError, AttributeError, RuntimeError):  # not a name
        return False
    return (old.policy, old.fp8_recipe) == (new.policy, new.fp8_recipe)


def _check_model_state(saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same keys, and tensors of the same shapes, as this run's model state."""
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    if missing or unexpected:
        found = " and ".join(([f"lacks {missing[:3]}"] if missing else []) +
                             ([f"has unexpected keys {unexpected[:3]}"] if unexpected else []))
        raise UsageError(f"its model state {found}; valid: the state of this --model "
                         f"({len(expected)} keys: {', '.join(list(expected)[:3])}, ...)")
    for key, tensor in expected.items():
        value = saved[key]
        if torch.is_tensor(tensor) and not (torch.is_tensor(value) and value.shape == tensor.shape):
            found = (f"shape {tuple(value.shape)}" if torch.is_tensor(value)
                     else type(value).__name__)
            raise UsageError(f"its model state {key!r} has {found}; valid: shape "
                             f"{tuple(tensor.shape)} (this --model)")


def train(settings: TrainSettings, *, checkpoint: Optional[str] = None, resume: bool = False,
          on_epoch: Optional[OnEpoch] = None, on_batch: Optional[OnBatchFactory] = None,
          on_warning: Optional[Warn] = None,
          on_start: Optional[Callable[[Optional[int]], None]] = None,
          threads: Optional[int] = None) -> dict[str, Any]:
    """Train for ``settings.epochs`` epochs (continuing a checkpoint when ``resume``).

    Args:
        settings: the run. checkpoint: written after every epoch when given.
        resume: continue from ``checkpoint``. on_epoch: called with each epoch's record.
        on_start: called once the checkpoint, the data and the model are loaded (anything
            refused is refused before it), before the first epoch, with the epochs the
            checkpoint finished when resuming (else None).
        on_batch: called with a task label, returns a per-batch progress callback.
        on_warning: called with a sentence naming the module when a step goes non-finite
            (the first such step of an epoch); default ``warnings.warn``.
        threads: intra-op threads for the epochs (None: on a CPU, 1 for a model under 5M
            parameters, as ``ampkit bench`` takes); a resume takes the checkpoint's and
            refuses another. Restored after.

    Returns:
        The log: settings, resolved policy, one record per epoch, the final one, the
        ``loss_scale_timeline`` of the whole run (see :func:`loss_scale_timeline`), and
        the threads it ran with and why.
    """
    if resume and not checkpoint:
        raise UsageError("--resume needs --checkpoint PATH (the checkpoint to continue)")
    state = load_checkpoint(checkpoint) if resume and checkpoint else None
    data = load_data(settings.data, settings.data_dir)
    trainer = Trainer(settings, data, warn=on_warning)
    if state is not None:
        _resume(trainer, state, str(checkpoint))
    start = len(trainer.history)
    count, why = _threads(threads, state, settings, trainer)
    trainer.threads = count
    if on_start is not None:
        on_start(start if state is not None else None)
    with num_threads(count):
        for epoch in range(start + 1, settings.epochs + 1):
            record = run_epoch(trainer, epoch, on_batch)
            trainer.history.append(record)
            if checkpoint:
                trainer.save(checkpoint)
            if on_epoch is not None:
                on_epoch(record)
    return dict(train_log(trainer, data, start if state is not None else None),
                threads=count, threads_reason=why)


def _threads(requested: Optional[int], state: Optional[dict[str, Any]], settings: TrainSettings,
             trainer: Trainer) -> tuple[int, str]:
    """The epochs' threads and why; a resumed run's are the checkpoint's."""
    saved = None if state is None else state.get("threads")
    if saved is None:  # a fresh run, or a checkpoint written before it recorded them
        return threads_for(requested, torch.device(settings.device).type, lambda: trainer.model)
    if requested is not None and requested != saved:
        raise UsageError(f"--threads {requested}: the checkpoint ran on {saved} thread(s), and "
                         "another count rounds a CPU's sums differently, so the resumed run "
                         f"would not continue exactly; valid: --threads {saved}, or leave it out")
    return saved, f"{saved}, the checkpoint's (a resume continues on the same threads)"


def train_log(trainer: Trainer, data: Dataset, resumed_from: Optional[int]) -> dict[str, Any]:
    """The log of a finished run (what :func:`train` returns)."""
    settings = trainer.settings
    return {"settings": asdict(settings), "resolved_policy": trainer.spec.resolved,
            "adam_eps": adam_eps(trainer.spec.policy),
            "loss_scaling": loss_scaling_label(trainer.spec.policy),
            "data": data.describe(), "resumed_from_epoch": resumed_from,
            "epochs": trainer.history, "final": trainer.history[-1] if trainer.history else None,
            "loss_scale_timeline": loss_scale_timeline(trainer.history)}


def loss_scale_timeline(history: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The loss scale over a run, from its epoch records (a checkpoint's ``history``).

    Returns None without loss scaling, else {"changes": [[step, scale after it], ...]
    (starting with [0, initial scale]), "skipped_steps": [step, ...]}; steps are global
    and count from 1. Epochs logged before ampkit recorded it add nothing.
    """
    if not history or all(record.get("loss_scale") is None for record in history):
        return None
    return {"changes": [change for record in history for change in record.get("scale_changes") or []],
            "skipped_steps": [step for record in history for step in record.get("skipped_at") or []]}


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _resume(trainer: Trainer, state: dict[str, Any], path: str) -> None:
    try:
        trainer.load_state_dict(state)
    except UsageError as err:
        raise UsageError(f"--resume: checkpoint {path!r}: {err}") from None


def run_epoch(trainer: Trainer, epoch: int, on_batch: Optional[OnBatchFactory]) -> dict[str, Any]:
    """Train one epoch and evaluate: the epoch's record (losses, accuracy, loss scale)."""
    started = time.perf_counter()
    label = f"epoch {epoch}/{trainer.settings.epochs}"
    train_loss = trainer.train_epoch(epoch, on_batch(label) if on_batch is not None else None)
    test_loss, test_acc = trainer.evaluate()
    scaler = trainer.precision.scaler
    stats = scaler.stats() if scaler.is_enabled() else None
    return {"epoch": epoch, "train_loss": train_loss, "test_loss": test_loss,
            "test_acc": test_acc, "time_s": time.perf_counter() - started,
            "loss_scale": None if stats is None else stats.scale,
            "skipped_steps": None if stats is None else stats.skipped_steps,
            **trainer.epoch_steps}
