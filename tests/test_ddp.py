"""DDP at every opt level and in the torch-style loop, fp8 layers under DDP and FSDP2.

One spawn of two CPU processes on gloo runs every case below, one after another, and
the tests read its results. Each case trains a few steps on each rank's own batches;
at step ``SKIP`` rank 1 alone overflows:

- "loss": rank 1's loss is multiplied by inf before backward. DDP averages the
  gradients during backward, so the inf/NaN reaches every rank's gradients and every
  rank skips, with or without a ``process_group``.
- "grad": an inf is written into one of rank 1's gradients after backward, so after
  DDP's all-reduce: only the scaler's ``process_group`` lets rank 0 know (the
  "unsynced" case, without it, shows the ranks part).

Under FSDP2 (``ampkit.distributed.shard``, torch 2.6+ on the CPU) the Float8Linear
weights are DTensors; the inf goes into rank 1's shard of one gradient.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampkit as amp
from ampkit._torch_compat import TORCH_VERSION
from ampkit.fp8 import Float8Config, Float8Linear, convert_to_fp8

from _dist import free_ports, spawn

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.slow,  # one spawn of two processes
]
F16, BF16 = torch.float16, torch.bfloat16
STEPS, SKIP = 4, 2
SPAWN_TIMEOUT_S = 180
# torch 2.5's FSDP2 needs CUDA streams (see tests/test_distributed.py).
HAS_FSDP2 = TORCH_VERSION >= (2, 6) or torch.cuda.is_available()


@dataclass(frozen=True)
class Case:
    loop: str  # "apex": initialize + scale_loss; "torch": autocast + GradScaler
    level: str = ""  # the opt level of the apex loop
    half: Optional[torch.dtype] = None
    # "loss" (before the all-reduce), "grad" (after it), "first" (the loss of the micro-batch
    # inside no_sync(): rank 1's grads alone hold the inf until the next backward)
    inject: Optional[str] = None
    group: bool = False  # GradScaler(process_group=WORLD)
    fp8: Optional[str] = None  # a Float8Linear recipe (emulated on the CPU)
    dynamic: bool = False  # the apex loop's loss_scale="dynamic" (O3 has none by default)
    bucket_view: bool = False  # DDP(gradient_as_bucket_view=True): grads are bucket views
    # Two micro-batches a step, the first inside DDP's no_sync(): "delay" passes it
    # delay_unscale=True (apex's recipe), "each" unscales both (transformers' loop).
    no_sync: Optional[str] = None
    # Step SKIP begins one clean step short of the scale's growth (apex's _unskipped written).
    at_growth: bool = False


CASES = {
    "O0": Case("apex", "O0"),
    "O1-fp16": Case("apex", "O1", F16, "loss"),
    "O1-bf16": Case("apex", "O1", BF16, "loss"),
    "O2-fp16": Case("apex", "O2", F16, "loss"),
    "O2-bf16": Case("apex", "O2", BF16, "loss"),
    "O2-fp16-bucket-view": Case("apex", "O2", F16, "loss", bucket_view=True),
    "O3-fp16": Case("apex", "O3", F16, "loss", dynamic=True),
    "O3-bf16": Case("apex", "O3", BF16),
    "torch-fp16": Case("torch", half=F16, inject="loss"),
    "torch-fp16-grad": Case("torch", half=F16, inject="grad", group=True),
    "torch-bf16": Case("torch", half=BF16),  # nanoGPT's loop: the scaler is disabled
    "fp8-tensorwise": Case("torch", half=F16, inject="loss", fp8="tensorwise"),
    "fp8-tensorwise-bf16": Case("torch", half=BF16, fp8="tensorwise"),
    "fp8-tensorwise-grad": Case("torch", half=F16, inject="grad", group=True, fp8="tensorwise"),
    # DDP broadcasts rank 0's buffers, the amax histories among them, at every forward.
    "fp8-delayed": Case("torch", half=F16, inject="loss", fp8="delayed"),
    # scale_loss set the held grads aside, so DDP reduced the last micro-batch alone and
    # each rank added its own unreduced first one back: the replicas parted (apex too).
    "O0-no_sync": Case("apex", "O0", no_sync="each"),
    "O1-fp16-no_sync": Case("apex", "O1", F16, "loss", no_sync="each"),
    "O1-bf16-no_sync-delay": Case("apex", "O1", BF16, "loss", no_sync="delay"),
    "O2-fp16-no_sync-delay": Case("apex", "O2", F16, "loss", no_sync="delay"),
    "O2-bf16-no_sync-delay": Case("apex", "O2", BF16, no_sync="delay"),
    # An O2 exit that unscaled moved the half grads into the masters, which DDP does not
    # reduce: the replicas parted (transformers' loop).
    "O1-fp16-no_sync-clean": Case("apex", "O1", F16, no_sync="each"),
    "O1-fp16-no_sync-delay": Case("apex", "O1", F16, no_sync="delay"),
    "O2-fp16-no_sync": Case("apex", "O2", F16, no_sync="each"),
    "O2-bf16-no_sync": Case("apex", "O2", BF16, no_sync="each"),
    "O2-fp16-no_sync-delay-clean": Case("apex", "O2", F16, no_sync="delay"),
    # O3's unscaled fp16 grads were set aside: DDP reduced the last micro-batch alone.
    "O3-fp16-no_sync": Case("apex", "O3", F16, dynamic=True, no_sync="each"),
    "O3-fp16-no_sync-delay": Case("apex", "O3", F16, dynamic=True, no_sync="delay"),
    # Rank 1 alone overflows in the micro-batch inside no_sync(): each exit updating the
    # scale backed rank 1's off twice and rank 0's once, and the ranks parted.
    "O1-fp16-no_sync-first": Case("apex", "O1", F16, "first", no_sync="each"),
    "O2-fp16-no_sync-first": Case("apex", "O2", F16, "first", no_sync="each"),
    "O2-fp16-no_sync-delay-first": Case("apex", "O2", F16, "first", no_sync="delay"),
    # ... and at the growth boundary: rank 0's clean micro-batch grew the window's scale
    # before the overflow halved it, so the overflowing step did not back off.
    "O1-fp16-no_sync-first-at-growth": Case("apex", "O1", F16, "first", no_sync="each",
                                            at_growth=True),
}
# Each "each" accumulation against its "delay" twin: a power-of-two scale makes them agree.
TWINS = [("O1-fp16-no_sync-clean", "O1-fp16-no_sync-delay"),
         ("O2-fp16-no_sync", "O2-fp16-no_sync-delay-clean"),
         ("O2-bf16-no_sync", "O2-bf16-no_sync-delay"),
         ("O3-fp16-no_sync", "O3-fp16-no_sync-delay")]
UNSYNCED = Case("torch", half=F16, inject="grad")  # the control: no process_group
SKIPPING = [name for name, case in CASES.items() if case.inject]


def _model(fp8: Optional[str]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    if fp8 is not None:
        convert_to_fp8(model, recipe=Float8Config(fp8, emulate=True))
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))


def _digest(tensors: list[torch.Tensor]) -> str:
    """A bitwise fingerprint of the tensors (values and dtypes)."""
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(str(t.dtype).encode())
        sha.update(t.detach().float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _injected(loss: torch.Tensor, rank: int, step: int, case: Case,
              where: str = "loss") -> torch.Tensor:
    if case.inject == where and rank == 1 and step == SKIP:
        return loss * float("inf")
    return loss


def _inject_grad(model: nn.Module, rank: int, step: int, case: Case) -> None:
    if case.inject == "grad" and rank == 1 and step == SKIP:
        next(model.parameters()).grad.view(-1)[0] = float("inf")


class _Record:
    """Per step: the (uninjected) loss, the loss scale, a digest of the parameters."""

    def __init__(self, model: nn.Module, tensors: Callable[[], list[torch.Tensor]]) -> None:
        self.tensors = tensors
        self.result = {"losses": [], "scales": [], "digests": [_digest(tensors())],
                       "fp8_weights": [type(m.weight).__name__ for m in model.modules()
                                       if isinstance(m, Float8Linear)]}

    def add(self, loss: torch.Tensor, scale: float) -> None:
        self.result["losses"].append(loss.item())
        self.result["scales"].append(scale)
        self.result["digests"].append(_digest(self.tensors()))


def _ddp(model: nn.Module, case: Case) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=case.bucket_view)


def _apex(rank: int, case: Case) -> dict:
    model = _model(case.fp8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ampkit.initialize: opt_level O3 here trains")  # bf16
        model, opt = amp.initialize(model, opt, opt_level=case.level, half_dtype=case.half,
                                    loss_scale="dynamic" if case.dynamic else None, verbosity=0)
    ddp = _ddp(model, case)
    record = _Record(model, lambda: [*model.parameters(), *amp.master_params(opt)])
    start = _flat(amp.master_params(opt))
    for step in range(STEPS):
        opt.zero_grad()
        if case.at_growth and step == SKIP:
            amp._amp_state.loss_scalers[0]._unskipped = 1999  # apex's growth interval: 2000
        if case.no_sync:
            with ddp.no_sync():  # accumulates locally; the next backward all-reduces the sum
                first = ddp(_batch(rank + 10, step)).float().pow(2).mean()
                first = _injected(first, rank, step, case, "first")
                with amp.scale_loss(first, opt, delay_unscale=case.no_sync == "delay") as scaled:
                    scaled.backward()
        loss = ddp(_batch(rank, step)).float().pow(2).mean()
        with amp.scale_loss(_injected(loss, rank, step, case), opt) as scaled:
            scaled.backward()  # DDP all-reduces here; scale_loss unscales on exit
        opt.step()  # does nothing after an overflow
        record.add(loss, amp.state_dict()["loss_scaler0"]["loss_scale"])
    del ddp  # its reducer goes before the process group
    return record.result | {"start": start, "params": _flat(amp.master_params(opt))}


def _flat(params) -> list[float]:
    return torch.cat([p.detach().float().reshape(-1) for p in params]).tolist()


def _torch(rank: int, case: Case) -> dict:
    model = _model(case.fp8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # The delayed recipe: an unwrapped copy that sees this rank's batches at the same
    # params, whose amax histories are what this rank's own must be (none of rank 0's).
    shadow = copy.deepcopy(model) if case.fp8 == "delayed" else None
    ddp = _ddp(model, case)
    scaler = amp.GradScaler("cpu", enabled=case.half == F16,
                            process_group=dist.group.WORLD if case.group else None)
    record = _Record(model, lambda: list(model.parameters()))
    for step in range(STEPS):
        opt.zero_grad()
        if shadow is not None:
            with torch.no_grad():
                for mine, theirs in zip(shadow.parameters(), model.parameters()):
                    mine.copy_(theirs)
            with amp.autocast("cpu", dtype=case.half):
                mirror = shadow(_batch(rank, step)).float().pow(2).mean()
            scaler.scale(_injected(mirror, rank, step, case)).backward()
        with amp.autocast("cpu", dtype=case.half):
            loss = ddp(_batch(rank, step)).float().pow(2).mean()
        scaler.scale(_injected(loss, rank, step, case)).backward()
        _inject_grad(model, rank, step, case)
        scaler.step(opt)
        scaler.update()
        record.add(loss, scaler.get_scale())
    del ddp
    if shadow is not None:
        histories = [(name, mine, theirs) for (name, mine), theirs
                     in zip(model.named_buffers(), shadow.buffers()) if "amax_history" in name]
        record.result["own_histories"] = [name for name, mine, theirs in histories
                                          if torch.equal(mine, theirs)]
        record.result["histories"] = [name for name, _, _ in histories]
    return record.result


class Net(nn.Module):
    """Blocks in a ModuleList (shard's default groups), every Linear fp8-eligible."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))
                                     for _ in range(2)])
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(torch.relu(x))
        return self.head(x)


