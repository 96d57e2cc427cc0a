"""``ampkit info``: versions, the device, what it runs natively, the recommended policy."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .. import __version__
from .._dtypes import autocast_default_dtype, capability, fp8_supported, recommend_policy
from ..fp8.attention import kernels_unavailable
from ._common import check_device


def add_parser(sub: Any) -> None:
    """Register ``info`` on the subcommand parsers."""
    info = sub.add_parser("info", help="versions, device, native half/fp8 support, "
                          "recommended policy", description="Print ampkit's and torch's "
                          "versions, the device, which half dtypes and fp8 it runs natively "
                          "(fp8 attention's kernels included), and the policy ampkit "
                          "recommends there, with the reason.")
    info.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when available)")
    info.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print versions, the device, what it runs natively and the recommended policy."""
    device = check_device(args.device)
    cap = capability(device)
    policy, reason = recommend_policy(device)
    fp8 = fp8_supported(device)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
    print(f"ampkit {__version__}")
    print(f"torch {torch.__version__} ({build})")
    print(f"device: {cap.device} ({cap.name})")
    print(f"native bf16: {_yes(cap.bf16)}   native fp16: {_yes(cap.fp16)}   "
          f"fp8 matmuls: {'yes' if fp8 else 'no (ampkit emulates them here: same numerics, slower)'}")
    why = kernels_unavailable(torch.device(device))
    print(f"fp8 attention: {'Triton kernels' if why is None else f'emulated: {why}'}")
    print(f"autocast default dtype here: {str(autocast_default_dtype(torch.device(device).type))[6:]}")
    print(f"recommended policy: {policy} ({reason})")
    return 0


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


