"""FP8 all-gather under FSDP2: ``shard(..., fp8_all_gather=True)`` gathers tensorwise
Float8Linear weights in fp8.

In-process tests use a one-rank gloo group (the hooks, the bytes and the numerics are
those of more ranks); one three-process run (slow) covers what needs several ranks: the
amax of the whole weight, uneven shards, and a DCP resume.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampkit._dtypes import fp8_supported
from ampkit._torch_compat import TORCH_VERSION
from ampkit.distributed import TrainState, shard
from ampkit.fp8 import Float8Config, Float8Linear, convert_to_fp8
from ampkit.fp8 import allgather
from ampkit.fp8.allgather import Fp8GatheredWeight, Fp8ShardedWeight
from ampkit.fp8.scaling import E4M3, quantize

from _dist import free_ports, spawn

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    # FSDP2 on the CPU, and fp8 gathers anywhere (allgather.FP8_ALL_GATHER_SINCE).
    pytest.mark.skipif(TORCH_VERSION < (2, 6), reason="fp8 all-gather needs torch 2.6 or later"),
]
BF16, F32 = torch.bfloat16, torch.float32


class Stack(nn.Module):
    """Linear layers in a ModuleList and a head, all fp8-eligible."""

    def __init__(self, bias: bool = False, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(32, hidden, bias=bias),
                                     nn.Linear(hidden, 32, bias=bias)])
        self.head = nn.Linear(32, 16, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class Pairs(nn.Module):
    """Blocks of two Linear layers each (one FSDP2 group per block) and a head."""

    def __init__(self, hidden: int = 48) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, hidden, bias=False), nn.ReLU(),
                                                   nn.Linear(hidden, 32, bias=False))
                                     for _ in range(2)])
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _fp8(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    return convert_to_fp8(model, recipe=Float8Config(recipe, emulate=True))


def _batch(rank: int, step: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + step)).to(dtype)


def _train(model: nn.Module, steps: int = 3, rank: int = 0, first: int = 0,
           optimizer: Optional[torch.optim.Optimizer] = None) -> list[float]:
    """``steps`` AdamW steps (a new AdamW unless given) on this rank's batches from ``first``."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(first, first + steps):
        loss = model(_batch(rank, step)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters, copied (on one rank full_tensor() may be the shard itself)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _gathered_bytes():
    """The bytes each FSDP2 all-gather sends from this rank, one entry per call."""
    sent: list[int] = []
    patches = contextlib.ExitStack()
    # FSDP2 calls all_gather_single from torch 2.13, all_gather_into_tensor before.
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            def counting(output, tensor, *args, _orig=getattr(dist, name), **kwargs):
                sent.append(tensor.numel() * tensor.element_size())
                return _orig(output, tensor, *args, **kwargs)
            patches.enter_context(pytest.MonkeyPatch.context())
            patches.callback(setattr, dist, name, getattr(dist, name))
            setattr(dist, name, counting)
    with patches:
        yield sent


def _locals(model: nn.Module) -> dict[str, type]:
    return {name: type(p.to_local()) for name, p in model.named_parameters()}


# --- one rank -----------------------------------------------------------------------------------
def _weights_seen(model: nn.Module) -> list:
    """What each Float8Linear's forward gets as its weight, call by call."""
    seen: list = []
    for layer in model.modules():
        if isinstance(layer, Float8Linear):
            layer.register_forward_pre_hook(lambda m, args: seen.append(
                (type(m.weight), m.weight.dtype, getattr(m.weight, "_data", m.weight).dtype)))
    return seen


def test_fp32_policy_trains_bitwise_like_one_process(one_rank):
    reference = _fp8(Stack())
    expected = _train(reference)
    runs = {}
    for fp8_all_gather in (True, False):
        model = shard(_fp8(Stack()), "32-true", fp8_all_gather=fp8_all_gather)
        seen = _weights_seen(model)
        runs[fp8_all_gather] = (_train(model, steps=3), seen, _full(model), _locals(model))
    (losses, seen, full, local), (_, seen_hp, full_hp, local_hp) = runs[True], runs[False]
    assert set(local.values()) == {Fp8ShardedWeight} and set(local_hp.values()) == {torch.Tensor}
    assert set(seen) == {(Fp8GatheredWeight, F32, E4M3)} and len(seen) == 9
    assert set(seen_hp) == {(nn.Parameter, F32, F32)}
    # The fp8 weight gathered is the one the unsharded layer casts: nothing else differs.
    assert losses == expected
    assert all(torch.equal(full[k], reference.state_dict()[k]) for k in full)
    assert all(torch.equal(full[k], full_hp[k]) for k in full)


def test_one_all_reduce_of_amaxes_per_group_and_gather(one_rank, monkeypatch):
    reduced = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        reduced.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    runs = {}
    for fp8_all_gather in (True, False):
        model = shard(_fp8(Pairs()), "32-true", fp8_all_gather=fp8_all_gather)
        monkeypatch.setattr(dist, "all_reduce", counting)
        runs[fp8_all_gather] = (_train(model, steps=2), _full(model))
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
    # Per step: the root (the head) gathered once, first; each block twice (forward,
    # backward), its 2 amaxes in one all-reduce.
    assert reduced == [(1,), (2,), (2,), (2,), (2,)] * 2
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[True][1])


