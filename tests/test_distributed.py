"""ampkit.distributed: fsdp_policy, shard (FSDP2), TrainState (DCP), on CPU with gloo.

In-process tests use a one-rank gloo group (FSDP2 runs there too: the groups, dtypes
and refusals are the same as with more ranks). One two-process run (spawned, gloo on
127.0.0.1) covers what needs two ranks: training under bf16-mixed and O2-bf16, fp16
with a GradScaler when only rank 1 overflows, and a DCP save/load resume.
"""

from __future__ import annotations

import gc
import inspect
import io
import json
import os
import runpy
import sys
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampkit
from ampkit._torch_compat import TORCH_VERSION
from ampkit.distributed import TrainState, fsdp_policy, is_sharded, shard

from _dist import free_ports, spawn

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    # torch 2.5's FSDP2 lives in a private module, needs CUDA streams and drops a reduce
    # dtype equal to the param dtype: FSDP2 on the CPU is supported from 2.6.
    pytest.mark.skipif(TORCH_VERSION < (2, 6) and not torch.cuda.is_available(),
                       reason="FSDP2 on the CPU needs torch 2.6 or later"),
]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SPAWN_TIMEOUT_S = 240
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp_train.py"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.relu(self.ln(x)))


class Net(nn.Module):
    """Transformer-like: an input layer, a ModuleList of blocks, a head."""

    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))


