"""FSDP2 under an ampkit policy: shard, train (a GradScaler for fp16), save and resume with DCP.

Run it under torchrun, on a laptop (gloo, CPU) or on GPUs (nccl):

    torchrun --nproc_per_node 2 examples/fsdp_train.py --policy bf16-mixed
    torchrun --nproc_per_node 2 examples/fsdp_train.py --policy 16-mixed --save /tmp/ckpt
    torchrun --nproc_per_node 2 examples/fsdp_train.py --policy 16-mixed --load /tmp/ckpt

Each rank trains on its own batches; FSDP2 averages the gradients. The policy decides
the loss scaling (``Policy.loss_scaling``): fp16 compute gets a dynamic GradScaler,
bf16 and fp32 a disabled one (every method a no-op), so one loop serves them all.
``--save`` writes model, optimizer, scaler and step with torch.distributed.checkpoint;
``--load`` resumes from there and continues with the same batches an unbroken run would see.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import ampkit
from ampkit.distributed import TrainState, load_checkpoint, shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    """A transformer-shaped MLP: embedding, a ModuleList of residual blocks, a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).flatten(0, 1)  # (batch * length, dim): one row per token
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(rank: int, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step`` (the next token is the current one plus one)."""
    tokens = torch.randint(0, 63, (8, 16), generator=torch.Generator().manual_seed(1000 * rank + step))
    return tokens.to(device), (tokens + 1).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save", help="a DCP checkpoint directory to write after training")
    parser.add_argument("--load", help="a DCP checkpoint directory to resume from")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's env:// variables
    rank = dist.get_rank()
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = shard(Model().to(device), args.policy)  # fully_shard per block, then the root
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # over the sharded params
        policy = ampkit.get_policy(args.policy)
        scaler = ampkit.GradScaler(device.split(":")[0], enabled=policy.loss_scaling.dynamic)
        state = {"train": TrainState(model, optimizer, scaler), "step": 0}
        if args.load:
            # every rank reads its own shards; a damaged checkpoint is refused unchanged
            load_checkpoint(state, checkpoint_id=args.load)
        start = state["step"]
        for step in range(start, start + args.steps):
            tokens, target = batch(rank, step, device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(tokens).float(), target.flatten())
            if step == start:
                first = loss.item()
            scaler.scale(loss).backward()  # FSDP2 reduce-scatters the gradients here
            scaler.step(optimizer)  # skipped on every rank if any rank's shard overflowed
            scaler.update()
        if args.save:
            state["step"] = start + args.steps
            dcp.save(state, checkpoint_id=args.save)
        if rank == 0:
            dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
            print(f"{args.policy}: steps {start}-{start + args.steps}, loss {first:.4f} -> "
                  f"{loss.item():.4f}, sharded params {'/'.join(dtypes)}, "
                  f"skipped {scaler.stats().skipped_steps}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