def test_bf16_mixed_hands_the_layer_the_fp8_weight_of_its_fp32_values(one_rank):
    model = shard(_fp8(Stack()), "bf16-mixed")
    seen = _weights_seen(model)
    out = model(_batch(0, 0))
    out.float().pow(2).mean().backward()
    assert seen == [(Fp8GatheredWeight, BF16, E4M3)] * 3
    # bf16 gradients of the gathered weights, reduced into the fp32 shards.
    assert {p.grad.dtype for p in model.parameters()} == {F32}
    # The one-process forward of the same fp32 weights on bf16 inputs (FSDP2 casts the
    # inputs; the weight is cast to fp8 from fp32 in both): bitwise the same output.
    reference = _fp8(Stack())
    assert torch.equal(out, reference(_batch(0, 0, BF16)))


def test_only_unshared_tensorwise_weights_gather_in_fp8(one_rank):
    model = Stack(bias=True)
    model.layers[0] = Float8Linear.from_linear(model.layers[0], Float8Config("delayed", emulate=True))
    model.layers[1] = Float8Linear.from_linear(model.layers[1], Float8Config("rowwise", emulate=True))
    model.head = Float8Linear.from_linear(model.head, Float8Config("tensorwise", emulate=True))
    model.extra = Float8Linear(16, 16, config=Float8Config("tensorwise", emulate=True))
    model.tied = Float8Linear(16, 16, config=Float8Config("tensorwise", emulate=True))
    model.tied.weight = model.extra.weight  # shared: the other user would see fp8 rounding
    shard(model, "bf16-mixed")
    assert _locals(model) == {
        "layers.0.weight": torch.Tensor, "layers.0.bias": torch.Tensor,
        "layers.1.weight": torch.Tensor, "layers.1.bias": torch.Tensor,
        "head.weight": Fp8ShardedWeight, "head.bias": torch.Tensor,
        "extra.weight": torch.Tensor, "extra.bias": torch.Tensor, "tied.bias": torch.Tensor}
    assert all(torch.isfinite(torch.tensor(_train(model, steps=2))))


def test_torch_2_5_gathers_in_the_policy_dtype(one_rank, monkeypatch):
    # Its FSDP2 passes the hooks the mesh alone and refuses them on uneven shards.
    monkeypatch.setattr(allgather, "TORCH_VERSION", (2, 5))
    model = shard(_fp8(Stack()), "bf16-mixed")
    assert set(_locals(model).values()) == {torch.Tensor}


def test_a_model_moved_after_sharding_still_gathers_in_fp8(one_rank):
    model = shard(_fp8(Stack()), "32-true")
    model.to(torch.float64)
    assert set(_locals(model).values()) == {Fp8ShardedWeight}
    seen = _weights_seen(model)
    model(_batch(0, 0).double()).pow(2).mean().backward()
    assert set(seen) == {(Fp8GatheredWeight, torch.float64, E4M3)}


