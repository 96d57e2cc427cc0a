"""Built-in benchmark models and user ``package.module:function`` workloads.

A :class:`Workload` is everything one benchmark run needs besides the precision: a
model factory (called after seeding, so every policy starts from the same weights), a
fixed set of synthetic batches (made once, on the device, before any timing), and a
loss. Sizes depend on the device: the CUDA sizes match the reference figures in
GPU.md, the CPU sizes keep a default run under a minute on two cores.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._dtypes import iter_tensors, map_tensors
from .._loss import default_loss
from .._reference import check_fp32_model, copy_model
from .errors import UsageError, torchvision_install

# (inputs, targets): a built-in model's are two tensors; a user function's inputs are any
# batch ``call_model`` takes (a tensor, a tuple, a dict), its targets a tensor, None, or
# whatever its own loss_fn takes.
Batch = tuple[Any, Any]
LossFn = Callable[[Any, Any], Tensor]
BUILTIN_MODELS = ("mlp", "cnn", "resnet18", "gpt")
VALID_MODELS = ", ".join(BUILTIN_MODELS) + ", or package.module:function"


@dataclass(frozen=True)
class Workload:
    """One model, its synthetic batches and its loss.

    Args:
        name: the model name as given (``"gpt"``, ``"mypkg.models:make"``).
        build: returns a fresh fp32 model on the CPU (the caller seeds first).
        batches: returns the batches on a device; called once per policy.
        loss_fn: ``loss_fn(output, target)``; computed in fp32 whatever the output dtype.
        batch_size: samples per step (rows of the inputs).
        description: a few words for the report (sizes).

    Example:
        >>> w = get_workload("mlp", "cpu", batch_size=4)
        >>> w.build()(w.batches(torch.device("cpu"))[0][0]).shape
        torch.Size([4, 10])
    """

    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[torch.device], list[Batch]]
    loss_fn: LossFn
    batch_size: int
    description: str


# --- losses: fp32 whatever the model's output dtype (pure-half policies return half) ---
def mse_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output.float(), target.float())


def classification_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.float().flatten(0, -2), target.flatten())


# --- models ---------------------------------------------------------------------------
def make_mlp(in_features: int = 10, hidden: int = 100, out_features: int = 10,
             layers: int = 1) -> nn.Sequential:
    """The tutorial MLP: ``layers`` hidden Linear+ReLU blocks, then a Linear head."""
    blocks: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    blocks.append(nn.Linear(width, out_features))
    return nn.Sequential(*blocks)


class _ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


def make_cnn(in_channels: int = 3, num_classes: int = 10, width: int = 32) -> nn.Sequential:
    """A small ResNet-style net with batch-norm: stem, three residual stages, pool, head."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        _ResidualBlock(width, width, 1), _ResidualBlock(width, 2 * width, 2),
        _ResidualBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))


def make_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 (raises UsageError when torchvision is not installed)."""
    try:
        from torchvision.models import resnet18
    except ImportError:
        raise UsageError("model 'resnet18' needs torchvision, which is not installed "
                         f"({torchvision_install()}); valid here: mlp, cnn, gpt, or "
                         "package.module:function") from None
    return resnet18(num_classes=num_classes)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the small decoder-only transformer."""

    vocab: int = 512
    seq: int = 64
    dim: int = 128
    layers: int = 2
    heads: int = 4


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small decoder-only transformer (pre-norm blocks, causal SDPA, learned positions)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# --- synthetic batches: learnable, so loss curves fall and their deviations mean something ---
_NUM_BATCHES = 4  # distinct batches cycled through; made once, before any timing


def _regression_batches(gen: torch.Generator, batch: int, dim: int) -> list[Batch]:
    weight = torch.randn(dim, dim, generator=gen) / math.sqrt(dim)
    out = []
    for _ in range(_NUM_BATCHES):
        x = torch.randn(batch, dim, generator=gen)
        out.append((x, x @ weight + 0.01 * torch.randn(batch, dim, generator=gen)))
    return out


def _image_batches(gen: torch.Generator, batch: int, shape: tuple[int, ...],
                   classes: int) -> list[Batch]:
    prototypes = torch.randn(classes, *shape, generator=gen)
    out = []
    for _ in range(_NUM_BATCHES):
        y = torch.randint(0, classes, (batch,), generator=gen)
        out.append((prototypes[y] + torch.randn(batch, *shape, generator=gen), y))
    return out


def _token_batches(gen: torch.Generator, batch: int, cfg: GPTConfig) -> list[Batch]:
    # Each sequence counts up from a random start by a random stride (mod vocab): the next
    # token follows from the previous two, so a small transformer learns it within steps.
    out = []
    positions = torch.arange(cfg.seq + 1)
    for _ in range(_NUM_BATCHES):
        start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        tokens = (start + stride * positions) % cfg.vocab
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _on_device(make: Callable[[torch.Generator], list[Batch]],
               seed: int) -> Callable[[torch.device], list[Batch]]:
    def batches(device: torch.device) -> list[Batch]:
        # Made on the CPU from a seeded generator, so every device sees the same numbers.
        gen = torch.Generator().manual_seed(seed)
        return [(x.to(device), y.to(device)) for x, y in make(gen)]
    return batches


