"""O2 under DistributedDataParallel: two CPU processes on gloo train one model together.

DDP reads ``param.grad`` after it is accumulated and writes the all-reduced gradient
back at the end of backward, so the masters must receive the reduced gradient, not the
local one (apex O2 + DDP was the usual multi-GPU setup).
"""

import gc
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampkit as amp
from ampkit.optim import master_weights_of

from _dist import free_ports, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
LOOPS = ("scale_loss", "gradscaler")



def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))


def _local_master_grads(rank: int, step_state: dict, half: torch.dtype) -> list[torch.Tensor]:
    """This rank's own (unreduced) master gradients for the same weights and batch."""
    model = _model()
    model.load_state_dict(step_state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, loss_scale=1.0)
    model(_batch(rank, 0)).float().pow(2).mean().backward()
    master_weights_of(opt).move_grads()  # no DDP here: the local gradient
    return [p.grad.clone() for p in amp.master_params(opt)]


def _train(rank: int, loop: str, half: torch.dtype) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = nn.parallel.DistributedDataParallel(model)
    scaler = amp.GradScaler("cpu") if loop == "gradscaler" else None
    grads = None
    for step in range(3):
        opt.zero_grad()
        loss = ddp(_batch(rank, step)).float().pow(2).mean()
        if scaler is None:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        if step == 0:
            grads = [p.grad.clone() for p in amp.master_params(opt)]
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    del ddp  # its reducer threads end before the process group is torn down
    local = _local_master_grads(rank, start, half)
    gathered = [[torch.zeros_like(g) for g in local] for _ in range(2)]
    for i, g in enumerate(local):
        parts = [torch.zeros_like(g) for _ in range(2)]
        dist.all_gather(parts, g)
        gathered[0][i], gathered[1][i] = parts
    mean = [(a + b) / 2 for a, b in zip(*gathered)]
    return {"weights": [p.float().flatten().tolist() for p in model.parameters()],
            "grad_err": max(float((g - m).abs().max() / m.abs().max()) for g, m in zip(grads, mean)),
            "local_differs": any(not torch.allclose(g, l) for g, l in zip(grads, local))}


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        result = {f"{loop}-{half}": _train(rank, loop, half)
                  for loop in LOOPS for half in (torch.float16, torch.bfloat16)}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        gc.collect()  # no DDP reducer may outlive the group ("terminate called" aborts)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_o2_under_ddp_steps_the_masters_with_the_reduced_gradients(tmp_path):
    spawn(_worker, (free_ports(1)[0], str(tmp_path)), 2, timeout_s=120)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(rank0) == 4
    for key in rank0:
        assert rank0[key]["weights"] == rank1[key]["weights"], key  # one model, bitwise
        for result in (rank0[key], rank1[key]):
            assert result["local_differs"], key  # the ranks' own gradients differ ...
            assert result["grad_err"] < 1e-2, key  # ... the masters got their mean


def _one_rank_run(loop: str, ddp: bool) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    scaler = amp.GradScaler("cpu") if loop == "gradscaler" else None
    for step in range(3):
        opt.zero_grad()
        loss = net(_batch(0, step)).float().pow(2).mean()
        if scaler is None:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    del net  # its reducer goes before the process group
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("loop", LOOPS)
def test_o2_under_one_rank_ddp_trains_as_without_ddp(loop):
    """The fast stand-in for the two-process test: the gradients DDP writes back at the end
    of backward reach the fp32 masters (one rank: their mean is the local gradient)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with_ddp = _one_rank_run(loop, ddp=True)
    finally:
        gc.collect()
        dist.destroy_process_group()
    start = [p.detach().float() for p in _model().parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(with_ddp, start))  # it trained
    assert all(torch.equal(a, b) for a, b in zip(with_ddp, _one_rank_run(loop, ddp=False)))