def test_checkpoints_hold_plain_tensors_that_load_either_way(one_rank, tmp_path):
    import torch.distributed.checkpoint as dcp

    model = shard(_fp8(Stack()), "bf16-mixed")
    _train(model, steps=2)
    state = model.state_dict()
    assert {type(v.to_local()) for v in state.values()} == {torch.Tensor}
    buffer = io.BytesIO()
    torch.save({k: v.full_tensor() for k, v in state.items()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # no ampkit class inside
    assert all(torch.equal(loaded[k], v) for k, v in _full(model).items())
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    for fp8_all_gather in (False, True):
        fresh = shard(_fp8(Stack()), "bf16-mixed", fp8_all_gather=fp8_all_gather)
        target = {"model": fresh.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
        fresh.load_state_dict(target["model"])
        assert all(torch.equal(v, _full(model)[k]) for k, v in _full(fresh).items())
        assert set(_locals(fresh).values()) == {Fp8ShardedWeight if fp8_all_gather else torch.Tensor}


@pytest.mark.parametrize("first_forward", [False, True])
def test_an_assigning_load_keeps_fp8_gathers_and_the_loaded_weights(one_rank, first_forward):
    """load_state_dict(assign=True), as torch's set_model_state_dict does into a meta
    model: the loaded tensors become the parameters. After a first gather, FSDP2 reuses
    its fp8 buffers: a plain parameter then gathered the wrong values (one rank) or
    crashed (several)."""
    results = {}
    for assign in (True, False):
        source = shard(_fp8(Stack()), "32-true", fp8_all_gather=False)
        _train(source, steps=1)  # other weights than a fresh Stack's
        model = shard(_fp8(Stack()), "32-true")
        if first_forward:
            model(_batch(0, 9)).sum().backward()
            model.zero_grad()
        model.load_state_dict(source.state_dict(), assign=assign)
        assert set(_locals(model).values()) == {Fp8ShardedWeight}
        assert all(torch.equal(v, _full(source)[k]) for k, v in _full(model).items())
        seen = _weights_seen(model)
        results[assign] = (model(_batch(0, 0)), _train(model, steps=2))
        assert set(seen) == {(Fp8GatheredWeight, F32, E4M3)}
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]


def test_a_layer_used_in_two_places_gathers_in_fp8(one_rank):
    model = Stack()
    model.layers[1] = model.layers[0]  # one layer, two slots: its weight is its own
    model = shard(_fp8(model), "bf16-mixed", modules=[])
    assert set(_locals(model).values()) == {Fp8ShardedWeight}


def test_meta_init_keeps_fp8_gathers_and_the_optimizer_state_stays_plain(one_rank):
    with torch.device("meta"):
        model = _fp8(Stack())
    shard(model, "bf16-mixed")
    model.to_empty(device="cpu")
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()
    assert set(_locals(model).values()) == {Fp8ShardedWeight}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _full(model)
    model(_batch(0, 0)).float().pow(2).mean().backward()
    optimizer.step()
    assert set(_locals(model).values()) == {Fp8ShardedWeight}
    assert not any(torch.equal(before[k], v) for k, v in _full(model).items())
    kinds = {type(value.to_local()) for state in optimizer.state.values()
             for key, value in state.items() if key != "step"}
    assert kinds == {torch.Tensor}


def test_a_meta_built_delayed_model_trains_like_one_built_on_the_cpu(one_rank, monkeypatch):
    """The delayed histories of a meta-built sharded model: to_empty() gave them whatever
    memory it got (silently wrong scales from the second step); they are zeros, plain
    tensors on the shards' device, as for a model built there."""
    reference = shard(_fp8(Stack(), "delayed"), "32-true")
    weights = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    with torch.device("meta"):
        model = _fp8(Stack(), "delayed")
    shard(model, "32-true")
    with monkeypatch.context() as patch:  # memory that held other values, as empty_like's may
        patch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, 3e20, **kw))
        model.to_empty(device="cpu")
    model.load_state_dict(weights)
    histories = [b for n, b in model.named_buffers() if "amax_history" in n]
    assert len(histories) == 9 and all(type(h) is torch.Tensor and not h.any() for h in histories)
    assert _train(model) == _train(reference)
    assert all(torch.equal(v, _full(reference)[k]) for k, v in _full(model).items())


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()
                         and fp8_supported("cuda")), reason="needs a GPU with fp8 tensor cores")