# Default batch sizes: (CPU, CUDA). The CUDA ones are GPU.md's reference workloads.
_DEFAULT_BATCH = {"mlp": (100, 100), "cnn": (32, 256), "resnet18": (16, 256), "gpt": (8, 16)}
_GPT_CUDA = GPTConfig(vocab=32768, seq=1024, dim=1024, layers=12, heads=16)


def get_workload(name: str, device: str, *, batch_size: Optional[int] = None,
                 seed: int = 0) -> Workload:
    """The workload for a model name: a built-in one or ``package.module:function``.

    Args:
        name: "mlp", "cnn", "resnet18", "gpt", or "package.module:function".
        device: the device the sizes are chosen for ("cpu", "cuda", "cuda:1").
        batch_size: samples per step; None: the model's default for the device.
        seed: seed of the synthetic data.

    Returns:
        The Workload. Raises UsageError naming the bad name and the valid ones.

    Example:
        >>> get_workload("gpt", "cpu").batch_size
        8
    """
    # Checked before a user function is called with it, as for a built-in model.
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size}")
    if ":" in name:
        return user_workload(name, batch_size)
    if name not in BUILTIN_MODELS:
        raise UsageError(f"unknown model {name!r}; valid: {VALID_MODELS}")
    cuda = torch.device(device).type == "cuda"
    batch = batch_size or _DEFAULT_BATCH[name][int(cuda)]
    return _BUILDERS[name](batch, cuda, seed)


def _mlp_workload(batch: int, cuda: bool, seed: int) -> Workload:
    return Workload("mlp", make_mlp, _on_device(lambda g: _regression_batches(g, batch, 10), seed),
                    mse_loss, batch, f"MLP 10-100-10, batch {batch}")


def _cnn_workload(batch: int, cuda: bool, seed: int) -> Workload:
    make = _on_device(lambda g: _image_batches(g, batch, (3, 32, 32), 10), seed)
    return Workload("cnn", make_cnn, make, classification_loss, batch,
                    f"ResNet-style CNN with batch-norm, 32x32, batch {batch}")


def _resnet18_workload(batch: int, cuda: bool, seed: int) -> Workload:
    make_resnet18(num_classes=1)  # fails now (no torchvision), not in the middle of a run
    make = _on_device(lambda g: _image_batches(g, batch, (3, 32, 32), 10), seed)
    return Workload("resnet18", make_resnet18, make, classification_loss, batch,
                    f"torchvision ResNet-18, 32x32, batch {batch}")


def _gpt_workload(batch: int, cuda: bool, seed: int) -> Workload:
    cfg = _GPT_CUDA if cuda else GPTConfig()
    return Workload("gpt", lambda: GPT(cfg), _on_device(lambda g: _token_batches(g, batch, cfg), seed),
                    classification_loss, batch,
                    f"GPT d={cfg.dim}, {cfg.layers} layers, seq {cfg.seq}, vocab {cfg.vocab}, "
                    f"batch {batch}")


_BUILDERS: dict[str, Callable[[int, bool, int], Workload]] = {
    "mlp": _mlp_workload, "cnn": _cnn_workload, "resnet18": _resnet18_workload,
    "gpt": _gpt_workload,
}


# --- user workloads: "package.module:function" -> (model, (inputs, targets)[, loss_fn]) ---
_EXPECTED = ("expected (torch.nn.Module, (inputs, targets)) or "
             "(torch.nn.Module, (inputs, targets), loss_fn) with loss_fn(output, targets) -> "
             "loss; inputs: a tensor or a list of tensors (model(inputs)), a tuple of tensors "
             "(model(*inputs)) or a dict of them (model(**inputs)); targets: a tensor, or "
             "None (the loss is then the mean output, or loss_fn's)")


