"""Datasets for ``ampkit train``: scikit-learn's digits, CIFAR-10 from local files, synthetic.

Nothing is ever downloaded: digits ship inside scikit-learn (the ``cli`` extra), CIFAR-10
must already be on disk (torchvision's "python version" layout), and the synthetic set
is made from a seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import UsageError, torchvision_install
from torch import Tensor

DATASETS = ("digits", "cifar10", "synthetic")
_SPLIT_SEED = 0  # the train/test split never depends on the training seed



@dataclass(frozen=True)
class Dataset:
    """A classification dataset held as tensors (images NCHW, labels int64).

    Example:
        >>> ds = load_data("synthetic")
        >>> ds.train_x.shape[1:], ds.num_classes
        (torch.Size([1, 8, 8]), 10)
    """

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_y)} train / {len(self.test_y)} test samples of "
                f"{'x'.join(map(str, self.input_shape))}, {self.num_classes} classes")


def load_data(name: str, data_dir: Optional[str] = None) -> Dataset:
    """Load a dataset by name; UsageError names what is missing and the valid choices.

    Args:
        name: "digits", "cifar10" or "synthetic".
        data_dir: the folder holding ``cifar-10-batches-py`` (cifar10 only).
    """
    if name == "digits":
        return load_digits()
    if name == "cifar10":
        return load_cifar10(data_dir)
    if name == "synthetic":
        return synthetic()
    raise UsageError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")


def _split(x: Tensor, y: Tensor, test_fraction: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def load_digits() -> Dataset:
    """The 1797 8x8 handwritten digits of scikit-learn, 80/20 split, pixels scaled to [-1, 1]."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise UsageError("--data digits needs scikit-learn, which is not installed; valid: "
                        "pip install 'ampkit[cli]' (or scikit-learn), or --data synthetic, "
                        "or --data cifar10 --data-dir DIR") from None
    bunch = sklearn_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).view(-1, 1, 8, 8) / 8.0 - 1.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    return Dataset("digits", *_split(x, y, 0.2), num_classes=10)


def load_cifar10(data_dir: Optional[str]) -> Dataset:
    """CIFAR-10 from ``data_dir`` via torchvision (download=False), normalised per channel."""
    if not data_dir:
        raise UsageError("--data cifar10 needs --data-dir DIR, a folder holding "
                        "cifar-10-batches-py; ampkit never downloads")
    if not os.path.isdir(data_dir) or not os.access(data_dir, os.R_OK):
        raise UsageError(f"--data-dir {data_dir!r} is not a readable folder; valid: a folder "
                        "holding cifar-10-batches-py (the python version of CIFAR-10)")
    try:
        from torchvision.datasets import CIFAR10
    except ImportError:
        raise UsageError("--data cifar10 needs torchvision, which is not installed; valid: "
                         f"{torchvision_install()}, or --data digits / synthetic") from None
    try:
        train, test = (CIFAR10(data_dir, train=flag, download=False) for flag in (True, False))
    except (RuntimeError, OSError) as err:
        raise UsageError(f"--data-dir {data_dir!r} holds no readable CIFAR-10 ({err}); valid: "
                        "a folder holding cifar-10-batches-py; ampkit never downloads") from None
    train_x, test_x = (torch.from_numpy(d.data).permute(0, 3, 1, 2).float() / 255 for d in (train, test))
    mean = train_x.mean(dim=(0, 2, 3), keepdim=True)
    std = train_x.std(dim=(0, 2, 3), keepdim=True)
    return Dataset("cifar10", (train_x - mean) / std, torch.tensor(train.targets),
                   (test_x - mean) / std, torch.tensor(test.targets), num_classes=10)


def synthetic(classes: int = 10, train: int = 2000, test: int = 500) -> Dataset:
    """Noisy class prototypes shaped like digits (1x8x8): learnable, not trivially."""
    gen = torch.Generator().manual_seed(_SPLIT_SEED)
    prototypes = torch.randn(classes, 1, 8, 8, generator=gen)
    y = torch.randint(0, classes, (train + test,), generator=gen)
    x = prototypes[y] + 1.5 * torch.randn(train + test, 1, 8, 8, generator=gen)
    return Dataset("synthetic", x[:train], y[:train], x[train:], y[train:], num_classes=classes)
