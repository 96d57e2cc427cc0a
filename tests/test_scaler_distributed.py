"""process_group: two CPU processes on gloo, one of them given an inf, skip together."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampkit.scaler import GradScaler

from _dist import free_ports, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")



def _run(rank, kind, group, both=False):
    """Three iterations; rank 1's gradient (with ``both``, every rank's) holds an inf in
    the second."""
    param = nn.Parameter(torch.ones(4))
    opt = (torch.optim.AdamW([param], lr=0.1, fused=True) if kind == "fused"
           else torch.optim.SGD([param], lr=0.1))
    scaler = GradScaler("cpu", init_scale=8.0, process_group=group)
    skipped = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        if (rank == 1 or both) and step == 1:
            param.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    stats = scaler.stats()
    return {"param": param.tolist(), "skipped": skipped,
            "stats": [stats.scale, stats.steps, stats.skipped_steps, stats.consecutive_skips]}


def _apply_update_reduces_in_place(rank, group):
    scaler = GradScaler("cpu", init_scale=8.0, process_group=group)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    found_inf = torch.tensor(float(rank == 0))
    scaler._apply_update(found_inf)  # the frontend's path: found_inf not all-reduced yet
    return [found_inf.item(), scaler.get_scale()]


def _worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        group = dist.new_group([0, 1])
        result = {kind: _run(rank, kind, group) for kind in ("plain", "fused")}
        result["unsynced"] = _run(rank, "plain", None)
        # Both ranks overflow (under DDP an inf reaches every rank through the all-reduce):
        # a summed flag was 2.0, which torch's fused kernels do not take for a skip.
        result["fused_both"] = _run(rank, "fused", group, both=True)
        result["apply_update"] = _apply_update_reduces_in_place(rank, group)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_ranks_skip_together_when_one_overflows(tmp_path):
    spawn(_worker, (free_ports(1)[0], str(tmp_path)), 2, timeout_s=120)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for kind in ("plain", "fused"):
        assert rank0[kind] == rank1[kind], kind
        assert rank0[kind]["skipped"] == [False, True, False]
        assert rank0[kind]["stats"] == [4.0, 3, 1, 0]
    # Without the group, rank 0 steps and keeps its scale while rank 1 skips: they diverge.
    assert rank0["unsynced"]["skipped"] == [False, False, False]
    assert rank1["unsynced"]["skipped"] == [False, True, False]
    assert rank0["unsynced"]["param"] != rank1["unsynced"]["param"]
    assert rank0["apply_update"] == rank1["apply_update"] == [1.0, 4.0]
    assert rank0["fused_both"] == rank1["fused_both"] == rank0["fused"]  # skipped, finite