def _fsdp_modules(model: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


# --- the public contract ---------------------------------------------------------------------
def test_the_public_names_and_signatures():
    assert "distributed" in ampkit.__all__ and ampkit.distributed.shard is shard
    assert set(ampkit.distributed.__all__) == {"fsdp_policy", "shard", "TrainState",
                                               "load_checkpoint", "is_sharded"}
    kinds = {name: (p.kind.name, p.default) for name, p in inspect.signature(shard).parameters.items()}
    assert kinds == {"model": ("POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
                     "policy": ("POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
                     "mesh": ("KEYWORD_ONLY", None), "modules": ("KEYWORD_ONLY", None),
                     "fp8_all_gather": ("KEYWORD_ONLY", True)}
    assert list(inspect.signature(fsdp_policy).parameters)[:1] == ["policy"]


# --- fsdp_policy ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("bf16-mixed", (BF16, F32, F32)),
    ("16-mixed", (F16, F32, F32)),
    ("O1", (F16, F32, F32)),
    ("O2", (F16, F32, F32)),
    ("O2-bf16", (BF16, F32, F32)),
    ("O3", (F16, F32, F16)),
    ("bf16-true", (BF16, F32, BF16)),
    ("p=f32,c=bf16,o=bf16", (BF16, F32, BF16)),
])
def test_fsdp_policy_maps_compute_to_param_dtype_and_reduces_in_fp32(name, expected):
    mp_policy = fsdp_policy(name)
    assert (mp_policy.param_dtype, mp_policy.reduce_dtype, mp_policy.output_dtype) == expected
    assert mp_policy.cast_forward_inputs
    assert fsdp_policy(ampkit.get_policy(name)) == mp_policy


@pytest.mark.parametrize("name", ["O0", "32-true", "fp32"])
def test_fsdp_policy_of_an_fp32_policy_casts_nothing(name):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert fsdp_policy(name) == MixedPrecisionPolicy()


def test_fsdp_policy_reduce_dtype_and_bad_input():
    assert fsdp_policy("bf16-mixed", reduce_dtype="bf16").reduce_dtype == BF16
    assert fsdp_policy("O0", reduce_dtype=BF16).reduce_dtype == BF16
    with pytest.raises(ValueError, match=r"unknown policy 'O9'.*valid: O0, O1"):
        fsdp_policy("O9")
    with pytest.raises(ValueError, match=r"reduce_dtype.*int8|int8.*reduce_dtype"):
        fsdp_policy("O2", reduce_dtype="int8")


# --- shard: groups, dtypes, refusals (one rank) --------------------------------------------------
def test_shard_groups_each_block_and_the_root(one_rank):
    model = shard(Net(depth=3), "bf16-mixed")
    assert _fsdp_modules(model) == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert is_sharded(model) and not is_sharded(Net())


@pytest.mark.parametrize("modules, groups", [
    ("blocks.*", ["", "blocks.0", "blocks.1"]),  # nested matches join the outer one
    ("blocks", ["", "blocks.0", "blocks.1"]),  # a ModuleList stands for its children
    (["inp", Block], ["", "inp", "blocks.0", "blocks.1"]),
    ([], [""]),
])
def test_shard_modules_selects_the_groups(one_rank, modules, groups):
    assert _fsdp_modules(shard(Net(), "O2", modules=modules)) == groups


def _dtypes_in_forward(model: nn.Module, names: list[str]) -> dict[str, tuple]:
    """name -> (input dtype, weight dtype) seen inside each module's forward."""
    seen: dict[str, tuple] = {}
    for name in names:
        def hook(module, args, name=name):
            seen[name] = (args[0].dtype, module.weight.dtype)
        model.get_submodule(name).register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("policy, sharded, compute, out", [
    ("bf16-mixed", F32, BF16, F32),
    ("O2", F32, F16, F32),  # fp32 sharded params are the masters; half compute
    ("O2-bf16", F32, BF16, F32),
    ("O3", F16, F16, F16),  # pure half: the sharded params themselves are half
    ("32-true", F32, F32, F32),
])
def test_shard_dtypes_follow_the_policy(one_rank, policy, sharded, compute, out):
    model = shard(Net(), policy)
    seen = _dtypes_in_forward(model, ["inp", "blocks.0.fc", "head"])
    y = model(torch.randn(2, 8))
    y.float().sum().backward()
    assert {p.dtype for p in model.parameters()} == {sharded}
    assert {p.grad.dtype for p in model.parameters()} == {sharded}
    assert set(seen.values()) == {(compute, compute)} and y.dtype == out


def test_kept_fp32_modules_and_batch_norm_are_fp32_groups(one_rank):
    model = ampkit.keep_fp32(Net(), ["head"])
    model.blocks[0].ln = nn.BatchNorm1d(16)
    shard(model, "O3")  # O3 casts batch norm too: only head is kept
    assert _fsdp_modules(model) == ["", "blocks.0", "blocks.1", "head"]
    seen = _dtypes_in_forward(model, ["blocks.0.fc", "head"])
    assert model(torch.randn(2, 8)).dtype == F16
    assert seen == {"blocks.0.fc": (F16, F16), "head": (F32, F32)}
    assert model.head.weight.dtype == F32 and model.blocks[0].ln.weight.dtype == F16

    model = Net()
    model.blocks[0].ln = nn.BatchNorm1d(16)
    shard(model, "O2")  # O2 keeps batch norm fp32: a group inside its block
    assert "blocks.0.ln" in _fsdp_modules(model)
    seen = _dtypes_in_forward(model, ["blocks.0.ln", "blocks.0.fc"])
    model(torch.randn(2, 8)).sum().backward()
    assert seen == {"blocks.0.ln": (F32, F32), "blocks.0.fc": (F16, F16)}


def test_keep_fp32_after_shard_is_refused_unless_the_selection_stays(one_rank):
    """keep_fp32 on a sharded model returned normally and changed nothing: the layer
    still ran in fp16 (shard had fixed each group's precision)."""
    model = shard(ampkit.keep_fp32(Net(), ["head"]), "O2-fp16")
    assert ampkit.keep_fp32(model, ["head"]) is model  # the same selection: nothing to do
    for modules in (["blocks.0.fc"], []):
        with pytest.raises(ValueError, match=r"already sharded .*kept now: \['head'\].*"
                                             r"before ampkit.distributed.shard"):
            ampkit.keep_fp32(model, modules)
    assert ampkit.keep.kept_names(model) == ["head"]


class _Frequencies(nn.Module):
    """A buffer table: fp32 rotary frequencies times positions."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16.0),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.arange(1, 9).repeat(2)[None].float().mul(self.inv_freq.repeat(2)).cos()


@pytest.mark.parametrize("policy", ["O3", "16-true"])
def test_a_pure_half_shard_warns_of_buffer_tables_as_initialize_does(one_rank, policy):
    model = Net()
    model.blocks[0].fc = nn.Sequential(_Frequencies(), nn.Linear(16, 16))
    with pytest.warns(UserWarning, match=r"ampkit.keep_fp32\(model, \['blocks.0.fc.0'\]\) first"):
        shard(model, policy)
    assert model.blocks[0].fc[0].inv_freq.dtype == F16
    model = Net()
    model.blocks[0].fc = nn.Sequential(_Frequencies(), nn.Linear(16, 16))
    freqs = model.blocks[0].fc[0].inv_freq.clone()
    shard(ampkit.keep_fp32(model, ["blocks.0.fc.0"]), policy)  # as the warning advises
    table = model.blocks[0].fc[0]
    assert table.inv_freq.dtype == F32 and torch.equal(table.inv_freq, freqs)
    seen = _dtypes_in_forward(model, ["blocks.0.fc.1"])
    assert model(torch.randn(2, 8)).dtype == F16 and seen == {"blocks.0.fc.1": (F16, F16)}


def _unchanged(model: nn.Module, before: dict) -> bool:
    after = model.state_dict()
    return (type(model) is Net and not is_sharded(model) and before.keys() == after.keys()
            and all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
                    for k in before))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"policy": "O7"}, ValueError, r"unknown policy 'O7'; valid: O0, O1, O2, O3"),
    ({"modules": "block.*"}, ValueError,
     r"modules='block\.\*' matches no module of Net; valid: .*'inp', 'blocks', 'blocks\.0'"),
    ({"modules": ["inp", "nothing"]}, ValueError, r"modules='nothing' matches no module"),
    ({"modules": [3]}, TypeError, r"modules item 3 is not a module selector; valid:"),
    ({"mesh": "cpu"}, TypeError, r"mesh='cpu' is not a DeviceMesh; valid:"),
    ({"fp8_all_gather": "yes"}, TypeError, r"fp8_all_gather='yes' is not a bool; valid: True"),
])
def test_shard_refuses_bad_input_before_anything_changes(one_rank, kwargs, error, match):
    model = ampkit.keep_fp32(Net(), ["head"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"policy": "O3", **kwargs}
    with pytest.raises(error, match=match):
        shard(model, args.pop("policy"), **args)
    assert _unchanged(model, before)


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_shard_groups_a_sequentials_layers(one_rank):
    """A Sequential's layers are its blocks; it was refused for lacking a ModuleList."""
    stack = shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16)),
                                nn.Linear(16, 4)), "bf16-mixed")
    assert _fsdp_modules(stack) == ["", "0", "2", "3"]  # the ReLU holds no parameters
    assert stack(torch.randn(2, 8)).dtype == F32
    nested = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)]))
    assert _fsdp_modules(shard(nested, "bf16-mixed")) == ["", "1.0"]  # a ModuleList first