def _sharded_fp8(rank: int, policy: str) -> dict:
    """convert_to_fp8, then shard; at step SKIP rank 1's shard of one gradient is inf."""
    from torch.distributed.tensor import DTensor

    from ampkit.distributed import shard

    model = shard(convert_to_fp8(Net(), recipe=Float8Config("tensorwise", emulate=True)), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = amp.GradScaler("cpu", enabled=policy == "16-mixed", init_scale=2.0**10)
    # full_tensor() all-gathers each shard: a collective every rank runs in the same order.
    record = _Record(model, lambda: [p.full_tensor() for p in model.parameters()])
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(_batch(rank, step)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if policy == "16-mixed" and rank == 1 and step == SKIP:
            model.head.weight.grad.to_local().view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        record.add(loss, scaler.get_scale())
    return record.result | {"dtensors": all(isinstance(p, DTensor) for p in model.parameters())}


def _worker(rank: int, port: int, out_dir: str, with_fsdp2: bool) -> None:
    torch.set_num_threads(1)  # two processes on a shared machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        result = {name: (_apex if case.loop == "apex" else _torch)(rank, case)
                  for name, case in CASES.items()}
        result["unsynced"] = _torch(rank, UNSYNCED)
        if with_fsdp2:
            result["shard-bf16"] = _sharded_fp8(rank, "bf16-mixed")
            result["shard-fp16"] = _sharded_fp8(rank, "16-mixed")
        Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(result))
        gc.collect()  # no DDP reducer may outlive the group ("terminate called" aborts)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    spawn(_worker, (free_ports(1)[0], str(out), HAS_FSDP2), 2, SPAWN_TIMEOUT_S)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _skipped(result: dict) -> list[bool]:
    """Steps that left every parameter (and master) bitwise as it was."""
    digests = result["digests"]
    return [after == before for before, after in zip(digests, digests[1:])]


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_holds_the_same_params_after_every_step(ranks, name):
    rank0, rank1 = (r[name] for r in ranks)
    assert rank0["digests"] == rank1["digests"]  # bitwise, masters included
    assert rank0["scales"] == rank1["scales"]
    assert all(math.isfinite(x) for x in rank0["losses"] + rank1["losses"])
    assert rank0["losses"] != rank1["losses"]  # each rank trained on its own batches
    assert rank0["digests"][-1] != rank0["digests"][0]  # it trained
    assert rank0["fp8_weights"] == (["Parameter"] * 2 if CASES[name].fp8 else [])


