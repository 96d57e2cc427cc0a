"""Buffer tables: modules without parameters whose floating buffers a half cast changes, and
the warning when a policy casts them.

A rotary embedding holds its frequencies (``inv_freq``) in a buffer and multiplies them by
the token position: in bf16 a frequency keeps 8 significant bits, so at position 4096 the
phase is off by radians and the model's sense of position is lost (a Llama-style rotary
embedding of head size 128: up to 5 rad at position 4096 in bf16, 1 rad in fp16;
``benchmarks/rope_phase.py``). apex's O2, like ``model.to(torch.bfloat16)``, cast such
buffers with the rest of the model, and so does ampkit: keeping them fp32 unasked would
break a model whose other modules read the buffer directly (fp32 meeting half
activations). It warns instead, naming the modules and the ``keep_fp32`` patterns that
keep them fp32 (their forward then runs in fp32 and hands half outputs on). A table is a
module with no parameters (in it or below it) holding a floating buffer of its own that
the cast changes; batch-norm layers without affine parameters follow the batch-norm rule.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ._select import patterns_selecting
from ._torch_compat import BatchNormBase
from ._warn import warn_once


def warn_buffer_tables(model: nn.Module, kept: Iterable[str], half: torch.dtype) -> None:
    """Warn where a policy casting ``model`` to ``half`` changes the buffers of a buffer
    table outside the ``kept`` modules; the warning gives the ``keep_fp32`` patterns."""
    tables = buffer_tables(model, kept, half)
    if not tables:
        return
    patterns = patterns_selecting(model, tables)
    buffers = [f"{name}.{b}".lstrip(".") for name in tables
               for b, t in model.get_submodule(name).named_buffers(recurse=False)
               if _changed_by_cast(t, half)]
    warn_once(("buffer-tables", type(model).__name__, half, tuple(tables)),
              f"ampkit: this policy casts the floating buffers of {len(tables)} module(s) "
              f"without parameters to {half}, which changes their values ({buffers[0]!r}, "
              f"...): a rotary embedding's frequencies, multiplied by the token position, "
              f"then put its phase off by radians at long positions; to keep them fp32 (their "
              f"forward runs in fp32 and hands {half} outputs on), pass keep_fp32="
              f"{patterns!r} to ampkit.initialize (or call ampkit.keep_fp32(model, "
              f"{patterns!r}) first), unless other modules read those buffers directly")


def buffer_tables(model: nn.Module, kept: Iterable[str], half: torch.dtype) -> list[str]:
    """The buffer tables of ``model`` outside the ``kept`` modules whose buffers a cast to
    ``half`` would change, in model order."""
    inside = {id(m) for name in kept for m in model.get_submodule(name).modules()}
    tables = []
    for name, module in model.named_modules():
        if name and id(module) not in inside and _is_table(module, half):
            tables.append(name)
            inside.update(id(m) for m in module.modules())
    return tables


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
