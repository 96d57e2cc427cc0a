"""Buffer tables: modules without parameters whose floating buffers a half cast would change.

A rotary embedding holds its frequencies (``inv_freq``) in a buffer and multiplies them by
the token position: in bf16 a frequency keeps 8 significant bits, so at position 4096 the
phase is off by radians and the model's sense of position is lost (transformers' Llama,
head size 128: up to 5 rad of phase at position 4096 in bf16, 1 rad in fp16). apex's O2,
like ``model.to(torch.bfloat16)``, cast such buffers with the rest of the model. A policy
that casts the parameters to half keeps these modules in fp32 instead, as
:func:`ampkit.keep_fp32` keeps a module: their buffers stay fp32, their forward runs in
fp32, their floating outputs go back to the half dtype around them (so the layers after
them see what they saw before). A table is a module with no parameters (in it or below it)
holding a floating buffer of its own that the cast changes; its compute is small (positions times
frequencies, a sinusoid added to the activations), and batch-norm layers without affine
parameters are left to the batch-norm rule.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ._torch_compat import BatchNormBase


def with_buffer_tables(model: nn.Module, names: Iterable[str], half: torch.dtype) -> list[str]:
    """``names`` (module names kept in fp32) and the buffer tables of ``model`` outside
    them that a cast to ``half`` would change, in model order."""
    kept = set(names)
    inside = {id(m) for name in kept for m in model.get_submodule(name).modules()}
    for name, module in model.named_modules():
        if name and id(module) not in inside and _is_table(module, half):
            kept.add(name)
            inside.update(id(m) for m in module.modules())
    return [name for name, _ in model.named_modules() if name in kept]


def _is_table(module: nn.Module, half: torch.dtype) -> bool:
    if isinstance(module, BatchNormBase) or any(True for _ in module.parameters()):
        return False
    # Its own buffers: a container of tables (a ModuleList) has no forward to run in fp32.
    return any(_changed_by_cast(buffer, half) for buffer in module.buffers(recurse=False))


@torch.no_grad()
def _changed_by_cast(buffer: torch.Tensor, half: torch.dtype) -> bool:
    if (not buffer.is_floating_point() or buffer.dtype == half or buffer.is_meta
            or buffer.numel() == 0):
        return False
    back = buffer.to(half).to(buffer.dtype)
    # NaN never equals itself; it survives the cast, so it is not a change.
    return bool(((back != buffer) & ~(buffer.isnan())).any())
