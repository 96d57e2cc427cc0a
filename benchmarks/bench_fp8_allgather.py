"""FP8 all-gather under FSDP2: the bytes each rank sends per step, with and without it.

``ampkit.distributed.shard`` all-gathers the weights of tensorwise Float8Linear layers in
fp8 (``fp8_all_gather=True``, the default). This runs the bench's CPU GPT (d=128, 2
blocks, vocab 512) converted to fp8 (tensorwise, emulated) and sharded over ``--nproc``
gloo ranks, for each policy with the fp8 gathers on and off, and records from rank 0:

- *gather MB / step*: bytes this rank passes to FSDP2's all-gathers per training step
  (``all_gather_single``/``all_gather_into_tensor`` inputs), which the device does not
  change; each rank receives ``nproc - 1`` times as much;
- *all-reduces / step*: collectives ``all_reduce`` issued per step (the fp8 gathers add
  one per FSDP2 group and gather, of the amaxes of the group's fp8 weights);
- *Δloss*: the largest relative difference of the loss curve from the run without fp8
  gathers (same seeds and batches).

Timing on the CPU is not reported: gloo over loopback says nothing about NVLink.

    PYTHONPATH=src python3 benchmarks/bench_fp8_allgather.py [--nproc 2] [--steps 3]
        [--policies bf16-mixed,32-true] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _count_collectives() -> dict[str, list[int]]:
    """Patch the collectives FSDP2 and ampkit call; bytes per all-gather, one per all-reduce."""
    seen: dict[str, list[int]] = {"gather": [], "all_reduce": []}
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            def gather(output, tensor, *args, _orig=getattr(dist, name), **kwargs):
                seen["gather"].append(tensor.numel() * tensor.element_size())
                return _orig(output, tensor, *args, **kwargs)
            setattr(dist, name, gather)

    def all_reduce(tensor, *args, _orig=dist.all_reduce, **kwargs):
        seen["all_reduce"].append(tensor.numel() * tensor.element_size())
        return _orig(tensor, *args, **kwargs)
    dist.all_reduce = all_reduce
    return seen


def _build() -> tuple[torch.nn.Module, Any]:
    from ampkit.bench.workloads import GPT, GPTConfig
    from ampkit.fp8 import Float8Config, convert_to_fp8

    cfg = GPTConfig()
    torch.manual_seed(0)  # the same weights on every rank and in every run
    return convert_to_fp8(GPT(cfg), recipe=Float8Config("tensorwise", emulate=True)), cfg


def _rank(rank: int, nproc: int, port: int, args: argparse.Namespace, out: str) -> None:
    from ampkit.distributed import shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nproc)
    seen = _count_collectives()
    rows = []
    try:
        for policy in args.policies.split(","):
            for fp8_all_gather in (False, True):
                model, cfg = _build()
                shard(model, policy, fp8_all_gather=fp8_all_gather)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                gen = torch.Generator().manual_seed(1 + rank)
                losses = []
                seen["gather"].clear()
                seen["all_reduce"].clear()
                for _ in range(args.steps):
                    tokens = torch.randint(cfg.vocab, (args.batch, cfg.seq), generator=gen)
                    with torch.autocast("cpu", torch.bfloat16, enabled=policy != "32-true"):
                        logits = model(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(
                        logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(loss.item())
                rows.append({"policy": policy, "fp8_all_gather": fp8_all_gather,
                             "gather_bytes_per_step": sum(seen["gather"]) / args.steps,
                             "gathers_per_step": len(seen["gather"]) / args.steps,
                             "all_reduces_per_step": len(seen["all_reduce"]) / args.steps,
                             "losses": losses})
                del model, optimizer
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as dst:
            json.dump(rows, dst)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--policies", default="bf16-mixed,32-true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        mp.spawn(_rank, args=(args.nproc, port, args, out), nprocs=args.nproc)
        with open(out) as src:
            rows = json.load(src)
    print("| policy | fp8 all-gather | gather MB / step / rank | × without | all-reduces / step "
          "| max relative Δloss |")
    print("|---|---|---|---|---|---|")
    base: dict[str, Any] = {}
    for row in rows:
        if not row["fp8_all_gather"]:
            base[row["policy"]] = row
        ref = base[row["policy"]]
        ratio = row["gather_bytes_per_step"] / ref["gather_bytes_per_step"]
        dev = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], ref["losses"]))
        row["ratio"], row["loss_dev"] = ratio, dev
        print(f"| {row['policy']} | {'on' if row['fp8_all_gather'] else 'off'} | "
              f"{row['gather_bytes_per_step'] / 1e6:.3f} | {ratio:.3f} | "
              f"{row['all_reduces_per_step']:.0f} | "
              f"{(f'{dev:.1e}' if dev else '0 (bitwise)') if row['fp8_all_gather'] else '–'} |")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "nproc": args.nproc, "steps": args.steps, "model": "bench GPT, CPU size",
            "device": "cpu (gloo)", "rows": rows}
    if args.json:
        with open(args.json, "w") as dst:
            json.dump(meta, dst, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
