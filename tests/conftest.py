"""Shared test setup: devices to parametrise over, gpu marker, and leak guards."""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import logging
import os
import sys
import zlib
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

# CI runs the property tests on a fixed example sequence, so a red run is reproducible
# and never depends on which random examples a clone happened to draw; a local run
# keeps exploring new examples.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# AMPKIT_DEBUG=1 makes the CLI re-raise instead of printing its one line: the tests check
# what a user sees by default, so a developer's own setting must not change them (nor
# the commands they run in subprocesses, which inherit this environment).
os.environ.pop("AMPKIT_DEBUG", None)

HAS_CUDA = torch.cuda.is_available()
# Parametrise with `@pytest.mark.parametrize("device", DEVICES)`: cuda cases carry the
# gpu marker and are skipped on a machine without one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HALF_DTYPES = [torch.float16, torch.bfloat16]

# torch's per-thread autocast state as a fresh process has it; every test must leave it so.
_AUTOCAST_DEVICES = ("cpu", "cuda")
_AUTOCAST_DEFAULTS = {d: torch.get_autocast_dtype(d) for d in _AUTOCAST_DEVICES}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _run_seed(config: pytest.Config) -> int | None:
    """pytest-randomly's seed for this run, or None when it is not loaded."""
    if not config.pluginmanager.hasplugin("randomly"):
        return None
    seed = config.getoption("randomly_seed", None)
    return seed if isinstance(seed, int) else None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    # randomly prints its seed in the header, which -q hides: say it where a failure is read.
    seed = _run_seed(config)
    if seed is not None:
        terminalreporter.write_line(f"Using --randomly-seed={seed} (pass it to rerun this order)")


def _autocast_nesting() -> int:
    torch.autocast_increment_nesting()
    return torch.autocast_decrement_nesting()


def _restore_torch_autocast() -> list[str]:
    """Put torch's autocast thread state back to a fresh process's; say what was left on."""
    leaks = []
    for device, default in _AUTOCAST_DEFAULTS.items():
        if torch.is_autocast_enabled(device):
            leaks.append(f"torch autocast left enabled on {device!r}")
            torch.set_autocast_enabled(device, False)
        dtype = torch.get_autocast_dtype(device)
        if dtype != default:
            leaks.append(f"torch autocast dtype of {device!r} left at {dtype}")
            torch.set_autocast_dtype(device, default)
    if not torch.is_autocast_cache_enabled():
        leaks.append("torch autocast cache left disabled")
        torch.set_autocast_cache_enabled(True)
    if _autocast_nesting():
        leaks.append(f"torch autocast nesting left at {_autocast_nesting()}")
        while torch.autocast_decrement_nesting() > 0:
            pass
    torch.clear_autocast_cache()
    return leaks


def _reset_ampkit() -> list[str]:
    """Put every process-global of ampkit back to its import-time value; say what leaked."""
    from ampkit import _orphan, _state, master, overrides, scaler
    from ampkit import _warn
    from ampkit.fp8 import attention as fp8_attention

    autocast = importlib.import_module("ampkit.autocast")  # ampkit.autocast is the class

    leaks = []
    if overrides._local.frames or overrides._open_regions:
        leaks.append(f"ampkit.autocast frames left open: {overrides._local.frames}")
        overrides._local.frames.clear()
        overrides._open_regions.clear()
    overrides.clear()  # also resets overrides._installed once the registry is empty
    _state.set_active(None)
    master._REGISTRY.clear()
    for handle in _orphan._ORPHAN_HOOK:
        handle.remove()
    _orphan._ORPHAN_HOOK.clear()
    _orphan._IS_ORPHAN.clear()
    autocast._RESOLVED.clear()
    autocast._CHECKED_DEVICES.clear()
    scaler._TAKES_GRAD_SCALER.clear()
    _warn.forget()
    regions = fp8_attention._regions
    if regions.entries or regions.mode is not None:
        leaks.append(f"ampkit.fp8.fp8_attention regions left open: {regions.entries}")
        if regions.mode is not None:
            regions.mode.__exit__(None, None, None)
        regions.entries.clear()
        regions.mode = None
    _clear_lru_caches()
    return leaks


def _clear_lru_caches() -> None:
    """Empty every functools cache defined in ampkit (device capabilities, ...)."""
    for name, module in list(sys.modules.items()):
        if name != "ampkit" and not name.startswith("ampkit."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper) and value.__module__ == name:
                value.cache_clear()


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts from a fresh process's globals, whatever ran before it.

    Resets ampkit's module state (overrides, the active initialize, the master registry,
    the orphan hook, autocast's and the capability caches, the fp8 warn-once set) and
    torch's autocast state, default dtype, grad mode, thread count, process group and the
    "ampkit" loggers. Seeds torch per test, as pytest-randomly seeds ``random``. A test
    that leaves an autocast region open (torch's or ampkit's) fails: no ampkit context
    manager may.
    """
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    threads = torch.get_num_threads()
    loggers = {name: logging.getLogger(name).level for name in ("ampkit", "ampkit.fp8")}
    # Each test's torch seed depends on the run's seed and its own name, never on the tests
    # that ran before it (pytest-randomly does the same for random and numpy).
    seed = (_run_seed(request.config) or 0) + zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed % 2**32)
    yield
    leaks = _restore_torch_autocast() + _reset_ampkit()
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for name, level in loggers.items():
        logging.getLogger(name).setLevel(level)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        leaks.append("a torch.distributed process group left initialized")
    if leaks:
        pytest.fail("the test left global state behind (now reset): " + "; ".join(leaks))


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group for the test, torn down after it (FSDP2 runs there as with
    more ranks). No gc.collect() first (0.2 s a test): FSDP2 on CPU leaves no thread or
    pending collective behind, unlike a DDP reducer (the DDP checkpoint tests keep their
    own fixture, which collects), so the group can go before the model."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class ModelOutputLike(collections.OrderedDict):
    """What transformers' ``ModelOutput`` is to ampkit's walkers: a dataclass subclass that
    is an OrderedDict of its non-None fields, read by attribute, by key and by index,
    whose ``update``/``pop``/``setdefault``/``del`` raise, whose item assignment sets the
    attribute too, and which copies through its fields (its ``__reduce__``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                super().__setitem__(f.name, value)

    def _refuse(self, *args, **kwargs):
        raise Exception(f"You cannot use this method on a {type(self).__name__} instance.")

    update = pop = setdefault = __delitem__ = _refuse

    def __getitem__(self, key):
        return self.to_tuple()[key] if isinstance(key, int) else super().__getitem__(key)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name, value) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __reduce__(self):
        args = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        return type(self), args, *super().__reduce__()[2:]

    def to_tuple(self) -> tuple:
        return tuple(self[k] for k in self.keys())