def load_user_function(spec: str, valid: str = VALID_MODELS) -> Callable[..., Any]:
    """Import ``package.module:function`` (the current directory is on the path, as for -m).

    ``valid``: the models the command takes, named in its errors.
    """
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name.isidentifier():
        raise UsageError(f"model {spec!r} is not of the form package.module:function; "
                         f"valid: {valid}")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        dotted = module_name[:-3] if module_name.endswith(".py") else module_name
        dotted = dotted.strip("./").replace("/", ".").replace(os.sep, ".")
        raise UsageError(f"model {spec!r} names a file; valid: its import name (the current "
                         f"folder is on the path), e.g. {dotted}:{func_name}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user module can fail in any way: report it in one line
        raise UsageError(f"model {spec!r}: cannot import {module_name!r} "
                         f"({type(err).__name__}: {err}); valid: {valid}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        what = (f"no function {func_name!r}" if func is None else
                f"{func_name!r}, but it is not a function (type {type(func).__name__})")
        raise UsageError(f"model {spec!r}: module {module_name!r} has {what}; valid: {valid}")
    return func


def call_user_function(spec: str, batch_size: Optional[int], valid: str = VALID_MODELS) -> Any:
    """Call the user's function, passing ``batch_size`` when it takes that keyword."""
    func = load_user_function(spec, valid)
    kwargs: dict[str, Any] = {}
    if batch_size is not None:
        if not _takes_batch_size(func):
            raise UsageError(f"--batch-size {batch_size} given, but model {spec!r} takes no "
                                "batch_size keyword; valid: leave out --batch-size, or add "
                                "a batch_size parameter to the function")
        kwargs["batch_size"] = batch_size
    try:
        return func(**kwargs)
    except Exception as err:
        raise UsageError(f"model {spec!r}: calling it raised {type(err).__name__}: {err}") from None


def _takes_batch_size(func: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "batch_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def user_workload(spec: str, batch_size: Optional[int] = None) -> Workload:
    """A Workload from a user function returning (model, (inputs, targets)[, loss_fn])."""
    result = call_user_function(spec, batch_size)
    model, (inputs, targets), loss_fn = _check_user_result(spec, result)

    def build() -> nn.Module:
        # A copy of the one model the function returned: every policy starts from the
        # same weights whether or not the function seeds itself.
        return copy_model(model, "the command")

    def batches(device: torch.device) -> list[Batch]:
        def move(tensor: Tensor) -> Tensor:
            return tensor.to(device)
        return [(map_tensors(inputs, move), map_tensors(targets, move))]

    if loss_fn is None:
        loss_fn = _default_loss(spec, targets)
    first = next(iter_tensors(inputs))  # the rows of the batch: its first tensor's
    return Workload(spec, build, batches, loss_fn, int(first.shape[0]) if first.dim() else 1,
                    f"{spec}, batch {_shapes(inputs)}")


def _default_loss(spec: str, targets: Optional[Tensor]) -> LossFn:
    """The loss of a user workload without loss_fn: cross-entropy for integer targets, MSE
    for floating ones, the mean output without targets (``inspect``'s rule); a model
    output that is not a tensor is refused saying what to return."""
    rule = (default_loss if targets is None else
            mse_loss if targets.is_floating_point() else classification_loss)

    def loss(output: Any, target: Any) -> Tensor:
        if not isinstance(output, Tensor):
            raise TypeError(f"model {spec!r} returned a {type(output).__name__} from its "
                            "forward, not a tensor, and no loss_fn; valid: return (model, "
                            "(inputs, targets), loss_fn) with loss_fn(output, target) -> loss")
        return rule(output, target)
    return loss


def _check_user_result(spec: str, result: Any) -> tuple[nn.Module, Batch, Optional[LossFn]]:
    ok = (isinstance(result, (tuple, list)) and len(result) in (2, 3)
          and isinstance(result[0], nn.Module) and isinstance(result[1], (tuple, list))
          and len(result[1]) == 2 and (len(result) == 2 or callable(result[2])))
    if ok:
        inputs, targets = result[1]
        ok = (_is_batch(inputs) and
              (len(result) == 3 or targets is None or isinstance(targets, Tensor)))
    if not ok:
        raise UsageError(f"model {spec!r} returned {_describe(result)}; {_EXPECTED}")
    try:  # every command compares policies from these weights, fp32 (32-true) first
        check_fp32_model(result[0], "the command")
    except ValueError as err:
        raise UsageError(f"model {spec!r} returned a model whose {err}") from None
    loss_fn = result[2] if len(result) == 3 else None
    return result[0], (result[1][0], result[1][1]), loss_fn


def _is_batch(inputs: Any) -> bool:
    """A tensor, or a tuple, list or mapping holding tensors (at least one: the batch's rows)."""
    if isinstance(inputs, Tensor):
        return True
    if isinstance(inputs, (tuple, list, abc.Mapping)):
        return next(iter_tensors(inputs), None) is not None
    return False


def _shapes(inputs: Any) -> str:
    """A batch for the report: a tensor's shape, ``(8, 16)``, or its structure's."""
    return str(tuple(inputs.shape)) if isinstance(inputs, Tensor) else _describe(inputs)


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value[:4])
        inner += ", ..." if len(value) > 4 else ""
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, abc.Mapping):
        items = list(value.items())
        inner = ", ".join(f"{k!r}: {_describe(v)}" for k, v in items[:4])
        return f"{{{inner}{', ...' if len(items) > 4 else ''}}}"
    if isinstance(value, Tensor):
        return f"Tensor{tuple(value.shape)}"
    return type(value).__name__
