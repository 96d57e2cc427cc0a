"""Tutorial (b): apex.amp's O1 loop, with ``import ampkit as amp`` in place of apex.

``amp.initialize`` runs the model's forward under autocast (outputs come back fp32);
``amp.scale_loss`` scales the loss with a dynamic loss scale and unscales the gradients
on exit; after an overflow the next ``optimizer.step()`` is skipped.

    PYTHONPATH=src python examples/apex_o1.py --steps 100
"""

import argparse

import torch

import ampkit as amp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device  # where the tutorial said .cuda()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

    inputs = torch.randn(args.batch, 32, device=device)
    labels = inputs[:, :4].argmax(dim=1)  # a learnable labelling
    for step in range(args.steps):
        output = model(inputs)
        loss = torch.nn.functional.cross_entropy(output, labels)
        if step == 0:
            print(f"output dtype {output.dtype}, loss dtype {loss.dtype}")
            first = loss.item()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    print(f"loss {first:.4f} -> {loss.item():.4f} after {args.steps} steps, "
          f"loss scale {amp.state_dict()['loss_scaler0']['loss_scale']:g}")


if __name__ == "__main__":
    main()