def test_delayed_fp8_keeps_each_ranks_own_amax_histories(ranks):
    """DDP broadcast every buffer from rank 0 before each forward, the amax histories too:
    rank 1 cast its activations with scales from rank 0's data (saturating where its own
    were larger). Each rank's histories are now what an unwrapped copy fed its batches
    records."""
    for rank in ranks:
        result = rank["fp8-delayed"]
        assert len(result["histories"]) == 6  # 2 layers x input, weight, grad_output
        assert result["own_histories"] == result["histories"]


@pytest.mark.parametrize("name", [n for n in CASES if n != "O0"])
def test_each_case_computes_in_its_own_precision(ranks, name):
    assert ranks[0][name]["losses"] != ranks[0]["O0"]["losses"]


@pytest.mark.parametrize("name", SKIPPING)
def test_an_overflow_on_rank_1_alone_skips_the_step_on_every_rank(ranks, name):
    rank0, rank1 = (r[name] for r in ranks)
    expected = [step == SKIP for step in range(STEPS)]
    assert _skipped(rank0) == _skipped(rank1) == expected
    scales = rank0["scales"]
    assert scales[SKIP] == scales[SKIP - 1] / 2 and scales[SKIP + 1] == scales[SKIP]


@pytest.mark.parametrize("name", [n for n in CASES if not CASES[n].inject])
def test_cases_without_an_injected_overflow_take_every_step(ranks, name):
    assert _skipped(ranks[0][name]) == [False] * STEPS