def _tied() -> nn.Sequential:
    """The language-model layout: an embedding tied to the output layer."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False))
    model[2].weight = model[0].weight
    return model


def test_shard_keeps_tied_layers_in_one_group(one_rank):
    """Tied layers became groups of their own: fully_shard failed on the second one, with
    the model half sharded."""
    model = shard(_tied(), "bf16-mixed")
    assert _fsdp_modules(model) == ["", "1"]  # the tied pair stays in the root group
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 16) and out.dtype == F32
    model = _tied()
    with pytest.raises(ValueError, match=r"parameter '0.weight' is shared with '2.weight', but "
                                         r"they would be in different groups \('0' and 'the root'\)"):
        shard(model, "bf16-mixed", modules=["0", "1"])
    assert not is_sharded(model) and _fsdp_modules(model) == []  # refused before any change


@pytest.mark.parametrize("policy", ["O3", "16-true"])
def test_a_pure_half_shard_refusing_tied_groups_leaves_the_model_fp32(one_rank, policy):
    """The pure-half cast ran before the tied-weight check: the refused model was fp16,
    and a retry under a master-weight policy silently stepped fp16 parameters."""
    model = _tied()
    with pytest.raises(ValueError, match=r"parameter '0.weight' is shared with '2.weight'"):
        shard(model, policy, modules=["0", "1"])
    assert [p.dtype for p in model.parameters()] == [F32] * 3 and not is_sharded(model)


class _Aliased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 8))
        self.dec = self.enc  # one module, two names
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dec(self.enc(x)))


def test_shard_selects_modules_by_keep_fp32s_rule(one_rank):
    """shard had a copy of keep_fp32's matching that missed a module's second name
    ("matches no module") and took no callable."""
    assert ampkit.keep.select(_Aliased(), ["dec"]) == ["enc"]
    assert _fsdp_modules(shard(_Aliased(), "bf16-mixed", modules=["dec"])) == ["", "enc"]
    picked = shard(_Aliased(), "bf16-mixed", modules=lambda name, m: name == "head")
    assert _fsdp_modules(picked) == ["", "head"]


@pytest.mark.parametrize("policy", ["O3", "16-true"])
def test_shard_refuses_keeping_one_side_of_a_tie_with_keeps_advice(one_rank, policy):
    """A kept module is an fp32 group of its own, so the group check refused the tie first,
    advising one group for both, which a kept module cannot take."""
    model = ampkit.keep_fp32(_tied(), ["2"])
    with pytest.raises(ValueError, match=r"^keep_fp32: '2' is kept in fp32, but its parameter "
                                         r"'2.weight' is also '0.weight'.*keep both '2' and '0'"):
        shard(model, policy)
    assert all(p.dtype == F32 for p in model.parameters()) and not is_sharded(model)


def test_a_modules_pattern_matching_only_an_empty_container_is_refused(one_rank):
    """An empty ModuleList stands for its (no) children: the pattern selected nothing,
    and the model was sharded as one root group without a word."""
    model = nn.Sequential(nn.ModuleList(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"modules='0' matches only empty containers \('0'\), "
                                         r"which stand for their children.*valid:.*'1'"):
        shard(model, "O2", modules=["0"])
    assert _fsdp_modules(model) == [] and model[1].weight.dtype == F32


def test_shard_refuses_a_model_without_blocks_a_sharded_or_initialized_one(one_rank):
    flat = _Flat()
    with pytest.raises(ValueError, match=r"_Flat has no blocks to shard one by one.*valid: "
                                         r"pass modules=.*'fc', 'act'.*modules=\[\]"):
        shard(flat, "bf16-mixed")
    assert _fsdp_modules(flat) == [] and flat.fc.weight.dtype == F32
    model = shard(Net(), "bf16-mixed")
    with pytest.raises(ValueError, match="already sharded"):
        shard(model, "bf16-mixed")
    model = ampkit.initialize(Net(), opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match=r"went through ampkit.initialize; valid:"):
        shard(model, "O2")


def test_shard_without_a_process_group_says_how_to_start_one():
    model = Net()
    with pytest.raises(RuntimeError, match=r"not initialized; valid: call torch.distributed."
                                           r"init_process_group first"):
        shard(model, "bf16-mixed")
    assert not is_sharded(model)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_initialize_on_a_sharded_model_names_shard(one_rank, opt_level):
    model = shard(Net(), "bf16-mixed")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"models\[0\] \(FSDPNet\) is already sharded.*"
                                        r"ampkit\.distributed\.shard\(model, policy\)"):
        ampkit.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    assert not hasattr(optimizer, "_amp_stash")


# --- two processes ------------------------------------------------------------------------------
def _full(model: nn.Module) -> list[list[float]]:
    # full_tensor() all-gathers each shard: a collective every rank runs in the same order.
    return [p.full_tensor().float().flatten().tolist() for p in model.parameters()]


def _train(rank: int, policy: str) -> dict:
    model = shard(Net(), policy)
    start = _full(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(_batch(rank, step)).float().pow(2).mean()
        loss.backward()  # FSDP2 reduce-scatters the gradients (in fp32) during backward
        optimizer.step()
        losses.append(loss.item())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"start": start, "end": _full(model), "losses": losses, "dtypes": dtypes}


def _fp16_skip(rank: int, process_group, fused: bool = False) -> dict:
    """16-mixed with a GradScaler; at step 1 only rank 1's shard of one gradient is inf."""
    model = shard(Net(), "16-mixed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = ampkit.GradScaler("cpu", init_scale=2.0**10, process_group=process_group)
    skipped, params = [], []
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(model(_batch(rank, step)).float().pow(2).mean()).backward()
        if rank == 1 and step == 1:
            model.head.weight.grad.to_local().view(-1)[0] = float("inf")
        # Unscaling all-reduces found-inf over the DTensor gradients' mesh (torch's DTensor
        # rule), so rank 0 sees rank 1's inf without a process_group; a fused step reads
        # the same reduced flag on the device.
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
        params.append(_full(model))
    return {"skipped": skipped, "stats": list(scaler.stats().__dict__.values()),
            "params": params}


def _run_steps(model, optimizer, scaler, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = model(_batch(rank, step)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses


def _fresh(policy: str) -> tuple:
    model = shard(Net(), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, ampkit.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def _dcp_resume(rank: int, path: str) -> dict:
    """Train 2 steps, save, train 2 more; a fresh model, optimizer and scaler load and redo them."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, scaler = _fresh("16-mixed")
    _run_steps(model, optimizer, scaler, rank, range(2))
    dcp.save({"train": TrainState(model, optimizer, scaler)}, checkpoint_id=path)
    after_save = _run_steps(model, optimizer, scaler, rank, range(2, 4))
    stats = scaler.stats()
    model, optimizer, scaler = _fresh("16-mixed")
    dcp.load({"train": TrainState(model, optimizer, scaler)}, checkpoint_id=path)
    resumed = _run_steps(model, optimizer, scaler, rank, range(2, 4))
    return {"after_save": after_save, "resumed": resumed,
            "stats": [list(stats.__dict__.values()), list(scaler.stats().__dict__.values())]}


def _example(rank: int, port: int, argv: list[str]) -> str:
    """examples/fsdp_train.py as torchrun runs it (env:// variables); rank 0's output."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["fsdp_train.py", *argv]), redirect_stdout(out):
        runpy.run_path(str(EXAMPLE), run_name="__main__")  # it destroys its process group
    return out.getvalue()


def _example_runs(out_dir: str) -> list[list[str]]:
    """4 steps unbroken; 2 steps and save, then load and 2 more: the same last loss."""
    ckpt = f"{out_dir}/example_ckpt"
    return [["--policy", "16-mixed", "--steps", "4"],
            ["--policy", "16-mixed", "--steps", "2", "--save", ckpt],
            ["--policy", "16-mixed", "--steps", "2", "--load", ckpt]]


def _worker(rank: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a shared machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=2)
    try:
        result = {policy: _train(rank, policy) for policy in ("bf16-mixed", "O2-bf16")}
        result["skip"] = _fp16_skip(rank, None)
        result["skip_with_group"] = _fp16_skip(rank, dist.group.WORLD)
        result["skip_fused"] = _fp16_skip(rank, None, fused=True)
        result["dcp"] = _dcp_resume(rank, f"{out_dir}/ckpt")
        gc.collect()  # no FSDP state may outlive the group
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The example starts and ends its own process group (torchrun's way), one per run.
    result["example"] = [_example(rank, port, argv)
                         for port, argv in zip(ports[1:], _example_runs(out_dir))]
    Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(result))


# The one spawn (shared by the tests below) takes 20-30 s on two busy cores, most of it
# starting two Python processes and importing torch and FSDP2 in each.
TWO_PROCESSES = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist")
    spawn(_worker, (free_ports(4), str(out)), 2, SPAWN_TIMEOUT_S)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@TWO_PROCESSES
@pytest.mark.parametrize("policy", ["bf16-mixed", "O2-bf16"])
def test_sharded_training_keeps_every_rank_on_the_same_params(two_ranks, policy):
    rank0, rank1 = (r[policy] for r in two_ranks)
    assert rank0["end"] == rank1["end"] and rank0["start"] == rank1["start"]
    assert rank0["end"] != rank0["start"]  # it trained
    assert rank0["losses"] != rank1["losses"]  # on each rank's own batches
    assert rank0["dtypes"] == rank1["dtypes"] == ["torch.float32"]  # fp32 shards (masters)


@TWO_PROCESSES
@pytest.mark.parametrize("kind", ["skip", "skip_with_group", "skip_fused"])
def test_fp16_on_fsdp2_every_rank_skips_when_one_shard_overflows(two_ranks, kind):
    rank0, rank1 = (r[kind] for r in two_ranks)
    assert rank0["skipped"] == rank1["skipped"] == [False, True, False]
    assert rank0["stats"] == rank1["stats"] == [2.0**9, 3, 1, 0]
    assert rank0["params"] == rank1["params"]
    assert rank0["params"][1] == rank0["params"][0]  # the skipped step changed nothing
    assert rank0["params"][2] != rank0["params"][1]


@TWO_PROCESSES
def test_dcp_save_load_resumes_bitwise(two_ranks):
    for rank in two_ranks:
        result = rank["dcp"]
        assert result["resumed"] == result["after_save"]  # bitwise: floats compare exactly
        assert result["stats"][0] == result["stats"][1]
    assert two_ranks[0]["dcp"]["stats"][0][0] == 2.0**12  # growth_interval=1: 4 doublings


@TWO_PROCESSES
def test_the_fsdp_example_trains_saves_and_resumes(two_ranks):
    unbroken, saved, resumed = two_ranks[0]["example"]
    assert two_ranks[1]["example"] == ["", "", ""]  # rank 0 prints
    assert unbroken.startswith("16-mixed: steps 0-4, loss ") and "sharded params float32" in unbroken
    assert saved.startswith("16-mixed: steps 0-2, loss ")
    assert resumed.startswith("16-mixed: steps 2-4, loss ")
    # The resumed run ends at the unbroken run's loss: "-> x.xxxx" is the last loss.
    assert resumed.split("-> ")[1] == unbroken.split("-> ")[1]


def test_a_scaler_unscales_sharded_and_plain_grads_in_one_optimizer(one_rank):
    """An FSDP2 model beside an unsharded extra parameter: DTensor's dispatch refuses a
    mixed list, so the unscale checks each kind apart; both are unscaled, an inf in
    either is found."""
    torch.manual_seed(0)
    model = Net()
    shard(model, "bf16-mixed")
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.0)
    scaler = ampkit.GradScaler("cpu", init_scale=4.0)
    loss = model(_batch(0, 0)).float().pow(2).mean() + extra.sum()
    scaler.scale(loss).backward()
    extra.grad[1] = float("inf")
    scaler.unscale_(opt)
    assert extra.grad[0].item() == 1.0  # 4 / 4
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0