def test_on_a_gpu_the_gathered_fp8_weight_feeds_scaled_mm(tmp_path):
    """One rank over NCCL: FSDP2's gather hooks run as with more ranks, and the layers
    call torch._scaled_mm on the gathered fp8 weight (its layout: row-major, as cast)."""
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        def native(model: nn.Module) -> nn.Module:
            model = convert_to_fp8(model.cuda(), recipe=Float8Config("tensorwise", emulate=False))
            assert all(m.native for m in model.modules() if isinstance(m, Float8Linear))
            return model

        def batches(step: int) -> torch.Tensor:
            return _batch(0, step).cuda()

        reference = native(Stack(hidden=64))
        model = shard(native(Stack(hidden=64)), "32-true")
        seen = _weights_seen(model)
        losses = {}
        for name, net in (("reference", reference), ("sharded", model)):
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
            losses[name] = []
            for step in range(3):
                loss = net(batches(step)).float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[name].append(loss.item())
        assert set(seen) == {(Fp8GatheredWeight, F32, E4M3)}
        torch.testing.assert_close(losses["sharded"], losses["reference"], rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()


# --- the tensor classes on their own ------------------------------------------------------------
def test_a_sharded_weight_is_its_tensor_for_every_op_but_fsdp2s_layout_ops():
    inner = torch.randn(4, 3)
    weight = Fp8ShardedWeight(inner.clone(), margin=1)
    assert weight.dtype == F32 and weight.shape == (4, 3)
    assert type(weight * 2) is torch.Tensor and torch.equal(weight * 2, inner * 2)
    assert type(torch.zeros_like(weight)) is torch.Tensor  # optimizer state stays plain
    # What FSDP2 does to shards (and fully_shard's move of a CPU-built model to the
    # mesh's device, Module.to()/.half() after sharding) keeps the all-gather hooks.
    for laid_out in (weight.new_zeros(5, 3), weight[1:3], weight.view(12),
                     torch.empty_like(weight), weight.detach(), weight.to("meta"),
                     weight.to(torch.float16)):
        assert type(laid_out) is Fp8ShardedWeight and laid_out._margin == 1
    assert weight.to(torch.float16).dtype == torch.float16
    weight.add_(1.0)  # in place: the wrapped tensor changes
    assert torch.equal(weight._tensor, inner + 1.0)
    assert "Fp8ShardedWeight" in repr(weight)
    # What torch refuses for subclasses is the wrapped tensor's: values, and pickling as a
    # plain tensor that torch.load(weights_only=True) reads.
    assert weight.tolist() == (inner + 1.0).tolist()
    assert (weight.numpy() == (inner + 1.0).numpy()).all()
    buffer = io.BytesIO()
    torch.save(weight, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, inner + 1.0)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_gathered_weight_gives_float8linear_the_same_matmuls_as_casting(dtype):
    torch.manual_seed(0)
    layer = Float8Linear(32, 16, bias=False, config=Float8Config("tensorwise", emulate=True))
    x = torch.randn(8, 32, dtype=dtype, requires_grad=True)
    out = layer(x)
    out.float().square().sum().backward()
    q = quantize(layer.weight.detach(), E4M3)
    gathered = nn.Parameter(Fp8GatheredWeight(q.data, q.inv_scale, dtype))
    fed = Float8Linear(32, 16, bias=False, config=Float8Config("tensorwise", emulate=True))
    fed.weight = gathered
    x2 = x.detach().clone().requires_grad_()
    out2 = fed(x2)
    out2.float().square().sum().backward()
    assert torch.equal(out2, out)
    assert torch.equal(x2.grad, x.grad)
    # The weight gradient in the gathered weight's dtype, as FSDP2 expects it.
    assert type(gathered.grad) is torch.Tensor and gathered.grad.dtype == dtype
    assert torch.equal(gathered.grad, layer.weight.grad.to(dtype))
    # Anything but a Float8Linear sees the dequantized weight, and cannot write into it
    # (the write would land in a dequantized copy).
    assert torch.equal(gathered.detach() + 0, (q.data.float() * q.inv_scale).to(dtype))
    with pytest.raises(RuntimeError, match=r"aten\.mul_\.Tensor would write into an "
                                           r"all-gathered fp8 weight.*valid: change the sharded"):
        gathered.detach().mul_(0)
    # A layer whose recipe is not the one its weight was gathered for refuses it.
    fed.config = Float8Config("delayed", emulate=True)
    fed._reset_fp8_state()
    with pytest.raises(RuntimeError, match=r"recipe=delayed\(16,max\)\) got a weight FSDP2 "
                                           r"gathered in fp8.*valid: keep the recipe"):
        fed(x2)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _Mesh:
    """A 1-D mesh whose group has ``size`` ranks (the all-reduce is patched away)."""

    ndim = 1

    def __init__(self, size: int) -> None:
        self.group = _Group(size)

    def get_group(self, dim: int) -> _Group:
        assert dim == 0
        return self.group


@pytest.mark.parametrize("rows, outer_rows, ranks, padded_rows", [
    (3, 5, 2, 3),  # 5 rows over 2 ranks: the first rank's 3, not padded
    (2, 5, 2, 3),  # the short shard: padded with a zero row
    (0, 2, 4, 1),  # a rank with no rows at all (2 rows over 4 ranks): one zero row
])
def test_the_pre_all_gather_hook_pads_short_and_empty_shards(monkeypatch, rows, outer_rows,
                                                              ranks, padded_rows):
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op, group: reduced.append((t.clone(), op, group)))
    shard_ = torch.arange(rows * 16, dtype=F32).reshape(rows, 16) - 7.0
    mesh = _Mesh(ranks)
    (data,), inv_scale = Fp8ShardedWeight(shard_).fsdp_pre_all_gather(
        mesh, torch.Size([outer_rows, 16]), (16, 1), None, None)
    assert data.dtype == torch.uint8 and data.shape == (padded_rows, 16)
    fp8 = data.view(E4M3)
    amax = shard_.abs().max() if rows else torch.tensor(0.0)
    assert len(reduced) == 1 and reduced[0][0] == amax and reduced[0][2] is mesh.group
    if rows:
        expected = quantize(shard_, E4M3)  # this rank's own amax: the all-reduce is patched
        assert torch.equal(inv_scale, expected.inv_scale)
        assert torch.equal(fp8[:rows].float(), expected.data.float())
    else:
        assert inv_scale.item() == 1.0  # nothing to scale: amax 0 gives scale 1
    assert not fp8[rows:].float().any()  # the padding is zeros


