"""Tutorial (a): an MLP trained in the torch.amp style, with ampkit in torch.amp's place.

The loop is torch.amp's own: forward under ``autocast()``, ``GradScaler`` around
backward and step. Under autocast the linear layers run in half precision (fp16 on
CUDA, bf16 on CPU), so the model's output comes out half, while the loss (mse_loss is on
autocast's fp32 list) comes out fp32.

    PYTHONPATH=src python examples/mlp_autocast_gradscaler.py --steps 100
"""

import argparse

import torch

import ampkit as amp


def make_model(in_size: int, hidden: int, out_size: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(in_size, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, out_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device  # where the tutorial said .cuda()

    torch.manual_seed(0)
    net = make_model(10, 100, 10).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = amp.GradScaler(device)
    data = torch.randn(args.batch, 10, device=device)
    target = data.flip(1).tanh()  # a fixed, learnable mapping

    for step in range(args.steps):
        with amp.autocast(device):
            output = net(data)
            loss = torch.nn.functional.mse_loss(output, target)
        if step == 0:
            print(f"output dtype {output.dtype}, loss dtype {loss.dtype}")
            first = loss.item()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    print(f"loss {first:.4f} -> {loss.item():.4f} after {args.steps} steps, "
          f"scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
