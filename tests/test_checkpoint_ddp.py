"""TrainState with a DDP model at O2: DCP save/load of an optimizer that steps fp32 masters.

torch's ``get_state_dict`` keys the optimizer state by the model's parameters, which an
O2 optimizer does not hold (it steps their fp32 masters), so TrainState keys that state
by the model's parameter names itself. In-process tests use a one-rank gloo group; one
two-rank spawn checks the bitwise resume.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampkit
from ampkit.distributed import TrainState

from _dist import free_ports, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
SPAWN_TIMEOUT_S = 180


def _net(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.ReLU(), nn.Linear(width, 4))


def _fresh(opt_level: str = "O2", width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=opt_level,
                                         half_dtype=torch.bfloat16, verbosity=0)
    return nn.parallel.DistributedDataParallel(model), optimizer


def _steps(ddp: nn.Module, optimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        loss = ddp(x).float().pow(2).mean()
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        import gc

        gc.collect()  # the DDP reducers go before the group
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:ampkit.initialize. opt_level O3")
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_dcp_round_trip_of_a_ddp_model_at_every_level(one_rank, tmp_path, opt_level):
    import torch.distributed.checkpoint as dcp

    ddp, optimizer = _fresh(opt_level)
    _steps(ddp, optimizer, 0, range(2))
    dcp.save({"train": TrainState(ddp, optimizer)}, checkpoint_id=str(tmp_path))
    after = _steps(ddp, optimizer, 0, range(2, 4))
    ddp, optimizer = _fresh(opt_level)
    dcp.load({"train": TrainState(ddp, optimizer)}, checkpoint_id=str(tmp_path))
    assert _steps(ddp, optimizer, 0, range(2, 4)) == after  # bitwise


def test_o2_state_is_keyed_by_the_model_parameter_names(one_rank):
    ddp, optimizer = _fresh("O2")
    _steps(ddp, optimizer, 0, range(1))
    state = TrainState(ddp, optimizer).state_dict()
    names = [name for name, _ in ddp.module.named_parameters()]
    assert list(state["model"]) == list(ddp.module.state_dict())  # no "module." prefix
    assert list(state["optimizer"]["state"]) == names
    assert state["optimizer"]["param_groups"][0]["params"] == names
    assert all(v.dtype == torch.float32 for v in state["optimizer"]["state"]["0.weight"].values()
               if v.dim() > 0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_load_of_another_model_changes_nothing(one_rank, tmp_path, level):
    """A checkpoint of a wider model: refused, and neither model nor optimizer changes.
    (torch 2.5's DCP read the wider tensors into the narrower ones, in part, silently.)"""
    import torch.distributed.checkpoint as dcp
    from ampkit.distributed import load_checkpoint

    ddp, optimizer = _fresh(level, width=32)
    _steps(ddp, optimizer, 0, range(1))
    dcp.save({"train": TrainState(ddp, optimizer)}, checkpoint_id=str(tmp_path))
    ddp, optimizer = _fresh(level)
    _steps(ddp, optimizer, 0, range(1))
    before = [p.clone() for p in ddp.parameters()] + [
        v.clone() for s in optimizer.state.values() for v in s.values()]
    train = TrainState(ddp, optimizer)
    with pytest.raises(ValueError, match=r"the checkpoint's 'train.model.0.weight' has shape "
                                         r"\(32, 8\), this run's has \(16, 8\)"):
        load_checkpoint({"train": train}, checkpoint_id=str(tmp_path))
    after = list(ddp.parameters()) + [v for s in optimizer.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    if level == "O1":
        return
    after = list(ddp.parameters()) + [v for s in optimizer.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match=r"optimizer state lacks \['0.bias'"):
        state = train.state_dict()
        del state["optimizer"]["state"]["0.bias"]
        train.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        ddp, optimizer = _fresh("O2")
        before = _steps(ddp, optimizer, rank, range(3))
        dcp.save({"train": TrainState(ddp, optimizer), "step": 3}, checkpoint_id=f"{out_dir}/ckpt")
        unbroken = _steps(ddp, optimizer, rank, range(3, 6))
        del ddp
        ddp, optimizer = _fresh("O2")
        state = {"train": TrainState(ddp, optimizer), "step": 0}
        dcp.load(state, checkpoint_id=f"{out_dir}/ckpt")
        resumed = _steps(ddp, optimizer, rank, range(state["step"], 6))
        del ddp
        import gc

        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(f"{out_dir}/rank{rank}.json").write_text(
        json.dumps({"before": before, "unbroken": unbroken, "resumed": resumed}))


@pytest.mark.slow
def test_o2_ddp_dcp_resume_is_bitwise_on_two_ranks(tmp_path):
    spawn(_worker, (free_ports(1)[0], str(tmp_path)), 2, SPAWN_TIMEOUT_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["resumed"] == result["unbroken"]  # floats compare exactly
    assert ranks[0]["unbroken"] != ranks[1]["unbroken"]  # each rank its own batches


def _build_for(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fp16 run of ``kind``: "ddp-O1" / "ddp-O2" (initialize, then DDP) or "fsdp" (shard)."""
    model = _net()
    if kind == "fsdp":
        from ampkit.distributed import shard
        model = shard(model, "16-mixed", modules=["1", "3"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=kind[-2:],
                                         half_dtype=torch.float16, verbosity=0)
    return nn.parallel.DistributedDataParallel(model), optimizer


def _scaled_steps(model, optimizer, scaler, steps: range, overflow: tuple = ()) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        with ampkit.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss * math.inf if step in overflow else loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses


_FSDP2_ON_CPU = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 6)


@pytest.mark.parametrize("kind", ["ddp-O1", "ddp-O2", pytest.param("fsdp", marks=pytest.mark.skipif(
    not _FSDP2_ON_CPU, reason="FSDP2 on the CPU needs torch 2.6 or later"))])
@pytest.mark.parametrize("saved_after", [0, 1])
def test_a_save_before_the_first_step_that_was_not_skipped_resumes_exactly(one_rank, tmp_path,
                                                                           kind, saved_after):
    """Saved after a skipped first step (grads left in place), a torch-path checkpoint had
    no optimizer state and no fresh optimizer could load it (DCP: missing key ...step);
    an O2 one, or a save before any step, gave the saving run's optimizer a step at lr 0
    (Adam's step count then ran one ahead of a run that never saved)."""
    import torch.distributed.checkpoint as dcp
    from ampkit.distributed import load_checkpoint

    model, optimizer = _build_for(kind)
    reference = _scaled_steps(model, optimizer, ampkit.GradScaler("cpu"), range(4), (0,))
    model, optimizer = _build_for(kind)
    scaler = ampkit.GradScaler("cpu")
    first = _scaled_steps(model, optimizer, scaler, range(saved_after), (0,))
    dcp.save({"train": TrainState(model, optimizer, scaler)}, checkpoint_id=str(tmp_path))
    assert not optimizer.state  # the saving run's optimizer is left fresh
    assert first + _scaled_steps(model, optimizer, scaler, range(saved_after, 4), (0,)) == reference
    for load in (load_checkpoint, dcp.load):
        model, optimizer = _build_for(kind)
        scaler = ampkit.GradScaler("cpu")
        load({"train": TrainState(model, optimizer, scaler)}, checkpoint_id=str(tmp_path))
        assert not optimizer.state, load
        resumed = _scaled_steps(model, optimizer, scaler, range(saved_after, 4), (0,))
        assert first + resumed == reference, load


def test_a_checkpoint_saved_without_the_fresh_key_still_loads(one_rank, tmp_path, monkeypatch):
    """A checkpoint written before TrainState saved "fresh_optimizer" loads through
    load_checkpoint (the key is read only where the checkpoint has it); plain dcp.load
    refuses it (DCP's planner wants every key it is given), changing nothing."""
    import torch.distributed.checkpoint as dcp
    from ampkit.distributed import load_checkpoint

    ddp, optimizer = _fresh("O1")
    _steps(ddp, optimizer, 0, range(2))
    state_dict = TrainState.state_dict
    with monkeypatch.context() as patch:
        patch.setattr(TrainState, "state_dict",
                      lambda self: {k: v for k, v in state_dict(self).items()
                                    if k != "fresh_optimizer"})
        dcp.save({"train": TrainState(ddp, optimizer)}, checkpoint_id=str(tmp_path))
    after = _steps(ddp, optimizer, 0, range(2, 4))
    ddp, optimizer = _fresh("O1")
    with pytest.raises(BaseException, match="train.fresh_optimizer"):  # CheckpointException
        dcp.load({"train": TrainState(ddp, optimizer)}, checkpoint_id=str(tmp_path))
    assert not optimizer.state
    load_checkpoint({"train": TrainState(ddp, optimizer)}, checkpoint_id=str(tmp_path))
    assert _steps(ddp, optimizer, 0, range(2, 4)) == after
