"""load_checkpoint: a damaged DCP checkpoint is refused with the live state unchanged.

DCP reads in place into the tensors ``TrainState.state_dict()`` returned, which for the
FSDP2 and DDP (O0/O1/O3) paths are the live parameters and optimizer state, so plain
``dcp.load`` of a truncated shard file raises with part of the model overwritten.
``ampkit.distributed.load_checkpoint`` reads into copies and loads them only when every
rank read everything. In-process tests use a one-rank gloo group (the damage and the
refusal are the same with one rank); one two-rank spawn (slow) checks that a damaged
file of one rank is refused unchanged on every rank.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # a submodule: not imported with torch.distributed
from torch import nn

import ampkit
from ampkit._torch_compat import TORCH_VERSION
from ampkit.distributed import TrainState, load_checkpoint, shard

from _dist import free_ports, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
FSDP2 = pytest.mark.skipif(TORCH_VERSION < (2, 6) and not torch.cuda.is_available(),
                           reason="FSDP2 on the CPU needs torch 2.6 or later")
SPAWN_TIMEOUT_S = 240


class Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
                                     for _ in range(blocks)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(torch.relu(x))
        return self.head(x)


def _build(kind: str, blocks: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, ampkit.GradScaler]:
    """fsdp: shard(16-mixed); ddp_O1 / ddp_O2: initialize (fp16) then DDP; each with a scaler."""
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    if kind == "fsdp":
        model = shard(Net(blocks), "16-mixed")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), scaler
    model = Net(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=kind[-2:], verbosity=0,
                                         loss_scale=1.0)
    return nn.parallel.DistributedDataParallel(model), optimizer, scaler


def _steps(model, optimizer, scaler, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _snapshot(model, optimizer, scaler, state: dict) -> list:
    """Everything a load may change, as plain values and local tensors."""
    masters = list(ampkit.master_params(optimizer))  # the fp32 masters under O2
    tensors = [_local(t) for t in [*model.state_dict().values(), *masters]]
    opt_sd = optimizer.state_dict()
    tensors += [_local(v) for s in opt_sd["state"].values() for v in s.values()]
    groups = [{k: v for k, v in g.items()} for g in opt_sd["param_groups"]]
    return [tensors, repr(groups), scaler.state_dict(), scaler.get_scale(), state["step"]]


def _same(a: list, b: list) -> bool:
    return (len(a[0]) == len(b[0]) and
            all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[0], b[0]))
            and a[1:] == b[1:])


def _truncate(path: str, name: str) -> None:
    file = os.path.join(path, name)
    with open(file, "r+b") as fh:
        fh.truncate(os.path.getsize(file) // 2)


def _bad_header(path: str, name: str) -> None:
    """Overwrite the zip signature of the file's last item: the others read fine."""
    from torch.distributed.checkpoint import FileSystemReader

    infos = [info for info in FileSystemReader(path).read_metadata().storage_data.values()
             if info.relative_path == name]
    with open(os.path.join(path, name), "r+b") as fh:
        fh.seek(max(info.offset for info in infos))
        fh.write(b"XXXX")


DAMAGE = {"truncated": _truncate, "bad_header": _bad_header}


