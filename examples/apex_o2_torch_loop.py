"""Tutorial (c): O2 (half model, fp32 master weights) in torch.amp's training loop.

``amp.initialize(..., opt_level="O2")`` casts the model to half (batch-norm stays fp32)
and gives the optimizer fp32 master weights; the loop is then the torch.amp one:
``autocast`` for forward, ``GradScaler`` for backward and step. The scaler unscales the
gradients into the masters, and ``optimizer.step()`` updates the masters and copies them
back into the half model. Runs a linear model, a small CNN with batch-norm, and the
tutorial's ResNet-18 when torchvision is installed. Each line ends with the steps the
scaler skipped: with fp16 the first few overflow at the initial scale of 2**16 (the
scaler halves it each time) before the loss falls.

ResNet-18 gets images of at least 32x32: smaller ones reach its last stage as 1x1 maps,
where torch's CPU bf16 convolution backward has given NaN weight gradients at random
(every step then skips, whatever the loss scale).

    PYTHONPATH=src python examples/apex_o2_torch_loop.py --steps 50
"""

import argparse

import torch
from torch import nn

import ampkit as amp


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def build(name: str, size: int, classes: int) -> nn.Module:
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, classes))
    if name == "cnn":
        return small_cnn(classes)
    import torchvision  # only for "resnet18"

    return torchvision.models.resnet18(num_classes=classes)


def train(name: str, args: argparse.Namespace, device: str) -> None:
    torch.manual_seed(0)
    size = max(args.image_size, 32) if name == "resnet18" else args.image_size
    model = build(name, size, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    scaler = amp.GradScaler()

    images = torch.randn(args.batch, 3, size, size, device=device)
    labels = torch.arange(args.batch, device=device) % 10
    for step in range(args.steps):
        optimizer.zero_grad()
        with amp.autocast():
            loss = nn.functional.cross_entropy(model(images), labels)
        if step == 0:
            first = loss.item()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    param = next(model.parameters())
    master = next(amp.master_params(optimizer))
    stats = scaler.stats()
    print(f"{name}: loss {first:.4f} -> {loss.item():.4f} after {args.steps} steps "
          f"(params {param.dtype}, masters {master.dtype}, loss {loss.dtype}); "
          f"{stats.skipped_steps} skipped for inf/NaN gradients, loss scale {stats.scale:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--models", default="linear,cnn,resnet18")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device  # where the tutorial said .cuda()
    for name in args.models.split(","):
        try:
            train(name, args, device)
        except ImportError as err:  # torchvision is optional
            print(f"{name}: skipped ({err})")


if __name__ == "__main__":
    main()
