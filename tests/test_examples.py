"""The three tutorial programs in examples/ run unchanged (tiny sizes) and do what they say."""

from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from ampkit._dtypes import autocast_default_dtype
from conftest import DEVICES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LOSS = re.compile(r"loss (\S+) -> (\S+) after")


def _run(name: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def _improved(line: str) -> bool:
    first, last = map(float, LOSS.search(line).groups())
    return last < first


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_autocast_gradscaler(device, monkeypatch, capsys):
    out = _run("mlp_autocast_gradscaler.py", ["--steps", "8", "--batch", "16", "--device", device],
               monkeypatch, capsys).splitlines()
    assert out[0] == f"output dtype {autocast_default_dtype(device)}, loss dtype torch.float32"
    assert _improved(out[1]) and out[1].endswith("scale 65536")


@pytest.mark.parametrize("device", DEVICES)
def test_apex_o1(device, monkeypatch, capsys):
    out = _run("apex_o1.py", ["--steps", "8", "--batch", "16", "--device", device],
               monkeypatch, capsys).splitlines()
    assert out[0] == "output dtype torch.float32, loss dtype torch.float32"
    assert _improved(out[1]) and out[1].endswith("loss scale 65536")


SKIPS = re.compile(r"; (\d+) skipped for inf/NaN gradients, loss scale (\S+)$")


@pytest.mark.parametrize("device", DEVICES)
def test_apex_o2_torch_loop(device, monkeypatch, capsys):
    out = _run("apex_o2_torch_loop.py", ["--steps", "8", "--batch", "8", "--image-size", "8",
                                         "--models", "linear,cnn", "--device", device],
               monkeypatch, capsys).splitlines()
    half = autocast_default_dtype(device)
    dtypes = f"(params {half}, masters torch.float32, loss torch.float32); "
    assert [line.split(":")[0] for line in out] == ["linear", "cnn"]
    for line in out:
        assert _improved(line) and dtypes in line and SKIPS.search(line), line
    # ResNet-18 (where torchvision is installed, as on the GPU machine): more steps, since
    # with fp16 the first ~4 overflow at the initial scale 2**16 and are skipped (the
    # scaler halves the scale each time); the example gives it 32x32 images (see its doc).
    out = _run("apex_o2_torch_loop.py", ["--steps", "16", "--batch", "8", "--image-size", "8",
                                         "--models", "resnet18", "--device", device],
               monkeypatch, capsys).splitlines()
    if importlib.util.find_spec("torchvision") is None:
        assert out == ["resnet18: skipped (No module named 'torchvision')"]
        return
    line = out[0]
    skipped, scale = SKIPS.search(line).groups()
    assert line.startswith("resnet18:") and dtypes in line, line
    assert int(skipped) <= 8, line  # at least half of the steps stepped
    assert float(scale) >= 2.0 ** 8, line
    assert _improved(line), line