@pytest.mark.parametrize("each, delay", TWINS)
def test_no_sync_accumulation_unscaled_at_each_exit_equals_the_delayed_one(ranks, each, delay):
    for rank in ranks:
        assert rank[each]["digests"] == rank[delay]["digests"]
        assert rank[each]["scales"] == rank[delay]["scales"]


@pytest.mark.parametrize("name", [n for n, case in CASES.items()
                                  if case.no_sync and not case.inject and n != "O0-no_sync"])
def test_no_sync_accumulation_trains_on_both_micro_batches_of_both_ranks(ranks, name):
    """Close to fp32's accumulation, far from what the last micro-batch alone gives."""
    reference = torch.tensor(ranks[0]["O0-no_sync"]["params"])
    params = torch.tensor(ranks[0][name]["params"])
    start = torch.tensor(ranks[0]["O0-no_sync"]["start"])
    moved = (reference - start).norm()
    assert (params - reference).norm() < 0.05 * moved, name


def test_without_a_process_group_an_overflow_after_the_all_reduce_parts_the_ranks(ranks):
    """The control for the "grad" cases: the inf really is on rank 1 alone."""
    rank0, rank1 = (r["unsynced"] for r in ranks)
    assert _skipped(rank0) == [False] * STEPS
    assert _skipped(rank1) == [step == SKIP for step in range(STEPS)]
    assert rank0["digests"][-1] != rank1["digests"][-1]
    assert rank0["scales"][SKIP] == 2 * rank1["scales"][SKIP]


FSDP2 = pytest.mark.skipif(not HAS_FSDP2, reason="FSDP2 on the CPU needs torch 2.6 or later")


@FSDP2
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_fp8_layers_train_under_shard_with_dtensor_weights(ranks, policy):
    rank0, rank1 = (r[f"shard-{policy}"] for r in ranks)
    assert rank0["fp8_weights"] == ["DTensor"] * 4  # inp, blocks.0/1's Linear, head
    assert rank0["dtensors"] and rank1["dtensors"]  # every parameter stays sharded
    assert rank0["digests"] == rank1["digests"] and rank0["digests"][-1] != rank0["digests"][0]
    assert rank0["scales"] == rank1["scales"]
    assert all(math.isfinite(x) for x in rank0["losses"] + rank1["losses"])
    expected = [policy == "fp16" and step == SKIP for step in range(STEPS)]
    assert _skipped(rank0) == _skipped(rank1) == expected
