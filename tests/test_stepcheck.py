"""``ampkit train``'s step check: a warning naming the module of a non-finite step, and
the loss-scale timeline (per change, and the skipped steps) in the JSON log and the
checkpoint.

The model overflows fp16 in a known layer: ``hot`` is Flatten, Linear, BatchNorm1d,
ReLU, then Linear '4' with weights 1e5 times too large (its outputs pass fp16's 65504:
inf under 16-mixed, finite in fp32 and bf16), ReLU, Linear. Synthetic data (2000
samples of 1x8x8), batch 256: 8 steps an epoch.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from torch import nn

import ampkit
from ampkit.bench.data import load_data
from ampkit.bench.policies import parse_policy
from ampkit.bench.precision import Precision
from ampkit.bench.stepcheck import PlainStep, StepCheck
from ampkit.bench.train import (Trainer, TrainSettings, load_checkpoint, loss_scale_timeline,
                                train)
from ampkit.cli import main

MODULE = "stepcheck_models_for_tests"
SOURCE = '''
import torch
from torch import nn

def hot():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():
        model[4].weight.mul_(1e5)
    return model
'''
STEPS = 8  # per epoch: 2000 samples, batch 256


@pytest.fixture
def hot(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    folder = tmp_path_factory.getbasetemp() / "stepcheck_models"
    folder.mkdir(exist_ok=True)
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(folder))
    return f"{MODULE}:hot"


def settings(model: str, policy: str, epochs: int = 1) -> TrainSettings:
    return TrainSettings(model=model, data="synthetic", policy=policy, epochs=epochs,
                         batch_size=256)


def test_train_warns_naming_the_module_and_logs_the_scale_timeline(capsys, tmp_path, hot):
    log, ckpt = tmp_path / "log.json", tmp_path / "run.pt"
    assert main(["train", "--model", hot, "--data", "synthetic", "--policy", "16-mixed",
                 "--epochs", "2", "--batch-size", "256", "--quiet", "--json", str(log),
                 "--checkpoint", str(ckpt)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2  # the first non-finite step of each epoch
    assert warnings[0].startswith("ampkit train: warning: step 1 (epoch 1) under 16-mixed: ")
    assert "output of module '4' (Linear) in the forward pass" in warnings[0]
    assert "skipped" in warnings[0] and "ampkit.keep_fp32(model, ['4'])" in warnings[0]
    assert warnings[1].startswith(f"ampkit train: warning: step {STEPS + 1} (epoch 2)")

    doc = json.loads(log.read_text())  # strict JSON: the NaN losses are "nan"
    assert doc["epochs"][0]["train_loss"] == "nan"
    timeline = doc["loss_scale_timeline"]
    # Every step overflows: each is skipped and halves the scale.
    assert timeline["skipped_steps"] == list(range(1, 2 * STEPS + 1))
    assert timeline["changes"] == [[step, 65536.0 / 2 ** step] for step in range(2 * STEPS + 1)]
    first = doc["epochs"][0]
    assert first["nonfinite"]["step"] == 1 and first["nonfinite_steps"] == STEPS
    assert (first["nonfinite"]["phase"], first["nonfinite"]["module"]) == ("forward", "4")
    # The checkpoint's history carries the same timeline.
    assert loss_scale_timeline(load_checkpoint(str(ckpt))["history"]) == timeline


def test_without_loss_scaling_the_loss_is_checked_before_the_step(hot):
    messages: list[str] = []
    log = train(settings(hot, "16-true"), on_warning=messages.append)
    assert len(messages) == 1 and "output of module '4' (Linear)" in messages[0]
    assert "nothing skips the step" in messages[0]
    record = log["epochs"][0]
    assert record["nonfinite_steps"] == STEPS  # the first step's NaN reached the weights
    assert record["scale_changes"] is None and log["loss_scale_timeline"] is None


def test_a_healthy_run_warns_nothing_and_keeps_its_scale():
    messages: list[str] = []
    log = train(settings("mlp", "16-mixed"), on_warning=messages.append)
    assert messages == []
    assert log["loss_scale_timeline"] == {"changes": [[0, 65536.0]], "skipped_steps": []}
    assert log["epochs"][0]["nonfinite"] is None and log["epochs"][0]["nonfinite_steps"] == 0


@pytest.mark.parametrize("policy, advice", [
    ("16-mixed", "keep it in fp32 (ampkit.keep_fp32(model, ['0'])) or train in bf16;"),
    ("bf16-mixed", "keep it in fp32 (ampkit.keep_fp32(model, ['0']));"),  # bf16 already
    ("O2-bf16", "keep it in fp32 (ampkit.keep_fp32(model, ['0']));"),
    ("32-true", "no precision setting is the cause"),
])
def test_the_warning_advises_bf16_only_where_the_policy_is_fp16(policy, advice):
    prec = Precision(parse_policy(policy, "cpu"), torch.device("cpu"))
    model, opt = prec.setup(nn.Sequential(nn.Linear(4, 2)),
                            lambda params: torch.optim.SGD(params, lr=0.1))
    check = StepCheck(model, opt, prec, nn.functional.cross_entropy, policy, lambda m: None)
    forward = check._message(("forward", "0"))
    assert advice in forward
    assert ("train in bf16" in forward) == (policy == "16-mixed")
    backward = check._message(("backward", "0"))
    assert ("train in bf16" in backward) == (policy == "16-mixed")


def test_the_keep_fp32_advice_keeps_the_modules_already_kept():
    prec = Precision(parse_policy("16-mixed", "cpu"), torch.device("cpu"))
    model = ampkit.keep_fp32(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), ["0"])
    model, opt = prec.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
    check = StepCheck(model, opt, prec, nn.functional.cross_entropy, "16-mixed", lambda m: None)
    assert "ampkit.keep_fp32(model, ['0', '1'])" in check._message(("forward", "1"))


@pytest.mark.parametrize("policy", ["16-mixed", "16-true"])
def test_the_rerun_leaves_no_trace(hot, policy):
    """Batch-norm statistics, weights, gradients and the RNG are as without the check."""
    data = load_data("synthetic")
    checked = Trainer(settings(hot, policy), data, warn=lambda message: None)
    plain = Trainer(settings(hot, policy), data)
    plain.check = PlainStep(plain)  # type: ignore[assignment]
    states = []
    for trainer in (checked, plain):
        torch.manual_seed(1)
        trainer.train_epoch(1)
        states.append((trainer.model.state_dict(), torch.get_rng_state()))
    (a, rng_a), (b, rng_b) = states
    assert checked.epoch_steps["nonfinite"]["module"] == "4"
    assert torch.equal(rng_a, rng_b) and a.keys() == b.keys()
    for key in a:  # NaN-aware: under 16-true the weights are NaN in both runs
        assert torch.equal(a[key].nan_to_num(), b[key].nan_to_num()), key
    assert all(p.grad is None for p in checked.model.parameters())
    if policy == "16-mixed":  # every step skipped: the statistics are those of the forwards
        assert math.isfinite(a["2.running_var"].sum().item())


def test_under_ddp_the_rerun_bypasses_the_wrapper(hot, monkeypatch):
    """A rank re-runs a non-finite step alone: through DDP, a collective would hang (and
    names would read 'module.4'); the re-run goes through the module DDP wraps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from _dist import free_ports

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_ports(1)[0]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    calls = []
    try:
        messages: list[str] = []
        s = settings(hot, "16-true")
        trainer = Trainer(s, load_data(s.data), messages.append,
                          wrap=lambda m: DDP(m))
        real_forward = DDP.forward
        monkeypatch.setattr(DDP, "forward", lambda self, *a, **k: calls.append(1) or
                            real_forward(self, *a, **k))
        trainer.train_epoch(1)
        del trainer
    finally:
        dist.destroy_process_group()
    assert len(messages) == 1 and "output of module '4' (Linear)" in messages[0]
    assert len(calls) == STEPS  # the steps went through DDP; the re-run did not
