"""Shared test setup: devices to parametrise over, gpu marker, and leak guards."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# CI runs the property tests on a fixed example sequence, so a red run is reproducible
# and never depends on which random examples a clone happened to draw; a local run
# keeps exploring new examples.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

HAS_CUDA = torch.cuda.is_available()
# Parametrise with `@pytest.mark.parametrize("device", DEVICES)`: cuda cases carry the
# gpu marker and are skipped on a machine without one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HALF_DTYPES = [torch.float16, torch.bfloat16]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leaks():
    """Each test starts with no overrides registered and no active initialize."""
    from ampkit import _state, overrides

    yield
    overrides.clear()
    _state.set_active(None)