def _refused_unchanged(kind: str, rank: int, path: str, damage: str, file: str) -> bool:
    """Save after 2 steps, train on, damage ``file``: the load raises, nothing changes."""
    from torch.distributed.checkpoint.api import CheckpointException

    model, optimizer, scaler = _build(kind)
    _steps(model, optimizer, scaler, rank, range(2))
    dcp.save({"train": TrainState(model, optimizer, scaler),
                                       "step": 2}, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        DAMAGE[damage](path, file)
    dist.barrier()
    _steps(model, optimizer, scaler, rank, range(2, 5))
    state = {"train": TrainState(model, optimizer, scaler), "step": 5}
    before = _snapshot(model, optimizer, scaler, state)
    with pytest.raises(CheckpointException):  # a BaseException, raised on every rank
        load_checkpoint(state, checkpoint_id=path)
    return _same(before, _snapshot(model, optimizer, scaler, state))


def _resume(kind: str, rank: int, path: str) -> tuple[list[float], list[float]]:
    """Losses of steps 2-3 unbroken, and after load_checkpoint into a fresh build."""
    model, optimizer, scaler = _build(kind)
    _steps(model, optimizer, scaler, rank, range(2))
    dcp.save({"train": TrainState(model, optimizer, scaler),
                                       "step": 2}, checkpoint_id=path)
    unbroken = _steps(model, optimizer, scaler, rank, range(2, 4)) + [scaler.get_scale()]
    model, optimizer, scaler = _build(kind)
    state = {"train": TrainState(model, optimizer, scaler), "step": 0}
    load_checkpoint(state, checkpoint_id=path)
    assert state["step"] == 2 and isinstance(state["train"], TrainState)
    return unbroken, _steps(model, optimizer, scaler, rank, range(2, 4)) + [scaler.get_scale()]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        import gc

        gc.collect()  # the DDP reducers go before the group
        dist.destroy_process_group()


KINDS = [pytest.param("fsdp", marks=FSDP2), "ddp_O1", "ddp_O2"]


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_checkpoint_is_refused_unchanged(one_rank, tmp_path, kind, damage):
    assert _refused_unchanged(kind, 0, str(tmp_path), damage, "__0_0.distcp")


@pytest.mark.parametrize("kind", KINDS)
def test_a_good_checkpoint_resumes_bitwise(one_rank, tmp_path, kind):
    unbroken, resumed = _resume(kind, 0, str(tmp_path))
    assert resumed == unbroken  # losses and the scale: floats compare exactly


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_optimizer_stays_fresh_after_a_refused_load(one_rank, tmp_path, kind):
    """Loading needs optimizer state to read into (a zero-lr step creates it); a refused
    load drops it again, so a fresh run's first step is the same as without the try."""
    from torch.distributed.checkpoint.api import CheckpointException

    model, optimizer, scaler = _build(kind)
    _steps(model, optimizer, scaler, 0, range(1))
    dcp.save({"train": TrainState(model, optimizer, scaler)},
                                      checkpoint_id=str(tmp_path))
    _truncate(str(tmp_path), "__0_0.distcp")
    model, optimizer, scaler = _build(kind)
    with pytest.raises(CheckpointException):
        load_checkpoint({"train": TrainState(model, optimizer, scaler)},
                        checkpoint_id=str(tmp_path))
    assert not optimizer.state
    assert _steps(model, optimizer, scaler, 0, range(2)) == _steps(*_build(kind), 0, range(2))


@pytest.mark.parametrize("fresh", [False, True], ids=["trained", "fresh"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_larger_models_checkpoint_is_refused_before_anything_changes(one_rank, tmp_path,
                                                                         kind, fresh):
    """A 3-block model's checkpoint loaded into the 2-block model silently (FSDP2, DDP
    O1): DCP reads only the tensors it is asked for, so the shared layers took the other
    model's weights. Under O2 it was refused after the read, and a fresh optimizer kept
    the zero state made to read into."""
    model, optimizer, scaler = _build(kind, blocks=3)
    _steps(model, optimizer, scaler, 0, range(1))
    dcp.save({"train": TrainState(model, optimizer, scaler), "step": 1},
             checkpoint_id=str(tmp_path))
    model, optimizer, scaler = _build(kind)
    if not fresh:
        _steps(model, optimizer, scaler, 0, range(1))
    state = {"train": TrainState(model, optimizer, scaler), "step": 1}
    before = _snapshot(model, optimizer, scaler, state)
    with pytest.raises(ValueError, match=r"no place for, e.g. \['train.model.blocks.2."):
        load_checkpoint(state, checkpoint_id=str(tmp_path))
    assert _same(before, _snapshot(model, optimizer, scaler, state))
    assert bool(optimizer.state) is not fresh


@FSDP2
def test_fp32_tensors_loaded_into_half_ones_are_warned_about(one_rank, tmp_path):
    """A 16-mixed run (fp32 sharded params and Adam state) resumed as bf16-true was rounded
    silently (distributed probe); the same policy resumes without a warning."""
    model = shard(Net(), "16-mixed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**8)
    _steps(model, optimizer, scaler, 0, range(1))
    dcp.save({"train": TrainState(model, optimizer, scaler)}, checkpoint_id=str(tmp_path))
    same = shard(Net(), "16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint({"train": TrainState(same, torch.optim.AdamW(same.parameters()),
                                             ampkit.GradScaler("cpu"))},
                        checkpoint_id=str(tmp_path))
    half = shard(Net(), "bf16-true")
    with pytest.warns(UserWarning, match=r"load_checkpoint: \d+ tensor\(s\) of the checkpoint "
                                         r"load into narrower ones of this run, e.g. "
                                         r"'train.model.inp.weight': torch.float32 into "
                                         r"torch.bfloat16; they are rounded"):
        load_checkpoint({"train": TrainState(half, torch.optim.AdamW(half.parameters()),
                                             ampkit.GradScaler("cpu"))},
                        checkpoint_id=str(tmp_path))
    assert half.inp.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["ddp_O1"])
def test_a_parameter_frozen_since_the_save_still_loads(one_rank, tmp_path, kind):
    """The refusal of another model's tensors must not take optimizer state of a parameter
    this run froze (torch's get_state_dict makes none to read into) for one: the model
    loads, that state is dropped, as torch's set_state_dict does. (O2 keys the state by
    name itself and refuses any difference, as before.)"""
    model, optimizer, scaler = _build(kind)
    _steps(model, optimizer, scaler, 0, range(1))
    dcp.save({"train": TrainState(model, optimizer, scaler), "step": 1},
             checkpoint_id=str(tmp_path))
    saved = [_local(t) for t in model.state_dict().values()]
    net = Net()
    net.inp.requires_grad_(False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, optimizer = ampkit.initialize(net, optimizer, opt_level=kind[-2:], verbosity=0,
                                       loss_scale=1.0)
    model = nn.parallel.DistributedDataParallel(net)
    state = {"train": TrainState(model, optimizer, scaler), "step": 0}
    load_checkpoint(state, checkpoint_id=str(tmp_path))
    assert state["step"] == 1
    assert all(torch.equal(a, _local(b)) for a, b in zip(saved, model.state_dict().values()))


def test_plain_entries_load_in_place_as_with_dcp(one_rank, tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"t": torch.arange(4.0), "d": {"u": torch.ones(2), "n": 3}, "step": 7},
             checkpoint_id=str(tmp_path))
    t, u = torch.zeros(4), torch.zeros(2)
    nested = {"u": u, "n": 0}
    state = {"t": t, "d": nested, "step": 0}
    load_checkpoint(state, checkpoint_id=str(tmp_path))
    assert state["t"] is t and torch.equal(t, torch.arange(4.0))
    assert state["d"] is nested and nested["u"] is u and torch.equal(u, torch.ones(2))
    assert nested["n"] == 3 and state["step"] == 7
    with pytest.raises(TypeError, match="must be a dict"):
        load_checkpoint([t], checkpoint_id=str(tmp_path))


# --- two ranks: one rank's file damaged, every rank refuses unchanged --------------------------
def _worker(rank: int, port: int, out_dir: str, kinds: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    result = {}
    try:
        for kind in kinds:
            result[kind] = {
                damage: _refused_unchanged(kind, rank, f"{out_dir}/{kind}_{damage}", damage, file)
                for damage, file in (("truncated", "__1_0.distcp"), ("bad_header", "__0_0.distcp"))}
            result[kind]["resume"] = _resume(kind, rank, f"{out_dir}/{kind}_good")
            import gc

            gc.collect()  # DDP reducers and FSDP state go before the group
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_one_damaged_rank_file_is_refused_unchanged_on_every_rank(tmp_path):
    kinds = ["ddp_O1"] + (["fsdp"] if TORCH_VERSION >= (2, 6) else [])
    spawn(_worker, (free_ports(1)[0], str(tmp_path), kinds), 2, SPAWN_TIMEOUT_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        for kind in kinds:
            assert result[kind]["truncated"] and result[kind]["bad_header"]
            unbroken, resumed = result[kind]["resume"]
            assert resumed == unbroken
    assert ranks[0]["ddp_O1"]["resume"][0] != ranks[1]["ddp_O1"]["resume"][0]  # own batches