# --- three processes ----------------------------------------------------------------------------
def _three_rank_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    try:
        result: dict = {"bytes": {}}
        for policy in ("32-true", "bf16-mixed"):
            for fp8_all_gather in (True, False):
                # hidden=80: 80 rows over 3 ranks are uneven shards (27, 27, 26), padded;
                # each block's two weights share an all-reduce of their amaxes.
                model = shard(_fp8(Pairs(hidden=80)), policy, fp8_all_gather=fp8_all_gather)
                with _gathered_bytes() as sent:
                    losses = _train(model, rank=rank)
                result["bytes"][f"{policy} {fp8_all_gather}"] = sent
                if policy == "32-true":
                    params = {k: v.flatten().tolist() for k, v in _full(model).items()}
                    result[str(fp8_all_gather)] = {"losses": losses, "params": params}
        # DCP resume with fp8 all-gather: 2 steps, save, 2 more; a fresh run loads and redoes them.
        model = shard(_fp8(Stack(hidden=80)), "bf16-mixed")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        path = f"{out_dir}/ckpt"
        _train(model, 2, rank, optimizer=optimizer)
        dcp.save({"train": TrainState(model, optimizer)}, checkpoint_id=path)
        after_save = _train(model, 2, rank, first=2, optimizer=optimizer)
        model = shard(_fp8(Stack(hidden=80)), "bf16-mixed")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dcp.load({"train": TrainState(model, optimizer)}, checkpoint_id=path)
        result["dcp"] = [after_save, _train(model, 2, rank, first=2, optimizer=optimizer)]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_three_ranks_gather_uneven_fp8_shards_by_the_whole_weights_amax(tmp_path):
    spawn(_three_rank_worker, (free_ports(1)[0], str(tmp_path)), 3, 240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank in ranks:
        # One scale for the whole weight (each shard's amax alone would give other fp8
        # values): bitwise the training of a gather in fp32, on every rank.
        assert rank["True"] == rank["False"]
        assert rank["True"]["params"] == ranks[0]["True"]["params"]
        assert rank["dcp"][0] == rank["dcp"][1]  # the resumed steps, bitwise
    assert ranks[0]["True"]["losses"] != ranks[1]["True"]["losses"]  # each rank's own data
    # Every parameter is a Float8Linear weight: 1 byte per element instead of 4 or 2.
    sent = ranks[0]["bytes"]
    assert len(sent["32-true True"]) == len(sent["32-true False"]) > 0
    assert sum(sent["32-true True"]) * 4 == sum(sent["32-true False"])
    assert sum(sent["bf16-mixed True"]) * 2 == sum(sent["bf16-mixed False"])
    assert os.path.isdir(tmp_path / "ckpt")
