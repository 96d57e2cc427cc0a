"""Every docstring example in the library runs and prints what it says (STYLE rule 8: one
runnable example per public docstring); a stale example fails here, not in a user's shell."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ampkit

# What a module may need beyond torch (the fp8 attention kernels: Triton, which CI installs).
OPTIONAL = {"triton"}
MODULES = sorted(info.name for info in pkgutil.walk_packages(ampkit.__path__, "ampkit.")
                 if not info.name.endswith("__main__"))  # importing it runs the command


def test_every_module_is_found():
    assert {"ampkit.autocast", "ampkit.scaler", "ampkit.diagnose.request",
            "ampkit.bench.precision", "ampkit.fp8.linear"} <= set(MODULES)


@pytest.mark.filterwarnings("ignore:ampkit.fp8. no fp8 tensor cores")
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name not in OPTIONAL:
            raise
        pytest.skip(f"{name} needs {err.name}, which is not installed")
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
